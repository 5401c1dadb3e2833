package io.stator.flink.bench;

import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.typeutils.base.LongSerializer;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;

import org.openjdk.jmh.annotations.Benchmark;
import org.openjdk.jmh.annotations.Setup;
import org.openjdk.jmh.infra.Blackhole;

import java.util.Map;

/**
 * Map state: each setup key holds {@link #MAP_KEYS} entries; get, put and remove touch one
 * entry of a random key, contains asks for one of twice as many user keys (half miss), the
 * iterator reads a key's whole map.
 */
public class MapStateBenchmark extends StateBenchmarkBase {

    static final int MAP_KEYS = 10;

    private MapState<Long, Long> state;
    private final Long[] userKeys = new Long[2 * MAP_KEYS];

    @Setup
    public void setUp() throws Exception {
        open();
        state =
                keyed.getPartitionedState(
                        VoidNamespace.INSTANCE,
                        VoidNamespaceSerializer.INSTANCE,
                        new MapStateDescriptor<>("map", LongSerializer.INSTANCE, LongSerializer.INSTANCE));
        for (int i = 0; i < userKeys.length; i++) {
            userKeys[i] = (long) i;
        }
        for (long k = 0; k < setupKeyCount; k++) {
            keyed.setCurrentKey(k);
            for (int i = 0; i < MAP_KEYS; i++) {
                state.put(userKeys[i], k + i);
            }
        }
    }

    @Benchmark
    public Long mapGet() throws Exception {
        int d = draw();
        keyed.setCurrentKey(setupKey(d));
        return state.get(userKeys[small(d) % MAP_KEYS]);
    }

    @Benchmark
    public void mapPut() throws Exception {
        int d = draw();
        keyed.setCurrentKey(setupKey(d));
        state.put(userKeys[small(d) % MAP_KEYS], value(d));
    }

    @Benchmark
    public boolean mapContains() throws Exception {
        int d = draw();
        keyed.setCurrentKey(setupKey(d));
        return state.contains(userKeys[small(d) % (2 * MAP_KEYS)]);
    }

    @Benchmark
    public void mapRemove() throws Exception {
        int d = draw();
        keyed.setCurrentKey(setupKey(d));
        state.remove(userKeys[small(d) % MAP_KEYS]);
    }

    @Benchmark
    public void mapIterator(Blackhole bh) throws Exception {
        keyed.setCurrentKey(setupKey(draw()));
        for (Map.Entry<Long, Long> e : state.entries()) {
            bh.consume(e.getKey());
            bh.consume(e.getValue());
        }
    }
}
