package io.stator.flink;

import io.stator.flink.testutils.JobRuns;
import io.stator.flink.testutils.Statord;
import io.stator.flink.testutils.TestJob;

import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.StateRecoveryOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.runtime.testutils.InMemoryReporter;
import org.apache.flink.runtime.testutils.MiniClusterResourceConfiguration;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.sink.legacy.SinkFunction;
import org.apache.flink.table.api.Table;
import org.apache.flink.table.api.bridge.java.StreamTableEnvironment;
import org.apache.flink.table.api.config.ExecutionConfigOptions;
import org.apache.flink.test.junit5.MiniClusterExtension;
import org.apache.flink.types.Row;
import org.apache.flink.types.RowKind;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.junit.jupiter.api.io.TempDir;

import java.nio.file.Path;
import java.time.Duration;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;

import static org.apache.flink.table.api.Expressions.$;
import static org.assertj.core.api.Assertions.assertThat;

/**
 * A SQL {@code GROUP BY} aggregation with asynchronous state ({@code
 * table.exec.async-state.enabled}) on Stator's asynchronous backend against a real statord,
 * compared with the same query on Flink's HashMap backend and with a model of the stream: through
 * an injected failure, and rescaled 2 -> 3 -> 2 from retained checkpoints.
 */
class AsyncSqlITCase {

    private static final long RECORDS = 40_000;
    private static final String STATOR = StatorStateBackendFactory.class.getName();

    private static final InMemoryReporter REPORTER = InMemoryReporter.createWithRetainedMetrics();

    @RegisterExtension
    static final MiniClusterExtension MINI_CLUSTER =
            new MiniClusterExtension(
                    new MiniClusterResourceConfiguration.Builder()
                            .setConfiguration(REPORTER.addToConfiguration(new Configuration()))
                            .setNumberTaskManagers(1)
                            .setNumberSlotsPerTaskManager(4)
                            .build());

    @TempDir static Path dir;
    private static Statord statord;

    /** Per run: each key's latest aggregate row, as the changelog left it. */
    static final Map<String, Map<Integer, String>> LATEST = new ConcurrentHashMap<>();

    @BeforeAll
    static void start() throws Exception {
        statord = new Statord(dir.resolve("statord")).start();
        run(JobRuns.config(dir, "hashmap", statord, "sql-ref"), "sql-ref", -1, -1, 1).getJobExecutionResult().get();
    }

    @AfterAll
    static void stop() throws Exception {
        statord.close();
    }

    private static JobClient run(Configuration c, String run, long pauseAt, long failAt, int parallelism)
            throws Exception {
        LATEST.putIfAbsent(run, new ConcurrentHashMap<>());
        c.set(ExecutionConfigOptions.TABLE_EXEC_ASYNC_STATE_ENABLED, true);
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(c);
        env.setParallelism(parallelism);
        StreamTableEnvironment t = StreamTableEnvironment.create(env);
        DataStream<Long> numbers = TestJob.numbers(env, run, RECORDS, pauseAt, failAt);
        t.createTemporaryView("numbers", numbers, $("v"));
        Table sums = t.sqlQuery(
                "SELECT CAST(v % 100 AS INT) AS k, COUNT(*) AS c, SUM(v) AS s, MAX(v) AS m, "
                        + "MIN(v) AS d FROM numbers GROUP BY CAST(v % 100 AS INT)");
        t.toChangelogStream(sums).addSink(new Latest(run)).name("latest");
        return env.executeAsync(run);
    }

    /** Every key's aggregate over records {@code [0, upTo)}. */
    private static Map<Integer, String> model(long upTo) {
        Map<Integer, String> m = new HashMap<>();
        for (int k = 0; k < TestJob.KEYS; k++) {
            long count = 0;
            long sum = 0;
            long max = 0;
            for (long v = k; v < upTo; v += TestJob.KEYS) {
                count++;
                sum += v;
                max = v;
            }
            m.put(k, k + "|" + count + "|" + sum + "|" + max + "|" + k);
        }
        return m;
    }

    private static void awaitAggregated(String run, long upTo) throws InterruptedException {
        Map<Integer, String> want = model(upTo);
        long deadline = System.nanoTime() + Duration.ofMinutes(3).toNanos();
        while (!new HashMap<>(LATEST.get(run)).equals(want)) {
            assertThat(System.nanoTime()).as("records below %d aggregated in time", upTo).isLessThan(deadline);
            Thread.sleep(20);
        }
    }

    private static void assertExact(String run) {
        Map<Integer, String> want = model(RECORDS);
        assertThat(new HashMap<>(LATEST.get("sql-ref"))).isEqualTo(want);
        assertThat(new HashMap<>(LATEST.get(run))).isEqualTo(want);
        // The aggregation ran on Stator's asynchronous backend, not through Flink's adaptor.
        assertThat(JobRuns.maxInFlight(REPORTER, run)).isPositive();
    }

    @Test
    void aGroupByIsExactThroughAFailure() throws Exception {
        String run = "sql-failure";
        run(JobRuns.config(dir, STATOR, statord, run), run, -1, RECORDS / 2, 2).getJobExecutionResult().get();
        assertThat(TestJob.FAILED.get(run)).isTrue();
        assertExact(run);
    }

    @Test
    void aGroupByRescalesFromRetainedCheckpoints() throws Exception {
        String run = "sql-rescale";
        long first = RECORDS / 3;
        long second = 2 * RECORDS / 3;
        Configuration a = JobRuns.config(dir, STATOR, statord, run);
        a.setString(StatorOptions.JOB.key(), "sql-rescale-test");
        JobClient p2 = run(a, run, first, -1, 2);
        awaitAggregated(run, first);
        Path chk = JobRuns.awaitCheckpoint(dir, run, p2.getJobID());
        JobRuns.cancel(p2);
        Configuration b = JobRuns.config(dir, STATOR, statord, run);
        b.setString(StatorOptions.JOB.key(), "sql-rescale-test");
        b.set(StateRecoveryOptions.SAVEPOINT_PATH, chk.toUri().toString());
        JobClient p3 = run(b, run, second, -1, 3);
        awaitAggregated(run, second);
        Path chk2 = JobRuns.awaitCheckpoint(dir, run, p3.getJobID());
        JobRuns.cancel(p3);
        Configuration c = JobRuns.config(dir, STATOR, statord, run);
        c.set(StateRecoveryOptions.SAVEPOINT_PATH, chk2.toUri().toString());
        run(c, run, -1, -1, 2).getJobExecutionResult().get();
        assertExact(run);
    }

    /** Keeps each key's latest row: inserts and updates-after (the changelog's new values). */
    static final class Latest implements SinkFunction<Row> {
        private final String run;

        Latest(String run) {
            this.run = run;
        }

        @Override
        public void invoke(Row r, Context context) {
            if (r.getKind() == RowKind.INSERT || r.getKind() == RowKind.UPDATE_AFTER) {
                int k = (Integer) r.getField(0);
                LATEST.get(run).put(k, k + "|" + r.getField(1) + "|" + r.getField(2) + "|" + r.getField(3) + "|" + r.getField(4));
            }
        }
    }
}
