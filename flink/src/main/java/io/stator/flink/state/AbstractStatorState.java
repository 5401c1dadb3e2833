package io.stator.flink.state;

import io.stator.flink.jni.StatorException;
import io.stator.flink.session.ArenaInputView;
import io.stator.flink.session.RequestChannel;
import io.stator.flink.session.Status;

import org.apache.flink.api.common.state.State;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.queryablestate.client.state.serialization.KvStateSerializer;
import org.apache.flink.runtime.state.KeyGroupRangeAssignment;
import org.apache.flink.runtime.state.internal.InternalKvState;
import org.apache.flink.util.FlinkRuntimeException;

import java.io.IOException;
import java.util.Collection;

/**
 * What every Stator state shares: the current namespace, the request's key part (key group,
 * state id, serialized key and namespace) written straight into the session's arena, and reads
 * that grow their result buffer when a result does not fit.
 *
 * <p>A request is built as {@code beginKeyed()}, then the op's own parts through {@code
 * ch.out}, then {@code ch.submit(...)} with the offsets of {@link #keyOff}, {@link #nsOff} and the
 * op's own. Offsets are relative to the request's start ({@link RequestChannel#mark()}).
 */
public abstract class AbstractStatorState<K, N, V> implements InternalKvState<K, N, V>, State {

    protected final StateContext<K> backend;
    protected final RequestChannel ch;
    /** The state's id in the session (statord's registration). */
    protected final int stateId;

    protected TypeSerializer<N> namespaceSerializer;
    protected TypeSerializer<V> valueSerializer;
    protected V defaultValue;

    private N currentNamespace;
    /**
     * A queryable-state lookup's key (serialized), key group and namespace while it runs (under
     * the channel's lock): it never touches the backend's current key or the task's namespace,
     * which the task thread may be changing meanwhile.
     */
    private DataOutputSerializer queryKey;
    private int queryGroup;
    private N queryNamespace;
    private Object serializedNamespaceOf;
    private final DataOutputSerializer namespaceBytes = new DataOutputSerializer(32);

    /** Where the key part of the request being built lies (relative offsets and lengths). */
    protected int keyOff;
    protected int keyLen;
    protected int nsOff;
    protected int nsLen;
    /** The arena offset of the last read's result. */
    protected int resultOff;

    /** The result buffer a read asks for; grows to the largest result seen. */
    private int readCapacity = 256;
    /** The most result room a read keeps reserving after a larger result. */
    static final int STICKY_CAPACITY = 64 << 10;

    protected AbstractStatorState(
            StateContext<K> backend,
            int stateId,
            TypeSerializer<N> namespaceSerializer,
            TypeSerializer<V> valueSerializer,
            V defaultValue) {
        this.backend = backend;
        this.ch = backend.channel();
        this.stateId = stateId;
        this.namespaceSerializer = namespaceSerializer;
        this.valueSerializer = valueSerializer;
        this.defaultValue = defaultValue;
    }

    @Override
    public TypeSerializer<K> getKeySerializer() {
        return backend.getKeySerializer();
    }

    @Override
    public TypeSerializer<N> getNamespaceSerializer() {
        return namespaceSerializer;
    }

    @Override
    public TypeSerializer<V> getValueSerializer() {
        return valueSerializer;
    }

    @Override
    public void setCurrentNamespace(N namespace) {
        this.currentNamespace = namespace;
    }

    /** The namespace requests use: a query's while one runs, else the task's. */
    protected N currentNamespace() {
        return queryKey != null ? queryNamespace : currentNamespace;
    }

    /** Updates the serializers after a re-registration (a restored or re-declared state). */
    public void update(TypeSerializer<N> namespaceSerializer, TypeSerializer<V> valueSerializer, V defaultValue) {
        this.namespaceSerializer = namespaceSerializer;
        this.valueSerializer = valueSerializer;
        this.defaultValue = defaultValue;
        this.serializedNamespaceOf = null;
    }

    protected V getDefaultValue() {
        return defaultValue == null ? null : valueSerializer.copy(defaultValue);
    }

    /** Starts a request on the current key and namespace. */
    protected void beginKeyed() throws IOException {
        beginKeyed(currentNamespace());
    }

    /** Starts a request on the current key and {@code namespace}. */
    protected void beginKeyed(N namespace) throws IOException {
        if (namespace != serializedNamespaceOf) {
            namespaceBytes.clear();
            namespaceSerializer.serialize(namespace, namespaceBytes);
            serializedNamespaceOf = namespace;
        }
        DataOutputSerializer key = currentKey();
        ch.begin();
        keyOff = ch.mark();
        ch.out.write(key.getSharedBuffer(), 0, key.length());
        keyLen = key.length();
        nsOff = ch.mark();
        ch.out.write(namespaceBytes.getSharedBuffer(), 0, namespaceBytes.length());
        nsLen = namespaceBytes.length();
    }

    /** Merges two values of a reducing or aggregating state. */
    @FunctionalInterface
    protected interface Merger<T> {
        T merge(T a, T b) throws Exception;
    }

    /**
     * {@code mergeNamespaces} of a reducing or aggregating state: folds the values of {@code
     * sources} into {@code target} with {@code merger}, deleting the sources.
     */
    protected void mergeValues(N target, Collection<N> sources, Merger<V> merger) throws Exception {
        synchronized (ch) {
            if (sources == null || sources.isEmpty()) {
                return;
            }
            N previous = currentNamespace();
            try {
                V merged = null;
                for (N source : sources) {
                    if (source == null) {
                        continue;
                    }
                    setCurrentNamespace(source);
                    V v = readValue();
                    if (v != null) {
                        writeKeyed(io.stator.flink.session.Opcode.DELETE);
                        merged = merged == null ? v : merger.merge(merged, v);
                    }
                }
                if (merged != null) {
                    setCurrentNamespace(target);
                    V t = readValue();
                    writeValue(t == null ? merged : merger.merge(merged, t));
                }
            } finally {
                setCurrentNamespace(previous);
            }
        }
    }

    /** The serialized key requests use: a query's while one runs, else the backend's current key. */
    protected DataOutputSerializer currentKey() throws IOException {
        return queryKey != null ? queryKey : backend.currentKeyBytes();
    }

    protected int keyGroup() {
        return queryKey != null ? queryGroup : backend.getCurrentKeyGroupIndex();
    }

    /** Submits a write on the key part with an optional user key and value. */
    protected void write(byte op, int ukOff, int ukLen, int valueOff, int valueLen) throws IOException {
        write(op, 0, ukOff, ukLen, valueOff, valueLen);
    }

    protected void write(byte op, int flags, int ukOff, int ukLen, int valueOff, int valueLen) throws IOException {
        ch.submit(op, flags, keyGroup(), stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, valueOff, valueLen, 0);
    }

    /** Writes {@code op} (no user key, no value) on the current key and namespace. */
    protected void writeKeyed(byte op) throws IOException {
        beginKeyed();
        write(op, RequestChannel.NONE, 0, RequestChannel.NONE, 0);
    }

    /**
     * Reads with {@code op} on the current key and namespace (and {@code userKey}, if the op takes
     * one), growing the result buffer until the result fits. Returns the status ({@link
     * Status#OK} or {@link Status#NOT_FOUND}); the result lies at {@link #resultOff}, {@code
     * ch.resultLength()} bytes, until the next request.
     */
    protected <UK> int read(byte op, UK userKey, TypeSerializer<UK> userKeySerializer) throws IOException {
        return read(op, currentNamespace(), userKey, userKeySerializer, 0);
    }

    protected <UK> int read(byte op, N namespace, UK userKey, TypeSerializer<UK> userKeySerializer, int flags)
            throws IOException {
        int cap = readCapacity;
        while (true) {
            beginKeyed(namespace);
            int ukOff = RequestChannel.NONE;
            int ukLen = 0;
            if (userKeySerializer != null) {
                ukOff = ch.mark();
                userKeySerializer.serialize(userKey, ch.out);
                ukLen = ch.mark() - ukOff;
            }
            int outOff = ch.mark();
            ch.out.reserve(cap);
            long token =
                    ch.submit(op, flags, keyGroup(), stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, outOff, cap, 0);
            int status = ch.await(token);
            if (status == Status.RESULT_TOO_LARGE) {
                cap = grow(ch.resultLength());
                continue;
            }
            // Later reads keep a grown room only up to STICKY_CAPACITY: one huge value must not
            // make every read reserve (or fail to reserve) as much.
            readCapacity = Math.max(readCapacity, Math.min(cap, STICKY_CAPACITY));
            check(status, op);
            resultOff = ch.absolute(token, outOff);
            return status;
        }
    }

    /** Reads {@code op} whose only output is {@code aux} (map contains). */
    protected <UK> long readAux(byte op, UK userKey, TypeSerializer<UK> userKeySerializer) throws IOException {
        beginKeyed();
        int ukOff = ch.mark();
        userKeySerializer.serialize(userKey, ch.out);
        int ukLen = ch.mark() - ukOff;
        long token =
                ch.submit(op, 0, keyGroup(), stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, RequestChannel.NONE, 0, 0);
        check(ch.await(token), op);
        return ch.resultAux();
    }

    /** The room a read asks for after a result of {@code needed} bytes did not fit. */
    public static int grow(int needed) {
        int c = Integer.highestOneBit(Math.max(needed, 64) - 1) << 1;
        return c > 0 ? c : needed;
    }

    protected void check(int status, byte op) throws StatorException {
        if (status < 0) {
            throw new StatorException(
                    StatorException.STATUS,
                    status,
                    "statord failed a request on state " + stateId + ": " + Status.describe(status));
        }
    }

    /** A view over the last read's result. */
    protected ArenaInputView result() {
        return ch.in.set(resultOff, ch.resultLength());
    }

    /** Reads the value stored at the current key and namespace. */
    protected V readValue() throws IOException {
        if (read(io.stator.flink.session.Opcode.GET, null, null) == Status.NOT_FOUND) {
            return null;
        }
        return valueSerializer.deserialize(result());
    }

    /** Writes {@code value} at the current key and namespace. */
    protected void writeValue(V value) throws IOException {
        beginKeyed();
        int off = ch.mark();
        valueSerializer.serialize(value, ch.out);
        write(io.stator.flink.session.Opcode.PUT, RequestChannel.NONE, 0, off, ch.mark() - off);
    }

    @Override
    public void clear() {
        synchronized (ch) {
            try {
                writeKeyed(io.stator.flink.session.Opcode.CLEAR);
            } catch (IOException e) {
                throw new FlinkRuntimeException("statord failed to clear state " + stateId, e);
            }
        }
    }

    /**
     * The serialized value (queryable state and the backend tests' checks), in the format the
     * subclass gives; read on the calling thread, so only from the task thread.
     */
    @Override
    public byte[] getSerializedValue(
            byte[] serializedKeyAndNamespace,
            TypeSerializer<K> safeKeySerializer,
            TypeSerializer<N> safeNamespaceSerializer,
            TypeSerializer<V> safeValueSerializer)
            throws Exception {
        synchronized (ch) {
            var kn =
                    KvStateSerializer.deserializeKeyAndNamespace(
                            serializedKeyAndNamespace, safeKeySerializer, safeNamespaceSerializer);
            DataOutputSerializer key = new DataOutputSerializer(32);
            safeKeySerializer.serialize(kn.f0, key);
            queryKey = key;
            queryGroup = KeyGroupRangeAssignment.assignToKeyGroup(kn.f0, backend.getNumberOfKeyGroups());
            queryNamespace = kn.f1;
            try {
                return serializedValue(safeValueSerializer);
            } finally {
                queryKey = null;
                queryNamespace = null;
            }
        }
    }

    /** The current value serialized as queryable state clients expect it (null if absent). */
    protected byte[] serializedValue(TypeSerializer<V> safeValueSerializer) throws Exception {
        V v = readValue();
        return v == null ? null : KvStateSerializer.serializeValue(v, safeValueSerializer);
    }

    @Override
    public StateIncrementalVisitor<K, N, V> getStateIncrementalVisitor(int recommendedMaxNumberOfReturnedRecords) {
        throw new UnsupportedOperationException("Stator states have no incremental visitor");
    }
}
