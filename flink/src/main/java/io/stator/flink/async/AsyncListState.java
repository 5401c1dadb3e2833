package io.stator.flink.async;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.asyncprocessing.StateRequestHandler;
import org.apache.flink.runtime.state.v2.AbstractListState;

/** Flink's v2 list state, its requests executed by {@link StatorStateExecutor}. */
public final class AsyncListState<K, N, V> extends AbstractListState<K, N, V> implements StateCodec.Coded {

    private final StateCodec codec;

    public AsyncListState(StateRequestHandler handler, TypeSerializer<V> serializer, StateCodec codec) {
        super(handler, serializer);
        this.codec = codec;
    }

    @Override
    public StateCodec codec() {
        return codec;
    }
}
