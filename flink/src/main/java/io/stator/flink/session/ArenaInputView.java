package io.stator.flink.session;

import org.apache.flink.core.memory.DataInputView;

import java.io.EOFException;
import java.io.IOException;
import java.io.UTFDataFormatException;
import java.nio.ByteBuffer;

/**
 * Flink's {@link DataInputView} over a range of a direct buffer (the arena, or a snapshot chunk
 * slot): results are deserialized where statord wrote them, with no copy.
 */
public final class ArenaInputView implements DataInputView {

    private ByteBuffer buf;
    private int position;
    private int end;

    public ArenaInputView() {}

    public ArenaInputView(ByteBuffer buf) {
        this.buf = buf;
    }

    /** Reads {@code [from, from + len)} of {@code buf} next. */
    public ArenaInputView set(ByteBuffer buf, int from, int len) {
        this.buf = buf;
        this.position = from;
        this.end = from + len;
        return this;
    }

    /** Reads {@code [from, from + len)} of the current buffer next. */
    public ArenaInputView set(int from, int len) {
        this.position = from;
        this.end = from + len;
        return this;
    }

    public int position() {
        return position;
    }

    public int available() {
        return end - position;
    }

    private void need(int n) throws EOFException {
        if (end - position < n) {
            throw new EOFException("read past the end of a statord result");
        }
    }

    @Override
    public void skipBytesToRead(int numBytes) throws IOException {
        need(numBytes);
        position += numBytes;
    }

    @Override
    public int read(byte[] b, int off, int len) throws IOException {
        if (len == 0) {
            return 0;
        }
        int n = Math.min(len, end - position);
        if (n <= 0) {
            return -1;
        }
        buf.get(position, b, off, n);
        position += n;
        return n;
    }

    @Override
    public int read(byte[] b) throws IOException {
        return read(b, 0, b.length);
    }

    @Override
    public void readFully(byte[] b) throws IOException {
        readFully(b, 0, b.length);
    }

    @Override
    public void readFully(byte[] b, int off, int len) throws IOException {
        need(len);
        buf.get(position, b, off, len);
        position += len;
    }

    @Override
    public int skipBytes(int n) {
        int k = Math.max(0, Math.min(n, end - position));
        position += k;
        return k;
    }

    @Override
    public boolean readBoolean() throws IOException {
        return readByte() != 0;
    }

    @Override
    public byte readByte() throws IOException {
        need(1);
        return buf.get(position++);
    }

    @Override
    public int readUnsignedByte() throws IOException {
        return readByte() & 0xFF;
    }

    @Override
    public short readShort() throws IOException {
        need(2);
        short v = buf.getShort(position);
        position += 2;
        return v;
    }

    @Override
    public int readUnsignedShort() throws IOException {
        return readShort() & 0xFFFF;
    }

    @Override
    public char readChar() throws IOException {
        need(2);
        char v = buf.getChar(position);
        position += 2;
        return v;
    }

    @Override
    public int readInt() throws IOException {
        need(4);
        int v = buf.getInt(position);
        position += 4;
        return v;
    }

    /** A little-endian {@code u32} (statord's own length fields). */
    public int readIntLE() throws IOException {
        return Integer.reverseBytes(readInt());
    }

    @Override
    public long readLong() throws IOException {
        need(8);
        long v = buf.getLong(position);
        position += 8;
        return v;
    }

    @Override
    public float readFloat() throws IOException {
        return Float.intBitsToFloat(readInt());
    }

    @Override
    public double readDouble() throws IOException {
        return Double.longBitsToDouble(readLong());
    }

    @Override
    public String readLine() throws IOException {
        StringBuilder sb = new StringBuilder();
        while (position < end) {
            char c = (char) (buf.get(position++) & 0xFF);
            if (c == '\n') {
                break;
            }
            if (c != '\r') {
                sb.append(c);
            }
        }
        return sb.toString();
    }

    /** Modified UTF-8 with a two-byte length, as {@link java.io.DataInputStream} reads it. */
    @Override
    public String readUTF() throws IOException {
        int len = readUnsignedShort();
        need(len);
        char[] chars = new char[len];
        int n = 0;
        int stop = position + len;
        while (position < stop) {
            int c = buf.get(position) & 0xFF;
            switch (c >> 4) {
                case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7:
                    position++;
                    chars[n++] = (char) c;
                    break;
                case 12: case 13: {
                    if (position + 2 > stop) {
                        throw new UTFDataFormatException("malformed input: partial character at end");
                    }
                    int c2 = buf.get(position + 1);
                    if ((c2 & 0xC0) != 0x80) {
                        throw new UTFDataFormatException("malformed input around byte " + position);
                    }
                    chars[n++] = (char) (((c & 0x1F) << 6) | (c2 & 0x3F));
                    position += 2;
                    break;
                }
                case 14: {
                    if (position + 3 > stop) {
                        throw new UTFDataFormatException("malformed input: partial character at end");
                    }
                    int c2 = buf.get(position + 1);
                    int c3 = buf.get(position + 2);
                    if (((c2 & 0xC0) != 0x80) || ((c3 & 0xC0) != 0x80)) {
                        throw new UTFDataFormatException("malformed input around byte " + (position + 1));
                    }
                    chars[n++] = (char) (((c & 0x0F) << 12) | ((c2 & 0x3F) << 6) | (c3 & 0x3F));
                    position += 3;
                    break;
                }
                default:
                    throw new UTFDataFormatException("malformed input around byte " + position);
            }
        }
        return new String(chars, 0, n);
    }
}
