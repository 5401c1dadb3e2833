package io.stator.flink.snapshot;

import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataInputViewStreamWrapper;
import org.apache.flink.core.memory.DataOutputView;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyGroupsStateHandle;
import org.apache.flink.runtime.state.KeyedBackendSerializationProxy;
import org.apache.flink.runtime.state.StreamStateHandle;
import org.apache.flink.runtime.state.filesystem.FileStateHandle;

import java.io.ByteArrayInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.util.Arrays;

/**
 * What a native Stator checkpoint puts in Flink's checkpoint metadata: a stock {@link
 * KeyGroupsStateHandle} (Flink's metadata serializer accepts only its own handle classes) over
 * a {@code FileStateHandle} whose {@code stator:} path holds the stream ({@link
 * StatorFileSystem}: Flink's discard of the handle reaches statord through it), or, for a
 * stream Flink put in a file of its checkpoint storage (past its memory threshold) or one too
 * long for a path, over the stream handle Flink made. The stream holds, in this order:
 *
 * <pre>
 *   8 bytes   magic "STATORFK"
 *   int       version (1)
 *   UTF       statord job        (the name the state is kept under)
 *   UTF       statord operator
 *   int       first key group, int last key group (inclusive), int max parallelism
 *   int n     then n bytes: statord's checkpoint handle (store/FORMAT.md §12.3)
 *   ...       Flink's KeyedBackendSerializationProxy: the key serializer and every state's
 *             meta information, so a restore checks compatibility as Flink's backends do
 * </pre>
 *
 * The key-group offsets of the Flink handle are all 0: a restore reads the whole stream and
 * statord clips the checkpoint to the restoring subtask's key groups.
 */
public final class StatorCheckpointHandle {

    static final byte[] MAGIC = {'S', 'T', 'A', 'T', 'O', 'R', 'F', 'K'};
    static final int VERSION = 1;

    public final String job;
    public final String operator;
    public final KeyGroupRange keyGroups;
    public final int maxParallelism;
    public final byte[] handle;
    /** Filled by {@link #read}: the serialization proxy that followed. */
    public KeyedBackendSerializationProxy<?> proxy;

    public StatorCheckpointHandle(String job, String operator, KeyGroupRange keyGroups, int maxParallelism, byte[] handle) {
        this.job = job;
        this.operator = operator;
        this.keyGroups = keyGroups;
        this.maxParallelism = maxParallelism;
        this.handle = handle;
    }

    public void write(DataOutputView out, KeyedBackendSerializationProxy<?> proxy) throws IOException {
        out.write(MAGIC);
        out.writeInt(VERSION);
        out.writeUTF(job);
        out.writeUTF(operator);
        out.writeInt(keyGroups.getStartKeyGroup());
        out.writeInt(keyGroups.getEndKeyGroup());
        out.writeInt(maxParallelism);
        out.writeInt(handle.length);
        out.write(handle);
        proxy.write(out);
    }

    /**
     * Reads a Stator checkpoint from a Flink handle, or returns null if the stream is not one
     * (a checkpoint or savepoint in Flink's own format).
     */
    public static StatorCheckpointHandle read(KeyGroupsStateHandle h, ClassLoader userCode) throws IOException {
        StreamStateHandle d = h.getDelegateStateHandle();
        try (InputStream raw = open(d)) {
            return read(raw, d instanceof FileStateHandle f ? StatorFileSystem.shortly(f.getFilePath()) : d.toString(), userCode);
        }
    }

    /**
     * A handle's stream: a {@code stator:} path is decoded here, so a restore never depends on
     * Flink finding {@link StatorFileSystem} (a jar in the user code, not in {@code lib/}).
     */
    private static InputStream open(StreamStateHandle h) throws IOException {
        if (h instanceof FileStateHandle f && StatorFileSystem.SCHEME.equals(f.getFilePath().toUri().getScheme())) {
            return new ByteArrayInputStream(StatorFileSystem.bytesOf(f.getFilePath()));
        }
        return h.openInputStream();
    }

    /**
     * Reads a Stator checkpoint from its stream, or returns null if the stream is not one; with
     * {@code userCode} null the serialization proxy is not read ({@link #proxy} stays null).
     */
    static StatorCheckpointHandle read(InputStream raw, String where, ClassLoader userCode) throws IOException {
        DataInputView in = new DataInputViewStreamWrapper(raw);
        byte[] m = new byte[MAGIC.length];
        int got = raw.readNBytes(m, 0, m.length);
        if (got < m.length || !Arrays.equals(m, MAGIC)) {
            return null;
        }
        int version = in.readInt();
        if (version != VERSION) {
            throw new IOException(
                    "a Stator checkpoint of format version " + version + " (this backend reads " + VERSION + ")");
        }
        String job = in.readUTF();
        String operator = in.readUTF();
        int first = in.readInt();
        int last = in.readInt();
        int maxParallelism = in.readInt();
        int n = in.readInt();
        if (n < 0 || n > 4096 || first < 0 || last < first) {
            throw new IOException("a corrupt Stator checkpoint in " + where);
        }
        byte[] handle = new byte[n];
        in.readFully(handle);
        StatorCheckpointHandle c =
                new StatorCheckpointHandle(job, operator, new KeyGroupRange(first, last), maxParallelism, handle);
        if (userCode != null) {
            KeyedBackendSerializationProxy<?> proxy = new KeyedBackendSerializationProxy<>(userCode);
            proxy.read(in);
            c.proxy = proxy;
        }
        return c;
    }
}
