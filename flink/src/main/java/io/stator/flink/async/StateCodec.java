package io.stator.flink.async;

import org.apache.flink.api.common.typeutils.TypeSerializer;

/**
 * What the executor needs to encode a state's requests and decode their results: the state's id
 * in the session, its kind, and serializers of its own (duplicates: the executor serializes under
 * the channel's lock, on the task thread or its completion thread, never beside another user of
 * the same instance). The bytes are those of the synchronous backend's states, so a checkpoint
 * of either backend restores into the other.
 */
public final class StateCodec {

    /** The kinds of v2 state, each with the request types it takes. */
    public enum Kind {
        VALUE,
        LIST,
        MAP,
        REDUCING,
        AGGREGATING
    }

    final int stateId;
    final Kind kind;
    final TypeSerializer<Object> namespace;
    /** The value's (a list's element, a map's user value, an accumulator's). */
    final TypeSerializer<Object> value;
    /** A map's user key; null for other kinds. */
    final TypeSerializer<Object> userKey;
    /** The namespace of a request whose record never set one. */
    final Object defaultNamespace;
    /** The result room a read reserves; grows to the largest result seen, up to a bound. */
    int readCapacity = 256;

    @SuppressWarnings("unchecked")
    public StateCodec(
            int stateId,
            Kind kind,
            Object defaultNamespace,
            TypeSerializer<?> namespace,
            TypeSerializer<?> value,
            TypeSerializer<?> userKey) {
        this.defaultNamespace = defaultNamespace;
        this.stateId = stateId;
        this.kind = kind;
        this.namespace = (TypeSerializer<Object>) namespace.duplicate();
        this.value = (TypeSerializer<Object>) value.duplicate();
        this.userKey = userKey == null ? null : (TypeSerializer<Object>) userKey.duplicate();
    }

    /** A request's namespace: its record's for the state, else the state's default. */
    Object namespaceOf(org.apache.flink.runtime.asyncprocessing.StateRequest<?, ?, ?, ?> r) {
        Object ns = r.getNamespace();
        return ns != null ? ns : defaultNamespace;
    }

    /** A state object of the asynchronous backend carries its codec. */
    public interface Coded {
        StateCodec codec();
    }
}
