package io.stator.flink.snapshot;

import io.stator.flink.session.Opcode;
import io.stator.flink.session.RequestChannel;

import org.apache.flink.api.common.state.StateDescriptor;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.base.ListSerializer;
import org.apache.flink.core.memory.DataInputDeserializer;
import org.apache.flink.runtime.state.CompositeKeySerializationUtils;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyedStateHandle;
import org.apache.flink.runtime.state.RegisteredKeyValueStateBackendMetaInfo;
import org.apache.flink.runtime.state.RegisteredPriorityQueueStateBackendMetaInfo;
import org.apache.flink.runtime.state.StateSerializerProvider;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueElement;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueSetFactory;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueSnapshotRestoreWrapper;
import org.apache.flink.runtime.state.KeyExtractorFunction;
import org.apache.flink.runtime.state.Keyed;
import org.apache.flink.runtime.state.PriorityComparable;
import org.apache.flink.runtime.state.metainfo.StateMetaInfoSnapshot;
import org.apache.flink.runtime.state.restore.FullSnapshotRestoreOperation;
import org.apache.flink.runtime.state.restore.KeyGroup;
import org.apache.flink.runtime.state.restore.KeyGroupEntry;
import org.apache.flink.runtime.state.restore.SavepointRestoreResult;
import org.apache.flink.runtime.state.restore.ThrowingIterator;

import java.io.IOException;
import java.util.Collection;
import java.util.HashMap;
import java.util.Map;

/**
 * Restores a savepoint (or a HashMap backend's checkpoint) in Flink's canonical format into
 * statord: Flink's own reader ({@link FullSnapshotRestoreOperation}) yields the RocksDB-layout
 * entries of the subtask's key groups; each is split into key, namespace and user key (by
 * reading them with the savepoint's serializers, whose bytes are kept as they are) and written
 * through the task's request path; timers go to the heap queues.
 */
public final class CanonicalRestore<K> {

    /** Where a restored state goes: its meta information and its id in the session. */
    public interface States {
        /** Registers (or finds) a restored state; returns its id in the session. */
        int register(RegisteredKeyValueStateBackendMetaInfo<?, ?> meta) throws IOException;
    }

    private final KeyGroupRange range;
    private final int numberOfKeyGroups;
    private final ClassLoader userCode;
    private final StateSerializerProvider<K> keySerializerProvider;
    private final RequestChannel ch;

    public CanonicalRestore(
            KeyGroupRange range,
            int numberOfKeyGroups,
            ClassLoader userCode,
            StateSerializerProvider<K> keySerializerProvider,
            RequestChannel ch) {
        this.range = range;
        this.numberOfKeyGroups = numberOfKeyGroups;
        this.userCode = userCode;
        this.keySerializerProvider = keySerializerProvider;
        this.ch = ch;
    }

    /** Restores {@code handles}; returns the entries written. */
    public long restore(
            Collection<KeyedStateHandle> handles,
            States states,
            Map<String, HeapPriorityQueueSnapshotRestoreWrapper<?>> queues,
            HeapPriorityQueueSetFactory queueFactory)
            throws Exception {
        int prefixBytes = CompositeKeySerializationUtils.computeRequiredBytesInKeyGroupPrefix(numberOfKeyGroups);
        long written = 0;
        FullSnapshotRestoreOperation<K> op =
                new FullSnapshotRestoreOperation<>(range, userCode, handles, keySerializerProvider);
        try (ThrowingIterator<SavepointRestoreResult> results = op.restore()) {
            while (results.hasNext()) {
                SavepointRestoreResult result = results.next();
                Map<Integer, Target> targets = new HashMap<>();
                int i = 0;
                for (StateMetaInfoSnapshot s : result.getStateMetaInfoSnapshots()) {
                    switch (s.getBackendStateType()) {
                        case KEY_VALUE: {
                            RegisteredKeyValueStateBackendMetaInfo<?, ?> meta =
                                    new RegisteredKeyValueStateBackendMetaInfo<>(s);
                            targets.put(i, new Target(meta, states.register(meta)));
                            break;
                        }
                        case PRIORITY_QUEUE: {
                            RegisteredPriorityQueueStateBackendMetaInfo<?> meta =
                                    new RegisteredPriorityQueueStateBackendMetaInfo<>(s);
                            HeapPriorityQueueSnapshotRestoreWrapper<?> q =
                                    queues.computeIfAbsent(s.getName(), n -> wrap(meta, queueFactory));
                            targets.put(i, new Target(q));
                            break;
                        }
                        default:
                            throw new IOException("a keyed savepoint holds " + s.getBackendStateType() + " state");
                    }
                    i++;
                }
                try (ThrowingIterator<KeyGroup> groups = result.getRestoredKeyGroups()) {
                    while (groups.hasNext()) {
                        KeyGroup g = groups.next();
                        try (ThrowingIterator<KeyGroupEntry> entries = g.getKeyGroupEntries()) {
                            while (entries.hasNext()) {
                                KeyGroupEntry e = entries.next();
                                Target t = targets.get(e.getKvStateId());
                                if (t == null) {
                                    throw new IOException("an entry of unknown state " + e.getKvStateId());
                                }
                                if (t.queue != null) {
                                    t.addTimer(e.getKey(), prefixBytes);
                                } else {
                                    t.write(g.getKeyGroupId(), e.getKey(), e.getValue(), prefixBytes);
                                    written++;
                                }
                            }
                        }
                    }
                }
            }
        }
        synchronized (ch) {
            ch.drain();
        }
        return written;
    }

    private <T extends HeapPriorityQueueElement & PriorityComparable<? super T> & Keyed<?>>
            HeapPriorityQueueSnapshotRestoreWrapper<T> wrap(
            RegisteredPriorityQueueStateBackendMetaInfo<?> meta, HeapPriorityQueueSetFactory factory) {
        @SuppressWarnings("unchecked")
        RegisteredPriorityQueueStateBackendMetaInfo<T> m = (RegisteredPriorityQueueStateBackendMetaInfo<T>) meta;
        return new HeapPriorityQueueSnapshotRestoreWrapper<>(
                factory.create(m.getName(), m.getElementSerializer()),
                m,
                KeyExtractorFunction.forKeyedObjects(),
                range,
                numberOfKeyGroups);
    }

    /** One restored state: a statord state, or a timer queue. */
    private final class Target {
        final RegisteredKeyValueStateBackendMetaInfo<?, ?> meta;
        final int stateId;
        final HeapPriorityQueueSnapshotRestoreWrapper<?> queue;
        final DataInputDeserializer in = new DataInputDeserializer();

        Target(RegisteredKeyValueStateBackendMetaInfo<?, ?> meta, int stateId) {
            this.meta = meta;
            this.stateId = stateId;
            this.queue = null;
        }

        Target(HeapPriorityQueueSnapshotRestoreWrapper<?> queue) {
            this.meta = null;
            this.stateId = -1;
            this.queue = queue;
        }

        @SuppressWarnings("unchecked")
        void addTimer(byte[] key, int prefixBytes) throws IOException {
            in.setBuffer(key);
            in.skipBytesToRead(prefixBytes);
            HeapPriorityQueueSnapshotRestoreWrapper<HeapPriorityQueueElement> q =
                    (HeapPriorityQueueSnapshotRestoreWrapper<HeapPriorityQueueElement>) queue;
            q.getPriorityQueue().add(q.getMetaInfo().getElementSerializer().deserialize(in));
        }

        /** The end of what {@code serializer} reads from {@code in}, skipping a length suffix. */
        private int skip(TypeSerializer<?> serializer, boolean ambiguous) throws IOException {
            int start = in.getPosition();
            serializer.deserialize(in);
            int len = in.getPosition() - start;
            int end = in.getPosition();
            if (ambiguous) {
                CompositeKeySerializationUtils.readVariableIntBytes(in, len);
            }
            return end;
        }

        void write(int keyGroup, byte[] key, byte[] value, int prefixBytes) throws IOException {
            TypeSerializer<K> keySer = keySerializerProvider.previousSchemaSerializer();
            TypeSerializer<?> nsSer = meta.getPreviousNamespaceSerializer();
            boolean ambiguous = CompositeKeySerializationUtils.isAmbiguousKeyPossible(keySer, nsSer);
            in.setBuffer(key);
            in.skipBytesToRead(prefixBytes);
            int keyStart = in.getPosition();
            int keyEnd = skip(keySer, ambiguous);
            int nsStart = in.getPosition();
            int nsEnd = skip(nsSer, ambiguous);
            int ukStart = in.getPosition();
            synchronized (ch) {
                ch.begin();
                int k = ch.mark();
                ch.out.write(key, keyStart, keyEnd - keyStart);
                int n = ch.mark();
                ch.out.write(key, nsStart, nsEnd - nsStart);
                StateDescriptor.Type type = meta.getStateType();
                int v = ch.mark();
                switch (type) {
                    case MAP: {
                        int u = ch.mark();
                        ch.out.write(key, ukStart, key.length - ukStart);
                        v = ch.mark();
                        ch.out.write(value);
                        ch.submit(Opcode.MAP_PUT, 0, keyGroup, stateId, k, keyEnd - keyStart, n, nsEnd - nsStart, u, key.length - ukStart, v, value.length, 0);
                        return;
                    }
                    case LIST: {
                        TypeSerializer<?> element =
                                ((ListSerializer<?>) meta.getPreviousStateSerializer()).getElementSerializer();
                        in.setBuffer(value);
                        while (in.available() > 0) {
                            int lenAt = ch.mark();
                            ch.out.writeInt(0);
                            int start = in.getPosition();
                            element.deserialize(in);
                            int end = in.getPosition();
                            ch.out.write(value, start, end - start);
                            ch.patchIntLE(lenAt, end - start);
                            if (in.available() > 0) {
                                in.readByte(); // the delimiter
                            }
                        }
                        ch.submit(Opcode.LIST_REPLACE, 0, keyGroup, stateId, k, keyEnd - keyStart, n, nsEnd - nsStart, RequestChannel.NONE, 0, v, ch.mark() - v, 0);
                        return;
                    }
                    default:
                        ch.out.write(value);
                        ch.submit(Opcode.PUT, 0, keyGroup, stateId, k, keyEnd - keyStart, n, nsEnd - nsStart, RequestChannel.NONE, 0, v, value.length, 0);
                }
            }
        }
    }
}
