package io.stator.flink.snapshot;

import org.apache.flink.api.common.state.StateDescriptor;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.runtime.state.CompositeKeySerializationUtils;
import org.apache.flink.runtime.state.FullSnapshotResources;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyValueStateIterator;
import org.apache.flink.runtime.state.RegisteredKeyValueStateBackendMetaInfo;
import org.apache.flink.runtime.state.StreamCompressionDecorator;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueStateSnapshot;
import org.apache.flink.runtime.state.metainfo.StateMetaInfoSnapshot;
import org.apache.flink.util.FlinkRuntimeException;
import org.apache.flink.util.IOUtils;

import java.io.IOException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Iterator;
import java.util.List;
import java.util.Map;

/**
 * A savepoint in Flink's canonical format: the state as a portable snapshot fixed at the
 * barrier (an export on a session of its own, streamed on the snapshot thread), turned record by
 * record into the key and value bytes Flink's full-snapshot format has (the RocksDB layout:
 * key-group prefix, key, namespace and, for maps, the user key; lists delimited), followed in
 * each key group by the heap timers. So a job moves between Stator and Flink's HashMap or RocksDB
 * backends with a savepoint.
 */
public final class CanonicalSavepointResources<K> implements FullSnapshotResources<K> {

    private final PortableSnapshotReader reader;
    private final List<RegisteredKeyValueStateBackendMetaInfo<?, ?>> kvStates;
    private final List<HeapPriorityQueueStateSnapshot<?>> queues;
    private final List<StateMetaInfoSnapshot> metaInfo = new ArrayList<>();
    private final KeyGroupRange keyGroupRange;
    private final int numberOfKeyGroups;
    private final TypeSerializer<K> keySerializer;
    private final StreamCompressionDecorator compression;

    /**
     * Takes over {@code reader}, an export of the state already fixed at the barrier, and closes
     * it (and its session) when released.
     */
    public CanonicalSavepointResources(
            List<RegisteredKeyValueStateBackendMetaInfo<?, ?>> kvStates,
            List<HeapPriorityQueueStateSnapshot<?>> queues,
            KeyGroupRange keyGroupRange,
            int numberOfKeyGroups,
            TypeSerializer<K> keySerializer,
            StreamCompressionDecorator compression,
            PortableSnapshotReader reader) {
        this.reader = reader;
        this.kvStates = kvStates;
        this.queues = queues;
        this.keyGroupRange = keyGroupRange;
        this.numberOfKeyGroups = numberOfKeyGroups;
        this.keySerializer = keySerializer;
        this.compression = compression;
        for (RegisteredKeyValueStateBackendMetaInfo<?, ?> m : kvStates) {
            metaInfo.add(m.snapshot());
        }
        for (HeapPriorityQueueStateSnapshot<?> q : queues) {
            metaInfo.add(q.getMetaInfoSnapshot());
        }
    }

    @Override
    public List<StateMetaInfoSnapshot> getMetaInfoSnapshots() {
        return metaInfo;
    }

    @Override
    public KeyValueStateIterator createKVStateIterator() throws IOException {
        return new Iter();
    }

    @Override
    public KeyGroupRange getKeyGroupRange() {
        return keyGroupRange;
    }

    @Override
    public TypeSerializer<K> getKeySerializer() {
        return keySerializer;
    }

    @Override
    public StreamCompressionDecorator getStreamCompressionDecorator() {
        return compression;
    }

    @Override
    public void release() {
        IOUtils.closeQuietly(reader);
    }

    /**
     * Key groups in order; in each, the exported records (grouped by state, as statord stores
     * them), then each timer queue's elements.
     */
    private final class Iter implements KeyValueStateIterator {
        private final int prefixBytes =
                CompositeKeySerializationUtils.computeRequiredBytesInKeyGroupPrefix(numberOfKeyGroups);
        private final Map<String, Integer> ids = new HashMap<>();
        private final DataOutputSerializer out = new DataOutputSerializer(128);
        /** The next exported record is loaded (and not yet handed out). */
        private boolean recordReady;
        private boolean recordsDone;
        /** Timer iteration within the current key group. */
        private int queue = -1;
        private Iterator<?> elements;

        private int keyGroup = -1;
        private int kvStateId = -1;
        private byte[] key;
        private byte[] value;
        private boolean valid;
        private boolean newKeyGroup;
        private boolean newState;
        private int group = keyGroupRange.getStartKeyGroup();

        Iter() throws IOException {
            for (int i = 0; i < kvStates.size(); i++) {
                ids.put(kvStates.get(i).getName(), i);
            }
            advanceRecord();
            next();
        }

        /** Loads the next exported record of a state this savepoint holds. */
        private void advanceRecord() throws IOException {
            recordReady = false;
            while (!recordsDone) {
                if (!reader.next()) {
                    recordsDone = true;
                    return;
                }
                if (reader.stateName() != null && ids.containsKey(reader.stateName())) {
                    recordReady = true;
                    return;
                }
            }
        }

        @Override
        public void next() throws IOException {
            int previousGroup = keyGroup;
            int previousState = kvStateId;
            valid = false;
            while (group <= keyGroupRange.getEndKeyGroup()) {
                if (recordReady && reader.keyGroup() == group) {
                    emitRecord();
                    advanceRecord();
                    break;
                }
                if (recordReady && reader.keyGroup() < group) {
                    throw new IOException("the exported state is not in key-group order");
                }
                if (emitTimer()) {
                    break;
                }
                group++;
                queue = -1;
                elements = null;
            }
            newKeyGroup = valid && keyGroup != previousGroup;
            newState = valid && (newKeyGroup || kvStateId != previousState);
        }

        private void emitRecord() throws IOException {
            String name = reader.stateName();
            int id = ids.get(name);
            RegisteredKeyValueStateBackendMetaInfo<?, ?> meta = kvStates.get(id);
            boolean ambiguous =
                    CompositeKeySerializationUtils.isAmbiguousKeyPossible(
                            keySerializer, meta.getNamespaceSerializer());
            byte[] k = reader.key();
            out.clear();
            CompositeKeySerializationUtils.writeKeyGroup(group, prefixBytes, out);
            int keyLen = reader.keyPartLength();
            out.write(k, reader.keyOffset(), keyLen);
            if (ambiguous) {
                CompositeKeySerializationUtils.writeVariableIntBytes(keyLen, out);
            }
            int nsLen = reader.namespaceLength();
            out.write(k, reader.namespaceOffset(), nsLen);
            if (ambiguous) {
                CompositeKeySerializationUtils.writeVariableIntBytes(nsLen, out);
            }
            int uk = reader.mapKeyOffset();
            out.write(k, uk, reader.keyLength() - uk);
            key = out.getCopyOfBuffer();
            if (meta.getStateType() == StateDescriptor.Type.LIST) {
                value = delimited(reader.value(), reader.valueLength());
            } else {
                value = Arrays.copyOf(reader.value(), reader.valueLength());
            }
            keyGroup = group;
            kvStateId = id;
            valid = true;
        }

        /** statord's elements ({@code u32 LE length | bytes}) as Flink's delimited list. */
        private byte[] delimited(byte[] v, int len) {
            DataOutputSerializer d = new DataOutputSerializer(len);
            int pos = 0;
            try {
                while (pos < len) {
                    int n = (v[pos] & 0xFF) | (v[pos + 1] & 0xFF) << 8 | (v[pos + 2] & 0xFF) << 16 | (v[pos + 3] & 0xFF) << 24;
                    if (pos > 0) {
                        d.write(',');
                    }
                    d.write(v, pos + 4, n);
                    pos += 4 + n;
                }
            } catch (IOException e) {
                throw new FlinkRuntimeException(e);
            }
            return d.getCopyOfBuffer();
        }

        @SuppressWarnings("unchecked")
        private boolean emitTimer() throws IOException {
            while (true) {
                if (elements != null && elements.hasNext()) {
                    HeapPriorityQueueStateSnapshot<Object> q = (HeapPriorityQueueStateSnapshot<Object>) queues.get(queue);
                    out.clear();
                    CompositeKeySerializationUtils.writeKeyGroup(group, prefixBytes, out);
                    ((TypeSerializer<Object>) q.getMetaInfo().getElementSerializer()).serialize(elements.next(), out);
                    key = out.getCopyOfBuffer();
                    value = new byte[0];
                    keyGroup = group;
                    kvStateId = kvStates.size() + queue;
                    valid = true;
                    return true;
                }
                if (queue + 1 >= queues.size()) {
                    return false;
                }
                queue++;
                elements = queues.get(queue).getIteratorForKeyGroup(group);
            }
        }

        @Override
        public int keyGroup() {
            return keyGroup;
        }

        @Override
        public byte[] key() {
            return key;
        }

        @Override
        public byte[] value() {
            return value;
        }

        @Override
        public int kvStateId() {
            return kvStateId;
        }

        @Override
        public boolean isNewKeyValueState() {
            return newState;
        }

        @Override
        public boolean isNewKeyGroup() {
            return newKeyGroup;
        }

        @Override
        public boolean isValid() {
            return valid;
        }

        @Override
        public void close() {}
    }
}
