package io.stator.flink.session;

/** The request opcodes of statord's wire protocol ({@code ring/PROTOCOL.md} §5). */
public final class Opcode {

    public static final byte NOP = 0;
    public static final byte GET = 1;
    public static final byte PUT = 2;
    public static final byte DELETE = 3;
    public static final byte LIST_APPEND = 4;
    public static final byte LIST_GET = 5;
    public static final byte LIST_REPLACE = 6;
    public static final byte MAP_GET = 7;
    public static final byte MAP_PUT = 8;
    public static final byte MAP_REMOVE = 9;
    public static final byte MAP_CONTAINS = 10;
    public static final byte MAP_ITER = 11;
    public static final byte CLEAR = 12;

    /** {@code MapIter}: resume after the user key given. */
    public static final int FLAG_ITER_RESUME = 0x02;
    /** {@link #LIST_APPEND}: the value is an encoded element list, appended whole. */
    public static final int FLAG_ELEMENTS = 0x08;

    /** {@code MapIter} modes. */
    public static final long ITER_KEYS = 1;
    public static final long ITER_VALUES = 2;
    public static final long ITER_ENTRIES = 3;

    private Opcode() {}

    static String name(byte op) {
        switch (op) {
            case NOP: return "Nop";
            case GET: return "Get";
            case PUT: return "Put";
            case DELETE: return "Delete";
            case LIST_APPEND: return "ListAppend";
            case LIST_GET: return "ListGet";
            case LIST_REPLACE: return "ListReplace";
            case MAP_GET: return "MapGet";
            case MAP_PUT: return "MapPut";
            case MAP_REMOVE: return "MapRemove";
            case MAP_CONTAINS: return "MapContains";
            case MAP_ITER: return "MapIter";
            case CLEAR: return "Clear";
            default: return "opcode " + op;
        }
    }
}
