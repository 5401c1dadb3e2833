package io.stator.flink;

import io.stator.flink.snapshot.StatorFileSystem;
import io.stator.flink.testutils.Statord;

import org.apache.flink.api.common.JobID;
import org.apache.flink.api.common.state.CheckpointListener;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.common.typeutils.base.IntSerializer;
import org.apache.flink.api.common.typeutils.base.LongSerializer;
import org.apache.flink.api.common.typeutils.base.StringSerializer;
import org.apache.flink.core.execution.SavepointFormatType;
import org.apache.flink.core.fs.CloseableRegistry;
import org.apache.flink.runtime.checkpoint.CheckpointOptions;
import org.apache.flink.runtime.checkpoint.SavepointType;
import org.apache.flink.runtime.operators.testutils.MockEnvironment;
import org.apache.flink.runtime.state.CheckpointStorageLocationReference;
import org.apache.flink.runtime.state.CheckpointStreamFactory;
import org.apache.flink.runtime.state.CheckpointableKeyedStateBackend;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyGroupRangeAssignment;
import org.apache.flink.runtime.state.KeyGroupsStateHandle;
import org.apache.flink.runtime.state.KeyedStateHandle;
import org.apache.flink.runtime.state.KeyedStateBackendParametersImpl;
import org.apache.flink.runtime.state.SavepointSnapshotStrategy;
import org.apache.flink.runtime.state.SnapshotExecutionType;
import org.apache.flink.runtime.state.SnapshotResult;
import org.apache.flink.runtime.state.SnapshotStrategyRunner;
import org.apache.flink.runtime.state.StateBackend;
import org.apache.flink.queryablestate.client.state.serialization.KvStateSerializer;
import org.apache.flink.runtime.state.VoidNamespace;
import org.apache.flink.runtime.state.internal.InternalKvState;
import org.apache.flink.runtime.state.VoidNamespaceSerializer;
import org.apache.flink.runtime.state.hashmap.HashMapStateBackend;
import org.apache.flink.runtime.state.filesystem.FileStateHandle;
import org.apache.flink.runtime.state.memory.ByteStreamStateHandle;
import org.apache.flink.runtime.state.storage.JobManagerCheckpointStorage;
import org.apache.flink.runtime.state.ttl.TtlTimeProvider;
import org.apache.flink.metrics.groups.UnregisteredMetricsGroup;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.io.TempDir;

import java.io.DataInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.net.StandardProtocolFamily;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.channels.Channels;
import java.nio.channels.ServerSocketChannel;
import java.nio.channels.SocketChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Collection;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.RunnableFuture;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

/**
 * Restores the suite does not reach: a checkpoint of another job (streamed in), savepoints in
 * Flink's canonical format both ways with the HashMap backend, and refusals of bad input, each
 * against a real statord.
 */
class StatorRestoreTest {

    private static final int MAX_PARALLELISM = 16;
    private static final int KEYS = 500;

    @TempDir static Path dir;
    private static Statord statord;

    @BeforeAll
    static void start() throws Exception {
        statord = new Statord(dir).start();
    }

    @AfterAll
    static void stop() throws Exception {
        statord.close();
    }

    private static StatorStateBackend stator(String job) {
        return new StatorStateBackend().setSocket(statord.socket()).setJob(job).setArenaBytes(4 << 20);
    }

    private static CheckpointableKeyedStateBackend<Integer> backend(
            StateBackend b, KeyGroupRange range, Collection<KeyedStateHandle> handles) throws Exception {
        return backend(b, IntSerializer.INSTANCE, range, handles);
    }

    private static <K> CheckpointableKeyedStateBackend<K> backend(
            StateBackend b, TypeSerializer<K> keys, KeyGroupRange range, Collection<KeyedStateHandle> handles)
            throws Exception {
        MockEnvironment env = MockEnvironment.builder().build();
        return b.createKeyedStateBackend(
                new KeyedStateBackendParametersImpl<>(
                        env,
                        new JobID(),
                        "StreamMap_0123456789abcdef0123456789abcdef_(1/1)",
                        keys,
                        MAX_PARALLELISM,
                        range,
                        env.getTaskKvStateRegistry(),
                        TtlTimeProvider.DEFAULT,
                        new UnregisteredMetricsGroup(),
                        (name, value) -> {},
                        handles,
                        new CloseableRegistry(),
                        1.0));
    }

    private static final KeyGroupRange ALL = new KeyGroupRange(0, MAX_PARALLELISM - 1);
    private static final ValueStateDescriptor<Long> VALUE = new ValueStateDescriptor<>("value", LongSerializer.INSTANCE);
    private static final ListStateDescriptor<String> LIST = new ListStateDescriptor<>("list", StringSerializer.INSTANCE);
    private static final MapStateDescriptor<Integer, String> MAP =
            new MapStateDescriptor<>("map", IntSerializer.INSTANCE, StringSerializer.INSTANCE);

    /** Writes a known state for every key of the range. */
    private static void write(CheckpointableKeyedStateBackend<Integer> b) throws Exception {
        ValueState<Long> v = b.getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE, VALUE);
        ListState<String> l = b.getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE, LIST);
        MapState<Integer, String> m = b.getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE, MAP);
        for (int k = 0; k < KEYS; k++) {
            if (!b.getKeyGroupRange().contains(KeyGroupRangeAssignment.assignToKeyGroup(k, MAX_PARALLELISM))) {
                continue;
            }
            b.setCurrentKey(k);
            v.update((long) k * 7);
            l.add("a" + k);
            l.add("b" + k);
            m.put(k, "x" + k);
            m.put(-k - 1, null);
        }
    }

    /** Reads every key of the backend's range back into a model. */
    private static Map<Integer, String> read(CheckpointableKeyedStateBackend<Integer> b) throws Exception {
        ValueState<Long> v = b.getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE, VALUE);
        ListState<String> l = b.getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE, LIST);
        MapState<Integer, String> m = b.getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE, MAP);
        Map<Integer, String> out = new HashMap<>();
        for (int k = 0; k < KEYS; k++) {
            if (!b.getKeyGroupRange().contains(KeyGroupRangeAssignment.assignToKeyGroup(k, MAX_PARALLELISM))) {
                continue;
            }
            b.setCurrentKey(k);
            List<String> list = new ArrayList<>();
            Iterable<String> got = l.get();
            if (got != null) {
                got.forEach(list::add);
            }
            Map<Integer, String> map = new java.util.TreeMap<>();
            for (Map.Entry<Integer, String> e : m.entries()) {
                map.put(e.getKey(), e.getValue());
            }
            out.put(k, v.value() + "|" + list + "|" + map);
        }
        return out;
    }

    private static Map<Integer, String> expected(KeyGroupRange range) {
        Map<Integer, String> out = new HashMap<>();
        for (int k = 0; k < KEYS; k++) {
            if (range.contains(KeyGroupRangeAssignment.assignToKeyGroup(k, MAX_PARALLELISM))) {
                Map<Integer, String> map = new java.util.TreeMap<>();
                map.put(k, "x" + k);
                map.put(-k - 1, null);
                out.put(k, ((long) k * 7) + "|[a" + k + ", b" + k + "]|" + map);
            }
        }
        return out;
    }

    private static CheckpointStreamFactory streams() throws Exception {
        return new JobManagerCheckpointStorage()
                .createCheckpointStorage(new JobID())
                .resolveCheckpointStorageLocation(1L, CheckpointStorageLocationReference.getDefault());
    }

    private static KeyedStateHandle run(RunnableFuture<SnapshotResult<KeyedStateHandle>> f) throws Exception {
        f.run();
        return f.get().getJobManagerOwnedSnapshot();
    }

    private static KeyedStateHandle checkpoint(CheckpointableKeyedStateBackend<Integer> b, long id) throws Exception {
        return run(b.snapshot(id, id, streams(), CheckpointOptions.forCheckpointWithDefaultLocation()));
    }

    private static KeyedStateHandle savepoint(CheckpointableKeyedStateBackend<Integer> b, long id) throws Exception {
        SavepointSnapshotStrategy<Integer> s = new SavepointSnapshotStrategy<>(b.savepoint().getSnapshotResources());
        return run(
                new SnapshotStrategyRunner<>("savepoint", s, new CloseableRegistry(), SnapshotExecutionType.SYNCHRONOUS)
                        .snapshot(
                                id,
                                id,
                                streams(),
                                CheckpointOptions.alignedNoTimeout(
                                        SavepointType.savepoint(SavepointFormatType.CANONICAL),
                                        CheckpointStorageLocationReference.getDefault())));
    }

    private static void dispose(CheckpointableKeyedStateBackend<Integer> b) throws Exception {
        b.close();
        b.dispose();
    }

    @Test
    void aCheckpointOfAnotherJobIsCopiedInAndRescales() throws Exception {
        CheckpointableKeyedStateBackend<Integer> a = backend(stator("job-a"), new KeyGroupRange(0, 7), List.of());
        CheckpointableKeyedStateBackend<Integer> b = backend(stator("job-a"), new KeyGroupRange(8, 15), List.of());
        write(a);
        write(b);
        KeyedStateHandle ha = checkpoint(a, 1);
        KeyedStateHandle hb = checkpoint(b, 1);
        dispose(a);
        dispose(b);
        // Job B restores job A's checkpoints at another parallelism: a scale-in across jobs.
        CheckpointableKeyedStateBackend<Integer> c = backend(stator("job-b"), ALL, List.of(ha, hb));
        assertThat(read(c)).isEqualTo(expected(ALL));
        dispose(c);
        // And job A by reference, scaled out again.
        for (KeyGroupRange r : List.of(new KeyGroupRange(0, 4), new KeyGroupRange(5, 15))) {
            List<KeyedStateHandle> handles = new ArrayList<>();
            for (KeyedStateHandle h : List.of(ha, hb)) {
                KeyedStateHandle part = h.getIntersection(r);
                if (part != null) {
                    handles.add(part);
                }
            }
            CheckpointableKeyedStateBackend<Integer> d = backend(stator("job-a"), r, handles);
            assertThat(read(d)).isEqualTo(expected(r));
            dispose(d);
        }
    }

    /**
     * Flink's discard of a checkpoint handle (on the JobManager: a cancelled job's checkpoints,
     * subsumed and aborted ones) releases it in statord through its {@code stator:} path: a
     * restore of it is refused afterwards, another subtask's checkpoint stays, a second discard
     * is harmless, and a handle whose statord socket is not on this host is let go.
     */
    @Test
    void aDiscardedHandleIsReleasedInStatord() throws Exception {
        KeyGroupRange left = new KeyGroupRange(0, 7);
        KeyGroupRange right = new KeyGroupRange(8, 15);
        CheckpointableKeyedStateBackend<Integer> a = backend(stator("job-discard"), left, List.of());
        CheckpointableKeyedStateBackend<Integer> b = backend(stator("job-discard"), right, List.of());
        write(a);
        write(b);
        KeyGroupsStateHandle ha = (KeyGroupsStateHandle) checkpoint(a, 1);
        KeyGroupsStateHandle hb = (KeyGroupsStateHandle) checkpoint(b, 1);
        ((CheckpointListener) a).notifyCheckpointComplete(1);
        ((CheckpointListener) b).notifyCheckpointComplete(1);
        dispose(a);
        dispose(b);
        assertThat(ha.getDelegateStateHandle()).isInstanceOf(FileStateHandle.class);
        org.apache.flink.core.fs.Path path = ((FileStateHandle) ha.getDelegateStateHandle()).getFilePath();
        assertThat(path.toUri().getScheme()).isEqualTo("stator");
        statord.awaitCheckpointsOf("job-discard", 2);
        // The same stream as taken through a socket this host does not have: let go.
        byte[] stream;
        try (InputStream in = hb.getDelegateStateHandle().openInputStream()) {
            stream = in.readAllBytes();
        }
        org.apache.flink.core.fs.Path elsewhere = StatorFileSystem.path(dir.resolve("no-such.sock").toString(), stream);
        new KeyGroupsStateHandle(hb.getGroupRangeOffsets(), new FileStateHandle(elsewhere, stream.length)).discardState();
        ha.discardState();
        ha.discardState();
        statord.awaitCheckpointsOf("job-discard", 1);
        assertThatThrownBy(() -> backend(stator("job-discard"), left, List.of(ha)))
                .hasMessageContaining("statord refused");
        CheckpointableKeyedStateBackend<Integer> c = backend(stator("job-discard"), right, List.of(hb));
        assertThat(read(c)).isEqualTo(expected(right));
        dispose(c);
        hb.discardState();
        statord.awaitCheckpointsOf("job-discard", 0);
    }

    @Test
    void aFreshStartSeesNothingAnEarlierAttemptWrote() throws Exception {
        CheckpointableKeyedStateBackend<Integer> a = backend(stator("job-fresh"), ALL, List.of());
        write(a);
        dispose(a);
        CheckpointableKeyedStateBackend<Integer> b = backend(stator("job-fresh"), ALL, List.of());
        assertThat(read(b).values()).allMatch(s -> s.equals("null|[]|{}"));
        dispose(b);
    }

    @Test
    void canonicalSavepointsMoveBetweenStatorAndHashMap() throws Exception {
        // Stator -> savepoint -> HashMap, at two parallelisms.
        CheckpointableKeyedStateBackend<Integer> s = backend(stator("job-sp"), ALL, List.of());
        write(s);
        KeyedStateHandle sp = savepoint(s, 7);
        dispose(s);
        for (KeyGroupRange r : List.of(ALL, new KeyGroupRange(3, 11))) {
            CheckpointableKeyedStateBackend<Integer> h =
                    backend(new HashMapStateBackend(), r, List.of(((KeyGroupsStateHandle) sp).getIntersection(r)));
            assertThat(read(h)).isEqualTo(expected(r));
            dispose(h);
        }
        // HashMap -> savepoint -> Stator.
        CheckpointableKeyedStateBackend<Integer> h = backend(new HashMapStateBackend(), ALL, List.of());
        write(h);
        KeyedStateHandle hp = savepoint(h, 8);
        dispose(h);
        CheckpointableKeyedStateBackend<Integer> s2 = backend(stator("job-sp2"), ALL, List.of(hp));
        assertThat(read(s2)).isEqualTo(expected(ALL));
        // And Stator's own checkpoint of it restores exactly.
        KeyedStateHandle c = checkpoint(s2, 9);
        dispose(s2);
        CheckpointableKeyedStateBackend<Integer> s3 = backend(stator("job-sp2"), ALL, List.of(c));
        assertThat(read(s3)).isEqualTo(expected(ALL));
        dispose(s3);
    }

    @Test
    void aMissingSocketNamesItself() {
        StatorStateBackend b = new StatorStateBackend().setSocket(dir.resolve("nowhere.sock").toString());
        assertThatThrownBy(() -> backend(b, ALL, List.of()))
                .hasMessageContaining("nowhere.sock")
                .hasMessageContaining("cannot connect to statord");
    }

    @Test
    void anAlteredHandleIsRefusedAndChangesNothing() throws Exception {
        CheckpointableKeyedStateBackend<Integer> a = backend(stator("job-bad"), ALL, List.of());
        write(a);
        KeyGroupsStateHandle h = (KeyGroupsStateHandle) checkpoint(a, 1);
        byte[] bytes;
        try (InputStream in = h.getDelegateStateHandle().openInputStream()) {
            bytes = in.readAllBytes();
        }
        // statord's handle (magic "STCH", store/FORMAT.md 12.3) inside the stream: alter its
        // manifest number.
        int at = new String(bytes, java.nio.charset.StandardCharsets.ISO_8859_1).indexOf("STCH");
        assertThat(at).isPositive();
        bytes[at + 9] ^= 0x5A;
        KeyGroupsStateHandle altered =
                new KeyGroupsStateHandle(h.getGroupRangeOffsets(), new ByteStreamStateHandle("altered", bytes));
        assertThatThrownBy(() -> backend(stator("job-bad"), ALL, List.of(altered)))
                .hasMessageContaining("statord refused");
        // The same altered stream kept as Stator keeps it (a stator: path), and a stator: path
        // that is not base64: refused as clearly.
        KeyGroupsStateHandle alteredPath =
                new KeyGroupsStateHandle(
                        h.getGroupRangeOffsets(),
                        new FileStateHandle(StatorFileSystem.path(statord.socket(), bytes), bytes.length));
        assertThatThrownBy(() -> backend(stator("job-bad"), ALL, List.of(alteredPath)))
                .hasMessageContaining("statord refused");
        KeyGroupsStateHandle badPath =
                new KeyGroupsStateHandle(
                        h.getGroupRangeOffsets(),
                        new FileStateHandle(new org.apache.flink.core.fs.Path("stator:/c29jaw/!!"), 3));
        assertThatThrownBy(() -> backend(stator("job-bad"), ALL, List.of(badPath)))
                .hasStackTraceContaining("not a Stator checkpoint path");
        // The live state is untouched by the refusal.
        assertThat(read(a)).isEqualTo(expected(ALL));
        dispose(a);
        // A stream that is not a checkpoint at all is refused too.
        KeyGroupsStateHandle garbage =
                new KeyGroupsStateHandle(h.getGroupRangeOffsets(), new ByteStreamStateHandle("garbage", new byte[] {1, 2, 3}));
        assertThatThrownBy(() -> backend(stator("job-bad"), ALL, List.of(garbage))).isNotNull();
    }

    @Test
    void aStatordOfAnotherVersionIsNamed() throws Exception {
        // A daemon that speaks another control protocol answers Open with Error VERSION
        // (daemon/CONTROL.md, responses): one frame from a socket of this test's own.
        Path sock = dir.resolve("other-version.sock");
        try (ServerSocketChannel server = ServerSocketChannel.open(StandardProtocolFamily.UNIX)) {
            server.bind(UnixDomainSocketAddress.of(sock));
            Thread daemon = new Thread(() -> answerVersion(server), "fake-statord");
            daemon.setDaemon(true);
            daemon.start();
            StatorStateBackend b = new StatorStateBackend().setSocket(sock.toString());
            assertThatThrownBy(() -> backend(b, ALL, List.of()))
                    .hasMessageContaining("this statord speaks control protocol 9")
                    .hasMessageContaining(sock.toString())
                    .hasMessageContaining("run statord " + io.stator.flink.jni.NativeSession.libraryVersion());
            daemon.join(10_000);
        }
    }

    /** Reads one framed request and answers it {@code Error VERSION}. */
    private static void answerVersion(ServerSocketChannel server) {
        try (SocketChannel c = server.accept()) {
            DataInputStream in = new DataInputStream(Channels.newInputStream(c));
            int len = Integer.reverseBytes(in.readInt());
            byte type = in.readByte();
            in.skipNBytes(len - 1);
            byte[] message = "unsupported protocol version: this statord speaks control protocol 9".getBytes(StandardCharsets.UTF_8);
            ByteBuffer out = ByteBuffer.allocate(4 + 1 + 4 + 2 + message.length).order(ByteOrder.LITTLE_ENDIAN);
            out.putInt(1 + 4 + 2 + message.length).put((byte) (type | 0x80)).putInt(-2);
            out.putShort((short) message.length).put(message).flip();
            while (out.hasRemaining()) {
                c.write(out);
            }
        } catch (IOException e) {
            throw new RuntimeException(e);
        }
    }

    @Test
    void aChangedKeySerializerIsRefusedAndChangesNothing() throws Exception {
        CheckpointableKeyedStateBackend<Integer> a = backend(stator("job-keys"), ALL, List.of());
        write(a);
        KeyedStateHandle h = checkpoint(a, 1);
        dispose(a);
        // The checkpoint's keys are ints; a job that now keys by strings cannot read them.
        assertThatThrownBy(() -> backend(stator("job-keys"), StringSerializer.INSTANCE, ALL, List.of(h)))
                .hasStackTraceContaining("key serializer");
        // The refused restore left the checkpoint as it was: the right key serializer restores it.
        CheckpointableKeyedStateBackend<Integer> b = backend(stator("job-keys"), ALL, List.of(h));
        assertThat(read(b)).isEqualTo(expected(ALL));
        dispose(b);
    }

    @Test
    @SuppressWarnings("unchecked")
    void aQueryLeavesTheTasksKeyAlone() throws Exception {
        CheckpointableKeyedStateBackend<Integer> a = backend(stator("job-query"), ALL, List.of());
        write(a);
        KeyedStateHandle h = checkpoint(a, 1);
        dispose(a);
        // Restored: no current key yet. A queryable-state lookup (another thread, in Flink)
        // reads key 3 and sets no current key.
        CheckpointableKeyedStateBackend<Integer> b = backend(stator("job-query"), ALL, List.of(h));
        InternalKvState<Integer, VoidNamespace, Long> v =
                (InternalKvState<Integer, VoidNamespace, Long>)
                        b.getPartitionedState(VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE, VALUE);
        byte[] three =
                KvStateSerializer.serializeKeyAndNamespace(
                        3, IntSerializer.INSTANCE, VoidNamespace.INSTANCE, VoidNamespaceSerializer.INSTANCE);
        byte[] got = v.getSerializedValue(three, IntSerializer.INSTANCE, VoidNamespaceSerializer.INSTANCE, LongSerializer.INSTANCE);
        assertThat(KvStateSerializer.deserializeValue(got, LongSerializer.INSTANCE)).isEqualTo(21L);
        assertThat(b.getCurrentKey()).isNull();
        // With a current key set, a lookup of another key leaves it.
        b.setCurrentKey(7);
        v.getSerializedValue(three, IntSerializer.INSTANCE, VoidNamespaceSerializer.INSTANCE, LongSerializer.INSTANCE);
        assertThat(b.getCurrentKey()).isEqualTo(7);
        assertThat(((ValueState<Long>) v).value()).isEqualTo(49L);
        dispose(b);
    }
}
