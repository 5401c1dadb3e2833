package io.stator.flink.session;

import org.apache.flink.core.memory.DataInputView;
import org.apache.flink.core.memory.DataOutputView;

import java.io.IOException;
import java.io.UTFDataFormatException;
import java.nio.ByteBuffer;

/**
 * Flink's {@link DataOutputView} straight over the session's shared arena: serializers write
 * keys and values into the memory statord reads, with no staging copy. Numbers are big-endian,
 * as {@link java.io.DataOutput} specifies.
 *
 * <p>The view writes between its position and its limit; when a write would pass the limit it
 * asks its {@link Room} for more (which may move the bytes written so far, or wait for statord
 * to finish older requests), so a serializer never sees the end of the arena.
 */
public final class ArenaOutputView implements DataOutputView {

    /** Whoever decides where the view may write. */
    interface Room {
        /** Makes room for {@code bytes} more bytes after the view's position, or throws. */
        void grow(ArenaOutputView view, int bytes) throws IOException;
    }

    private final ByteBuffer arena;
    private final Room room;
    int position;
    int limit;

    ArenaOutputView(ByteBuffer arena, Room room) {
        this.arena = arena;
        this.room = room;
    }

    /** The arena offset the next byte goes to. */
    public int position() {
        return position;
    }

    private void need(int n) throws IOException {
        if (limit - position < n) {
            room.grow(this, n);
        }
    }

    /** Reserves {@code n} bytes (a result buffer) without writing them; returns their offset. */
    public int reserve(int n) throws IOException {
        need(n);
        int at = position;
        position += n;
        return at;
    }

    /** Moves {@code len} bytes within the arena (the regions may overlap). */
    void copyWithin(int src, int dst, int len) {
        arena.put(dst, arena, src, len);
    }

    @Override
    public void write(int b) throws IOException {
        need(1);
        arena.put(position++, (byte) b);
    }

    @Override
    public void write(byte[] b) throws IOException {
        write(b, 0, b.length);
    }

    @Override
    public void write(byte[] b, int off, int len) throws IOException {
        need(len);
        arena.put(position, b, off, len);
        position += len;
    }

    /** Copies {@code len} bytes of another direct buffer. */
    public void write(ByteBuffer src, int off, int len) throws IOException {
        need(len);
        arena.put(position, src, off, len);
        position += len;
    }

    @Override
    public void writeBoolean(boolean v) throws IOException {
        write(v ? 1 : 0);
    }

    @Override
    public void writeByte(int v) throws IOException {
        write(v);
    }

    @Override
    public void writeShort(int v) throws IOException {
        need(2);
        arena.putShort(position, (short) v);
        position += 2;
    }

    @Override
    public void writeChar(int v) throws IOException {
        need(2);
        arena.putChar(position, (char) v);
        position += 2;
    }

    @Override
    public void writeInt(int v) throws IOException {
        need(4);
        arena.putInt(position, v);
        position += 4;
    }

    @Override
    public void writeLong(long v) throws IOException {
        need(8);
        arena.putLong(position, v);
        position += 8;
    }

    @Override
    public void writeFloat(float v) throws IOException {
        writeInt(Float.floatToIntBits(v));
    }

    @Override
    public void writeDouble(double v) throws IOException {
        writeLong(Double.doubleToLongBits(v));
    }

    @Override
    public void writeBytes(String s) throws IOException {
        int n = s.length();
        need(n);
        for (int i = 0; i < n; i++) {
            arena.put(position++, (byte) s.charAt(i));
        }
    }

    @Override
    public void writeChars(String s) throws IOException {
        int n = s.length();
        need(2 * n);
        for (int i = 0; i < n; i++) {
            arena.putChar(position, s.charAt(i));
            position += 2;
        }
    }

    /** Modified UTF-8 with a two-byte length, as {@link java.io.DataOutputStream} writes it. */
    @Override
    public void writeUTF(String s) throws IOException {
        int n = s.length();
        int bytes = 0;
        for (int i = 0; i < n; i++) {
            char c = s.charAt(i);
            bytes += (c >= 0x0001 && c <= 0x007F) ? 1 : (c > 0x07FF ? 3 : 2);
        }
        if (bytes > 65535) {
            throw new UTFDataFormatException("encoded string too long: " + bytes + " bytes");
        }
        need(2 + bytes);
        arena.putShort(position, (short) bytes);
        position += 2;
        for (int i = 0; i < n; i++) {
            char c = s.charAt(i);
            if (c >= 0x0001 && c <= 0x007F) {
                arena.put(position++, (byte) c);
            } else if (c > 0x07FF) {
                arena.put(position++, (byte) (0xE0 | ((c >> 12) & 0x0F)));
                arena.put(position++, (byte) (0x80 | ((c >> 6) & 0x3F)));
                arena.put(position++, (byte) (0x80 | (c & 0x3F)));
            } else {
                arena.put(position++, (byte) (0xC0 | ((c >> 6) & 0x1F)));
                arena.put(position++, (byte) (0x80 | (c & 0x3F)));
            }
        }
    }

    @Override
    public void skipBytesToWrite(int numBytes) throws IOException {
        need(numBytes);
        position += numBytes;
    }

    @Override
    public void write(DataInputView source, int numBytes) throws IOException {
        need(numBytes);
        for (int i = 0; i < numBytes; i++) {
            arena.put(position++, source.readByte());
        }
    }
}
