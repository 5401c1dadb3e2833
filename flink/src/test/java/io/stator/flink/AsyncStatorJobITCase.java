package io.stator.flink;

import io.stator.flink.testutils.AsyncTestJob;
import io.stator.flink.testutils.JobRuns;
import io.stator.flink.testutils.Statord;
import io.stator.flink.testutils.TestJob;

import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.StateRecoveryOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.runtime.testutils.MiniClusterResourceConfiguration;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.test.junit5.MiniClusterExtension;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.extension.RegisterExtension;
import org.junit.jupiter.api.io.TempDir;

import java.nio.file.Path;
import java.util.HashMap;

import static org.assertj.core.api.Assertions.assertThat;

/**
 * Real Flink jobs (MiniCluster) with asynchronous state (State V2, {@code enableAsyncState()}) on
 * Stator's asynchronous backend against a real statord, each compared with the same job on
 * Flink's HashMap backend: every v2 state kind through an injected failure, a rescale 2 -> 3 -> 2
 * from retained checkpoints, the same rescale alternating with Stator's synchronous backend, and
 * statord killed under the running job.
 */
class AsyncStatorJobITCase {

    private static final long RECORDS = 40_000;
    private static final String STATOR = StatorStateBackendFactory.class.getName();

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
        // The reference: the same job on the HashMap backend (Flink runs it through its adaptor
        // of synchronous backends), no failure, parallelism 1.
        run(JobRuns.config(dir, "hashmap", statord, "async-ref"), "async-ref", -1, -1, 1)
                .getJobExecutionResult()
                .get();
    }

    @AfterAll
    static void stop() throws Exception {
        statord.close();
    }

    private static JobClient run(Configuration c, String run, long pauseAt, long failAt, int parallelism)
            throws Exception {
        return run(c, run, pauseAt, failAt, parallelism, true);
    }

    /** The job on the asynchronous state API, or with {@code async} false on the synchronous one. */
    private static JobClient run(
            Configuration c, String run, long pauseAt, long failAt, int parallelism, boolean async)
            throws Exception {
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(c);
        AsyncTestJob.build(env, run, RECORDS, pauseAt, failAt, parallelism, async);
        return env.executeAsync(run);
    }

    private static void assertLikeReference(String run) {
        assertThat(TestJob.processedUpTo("async-ref", RECORDS)).isTrue();
        assertThat(new HashMap<>(TestJob.LATEST.get(run))).isEqualTo(new HashMap<>(TestJob.LATEST.get("async-ref")));
    }

    @Test
    void everyV2StateKindIsExactlyOnceThroughAFailure() throws Exception {
        String run = "async-failure";
        run(JobRuns.config(dir, STATOR, statord, run), run, -1, RECORDS / 2, 2).getJobExecutionResult().get();
        assertThat(TestJob.FAILED.get(run)).isTrue();
        assertLikeReference(run);
    }

    @Test
    void rescalesFromRetainedCheckpoints() throws Exception {
        rescale2To3To2("async-rescale", true, true);
    }

    /**
     * One job's state moves between Stator's two backends through their checkpoints: the
     * synchronous operator at parallelism 2, restored by the asynchronous one at 3, restored by
     * the synchronous one at 2 again; the same handles serve both, rescaled each time.
     */
    @Test
    void restoresBetweenTheSynchronousAndAsynchronousBackends() throws Exception {
        rescale2To3To2("async-cross", false, true);
    }

    /**
     * Runs the job at parallelism 2 (on the asynchronous state API if {@code async2}, else the
     * synchronous one) to a third of its records, restores it at 3 ({@code async3}) from that
     * retained checkpoint to two thirds, then at 2 again ({@code async2}, and another statord
     * tenant) to the end, and compares with the reference.
     */
    private static void rescale2To3To2(String run, boolean async2, boolean async3) throws Exception {
        long first = RECORDS / 3;
        long second = 2 * RECORDS / 3;
        Configuration a = JobRuns.config(dir, STATOR, statord, run);
        a.setString(StatorOptions.JOB.key(), run + "-test");
        JobClient p2 = run(a, run, first, -1, 2, async2);
        JobRuns.awaitProcessed(run, first);
        Path chk = JobRuns.awaitCheckpoint(dir, run, p2.getJobID());
        JobRuns.cancel(p2);
        Configuration b = JobRuns.config(dir, STATOR, statord, run);
        b.setString(StatorOptions.JOB.key(), run + "-test");
        b.set(StateRecoveryOptions.SAVEPOINT_PATH, chk.toUri().toString());
        JobClient p3 = run(b, run, second, -1, 3, async3);
        JobRuns.awaitProcessed(run, second);
        Path chk2 = JobRuns.awaitCheckpoint(dir, run, p3.getJobID());
        JobRuns.cancel(p3);
        Configuration c = JobRuns.config(dir, STATOR, statord, run);
        c.set(StateRecoveryOptions.SAVEPOINT_PATH, chk2.toUri().toString());
        run(c, run, -1, -1, 2, async2).getJobExecutionResult().get();
        assertLikeReference(run);
    }

    @Test
    void statordKilledUnderARunningJobLosesNothing() throws Exception {
        String run = "async-killed";
        try (Statord own = new Statord(dir.resolve("statord-killed")).start()) {
            JobClient job = run(JobRuns.config(dir, STATOR, own, run), run, RECORDS / 2, -1, 2);
            JobRuns.awaitProcessed(run, RECORDS / 2);
            JobRuns.awaitCheckpoint(dir, run, job.getJobID());
            // The completion threads see the session die and fail every request in flight; the
            // job restarts from its last completed checkpoint once statord is back.
            own.kill();
            TestJob.RELEASED.add(run);
            Thread.sleep(1000);
            own.start();
            job.getJobExecutionResult().get();
        }
        assertLikeReference(run);
    }
}
