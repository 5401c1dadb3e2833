package io.stator.flink.jni;

import java.io.IOException;

/**
 * A failure of statord or of the native library: what failed, the control or request status
 * statord gave (if any), and its message.
 */
public class StatorException extends IOException {

    private static final long serialVersionUID = 1L;

    /** The arguments were not valid. */
    public static final int ARGUMENT = -1;
    /** statord refused a control request; {@link #detail()} is its control status. */
    public static final int REFUSED = -2;
    /** statord is gone (it stopped or died). */
    public static final int GONE = -3;
    /** The submission queue or the arena is full. */
    public static final int FULL = -4;
    /** A request larger than the session's arena can hold. */
    public static final int TOO_LARGE = -5;
    /** The protocol was broken, or a call came out of order. */
    public static final int PROTOCOL = -6;
    /** A request completed with an error; {@link #detail()} is its status. */
    public static final int STATUS = -7;
    /** statord's socket could not be reached. */
    public static final int CONNECT = -8;
    /** A bug in the native library. */
    public static final int PANIC = -9;
    /** The channel was closed (the backend disposed); raised by the Java side only. */
    public static final int CLOSED = -10;

    /** Control status: the request did not decode (an older daemon meets a newer field). */
    public static final int CONTROL_MALFORMED = -1;
    /** Control status: the protocol version is not the daemon's. */
    public static final int CONTROL_VERSION = -2;

    private final int code;
    private final int detail;

    public StatorException(int code, int detail, String message) {
        super(message);
        this.code = code;
        this.detail = detail;
    }

    public StatorException(String message, Throwable cause) {
        super(message, cause);
        this.code = ARGUMENT;
        this.detail = 0;
    }

    /** What failed (one of this class's constants). */
    public int code() {
        return code;
    }

    /** The control status ({@link #REFUSED}) or request status ({@link #STATUS}), else 0. */
    public int detail() {
        return detail;
    }
}
