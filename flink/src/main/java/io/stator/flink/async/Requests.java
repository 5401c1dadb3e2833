package io.stator.flink.async;

import io.stator.flink.jni.StatorException;
import io.stator.flink.session.ArenaInputView;
import io.stator.flink.session.Opcode;
import io.stator.flink.session.RequestChannel;
import io.stator.flink.session.Status;
import io.stator.flink.state.AbstractStatorState;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.api.java.tuple.Tuple2;
import org.apache.flink.core.memory.DataOutputSerializer;
import org.apache.flink.runtime.asyncprocessing.StateRequest;
import org.apache.flink.runtime.asyncprocessing.StateRequestType;
import org.apache.flink.runtime.state.v2.AbstractKeyedState;
import org.apache.flink.runtime.state.v2.adaptor.CompleteStateIterator;

import java.io.IOException;
import java.util.AbstractMap;
import java.util.ArrayList;
import java.util.Collections;
import java.util.List;
import java.util.Map;

/**
 * Flink's state requests as statord requests: {@link #submit} writes one into the session's
 * arena (key, namespace, user key and value serialized in place, as the synchronous backend's
 * states store them), {@link #completed} decodes its result where statord wrote it and completes
 * its future.
 *
 * <p>A write (update, add, put, remove, clear) completes its future once submitted: statord
 * applies a session's requests on one key in submission order, so a later read sees it, and a
 * failed write fails the channel's next call. A read completes when statord answers; one whose
 * result did not fit its room is asked again with more ({@link #resubmit}), as is an emptiness
 * check that met only a page without entries.
 *
 * <p>Everything here runs under the channel's lock (the task thread's submissions, the
 * completion thread's deliveries); {@link #completed} runs inside the channel's call, so it only
 * queues what it must ask again.
 */
final class Requests implements RequestChannel.Completions {

    /** Bytes asked for per map iteration page. */
    private static final int PAGE_BYTES = 32 << 10;
    /** The most result room a read keeps reserving after a larger result. */
    private static final int STICKY_CAPACITY = 64 << 10;

    private final RequestChannel ch;
    private final TypeSerializer<Object> keys;
    private final DataOutputSerializer scratch = new DataOutputSerializer(64);

    /** Reads in flight, by slot: the request, its result room (relative offset), its cursor. */
    private final StateRequest<?, ?, ?, ?>[] reads;
    private final int[] outOffs;
    private final MapCursor[] cursors;
    private int pendingReads;

    /** Reads to ask again, with the room or the cursor they need. */
    private final List<Retry> retries = new ArrayList<>();

    /** A synchronous request its caller waits for, and whether it ended (done or failed). */
    private StateRequest<?, ?, ?, ?> watched;
    private boolean watchedEnded;

    /** The key part of the request being written (offsets relative to its start). */
    private int keyGroup;
    private int keyOff;
    private int keyLen;
    private int nsOff;
    private int nsLen;

    private static final class Retry {
        final StateRequest<?, ?, ?, ?> request;
        final int capacity;
        final MapCursor cursor;

        Retry(StateRequest<?, ?, ?, ?> request, int capacity, MapCursor cursor) {
            this.request = request;
            this.capacity = capacity;
            this.cursor = cursor;
        }
    }

    @SuppressWarnings("unchecked")
    Requests(RequestChannel ch, TypeSerializer<?> keySerializer) {
        this.ch = ch;
        this.keys = (TypeSerializer<Object>) keySerializer.duplicate();
        int n = ch.capacity();
        this.reads = new StateRequest<?, ?, ?, ?>[n];
        this.outOffs = new int[n];
        this.cursors = new MapCursor[n];
    }

    /** Reads submitted and not yet answered (or queued to be asked again). */
    int pendingReads() {
        return pendingReads + retries.size();
    }

    // ------------------------------------------------------------------------
    //  Submitting
    // ------------------------------------------------------------------------

    /**
     * Watches {@code r} (null: none): {@link #watchedEnded} tells when its future completed or
     * failed. A failed Flink future never says it is done (its failure goes to the task's
     * handler), so a caller waiting for one must ask here.
     */
    void watch(StateRequest<?, ?, ?, ?> r) {
        watched = r;
        watchedEnded = false;
    }

    boolean watchedEnded() {
        return watchedEnded;
    }

    private void ended(StateRequest<?, ?, ?, ?> r) {
        if (r == watched) {
            watchedEnded = true;
        }
    }

    /** Writes {@code r} into the channel; a failure fails its future. */
    void submit(StateRequest<?, ?, ?, ?> r) {
        try {
            encode(r, 0, null);
        } catch (Throwable t) {
            fail(r, t);
        }
    }

    /** Asks again what {@link #completed} queued; returns whether there was anything. */
    boolean resubmit() {
        boolean any = !retries.isEmpty();
        while (!retries.isEmpty()) {
            Retry t = retries.remove(retries.size() - 1);
            try {
                encode(t.request, t.capacity, t.cursor);
            } catch (Throwable e) {
                fail(t.request, e);
            }
        }
        return any;
    }

    @SuppressWarnings("unchecked")
    private void encode(StateRequest<?, ?, ?, ?> r, int capacity, MapCursor cursor) throws IOException {
        StateCodec c = ((StateCodec.Coded) r.getState()).codec();
        Object payload = r.getPayload();
        StateRequestType type = r.getRequestType();
        boolean written =
                switch (type) {
                    case VALUE_GET, REDUCING_GET, AGGREGATING_GET -> {
                        read(r, c, Opcode.GET, null, room(c, capacity), 0);
                        yield false;
                    }
                    case LIST_GET -> {
                        read(r, c, Opcode.LIST_GET, null, room(c, capacity), 0);
                        yield false;
                    }
                    case MAP_GET -> {
                        read(r, c, Opcode.MAP_GET, payload, room(c, capacity), 0);
                        yield false;
                    }
                    case MAP_CONTAINS -> {
                        read(r, c, Opcode.MAP_CONTAINS, payload, -1, 0);
                        yield false;
                    }
                    case MAP_IS_EMPTY, MAP_ITER, MAP_ITER_KEY, MAP_ITER_VALUE -> {
                        iterate(r, c, cursor != null ? cursor : first(r, c, type), capacity);
                        yield false;
                    }
                    case ITERATOR_LOADING -> {
                        iterate(r, c, cursor != null ? cursor : (MapCursor) payload, capacity);
                        yield false;
                    }
                    case VALUE_UPDATE, REDUCING_ADD, AGGREGATING_ADD -> {
                        if (payload == null) {
                            writeKeyed(r, c, Opcode.DELETE);
                        } else {
                            beginKeyed(r, c);
                            int off = ch.mark();
                            c.value.serialize(payload, ch.out);
                            write(c, Opcode.PUT, 0, RequestChannel.NONE, 0, off, ch.mark() - off);
                        }
                        yield true;
                    }
                    case CLEAR -> {
                        writeKeyed(r, c, Opcode.CLEAR);
                        yield true;
                    }
                    case LIST_ADD -> {
                        if (payload == null) {
                            throw new NullPointerException("You cannot add null to a ListState.");
                        }
                        beginKeyed(r, c);
                        int off = ch.mark();
                        c.value.serialize(payload, ch.out);
                        write(c, Opcode.LIST_APPEND, 0, RequestChannel.NONE, 0, off, ch.mark() - off);
                        yield true;
                    }
                    case LIST_UPDATE -> {
                        List<Object> values = (List<Object>) payload;
                        if (values == null || values.isEmpty()) {
                            writeKeyed(r, c, Opcode.CLEAR);
                        } else {
                            writeElements(r, c, Opcode.LIST_REPLACE, 0, values);
                        }
                        yield true;
                    }
                    case LIST_ADD_ALL -> {
                        List<Object> values = (List<Object>) payload;
                        if (values != null && !values.isEmpty()) {
                            writeElements(r, c, Opcode.LIST_APPEND, Opcode.FLAG_ELEMENTS, values);
                        }
                        yield true;
                    }
                    case MAP_PUT -> {
                        Tuple2<Object, Object> e = (Tuple2<Object, Object>) payload;
                        putEntry(r, c, e.f0, e.f1);
                        yield true;
                    }
                    case MAP_PUT_ALL -> {
                        Map<Object, Object> m = (Map<Object, Object>) payload;
                        if (m != null) {
                            for (Map.Entry<Object, Object> e : m.entrySet()) {
                                putEntry(r, c, e.getKey(), e.getValue());
                            }
                        }
                        yield true;
                    }
                    case MAP_REMOVE -> {
                        beginKeyed(r, c);
                        int ukOff = ch.mark();
                        c.userKey.serialize(payload, ch.out);
                        write(c, Opcode.MAP_REMOVE, 0, ukOff, ch.mark() - ukOff, RequestChannel.NONE, 0);
                        yield true;
                    }
                    case SYNC_POINT, CUSTOMIZED ->
                            throw new UnsupportedOperationException(
                                    "Stator's state executor does not take " + type + " requests");
                };
        if (written) {
            r.getFuture().complete(null);
            ended(r);
        }
    }

    private static int room(StateCodec c, int capacity) {
        return capacity > 0 ? capacity : c.readCapacity;
    }

    /** Starts a request on the request's key and namespace. */
    private void beginKeyed(StateRequest<?, ?, ?, ?> r, StateCodec c) throws IOException {
        ch.begin();
        keyGroup = r.getRecordContext().getKeyGroup();
        keyOff = ch.mark();
        keys.serialize(r.getRecordContext().getKey(), ch.out);
        keyLen = ch.mark() - keyOff;
        nsOff = ch.mark();
        c.namespace.serialize(c.namespaceOf(r), ch.out);
        nsLen = ch.mark() - nsOff;
    }

    /** Starts a request on a map's key part as a cursor holds it. */
    private void beginKeyed(MapCursor m) throws IOException {
        ch.begin();
        keyGroup = m.keyGroup;
        keyOff = ch.mark();
        ch.out.write(m.key);
        keyLen = m.key.length;
        nsOff = ch.mark();
        ch.out.write(m.namespace);
        nsLen = m.namespace.length;
    }

    private long write(StateCodec c, byte op, int flags, int ukOff, int ukLen, int valueOff, int valueLen)
            throws IOException {
        return ch.submit(
                op, flags, keyGroup, c.stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, valueOff, valueLen, 0);
    }

    private void writeKeyed(StateRequest<?, ?, ?, ?> r, StateCodec c, byte op) throws IOException {
        beginKeyed(r, c);
        write(c, op, 0, RequestChannel.NONE, 0, RequestChannel.NONE, 0);
    }

    /** {@code op} with {@code values} as an encoded element list ({@code u32 len (LE) | bytes}). */
    private void writeElements(StateRequest<?, ?, ?, ?> r, StateCodec c, byte op, int flags, List<Object> values)
            throws IOException {
        beginKeyed(r, c);
        int off = ch.mark();
        for (Object v : values) {
            if (v == null) {
                throw new NullPointerException("You cannot have a null element in a ListState.");
            }
            int lenAt = ch.mark();
            ch.out.writeInt(0);
            c.value.serialize(v, ch.out);
            ch.patchIntLE(lenAt, ch.mark() - lenAt - 4);
        }
        write(c, op, flags, RequestChannel.NONE, 0, off, ch.mark() - off);
    }

    /** One map entry; its value with a null flag first, as the synchronous map state stores it. */
    private void putEntry(StateRequest<?, ?, ?, ?> r, StateCodec c, Object key, Object value) throws IOException {
        beginKeyed(r, c);
        int ukOff = ch.mark();
        c.userKey.serialize(key, ch.out);
        int ukLen = ch.mark() - ukOff;
        int off = ch.mark();
        ch.out.writeBoolean(value == null);
        if (value != null) {
            c.value.serialize(value, ch.out);
        }
        write(c, Opcode.MAP_PUT, 0, ukOff, ukLen, off, ch.mark() - off);
    }

    /**
     * A read on the request's key part, with a user key if {@code userKey} is not null, and
     * {@code capacity} bytes of result room (none if negative).
     */
    private void read(StateRequest<?, ?, ?, ?> r, StateCodec c, byte op, Object userKey, int capacity, long arg)
            throws IOException {
        beginKeyed(r, c);
        int ukOff = RequestChannel.NONE;
        int ukLen = 0;
        if (userKey != null) {
            ukOff = ch.mark();
            c.userKey.serialize(userKey, ch.out);
            ukLen = ch.mark() - ukOff;
        }
        int outOff = RequestChannel.NONE;
        int outLen = 0;
        if (capacity >= 0) {
            outOff = ch.mark();
            ch.out.reserve(capacity);
            outLen = capacity;
        }
        long token = track(r, outOff, null);
        try {
            ch.submit(op, 0, keyGroup, c.stateId, keyOff, keyLen, nsOff, nsLen, ukOff, ukLen, outOff, outLen, arg);
        } catch (IOException | RuntimeException e) {
            untrack(token);
            throw e;
        }
    }

    /** The cursor of a map iteration's first page: the request's key part, serialized. */
    private MapCursor first(StateRequest<?, ?, ?, ?> r, StateCodec c, StateRequestType type) throws IOException {
        scratch.clear();
        keys.serialize(r.getRecordContext().getKey(), scratch);
        byte[] key = scratch.getCopyOfBuffer();
        scratch.clear();
        c.namespace.serialize(c.namespaceOf(r), scratch);
        return new MapCursor(type, r.getRecordContext().getKeyGroup(), key, scratch.getCopyOfBuffer(), null);
    }

    /** A page of a map iteration ({@code MapIter}) from {@code m}. */
    private void iterate(StateRequest<?, ?, ?, ?> r, StateCodec c, MapCursor m, int capacity) throws IOException {
        beginKeyed(m);
        int flags = 0;
        int ukOff = RequestChannel.NONE;
        int ukLen = 0;
        if (m.after != null) {
            flags = Opcode.FLAG_ITER_RESUME;
            ukOff = ch.mark();
            ch.out.write(m.after);
            ukLen = m.after.length;
        }
        int room = capacity > 0 ? capacity : PAGE_BYTES;
        int outOff = ch.mark();
        ch.out.reserve(room);
        long token = track(r, outOff, m);
        try {
            ch.submit(
                    Opcode.MAP_ITER,
                    flags,
                    keyGroup,
                    c.stateId,
                    keyOff,
                    keyLen,
                    nsOff,
                    nsLen,
                    ukOff,
                    ukLen,
                    outOff,
                    room,
                    keysOnly(m.original) ? Opcode.ITER_KEYS : Opcode.ITER_ENTRIES);
        } catch (IOException | RuntimeException e) {
            untrack(token);
            throw e;
        }
    }

    private static boolean keysOnly(StateRequestType original) {
        return original == StateRequestType.MAP_ITER_KEY || original == StateRequestType.MAP_IS_EMPTY;
    }

    /**
     * Records a read under the token its submit will get, before the submit: a submit may hand
     * statord the batch and take completions, this read's among them, before it returns.
     */
    private long track(StateRequest<?, ?, ?, ?> r, int outOff, MapCursor m) {
        long token = ch.nextToken();
        int slot = ch.slot(token);
        reads[slot] = r;
        outOffs[slot] = outOff;
        cursors[slot] = m;
        pendingReads++;
        return token;
    }

    /** Forgets a read whose submit failed (its future fails instead). */
    private void untrack(long token) {
        int slot = ch.slot(token);
        if (reads[slot] != null) {
            reads[slot] = null;
            cursors[slot] = null;
            pendingReads--;
        }
    }

    // ------------------------------------------------------------------------
    //  Completions
    // ------------------------------------------------------------------------

    @Override
    public boolean completed(long token, int status, int flags, int length, long aux) {
        int slot = ch.slot(token);
        StateRequest<?, ?, ?, ?> r = reads[slot];
        if (r == null) {
            return false; // a write: the channel's own
        }
        MapCursor m = cursors[slot];
        reads[slot] = null;
        cursors[slot] = null;
        pendingReads--;
        int queued = retries.size();
        try {
            StateCodec c = ((StateCodec.Coded) r.getState()).codec();
            if (status == Status.RESULT_TOO_LARGE) {
                retries.add(new Retry(r, AbstractStatorState.grow(length), m));
            } else if (status < 0) {
                throw new StatorException(
                        StatorException.STATUS,
                        status,
                        "statord failed a "
                                + r.getRequestType()
                                + " request on state "
                                + c.stateId
                                + ": "
                                + Status.describe(status));
            } else {
                decode(r, c, m, status, ch.absolute(token, outOffs[slot]), length, aux, flags);
            }
            if (retries.size() == queued) {
                ended(r);
            }
        } catch (Throwable t) {
            fail(r, t);
        }
        return true;
    }

    @SuppressWarnings({"unchecked", "rawtypes"})
    private void decode(
            StateRequest<?, ?, ?, ?> r, StateCodec c, MapCursor m, int status, int at, int len, long aux, int flags)
            throws IOException {
        StateRequest<?, ?, ?, Object> out = (StateRequest<?, ?, ?, Object>) r;
        boolean found = status != Status.NOT_FOUND;
        ArenaInputView in = ch.in;
        switch (r.getRequestType()) {
            case VALUE_GET, REDUCING_GET, AGGREGATING_GET -> {
                remember(c, len);
                out.getFuture().complete(found ? c.value.deserialize(in.set(at, len)) : null);
            }
            case LIST_GET -> {
                remember(c, len);
                List<Object> elements = found ? elements(c, at, len) : Collections.emptyList();
                out.getFuture().complete(new CompleteStateIterator<>(elements));
            }
            case MAP_GET -> {
                remember(c, len);
                Object v = null;
                if (found) {
                    in.set(at, len);
                    v = in.readBoolean() ? null : c.value.deserialize(in);
                }
                out.getFuture().complete(v);
            }
            case MAP_CONTAINS -> out.getFuture().complete(aux != 0);
            case MAP_IS_EMPTY -> {
                boolean more = (flags & 1) != 0;
                if (aux > 0 || !more) {
                    out.getFuture().complete(aux == 0);
                } else {
                    retries.add(new Retry(r, 0, resume(m, at, len)));
                }
            }
            case MAP_ITER, MAP_ITER_KEY, MAP_ITER_VALUE, ITERATOR_LOADING -> {
                boolean more = (flags & 1) != 0;
                List<Object> page = page(c, m.original, at, len, aux);
                MapCursor next = more ? resume(m, at, len) : null;
                out.getFuture()
                        .complete(
                                new MapPageIterator(
                                        r.getState(),
                                        m.original,
                                        ((AbstractKeyedState) r.getState()).getStateRequestHandler(),
                                        page,
                                        next));
            }
            case VALUE_UPDATE,
                    REDUCING_ADD,
                    AGGREGATING_ADD,
                    CLEAR,
                    LIST_ADD,
                    LIST_UPDATE,
                    LIST_ADD_ALL,
                    MAP_PUT,
                    MAP_PUT_ALL,
                    MAP_REMOVE,
                    SYNC_POINT,
                    CUSTOMIZED ->
                    throw new IllegalStateException("a " + r.getRequestType() + " request is not a read");
        }
    }

    /** Later reads of the state reserve a result as large as this one, up to a bound. */
    private static void remember(StateCodec c, int len) {
        if (len > c.readCapacity && c.readCapacity < STICKY_CAPACITY) {
            c.readCapacity = Math.min(AbstractStatorState.grow(len), STICKY_CAPACITY);
        }
    }

    /** A list's elements ({@code u32 length (LE) | bytes} each), deserialized in place. */
    private List<Object> elements(StateCodec c, int at, int len) throws IOException {
        ArenaInputView in = ch.in;
        List<Object> out = new ArrayList<>();
        int pos = at;
        int end = at + len;
        while (pos < end) {
            in.set(pos, 4);
            int n = in.readIntLE();
            in.set(pos + 4, n);
            out.add(c.value.deserialize(in));
            pos += 4 + n;
        }
        return out;
    }

    /** The cursor after a page: the page ends with the resume key and its {@code u32} length. */
    private MapCursor resume(MapCursor m, int at, int len) throws IOException {
        ArenaInputView in = ch.in;
        in.set(at + len - 4, 4);
        int cursorLen = in.readIntLE();
        byte[] after = new byte[cursorLen];
        in.set(at + len - 4 - cursorLen, cursorLen);
        in.readFully(after);
        return new MapCursor(m.original, m.keyGroup, m.key, m.namespace, after);
    }

    /** A page's items as the iteration asked them: entries, user keys or user values. */
    private List<Object> page(StateCodec c, StateRequestType original, int at, int len, long entries)
            throws IOException {
        ArenaInputView in = ch.in;
        boolean keysOnly = keysOnly(original);
        List<Object> out = new ArrayList<>((int) Math.min(entries, 1024));
        int pos = at;
        for (long i = 0; i < entries; i++) {
            in.set(pos, 4);
            int kl = in.readIntLE();
            Object k = null;
            if (original != StateRequestType.MAP_ITER_VALUE) {
                in.set(pos + 4, kl);
                k = c.userKey.deserialize(in);
            }
            pos += 4 + kl;
            Object v = null;
            if (!keysOnly) {
                in.set(pos, 4);
                int vl = in.readIntLE();
                in.set(pos + 4, vl);
                v = in.readBoolean() ? null : c.value.deserialize(in);
                pos += 4 + vl;
            }
            switch (original) {
                case MAP_ITER_KEY -> out.add(k);
                case MAP_ITER_VALUE -> out.add(v);
                default -> out.add(new AbstractMap.SimpleImmutableEntry<>(k, v));
            }
        }
        return out;
    }

    /** Fails {@code r}: Flink hands the failure to the task's handler, which fails the task. */
    void fail(StateRequest<?, ?, ?, ?> r, Throwable t) {
        r.getFuture().completeExceptionally("statord failed a " + r.getRequestType() + " state request", t);
        ended(r);
    }

    /** Fails every read in flight or queued (the session is gone, or the executor stopped). */
    void failAll(Throwable t) {
        for (int i = 0; i < reads.length; i++) {
            if (reads[i] != null) {
                StateRequest<?, ?, ?, ?> r = reads[i];
                reads[i] = null;
                cursors[i] = null;
                fail(r, t);
            }
        }
        pendingReads = 0;
        for (Retry t2 : retries) {
            fail(t2.request, t);
        }
        retries.clear();
    }
}
