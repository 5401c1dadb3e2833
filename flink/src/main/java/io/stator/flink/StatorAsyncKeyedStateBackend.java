package io.stator.flink;

import io.stator.flink.async.AsyncAggregatingState;
import io.stator.flink.async.AsyncListState;
import io.stator.flink.async.AsyncMapState;
import io.stator.flink.async.AsyncReducingState;
import io.stator.flink.async.AsyncValueState;
import io.stator.flink.async.StateCodec;
import io.stator.flink.async.StatorStateExecutor;

import org.apache.flink.api.common.state.v2.AggregatingStateDescriptor;
import org.apache.flink.api.common.state.v2.MapStateDescriptor;
import org.apache.flink.api.common.state.v2.ReducingStateDescriptor;
import org.apache.flink.api.common.state.v2.State;
import org.apache.flink.api.common.state.v2.StateDescriptor;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.metrics.Gauge;
import org.apache.flink.metrics.MetricGroup;
import org.apache.flink.runtime.asyncprocessing.RecordContext;
import org.apache.flink.runtime.asyncprocessing.StateExecutor;
import org.apache.flink.runtime.asyncprocessing.StateRequestHandler;
import org.apache.flink.runtime.checkpoint.CheckpointOptions;
import org.apache.flink.runtime.checkpoint.SnapshotType;
import org.apache.flink.runtime.state.AsyncKeyedStateBackend;
import org.apache.flink.runtime.state.CheckpointStreamFactory;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyGroupedInternalPriorityQueue;
import org.apache.flink.runtime.state.Keyed;
import org.apache.flink.runtime.state.KeyedStateHandle;
import org.apache.flink.runtime.state.PriorityComparable;
import org.apache.flink.runtime.state.SnapshotResult;
import org.apache.flink.runtime.state.StateSnapshotTransformer.StateSnapshotTransformFactory;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueElement;
import org.apache.flink.runtime.state.ttl.TtlTimeProvider;
import org.apache.flink.runtime.state.v2.StateDescriptorUtils;
import org.apache.flink.runtime.state.v2.internal.InternalKeyedState;
import org.apache.flink.runtime.state.v2.ttl.TtlStateFactory;
import org.apache.flink.util.FlinkRuntimeException;
import org.apache.flink.util.IOUtils;
import org.apache.flink.util.Preconditions;

import javax.annotation.Nonnull;
import javax.annotation.Nullable;

import java.io.IOException;
import java.util.HashMap;
import java.util.Map;
import java.util.concurrent.RunnableFuture;

/**
 * Flink's asynchronous keyed state backend (State V2) on Stator: state requests of many records
 * in flight at once from one task, through {@link StatorStateExecutor}.
 *
 * <p>It is the synchronous backend's session, restore, checkpoints, savepoints and timers with
 * an asynchronous request path: each v2 state is registered as its v1 equivalent (a v2 list of
 * {@code T} as a v1 list of {@code T}, and so on), so the two backends store the same bytes and
 * take each other's checkpoints, savepoints and rescales.
 */
public final class StatorAsyncKeyedStateBackend<K> implements AsyncKeyedStateBackend<K> {

    private final StatorKeyedStateBackend<K> backend;
    private final TtlTimeProvider ttlTimeProvider;
    private final Map<String, InternalKeyedState<K, ?, ?>> states = new HashMap<>();
    private StateRequestHandler handler;
    private volatile StatorStateExecutor executor;

    StatorAsyncKeyedStateBackend(
            StatorKeyedStateBackend<K> backend, TtlTimeProvider ttlTimeProvider, MetricGroup metrics) {
        this.backend = backend;
        this.ttlTimeProvider = ttlTimeProvider;
        if (metrics != null) {
            // The operator's state requests in statord: now, and the most at once.
            metrics.<Long, Gauge<Long>>gauge(METRIC_IN_FLIGHT, () -> {
                StatorStateExecutor e = executor;
                return e == null ? 0L : e.inFlight();
            });
            metrics.<Long, Gauge<Long>>gauge(METRIC_MAX_IN_FLIGHT, () -> {
                StatorStateExecutor e = executor;
                return e == null ? 0L : e.maxInFlight();
            });
        }
    }

    /** Operator metrics: state requests in statord now, and the most at once. */
    public static final String METRIC_IN_FLIGHT = "statorRequestsInFlight";

    public static final String METRIC_MAX_IN_FLIGHT = "statorRequestsInFlightMax";

    /** The synchronous backend underneath (tests). */
    StatorKeyedStateBackend<K> backend() {
        return backend;
    }

    @Override
    public void setup(@Nonnull StateRequestHandler stateRequestHandler) {
        this.handler = stateRequestHandler;
    }

    @Override
    @SuppressWarnings("unchecked")
    public <N, S extends State, SV> S getOrCreateKeyedState(
            N defaultNamespace, TypeSerializer<N> namespaceSerializer, StateDescriptor<SV> desc) throws Exception {
        Preconditions.checkNotNull(namespaceSerializer, "Namespace serializer");
        InternalKeyedState<K, ?, ?> s = states.get(desc.getStateId());
        if (s == null) {
            if (!desc.isSerializerInitialized()) {
                desc.initializeSerializerUnlessSet(backend.executionConfig());
            }
            s = TtlStateFactory.createStateAndWrapWithTtlIfEnabled(
                    defaultNamespace, namespaceSerializer, desc, this, ttlTimeProvider);
            states.put(desc.getStateId(), s);
        }
        return (S) s;
    }

    @Nonnull
    @Override
    @SuppressWarnings({"unchecked", "rawtypes"})
    public <N, S extends InternalKeyedState, SV> S createStateInternal(
            @Nonnull N defaultNamespace,
            @Nonnull TypeSerializer<N> namespaceSerializer,
            @Nonnull StateDescriptor<SV> desc)
            throws Exception {
        Preconditions.checkNotNull(handler, "setup() must be called before a state is created");
        if (!desc.isSerializerInitialized()) {
            desc.initializeSerializerUnlessSet(backend.executionConfig());
        }
        // The v1 twin registers the state (or checks it against its restored meta information)
        // exactly as the synchronous backend does.
        backend.createOrUpdateInternalState(
                namespaceSerializer,
                StateDescriptorUtils.transformFromV2ToV1(desc),
                StateSnapshotTransformFactory.noTransform());
        int id = backend.stateId(desc.getStateId());
        TypeSerializer<SV> value = desc.getSerializer();
        S state;
        switch (desc.getType()) {
            case VALUE:
                state = (S) new AsyncValueState<>(handler, value, codec(id, StateCodec.Kind.VALUE, defaultNamespace, namespaceSerializer, value, null));
                break;
            case LIST:
                state = (S) new AsyncListState<>(handler, value, codec(id, StateCodec.Kind.LIST, defaultNamespace, namespaceSerializer, value, null));
                break;
            case MAP:
                TypeSerializer<?> userKey = ((MapStateDescriptor<?, ?>) desc).getUserKeySerializer();
                state = (S) new AsyncMapState<>(handler, value, codec(id, StateCodec.Kind.MAP, defaultNamespace, namespaceSerializer, value, userKey));
                break;
            case REDUCING:
                state = (S) new AsyncReducingState<>(
                        handler,
                        ((ReducingStateDescriptor<SV>) desc).getReduceFunction(),
                        value,
                        codec(id, StateCodec.Kind.REDUCING, defaultNamespace, namespaceSerializer, value, null));
                break;
            case AGGREGATING:
                state = (S) new AsyncAggregatingState<>(
                        handler,
                        ((AggregatingStateDescriptor) desc).getAggregateFunction(),
                        value,
                        codec(id, StateCodec.Kind.AGGREGATING, defaultNamespace, namespaceSerializer, value, null));
                break;
            default:
                throw new FlinkRuntimeException("Stator does not keep " + desc.getType() + " state");
        }
        return state;
    }

    private static StateCodec codec(
            int id,
            StateCodec.Kind kind,
            Object defaultNamespace,
            TypeSerializer<?> ns,
            TypeSerializer<?> value,
            TypeSerializer<?> userKey) {
        return new StateCodec(id, kind, defaultNamespace, ns, value, userKey);
    }

    /**
     * The executor of the one asynchronous execution controller Flink builds per operator; a
     * second one is made only after the first shut down (both would own the session's channel).
     */
    @Nonnull
    @Override
    public synchronized StateExecutor createStateExecutor() {
        if (executor != null && !executor.isShutdown()) {
            throw new IllegalStateException(
                    "the Stator backend of " + backend.operator() + " has a state executor already");
        }
        try {
            executor = new StatorStateExecutor(backend.channel(), backend.getKeySerializer(), backend.operator());
        } catch (IOException e) {
            throw new FlinkRuntimeException("statord could not start the state executor", e);
        }
        return executor;
    }

    @Override
    public KeyGroupRange getKeyGroupRange() {
        return backend.getKeyGroupRange();
    }

    @Override
    public void switchContext(@Nullable RecordContext<K> context) {
        if (context != null) {
            backend.setCurrentKeyAndKeyGroup(context.getKey(), context.getKeyGroup());
        }
    }

    @Nonnull
    @Override
    public RunnableFuture<SnapshotResult<KeyedStateHandle>> snapshot(
            long checkpointId,
            long timestamp,
            @Nonnull CheckpointStreamFactory streamFactory,
            @Nonnull CheckpointOptions checkpointOptions)
            throws Exception {
        // Flink drains the operator's in-flight records before the barrier; the synchronous
        // backend's snapshot then hands statord whatever is still pending before it.
        return backend.snapshot(checkpointId, timestamp, streamFactory, checkpointOptions);
    }

    @Override
    public void notifyCheckpointComplete(long checkpointId) throws Exception {
        backend.notifyCheckpointComplete(checkpointId);
    }

    @Override
    public void notifyCheckpointAborted(long checkpointId) throws Exception {
        backend.notifyCheckpointAborted(checkpointId);
    }

    @Override
    public void notifyCheckpointSubsumed(long checkpointId) throws Exception {
        backend.notifyCheckpointSubsumed(checkpointId);
    }

    @Nonnull
    @Override
    public <T extends HeapPriorityQueueElement & PriorityComparable<? super T> & Keyed<?>>
            KeyGroupedInternalPriorityQueue<T> create(
                    @Nonnull String stateName, @Nonnull TypeSerializer<T> byteOrderedElementSerializer) {
        return backend.create(stateName, byteOrderedElementSerializer);
    }

    @Override
    public <T extends HeapPriorityQueueElement & PriorityComparable<? super T> & Keyed<?>>
            KeyGroupedInternalPriorityQueue<T> create(
                    @Nonnull String stateName,
                    @Nonnull TypeSerializer<T> byteOrderedElementSerializer,
                    boolean allowFutureMetadataUpdates) {
        return backend.create(stateName, byteOrderedElementSerializer, allowFutureMetadataUpdates);
    }

    @Override
    public boolean requiresLegacySynchronousTimerSnapshots(SnapshotType checkpointType) {
        return backend.requiresLegacySynchronousTimerSnapshots(checkpointType);
    }

    @Override
    public boolean isSafeToReuseKVState() {
        return false;
    }

    @Override
    public String getBackendTypeIdentifier() {
        return StatorStateBackend.IDENTIFIER;
    }

    @Override
    public synchronized void dispose() {
        if (executor != null) {
            executor.shutdown();
        }
        states.clear();
        backend.dispose();
    }

    @Override
    public void close() throws IOException {
        IOUtils.closeQuietly(backend);
    }
}
