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
 *   <li>{@code remote}: {@code disk}'s state on object storage 23 ms away, the local disk a cache
 *       as large as the memory budget: statord's remote tier on the tests' S3 server ({@code
 *       stator-bench s3-server}, every request held 23 ms), ForSt with its primary directory on
 *       {@link DelayedFileSystem} (a directory whose every round trip takes 23 ms) and its file
 *       cache of the same size. A checkpoint after the load makes every file durable remotely
 *       (statord then evicts its local copies down to the cache), so that the windows read
 *       what is not cached from the remote; the remote reads per record in the windows are
 *       printed. EmbeddedRocksDB keeps no state remotely and is not run.
 * </ul>
 *
 * <p>Per run: records/s per one-second window (median and slowest), state requests/s (three per
 * record: value get, value update, map put), the p99 of a record's state latency (from its first
 * request to its last callback, three requests chained), and checkpoint duration.
 *
 * <p>Usage: {@code AsyncJobBenchmark [--quick] [--json FILE] [--cases memory,disk,disk-pagecache,remote] [--backends
 * forst,rocksdb,stator] [--seconds S]}; needs {@code -Dstator.statord}.
 */
public final class AsyncJobBenchmark {

    /** Requests per record: count get, count update, map put. */
    static final int REQUESTS_PER_RECORD = 3;

    private AsyncJobBenchmark() {}

    /**
     * A case; {@code direct}: RocksDB and ForSt read with {@code O_DIRECT}, as statord does;
     * {@code remote}: the state on object storage, the local disk a cache of {@code budgetMib}.
     */
    record Case(String name, long keys, int budgetMib, boolean direct, boolean remote) {}

    /** Object storage's latency in the remote case, per request. */
    static final long REMOTE_DELAY_MS = 23;

    public static void main(String[] args) throws Exception {
        boolean quick = Arrays.asList(args).contains("--quick");
        int j = Arrays.asList(args).indexOf("--json");
        PrintStream json = j >= 0 ? new PrintStream(args[j + 1]) : null;
        List<String> names = option(args, "--cases").map(v -> List.of(v.split(","))).orElse(List.of("memory", "disk", "remote"));
        List<String> backends =
                option(args, "--backends").map(v -> List.of(v.split(","))).orElse(List.of("forst", "rocksdb", "stator"));
        int seconds = option(args, "--seconds").map(Integer::parseInt).orElse(quick ? 4 : 10);
        int checkpoints = quick ? 2 : 3;
        // About 150 bytes of state per key (the count, one map entry of 100 bytes, keys); the
        // disk case's state is about four times its 64 MiB budget.
        long diskKeys = quick ? 1_000_000 : 1_800_000;
        List<Case> cases = List.of(
                new Case("memory", quick ? 100_000 : 400_000, 1024, false, false),
                new Case("disk", diskKeys, 64, true, false),
                new Case("disk-pagecache", diskKeys, 64, false, false),
                new Case("remote", diskKeys, 64, false, true));
        System.out.printf(
                "%-14s %-8s %9s %12s %12s %12s %12s %10s %10s %12s%n",
                "case", "backend", "keys", "rec/s p50", "rec/s min", "req/s p50", "p99 lat", "ckpt p50", "ckpt max",
                "remote/rec");
        // DelayedFileSystem's round trip: the S3 server's delay.
        System.setProperty("stator.bench.delay-ms", Long.toString(REMOTE_DELAY_MS));
        Path dir = Files.createTempDirectory("stator-async-bench-");
        try {
            for (Case k : cases) {
                if (!names.contains(k.name())) {
                    continue;
                }
                Configuration cluster = new Configuration();
                cluster.set(TaskManagerOptions.MANAGED_MEMORY_SIZE, MemorySize.ofMebiBytes(k.budgetMib()));
                try (S3Server s3 = k.remote() ? new S3Server(dir.resolve("s3-" + k.name()), REMOTE_DELAY_MS) : null;
                        Statord statord = new Statord(dir.resolve("statord-" + k.name()))
                                .memoryBudgetMib(k.budgetMib())
                                .config(s3 == null ? null : s3.statordConfig(k.budgetMib(), 8192))
                                .start()) {
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
                            if (k.remote() && backend.equals("rocksdb")) {
                                System.out.printf("%-14s %-8s (keeps no state remotely: not run)%n", k.name(), backend);
                                continue;
                            }
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
                            if (k.remote()) {
                                c.set(
                                        ForStOptions.PRIMARY_DIRECTORY,
                                        DelayedFileSystem.SCHEME + "://" + dir.resolve("forst-primary-" + k.name()));
                                c.set(ForStOptions.CACHE_SIZE_BASE_LIMIT, MemorySize.ofMebiBytes(k.budgetMib()));
                            }
                            RemoteReads remote = k.remote() ? new RemoteReads(backend, statord) : null;
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
                                            checkpoints,
                                            remote == null ? JobBenchmark.Phases.NONE : remote);
                            long p99 = LATENCY.percentile(0.99);
                            System.out.printf(
                                    "%-14s %-8s %9d %12.0f %12.0f %12.0f %9.1f us %7d ms %7d ms %12s%n",
                                    k.name(), backend, k.keys(), r.rateP50(), r.rateMin(),
                                    r.rateP50() * REQUESTS_PER_RECORD, p99 / 1e3, r.ckptP50(), r.ckptMax(),
                                    remote == null ? "-" : String.format("%.3f", remote.perRecord()));
                            if (json != null) {
                                json.printf(
                                        "{\"suite\":\"flink-async-job\",\"case\":\"%s/%s/keys=%d\",\"ops_per_sec\":%.0f,"
                                                + "\"min_window_ops_per_sec\":%.0f,\"requests_per_sec\":%.0f,"
                                                + "\"p50_ns\":%d,\"p99_ns\":%d,\"p999_ns\":%d,"
                                                + "\"checkpoint_p50_ms\":%d,\"checkpoint_max_ms\":%d%s}%n",
                                        k.name(), backend, k.keys(), r.rateP50(), r.rateMin(),
                                        r.rateP50() * REQUESTS_PER_RECORD, LATENCY.percentile(0.5), p99,
                                        LATENCY.percentile(0.999), r.ckptP50(), r.ckptMax(),
                                        remote == null
                                                ? ""
                                                : String.format(",\"remote_reads_per_record\":%.4f", remote.perRecord()));
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

    /**
     * The remote case's phases: after the load, a checkpoint (every file durable remotely) and a
     * pause for statord's eviction (it trims its local cache twice a second); around the windows,
     * the remote reads: statord's ranged GETs, or {@link DelayedFileSystem}'s read round trips.
     */
    static final class RemoteReads implements JobBenchmark.Phases {
        private final String backend;
        private final Statord statord;
        private long reads;
        private long records;
        private double perRecord = Double.NaN;

        RemoteReads(String backend, Statord statord) {
            this.backend = backend;
            this.statord = statord;
        }

        private long count() throws Exception {
            if (backend.equals("forst")) {
                return DelayedFileSystem.READS.get();
            }
            long gets = 0;
            for (var shard : statord.status().path("shards")) {
                gets += shard.path("remote").path("gets").asLong();
            }
            return gets;
        }

        @Override
        public void loaded(MiniCluster mini, org.apache.flink.api.common.JobID job) throws Exception {
            mini.triggerCheckpoint(job).get();
            Thread.sleep(2000);
            reads = count();
            records = JobBenchmark.PROCESSED.get();
        }

        @Override
        public void measured() throws Exception {
            perRecord = (double) (count() - reads) / (JobBenchmark.PROCESSED.get() - records);
        }

        double perRecord() {
            return perRecord;
        }
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

    /**
     * A count (value state) and a 100-byte value under one of four user keys (map state). The
     * values are random bytes: a mostly-zero value would let RocksDB and ForSt (Snappy by default)
     * store the state in a fraction of the memory budget, and the state would not be larger than
     * memory for them.
     */
    static final class Aggregate extends KeyedProcessFunction<Long, Long, Long> {
        private static final int POOL_BYTES = 1 << 20;
        private transient ValueState<Long> count;
        private transient MapState<Integer, byte[]> payloads;
        private transient byte[] pool;
        private transient byte[] bytes;

        @Override
        public void open(OpenContext ctx) {
            count = getRuntimeContext().getState(new ValueStateDescriptor<>("count", Types.LONG));
            payloads = getRuntimeContext()
                    .getMapState(new MapStateDescriptor<>(
                            "payloads", Types.INT, PrimitiveArrayTypeInfo.BYTE_PRIMITIVE_ARRAY_TYPE_INFO));
            pool = new byte[POOL_BYTES];
            new java.util.Random(42).nextBytes(pool);
            bytes = new byte[100];
        }

        @Override
        public void processElement(Long key, Context ctx, Collector<Long> out) {
            long start = System.nanoTime();
            count.asyncValue()
                    .thenCompose(c -> {
                        long n = c == null ? 1 : c + 1;
                        // A different window of random bytes per update, no garbage.
                        System.arraycopy(pool, (int) ((key * 131 + n * 7919) & (POOL_BYTES - 128)), bytes, 0, 100);
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
