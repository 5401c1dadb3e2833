package io.stator.flink.session;

/** The request statuses of statord's wire protocol ({@code ring/PROTOCOL.md} §6). */
public final class Status {

    public static final int OK = 0;
    public static final int NOT_FOUND = 1;
    public static final int RESULT_TOO_LARGE = -6;
    public static final int BUSY = -11;

    private Status() {}

    /** The protocol's name and message of a status. */
    public static String describe(int status) {
        switch (status) {
            case 0: return "Ok";
            case 1: return "NotFound";
            case -1: return "BadOpcode: unknown opcode";
            case -2: return "BadFlags: flags not valid for this opcode";
            case -3: return "BadRange: a range lies outside the arena";
            case -4: return "BadState: state id not registered in this session, or of the wrong kind";
            case -5: return "BadKeyGroup: key group outside this session's key-group range";
            case -6: return "ResultTooLarge: result does not fit the buffer";
            case -7: return "NoBuffer";
            case -8: return "BadBuffer";
            case -9: return "BadArgument: an argument is invalid";
            case -10: return "TooLarge: key or value exceeds the session's limits";
            case -11: return "Busy: a limit is reached (memory budget, or flushes failing)";
            case -12: return "Io: storage I/O error";
            case -13: return "Corrupt: stored data failed its checksum";
            case -14: return "NoSpace: the disk is full";
            case -15: return "Unsupported";
            case -16: return "ShuttingDown: statord is shutting down";
            case -17: return "Remote: remote storage failed";
            case -18: return "Internal: internal daemon error";
            case -19: return "BadSnapshot";
            default: return "status " + status;
        }
    }
}
