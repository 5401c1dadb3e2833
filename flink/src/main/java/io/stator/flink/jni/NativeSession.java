package io.stator.flink.jni;

import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.List;

/**
 * One statord session, as the native library holds it. Every method is {@code synchronized}: a
 * handle is never used by two threads at once, and never after {@link #close()} freed it.
 * Uncontended (the task thread is the only caller on the hot path), that costs one atomic
 * exchange per call.
 */
public final class NativeSession implements AutoCloseable {

    /** The kinds of state statord keeps. */
    public enum Kind {
        VALUE(1),
        LIST(2),
        MAP(3);

        final int wire;

        Kind(int wire) {
            this.wire = wire;
        }
    }

    /** What a checkpoint notification says. */
    public enum Notify {
        COMPLETE(1),
        ABORT(2),
        SUBSUME(3);

        final int wire;

        Notify(int wire) {
            this.wire = wire;
        }
    }

    /** How to open a session. Zero sizes take the daemon's defaults. */
    public static final class Options {
        public String socket;
        public String job;
        public String operator;
        public int subtask;
        public int parallelism = 1;
        public int maxParallelism;
        /** The session's key groups, inclusive; -1: the daemon's range of the subtask. */
        public int keyGroupFirst = -1;
        public int keyGroupLast = -1;
        public int sqEntries;
        public int cqEntries;
        public long arenaBytes;
        public int chunkSlots;
        public long spinNanos = 50_000;
    }

    /** What {@link #exportNext()} returns at the end of the stream. */
    public static final long EXPORT_END = Long.MAX_VALUE;

    private long handle;
    private final String socket;
    /** Buffers bound to the native session: kept reachable while it lives. */
    private ByteBuffer commands;
    private ByteBuffer completions;

    private NativeSession(long handle, String socket) {
        this.handle = handle;
        this.socket = socket;
    }

    /** The native library's version. */
    public static String libraryVersion() {
        Scratch s = Scratch.get();
        int n = StatorJni.version(s.address(), s.capacity());
        return n < 0 ? "unknown" : new String(s.result(n), StandardCharsets.UTF_8);
    }

    /** Connects to statord and opens a session. */
    public static NativeSession open(Options o) throws StatorException {
        Scratch s = Scratch.get();
        s.str(o.socket).str(o.job).str(o.operator);
        s.u32(o.subtask).u32(o.parallelism).u32(o.maxParallelism);
        s.u32(o.keyGroupFirst).u32(o.keyGroupLast);
        s.u32(o.sqEntries).u32(o.cqEntries).u64(o.arenaBytes).u32(o.chunkSlots).u64(o.spinNanos);
        long h = StatorJni.open(s.address(), s.length());
        if (h <= 0) {
            throw Scratch.failure("opening a statord session for " + o.job + "/" + o.operator);
        }
        return new NativeSession(h, o.socket);
    }

    /**
     * Tells the statord at {@code socket} that Flink no longer references these checkpoints of
     * {@code job}'s {@code operator} (it discarded them), with no session and no claim of the
     * job; returns how many statord held and deleted (a release may repeat, or reach a statord
     * that never held them).
     */
    public static int releaseCheckpoints(String socket, String job, String operator, List<byte[]> checkpointHandles)
            throws StatorException {
        Scratch s = Scratch.get();
        s.str(socket).str(job).str(operator);
        s.u32(checkpointHandles.size());
        for (byte[] h : checkpointHandles) {
            s.bytes(h);
        }
        return check(StatorJni.releaseCheckpoints(s.address(), s.length()), "releasing checkpoints of " + job + "/" + operator);
    }

    /** The control socket this session was opened through. */
    public String socket() {
        return socket;
    }

    private long live() throws StatorException {
        if (handle == 0) {
            throw new StatorException(StatorException.PROTOCOL, 0, "the statord session is closed");
        }
        return handle;
    }

    private static int check(int r, String what) throws StatorException {
        if (r < 0) {
            throw Scratch.failure(what);
        }
        return r;
    }

    private static long check(long r, String what) throws StatorException {
        if (r < 0) {
            throw Scratch.failure(what);
        }
        return r;
    }

    /** Registers (or finds) a state of the session's operator; returns its id here. */
    public synchronized int register(String name, Kind kind) throws StatorException {
        Scratch s = Scratch.get();
        s.u8(kind.wire).str(name);
        return check(StatorJni.register(live(), s.address(), s.length()), "registering state " + name);
    }

    private static Scratch handles(List<byte[]> handles) {
        Scratch s = Scratch.get();
        s.u32(handles.size());
        for (byte[] h : handles) {
            s.bytes(h);
        }
        return s;
    }

    /** Replaces the session's state by what the checkpoints hold of its key groups. */
    public synchronized int restore(List<byte[]> checkpointHandles) throws StatorException {
        Scratch s = handles(checkpointHandles);
        return check(StatorJni.restore(live(), s.address(), s.length()), "restoring");
    }

    /** Reserves the caller's region of the arena; returns its offset in the arena. */
    public synchronized int region(int bytes) throws StatorException {
        return (int) check(StatorJni.region(live(), bytes), "reserving the request region");
    }

    /** A direct buffer over the whole arena (native byte order is set by the caller). */
    public synchronized ByteBuffer arena() throws StatorException {
        ByteBuffer b = StatorJni.arena(live());
        if (b == null) {
            throw Scratch.failure("mapping the arena");
        }
        return b;
    }

    public synchronized int chunkSlots() throws StatorException {
        return check(StatorJni.chunkSlots(live()), "counting chunk slots");
    }

    /** A direct buffer over chunk slot {@code slot} (4 MiB). */
    public synchronized ByteBuffer chunkSlot(int slot) throws StatorException {
        ByteBuffer b = StatorJni.chunkSlot(live(), slot);
        if (b == null) {
            throw Scratch.failure("mapping chunk slot " + slot);
        }
        return b;
    }

    /** Binds the command and completion buffers of {@link #call}. */
    public synchronized void bind(ByteBuffer commands, ByteBuffer completions) throws StatorException {
        check(
                StatorJni.bind(
                        live(),
                        StatorJni.address(commands),
                        commands.capacity(),
                        StatorJni.address(completions),
                        completions.capacity()),
                "binding buffers");
        this.commands = commands;
        this.completions = completions;
    }

    /**
     * Submits {@code count} commands and writes the ready completions (waiting for one first if
     * {@code wait}); returns how many completions it wrote.
     */
    public synchronized int call(int count, boolean wait) throws StatorException {
        return check(StatorJni.call(live(), count, wait), "a statord request");
    }

    /**
     * Asks statord to ring the doorbell at the next completion, before a {@link Sleeper} sleeps;
     * returns true if completions are ready already (then do not sleep, but {@link #disarm()}).
     */
    public synchronized boolean arm() throws StatorException {
        return check(StatorJni.arm(live()), "arming the doorbell") == 1;
    }

    /** Ends a sleep begun with {@link #arm()}; fails if statord closed the session. */
    public synchronized void disarm() throws StatorException {
        check(StatorJni.disarm(live()), "a statord request");
    }

    /** A sleeper over this session's doorbell: closed by its owner, before the session. */
    public synchronized Sleeper sleeper() throws StatorException {
        return new Sleeper(check(StatorJni.sleeper(live()), "creating a sleeper"));
    }

    /** A checkpoint's synchronous part (the barrier is taken when it returns). */
    public synchronized void checkpoint(long checkpointId) throws StatorException {
        check(StatorJni.checkpoint(live(), checkpointId), "checkpoint " + checkpointId);
    }

    /**
     * Waits up to {@code timeoutMs} for checkpoint {@code checkpointId} to be durable; returns
     * its handle, or null if it is not yet.
     */
    public synchronized byte[] checkpointWait(long checkpointId, int timeoutMs) throws StatorException {
        Scratch s = Scratch.get();
        s.reserve(4096);
        int n =
                check(
                        StatorJni.checkpointWait(live(), checkpointId, timeoutMs, s.address(), s.capacity()),
                        "checkpoint " + checkpointId);
        return n == 0 ? null : s.result(n);
    }

    public synchronized void notifyCheckpoint(long checkpointId, Notify kind) throws StatorException {
        check(StatorJni.notifyCheckpoint(live(), checkpointId, kind.wire), "notifying checkpoint " + checkpointId);
    }

    /** Empties the session's state: a task that starts without a checkpoint sees nothing. */
    public synchronized void reset(long importId) throws StatorException {
        check(StatorJni.reset(live(), importId), "clearing the state of a fresh start");
    }

    /**
     * Starts an export of the live state (no handles) or of retained checkpoints; chunks come
     * from {@link #exportNext()}.
     */
    public synchronized void exportStart(long snapshotId, List<byte[]> checkpointHandles) throws StatorException {
        if (checkpointHandles.isEmpty()) {
            check(StatorJni.exportStart(live(), snapshotId, 0, 0), "starting an export");
        } else {
            Scratch s = handles(checkpointHandles);
            check(StatorJni.exportStart(live(), snapshotId, s.address(), s.length()), "starting an export");
        }
    }

    /** The next chunk as {@code slot << 32 | length}, or {@link #EXPORT_END}. */
    public synchronized long exportNext() throws StatorException {
        return check(StatorJni.exportNext(live()), "reading an export");
    }

    public synchronized void exportCancel() throws StatorException {
        check(StatorJni.exportCancel(live()), "cancelling an export");
    }

    /**
     * Streams what {@code from} exports (its live state, or the checkpoints named) into an import
     * on {@code to}; returns the records installed.
     */
    public static long transfer(NativeSession from, NativeSession to, long snapshotId, List<byte[]> checkpointHandles)
            throws StatorException {
        synchronized (from) {
            synchronized (to) {
                Scratch s = handles(checkpointHandles);
                int len = checkpointHandles.isEmpty() ? 0 : s.length();
                return check(
                        StatorJni.transfer(from.live(), to.live(), snapshotId, s.address(), len),
                        "moving state between sessions");
            }
        }
    }

    /** Closes the session: statord drops it; its state stays. */
    @Override
    public synchronized void close() throws StatorException {
        if (handle != 0) {
            long h = handle;
            handle = 0;
            commands = null;
            completions = null;
            check(StatorJni.close(h), "closing the session");
        }
    }
}
