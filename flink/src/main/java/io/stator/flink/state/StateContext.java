package io.stator.flink.state;

import io.stator.flink.session.RequestChannel;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.core.memory.DataOutputSerializer;

/** What a state needs of its keyed backend. */
public interface StateContext<K> {

    RequestChannel channel();

    /** The current key, serialized (cached until the key changes). */
    DataOutputSerializer currentKeyBytes() throws java.io.IOException;

    K getCurrentKey();

    int getCurrentKeyGroupIndex();

    void setCurrentKeyAndKeyGroup(K key, int keyGroup);

    int getNumberOfKeyGroups();

    TypeSerializer<K> getKeySerializer();
}
