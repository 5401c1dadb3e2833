package io.stator.flink.async;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.asyncprocessing.StateRequestHandler;
import org.apache.flink.runtime.state.v2.AbstractValueState;

/** Flink's v2 value state, its requests executed by {@link StatorStateExecutor}. */
public final class AsyncValueState<K, N, V> extends AbstractValueState<K, N, V> implements StateCodec.Coded {

    private final StateCodec codec;

    public AsyncValueState(StateRequestHandler handler, TypeSerializer<V> serializer, StateCodec codec) {
        super(handler, serializer);
        this.codec = codec;
    }

    @Override
    public StateCodec codec() {
        return codec;
    }
}
