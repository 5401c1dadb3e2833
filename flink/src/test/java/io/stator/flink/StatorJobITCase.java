package io.stator.flink;

import io.stator.flink.testutils.JobRuns;
import io.stator.flink.testutils.Statord;
import io.stator.flink.testutils.TestJob;

import org.apache.flink.api.common.JobID;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.ExternalizedCheckpointRetention;
import org.apache.flink.configuration.PipelineOptions;
import org.apache.flink.configuration.RestartStrategyOptions;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.configuration.StateRecoveryOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.core.execution.SavepointFormatType;
import org.apache.flink.runtime.testutils.MiniClusterResourceConfiguration;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.test.junit5.MiniClusterExtension;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.junit.jupiter.api.io.TempDir;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Comparator;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.stream.Stream;

import static org.assertj.core.api.Assertions.assertThat;

/**
 * Real Flink jobs (MiniCluster) on Stator against a real statord, each compared with the same
 * job on Flink's HashMap backend: every state kind and a session-window aggregation through an
 * injected failure; rescales 2 -> 3 -> 2 from retained checkpoints (through their _metadata);
 * savepoint migration HashMap -> Stator -> RocksDB; a native savepoint outliving later
 * checkpoints; and statord killed under a running job.
 */
class StatorJobITCase {

    private static final long RECORDS = 40_000;

    @RegisterExtension
    static final MiniClusterExtension MINI_CLUSTER =
            new MiniClusterExtension(
                    new MiniClusterResourceConfiguration.Builder()
                            .setNumberTaskManagers(1)
                            .setNumberSlotsPerTaskManager(4)
                            .build());

    @TempDir static Path dir;
    private static Statord statord;

    @BeforeAll
    static void start() throws Exception {
        statord = new Statord(dir.resolve("statord")).start();
        // The reference: the same job on the HashMap backend, no failure, parallelism 1.
        run(config("hashmap", statord, "ref"), "ref", -1, -1, 1).getJobExecutionResult().get();
    }

    @AfterAll
    static void stop() throws Exception {
        statord.close();
    }

    private static Configuration config(String backend, Statord statord, String name) throws IOException {
        return JobRuns.config(dir, backend, statord, name);
    }

    private static final String STATOR = StatorStateBackendFactory.class.getName();

    private static JobClient run(Configuration c, String run, long pauseAt, long failAt, int parallelism)
            throws Exception {
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(c);
        TestJob.build(env, run, RECORDS, pauseAt, failAt, parallelism);
        return env.executeAsync(run);
    }

    private static void assertLikeReference(String run) {
        assertThat(new HashMap<>(TestJob.LATEST.get(run))).isEqualTo(new HashMap<>(TestJob.LATEST.get("ref")));
        assertThat(new HashSet<>(TestJob.WINDOWS.get(run))).isEqualTo(new HashSet<>(TestJob.WINDOWS.get("ref")));
    }

    private static void awaitProcessed(String run, long upTo) throws InterruptedException {
        JobRuns.awaitProcessed(run, upTo);
    }

    private static Path awaitCheckpoint(String name, JobID job) throws Exception {
        return JobRuns.awaitCheckpoint(dir, name, job);
    }

    private static void cancel(JobClient c) throws Exception {
        JobRuns.cancel(c);
    }

    @Test
    void everyStateKindIsExactlyOnceThroughAFailure() throws Exception {
        run(config(STATOR, statord, "failure"), "failure", -1, RECORDS / 2, 2).getJobExecutionResult().get();
        assertThat(TestJob.FAILED.get("failure")).isTrue();
        assertLikeReference("failure");
    }

    @Test
    void rescalesFromRetainedCheckpoints() throws Exception {
        String run = "rescale";
        long first = RECORDS / 3;
        long second = 2 * RECORDS / 3;
        // Two phases under one statord job name: the restore references statord's segments.
        Configuration a = config(STATOR, statord, run);
        a.setString(StatorOptions.JOB.key(), "rescale-test");
        JobClient p2 = run(a, run, first, -1, 2);
        awaitProcessed(run, first);
        Path chk = awaitCheckpoint(run, p2.getJobID());
        cancel(p2);
        Configuration b = config(STATOR, statord, run);
        b.setString(StatorOptions.JOB.key(), "rescale-test");
        b.set(StateRecoveryOptions.SAVEPOINT_PATH, chk.toUri().toString());
        JobClient p3 = run(b, run, second, -1, 3);
        awaitProcessed(run, second);
        Path chk2 = awaitCheckpoint(run, p3.getJobID());
        cancel(p3);
        // The third phase under the default name (its job id): the state is copied in.
        Configuration c = config(STATOR, statord, run);
        c.set(StateRecoveryOptions.SAVEPOINT_PATH, chk2.toUri().toString());
        run(c, run, -1, -1, 2).getJobExecutionResult().get();
        assertLikeReference(run);
    }

    /**
     * A cancelled job whose checkpoints are not retained leaves none in statord: Flink's
     * JobManager discards them once the job is cancelled, and the discard of each subtask's
     * handle releases its statord checkpoint (no task is left to notify it). While the job runs,
     * the checkpoints Flink subsumes go too.
     */
    @Test
    void aCancelledJobsCheckpointsAreReleasedInStatord() throws Exception {
        String run = "discard";
        String job = "discard-test";
        Configuration c = config(STATOR, statord, run);
        c.setString(StatorOptions.JOB.key(), job);
        c.set(
                CheckpointingOptions.EXTERNALIZED_CHECKPOINT_RETENTION,
                ExternalizedCheckpointRetention.DELETE_ON_CANCELLATION);
        JobClient j = run(c, run, RECORDS / 2, -1, 2);
        try {
            awaitProcessed(run, RECORDS / 2);
            awaitCheckpoint(run, j.getJobID());
            // (Each keyed operator's subtasks: Flink's retained checkpoint, and the next ones
            // in flight or not yet subsumed.)
            assertThat(statord.checkpointsOf(job)).isPositive();
        } finally {
            // Even when an assertion failed: a job left running holds the cluster's slots.
            cancel(j);
        }
        statord.awaitCheckpointsOf(job, 0);
    }

    @Test
    void aSavepointMovesAJobFromHashMapToStatorToRocksDB() throws Exception {
        String run = "migrate";
        long first = RECORDS / 3;
        long second = 2 * RECORDS / 3;
        JobClient h = run(config("hashmap", statord, run), run, first, -1, 2);
        awaitProcessed(run, first);
        String sp1 = h.triggerSavepoint(dir.resolve("savepoints").toUri().toString(), SavepointFormatType.CANONICAL).get();
        cancel(h);
        Configuration s = config(STATOR, statord, run);
        s.set(StateRecoveryOptions.SAVEPOINT_PATH, sp1);
        JobClient st = run(s, run, second, -1, 3);
        awaitProcessed(run, second);
        String sp2 = st.triggerSavepoint(dir.resolve("savepoints").toUri().toString(), SavepointFormatType.CANONICAL).get();
        cancel(st);
        Configuration r = config("rocksdb", statord, run);
        r.set(StateRecoveryOptions.SAVEPOINT_PATH, sp2);
        run(r, run, -1, -1, 2).getJobExecutionResult().get();
        assertLikeReference(run);
    }

    /**
     * A native-format savepoint is taken (Flink failed the job over when the backend refused the
     * format) and stays restorable after later checkpoints complete and its job is cancelled
     * (Flink never notifies a savepoint's completion: a statord checkpoint kept for it would be
     * deleted by the next completed checkpoint).
     */
    @Test
    void aNativeSavepointOutlivesLaterCheckpointsAndItsJob() throws Exception {
        String run = "native-savepoint";
        Configuration a = config(STATOR, statord, run);
        a.setString(StatorOptions.JOB.key(), "native-savepoint-test");
        JobClient j = run(a, run, RECORDS / 2, -1, 2);
        awaitProcessed(run, RECORDS / 2);
        String sp = j.triggerSavepoint(dir.resolve("savepoints").toUri().toString(), SavepointFormatType.NATIVE).get();
        awaitCheckpoint(run, j.getJobID());
        cancel(j);
        Configuration b = config(STATOR, statord, run);
        b.setString(StatorOptions.JOB.key(), "native-savepoint-test");
        b.set(StateRecoveryOptions.SAVEPOINT_PATH, sp);
        b.set(RestartStrategyOptions.RESTART_STRATEGY, "none");
        run(b, run, -1, -1, 3).getJobExecutionResult().get();
        assertLikeReference(run);
    }

    @Test
    void statordKilledUnderARunningJobLosesNothing() throws Exception {
        String run = "killed";
        try (Statord own = new Statord(dir.resolve("statord-killed")).start()) {
            JobClient job = run(config(STATOR, own, run), run, RECORDS / 2, -1, 2);
            awaitProcessed(run, RECORDS / 2);
            awaitCheckpoint(run, job.getJobID());
            // statord dies with the job's state (and whatever checkpoint was in flight); the
            // tasks fail, and restart from the last completed checkpoint once it is back.
            own.kill();
            TestJob.RELEASED.add(run);
            Thread.sleep(1000);
            own.start();
            job.getJobExecutionResult().get();
        }
        assertLikeReference(run);
    }
}
