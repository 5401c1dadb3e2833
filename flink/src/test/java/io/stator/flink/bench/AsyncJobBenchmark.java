package io.stator.flink.bench;

import io.stator.flink.testutils.Statord;

import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.v2.MapState;
import org.apache.flink.api.common.state.v2.MapStateDescriptor;
import org.apache.flink.api.common.state.v2.ValueState;
import org.apache.flink.api.common.state.v2.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.PrimitiveArrayTypeInfo;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.MemorySize;
import org.apache.flink.configuration.TaskManagerOptions;
import org.apache.flink.runtime.minicluster.MiniCluster;
import org.apache.flink.runtime.minicluster.MiniClusterConfiguration;
import org.apache.flink.state.forst.ForStOptions;
import org.apache.flink.state.rocksdb.RocksDBOptions;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.legacy.DiscardingSink;
import org.apache.flink.util.Collector;
import org.apache.flink.util.FileUtils;

import java.io.PrintStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.Arrays;
import java.util.List;
import java.util.Optional;
import java.util.concurrent.atomic.AtomicLongArray;

/**
 * The asynchronous-state job figure (State V2, {@code enableAsyncState()}): one keyed job,
 * uniform keys, a value state (a count) and a map state (a 100-byte value under one of four user
 * keys) per key, on ForSt (Flink's disaggregated backend), EmbeddedRocksDB (through Flink's
 * adaptor of synchronous backends) and Stator's asynchronous backend, alternating, in one run:
 *
 * <ul>
 *   <li>{@code memory}: the state fits the memory budget;
 *   <li>{@code disk}: the state is about four times the memory budget (statord's {@code
 *       memory_budget}, RocksDB's and ForSt's managed memory: the same size), every backend
 *       reading its files with {@code O_DIRECT} ({@link DirectReads}), so that the budget bounds
 *       each one's memory;
 *   <li>{@code disk-pagecache} (not run by default, not judged): {@code disk} with RocksDB and
 *       ForSt reading through the kernel's page cache, which on this machine holds all of their
 *       state beyond the budget: the figure a host with spare memory and no memory limit sees.
 * </ul>
 *
 * <p>Per run: records/s per one-second window (median and slowest), state requests/s (three per
 * record: value get, value update, map put), the p99 of a record's state latency (from its first
 * request to its last callback, three requests chained), and checkpoint duration.
 *
 * <p>Usage: {@code AsyncJobBenchmark [--quick] [--json FILE] [--cases memory,disk,disk-pagecache] [--backends
 * forst,rocksdb,stator] [--seconds S]}; needs {@code -Dstator.statord}.
 */
public final class AsyncJobBenchmark {

    /** Requests per record: count get, count update, map put. */
    static final int REQUESTS_PER_RECORD = 3;

    private AsyncJobBenchmark() {}

    /** A case; {@code direct}: RocksDB and ForSt read with {@code O_DIRECT}, as statord does. */
    record Case(String name, long keys, int budgetMib, boolean direct) {}

    public static void main(String[] args) throws Exception {
        boolean quick = Arrays.asList(args).contains("--quick");
        int j = Arrays.asList(args).indexOf("--json");
        PrintStream json = j >= 0 ? new PrintStream(args[j + 1]) : null;
        List<String> names = option(args, "--cases").map(v -> List.of(v.split(","))).orElse(List.of("memory", "disk"));
        List<String> backends =
                option(args, "--backends").map(v -> List.of(v.split(","))).orElse(List.of("forst", "rocksdb", "stator"));
        int seconds = option(args, "--seconds").map(Integer::parseInt).orElse(quick ? 4 : 10);
        int checkpoints = quick ? 2 : 3;
        // About 150 bytes of state per key (the count, one map entry of 100 bytes, keys); the
        // disk case's state is about four times its 64 MiB budget.
        long diskKeys = quick ? 1_000_000 : 1_800_000;
        List<Case> cases = List.of(
                new Case("memory", quick ? 100_000 : 400_000, 1024, false),
                new Case("disk", diskKeys, 64, true),
                new Case("disk-pagecache", diskKeys, 64, false));
        System.out.printf(
                "%-14s %-8s %9s %12s %12s %12s %12s %10s %10s%n",
                "case", "backend", "keys", "rec/s p50", "rec/s min", "req/s p50", "p99 lat", "ckpt p50", "ckpt max");
        Path dir = Files.createTempDirectory("stator-async-bench-");
        try {
            for (Case k : cases) {
                if (!names.contains(k.name())) {
                    continue;
                }
                Configuration cluster = new Configuration();
                cluster.set(TaskManagerOptions.MANAGED_MEMORY_SIZE, MemorySize.ofMebiBytes(k.budgetMib()));
                try (Statord statord =
                        new Statord(dir.resolve("statord-" + k.name())).memoryBudgetMib(k.budgetMib()).start()) {
                    MiniCluster mini =
                            new MiniCluster(
                                    new MiniClusterConfiguration.Builder()
                                            .setConfiguration(cluster)
                                            .setNumTaskManagers(1)
                                            .setNumSlotsPerTaskManager(2)
                                            .build());
                    mini.start();
                    try {
                        for (String backend : backends) {
                            Configuration c =
                                    JobBenchmark.config(statord, dir, backend, "async-bench-" + k.name(), k.keys());
                            if (k.direct()) {
                                c.set(RocksDBOptions.OPTIONS_FACTORY, DirectReads.RocksDB.class.getName());
                                // ForSt's files by default live in the checkpoint directory and
                                // are read through Flink's file system (the page cache); on the
                                // TaskManager's local directory they are ForSt's own files.
                                c.set(ForStOptions.PRIMARY_DIRECTORY, "local-dir");
                                c.set(ForStOptions.OPTIONS_FACTORY, DirectReads.ForSt.class.getName());
                            }
                            LATENCY.reset();
                            JobBenchmark.Result r =
                                    JobBenchmark.measure(
                                            mini,
                                            c,
                                            k.name() + " " + backend,
                                            env -> env.addSource(new JobBenchmark.Records(k.keys()), "records")
                                                    .returns(Types.LONG)
                                                    .keyBy(v -> v, Types.LONG)
                                                    .enableAsyncState()
                                                    .process(new Aggregate())
                                                    .addSink(new DiscardingSink<>()),
                                            k.keys(),
                                            seconds,
                                            checkpoints);
                            long p99 = LATENCY.percentile(0.99);
                            System.out.printf(
                                    "%-14s %-8s %9d %12.0f %12.0f %12.0f %9.1f us %7d ms %7d ms%n",
                                    k.name(), backend, k.keys(), r.rateP50(), r.rateMin(),
                                    r.rateP50() * REQUESTS_PER_RECORD, p99 / 1e3, r.ckptP50(), r.ckptMax());
                            if (json != null) {
                                json.printf(
                                        "{\"suite\":\"flink-async-job\",\"case\":\"%s/%s/keys=%d\",\"ops_per_sec\":%.0f,"
                                                + "\"min_window_ops_per_sec\":%.0f,\"requests_per_sec\":%.0f,"
                                                + "\"p50_ns\":%d,\"p99_ns\":%d,\"p999_ns\":%d,"
                                                + "\"checkpoint_p50_ms\":%d,\"checkpoint_max_ms\":%d}%n",
                                        k.name(), backend, k.keys(), r.rateP50(), r.rateMin(),
                                        r.rateP50() * REQUESTS_PER_RECORD, LATENCY.percentile(0.5), p99,
                                        LATENCY.percentile(0.999), r.ckptP50(), r.ckptMax());
                            }
                        }
                    } finally {
                        mini.close();
                    }
                }
            }
        } finally {
            if (json != null) {
                json.close();
            }
            FileUtils.deleteDirectory(dir.toFile());
        }
        // ForSt leaves non-daemon threads running (and spinning) after its MiniCluster closed: the
        // JVM would linger and take CPU from whatever runs next.
        System.exit(0);
    }

    private static Optional<String> option(String[] args, String name) {
        int i = Arrays.asList(args).indexOf(name);
        return i >= 0 && i + 1 < args.length ? Optional.of(args[i + 1]) : Optional.empty();
    }

    /** Records' state latencies; static because MiniCluster runs the task in this JVM. */
    static final Histogram LATENCY = new Histogram();

    /**
     * A log-linear histogram of nanoseconds: 8 buckets per power of two (within 12.5%), written by
     * the task thread, read after the job.
     */
    static final class Histogram {
        private final AtomicLongArray counts = new AtomicLongArray(64 * 8);

        void record(long ns) {
            long v = Math.max(ns, 1);
            int exp = 63 - Long.numberOfLeadingZeros(v);
            int sub = exp >= 3 ? (int) ((v >>> (exp - 3)) & 7) : 0;
            counts.incrementAndGet(exp * 8 + sub);
        }

        void reset() {
            for (int i = 0; i < counts.length(); i++) {
                counts.set(i, 0);
            }
        }

        /** The upper bound of the bucket holding quantile {@code q}. */
        long percentile(double q) {
            long total = 0;
            for (int i = 0; i < counts.length(); i++) {
                total += counts.get(i);
            }
            long want = (long) Math.ceil(q * total);
            long seen = 0;
            for (int i = 0; i < counts.length(); i++) {
                seen += counts.get(i);
                if (seen >= want && total > 0) {
                    int exp = i / 8;
                    int sub = i % 8;
                    return exp >= 3 ? (8L + sub + 1) << (exp - 3) : 1L << (exp + 1);
                }
            }
            return 0;
        }
    }

    /** A count (value state) and a 100-byte value under one of four user keys (map state). */
    static final class Aggregate extends KeyedProcessFunction<Long, Long, Long> {
        private transient ValueState<Long> count;
        private transient MapState<Integer, byte[]> payloads;
        private transient byte[] bytes;

        @Override
        public void open(OpenContext ctx) {
            count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Types.LONG));
            payloads = getRuntimeContext()
                    .getMapState(new MapStateDescriptor<>(
                            "payloads", Types.INT, PrimitiveArrayTypeInfo.BYTE_PRIMITIVE_ARRAY_TYPE_INFO));
            bytes = new byte[100];
        }

        @Override
        public void processElement(Long key, Context ctx, Collector<Long> out) {
            long start = System.nanoTime();
            count.asyncValue()
                    .thenCompose(c -> {
                        long n = c == null ? 1 : c + 1;
                        bytes[(int) (n % 100)]++;
                        return count.asyncUpdate(n)
                                .thenCompose(x -> payloads.asyncPut((int) (n & 3), bytes))
                                .thenApply(x -> n);
                    })
                    .thenAccept(n -> {
                        LATENCY.record(System.nanoTime() - start);
                        JobBenchmark.PROCESSED.lazySet(JobBenchmark.PROCESSED.get() + 1);
                        if ((n & 1023) == 0) {
                            out.collect(n);
                        }
                    });
        }
    }
}
