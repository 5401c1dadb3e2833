package io.stator.flink.state;


import org.apache.flink.api.common.functions.ReduceFunction;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.state.internal.InternalReducingState;

import java.io.IOException;
import java.util.Collection;

/** A reducing state: a value state whose function runs here (read, reduce, write). */
public final class StatorReducingState<K, N, V> extends AbstractStatorState<K, N, V>
        implements InternalReducingState<K, N, V> {

    private ReduceFunction<V> reduceFunction;

    public StatorReducingState(
            StateContext<K> backend,
            int stateId,
            TypeSerializer<N> namespaceSerializer,
            TypeSerializer<V> valueSerializer,
            V defaultValue,
            ReduceFunction<V> reduceFunction) {
        super(backend, stateId, namespaceSerializer, valueSerializer, defaultValue);
        this.reduceFunction = reduceFunction;
    }

    public void setReduceFunction(ReduceFunction<V> reduceFunction) {
        this.reduceFunction = reduceFunction;
    }

    @Override
    public V get() throws IOException {
        synchronized (ch) {
            return readValue();
        }
    }

    @Override
    public void add(V value) throws Exception {
        synchronized (ch) {
            V current = readValue();
            writeValue(current == null ? value : reduceFunction.reduce(current, value));
        }
    }

    @Override
    public V getInternal() throws IOException {
        synchronized (ch) {
            return readValue();
        }
    }

    @Override
    public void updateInternal(V value) throws IOException {
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
        mergeValues(target, sources, reduceFunction::reduce);
    }
}
