package io.stator.flink.jni;

import java.nio.ByteBuffer;

/**
 * The native methods of {@code libstator_jni.so} (the Rust crate {@code clients/jni}), and
 * nothing else.
 *
 * <p>Every method takes and returns primitives, or direct buffers over native memory. Arguments
 * that are not numbers travel in the calling thread's scratch buffer as an argument block (see
 * {@link Scratch}); a negative result is a failure whose details {@link #error} writes into the
 * scratch buffer. No method throws.
 *
 * <p>The contract the native side relies on: an address and length name a live direct buffer that
 * no other thread touches during the call; a handle is one {@link #open} returned and {@link
 * #close} has not been given; and the buffers bound to a session stay reachable until it is
 * closed. {@link NativeSession} keeps it.
 */
final class StatorJni {

    private StatorJni() {}

    static {
        NativeLibrary.load();
    }

    /** The address of a direct buffer's memory. */
    static native long address(ByteBuffer direct);

    /** Writes the library's version (UTF-8) into the scratch buffer; returns its length. */
    static native int version(long io, int cap);

    /** Writes this thread's last failure (an error record) into the scratch buffer. */
    static native int error(long io, int cap);

    /** Opens a session from an argument block; returns its handle, or a negative code. */
    static native long open(long io, int len);

    /** Registers a state (argument block: kind, name); returns its id in the session. */
    static native int register(long handle, long io, int len);

    /** Restores from checkpoint handles (argument block); returns the layers added. */
    static native int restore(long handle, long io, int len);

    /** Reserves the caller's region of the arena; returns its arena offset. */
    static native long region(long handle, int bytes);

    /** A direct buffer over the session's arena. */
    static native ByteBuffer arena(long handle);

    /** A direct buffer over one 4 MiB chunk slot. */
    static native ByteBuffer chunkSlot(long handle, int slot);

    static native int chunkSlots(long handle);

    /** Binds the command and completion buffers (addresses and lengths). */
    static native int bind(long handle, long commands, int commandsLen, long completions, int completionsLen);

    /**
     * Submits {@code count} commands, publishes them, waits for a completion if {@code wait},
     * and writes the ready completions; returns how many.
     */
    static native int call(long handle, int count, boolean wait);

    /** A checkpoint's synchronous part: returns once statord has taken the barrier. */
    static native int checkpoint(long handle, long checkpointId);

    /**
     * Waits up to {@code timeoutMs} for a checkpoint to be durable; writes its handle and returns
     * the handle's length, or 0 if it is not durable yet.
     */
    static native int checkpointWait(long handle, long checkpointId, int timeoutMs, long io, int cap);

    /** Complete (1), abort (2) or subsume (3) a checkpoint. */
    static native int notifyCheckpoint(long handle, long checkpointId, int kind);

    /**
     * Releases checkpoints with no session (argument block: socket, job, operator, handles);
     * returns how many statord deleted.
     */
    static native int releaseCheckpoints(long io, int len);

    /** Empties the session's state (imports an empty snapshot). */
    static native int reset(long handle, long importId);

    /** Starts an export (argument block of handles, or none: the live state). */
    static native int exportStart(long handle, long snapshotId, long io, int len);

    /** The next chunk as {@code slot << 32 | len}, or {@link Long#MAX_VALUE} at the end. */
    static native long exportNext(long handle);

    static native int exportCancel(long handle);

    /** Streams one session's export into another's import; returns the records installed. */
    static native long transfer(long from, long to, long snapshotId, long io, int len);

    /** Closes and frees the session. */
    static native int close(long handle);

    /** Arms the doorbell for a sleeper: 1 if completions are ready already, 0 armed. */
    static native int arm(long handle);

    /** Ends a sleeper's sleep on the session. */
    static native int disarm(long handle);

    /** A sleeper over the session's doorbell and control socket, with a wake fd of its own. */
    static native long sleeper(long handle);

    /** Sleeps up to {@code ms}; returns what ended it ({@link Sleeper} bits). */
    static native int sleep(long sleeper, int ms);

    static native int wake(long sleeper);

    static native int sleeperClose(long sleeper);
}
