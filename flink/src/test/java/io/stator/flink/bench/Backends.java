package io.stator.flink.bench;

import io.stator.flink.StatorStateBackend;
import io.stator.flink.testutils.Statord;

import org.apache.flink.api.common.JobID;
import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.core.fs.CloseableRegistry;
import org.apache.flink.metrics.groups.UnregisteredMetricsGroup;
import org.apache.flink.runtime.operators.testutils.MockEnvironment;
import org.apache.flink.runtime.state.CheckpointableKeyedStateBackend;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyedStateBackendParametersImpl;
import org.apache.flink.runtime.state.StateBackend;
import org.apache.flink.runtime.state.hashmap.HashMapStateBackend;
import org.apache.flink.runtime.state.ttl.TtlTimeProvider;
import org.apache.flink.state.rocksdb.EmbeddedRocksDBStateBackend;
import org.apache.flink.util.FileUtils;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;

/**
 * One keyed state backend for a benchmark trial: Flink's HashMap backend, EmbeddedRocksDB with
 * Flink's default settings (its files in a temporary directory), or Stator over a statord
 * started for the trial. A whole-range subtask (128 key groups), as in apache/flink-benchmarks.
 */
public final class Backends implements AutoCloseable {

    public static final int MAX_PARALLELISM = 128;

    private final Path dir;
    private final MockEnvironment env;
    private final Statord statord;
    private final CheckpointableKeyedStateBackend<?> backend;

    private <K> Backends(String kind, TypeSerializer<K> keys) throws Exception {
        dir = Files.createTempDirectory("stator-bench-");
        env = MockEnvironment.builder().build();
        StateBackend b;
        Statord d = null;
        switch (kind) {
            case "hashmap":
                b = new HashMapStateBackend();
                break;
            case "rocksdb":
                EmbeddedRocksDBStateBackend r = new EmbeddedRocksDBStateBackend();
                r.setDbStoragePath(dir.resolve("rocksdb").toString());
                b = r;
                break;
            case "stator":
                d = new Statord(dir.resolve("statord")).memoryBudgetMib(4096).start();
                b = new StatorStateBackend().setSocket(d.socket()).setJob("bench");
                break;
            default:
                throw new IllegalArgumentException("no backend " + kind + " (hashmap, rocksdb, stator)");
        }
        statord = d;
        backend =
                b.createKeyedStateBackend(
                        new KeyedStateBackendParametersImpl<>(
                                env,
                                new JobID(),
                                "KeyedProcess_0123456789abcdef0123456789abcdef_(1/1)",
                                keys,
                                MAX_PARALLELISM,
                                new KeyGroupRange(0, MAX_PARALLELISM - 1),
                                env.getTaskKvStateRegistry(),
                                TtlTimeProvider.DEFAULT,
                                new UnregisteredMetricsGroup(),
                                (name, value) -> {},
                                List.of(),
                                new CloseableRegistry(),
                                1.0));
    }

    public static <K> Backends open(String kind, TypeSerializer<K> keys) throws Exception {
        return new Backends(kind, keys);
    }

    @SuppressWarnings("unchecked")
    public <K> CheckpointableKeyedStateBackend<K> backend() {
        return (CheckpointableKeyedStateBackend<K>) backend;
    }

    @Override
    public void close() throws Exception {
        try {
            backend.dispose();
            backend.close();
            env.close();
        } finally {
            if (statord != null) {
                statord.close();
            }
            FileUtils.deleteDirectory(dir.toFile());
        }
    }
}
