package io.stator.flink.snapshot;

import io.stator.flink.StatorKeyedStateBackend;
import io.stator.flink.jni.NativeSession;

import org.apache.flink.core.fs.CloseableRegistry;
import org.apache.flink.core.fs.Path;
import org.apache.flink.core.memory.DataOutputViewStreamWrapper;
import org.apache.flink.runtime.checkpoint.CheckpointOptions;
import org.apache.flink.runtime.state.CheckpointStateOutputStream;
import org.apache.flink.runtime.state.CheckpointStreamFactory;
import org.apache.flink.runtime.state.CheckpointedStateScope;
import org.apache.flink.runtime.state.KeyGroupRangeOffsets;
import org.apache.flink.runtime.state.KeyGroupsStateHandle;
import org.apache.flink.runtime.state.KeyedBackendSerializationProxy;
import org.apache.flink.runtime.state.KeyedStateHandle;
import org.apache.flink.runtime.state.SnapshotResources;
import org.apache.flink.runtime.state.SnapshotResult;
import org.apache.flink.runtime.state.SnapshotStrategy;
import org.apache.flink.runtime.state.StreamStateHandle;
import org.apache.flink.runtime.state.filesystem.FileStateHandle;
import org.apache.flink.runtime.state.memory.ByteStreamStateHandle;
import org.apache.flink.runtime.state.metainfo.StateMetaInfoSnapshot;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import java.io.Closeable;
import java.util.List;
import java.util.concurrent.CancellationException;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * A native checkpoint: the synchronous part takes statord's barrier (every request the task
 * made before is in it, none after; flat in state size); the asynchronous part waits until the
 * checkpoint's manifest is durable and writes its handle, with Flink's serialization proxy, into
 * a small stream that Flink keeps as a {@link KeyGroupsStateHandle} ({@link
 * StatorCheckpointHandle}) over a {@code stator:} path ({@link StatorFileSystem}), through which
 * Flink's discard of it releases it in statord. No state bytes are copied.
 */
public final class NativeCheckpointStrategy<K>
        implements SnapshotStrategy<KeyedStateHandle, NativeCheckpointStrategy.Barrier>, Closeable {

    private static final Logger LOG = LoggerFactory.getLogger(NativeCheckpointStrategy.class);

    /** How long one wait for a checkpoint holds the checkpoint session (others use it between). */
    private static final int WAIT_SLICE_MS = 5;

    private final StatorKeyedStateBackend<K> backend;
    private volatile boolean closed;
    /** The warning about streams Flink's discard cannot release, given once. */
    private volatile boolean warnedUnreleasable;

    public NativeCheckpointStrategy(StatorKeyedStateBackend<K> backend) {
        this.backend = backend;
    }

    /** The synchronous part's outcome: the barrier's checkpoint and the states it holds. */
    static final class Barrier implements SnapshotResources {
        final long checkpointId;
        final List<StateMetaInfoSnapshot> metaInfo;

        Barrier(long checkpointId, List<StateMetaInfoSnapshot> metaInfo) {
            this.checkpointId = checkpointId;
            this.metaInfo = metaInfo;
        }

        @Override
        public void release() {}
    }

    @Override
    public Barrier syncPrepareResources(long checkpointId) throws Exception {
        backend.checkpointSession().checkpoint(checkpointId);
        return new Barrier(checkpointId, backend.metaInfoSnapshots());
    }

    @Override
    public SnapshotResultSupplier<KeyedStateHandle> asyncSnapshot(
            Barrier barrier,
            long checkpointId,
            long timestamp,
            CheckpointStreamFactory streamFactory,
            CheckpointOptions checkpointOptions) {
        return registry -> {
            byte[] handle = awaitDurable(barrier.checkpointId, registry);
            StatorCheckpointHandle h =
                    new StatorCheckpointHandle(
                            backend.job(),
                            backend.operator(),
                            backend.getKeyGroupRange(),
                            backend.getNumberOfKeyGroups(),
                            handle);
            KeyedBackendSerializationProxy<K> proxy =
                    new KeyedBackendSerializationProxy<>(
                            backend.getKeySerializer(), barrier.metaInfo, false);
            // Through Flink's checkpoint stream, as any backend writes its snapshot (Flink's
            // tests block on it to check a snapshot runs in its asynchronous part).
            CheckpointStateOutputStream out =
                    streamFactory.createCheckpointStateOutputStream(CheckpointedStateScope.EXCLUSIVE);
            registry.registerCloseable(out);
            try {
                h.write(new DataOutputViewStreamWrapper(out), proxy);
            } finally {
                registry.unregisterCloseable(out);
            }
            StreamStateHandle kept = releasable(out.closeAndGetHandle());
            return SnapshotResult.of(
                    new KeyGroupsStateHandle(new KeyGroupRangeOffsets(backend.getKeyGroupRange()), kept));
        };
    }

    /**
     * The stream as Flink will keep it: a stream small enough to stay in Flink's metadata (a
     * {@link ByteStreamStateHandle}, under Flink's memory threshold) goes into a {@code stator:}
     * path instead, through which Flink's discard of it releases it in statord. A stream Flink
     * put in a file of its checkpoint storage (a key serializer's snapshot of tens of KiB, or a
     * threshold of 0) stays there, and its discard does not reach statord.
     */
    private StreamStateHandle releasable(StreamStateHandle stream) {
        if (stream instanceof ByteStreamStateHandle b) {
            // Absolute: the job manager resolves it, in another working directory.
            String socket = java.nio.file.Path.of(backend.checkpointSession().socket()).toAbsolutePath().toString();
            Path path = StatorFileSystem.path(socket, b.getData());
            if (path != null) {
                return new FileStateHandle(path, b.getData().length);
            }
        }
        if (!warnedUnreleasable) {
            warnedUnreleasable = true;
            LOG.warn(
                    "The checkpoints of {}/{} are kept as {} in Flink's checkpoint storage: Flink's discard of one "
                            + "will not release it in statord",
                    backend.job(),
                    backend.operator(),
                    stream.getClass().getSimpleName());
        }
        return stream;
    }

    private byte[] awaitDurable(long checkpointId, CloseableRegistry registry) throws Exception {
        AtomicBoolean cancelled = new AtomicBoolean();
        Closeable onCancel = () -> cancelled.set(true);
        registry.registerCloseable(onCancel);
        try {
            NativeSession s = backend.checkpointSession();
            while (true) {
                if (cancelled.get() || closed) {
                    throw new CancellationException("checkpoint " + checkpointId + " was cancelled");
                }
                byte[] handle = s.checkpointWait(checkpointId, WAIT_SLICE_MS);
                if (handle != null) {
                    return handle;
                }
            }
        } finally {
            registry.unregisterCloseable(onCancel);
        }
    }

    @Override
    public void close() {
        closed = true;
    }
}
