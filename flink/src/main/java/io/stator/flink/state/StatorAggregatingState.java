package io.stator.flink.state;


import org.apache.flink.api.common.functions.AggregateFunction;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.state.internal.InternalAggregatingState;

import java.io.IOException;
import java.util.Collection;

/**
 * An aggregating state: the accumulator is the stored value; the function runs here (read,
 * add, write).
 */
public final class StatorAggregatingState<K, N, IN, ACC, OUT> extends AbstractStatorState<K, N, ACC>
        implements InternalAggregatingState<K, N, IN, ACC, OUT> {

    private AggregateFunction<IN, ACC, OUT> aggFunction;

    public StatorAggregatingState(
            StateContext<K> backend,
            int stateId,
            TypeSerializer<N> namespaceSerializer,
            TypeSerializer<ACC> accSerializer,
            ACC defaultValue,
            AggregateFunction<IN, ACC, OUT> aggFunction) {
        super(backend, stateId, namespaceSerializer, accSerializer, defaultValue);
        this.aggFunction = aggFunction;
    }

    public void setAggregateFunction(AggregateFunction<IN, ACC, OUT> aggFunction) {
        this.aggFunction = aggFunction;
    }

    @Override
    public OUT get() throws IOException {
        synchronized (ch) {
            ACC acc = readValue();
            return acc == null ? null : aggFunction.getResult(acc);
        }
    }

    @Override
    public void add(IN value) throws IOException {
        synchronized (ch) {
            ACC acc = readValue();
            if (acc == null) {
                acc = aggFunction.createAccumulator();
            }
            writeValue(aggFunction.add(value, acc));
        }
    }

    @Override
    public ACC getInternal() throws IOException {
        synchronized (ch) {
            return readValue();
        }
    }

    @Override
    public void updateInternal(ACC value) throws IOException {
        synchronized (ch) {
            if (value == null) {
                clear();
            } else {
                writeValue(value);
            }
        }
    }

    @Override
    public void mergeNamespaces(N target, Collection<N> sources) throws Exception {
        mergeValues(target, sources, aggFunction::merge);
    }
}
