package io.stator.flink.example;

import org.apache.flink.api.common.functions.OpenContext;
import org.apache.flink.api.common.state.ValueState;
import org.apache.flink.api.common.state.ValueStateDescriptor;
import org.apache.flink.api.common.typeinfo.Types;
import org.apache.flink.configuration.CheckpointingOptions;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.configuration.StateBackendOptions;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.streaming.api.functions.KeyedProcessFunction;
import org.apache.flink.util.Collector;

import java.nio.file.Files;
import java.time.Duration;

/**
 * The README's example job: a running sum per key, its state in statord. Run it with the
 * stator-flink jar and Flink on the classpath and statord listening:
 * {@code SumPerKey [socket]} (default {@code ./stator-run/stator.sock}).
 */
public final class SumPerKey {

    private SumPerKey() {}

    public static void main(String[] args) throws Exception {
        Configuration conf = new Configuration();
        conf.set(StateBackendOptions.STATE_BACKEND, "io.stator.flink.StatorStateBackendFactory");
        conf.setString("state.backend.stator.socket", args.length > 0 ? args[0] : "stator-run/stator.sock");
        conf.set(CheckpointingOptions.CHECKPOINTING_INTERVAL, Duration.ofSeconds(10));
        conf.set(
                CheckpointingOptions.CHECKPOINTS_DIRECTORY,
                Files.createTempDirectory("checkpoints").toUri().toString());
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);
        env.fromSequence(0, 1_000_000)
                .keyBy(v -> v % 1000)
                .process(new Sum())
                .print();
        env.execute("sum per key on Stator");
    }

    /** Keeps a running sum per key in a value state. */
    static final class Sum extends KeyedProcessFunction<Long, Long, String> {
        private transient ValueState<Long> sum;

        @Override
        public void open(OpenContext ctx) {
            sum = getRuntimeContext().getState(new ValueStateDescriptor<>("sum", Types.LONG));
        }

        @Override
        public void processElement(Long v, Context ctx, Collector<String> out) throws Exception {
            Long s = sum.value();
            long next = s == null ? v : s + v;
            sum.update(next);
            out.collect(ctx.getCurrentKey() + " -> " + next);
        }
    }
}
