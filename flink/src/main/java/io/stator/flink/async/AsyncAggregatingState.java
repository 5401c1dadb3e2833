package io.stator.flink.async;

import org.apache.flink.api.common.functions.AggregateFunction;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.asyncprocessing.StateRequestHandler;
import org.apache.flink.runtime.state.v2.AbstractAggregatingState;

/**
 * Flink's v2 aggregating state (read the accumulator, add, write), its requests executed by {@link
 * StatorStateExecutor}.
 */
public final class AsyncAggregatingState<K, N, IN, ACC, OUT> extends AbstractAggregatingState<K, N, IN, ACC, OUT>
        implements StateCodec.Coded {

    private final StateCodec codec;

    public AsyncAggregatingState(
            StateRequestHandler handler,
            AggregateFunction<IN, ACC, OUT> aggregate,
            TypeSerializer<ACC> serializer,
            StateCodec codec) {
        super(handler, aggregate, serializer);
        this.codec = codec;
    }

    @Override
    public StateCodec codec() {
        return codec;
    }
}
