package org.apache.flink.runtime.state;

import io.stator.flink.StatorStateBackend;
import io.stator.flink.testutils.Statord;

import org.apache.flink.core.fs.Path;
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
import java.util.List;

/**
 * Flink's own keyed state backend test suite ({@link StateBackendTestBase}) against the Stator
 * backend and a real statord, with the job manager's and a file system's checkpoint storage. It
 * lives in Flink's package because the suite's test methods are package-private.
 */
@ExtendWith(ParameterizedTestExtension.class)
public class StatorStateBackendTest extends StateBackendTestBase<StatorStateBackend> {

    @TempDir static java.nio.file.Path dir;

    private static Statord statord;
    private static int tests;

    /** The statord job name of the current test's backends. */
    private String job;

    @BeforeEach
    void newJob() {
        job = "backend-test-" + (++tests);
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
        // One statord job name for the backends of one test: the suite gives each backend a new
        // Flink job id, and its restores combine checkpoints of several backends, which statord
        // restores by reference only within one job. (A job is a fresh one per test, as no test
        // completes its checkpoints and statord bounds those of one operator.)
        return new StatorStateBackend().setSocket(statord.socket()).setJob(job).setArenaBytes(8 << 20);
    }

    @Override
    protected CheckpointStorage getCheckpointStorage() throws Exception {
        return storage.get();
    }

    @Override
    protected boolean isSerializerPresenceRequiredOnRestore() {
        return false;
    }

    @Override
    protected boolean supportsAsynchronousSnapshots() {
        return true;
    }

    @Override
    protected boolean isSafeToReuseKVState() {
        return false;
    }
}
