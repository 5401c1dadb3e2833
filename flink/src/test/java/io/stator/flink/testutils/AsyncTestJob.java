package io.stator.flink.testutils;

import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.v2.AggregatingState;
import org.apache.flink.api.common.state.v2.AggregatingStateDescriptor;
import org.apache.flink.api.common.state.v2.ListState;
import org.apache.flink.api.common.state.v2.ListStateDescriptor;
import org.apache.flink.api.common.state.v2.MapState;
import org.apache.flink.api.common.state.v2.MapStateDescriptor;
import org.apache.flink.api.common.state.v2.ReducingState;
import org.apache.flink.api.common.state.v2.ReducingStateDescriptor;
import org.apache.flink.api.common.state.v2.StateFuture;
import org.apache.flink.api.common.state.v2.ValueState;
import org.apache.flink.api.common.state.v2.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.core.state.StateFutureUtils;
import org.apache.flink.streaming.api.datastream.DataStream;
import org.apache.flink.streaming.api.datastream.KeyedStream;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.util.Collector;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.concurrent.ConcurrentHashMap;

/**
 * {@link TestJob}'s keyed operator written against Flink's asynchronous state API (State V2,
 * {@code enableAsyncState()}): every v2 state kind, map iteration, list rewrites and a timer per
 * record, each step a state future chained on the last. Its prints have {@link TestJob}'s shape,
 * so {@link TestJob#processedUpTo} reads them; a run on Flink's HashMap backend (through Flink's
 * adaptor of synchronous backends) is the reference.
 */
public final class AsyncTestJob {

    private AsyncTestJob() {}

    /** As {@link TestJob#build}, with the asynchronous operator only. */
    public static void build(
            StreamExecutionEnvironment env, String run, long end, long pauseAt, long failAt, int parallelism) {
        build(env, run, end, pauseAt, failAt, parallelism, true);
    }

    /**
     * {@link #build(StreamExecutionEnvironment, String, long, long, long, int)}, or with {@code
     * async} false the same job on the synchronous state API: {@link TestJob}'s operator, with the
     * same states, timers and prints, under the same uid, so that either restores the other's
     * checkpoints.
     */
    public static void build(
            StreamExecutionEnvironment env,
            String run,
            long end,
            long pauseAt,
            long failAt,
            int parallelism,
            boolean async) {
        TestJob.LATEST.putIfAbsent(run, new ConcurrentHashMap<>());
        DataStream<Long> numbers = TestJob.numbers(env, run, end, pauseAt, failAt);
        KeyedStream<Long, Integer> keyed = numbers.keyBy(v -> (int) (v % TestJob.KEYS), Types.INT);
        (async ? keyed.enableAsyncState().process(new AsyncStates()) : keyed.process(new TestJob.AllStates()))
                .setParallelism(parallelism)
                .uid("async-states")
                .addSink(new TestJob.Latest(run))
                .setParallelism(parallelism)
                .uid("latest");
    }

    /** Every v2 state kind; prints the key's state at every action, read asynchronously. */
    static final class AsyncStates extends KeyedProcessFunction<Integer, Long, String> {
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
            count = getRuntimeContext()
                    .getAggregatingState(new AggregatingStateDescriptor<>("count", new TestJob.Count(), Types.LONG));
        }

        @Override
        public void processElement(Long v, Context ctx, Collector<String> out) {
            int key = ctx.getCurrentKey();
            int b = (int) (v % 7);
            ctx.timerService().registerEventTimeTimer(ctx.timestamp() + 1000);
            sum.asyncValue()
                    .thenCompose(s -> sum.asyncUpdate((s == null ? 0 : s) + v))
                    .thenCompose(x -> recent.asyncAdd(v))
                    .thenCompose(x -> recent.asyncGet())
                    .thenCompose(it -> {
                        List<Long> l = new ArrayList<>();
                        return it.onNext((Long x) -> {
                                    l.add(x);
                                })
                                .thenApply(y -> l);
                    })
                    .thenCompose(l -> l.size() >= 20
                            ? recent.asyncUpdate(List.of(l.stream().mapToLong(Long::longValue).sum()))
                            : StateFutureUtils.completedVoidFuture())
                    .thenCompose(x -> buckets.asyncGet(b))
                    .thenCompose(c -> buckets.asyncPut(b, c == null ? 1 : c + 1))
                    .thenCompose(x -> max.asyncAdd(v))
                    .thenCompose(x -> count.asyncAdd(v))
                    .thenCompose(x -> describe(key))
                    .thenAccept(out::collect);
        }

        @Override
        public void onTimer(long timestamp, OnTimerContext ctx, Collector<String> out) {
            int key = ctx.getCurrentKey();
            fired.asyncValue()
                    .thenCompose(f -> fired.asyncUpdate((f == null ? 0 : f) + 1))
                    .thenCompose(x -> describe(key))
                    .thenAccept(out::collect);
        }

        /** The key's whole state, as {@link TestJob} prints it. */
        private StateFuture<String> describe(int key) {
            StringBuilder sb = new StringBuilder().append(key);
            TreeMap<Integer, Long> m = new TreeMap<>();
            List<Long> l = new ArrayList<>();
            return sum.asyncValue()
                    .thenCompose(s -> {
                        sb.append("|sum=").append(s);
                        return recent.asyncGet();
                    })
                    .thenCompose(it -> it.onNext((Long x) -> {
                        l.add(x);
                    }))
                    .thenCompose(x -> {
                        sb.append("|recent=").append(l);
                        return buckets.asyncEntries();
                    })
                    .thenCompose(it -> it.onNext((Map.Entry<Integer, Long> e) -> {
                        m.put(e.getKey(), e.getValue());
                    }))
                    .thenCompose(x -> {
                        sb.append("|buckets=").append(m);
                        return max.asyncGet();
                    })
                    .thenCompose(mx -> {
                        sb.append("|max=").append(mx);
                        return count.asyncGet();
                    })
                    .thenCompose(c -> {
                        sb.append("|count=").append(c);
                        return fired.asyncValue();
                    })
                    .thenApply(f -> sb.append("|fired=").append(f).toString());
        }
    }
}
