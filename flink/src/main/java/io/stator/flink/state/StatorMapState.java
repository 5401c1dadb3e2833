package io.stator.flink.state;

import io.stator.flink.session.ArenaInputView;
import io.stator.flink.session.Opcode;
import io.stator.flink.session.RequestChannel;
import io.stator.flink.session.Status;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.base.MapSerializer;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.queryablestate.client.state.serialization.KvStateSerializer;
import org.apache.flink.runtime.state.internal.InternalMapState;
import org.apache.flink.util.FlinkRuntimeException;

import java.io.IOException;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.NoSuchElementException;
import java.util.Objects;

/**
 * A map state: each entry is its own statord record under the map's key and namespace, so a
 * get, put or remove touches one entry; iteration reads pages of entries in user-key order
 * ({@code MapIter}), resuming after the last key a page examined. Values are stored with a
 * null flag first, as Flink's RocksDB backend stores them.
 */
public final class StatorMapState<K, N, UK, UV> extends AbstractStatorState<K, N, Map<UK, UV>>
        implements InternalMapState<K, N, UK, UV> {

    private TypeSerializer<UK> userKeySerializer;
    private TypeSerializer<UV> userValueSerializer;

    /** Bytes asked for per iteration page. */
    private static final int PAGE_BYTES = 32 << 10;

    public StatorMapState(
            StateContext<K> backend,
            int stateId,
            TypeSerializer<N> namespaceSerializer,
            TypeSerializer<Map<UK, UV>> valueSerializer,
            Map<UK, UV> defaultValue) {
        super(backend, stateId, namespaceSerializer, valueSerializer, defaultValue);
        setSerializers(valueSerializer);
    }

    @Override
    public void update(TypeSerializer<N> ns, TypeSerializer<Map<UK, UV>> value, Map<UK, UV> defaultValue) {
        super.update(ns, value, defaultValue);
        setSerializers(value);
    }

    private void setSerializers(TypeSerializer<Map<UK, UV>> valueSerializer) {
        MapSerializer<UK, UV> m = (MapSerializer<UK, UV>) valueSerializer;
        this.userKeySerializer = m.getKeySerializer();
        this.userValueSerializer = m.getValueSerializer();
    }

    private UV readUserValue(ArenaInputView in) throws IOException {
        return in.readBoolean() ? null : userValueSerializer.deserialize(in);
    }

    @Override
    public UV get(UK key) throws IOException {
        synchronized (ch) {
            if (read(Opcode.MAP_GET, key, userKeySerializer) == Status.NOT_FOUND) {
                return null;
            }
            return readUserValue(result());
        }
    }

    @Override
    public void put(UK key, UV value) throws IOException {
        synchronized (ch) {
            beginKeyed();
            putEntry(key, value);
        }
    }

    /** Writes one entry on the key part just written. */
    private void putEntry(UK key, UV value) throws IOException {
        int ukOff = ch.mark();
        userKeySerializer.serialize(key, ch.out);
        int ukLen = ch.mark() - ukOff;
        int off = ch.mark();
        ch.out.writeBoolean(value == null);
        if (value != null) {
            userValueSerializer.serialize(value, ch.out);
        }
        write(Opcode.MAP_PUT, ukOff, ukLen, off, ch.mark() - off);
    }

    @Override
    public void putAll(Map<UK, UV> map) throws IOException {
        synchronized (ch) {
            if (map == null) {
                return;
            }
            for (Map.Entry<UK, UV> e : map.entrySet()) {
                put(e.getKey(), e.getValue());
            }
        }
    }

    @Override
    public void remove(UK key) throws IOException {
        synchronized (ch) {
            beginKeyed();
            int ukOff = ch.mark();
            userKeySerializer.serialize(key, ch.out);
            write(Opcode.MAP_REMOVE, ukOff, ch.mark() - ukOff, RequestChannel.NONE, 0);
        }
    }

    @Override
    public boolean contains(UK key) throws IOException {
        synchronized (ch) {
            return readAux(Opcode.MAP_CONTAINS, key, userKeySerializer) != 0;
        }
    }

    @Override
    public Iterable<Map.Entry<UK, UV>> entries() {
        return this::iterator;
    }

    @Override
    public Iterable<UK> keys() {
        return () -> new Pages<UK>(Opcode.ITER_KEYS) {
            @Override
            UK item(Entry e) {
                return e.getKey();
            }
        };
    }

    @Override
    public Iterable<UV> values() {
        return () -> new Pages<UV>(Opcode.ITER_ENTRIES) {
            @Override
            UV item(Entry e) {
                return e.getValue();
            }
        };
    }

    @Override
    public Iterator<Map.Entry<UK, UV>> iterator() {
        return new Pages<Map.Entry<UK, UV>>(Opcode.ITER_ENTRIES) {
            @Override
            Map.Entry<UK, UV> item(Entry e) {
                return e;
            }
        };
    }

    @Override
    public boolean isEmpty() throws IOException {
        synchronized (ch) {
            return !new Pages<UK>(Opcode.ITER_KEYS) {
                @Override
                UK item(Entry e) {
                    return e.getKey();
                }
            }.hasNext();
        }
    }

    @Override
    protected byte[] serializedValue(TypeSerializer<Map<UK, UV>> safeValueSerializer) throws Exception {
        List<Map.Entry<UK, UV>> all = new ArrayList<>();
        iterator().forEachRemaining(all::add);
        if (all.isEmpty()) {
            return null;
        }
        MapSerializer<UK, UV> m = (MapSerializer<UK, UV>) safeValueSerializer;
        return KvStateSerializer.serializeMap(all, m.getKeySerializer(), m.getValueSerializer());
    }

    /** One entry of a page; {@code setValue} writes through. */
    private final class Entry implements Map.Entry<UK, UV> {
        private final Pages<?> pages;
        private final UK key;
        private UV value;

        Entry(Pages<?> pages, UK key, UV value) {
            this.pages = pages;
            this.key = key;
            this.value = value;
        }

        @Override
        public UK getKey() {
            return key;
        }

        @Override
        public UV getValue() {
            return value;
        }

        @Override
        public UV setValue(UV value) {
            UV old = this.value;
            this.value = value;
            pages.write(key, value, false);
            return old;
        }

        @Override
        public boolean equals(Object o) {
            if (this == o) {
                return true;
            }
            if (!(o instanceof Map.Entry)) {
                return false;
            }
            Map.Entry<?, ?> e = (Map.Entry<?, ?>) o;
            return Objects.equals(key, e.getKey()) && Objects.equals(value, e.getValue());
        }

        @Override
        public int hashCode() {
            return Objects.hashCode(key) ^ Objects.hashCode(value);
        }

        @Override
        public String toString() {
            return key + "=" + value;
        }
    }

    /**
     * Iteration over the map of the key and namespace current when it began, a page at a time;
     * each page is deserialized as it arrives (its bytes are reused by the next request).
     */
    private abstract class Pages<T> implements Iterator<T> {
        private final long mode;
        private final byte[] key;
        private final int keyGroup;
        private final N namespace;
        private final List<Entry> page = new ArrayList<>();
        private int next;
        private byte[] cursor;
        private boolean more = true;
        private Entry last;
        private int capacity = PAGE_BYTES;

        Pages(long mode) {
            this.mode = mode;
            try {
                this.key = currentKey().getCopyOfBuffer();
            } catch (IOException e) {
                throw new FlinkRuntimeException("serializing the current key failed", e);
            }
            this.keyGroup = keyGroup();
            this.namespace = currentNamespace();
        }

        abstract T item(Entry e);

        private void begin() throws IOException {
            ch.begin();
            keyOff = ch.mark();
            ch.out.write(key);
            keyLen = key.length;
            nsOff = ch.mark();
            namespaceSerializer.serialize(namespace, ch.out);
            nsLen = ch.mark() - nsOff;
        }

        /** Writes or removes one entry of this iteration's map. */
        void write(UK userKey, UV value, boolean remove) {
            synchronized (ch) {
                writeLocked(userKey, value, remove);
            }
        }

        private void writeLocked(UK userKey, UV value, boolean remove) {
            try {
                begin();
                int ukOff = ch.mark();
                userKeySerializer.serialize(userKey, ch.out);
                int ukLen = ch.mark() - ukOff;
                if (remove) {
                    ch.submit(Opcode.MAP_REMOVE, 0, keyGroup, stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, RequestChannel.NONE, 0, 0);
                } else {
                    int off = ch.mark();
                    ch.out.writeBoolean(value == null);
                    if (value != null) {
                        userValueSerializer.serialize(value, ch.out);
                    }
                    ch.submit(Opcode.MAP_PUT, 0, keyGroup, stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, off, ch.mark() - off, 0);
                }
            } catch (IOException e) {
                throw new FlinkRuntimeException("statord failed to write map state " + stateId, e);
            }
        }

        private void fetch() throws IOException {
            page.clear();
            next = 0;
            while (page.isEmpty() && more) {
                begin();
                int flags = 0;
                int ukOff = RequestChannel.NONE;
                int ukLen = 0;
                if (cursor != null) {
                    flags = Opcode.FLAG_ITER_RESUME;
                    ukOff = ch.mark();
                    ch.out.write(cursor);
                    ukLen = cursor.length;
                }
                int outOff = ch.mark();
                ch.out.reserve(capacity);
                long token =
                        ch.submit(Opcode.MAP_ITER, flags, keyGroup, stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, outOff, capacity, mode);
                int status = ch.await(token);
                if (status == Status.RESULT_TOO_LARGE) {
                    capacity = grow(ch.resultLength());
                    continue;
                }
                check(status, Opcode.MAP_ITER);
                int at = ch.absolute(token, outOff);
                int len = ch.resultLength();
                long entries = ch.resultAux();
                more = ch.resultMore();
                ArenaInputView in = ch.in;
                in.set(at + len - 4, 4);
                int cursorLen = in.readIntLE();
                int cursorAt = at + len - 4 - cursorLen;
                cursor = new byte[cursorLen];
                in.set(cursorAt, cursorLen);
                in.readFully(cursor);
                int pos = at;
                for (long i = 0; i < entries; i++) {
                    in.set(pos, 4);
                    int kl = in.readIntLE();
                    in.set(pos + 4, kl);
                    UK k = userKeySerializer.deserialize(in);
                    pos += 4 + kl;
                    UV v = null;
                    if (mode == Opcode.ITER_ENTRIES) {
                        in.set(pos, 4);
                        int vl = in.readIntLE();
                        in.set(pos + 4, vl);
                        v = readUserValue(in);
                        pos += 4 + vl;
                    }
                    page.add(new Entry(this, k, v));
                }
            }
        }

        @Override
        public boolean hasNext() {
            if (next < page.size()) {
                return true;
            }
            if (!more) {
                return false;
            }
            try {
                synchronized (ch) {
                    fetch();
                }
            } catch (IOException e) {
                throw new FlinkRuntimeException("statord failed to iterate map state " + stateId, e);
            }
            return next < page.size();
        }

        @Override
        public T next() {
            if (!hasNext()) {
                throw new NoSuchElementException();
            }
            last = page.get(next++);
            return item(last);
        }

        @Override
        public void remove() {
            if (last == null) {
                throw new IllegalStateException("remove() without next()");
            }
            write(last.getKey(), null, true);
            last = null;
        }
    }
}
