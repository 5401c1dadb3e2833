package io.stator.flink.bench;

import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.typeutils.base.LongSerializer;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;

import org.openjdk.jmh.annotations.Benchmark;
import org.openjdk.jmh.annotations.Measurement;
import org.openjdk.jmh.annotations.Setup;
import org.openjdk.jmh.infra.Blackhole;

import java.util.ArrayList;
import java.util.List;

/**
 * List state: each setup key starts with one element; add appends one, addAll and update take
 * a list of {@link #LIST_VALUES} elements, get reads a key's list and iterates it.
 */
public class ListStateBenchmark extends StateBenchmarkBase {

    static final int LIST_VALUES = 100;

    private ListState<Long> state;
    private List<Long> list;

    @Setup
    public void setUp() throws Exception {
        open();
        state =
                keyed.getPartitionedState(
                        VoidNamespace.INSTANCE,
                        VoidNamespaceSerializer.INSTANCE,
                        new ListStateDescriptor<>("list", LongSerializer.INSTANCE));
        for (long k = 0; k < setupKeyCount; k++) {
            keyed.setCurrentKey(k);
            state.add(k);
        }
        list = new ArrayList<>();
        for (int i = 0; i < LIST_VALUES; i++) {
            list.add(value(i));
        }
    }

    @Benchmark
    public void listAdd() throws Exception {
        int d = draw();
        keyed.setCurrentKey(setupKey(d));
        state.add(value(d));
    }

    /**
     * 20 iterations, not 5: a call writes 100 elements (1.2 KB), both stores spend most of it
     * flushing and compacting, and EmbeddedRocksDB's one-second iterations range from 2 to 177
     * ops/ms in one trial (benches/RESULTS.md): five of them do not estimate its mean.
     */
    @Benchmark
    @Measurement(iterations = 20, time = 1)
    public void listAddAll() throws Exception {
        keyed.setCurrentKey(setupKey(draw()));
        state.addAll(list);
    }

    /** 20 iterations, as {@link #listAddAll()}. */
    @Benchmark
    @Measurement(iterations = 20, time = 1)
    public void listUpdate() throws Exception {
        keyed.setCurrentKey(setupKey(draw()));
        state.update(list);
    }

    @Benchmark
    public void listGet(Blackhole bh) throws Exception {
        keyed.setCurrentKey(setupKey(draw()));
        for (Long v : state.get()) {
            bh.consume(v);
        }
    }
}
