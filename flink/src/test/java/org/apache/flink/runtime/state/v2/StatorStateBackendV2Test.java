package org.apache.flink.runtime.state.v2;

import io.stator.flink.StatorStateBackend;
import io.stator.flink.testutils.Statord;

import org.apache.flink.api.common.typeutils.TypeSerializer;
import org.apache.flink.core.fs.CloseableRegistry;
import org.apache.flink.core.fs.Path;
import org.apache.flink.runtime.execution.Environment;
import org.apache.flink.runtime.state.AsyncKeyedStateBackend;
import org.apache.flink.runtime.state.KeyGroupRange;
import org.apache.flink.runtime.state.KeyedStateBackendParametersImpl;
import org.apache.flink.runtime.state.KeyedStateHandle;
import org.apache.flink.runtime.state.ttl.TtlTimeProvider;
import org.apache.flink.runtime.state.CheckpointStorage;
import org.apache.flink.runtime.state.ConfigurableStateBackend;
import org.apache.flink.runtime.state.storage.FileSystemCheckpointStorage;
import org.apache.flink.runtime.state.storage.JobManagerCheckpointStorage;
import org.apache.flink.testutils.junit.extensions.parameterized.Parameter;
import org.apache.flink.testutils.junit.extensions.parameterized.ParameterizedTestExtension;
import org.apache.flink.testutils.junit.extensions.parameterized.Parameters;
import org.apache.flink.util.function.SupplierWithException;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.BeforeEach;
import org.junit.jupiter.api.extension.ExtendWith;
import org.junit.jupiter.api.io.TempDir;

import java.io.IOException;
import java.nio.file.Files;
import java.util.Arrays;
import java.util.Collections;
import java.util.List;

/**
 * Flink's own asynchronous (State V2) backend test suite ({@link StateBackendTestV2Base}) against
 * the Stator backend and a real statord, with the job manager's and a file system's checkpoint
 * storage. In Flink's package: the suite's test methods are package-private.
 */
@ExtendWith(ParameterizedTestExtension.class)
public class StatorStateBackendV2Test extends StateBackendTestV2Base<StatorStateBackend> {

    @TempDir static java.nio.file.Path dir;

    private static Statord statord;
    private static int tests;

    private String job;

    @BeforeEach
    void newJob() {
        job = "v2-backend-test-" + (++tests);
    }

    @Parameter public SupplierWithException<CheckpointStorage, IOException> storage;

    @Parameters(name = "storage = {0}")
    public static List<Object[]> storages() {
        SupplierWithException<CheckpointStorage, IOException> jobManager = JobManagerCheckpointStorage::new;
        SupplierWithException<CheckpointStorage, IOException> fileSystem =
                () -> new FileSystemCheckpointStorage(
                        new Path(Files.createTempDirectory(dir, "checkpoints").toUri()), 0, -1);
        return Arrays.asList(new Object[] {jobManager}, new Object[] {fileSystem});
    }

    @BeforeAll
    static void startStatord() throws Exception {
        statord = new Statord(dir).start();
    }

    @AfterAll
    static void stopStatord() throws Exception {
        if (statord != null) {
            statord.close();
        }
    }

    @Override
    protected ConfigurableStateBackend getStateBackend() {
        // One statord job per test: the suite restores a backend from the checkpoint of another
        // one with a new Flink job id (see StatorStateBackendTest).
        return new StatorStateBackend().setSocket(statord.socket()).setJob(job).setArenaBytes(8 << 20);
    }

    /**
     * As the suite's own, but as Flink's runtime calls a backend: Flink 2.3's suite passes the
     * range's size as the number of key groups (5 for key groups 5..9 of 10), which statord
     * refuses, as it checks a session's key groups against the job's maximum parallelism, and
     * names the operator after the subtask ({@code test_op_1_2}), where Flink gives every subtask
     * of an operator one identifier; statord restores a subtask from the checkpoints of its own
     * operator only.
     */
    @Override
    protected <K> AsyncKeyedStateBackend<K> createAsyncKeyedBackend(
            int subtask, int parallelism, TypeSerializer<K> keySerializer, KeyGroupRange range, Environment env)
            throws Exception {
        env.setCheckpointStorageAccess(getCheckpointStorageAccess());
        return restoreAsyncKeyedBackend(subtask, parallelism, keySerializer, range, Collections.emptyList(), env);
    }

    @Override
    protected <K> AsyncKeyedStateBackend<K> restoreAsyncKeyedBackend(
            int subtask,
            int parallelism,
            TypeSerializer<K> keySerializer,
            KeyGroupRange range,
            List<KeyedStateHandle> state,
            Environment env)
            throws Exception {
        return getStateBackend()
                .createAsyncKeyedStateBackend(
                        new KeyedStateBackendParametersImpl<>(
                                env,
                                jobID,
                                "test_op",
                                keySerializer,
                                Math.max(range.getNumberOfKeyGroups(), range.getEndKeyGroup() + 1),
                                range,
                                env.getTaskKvStateRegistry(),
                                TtlTimeProvider.DEFAULT,
                                getMetricGroup(),
                                getCustomInitializationMetrics(),
                                state,
                                new CloseableRegistry(),
                                1.0d));
    }

    @Override
    protected void restoreJob() {
        // Nothing to do before a restore: the checkpoints stay in statord, under this test's job.
    }

    @Override
    protected CheckpointStorage getCheckpointStorage() throws Exception {
        return storage.get();
    }
}
