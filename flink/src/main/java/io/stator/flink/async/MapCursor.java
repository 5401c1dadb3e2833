package io.stator.flink.async;

import org.apache.flink.runtime.asyncprocessing.StateRequestType;

/**
 * Where a map iteration resumes: the map's key part (serialized key and namespace, as its first
 * page was asked with) and the last user key a page examined. It is the payload of Flink's
 * {@code ITERATOR_LOADING} request, so the next page reads the same map whatever record is
 * current when it is asked for.
 */
final class MapCursor {
    final StateRequestType original;
    final int keyGroup;
    final byte[] key;
    final byte[] namespace;
    final byte[] after;

    MapCursor(StateRequestType original, int keyGroup, byte[] key, byte[] namespace, byte[] after) {
        this.original = original;
        this.keyGroup = keyGroup;
        this.key = key;
        this.namespace = namespace;
        this.after = after;
    }
}
