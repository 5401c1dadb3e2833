package io.stator.flink.state;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.runtime.state.internal.InternalValueState;

import java.io.IOException;

/** A value state: one {@code Get} or {@code Put} per access. */
public final class StatorValueState<K, N, V> extends AbstractStatorState<K, N, V>
        implements InternalValueState<K, N, V> {

    public StatorValueState(
            StateContext<K> backend,
            int stateId,
            TypeSerializer<N> namespaceSerializer,
            TypeSerializer<V> valueSerializer,
            V defaultValue) {
        super(backend, stateId, namespaceSerializer, valueSerializer, defaultValue);
    }

    @Override
    public V value() throws IOException {
        synchronized (ch) {
            V v = readValue();
            return v == null ? getDefaultValue() : v;
        }
    }

    @Override
    public void update(V value) throws IOException {
        synchronized (ch) {
            if (value == null) {
                clear();
                return;
            }
            writeValue(value);
        }
    }
}
