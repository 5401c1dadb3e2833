package io.stator.flink.snapshot;

import io.stator.flink.jni.NativeSession;
import io.stator.flink.jni.StatorException;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;
import java.util.zip.CRC32C;

/**
 * Reads the records of a portable snapshot ({@code store/FORMAT.md} §13) as statord exports it
 * into a session's chunk slots, each chunk in place: the state table, then per key group its
 * records, each a stored key ({@code u16 BE key group, u32 BE state id, u32 BE key length, key,
 * u32 BE namespace length, namespace, user key}) and a value. Items may span chunks; the reader
 * carries the cut part over.
 */
public final class PortableSnapshotReader implements AutoCloseable {

    private static final int HEADER = 32;

    private final NativeSession session;
    private final ByteBuffer[] slots;
    private boolean closed;
    private ByteBuffer chunk;
    private int pos;
    private int end;
    private boolean last;
    private boolean done;
    private int expectIndex;
    private long snapshotId = -1;

    /** State id -> name and kind, from the state table. */
    private final Map<Integer, String> names = new HashMap<>();
    private final Map<Integer, Integer> kinds = new HashMap<>();

    private byte[] key = new byte[256];
    private int keyLen;
    private byte[] value = new byte[256];
    private int valueLen;
    private int keyGroup = -1;

    private final boolean ownsSession;

    /**
     * Reads the export started on {@code session}; with {@code ownsSession}, {@link #close()}
     * closes the session too.
     */
    public PortableSnapshotReader(NativeSession session, boolean ownsSession) throws StatorException {
        this.session = session;
        this.ownsSession = ownsSession;
        int n = session.chunkSlots();
        this.slots = new ByteBuffer[n];
        for (int i = 0; i < n; i++) {
            slots[i] = session.chunkSlot(i).order(ByteOrder.LITTLE_ENDIAN);
        }
    }

    /** Takes the next chunk; false at the end of the stream. */
    private boolean nextChunk() throws IOException {
        if (last) {
            return false;
        }
        long r = session.exportNext();
        if (r == NativeSession.EXPORT_END) {
            throw new IOException("the snapshot ended without its last chunk");
        }
        int slot = (int) (r >>> 32);
        int len = (int) r;
        ByteBuffer c = slots[slot];
        if (len < HEADER || c.get(0) != 'S' || c.get(1) != 'T' || c.get(2) != 'S' || c.get(3) != 'N') {
            throw new IOException("a snapshot chunk without its header");
        }
        int flags = c.getShort(6) & 0xFFFF;
        long id = c.getLong(8);
        int index = c.getInt(16);
        int payload = c.getInt(20);
        if (payload != len - HEADER || index != expectIndex || (snapshotId != -1 && id != snapshotId)) {
            throw new IOException("snapshot chunk " + index + " is out of order or cut");
        }
        CRC32C crc = new CRC32C();
        crc.update(c.duplicate().position(HEADER).limit(len));
        if ((int) crc.getValue() != c.getInt(24)) {
            throw new IOException("snapshot chunk " + index + " fails its checksum");
        }
        snapshotId = id;
        expectIndex++;
        last = (flags & 1) != 0;
        chunk = c;
        pos = HEADER;
        end = len;
        return true;
    }

    private void read(byte[] into, int off, int n) throws IOException {
        while (n > 0) {
            if (pos == end && !nextChunk()) {
                throw new IOException("the snapshot ends inside an item");
            }
            int k = Math.min(n, end - pos);
            chunk.get(pos, into, off, k);
            pos += k;
            off += k;
            n -= k;
        }
    }

    private final byte[] word = new byte[8];

    private int u32le() throws IOException {
        read(word, 0, 4);
        return (word[0] & 0xFF) | (word[1] & 0xFF) << 8 | (word[2] & 0xFF) << 16 | (word[3] & 0xFF) << 24;
    }

    /**
     * Moves to the next record; false at the end. The record's stored key and value are then
     * {@link #key()} / {@link #keyLength()} and {@link #value()} / {@link #valueLength()}.
     */
    public boolean next() throws IOException {
        while (!done) {
            if (pos == end && !nextChunk()) {
                done = true;
                return false;
            }
            read(word, 0, 8);
            int kind = word[0] & 0xFF;
            if (kind == 0xFE) {
                int bodyLen =
                        (word[4] & 0xFF) | (word[5] & 0xFF) << 8 | (word[6] & 0xFF) << 16 | (word[7] & 0xFF) << 24;
                byte[] body = new byte[bodyLen];
                read(body, 0, bodyLen);
                ByteBuffer b = ByteBuffer.wrap(body).order(ByteOrder.LITTLE_ENDIAN);
                int count = b.getInt();
                for (int i = 0; i < count; i++) {
                    int id = b.getInt();
                    int k = b.get() & 0xFF;
                    b.get();
                    int nameLen = b.getShort() & 0xFFFF;
                    byte[] name = new byte[nameLen];
                    b.get(name);
                    names.put(id, new String(name, StandardCharsets.UTF_8));
                    kinds.put(id, k);
                }
            } else if (kind == 0xFF) {
                keyGroup =
                        (word[4] & 0xFF) | (word[5] & 0xFF) << 8 | (word[6] & 0xFF) << 16 | (word[7] & 0xFF) << 24;
            } else if (kind == 1) {
                keyLen = (word[2] & 0xFF) | (word[3] & 0xFF) << 8;
                valueLen =
                        (word[4] & 0xFF) | (word[5] & 0xFF) << 8 | (word[6] & 0xFF) << 16 | (word[7] & 0xFF) << 24;
                if (key.length < keyLen) {
                    key = new byte[Math.max(keyLen, key.length * 2)];
                }
                if (value.length < valueLen) {
                    value = new byte[Math.max(valueLen, value.length * 2)];
                }
                read(key, 0, keyLen);
                read(value, 0, valueLen);
                return true;
            } else {
                throw new IOException("an unknown item " + kind + " in a snapshot");
            }
        }
        return false;
    }

    public byte[] key() {
        return key;
    }

    public int keyLength() {
        return keyLen;
    }

    public byte[] value() {
        return value;
    }

    public int valueLength() {
        return valueLen;
    }

    public int keyGroup() {
        return keyGroup;
    }

    /** The state the current record belongs to (from its key), by name. */
    public String stateName() {
        return names.get(stateId());
    }

    public int stateId() {
        return be32(key, 2);
    }

    /** Where the key part of the record's stored key starts, and its length. */
    public int keyOffset() {
        return 10;
    }

    public int keyPartLength() {
        return be32(key, 6);
    }

    public int namespaceOffset() {
        return 14 + keyPartLength();
    }

    public int namespaceLength() {
        return be32(key, 10 + keyPartLength());
    }

    /** Where a map entry's user key starts (its length runs to the end of the key). */
    public int mapKeyOffset() {
        return namespaceOffset() + namespaceLength();
    }

    static int be32(byte[] b, int at) {
        return (b[at] & 0xFF) << 24 | (b[at + 1] & 0xFF) << 16 | (b[at + 2] & 0xFF) << 8 | (b[at + 3] & 0xFF);
    }

    /** Ends the export: after its last chunk, hands the slot back; before it, cancels. */
    @Override
    public void close() throws StatorException {
        if (closed) {
            return;
        }
        closed = true;
        try {
            if (last) {
                session.exportNext();
            } else {
                session.exportCancel();
            }
        } finally {
            if (ownsSession) {
                session.close();
            }
        }
    }
}
