package io.stator.flink.bench;

import org.apache.flink.api.common.typeutils.base.LongSerializer;
import org.apache.flink.runtime.state.CheckpointableKeyedStateBackend;

import org.openjdk.jmh.annotations.BenchmarkMode;
import org.openjdk.jmh.annotations.Fork;
import org.openjdk.jmh.annotations.Measurement;
import org.openjdk.jmh.annotations.Mode;
import org.openjdk.jmh.annotations.OutputTimeUnit;
import org.openjdk.jmh.annotations.Param;
import org.openjdk.jmh.annotations.Scope;
import org.openjdk.jmh.annotations.State;
import org.openjdk.jmh.annotations.TearDown;
import org.openjdk.jmh.annotations.Warmup;

import java.util.SplittableRandom;
import java.util.concurrent.TimeUnit;

/**
 * What every state benchmark shares, after apache/flink-benchmarks' state benchmarks: one thread,
 * {@code setupKeyCount} keys (500 K) written before the trial, operations on keys drawn at random
 * from them (or from as many new keys), ops/ms and sampled latency, every backend in one run.
 * Keys and values are boxed before the trial, so what the gc profiler counts per operation is the
 * backend's own garbage.
 */
@State(Scope.Thread)
@BenchmarkMode({Mode.Throughput, Mode.SampleTime})
@OutputTimeUnit(TimeUnit.MILLISECONDS)
@Fork(value = 1, jvmArgsAppend = {"-Xms4g", "-Xmx4g"})
@Warmup(iterations = 3, time = 1)
@Measurement(iterations = 5, time = 1)
public abstract class StateBenchmarkBase {

    /** Random draws per array: a power of two, so an index wraps with a mask. */
    private static final int DRAWS = 1 << 20;

    @Param({"hashmap", "rocksdb", "stator"})
    public String backend;

    @Param({"500000"})
    public int setupKeyCount;

    protected Backends backends;
    protected CheckpointableKeyedStateBackend<Long> keyed;

    private Long[] setupKeys;
    private Long[] newKeys;
    private Long[] values;
    private int[] small;
    private int next;

    /** Opens the backend and draws the keys and values; subclasses then write their state. */
    protected void open() throws Exception {
        backends = Backends.open(backend, LongSerializer.INSTANCE);
        keyed = backends.backend();
        SplittableRandom r = new SplittableRandom(42);
        setupKeys = new Long[DRAWS];
        newKeys = new Long[DRAWS];
        values = new Long[DRAWS];
        small = new int[DRAWS];
        for (int i = 0; i < DRAWS; i++) {
            setupKeys[i] = (long) r.nextInt(setupKeyCount);
            newKeys[i] = (long) (setupKeyCount + r.nextInt(setupKeyCount));
            values[i] = r.nextLong();
            small[i] = r.nextInt(1 << 16);
        }
    }

    @TearDown
    public void close() throws Exception {
        if (backends != null) {
            backends.close();
        }
    }

    /** Advances to the next draw. */
    protected final int draw() {
        return next = (next + 1) & (DRAWS - 1);
    }

    protected final Long setupKey(int d) {
        return setupKeys[d];
    }

    protected final Long newKey(int d) {
        return newKeys[d];
    }

    protected final Long value(int d) {
        return values[d];
    }

    /** A small random int (0..65535) for this draw, e.g. a map key modulo its count. */
    protected final int small(int d) {
        return small[d];
    }
}
