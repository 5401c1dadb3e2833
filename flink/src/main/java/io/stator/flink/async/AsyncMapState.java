package io.stator.flink.async;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.asyncprocessing.StateRequestHandler;
import org.apache.flink.runtime.state.v2.AbstractMapState;

/** Flink's v2 map state, its requests executed by {@link StatorStateExecutor}. */
public final class AsyncMapState<K, N, UK, V> extends AbstractMapState<K, N, UK, V>
        implements StateCodec.Coded {

    private final StateCodec codec;

    public AsyncMapState(StateRequestHandler handler, TypeSerializer<V> serializer, StateCodec codec) {
        super(handler, serializer);
        this.codec = codec;
    }

    @Override
    public StateCodec codec() {
        return codec;
    }
}
