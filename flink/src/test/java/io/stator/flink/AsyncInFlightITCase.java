package io.stator.flink;

import io.stator.flink.testutils.JobRuns;
import io.stator.flink.testutils.Statord;

import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.state.v2.ValueState;
import org.apache.flink.api.common.state.v2.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.ExecutionOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.runtime.state.FunctionInitializationContext;
import org.apache.flink.runtime.state.FunctionSnapshotContext;
import org.apache.flink.runtime.testutils.InMemoryReporter;
import org.apache.flink.runtime.testutils.MiniClusterResourceConfiguration;
import org.apache.flink.streaming.api.checkpoint.CheckpointedFunction;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.legacy.SinkFunction;
import org.apache.flink.streaming.api.functions.source.legacy.RichSourceFunction;
import org.apache.flink.test.junit5.MiniClusterExtension;
import org.apache.flink.util.Collector;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.params.ParameterizedTest;
import org.junit.jupiter.params.provider.ValueSource;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.junit.jupiter.api.io.TempDir;

import java.nio.file.Path;
import java.time.Duration;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

import static org.assertj.core.api.Assertions.assertThat;

/**
 * One task with thousands of state requests in flight on Stator's asynchronous backend (Flink's
 * buffers set to 6,000 and to 60,000 records, one state request each at a time): per-key order
 * holds, checked against a model of the stream, and nothing is lost when statord is SIGKILLed
 * under the job and the job restarts from its last completed checkpoint. The most requests the
 * task had in statord's queues at once is read from the backend's metric and printed.
 */
class AsyncInFlightITCase {

    /** Keys, and records (each key sees RECORDS / KEYS of them, in increasing order). */
    private static final int KEYS = 100_000;
    private static final long RECORDS = 600_000;

    private static final InMemoryReporter REPORTER = InMemoryReporter.createWithRetainedMetrics();

    @RegisterExtension
    static final MiniClusterExtension MINI_CLUSTER =
            new MiniClusterExtension(
                    new MiniClusterResourceConfiguration.Builder()
                            .setConfiguration(REPORTER.addToConfiguration(new Configuration()))
                            .setNumberTaskManagers(1)
                            .setNumberSlotsPerTaskManager(2)
                            .build());

    @TempDir static Path dir;
    private static Statord statord;

    /** Per run: each key's latest record seen downstream, and every order violation found. */
    static final Map<String, Map<Integer, Long>> LATEST = new ConcurrentHashMap<>();
    static final Map<String, Set<String>> VIOLATIONS = new ConcurrentHashMap<>();
    /** Runs whose source may pass its pause. */
    static final Set<String> RELEASED = ConcurrentHashMap.newKeySet();

    @BeforeAll
    static void start() throws Exception {
        statord = new Statord(dir.resolve("statord")).start();
    }

    @AfterAll
    static void stop() throws Exception {
        statord.close();
    }

    @ParameterizedTest(name = "{0} in flight")
    @ValueSource(ints = {6_000, 60_000})
    void perKeyOrderHoldsAndNothingIsLostWhenStatordIsKilled(int inFlight) throws Exception {
        String run = "in-flight-" + inFlight;
        LATEST.put(run, new ConcurrentHashMap<>());
        VIOLATIONS.put(run, ConcurrentHashMap.newKeySet());
        try (Statord own = new Statord(dir.resolve("statord-" + inFlight)).start()) {
            Configuration c = JobRuns.config(dir, StatorStateBackendFactory.class.getName(), own, run);
            c.set(ExecutionOptions.ASYNC_STATE_TOTAL_BUFFER_SIZE, inFlight);
            c.set(ExecutionOptions.ASYNC_STATE_ACTIVE_BUFFER_SIZE, inFlight);
            c.set(ExecutionOptions.ASYNC_STATE_ACTIVE_BUFFER_TIMEOUT, 5L);
            c.set(StatorOptions.ASYNC_IN_FLIGHT, Integer.highestOneBit(inFlight) << 1);
            c.setString(StatorOptions.ARENA_SIZE.key(), "64mb");
            StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(c);
            env.addSource(new Records(run, RECORDS, RECORDS / 2), "records")
                    .returns(Types.LONG)
                    .setParallelism(1)
                    .keyBy(v -> (int) (v % KEYS), Types.INT)
                    .enableAsyncState()
                    .process(new OrderCheck(run))
                    .setParallelism(1)
                    .addSink(new Latest(run))
                    .setParallelism(1);
            JobClient job = env.executeAsync(run);
            long half = RECORDS / 2;
            long deadline = System.nanoTime() + Duration.ofMinutes(3).toNanos();
            while (LATEST.get(run).size() < KEYS || !seenUpTo(run, half)) {
                assertThat(System.nanoTime()).as("the first half processed in time").isLessThan(deadline);
                Thread.sleep(20);
            }
            JobRuns.awaitCheckpoint(dir, run, job.getJobID());
            long most = JobRuns.maxInFlight(REPORTER, run);
            own.kill();
            RELEASED.add(run);
            Thread.sleep(500);
            own.start();
            job.getJobExecutionResult().get();
            most = Math.max(most, JobRuns.maxInFlight(REPORTER, run));
            System.out.printf("%s: at most %d state requests in statord at once%n", run, most);
            // Flink's buffer went to statord whole: a batch of thousands of reads (and the writes
            // they lead to) at once, not one read at a time. (8,192 and 65,536 here: the channel's
            // capacity, as completions are reaped between batches.)
            assertThat(most).isGreaterThan(inFlight / 8);
        }
        assertThat(VIOLATIONS.get(run)).isEmpty();
        Map<Integer, Long> latest = LATEST.get(run);
        assertThat(latest).hasSize(KEYS);
        for (int k = 0; k < KEYS; k++) {
            assertThat(latest.get(k)).as("key %d's last record", k).isEqualTo(RECORDS - KEYS + k);
        }
    }

    private static boolean seenUpTo(String run, long upTo) {
        Map<Integer, Long> m = LATEST.get(run);
        for (int k = 0; k < KEYS; k++) {
            Long v = m.get(k);
            if (v == null || v < upTo - KEYS) {
                return false;
            }
        }
        return true;
    }

    /** Records {@code [0, end)} from a checkpointed offset; waits at {@code pauseAt} until released. */
    static final class Records extends RichSourceFunction<Long> implements CheckpointedFunction {
        private final String run;
        private final long end;
        private final long pauseAt;
        private volatile boolean running = true;
        private long next;
        private transient ListState<Long> offset;

        Records(String run, long end, long pauseAt) {
            this.run = run;
            this.end = end;
            this.pauseAt = pauseAt;
        }

        @Override
        public void run(SourceContext<Long> ctx) throws Exception {
            while (running && next < end) {
                if (next == pauseAt && !RELEASED.contains(run)) {
                    Thread.sleep(5);
                    continue;
                }
                synchronized (ctx.getCheckpointLock()) {
                    ctx.collect(next++);
                }
            }
        }

        @Override
        public void cancel() {
            running = false;
        }

        @Override
        public void snapshotState(FunctionSnapshotContext context) throws Exception {
            offset.update(java.util.List.of(next));
        }

        @Override
        public void initializeState(FunctionInitializationContext context) throws Exception {
            offset = context.getOperatorStateStore().getListState(new ListStateDescriptor<>("offset", Types.LONG));
            for (Long o : offset.get()) {
                next = o;
            }
        }
    }

    /**
     * The model: key {@code k}'s records are {@code k, k + KEYS, k + 2 KEYS, ...} in order, so the
     * state a record reads is the record before it of its key (none for the first).
     */
    static final class OrderCheck extends KeyedProcessFunction<Integer, Long, Long> {
        private final String run;
        private transient ValueState<Long> last;

        OrderCheck(String run) {
            this.run = run;
        }

        @Override
        public void open(OpenContext openContext) {
            last = getRuntimeContext().getState(new ValueStateDescriptor<>("last", Types.LONG));
        }

        @Override
        public void processElement(Long v, Context ctx, Collector<Long> out) {
            last.asyncValue()
                    .thenCompose(prev -> {
                        Long expected = v >= KEYS ? v - KEYS : null;
                        if (!java.util.Objects.equals(prev, expected)) {
                            VIOLATIONS.get(run).add("record " + v + " read " + prev + ", not " + expected);
                        }
                        return last.asyncUpdate(v);
                    })
                    .thenAccept(x -> out.collect(v));
        }
    }

    static final class Latest implements SinkFunction<Long> {
        private final String run;

        Latest(String run) {
            this.run = run;
        }

        @Override
        public void invoke(Long v, Context context) {
            LATEST.get(run).merge((int) (v % KEYS), v, Math::max);
        }
    }
}
