package io.stator.flink.state;

import io.stator.flink.session.ArenaInputView;
import io.stator.flink.session.Opcode;
import io.stator.flink.session.RequestChannel;
import io.stator.flink.session.Status;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.base.ListSerializer;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.runtime.state.internal.InternalListState;
import org.apache.flink.util.FlinkRuntimeException;
import org.apache.flink.util.Preconditions;

import java.io.IOException;
import java.util.ArrayList;
import java.util.Collection;
import java.util.List;

/**
 * A list state: {@code add} is one {@code ListAppend} (statord chains the element, nothing is
 * read), {@code get} one {@code ListGet} whose elements ({@code u32 length (LE) | bytes} each)
 * are deserialized where statord wrote them.
 */
public final class StatorListState<K, N, V> extends AbstractStatorState<K, N, List<V>>
        implements InternalListState<K, N, V> {

    private TypeSerializer<V> elementSerializer;

    public StatorListState(
            StateContext<K> backend,
            int stateId,
            TypeSerializer<N> namespaceSerializer,
            TypeSerializer<List<V>> valueSerializer,
            List<V> defaultValue) {
        super(backend, stateId, namespaceSerializer, valueSerializer, defaultValue);
        this.elementSerializer = ((ListSerializer<V>) valueSerializer).getElementSerializer();
    }

    @Override
    public void update(TypeSerializer<N> ns, TypeSerializer<List<V>> value, List<V> defaultValue) {
        super.update(ns, value, defaultValue);
        this.elementSerializer = ((ListSerializer<V>) value).getElementSerializer();
    }

    @Override
    public Iterable<V> get() throws IOException {
        return getInternal();
    }

    @Override
    public List<V> getInternal() throws IOException {
        synchronized (ch) {
            if (read(Opcode.LIST_GET, null, null) == Status.NOT_FOUND) {
                return null;
            }
            ArenaInputView in = result();
            int pos = in.position();
            int end = pos + in.available();
            List<V> out = new ArrayList<>();
            while (pos < end) {
                in.set(pos, 4);
                int len = in.readIntLE();
                in.set(pos + 4, len);
                out.add(elementSerializer.deserialize(in));
                pos += 4 + len;
            }
            return out;
        }
    }

    @Override
    public void add(V value) throws IOException {
        synchronized (ch) {
            Preconditions.checkNotNull(value, "You cannot add null to a ListState.");
            append(value);
        }
    }

    private void append(V value) throws IOException {
        beginKeyed();
        int off = ch.mark();
        elementSerializer.serialize(value, ch.out);
        write(Opcode.LIST_APPEND, RequestChannel.NONE, 0, off, ch.mark() - off);
    }

    @Override
    public void addAll(List<V> values) throws IOException {
        synchronized (ch) {
            Preconditions.checkNotNull(values, "List of values to add cannot be null.");
            for (V v : values) {
                Preconditions.checkNotNull(v, "You cannot add null to a ListState.");
            }
            if (values.size() == 1) {
                append(values.get(0));
            } else if (!values.isEmpty()) {
                // One request for the whole list, not one per element.
                writeElements(Opcode.LIST_APPEND, Opcode.FLAG_ELEMENTS, values);
            }
        }
    }

    @Override
    public void update(List<V> values) throws IOException {
        updateInternal(values);
    }

    @Override
    public void updateInternal(List<V> values) throws IOException {
        synchronized (ch) {
            Preconditions.checkNotNull(values, "List of values to add cannot be null.");
            if (values.isEmpty()) {
                clear();
                return;
            }
            for (V v : values) {
                Preconditions.checkNotNull(v, "You cannot have a null element in a ListState.");
            }
            writeElements(Opcode.LIST_REPLACE, 0, values);
        }
    }

    /** Writes {@code op} with {@code values} as an encoded element list ({@code u32 len | bytes}). */
    private void writeElements(byte op, int flags, List<V> values) throws IOException {
        beginKeyed();
        int off = ch.mark();
        for (V v : values) {
            int lenAt = ch.mark();
            ch.out.writeInt(0);
            elementSerializer.serialize(v, ch.out);
            ch.patchIntLE(lenAt, ch.mark() - lenAt - 4);
        }
        write(op, flags, RequestChannel.NONE, 0, off, ch.mark() - off);
    }

    /** The current list as encoded elements, copied out (null if empty). */
    private DataOutputSerializer readEncoded(DataOutputSerializer into) throws IOException {
        if (read(Opcode.LIST_GET, null, null) == Status.NOT_FOUND) {
            return null;
        }
        ArenaInputView in = result();
        byte[] tmp = new byte[in.available()];
        in.readFully(tmp);
        into.write(tmp);
        return into;
    }

    @Override
    public void mergeNamespaces(N target, Collection<N> sources) {
        synchronized (ch) {
            if (sources == null || sources.isEmpty()) {
                return;
            }
            N previous = currentNamespace();
            try {
                DataOutputSerializer merged = new DataOutputSerializer(256);
                for (N source : sources) {
                    if (source == null) {
                        continue;
                    }
                    setCurrentNamespace(source);
                    if (readEncoded(merged) != null) {
                        writeKeyed(Opcode.CLEAR);
                    }
                }
                if (merged.length() == 0) {
                    return;
                }
                setCurrentNamespace(target);
                byte[] b = merged.getSharedBuffer();
                int pos = 0;
                while (pos < merged.length()) {
                    int len =
                            (b[pos] & 0xFF)
                                    | (b[pos + 1] & 0xFF) << 8
                                    | (b[pos + 2] & 0xFF) << 16
                                    | (b[pos + 3] & 0xFF) << 24;
                    beginKeyed();
                    int off = ch.mark();
                    ch.out.write(b, pos + 4, len);
                    write(Opcode.LIST_APPEND, RequestChannel.NONE, 0, off, len);
                    pos += 4 + len;
                }
            } catch (Exception e) {
                throw new FlinkRuntimeException("statord failed to merge list state " + stateId, e);
            } finally {
                setCurrentNamespace(previous);
            }
        }
    }

    /** Elements separated by one byte, as queryable state's list reader expects. */
    @Override
    protected byte[] serializedValue(TypeSerializer<List<V>> safeValueSerializer) throws Exception {
        DataOutputSerializer encoded = readEncoded(new DataOutputSerializer(128));
        if (encoded == null) {
            return null;
        }
        DataOutputSerializer out = new DataOutputSerializer(encoded.length());
        byte[] b = encoded.getSharedBuffer();
        int pos = 0;
        while (pos < encoded.length()) {
            int len =
                    (b[pos] & 0xFF) | (b[pos + 1] & 0xFF) << 8 | (b[pos + 2] & 0xFF) << 16 | (b[pos + 3] & 0xFF) << 24;
            if (pos > 0) {
                out.write(',');
            }
            out.write(b, pos + 4, len);
            pos += 4 + len;
        }
        return out.getCopyOfBuffer();
    }
}
