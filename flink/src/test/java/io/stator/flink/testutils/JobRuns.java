package io.stator.flink.testutils;

import io.stator.flink.StatorAsyncKeyedStateBackend;
import io.stator.flink.StatorOptions;

import org.apache.flink.api.common.JobID;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.ExternalizedCheckpointRetention;
import org.apache.flink.configuration.PipelineOptions;
import org.apache.flink.configuration.RestartStrategyOptions;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.metrics.Gauge;
import org.apache.flink.metrics.Metric;
import org.apache.flink.metrics.MetricGroup;
import org.apache.flink.runtime.testutils.InMemoryReporter;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.Arrays;
import java.util.Comparator;
import java.util.List;
import java.util.Map;
import java.util.stream.Stream;

import static org.assertj.core.api.Assertions.assertThat;

/** What the MiniCluster job tests share: a job's configuration, and waits on its progress. */
public final class JobRuns {

    private JobRuns() {}

    /**
     * A job on {@code backend} (a factory name) against {@code statord}: checkpoints every 100 ms
     * under {@code dir/checkpoints/name}, retained on cancellation, restarts without end.
     */
    public static Configuration config(Path dir, String backend, Statord statord, String name) throws IOException {
        Configuration c = new Configuration();
        c.set(StateBackendOptions.STATE_BACKEND, backend);
        c.setString(StatorOptions.SOCKET.key(), statord.socket());
        c.setString(StatorOptions.ARENA_SIZE.key(), "8mb");
        c.set(CheckpointingOptions.CHECKPOINTING_INTERVAL, Duration.ofMillis(100));
        c.set(
                CheckpointingOptions.CHECKPOINTS_DIRECTORY,
                Files.createDirectories(dir.resolve("checkpoints").resolve(name)).toUri().toString());
        c.set(
                CheckpointingOptions.EXTERNALIZED_CHECKPOINT_RETENTION,
                ExternalizedCheckpointRetention.RETAIN_ON_CANCELLATION);
        c.set(RestartStrategyOptions.RESTART_STRATEGY, "fixed-delay");
        c.set(RestartStrategyOptions.RESTART_STRATEGY_FIXED_DELAY_ATTEMPTS, 200);
        c.set(RestartStrategyOptions.RESTART_STRATEGY_FIXED_DELAY_DELAY, Duration.ofMillis(100));
        c.set(PipelineOptions.MAX_PARALLELISM, 128);
        return c;
    }

    /** Waits until every record below {@code upTo} is processed. */
    public static void awaitProcessed(String run, long upTo) throws InterruptedException {
        long deadline = System.nanoTime() + Duration.ofMinutes(3).toNanos();
        while (!TestJob.processedUpTo(run, upTo)) {
            assertThat(System.nanoTime()).as("records below %d processed in time", upTo).isLessThan(deadline);
            Thread.sleep(20);
        }
    }

    /**
     * Waits for the second checkpoint of {@code job} completed after now (so it was triggered
     * after now: one checkpoint at a time) and returns its directory.
     */
    public static Path awaitCheckpoint(Path dir, String name, JobID job) throws Exception {
        Path jobDir = dir.resolve("checkpoints").resolve(name).resolve(job.toHexString());
        long since = System.currentTimeMillis();
        long deadline = System.nanoTime() + Duration.ofMinutes(2).toNanos();
        while (true) {
            List<Path> done;
            try (Stream<Path> s = Files.exists(jobDir) ? Files.list(jobDir) : Stream.empty()) {
                done =
                        s.filter(p -> p.getFileName().toString().startsWith("chk-"))
                                .filter(p -> Files.exists(p.resolve("_metadata")))
                                .filter(p -> p.resolve("_metadata").toFile().lastModified() > since)
                                .sorted(Comparator.comparingInt(p -> Integer.parseInt(p.getFileName().toString().substring(4))))
                                .toList();
            }
            if (done.size() >= 2) {
                return done.get(done.size() - 1);
            }
            assertThat(System.nanoTime()).as("a checkpoint completed in time").isLessThan(deadline);
            Thread.sleep(20);
        }
    }

    public static void cancel(JobClient c) throws Exception {
        c.cancel().get();
        try {
            c.getJobExecutionResult().get();
        } catch (Exception expected) {
            // cancelled
        }
    }


    /**
     * The most state requests Stator's asynchronous backend had in statord at once, over every
     * attempt of {@code run}'s keyed tasks (0: no such backend ran).
     */
    @SuppressWarnings("unchecked")
    public static long maxInFlight(InMemoryReporter reporter, String run) {
        long most = 0;
        for (Map.Entry<MetricGroup, Map<String, Metric>> g : reporter.getMetricsByGroup().entrySet()) {
            Metric m = g.getValue().get(StatorAsyncKeyedStateBackend.METRIC_MAX_IN_FLIGHT);
            if (m != null && Arrays.asList(g.getKey().getScopeComponents()).contains(run)) {
                most = Math.max(most, ((Gauge<Long>) m).getValue());
            }
        }
        return most;
    }
}
