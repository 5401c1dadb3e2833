package io.stator.flink.async;

import org.apache.flink.api.common.functions.ReduceFunction;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.asyncprocessing.StateRequestHandler;
import org.apache.flink.runtime.state.v2.AbstractReducingState;

/** Flink's v2 reducing state (read, reduce, write), its requests executed by {@link StatorStateExecutor}. */
public final class AsyncReducingState<K, N, V> extends AbstractReducingState<K, N, V>
        implements StateCodec.Coded {

    private final StateCodec codec;

    public AsyncReducingState(
            StateRequestHandler handler, ReduceFunction<V> reduce, TypeSerializer<V> serializer, StateCodec codec) {
        super(handler, reduce, serializer);
        this.codec = codec;
    }

    @Override
    public StateCodec codec() {
        return codec;
    }
}
