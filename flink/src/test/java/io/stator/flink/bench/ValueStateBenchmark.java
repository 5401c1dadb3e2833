package io.stator.flink.bench;

import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeutils.base.LongSerializer;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;

import org.openjdk.jmh.annotations.Benchmark;
import org.openjdk.jmh.annotations.Setup;

/** Value state: update and get on the setup keys, add (update) on new keys. */
public class ValueStateBenchmark extends StateBenchmarkBase {

    private ValueState<Long> state;

    @Setup
    public void setUp() throws Exception {
        open();
        state =
                keyed.getPartitionedState(
                        VoidNamespace.INSTANCE,
                        VoidNamespaceSerializer.INSTANCE,
                        new ValueStateDescriptor<>("value", LongSerializer.INSTANCE));
        for (long k = 0; k < setupKeyCount; k++) {
            keyed.setCurrentKey(k);
            state.update(k);
        }
    }

    @Benchmark
    public void valueUpdate() throws Exception {
        int d = draw();
        keyed.setCurrentKey(setupKey(d));
        state.update(value(d));
    }

    @Benchmark
    public void valueAdd() throws Exception {
        int d = draw();
        keyed.setCurrentKey(newKey(d));
        state.update(value(d));
    }

    @Benchmark
    public Long valueGet() throws Exception {
        keyed.setCurrentKey(setupKey(draw()));
        return state.value();
    }
}
