package io.stator.flink.jni;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;

/**
 * The calling thread's scratch buffer: argument blocks out to the native side (little-endian
 * numbers, strings and byte strings as {@code u16 length} then bytes), results and error records
 * back. One per thread, so calls on different sessions from different threads never share one.
 */
final class Scratch {

    private static final ThreadLocal<Scratch> THREAD = ThreadLocal.withInitial(Scratch::new);

    private ByteBuffer buf;
    private long address;

    private Scratch() {
        allocate(64 << 10);
    }

    /** This thread's scratch buffer, cleared for a new argument block. */
    static Scratch get() {
        Scratch s = THREAD.get();
        s.buf.clear();
        return s;
    }

    private void allocate(int cap) {
        buf = ByteBuffer.allocateDirect(cap).order(ByteOrder.LITTLE_ENDIAN);
        address = StatorJni.address(buf);
    }

    private void ensure(int more) {
        if (buf.remaining() < more) {
            ByteBuffer old = buf;
            old.flip();
            allocate(Math.max(buf.capacity() * 2, old.remaining() + more));
            buf.put(old);
        }
    }

    long address() {
        return address;
    }

    int capacity() {
        return buf.capacity();
    }

    /** Bytes written so far. */
    int length() {
        return buf.position();
    }

    Scratch u8(int v) {
        ensure(1);
        buf.put((byte) v);
        return this;
    }

    Scratch u32(int v) {
        ensure(4);
        buf.putInt(v);
        return this;
    }

    Scratch u64(long v) {
        ensure(8);
        buf.putLong(v);
        return this;
    }

    Scratch bytes(byte[] b) {
        if (b.length > 0xFFFF) {
            throw new IllegalArgumentException(b.length + " bytes exceed a 65,535-byte field");
        }
        ensure(2 + b.length);
        buf.putShort((short) b.length);
        buf.put(b);
        return this;
    }

    Scratch str(String s) {
        return bytes(s.getBytes(StandardCharsets.UTF_8));
    }

    /** Makes room for a result of {@code n} bytes (a checkpoint handle). */
    void reserve(int n) {
        buf.clear();
        ensure(n);
    }

    /** The first {@code n} bytes of a result. */
    byte[] result(int n) {
        byte[] out = new byte[n];
        buf.get(0, out, 0, n);
        return out;
    }

    /** The exception for a failed call: its error record. */
    static StatorException failure(String what) {
        Scratch s = THREAD.get();
        int n = StatorJni.error(s.address, s.buf.capacity());
        if (n < 12) {
            return new StatorException(StatorException.PROTOCOL, 0, what + " failed (no details)");
        }
        int code = s.buf.getInt(0);
        int detail = s.buf.getInt(4);
        int len = Math.min(s.buf.getInt(8), n - 12);
        byte[] msg = new byte[len];
        s.buf.get(12, msg, 0, len);
        return new StatorException(
                code, detail, what + ": " + new String(msg, StandardCharsets.UTF_8));
    }
}
