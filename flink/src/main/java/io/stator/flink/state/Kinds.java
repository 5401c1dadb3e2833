package io.stator.flink.state;

import io.stator.flink.jni.NativeSession;

import org.apache.flink.api.common.state.StateDescriptor;
import org.apache.flink.util.FlinkRuntimeException;

/** The statord kind each of Flink's state types is kept as. */
public final class Kinds {

    private Kinds() {}

    /** Value, reducing and aggregating state are statord values (their functions run here). */
    public static NativeSession.Kind of(StateDescriptor.Type type) {
        switch (type) {
            case VALUE:
            case REDUCING:
            case AGGREGATING:
                return NativeSession.Kind.VALUE;
            case LIST:
                return NativeSession.Kind.LIST;
            case MAP:
                return NativeSession.Kind.MAP;
            default:
                throw new FlinkRuntimeException("Stator does not keep " + type + " state");
        }
    }
}
