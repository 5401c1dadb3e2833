package io.stator.flink;

import io.stator.flink.jni.NativeSession;
import io.stator.flink.jni.StatorException;
import io.stator.flink.session.RequestChannel;
import io.stator.flink.snapshot.CanonicalRestore;
import io.stator.flink.snapshot.StatorCheckpointHandle;
import io.stator.flink.state.Kinds;

import org.apache.flink.api.common.TaskInfo;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.TypeSerializerSchemaCompatibility;
import org.apache.flink.core.fs.CloseableRegistry;
import org.apache.flink.runtime.execution.Environment;
import org.apache.flink.runtime.state.AbstractStateBackend;
import org.apache.flink.runtime.state.BackendBuildingException;
import org.apache.flink.runtime.state.InternalKeyContextImpl;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyGroupsStateHandle;
import org.apache.flink.runtime.state.KeyedStateHandle;
import org.apache.flink.runtime.state.RegisteredKeyValueStateBackendMetaInfo;
import org.apache.flink.runtime.state.StateBackend.KeyedStateBackendParameters;
import org.apache.flink.runtime.state.StateSerializerProvider;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueSetFactory;
import org.apache.flink.runtime.state.heap.HeapPriorityQueueSnapshotRestoreWrapper;
import org.apache.flink.runtime.state.metainfo.StateMetaInfoSnapshot;
import org.apache.flink.runtime.state.metrics.LatencyTrackingStateConfig;
import org.apache.flink.runtime.state.metrics.SizeTrackingStateConfig;
import org.apache.flink.util.IOUtils;
import org.apache.flink.util.StateMigrationException;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Set;
import java.util.concurrent.ThreadLocalRandom;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * Opens a subtask's sessions and restores its state: a checkpoint of the same job and operator
 * by reference (statord adds the checkpoint's segments, clipped to the subtask's key groups),
 * one of another job by streaming it from that job's checkpoint into this one, and no
 * checkpoint at all by emptying whatever an earlier attempt left in the subtask's key groups.
 */
final class StatorKeyedStateBackendBuilder<K> {

    private static final Logger LOG = LoggerFactory.getLogger(StatorKeyedStateBackendBuilder.class);

    /** Flink's operator identifier: {@code <class>_<operator id>_(<subtask>/<parallelism>)}. */
    private static final Pattern OPERATOR_ID = Pattern.compile(".*_([0-9a-f]{32})_\\(\\d+/\\d+\\)$");

    /** The checkpoint session: few requests, no results beyond handles. */
    private static final int SMALL_QUEUE = 64;
    private static final long SMALL_ARENA = 1 << 20;

    private final KeyedStateBackendParameters<K> p;
    private final String socket;
    private final String job;
    private final int queueEntries;
    private final long arenaBytes;
    private final int inFlight;
    private final int writeBatch;
    private final long spinNanos;
    private final LatencyTrackingStateConfig latency;
    private final SizeTrackingStateConfig size;

    StatorKeyedStateBackendBuilder(
            KeyedStateBackendParameters<K> p,
            String socket,
            String job,
            int queueEntries,
            long arenaBytes,
            int inFlight,
            int writeBatch,
            long spinNanos,
            LatencyTrackingStateConfig latency,
            SizeTrackingStateConfig size) {
        this.p = p;
        this.socket = socket;
        this.job = job;
        this.queueEntries = queueEntries;
        this.arenaBytes = arenaBytes;
        this.inFlight = inFlight;
        this.writeBatch = writeBatch;
        this.spinNanos = spinNanos;
        this.latency = latency;
        this.size = size;
    }

    /** The operator's stable id (its {@code OperatorID}), or the whole identifier. */
    static String operatorName(String identifier) {
        Matcher m = OPERATOR_ID.matcher(identifier);
        return m.matches() ? m.group(1) : identifier;
    }

    private NativeSession.Options options(String job, String operator) {
        NativeSession.Options o = new NativeSession.Options();
        KeyGroupRange range = p.getKeyGroupRange();
        o.socket = socket;
        o.job = job;
        o.operator = operator;
        o.maxParallelism = p.getNumberOfKeyGroups();
        o.keyGroupFirst = range.getStartKeyGroup();
        o.keyGroupLast = range.getEndKeyGroup();
        Environment env = p.getEnv();
        TaskInfo task = env == null ? null : env.getTaskInfo();
        int parallelism = task == null ? 1 : task.getNumberOfParallelSubtasks();
        int subtask = task == null ? 0 : task.getIndexOfThisSubtask();
        if (parallelism < 1 || parallelism > o.maxParallelism || subtask < 0 || subtask >= parallelism) {
            parallelism = 1;
            subtask = 0;
        }
        o.subtask = subtask;
        o.parallelism = parallelism;
        o.sqEntries = SMALL_QUEUE;
        o.cqEntries = SMALL_QUEUE;
        o.arenaBytes = SMALL_ARENA;
        o.chunkSlots = 2;
        o.spinNanos = spinNanos;
        return o;
    }

    private NativeSession open(NativeSession.Options o) throws StatorException {
        try {
            return NativeSession.open(o);
        } catch (StatorException e) {
            if (e.code() == StatorException.REFUSED
                    && (e.detail() == StatorException.CONTROL_MALFORMED
                            || e.detail() == StatorException.CONTROL_VERSION)) {
                // An older (or newer) statord: name both sides so the operator knows which to
                // upgrade.
                throw new StatorException(
                        e.code(),
                        e.detail(),
                        e.getMessage()
                                + " (statord at "
                                + o.socket
                                + " does not speak the control protocol of this stator-flink "
                                + NativeSession.libraryVersion()
                                + "; run statord "
                                + NativeSession.libraryVersion()
                                + ")");
            }
            throw e;
        }
    }

    StatorKeyedStateBackend<K> build() throws BackendBuildingException {
        String jobName = job.isEmpty() ? p.getJobID().toHexString() : job;
        String operator = operatorName(p.getOperatorIdentifier());
        ClassLoader userCode = p.getEnv().getUserCodeClassLoader().asClassLoader();
        NativeSession data = null;
        NativeSession checkpoints = null;
        RequestChannel channel = null;
        try {
            NativeSession.Options o = options(jobName, operator);
            checkpoints = open(o);
            NativeSession.Options d = options(jobName, operator);
            d.sqEntries = queueEntries;
            d.cqEntries = queueEntries;
            d.arenaBytes = arenaBytes;
            data = open(d);
            channel = new RequestChannel(data, (int) Math.min(arenaBytes / 2, 1 << 30), inFlight, writeBatch);
            LinkedHashMap<String, StatorKeyedStateBackend.StateInfo> states = new LinkedHashMap<>();
            LinkedHashMap<String, HeapPriorityQueueSnapshotRestoreWrapper<?>> queues = new LinkedHashMap<>();
            HeapPriorityQueueSetFactory queueFactory =
                    new HeapPriorityQueueSetFactory(p.getKeyGroupRange(), p.getNumberOfKeyGroups(), 128);
            restore(data, channel, o, userCode, states, queues, queueFactory);
            return new StatorKeyedStateBackend<>(
                    p.getKvStateRegistry(),
                    p.getKeySerializer(),
                    userCode,
                    p.getEnv().getExecutionConfig(),
                    p.getTtlTimeProvider(),
                    latency,
                    size,
                    // The task's registry is for the restore and closes after it (as RocksDB's
                    // builder does, the backend gets its own, closed on dispose).
                    new CloseableRegistry(),
                    AbstractStateBackend.getCompressionDecorator(p.getEnv().getExecutionConfig()),
                    new InternalKeyContextImpl<>(p.getKeyGroupRange(), p.getNumberOfKeyGroups()),
                    channel,
                    checkpoints,
                    options(jobName, operator),
                    states,
                    queues,
                    queueFactory);
        } catch (Exception e) {
            IOUtils.closeQuietly(channel);
            IOUtils.closeQuietly(data);
            IOUtils.closeQuietly(checkpoints);
            if (e instanceof BackendBuildingException) {
                throw (BackendBuildingException) e;
            }
            throw new BackendBuildingException(
                    "Stator could not open the keyed state of " + p.getOperatorIdentifier() + ": " + e.getMessage(), e);
        }
    }

    private void restore(
            NativeSession data,
            RequestChannel channel,
            NativeSession.Options base,
            ClassLoader userCode,
            LinkedHashMap<String, StatorKeyedStateBackend.StateInfo> states,
            LinkedHashMap<String, HeapPriorityQueueSnapshotRestoreWrapper<?>> queues,
            HeapPriorityQueueSetFactory queueFactory)
            throws Exception {
        List<StatorCheckpointHandle> checkpoints = new ArrayList<>();
        List<KeyedStateHandle> canonical = new ArrayList<>();
        for (KeyedStateHandle h : p.getStateHandles()) {
            if (h == null) {
                continue;
            }
            if (!(h instanceof KeyGroupsStateHandle)) {
                throw new BackendBuildingException(
                        "Stator cannot restore a "
                                + h.getClass().getSimpleName()
                                + " (a checkpoint of another state backend); move the job with a "
                                + "canonical savepoint instead");
            }
            StatorCheckpointHandle c = StatorCheckpointHandle.read((KeyGroupsStateHandle) h, userCode);
            if (c == null) {
                canonical.add(h);
            } else {
                checkpoints.add(c);
            }
        }
        if (!checkpoints.isEmpty() && !canonical.isEmpty()) {
            throw new BackendBuildingException(
                    "the state to restore mixes Stator checkpoints and snapshots in Flink's own format");
        }
        long id = ThreadLocalRandom.current().nextLong(1, Long.MAX_VALUE);
        if (checkpoints.isEmpty()) {
            // A fresh start (or a savepoint's restore) sees nothing an earlier attempt left.
            data.reset(id);
            if (!canonical.isEmpty()) {
                restoreCanonical(canonical, channel, userCode, states, queues, queueFactory);
            }
            return;
        }
        checkKeySerializer(checkpoints.get(0));
        for (StatorCheckpointHandle c : checkpoints) {
            for (StateMetaInfoSnapshot s : c.proxy.getStateMetaInfoSnapshots()) {
                if (s.getBackendStateType() == StateMetaInfoSnapshot.BackendStateType.KEY_VALUE) {
                    states.putIfAbsent(
                            s.getName(),
                            new StatorKeyedStateBackend.StateInfo(new RegisteredKeyValueStateBackendMetaInfo<>(s)));
                }
            }
        }
        Set<List<String>> owners = new LinkedHashSet<>();
        List<byte[]> handles = new ArrayList<>();
        for (StatorCheckpointHandle c : checkpoints) {
            owners.add(List.of(c.job, c.operator));
            handles.add(c.handle);
        }
        if (owners.size() > 1) {
            throw new BackendBuildingException("the checkpoint handles to restore belong to several jobs: " + owners);
        }
        List<String> owner = owners.iterator().next();
        if (owner.get(0).equals(base.job) && owner.get(1).equals(base.operator)) {
            data.restore(handles);
        } else {
            // Another job's checkpoint: copy its state in (its segments belong to that job).
            LOG.info(
                    "Restoring {}/{} from a checkpoint of {}/{}: its state is copied in",
                    base.job,
                    base.operator,
                    owner.get(0),
                    owner.get(1));
            NativeSession.Options o = options(owner.get(0), owner.get(1));
            try (NativeSession from = open(o)) {
                NativeSession.transfer(from, data, id, handles);
            }
        }
    }

    private void restoreCanonical(
            List<KeyedStateHandle> handles,
            RequestChannel channel,
            ClassLoader userCode,
            LinkedHashMap<String, StatorKeyedStateBackend.StateInfo> states,
            LinkedHashMap<String, HeapPriorityQueueSnapshotRestoreWrapper<?>> queues,
            HeapPriorityQueueSetFactory queueFactory)
            throws Exception {
        StateSerializerProvider<K> keys = StateSerializerProvider.fromNewRegisteredSerializer(p.getKeySerializer());
        CanonicalRestore<K> restore =
                new CanonicalRestore<>(p.getKeyGroupRange(), p.getNumberOfKeyGroups(), userCode, keys, channel);
        long n =
                restore.restore(
                        handles,
                        meta -> {
                            StatorKeyedStateBackend.StateInfo info =
                                    states.computeIfAbsent(meta.getName(), k -> new StatorKeyedStateBackend.StateInfo(meta));
                            if (info.stateId < 0) {
                                info.stateId =
                                        channel.session().register(meta.getName(), Kinds.of(meta.getStateType()));
                            }
                            return info.stateId;
                        },
                        queues,
                        queueFactory);
        LOG.info("Restored {} entries of {} from Flink's canonical format", n, p.getOperatorIdentifier());
    }

    private void checkKeySerializer(StatorCheckpointHandle c) throws StateMigrationException {
        TypeSerializer<K> keySerializer = p.getKeySerializer();
        StateSerializerProvider<K> provider = StateSerializerProvider.fromNewRegisteredSerializer(keySerializer);
        @SuppressWarnings("unchecked")
        TypeSerializerSchemaCompatibility<K> compat =
                provider.setPreviousSerializerSnapshotForRestoredState(
                        (org.apache.flink.api.common.typeutils.TypeSerializerSnapshot<K>) c.proxy.getKeySerializerSnapshot());
        if (compat.isCompatibleAfterMigration() || compat.isIncompatible()) {
            throw new StateMigrationException(
                    "The new key serializer (" + keySerializer + ") must be compatible with the checkpoint's.");
        }
    }
}
