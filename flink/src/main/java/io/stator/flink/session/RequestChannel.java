package io.stator.flink.session;

import io.stator.flink.jni.NativeSession;
import io.stator.flink.jni.StatorException;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;

/**
 * The request path of one session, on the task thread: requests are serialized straight into a
 * region of the session's shared arena, described by 64-byte commands, and handed to statord a
 * batch at a time; results are read in place.
 *
 * <p><b>Writes</b> (put, append, remove, clear) need no round trip: their commands wait in the
 * command buffer and go with the next batch, and statord applies a session's requests on one key
 * in submission order, so the next read of that key sees them. A write that fails in statord
 * fails the next call on this channel. <b>Reads</b> submit everything pending and wait for their
 * own completion only.
 *
 * <p><b>The region</b> is a ring of request bytes: a request's bytes stay put from its first
 * byte until statord completes it; bytes are reused oldest first. The view a request is written
 * through grows on demand: it wraps to the region's start (moving the few bytes written so far)
 * or waits for older requests, so a serializer never sees the region's end. Offsets a caller
 * keeps while writing a request are therefore relative to the request's start ({@link #mark()}).
 *
 * <p>Not thread-safe: one task thread at a time.
 */
public final class RequestChannel implements ArenaOutputView.Room, AutoCloseable {

    static final int COMMAND_LEN = 64;
    static final int COMPLETION_LEN = 32;
    private static final byte FREE = 0;
    private static final byte IN_FLIGHT = 1;
    private static final byte DONE = 2;
    /** A field an opcode does not use. */
    public static final int NONE = -1;

    private final NativeSession session;
    private final ByteBuffer arena;
    public final ArenaOutputView out;
    public final ArenaInputView in;

    /** The region: its arena offset and length. */
    private final int base;
    private final int cap;
    /** Region-relative: where the next request starts, and the oldest live request's start. */
    private int head;
    private int tail;
    /** Region-relative start of the request being written, or -1. */
    private int requestStart = -1;

    private final ByteBuffer commands;
    private final ByteBuffer completions;
    private final int maxCommands;
    private int pending;

    /** Requests by sequence number (the token): slot = seq & mask. */
    private final int mask;
    private final int[] starts;
    private final byte[] states;
    private final byte[] ops;
    private long next;
    private long oldest;

    /** The read being waited for, and what it came back with. */
    private long awaited = -1;
    private boolean awaitedDone;
    private int resultStatus;
    private int resultLen;
    private int resultFlags;
    private long resultAux;

    private StatorException failure;

    /** Takes completions no caller awaits itself (the asynchronous executor's reads), or null. */
    private Completions sink;
    /** How many times a call waited in statord's doorbell (see {@link #waits()}). */
    private long waits;

    /**
     * Completions of requests that no {@link #await} waits for. Called on whichever thread drives
     * the channel (under its lock), while the request's bytes still lie where it wrote them.
     */
    public interface Completions {
        /**
         * Takes one completion; returns false to leave it to the channel (a write, whose failure
         * fails the channel's next call).
         */
        boolean completed(long token, int status, int flags, int length, long aux);
    }

    /**
     * Binds a channel to {@code session}: reserves {@code regionBytes} of its arena and allows at
     * most {@code maxInFlight} requests (a power of two, at most the session's queue sizes) in
     * statord at once.
     */
    public RequestChannel(NativeSession session, int regionBytes, int maxInFlight, int batch)
            throws StatorException {
        if (Integer.bitCount(maxInFlight) != 1) {
            throw new IllegalArgumentException("maxInFlight must be a power of two: " + maxInFlight);
        }
        this.session = session;
        this.arena = session.arena().order(ByteOrder.BIG_ENDIAN);
        this.base = session.region(regionBytes);
        this.cap = regionBytes;
        this.out = new ArenaOutputView(arena, this);
        this.in = new ArenaInputView(arena);
        this.maxCommands = Math.min(batch, maxInFlight);
        this.commands =
                ByteBuffer.allocateDirect(maxCommands * COMMAND_LEN).order(ByteOrder.LITTLE_ENDIAN);
        this.completions =
                ByteBuffer.allocateDirect(maxInFlight * COMPLETION_LEN).order(ByteOrder.LITTLE_ENDIAN);
        session.bind(commands, completions);
        this.mask = maxInFlight - 1;
        this.starts = new int[maxInFlight];
        this.states = new byte[maxInFlight];
        this.ops = new byte[maxInFlight];
    }

    public NativeSession session() {
        return session;
    }

    /** The arena, for reading results in place. */
    public ByteBuffer arena() {
        return arena;
    }

    // ------------------------------------------------------------------------
    //  Writing a request
    // ------------------------------------------------------------------------

    /** Starts a request: the output view writes its bytes from here on. */
    public void begin() throws IOException {
        checkFailure();
        if (next - oldest > mask) {
            // Every slot holds a request in flight: wait for the oldest.
            long want = oldest;
            while (oldest == want) {
                drive(true);
            }
        }
        if (next == oldest) {
            head = 0;
            tail = 0;
        }
        requestStart = head;
        out.position = base + head;
        out.limit = base + limitAt(head);
    }

    /** Where the request being written is, relative to its start (for its fields). */
    public int mark() {
        return out.position - base - requestStart;
    }

    /** How far bytes written from {@code head} may go (region-relative). */
    private int limitAt(int at) {
        if (next == oldest) {
            return cap; // nothing else is live
        }
        if (at > tail) {
            return cap; // live bytes lie in [tail, at): free up to the end
        }
        if (at < tail) {
            return tail; // wrapped: free up to the oldest live byte
        }
        return at; // at == tail with requests live: the ring is full
    }

    @Override
    public void grow(ArenaOutputView view, int bytes) throws IOException {
        if (requestStart < 0) {
            throw new IllegalStateException("writing outside a request");
        }
        int written = out.position - base - requestStart;
        long needed = (long) written + bytes;
        if (needed > cap) {
            throw new StatorException(
                    StatorException.TOO_LARGE,
                    0,
                    "a request of "
                            + needed
                            + " bytes exceeds the session's request region of "
                            + cap
                            + " bytes (raise state.backend.stator.arena-size)");
        }
        while (true) {
            if (requestStart + needed <= limitAt(requestStart)) {
                out.limit = base + limitAt(requestStart);
                return;
            }
            boolean fitsAtStart =
                    next == oldest || (requestStart >= tail && needed <= tail);
            if (requestStart != 0 && fitsAtStart) {
                out.copyWithin(base + requestStart, base, written);
                requestStart = 0;
                head = 0;
                if (next == oldest) {
                    tail = 0;
                }
                out.position = base + written;
                out.limit = base + limitAt(0);
                if (needed <= limitAt(0)) {
                    return;
                }
            }
            if (next == oldest) {
                // Unreachable: with nothing live the whole region is free.
                throw new IllegalStateException("no room in an empty region");
            }
            drive(true);
            if (next == oldest) {
                tail = requestStart;
            }
        }
    }

    /**
     * Writes a little-endian {@code u32} at {@code relative} (from the request's start), over
     * bytes written before: a length known only once what follows it is serialized.
     */
    public void patchIntLE(int relative, int value) {
        arena.putInt(base + requestStart + relative, Integer.reverseBytes(value));
    }

    /**
     * Submits the request written since {@link #begin()}. Each range is {@code (offset relative
     * to the request's start, length)}, or {@link #NONE} as the offset for a field the opcode
     * does not use. Returns the request's token.
     */
    public long submit(
            byte op,
            int flags,
            int keyGroup,
            int state,
            int keyOff,
            int keyLen,
            int nsOff,
            int nsLen,
            int ukOff,
            int ukLen,
            int valueOff,
            int valueLen,
            long arg)
            throws IOException {
        int startAbs = base + requestStart;
        long token = next;
        int slot = (int) (token & mask);
        starts[slot] = requestStart;
        states[slot] = IN_FLIGHT;
        ops[slot] = op;
        head = out.position - base;
        requestStart = -1;
        next++;
        int at = pending * COMMAND_LEN;
        commands.putLong(at, token);
        commands.put(at + 8, op);
        commands.put(at + 9, (byte) flags);
        commands.putShort(at + 10, (short) keyGroup);
        commands.putInt(at + 12, state);
        range(at + 16, startAbs, keyOff, keyLen);
        range(at + 24, startAbs, nsOff, nsLen);
        range(at + 32, startAbs, ukOff, ukLen);
        range(at + 40, startAbs, valueOff, valueLen);
        commands.putLong(at + 48, arg);
        commands.putLong(at + 56, 0L);
        pending++;
        if (pending == maxCommands) {
            drive(false);
        }
        return token;
    }

    private void range(int at, int startAbs, int off, int len) {
        if (off == NONE) {
            commands.putLong(at, 0L);
        } else {
            commands.putInt(at, startAbs + off);
            commands.putInt(at + 4, len);
        }
    }

    // ------------------------------------------------------------------------
    //  Completions
    // ------------------------------------------------------------------------

    /** Sends what is pending and takes what completed (waiting for one if {@code wait}). */
    private int drive(boolean wait) throws StatorException {
        checkFailure();
        int n;
        boolean sleeps = wait && next > oldest;
        if (sleeps) {
            waits++;
        }
        try {
            n = session.call(pending, sleeps);
        } catch (StatorException e) {
            // Some of the pending commands may be in statord and some not: this channel can no
            // longer tell, so it fails every later call rather than submit any of them twice.
            failure = e;
            throw e;
        }
        pending = 0;
        for (int i = 0; i < n; i++) {
            int at = i * COMPLETION_LEN;
            long token = completions.getLong(at);
            int status = completions.getInt(at + 8);
            int slot = (int) (token & mask);
            if (token < oldest || token >= next || states[slot] != IN_FLIGHT) {
                throw new StatorException(
                        StatorException.PROTOCOL, 0, "a completion for no request in flight: " + token);
            }
            states[slot] = DONE;
            if (token == awaited) {
                awaitedDone = true;
                resultStatus = status;
                resultFlags = completions.getInt(at + 12);
                resultLen = completions.getInt(at + 16);
                resultAux = completions.getLong(at + 24);
            } else if (sink != null
                    && sink.completed(
                            token,
                            status,
                            completions.getInt(at + 12),
                            completions.getInt(at + 16),
                            completions.getLong(at + 24))) {
                // taken by the sink
            } else if (status < 0 && failure == null) {
                failure =
                        new StatorException(
                                StatorException.STATUS,
                                status,
                                "statord failed a "
                                        + Opcode.name(ops[slot])
                                        + " request: "
                                        + Status.describe(status));
            }
        }
        while (oldest < next && states[(int) (oldest & mask)] == DONE) {
            states[(int) (oldest & mask)] = FREE;
            oldest++;
        }
        tail = oldest < next ? starts[(int) (oldest & mask)] : head;
        return n;
    }

    /**
     * Waits for request {@code token} (a read) and returns its status; its result lies in the
     * arena where the request's value range named, {@link #resultLength()} bytes, and stays
     * there until the next {@link #begin()}.
     */
    public int await(long token) throws IOException {
        awaited = token;
        awaitedDone = false;
        try {
            do {
                drive(true);
            } while (!awaitedDone);
        } finally {
            awaited = -1;
        }
        checkFailure();
        return resultStatus;
    }

    public int resultLength() {
        return resultLen;
    }

    public long resultAux() {
        return resultAux;
    }

    /** {@code MapIter}: more entries follow the page. */
    public boolean resultMore() {
        return (resultFlags & 1) != 0;
    }

    /** Sends completions no {@link #await} waits for to {@code sink} (once, before any request). */
    public void completions(Completions sink) {
        this.sink = sink;
    }

    /**
     * Hands statord what is pending and takes what completed, without waiting; returns how many
     * completions it took.
     */
    public int flush() throws IOException {
        int n = drive(false);
        checkFailure();
        return n;
    }

    /** Hands statord what is pending and waits for at least one completion. */
    public void pump() throws IOException {
        drive(true);
        checkFailure();
    }

    /**
     * The token the next {@link #submit} returns: a caller that must know a request before its
     * completion can arrive (a submit may hand statord the batch and take completions at once)
     * records it first.
     */
    public long nextToken() {
        return next;
    }

    /** Requests in statord (submitted or pending, not yet completed). */
    public long inFlight() {
        return next - oldest;
    }

    /** How many requests may be in flight at once. */
    public int capacity() {
        return mask + 1;
    }

    /** A request's slot (its index in per-request arrays of {@link #capacity()} entries). */
    public int slot(long token) {
        return (int) (token & mask);
    }

    /**
     * How many times a call of this channel slept on statord's doorbell: a thread that arms the
     * doorbell for itself ({@link io.stator.flink.jni.Sleeper}) re-arms when this moved.
     */
    public long waits() {
        return waits;
    }

    /** Hands statord every pending request and waits until none is in flight. */
    public void drain() throws IOException {
        while (next > oldest || pending > 0) {
            drive(true);
        }
        checkFailure();
    }

    private void checkFailure() throws StatorException {
        if (failure != null) {
            throw new StatorException(failure.code(), failure.detail(), failure.getMessage());
        }
    }

    /** The arena offset of a request's byte, given the request's start as {@link #submit} saw it. */
    public int absolute(long token, int relative) {
        return base + starts[(int) (token & mask)] + relative;
    }

    /**
     * Closes the session. Every later call on this channel fails (before it touches the arena,
     * which the session unmaps); callers close it under the same lock as their requests.
     */
    @Override
    public void close() throws StatorException {
        if (failure == null || failure.code() != StatorException.CLOSED) {
            failure = new StatorException(StatorException.CLOSED, 0, "the state backend is disposed");
        }
        session.close();
    }
}
