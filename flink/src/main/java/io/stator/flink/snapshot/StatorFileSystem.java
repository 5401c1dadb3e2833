package io.stator.flink.snapshot;

import io.stator.flink.jni.NativeSession;

import org.apache.flink.core.fs.BlockLocation;
import org.apache.flink.core.fs.FSDataInputStream;
import org.apache.flink.core.fs.FSDataOutputStream;
import org.apache.flink.core.fs.FileStatus;
import org.apache.flink.core.fs.FileSystem;
import org.apache.flink.core.fs.Path;
import org.apache.flink.runtime.state.memory.ByteStreamStateHandle;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

import java.io.ByteArrayInputStream;
import java.io.FileNotFoundException;
import java.io.IOException;
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.Base64;
import java.util.List;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * The {@code stator:} file system: how Flink's discard of a Stator checkpoint handle reaches the
 * statord that holds it. Flink's metadata accepts only its own handle classes, and the one that
 * does something when discarded is a {@code FileStateHandle}: its {@code discardState()} deletes
 * its path through the file system of the path's scheme. So a Stator checkpoint's stream ({@link
 * StatorCheckpointHandle}) is kept as a "file" whose path holds the stream itself:
 *
 * <pre>
 *   stator:/&lt;socket&gt;/&lt;stream&gt;
 *   socket   base64url (RFC 4648 §5, no padding) of the UTF-8 path of the control socket of the
 *            statord that took the checkpoint
 *   stream   base64url, no padding, of the checkpoint's stream bytes (StatorCheckpointHandle)
 * </pre>
 *
 * <p>Reading the path gives the stream (a restore decodes it without this class, see {@link
 * StatorCheckpointHandle#read}); deleting it sends statord on that socket a {@code Release} of
 * the checkpoint's statord handle for its job and operator (daemon/CONTROL.md: no session, no
 * claim of the job; the job manager's uid must own the job, as the task managers' does). A
 * statord that does not hold it (subsumed checkpoints the tasks released already, another host's)
 * changes nothing. Flink discards a checkpoint when it is subsumed, when a pending one is aborted,
 * and when its job is cancelled (unless checkpoints are retained on cancellation) or finishes:
 * that last case is the one no task is left to tell statord about.
 *
 * <p>Flink finds this file system through the {@code FileSystemFactory} service in the jar,
 * where Flink's own file systems are found: the jar must be in Flink's {@code lib/} on the
 * JobManager too. A JobManager on a host without that socket cannot reach the statord: it logs
 * one warning and treats the discard as done; such a checkpoint stays in statord (a cancelled
 * job sends no later checkpoint to push it out of {@code retained_checkpoints}) until it is
 * released by hand.
 */
public final class StatorFileSystem extends FileSystem {

    public static final String SCHEME = "stator";

    private static final Logger LOG = LoggerFactory.getLogger(StatorFileSystem.class);

    /**
     * Longest path written (about 15 KB of stream): Flink's metadata keeps a path as a string of
     * at most 64 KiB, once per subtask; a longer stream stays the handle Flink made of it.
     */
    static final int MAX_PATH = 20_000;

    private static final URI ROOT = URI.create(SCHEME + ":/");
    private static final Base64.Encoder ENCODE = Base64.getUrlEncoder().withoutPadding();
    private static final Base64.Decoder DECODE = Base64.getUrlDecoder();

    private final AtomicBoolean warnedUnreachable = new AtomicBoolean();

    /** The path of a checkpoint's stream taken through {@code socket}, or null if too long. */
    public static Path path(String socket, byte[] stream) {
        String p =
                SCHEME
                        + ":/"
                        + ENCODE.encodeToString(socket.getBytes(StandardCharsets.UTF_8))
                        + "/"
                        + ENCODE.encodeToString(stream);
        return p.length() > MAX_PATH ? null : new Path(p);
    }

    private static String[] parts(Path path) throws FileNotFoundException {
        URI u = path.toUri();
        String p = u.getPath();
        String[] parts = p == null ? new String[0] : p.split("/");
        // "", socket, stream
        if (!SCHEME.equals(u.getScheme()) || parts.length != 3 || parts[1].isEmpty() || parts[2].isEmpty()) {
            throw new FileNotFoundException("not a Stator checkpoint path: " + shortly(path));
        }
        return parts;
    }

    private static byte[] decode(String part, Path path) throws FileNotFoundException {
        try {
            return DECODE.decode(part);
        } catch (IllegalArgumentException e) {
            throw new FileNotFoundException("not a Stator checkpoint path (" + e.getMessage() + "): " + shortly(path));
        }
    }

    /** A path for a message: its start and its length (the whole can be kilobytes). */
    static String shortly(Path path) {
        String p = path.toString();
        return p.length() <= 96 ? p : p.substring(0, 96) + "... (" + p.length() + " chars)";
    }

    /** The control socket a checkpoint's path names. */
    static String socketOf(Path path) throws FileNotFoundException {
        return new String(decode(parts(path)[1], path), StandardCharsets.UTF_8);
    }

    /** The stream a checkpoint's path holds. */
    static byte[] bytesOf(Path path) throws FileNotFoundException {
        return decode(parts(path)[2], path);
    }

    @Override
    public Path getWorkingDirectory() {
        return new Path(ROOT);
    }

    @Override
    public Path getHomeDirectory() {
        return new Path(ROOT);
    }

    @Override
    public URI getUri() {
        return ROOT;
    }

    @Override
    public FileStatus getFileStatus(Path f) throws IOException {
        long len = bytesOf(f).length;
        return new FileStatus() {
            @Override
            public long getLen() {
                return len;
            }

            @Override
            public long getBlockSize() {
                return len;
            }

            @Override
            public short getReplication() {
                return 1;
            }

            @Override
            public long getModificationTime() {
                return 0;
            }

            @Override
            public long getAccessTime() {
                return 0;
            }

            @Override
            public boolean isDir() {
                return false;
            }

            @Override
            public Path getPath() {
                return f;
            }
        };
    }

    @Override
    public BlockLocation[] getFileBlockLocations(FileStatus file, long start, long len) {
        return new BlockLocation[0];
    }

    @Override
    public FSDataInputStream open(Path f, int bufferSize) throws IOException {
        return open(f);
    }

    @Override
    public FSDataInputStream open(Path f) throws IOException {
        // Flink's own stream over bytes in memory (seekable, as an FSDataInputStream is).
        return new ByteStreamStateHandle(shortly(f), bytesOf(f)).openInputStream();
    }

    @Override
    public FileStatus[] listStatus(Path f) throws IOException {
        throw new IOException("a Stator checkpoint path is not a directory: " + f);
    }

    /**
     * Releases the checkpoint the path names in the statord that took it. True once statord has
     * answered (whether or not it still held the checkpoint), or when this host has no such
     * socket (logged once); a statord that does not answer is an {@code IOException}, and Flink
     * logs the discard as failed.
     */
    @Override
    public boolean delete(Path f, boolean recursive) throws IOException {
        String socket = socketOf(f);
        StatorCheckpointHandle c = StatorCheckpointHandle.read(new ByteArrayInputStream(bytesOf(f)), shortly(f), null);
        if (c == null) {
            throw new IOException("not a Stator checkpoint stream: " + shortly(f));
        }
        if (!Files.exists(java.nio.file.Path.of(socket))) {
            if (warnedUnreachable.compareAndSet(false, true)) {
                LOG.warn(
                        "No statord socket {} on this host: Flink's discards of Stator checkpoints taken there cannot "
                                + "reach statord from here (checkpoints Flink subsumes are released by the tasks; a "
                                + "cancelled job's last ones stay until statord's retention drops them)",
                        socket);
            }
            return true;
        }
        try {
            int released = NativeSession.releaseCheckpoints(socket, c.job, c.operator, List.of(c.handle));
            LOG.debug("Released {} Stator checkpoint of {}/{} {}", released, c.job, c.operator, c.keyGroups);
        } catch (LinkageError e) {
            // No native library on this host (Flink's discard catches IOExceptions only).
            throw new IOException("cannot load Stator's native library to release " + describe(c), e);
        }
        return true;
    }

    private static String describe(StatorCheckpointHandle c) {
        return "the Stator checkpoint of " + c.job + "/" + c.operator + " " + c.keyGroups;
    }

    @Override
    public boolean mkdirs(Path f) throws IOException {
        throw new IOException("the stator: file system is read-only");
    }

    @Override
    public FSDataOutputStream create(Path f, WriteMode overwriteMode) throws IOException {
        throw new IOException("the stator: file system is read-only");
    }

    @Override
    public boolean rename(Path src, Path dst) throws IOException {
        throw new IOException("the stator: file system is read-only");
    }

    @Override
    public boolean isDistributedFS() {
        // The same path reads the same bytes on every host.
        return true;
    }
}
