package io.stator.flink.testutils;

import org.apache.flink.api.common.functions.AggregateFunction;
import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.AggregatingState;
import org.apache.flink.api.common.state.AggregatingStateDescriptor;
import org.apache.flink.api.common.state.ListState;
import org.apache.flink.api.common.state.ListStateDescriptor;
import org.apache.flink.api.common.state.MapState;
import org.apache.flink.api.common.state.MapStateDescriptor;
import org.apache.flink.api.common.state.ReducingState;
import org.apache.flink.api.common.state.ReducingStateDescriptor;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.runtime.state.FunctionInitializationContext;
import org.apache.flink.runtime.state.FunctionSnapshotContext;
import org.apache.flink.streaming.api.checkpoint.CheckpointedFunction;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.streaming.api.functions.sink.legacy.SinkFunction;
import org.apache.flink.streaming.api.functions.source.legacy.RichSourceFunction;
import org.apache.flink.streaming.api.functions.windowing.ProcessWindowFunction;
import org.apache.flink.streaming.api.watermark.Watermark;
import org.apache.flink.streaming.api.windowing.assigners.EventTimeSessionWindows;
import org.apache.flink.streaming.api.windowing.windows.TimeWindow;
import org.apache.flink.util.Collector;

import java.time.Duration;
import java.util.ArrayList;
import java.util.Map;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.atomic.AtomicBoolean;

/**
 * A keyed job that uses every kind of keyed state, event-time timers and a session-window
 * aggregation (merging windows), over a deterministic, checkpointed source. Its outputs are
 * made comparable across failures and backends: every action on a key prints that key's whole
 * state, and the sink keeps the latest print per key (replays after a failure print again, but
 * the last print of each key is its final state); session windows go to a set.
 */
public final class TestJob {

    public static final int KEYS = 100;

    /** What one run produced; static because MiniCluster runs tasks in this JVM. */
    public static final Map<String, Map<Integer, String>> LATEST = new ConcurrentHashMap<>();
    public static final Map<String, Set<String>> WINDOWS = new ConcurrentHashMap<>();
    public static final Map<String, AtomicBoolean> FAILED = new ConcurrentHashMap<>();
    /** Runs whose source may go on past its pause. */
    public static final Set<String> RELEASED = ConcurrentHashMap.newKeySet();

    private TestJob() {}

    /** Event time of record {@code i}: 10 ms apart per key, and a 2 s gap every 40 per key. */
    static long timestamp(long i) {
        return (i / KEYS) * 10 + (i / (40 * KEYS)) * 2000;
    }

    /**
     * Builds the job on {@code env}: records {@code [0, end)}, pausing at {@code pauseAt} (-1: never)
     * until cancelled or released, failing once at {@code failAt} (-1: never); results under {@code run}.
     */
    public static void build(StreamExecutionEnvironment env, String run, long end, long pauseAt, long failAt, int parallelism) {
        LATEST.putIfAbsent(run, new ConcurrentHashMap<>());
        WINDOWS.putIfAbsent(run, ConcurrentHashMap.newKeySet());
        DataStream<Long> numbers = numbers(env, run, end, pauseAt, failAt);
        numbers.keyBy(v -> (int) (v % KEYS), Types.INT)
                .process(new AllStates())
                .setParallelism(parallelism)
                .uid("all-states")
                .addSink(new Latest(run))
                .setParallelism(parallelism)
                .uid("latest");
        numbers.keyBy(v -> (int) (v % KEYS), Types.INT)
                .window(EventTimeSessionWindows.withGap(Duration.ofMillis(500)))
                .aggregate(new Count(), new Describe())
                .setParallelism(parallelism)
                .uid("sessions")
                .addSink(new Windows(run))
                .setParallelism(parallelism)
                .uid("windows");
    }

    /**
     * The jobs' input: records {@code [0, end)} in order from one checkpointed source, pausing at
     * {@code pauseAt} (-1: never) until released, failing the job once at {@code failAt} (-1:
     * never).
     */
    public static DataStream<Long> numbers(
            StreamExecutionEnvironment env, String run, long end, long pauseAt, long failAt) {
        FAILED.putIfAbsent(run, new AtomicBoolean());
        return env.addSource(new Numbers(run, end, pauseAt), "numbers")
                .returns(Types.LONG)
                .setParallelism(1)
                .uid("numbers")
                .map(new Failer(run, failAt))
                .setParallelism(1)
                .uid("failer");
    }

    /** The records, in order, from a checkpointed offset; pauses (idle, checkpointing) at pauseAt. */
    static final class Numbers extends RichSourceFunction<Long> implements CheckpointedFunction {
        private final String run;
        private final long end;
        private final long pauseAt;
        private volatile boolean running = true;
        private long next;
        private transient ListState<Long> offset;

        Numbers(String run, long end, long pauseAt) {
            this.run = run;
            this.end = end;
            this.pauseAt = pauseAt;
        }

        @Override
        public void run(SourceContext<Long> ctx) throws Exception {
            while (running && next < end) {
                if (next == pauseAt && !RELEASED.contains(run)) {
                    Thread.sleep(5);
                    continue;
                }
                synchronized (ctx.getCheckpointLock()) {
                    ctx.collectWithTimestamp(next, timestamp(next));
                    if (next % 50 == 0) {
                        ctx.emitWatermark(new Watermark(timestamp(next) - 1));
                    }
                    next++;
                }
                if (next % 400 == 0) {
                    Thread.sleep(1);
                }
            }
        }

        @Override
        public void cancel() {
            running = false;
        }

        @Override
        public void snapshotState(FunctionSnapshotContext context) throws Exception {
            offset.update(java.util.List.of(next));
        }

        @Override
        public void initializeState(FunctionInitializationContext context) throws Exception {
            offset = context.getOperatorStateStore().getListState(new ListStateDescriptor<>("offset", Types.LONG));
            for (Long o : offset.get()) {
                next = o;
            }
        }
    }

    /** Fails the job once, at record {@code failAt}. */
    static final class Failer implements org.apache.flink.api.common.functions.MapFunction<Long, Long> {
        private final String run;
        private final long failAt;

        Failer(String run, long failAt) {
            this.run = run;
            this.failAt = failAt;
        }

        @Override
        public Long map(Long v) {
            if (v == failAt && FAILED.get(run).compareAndSet(false, true)) {
                throw new RuntimeException("injected failure at record " + v);
            }
            return v;
        }
    }

    /** Every keyed state kind, and a timer per record; prints the key's state at every action. */
    public static final class AllStates extends KeyedProcessFunction<Integer, Long, String> {
        private transient ValueState<Long> sum;
        private transient ValueState<Long> fired;
        private transient ListState<Long> recent;
        private transient MapState<Integer, Long> buckets;
        private transient ReducingState<Long> max;
        private transient AggregatingState<Long, Long> count;

        @Override
        public void open(OpenContext openContext) {
            sum = getRuntimeContext().getState(new ValueStateDescriptor<>("sum", Types.LONG));
            fired = getRuntimeContext().getState(new ValueStateDescriptor<>("fired", Types.LONG));
            recent = getRuntimeContext().getListState(new ListStateDescriptor<>("recent", Types.LONG));
            buckets = getRuntimeContext().getMapState(new MapStateDescriptor<>("buckets", Types.INT, Types.LONG));
            max = getRuntimeContext().getReducingState(new ReducingStateDescriptor<>("max", Math::max, Types.LONG));
            count = getRuntimeContext().getAggregatingState(new AggregatingStateDescriptor<>("count", new Count(), Types.LONG));
        }

        @Override
        public void processElement(Long v, Context ctx, Collector<String> out) throws Exception {
            Long s = sum.value();
            sum.update((s == null ? 0 : s) + v);
            recent.add(v);
            ArrayList<Long> l = new ArrayList<>();
            recent.get().forEach(l::add);
            if (l.size() >= 20) {
                recent.update(java.util.List.of(l.stream().mapToLong(Long::longValue).sum()));
            }
            int b = (int) (v % 7);
            Long c = buckets.get(b);
            buckets.put(b, c == null ? 1 : c + 1);
            max.add(v);
            count.add(v);
            ctx.timerService().registerEventTimeTimer(ctx.timestamp() + 1000);
            out.collect(describe(ctx.getCurrentKey()));
        }

        @Override
        public void onTimer(long timestamp, OnTimerContext ctx, Collector<String> out) throws Exception {
            Long f = fired.value();
            fired.update((f == null ? 0 : f) + 1);
            out.collect(describe(ctx.getCurrentKey()));
        }

        private String describe(int key) throws Exception {
            TreeMap<Integer, Long> m = new TreeMap<>();
            for (Map.Entry<Integer, Long> e : buckets.entries()) {
                m.put(e.getKey(), e.getValue());
            }
            ArrayList<Long> l = new ArrayList<>();
            Iterable<Long> got = recent.get();
            if (got != null) {
                got.forEach(l::add);
            }
            return key + "|sum=" + sum.value() + "|recent=" + l + "|buckets=" + m + "|max=" + max.get()
                    + "|count=" + count.get() + "|fired=" + fired.value();
        }
    }

    /** Counts; also the aggregating state's function. */
    public static final class Count implements AggregateFunction<Long, Long, Long> {
        @Override
        public Long createAccumulator() {
            return 0L;
        }

        @Override
        public Long add(Long value, Long acc) {
            return acc + 1;
        }

        @Override
        public Long getResult(Long acc) {
            return acc;
        }

        @Override
        public Long merge(Long a, Long b) {
            return a + b;
        }
    }

    static final class Describe extends ProcessWindowFunction<Long, String, Integer, TimeWindow> {
        @Override
        public void process(Integer key, Context ctx, Iterable<Long> counts, Collector<String> out) {
            for (Long c : counts) {
                out.collect(key + "|" + ctx.window().getStart() + "|" + ctx.window().getEnd() + "|" + c);
            }
        }
    }

    /** Keeps the latest print of each key. */
    static final class Latest implements SinkFunction<String> {
        private final String run;

        Latest(String run) {
            this.run = run;
        }

        @Override
        public void invoke(String value, Context context) {
            LATEST.get(run).put(Integer.parseInt(value.substring(0, value.indexOf('|'))), value);
        }
    }

    static final class Windows implements SinkFunction<String> {
        private final String run;

        Windows(String run) {
            this.run = run;
        }

        @Override
        public void invoke(String value, Context context) {
            WINDOWS.get(run).add(value);
        }
    }

    /** The sum each key reaches after records {@code [0, upTo)}. */
    public static long expectedSum(int key, long upTo) {
        long s = 0;
        for (long i = key; i < upTo; i += KEYS) {
            s += i;
        }
        return s;
    }

    /** Whether run's latest prints show every record below {@code upTo} processed. */
    public static boolean processedUpTo(String run, long upTo) {
        Map<Integer, String> m = LATEST.get(run);
        for (int k = 0; k < KEYS; k++) {
            String s = m.get(k);
            if (s == null || !s.contains("|sum=" + expectedSum(k, upTo) + "|")) {
                return false;
            }
        }
        return true;
    }
}
