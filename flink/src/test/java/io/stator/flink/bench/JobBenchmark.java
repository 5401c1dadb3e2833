package io.stator.flink.bench;

import io.stator.flink.StatorOptions;
import io.stator.flink.StatorStateBackendFactory;
import io.stator.flink.testutils.Statord;

import org.apache.flink.api.common.JobID;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.api.common.typeutils.base.array.BytePrimitiveArraySerializer;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.MemorySize;
import org.apache.flink.configuration.PipelineOptions;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.configuration.TaskManagerOptions;
import org.apache.flink.runtime.checkpoint.AbstractCheckpointStats;
import org.apache.flink.runtime.checkpoint.SubtaskStateStats;
import org.apache.flink.runtime.checkpoint.TaskStateStats;
import org.apache.flink.runtime.executiongraph.AccessExecutionGraph;
import org.apache.flink.runtime.minicluster.MiniCluster;
import org.apache.flink.runtime.minicluster.MiniClusterConfiguration;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.legacy.DiscardingSink;
import org.apache.flink.streaming.api.functions.source.legacy.SourceFunction;
import org.apache.flink.util.Collector;
import org.apache.flink.util.FileUtils;

import java.io.PrintStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Optional;
import java.util.SplittableRandom;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicLong;

/**
 * The job-level figure: one keyed aggregation (a running count and the last 100-byte payload per
 * key, uniform keys) on a MiniCluster, per backend, at two state sizes. For each run: records/s
 * per one-second window after every key is written (median and slowest window), then
 * checkpoints triggered one at a time (end-to-end duration from Flink's checkpoint statistics,
 * median and max, and the backend's own part of it: the slowest subtask's synchronous plus
 * asynchronous phase; and the checkpointed size). Backends alternate within a state size.
 *
 * <p>Usage: {@code JobBenchmark [--quick] [--json FILE] [--keys N,M] [--backends a,b] [--seconds S]
 * [--windows]} (defaults: 200 K and 2 M keys, every backend, 10 s; {@code --windows} prints each second's
 * rate in order); needs {@code -Dstator.statord}.
 */
public final class JobBenchmark {

    static final AtomicLong PROCESSED = new AtomicLong();

    private JobBenchmark() {}

    public static void main(String[] args) throws Exception {
        boolean quick = Arrays.asList(args).contains("--quick");
        int j = Arrays.asList(args).indexOf("--json");
        PrintStream json = j >= 0 ? new PrintStream(args[j + 1]) : null;
        long[] sizes =
                option(args, "--keys")
                        .map(v -> Arrays.stream(v.split(",")).mapToLong(Long::parseLong).toArray())
                        .orElse(quick ? new long[] {100_000, 400_000} : new long[] {200_000, 2_000_000});
        List<String> backends =
                option(args, "--backends").map(v -> List.of(v.split(","))).orElse(List.of("hashmap", "rocksdb", "stator"));
        int seconds = option(args, "--seconds").map(Integer::parseInt).orElse(quick ? 4 : 10);
        WINDOWS.set(Arrays.asList(args).contains("--windows"));
        int checkpoints = quick ? 3 : 5;
        Path dir = Files.createTempDirectory("stator-job-bench-");
        try (Statord statord = new Statord(dir.resolve("statord")).memoryBudgetMib(4096).start()) {
            Configuration cluster = new Configuration();
            cluster.set(TaskManagerOptions.MANAGED_MEMORY_SIZE, MemorySize.parse("512m"));
            MiniCluster mini =
                    new MiniCluster(
                            new MiniClusterConfiguration.Builder()
                                    .setConfiguration(cluster)
                                    .setNumTaskManagers(1)
                                    .setNumSlotsPerTaskManager(2)
                                    .build());
            mini.start();
            try {
                System.out.printf(
                        "%-8s %-9s %12s %12s %10s %10s %10s %10s %12s%n",
                        "keys", "backend", "rec/s p50", "rec/s min", "ckpt p50", "ckpt max", "snap p50", "snap max",
                        "ckpt size");
                for (long keys : sizes) {
                    for (String backend : backends) {
                        Result r = run(mini, statord, dir, backend, keys, seconds, checkpoints);
                        System.out.printf(
                                "%-8d %-9s %12.0f %12.0f %7d ms %7d ms %7d ms %7d ms %9.1f MB%n",
                                keys, backend, r.rateP50, r.rateMin, r.ckptP50, r.ckptMax, r.snapP50, r.snapMax,
                                r.ckptBytes / 1e6);
                        if (json != null) {
                            json.printf(
                                    "{\"suite\":\"flink-job\",\"case\":\"%s/keys=%d\",\"ops_per_sec\":%.0f,"
                                            + "\"min_window_ops_per_sec\":%.0f,\"checkpoint_p50_ms\":%d,"
                                            + "\"checkpoint_max_ms\":%d,\"snapshot_p50_ms\":%d,\"snapshot_max_ms\":%d,"
                                            + "\"checkpoint_bytes\":%d}%n",
                                    backend, keys, r.rateP50, r.rateMin, r.ckptP50, r.ckptMax, r.snapP50, r.snapMax,
                                    r.ckptBytes);
                        }
                    }
                }
            } finally {
                mini.close();
            }
        } finally {
            if (json != null) {
                json.close();
            }
            FileUtils.deleteDirectory(dir.toFile());
        }
    }

    private static final AtomicBoolean WINDOWS =
            new AtomicBoolean();

    /** The value after {@code name} in {@code args}, if given. */
    private static Optional<String> option(String[] args, String name) {
        int i = Arrays.asList(args).indexOf(name);
        return i >= 0 && i + 1 < args.length ? Optional.of(args[i + 1]) : Optional.empty();
    }

    record Result(
            double rateP50, double rateMin, long ckptP50, long ckptMax, long snapP50, long snapMax, long ckptBytes) {}

    private static Result run(
            MiniCluster mini, Statord statord, Path dir, String backend, long keys, int seconds, int checkpoints)
            throws Exception {
        Configuration c = config(statord, dir, backend, "job-bench-" + keys, keys);
        return measure(mini, c, backend + " " + keys + " keys", env -> env.addSource(new Records(keys), "records")
                .returns(Types.LONG)
                .keyBy(v -> v, Types.LONG)
                .process(new Aggregate())
                .addSink(new DiscardingSink<>()), keys, seconds, checkpoints, Phases.NONE);
    }

    /**
     * A job's configuration on {@code backend} ({@code hashmap}, {@code rocksdb}, {@code forst}
     * or {@code stator}): checkpoints only when the benchmark triggers them.
     */
    static Configuration config(Statord statord, Path dir, String backend, String job, long keys) throws Exception {
        Configuration c = new Configuration();
        c.set(
                StateBackendOptions.STATE_BACKEND,
                backend.equals("stator") ? StatorStateBackendFactory.class.getName() : backend);
        c.setString(StatorOptions.SOCKET.key(), statord.socket());
        c.setString(StatorOptions.JOB.key(), job);
        c.set(CheckpointingOptions.CHECKPOINTING_INTERVAL, Duration.ofHours(1));
        c.set(
                CheckpointingOptions.CHECKPOINTS_DIRECTORY,
                Files.createDirectories(dir.resolve("checkpoints").resolve(backend + keys)).toUri().toString());
        c.set(PipelineOptions.MAX_PARALLELISM, 128);
        return c;
    }

    /** What a benchmark does between {@link #measure}'s phases; nothing by default. */
    interface Phases {
        /** Phases that do nothing. */
        Phases NONE = new Phases() {};

        /** Every key was written; the windows start when this returns. */
        default void loaded(MiniCluster mini, JobID job) throws Exception {}

        /** The windows ended; the checkpoints start when this returns. */
        default void measured() throws Exception {}
    }

    /**
     * Runs the job {@code build} makes (parallelism 1) until {@link #PROCESSED} passed {@code
     * keys}, then measures records/s in one-second windows for {@code seconds}, then takes {@code
     * checkpoints} checkpoints one at a time; {@code phases} runs between those steps.
     */
    static Result measure(
            MiniCluster mini,
            Configuration c,
            String label,
            java.util.function.Consumer<StreamExecutionEnvironment> build,
            long keys,
            int seconds,
            int checkpoints,
            Phases phases)
            throws Exception {
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(c);
        env.setParallelism(1);
        build.accept(env);
        PROCESSED.set(0);
        JobID job = mini.submitJob(env.getStreamGraph().getJobGraph()).get().getJobID();
        try {
            // Every key written once (the records go through the keys in order first).
            while (PROCESSED.get() < keys) {
                Thread.sleep(10);
            }
            phases.loaded(mini, job);
            // Checkpoints a phase took before the windows are not the measured ones.
            long measuredFrom = System.currentTimeMillis();
            double[] rates = new double[seconds];
            long last = PROCESSED.get();
            long at = System.nanoTime();
            for (int s = 0; s < seconds; s++) {
                Thread.sleep(1000);
                long now = System.nanoTime();
                long p = PROCESSED.get();
                rates[s] = (p - last) * 1e9 / (now - at);
                last = p;
                at = now;
            }
            if (WINDOWS.get()) {
                System.out.println(label + ", records/s per second: " + Arrays.toString(rates));
            }
            phases.measured();
            Arrays.sort(rates);
            for (int i = 0; i < checkpoints; i++) {
                mini.triggerCheckpoint(job).get();
            }
            AccessExecutionGraph g = mini.getExecutionGraph(job).get();
            List<Long> durations = new ArrayList<>();
            List<Long> snapshots = new ArrayList<>();
            long bytes = 0;
            for (AbstractCheckpointStats s : g.getCheckpointStatsSnapshot().getHistory().getCheckpoints()) {
                if (s.getTriggerTimestamp() < measuredFrom) {
                    continue;
                }
                durations.add(s.getEndToEndDuration());
                bytes = Math.max(bytes, s.getStateSize());
                // The backend's own part: the slowest subtask's synchronous + asynchronous phase
                // (end to end also counts the barrier's wait behind buffered records).
                long snapshot = 0;
                for (TaskStateStats t : s.getAllTaskStateStats()) {
                    for (SubtaskStateStats st : t.getSubtaskStats()) {
                        if (st != null) {
                            snapshot = Math.max(snapshot, st.getSyncCheckpointDuration() + st.getAsyncCheckpointDuration());
                        }
                    }
                }
                snapshots.add(snapshot);
            }
            durations.sort(null);
            snapshots.sort(null);
            return new Result(
                    rates[seconds / 2],
                    rates[0],
                    durations.get(durations.size() / 2),
                    durations.get(durations.size() - 1),
                    snapshots.get(snapshots.size() / 2),
                    snapshots.get(snapshots.size() - 1),
                    bytes);
        } finally {
            mini.cancelJob(job).get();
            while (!mini.getJobStatus(job).get().isGloballyTerminalState()) {
                Thread.sleep(10);
            }
        }
    }

    /** Keys 0..keys-1 in order, then uniform at random; unbounded. */
    static final class Records implements SourceFunction<Long> {
        private final long keys;
        private volatile boolean running = true;

        Records(long keys) {
            this.keys = keys;
        }

        @Override
        public void run(SourceContext<Long> ctx) {
            SplittableRandom r = new SplittableRandom(7);
            long i = 0;
            while (running) {
                long k = i < keys ? i : r.nextLong(keys);
                synchronized (ctx.getCheckpointLock()) {
                    ctx.collect(k);
                }
                i++;
            }
        }

        @Override
        public void cancel() {
            running = false;
        }
    }

    /** A count and the latest 100-byte payload per key. */
    static final class Aggregate extends KeyedProcessFunction<Long, Long, Long> {
        private transient ValueState<Long> count;
        private transient ValueState<byte[]> payload;
        private transient byte[] bytes;

        @Override
        public void open(OpenContext ctx) {
            count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Types.LONG));
            payload =
                    getRuntimeContext()
                            .getState(new ValueStateDescriptor<>("payload", BytePrimitiveArraySerializer.INSTANCE));
            bytes = new byte[100];
        }

        @Override
        public void processElement(Long key, Context ctx, Collector<Long> out) throws Exception {
            Long c = count.value();
            long n = c == null ? 1 : c + 1;
            count.update(n);
            bytes[(int) (n % 100)]++;
            payload.update(bytes);
            PROCESSED.lazySet(PROCESSED.get() + 1);
            if ((n & 1023) == 0) {
                out.collect(n);
            }
        }
    }
}
