package io.stator.flink.jni;

/**
 * What a thread other than a session's caller sleeps on while the session's requests are in
 * flight: duplicates of the session's doorbell and control socket, and a wake fd of its own. It
 * holds no session, so {@link #sleep} runs without the session's lock: arm the doorbell ({@link
 * NativeSession#arm()}), sleep, then {@link NativeSession#disarm()}.
 *
 * <p>{@link #sleep} and {@link #wake} may run on different threads at once; {@link #close()}
 * only after the sleeping thread stopped and under the lock its wakers take.
 */
public final class Sleeper implements AutoCloseable {

    /** {@link #sleep} bits: the doorbell rang, the control socket is readable, a wake. */
    public static final int BELL = 1;
    public static final int SOCKET = 2;
    public static final int WAKE = 4;

    private volatile long handle;

    Sleeper(long handle) {
        this.handle = handle;
    }

    /** Sleeps up to {@code ms} milliseconds; returns what ended it. */
    public int sleep(int ms) throws StatorException {
        int r = StatorJni.sleep(live(), ms);
        if (r < 0) {
            throw Scratch.failure("sleeping for completions");
        }
        return r;
    }

    /** Ends the current sleep, or the next one. */
    public void wake() throws StatorException {
        if (StatorJni.wake(live()) < 0) {
            throw Scratch.failure("waking the completion thread");
        }
    }

    private long live() throws StatorException {
        long h = handle;
        if (h == 0) {
            throw new StatorException(StatorException.CLOSED, 0, "the sleeper is closed");
        }
        return h;
    }

    @Override
    public void close() {
        long h = handle;
        handle = 0;
        if (h != 0) {
            StatorJni.sleeperClose(h);
        }
    }
}
