package io.stator.flink;

import io.stator.flink.jni.NativeSession;
import io.stator.flink.jni.StatorException;
import io.stator.flink.session.RequestChannel;
import io.stator.flink.snapshot.NativeCheckpointStrategy;
import io.stator.flink.snapshot.PortableSnapshotReader;
import io.stator.flink.state.AbstractStatorState;
import io.stator.flink.state.Kinds;
import io.stator.flink.snapshot.CanonicalSavepointResources;
import io.stator.flink.state.StateContext;
import io.stator.flink.state.StatorAggregatingState;
import io.stator.flink.state.StatorListState;
import io.stator.flink.state.StatorMapState;
import io.stator.flink.state.StatorReducingState;
import io.stator.flink.state.StatorValueState;

import org.apache.flink.api.common.ExecutionConfig;
import org.apache.flink.api.common.state.AggregatingStateDescriptor;
import org.apache.flink.api.common.state.ReducingStateDescriptor;
import org.apache.flink.api.common.state.State;
import org.apache.flink.api.common.state.StateDescriptor;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.TypeSerializerSchemaCompatibility;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.core.fs.CloseableRegistry;
import org.apache.flink.core.memory.DataInputDeserializer;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.runtime.checkpoint.CheckpointOptions;
import org.apache.flink.runtime.checkpoint.SnapshotType;
import org.apache.flink.runtime.query.TaskKvStateRegistry;
import org.apache.flink.runtime.state.AbstractKeyedStateBackend;
import org.apache.flink.runtime.state.CheckpointStreamFactory;
import org.apache.flink.runtime.state.HeapPriorityQueuesManager;
import org.apache.flink.runtime.state.KeyGroupedInternalPriorityQueue;
import org.apache.flink.runtime.state.Keyed;
import org.apache.flink.runtime.state.KeyedStateHandle;
import org.apache.flink.runtime.state.PriorityComparable;
import org.apache.flink.runtime.state.RegisteredKeyValueStateBackendMetaInfo;
import org.apache.flink.runtime.state.SavepointResources;
import org.apache.flink.runtime.state.SavepointSnapshotStrategy;
import org.apache.flink.runtime.state.SnapshotExecutionType;
import org.apache.flink.runtime.state.SnapshotResult;
import org.apache.flink.runtime.state.SnapshotStrategyRunner;
import org.apache.flink.runtime.state.StateSnapshotTransformer.StateSnapshotTransformFactory;
import org.apache.flink.runtime.state.StreamCompressionDecorator;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueElement;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueSetFactory;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueSnapshotRestoreWrapper;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueStateSnapshot;
import org.apache.flink.runtime.state.InternalKeyContext;
import org.apache.flink.runtime.state.metrics.LatencyTrackingStateConfig;
import org.apache.flink.runtime.state.metrics.SizeTrackingStateConfig;
import org.apache.flink.runtime.state.ttl.TtlTimeProvider;
import org.apache.flink.util.FlinkRuntimeException;
import org.apache.flink.util.IOUtils;
import org.apache.flink.util.StateMigrationException;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import javax.annotation.Nonnull;

import java.io.IOException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.NoSuchElementException;
import java.util.Spliterator;
import java.util.Spliterators;
import java.util.concurrent.RunnableFuture;
import java.util.function.Function;
import java.util.stream.Stream;
import java.util.stream.StreamSupport;

/**
 * A keyed state backend whose state lives in statord: one session per subtask carries the
 * requests of the task thread ({@link RequestChannel}), a second one the checkpoints (barriers
 * taken on the task thread, completions awaited on Flink's asynchronous snapshot thread), and
 * short-lived sessions scan the state (key iteration, savepoints). Timers stay on the heap and
 * are snapshotted synchronously by Flink, as with RocksDB's heap timers.
 */
public class StatorKeyedStateBackend<K> extends AbstractKeyedStateBackend<K> implements StateContext<K> {

    private static final Logger LOG = LoggerFactory.getLogger(StatorKeyedStateBackend.class);

    /** A registered state: its meta information, its id in the session, its object. */
    public static final class StateInfo {
        RegisteredKeyValueStateBackendMetaInfo<?, ?> meta;
        int stateId = -1;
        AbstractStatorState<?, ?, ?> state;

        public StateInfo(RegisteredKeyValueStateBackendMetaInfo<?, ?> meta) {
            this.meta = meta;
        }
    }

    private final RequestChannel channel;
    private final NativeSession checkpoints;
    private final NativeSession.Options scanOptions;
    final String job;
    final String operator;
    private final LinkedHashMap<String, StateInfo> states;
    private final HeapPriorityQueuesManager priorityQueues;
    private final NativeCheckpointStrategy<K> checkpointStrategy;

    private final DataOutputSerializer keyBytes = new DataOutputSerializer(64);
    private boolean keyDirty = true;
    private boolean disposed;
    private final ExecutionConfig config;

    StatorKeyedStateBackend(
            TaskKvStateRegistry kvStateRegistry,
            TypeSerializer<K> keySerializer,
            ClassLoader userCodeClassLoader,
            ExecutionConfig executionConfig,
            TtlTimeProvider ttlTimeProvider,
            LatencyTrackingStateConfig latencyTrackingStateConfig,
            SizeTrackingStateConfig sizeTrackingStateConfig,
            CloseableRegistry cancelStreamRegistry,
            StreamCompressionDecorator compression,
            InternalKeyContext<K> keyContext,
            RequestChannel channel,
            NativeSession checkpoints,
            NativeSession.Options scanOptions,
            LinkedHashMap<String, StateInfo> restoredStates,
            LinkedHashMap<String, HeapPriorityQueueSnapshotRestoreWrapper<?>> restoredQueues,
            HeapPriorityQueueSetFactory priorityQueueFactory) {
        super(
                kvStateRegistry,
                keySerializer,
                userCodeClassLoader,
                executionConfig,
                ttlTimeProvider,
                latencyTrackingStateConfig,
                sizeTrackingStateConfig,
                cancelStreamRegistry,
                compression,
                keyContext);
        this.config = executionConfig;
        this.channel = channel;
        this.checkpoints = checkpoints;
        this.scanOptions = scanOptions;
        this.job = scanOptions.job;
        this.operator = scanOptions.operator;
        this.states = restoredStates;
        this.priorityQueues =
                new HeapPriorityQueuesManager(
                        restoredQueues, priorityQueueFactory, keyGroupRange, numberOfKeyGroups);
        this.checkpointStrategy = new NativeCheckpointStrategy<>(this);
    }

    // ------------------------------------------------------------------------
    //  Keys
    // ------------------------------------------------------------------------

    @Override
    public void setCurrentKey(K newKey) {
        super.setCurrentKey(newKey);
        keyDirty = true;
    }

    @Override
    public void setCurrentKeyAndKeyGroup(K newKey, int newKeyGroupIndex) {
        super.setCurrentKeyAndKeyGroup(newKey, newKeyGroupIndex);
        keyDirty = true;
    }

    @Override
    public DataOutputSerializer currentKeyBytes() throws IOException {
        if (keyDirty) {
            keyBytes.clear();
            keySerializer.serialize(getCurrentKey(), keyBytes);
            keyDirty = false;
        }
        return keyBytes;
    }

    @Override
    public RequestChannel channel() {
        return channel;
    }

    // ------------------------------------------------------------------------
    //  States
    // ------------------------------------------------------------------------

    @Nonnull
    @Override
    @SuppressWarnings({"unchecked", "rawtypes"})
    public <N, SV, SEV, S extends State, IS extends S> IS createOrUpdateInternalState(
            @Nonnull TypeSerializer<N> namespaceSerializer,
            @Nonnull StateDescriptor<S, SV> desc,
            @Nonnull StateSnapshotTransformFactory<SEV> snapshotTransformFactory)
            throws Exception {
        return createOrUpdateInternalState(namespaceSerializer, desc, snapshotTransformFactory, false);
    }

    @Nonnull
    @Override
    @SuppressWarnings({"unchecked", "rawtypes"})
    public <N, SV, SEV, S extends State, IS extends S> IS createOrUpdateInternalState(
            @Nonnull TypeSerializer<N> namespaceSerializer,
            @Nonnull StateDescriptor<S, SV> desc,
            @Nonnull StateSnapshotTransformFactory<SEV> snapshotTransformFactory,
            boolean allowFutureMetadataUpdates)
            throws Exception {
        StateInfo info = states.get(desc.getName());
        TypeSerializer<SV> stateSerializer = desc.getSerializer();
        if (info == null) {
            RegisteredKeyValueStateBackendMetaInfo<N, SV> meta =
                    new RegisteredKeyValueStateBackendMetaInfo<>(
                            desc.getType(),
                            desc.getName(),
                            namespaceSerializer,
                            stateSerializer,
                            StateSnapshotTransformFactory.noTransform());
            info = new StateInfo(allowFutureMetadataUpdates ? meta.withSerializerUpgradesAllowed() : meta);
            states.put(desc.getName(), info);
        } else {
            RegisteredKeyValueStateBackendMetaInfo<N, SV> meta =
                    (RegisteredKeyValueStateBackendMetaInfo<N, SV>) info.meta;
            TypeSerializer<N> previousNs = meta.getNamespaceSerializer();
            TypeSerializerSchemaCompatibility<N> nsCompat = meta.updateNamespaceSerializer(namespaceSerializer);
            if (nsCompat.isCompatibleAfterMigration() || nsCompat.isIncompatible()) {
                throw new StateMigrationException(
                        "The new namespace serializer ("
                                + namespaceSerializer
                                + ") must be compatible with the old namespace serializer ("
                                + previousNs
                                + ").");
            }
            meta.checkStateMetaInfo(desc);
            TypeSerializer<SV> previous = meta.getStateSerializer();
            TypeSerializerSchemaCompatibility<SV> compat = meta.updateStateSerializer(stateSerializer);
            if (compat.isCompatibleAfterMigration()) {
                throw new StateMigrationException(
                        "The new state serializer ("
                                + stateSerializer
                                + ") of state "
                                + desc.getName()
                                + " needs its stored values migrated, which Stator does not do yet; "
                                + "take a canonical savepoint with the old serializer and restore it on "
                                + "Flink's HashMap backend to migrate.");
            } else if (compat.isIncompatible()) {
                throw new StateMigrationException(
                        "The new state serializer ("
                                + stateSerializer
                                + ") must not be incompatible with the old state serializer ("
                                + previous
                                + ").");
            }
            if (allowFutureMetadataUpdates) {
                info.meta = meta.withSerializerUpgradesAllowed();
            }
        }
        if (info.stateId < 0) {
            info.stateId = channel.session().register(desc.getName(), Kinds.of(desc.getType()));
        }
        RegisteredKeyValueStateBackendMetaInfo<N, SV> meta =
                (RegisteredKeyValueStateBackendMetaInfo<N, SV>) info.meta;
        TypeSerializer<N> ns = meta.getNamespaceSerializer();
        TypeSerializer<SV> ser = meta.getStateSerializer();
        if (info.state == null) {
            info.state = createState(desc, info.stateId, ns, ser);
        } else {
            AbstractStatorState<?, N, SV> s = (AbstractStatorState<?, N, SV>) info.state;
            s.update(ns, ser, desc.getDefaultValue());
            if (desc instanceof ReducingStateDescriptor) {
                ((StatorReducingState) s).setReduceFunction(((ReducingStateDescriptor) desc).getReduceFunction());
            } else if (desc instanceof AggregatingStateDescriptor) {
                ((StatorAggregatingState) s)
                        .setAggregateFunction(((AggregatingStateDescriptor) desc).getAggregateFunction());
            }
        }
        return (IS) info.state;
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    private <N, SV> AbstractStatorState<K, N, SV> createState(
            StateDescriptor<?, SV> desc, int stateId, TypeSerializer<N> ns, TypeSerializer<SV> ser) {
        switch (desc.getType()) {
            case VALUE:
                return new StatorValueState<>(this, stateId, ns, ser, desc.getDefaultValue());
            case LIST:
                return (AbstractStatorState) new StatorListState<>(this, stateId, ns, (TypeSerializer) ser, null);
            case MAP:
                return (AbstractStatorState) new StatorMapState<>(this, stateId, ns, (TypeSerializer) ser, null);
            case REDUCING:
                return new StatorReducingState<>(
                        this, stateId, ns, ser, desc.getDefaultValue(), ((ReducingStateDescriptor<SV>) desc).getReduceFunction());
            case AGGREGATING:
                return new StatorAggregatingState<>(
                        this,
                        stateId,
                        ns,
                        ser,
                        desc.getDefaultValue(),
                        ((AggregatingStateDescriptor) desc).getAggregateFunction());
            default:
                throw new FlinkRuntimeException("Stator does not keep " + desc.getType() + " state");
        }
    }

    /** Every state's meta information, for a checkpoint. */
    public List<org.apache.flink.runtime.state.metainfo.StateMetaInfoSnapshot> metaInfoSnapshots() {
        List<org.apache.flink.runtime.state.metainfo.StateMetaInfoSnapshot> out = new ArrayList<>();
        for (StateInfo i : states.values()) {
            out.add(i.meta.snapshot());
        }
        return out;
    }

    // ------------------------------------------------------------------------
    //  Scans (key iteration)
    // ------------------------------------------------------------------------

    /**
     * Opens a session that exports the state as of now (every request the task made before is
     * in it) and reads it record by record.
     */
    private PortableSnapshotReader scan() throws IOException {
        synchronized (channel) {
            channel.drain();
        }
        NativeSession s = NativeSession.open(scanOptions);
        PortableSnapshotReader r = null;
        try {
            r = new PortableSnapshotReader(s, true);
            s.exportStart(System.nanoTime(), List.of());
            return r;
        } catch (IOException | RuntimeException e) {
            IOUtils.closeQuietly(r);
            IOUtils.closeQuietly(s);
            throw e;
        }
    }

    /**
     * The distinct (key, namespace) pairs of the named states, in stored order, made into
     * values by {@code make} (which sees the key bytes and namespace bytes); {@code namespace}
     * null: every namespace.
     */
    private <T> Stream<T> scanKeys(List<String> names, byte[] namespace, Function<byte[][], T> make) {
        PortableSnapshotReader r;
        try {
            r = scan();
        } catch (IOException e) {
            throw new FlinkRuntimeException("statord could not scan the state of " + names, e);
        }
        Iterator<T> it =
                new Iterator<>() {
                    byte[] lastKey;
                    byte[] lastNs;
                    String lastState;
                    T ready;

                    @Override
                    public boolean hasNext() {
                        if (ready != null) {
                            return true;
                        }
                        try {
                            while (r.next()) {
                                String st = r.stateName();
                                if (st == null || !names.contains(st)) {
                                    continue;
                                }
                                byte[] k = r.key();
                                int nsOff = r.namespaceOffset();
                                int nsLen = r.namespaceLength();
                                if (namespace != null
                                        && !Arrays.equals(k, nsOff, nsOff + nsLen, namespace, 0, namespace.length)) {
                                    continue;
                                }
                                byte[] key = Arrays.copyOfRange(k, r.keyOffset(), r.keyOffset() + r.keyPartLength());
                                byte[] ns = Arrays.copyOfRange(k, nsOff, nsOff + nsLen);
                                if (Arrays.equals(key, lastKey)
                                        && (namespace != null || Arrays.equals(ns, lastNs))
                                        && (names.size() == 1 || st.equals(lastState))) {
                                    continue; // another entry of the same map
                                }
                                lastKey = key;
                                lastNs = ns;
                                lastState = st;
                                ready = make.apply(new byte[][] {key, ns});
                                return true;
                            }
                            // Read to the end: the scan's session and export go now, not only
                            // when (if ever) the caller closes the stream.
                            IOUtils.closeQuietly(r);
                            return false;
                        } catch (IOException e) {
                            IOUtils.closeQuietly(r);
                            throw new FlinkRuntimeException("statord failed while scanning " + names, e);
                        }
                    }

                    @Override
                    public T next() {
                        if (!hasNext()) {
                            throw new NoSuchElementException();
                        }
                        T t = ready;
                        ready = null;
                        return t;
                    }
                };
        return StreamSupport.stream(Spliterators.spliteratorUnknownSize(it, Spliterator.ORDERED), false)
                .onClose(() -> IOUtils.closeQuietly(r));
    }

    private K deserializeKey(byte[] b) {
        try {
            return keySerializer.deserialize(new DataInputDeserializer(b));
        } catch (IOException e) {
            throw new FlinkRuntimeException("a stored key does not deserialize", e);
        }
    }

    @SuppressWarnings("unchecked")
    private <N> byte[] serializeNamespace(String state, N namespace) {
        StateInfo info = states.get(state);
        if (info == null) {
            return null;
        }
        try {
            DataOutputSerializer out = new DataOutputSerializer(32);
            ((TypeSerializer<N>) info.meta.getNamespaceSerializer()).serialize(namespace, out);
            return out.getCopyOfBuffer();
        } catch (IOException e) {
            throw new FlinkRuntimeException("the namespace does not serialize", e);
        }
    }

    @Override
    public <N> Stream<K> getKeys(String state, N namespace) {
        byte[] ns = serializeNamespace(state, namespace);
        if (ns == null) {
            return Stream.empty();
        }
        return scanKeys(List.of(state), ns, kn -> deserializeKey(kn[0]));
    }

    @Override
    public <N> Stream<K> getKeys(List<String> states, N namespace) {
        List<String> known = new ArrayList<>();
        byte[] ns = null;
        for (String s : states) {
            byte[] b = serializeNamespace(s, namespace);
            if (b != null) {
                known.add(s);
                ns = b;
            }
        }
        if (known.isEmpty()) {
            return Stream.empty();
        }
        return scanKeys(known, ns, kn -> deserializeKey(kn[0])).distinct();
    }

    @Override
    @SuppressWarnings("unchecked")
    public <N> Stream<Tuple2<K, N>> getKeysAndNamespaces(String state) {
        StateInfo info = states.get(state);
        if (info == null) {
            return Stream.empty();
        }
        TypeSerializer<N> nsSer = (TypeSerializer<N>) info.meta.getNamespaceSerializer();
        return scanKeys(
                List.of(state),
                null,
                kn -> {
                    try {
                        return Tuple2.of(deserializeKey(kn[0]), nsSer.deserialize(new DataInputDeserializer(kn[1])));
                    } catch (IOException e) {
                        throw new FlinkRuntimeException("a stored namespace does not deserialize", e);
                    }
                });
    }

    @Override
    public int numKeyValueStateEntries() {
        int n = 0;
        try (PortableSnapshotReader r = scan()) {
            while (r.next()) {
                if (r.stateName() != null && states.containsKey(r.stateName())) {
                    n++;
                }
            }
        } catch (IOException e) {
            throw new FlinkRuntimeException("statord could not count the state", e);
        }
        return n;
    }

    // ------------------------------------------------------------------------
    //  Timers
    // ------------------------------------------------------------------------

    @Nonnull
    @Override
    public <T extends HeapPriorityQueueElement & PriorityComparable<? super T> & Keyed<?>>
            KeyGroupedInternalPriorityQueue<T> create(
                    @Nonnull String stateName, @Nonnull TypeSerializer<T> byteOrderedElementSerializer) {
        return priorityQueues.createOrUpdate(stateName, byteOrderedElementSerializer);
    }

    @Override
    public <T extends HeapPriorityQueueElement & PriorityComparable<? super T> & Keyed<?>>
            KeyGroupedInternalPriorityQueue<T> create(
                    @Nonnull String stateName,
                    @Nonnull TypeSerializer<T> byteOrderedElementSerializer,
                    boolean allowFutureMetadataUpdates) {
        return priorityQueues.createOrUpdate(stateName, byteOrderedElementSerializer, allowFutureMetadataUpdates);
    }

    @Override
    public boolean requiresLegacySynchronousTimerSnapshots(SnapshotType checkpointType) {
        return !checkpointType.isSavepoint();
    }

    @Override
    public boolean isSafeToReuseKVState() {
        return false;
    }

    // ------------------------------------------------------------------------
    //  Checkpoints
    // ------------------------------------------------------------------------

    /** The session the checkpoints go through. */
    public NativeSession checkpointSession() {
        return checkpoints;
    }

    public String job() {
        return job;
    }

    public String operator() {
        return operator;
    }

    @Nonnull
    @Override
    public RunnableFuture<SnapshotResult<KeyedStateHandle>> snapshot(
            long checkpointId,
            long timestamp,
            @Nonnull CheckpointStreamFactory streamFactory,
            @Nonnull CheckpointOptions checkpointOptions)
            throws Exception {
        if (checkpointOptions.getCheckpointType().isSavepoint()) {
            // A native-format savepoint (Flink sends canonical ones to savepoint()) is written
            // like a canonical one, self-contained in Flink's streams. As a statord checkpoint
            // it would not be safe: Flink never tells a backend that a savepoint completed or
            // was dropped, so the next completed checkpoint deleted it as never completed (or
            // it was kept forever), and it would be bound to this host's statord.
            SavepointResources<K> r = savepoint();
            return new SnapshotStrategyRunner<>(
                            "Stator savepoint",
                            new SavepointSnapshotStrategy<>(r.getSnapshotResources()),
                            cancelStreamRegistry,
                            r.getPreferredSnapshotExecutionType())
                    .snapshot(checkpointId, timestamp, streamFactory, checkpointOptions);
        }
        if (states.isEmpty()) {
            // Nothing to keep: an empty snapshot, as Flink's own backends return.
            return org.apache.flink.runtime.state.DoneFuture.of(SnapshotResult.empty());
        }
        // Every request made so far is in statord (and applied) before the barrier.
        synchronized (channel) {
            channel.drain();
        }
        return new SnapshotStrategyRunner<>(
                        "Stator native checkpoint",
                        checkpointStrategy,
                        cancelStreamRegistry,
                        SnapshotExecutionType.ASYNCHRONOUS)
                .snapshot(checkpointId, timestamp, streamFactory, checkpointOptions);
    }

    /**
     * A canonical savepoint: the state is fixed here (an export on a session of its own, after
     * every request made so far) and streamed into Flink's format on the snapshot thread.
     */
    @Nonnull
    @Override
    public SavepointResources<K> savepoint() throws Exception {
        PortableSnapshotReader reader = scan();
        try {
            return savepoint(reader);
        } catch (Exception | Error e) {
            IOUtils.closeQuietly(reader);
            throw e;
        }
    }

    private SavepointResources<K> savepoint(PortableSnapshotReader reader) {
        List<RegisteredKeyValueStateBackendMetaInfo<?, ?>> kv = new ArrayList<>();
        for (StateInfo i : states.values()) {
            kv.add(i.meta);
        }
        List<HeapPriorityQueueStateSnapshot<?>> queues = new ArrayList<>();
        for (HeapPriorityQueueSnapshotRestoreWrapper<?> q : priorityQueues.getRegisteredPQStates().values()) {
            queues.add(q.stateSnapshot());
        }
        return new SavepointResources<>(
                new CanonicalSavepointResources<>(
                        kv, queues, keyGroupRange, numberOfKeyGroups, keySerializer, keyGroupCompressionDecorator, reader),
                SnapshotExecutionType.ASYNCHRONOUS);
    }

    @Override
    public void notifyCheckpointComplete(long checkpointId) throws Exception {
        notify(checkpointId, NativeSession.Notify.COMPLETE);
    }

    @Override
    public void notifyCheckpointAborted(long checkpointId) throws Exception {
        notify(checkpointId, NativeSession.Notify.ABORT);
    }

    @Override
    public void notifyCheckpointSubsumed(long checkpointId) throws Exception {
        notify(checkpointId, NativeSession.Notify.SUBSUME);
    }

    private void notify(long checkpointId, NativeSession.Notify kind) throws StatorException {
        if (!disposed) {
            checkpoints.notifyCheckpoint(checkpointId, kind);
        }
    }

    @Override
    public String getBackendTypeIdentifier() {
        return StatorStateBackend.IDENTIFIER;
    }

    @Override
    public void dispose() {
        if (disposed) {
            return;
        }
        disposed = true;
        super.dispose();
        // Writes not yet in statord are dropped with the task: its state is restored from a
        // checkpoint when it runs again.
        IOUtils.closeQuietly(checkpointStrategy);
        // Under the channel's lock: a state call of another thread (queryable state) either
        // finished or finds the channel closed, never an unmapped arena.
        synchronized (channel) {
            IOUtils.closeQuietly(channel);
        }
        IOUtils.closeQuietly(checkpoints);
        states.clear();
    }

    /** The session id of a registered state (the asynchronous backend's states take it). */
    int stateId(String name) {
        StateInfo info = states.get(name);
        if (info == null || info.stateId < 0) {
            throw new IllegalStateException("state " + name + " is not registered");
        }
        return info.stateId;
    }

    ExecutionConfig executionConfig() {
        return config;
    }

    /** A view for tests: every state's session id. */
    Map<String, Integer> stateIds() {
        Map<String, Integer> m = new HashMap<>();
        states.forEach((k, v) -> m.put(k, v.stateId));
        return m;
    }

    Logger log() {
        return LOG;
    }
}
