package io.stator.flink;

import org.apache.flink.configuration.ConfigOption;
import org.apache.flink.configuration.ConfigOptions;
import org.apache.flink.configuration.MemorySize;

import java.time.Duration;

/** The options of the Stator state backend ({@code state.backend.stator.*}). */
public final class StatorOptions {

    private StatorOptions() {}

    /** statord's control socket on this host. */
    public static final ConfigOption<String> SOCKET =
            ConfigOptions.key("state.backend.stator.socket")
                    .stringType()
                    .defaultValue("/run/stator/stator.sock")
                    .withDescription(
                            "statord's control socket on this host: <run_dir>/stator.sock "
                                    + "(/run/stator/stator.sock under the systemd unit, "
                                    + "./stator-run/stator.sock for `cargo run -p statord`). "
                                    + "The environment variable STATOR_SOCKET overrides the default.");

    /**
     * The tenant name the job's state is kept under in statord; empty: the Flink job id. Restores
     * and rescales within one name reference statord's segments; a checkpoint of another name is
     * copied in.
     */
    public static final ConfigOption<String> JOB =
            ConfigOptions.key("state.backend.stator.job")
                    .stringType()
                    .defaultValue("")
                    .withDescription(
                            "The name the job's state is kept under in statord (empty: the Flink "
                                    + "job id). Restores within one name move no bytes; restoring a "
                                    + "checkpoint of another name copies its state. Two jobs running "
                                    + "at once must never share a name.");

    public static final ConfigOption<Integer> QUEUE_ENTRIES =
            ConfigOptions.key("state.backend.stator.queue-entries")
                    .intType()
                    .defaultValue(4096)
                    .withDescription(
                            "Entries of each session's submission and completion queues (a power of two, 64 or more).");

    public static final ConfigOption<MemorySize> ARENA_SIZE =
            ConfigOptions.key("state.backend.stator.arena-size")
                    .memoryType()
                    .defaultValue(MemorySize.parse("64mb"))
                    .withDescription(
                            "Shared memory per task for keys, values and results (a power of two, 1 MiB to 1 GiB); "
                                    + "half of it holds requests in flight, so the largest value is about "
                                    + "half of this.");

    public static final ConfigOption<Integer> IN_FLIGHT =
            ConfigOptions.key("state.backend.stator.in-flight")
                    .intType()
                    .defaultValue(1024)
                    .withDescription(
                            "Requests one task may have in statord at once (a power of two, at most "
                                    + "queue-entries); writes wait beyond it.");

    public static final ConfigOption<Integer> ASYNC_IN_FLIGHT =
            ConfigOptions.key("state.backend.stator.async.in-flight")
                    .intType()
                    .defaultValue(8192)
                    .withDescription(
                            "Requests one task with asynchronous state (State V2) may have in statord "
                                    + "at once, reads and writes (a power of two; the session's queues "
                                    + "are at least as large); beyond it a submission waits for the "
                                    + "oldest. Flink's execution.async-state.total-buffer-size (6,000 "
                                    + "records) and active-buffer-size (1,000 requests per batch) decide "
                                    + "how many it sends.");

    public static final ConfigOption<Integer> WRITE_BATCH =
            ConfigOptions.key("state.backend.stator.write-batch")
                    .intType()
                    .defaultValue(256)
                    .withDescription(
                            "Writes gathered before they are handed to statord together (a read, a "
                                    + "checkpoint and the end of the task hand them over earlier).");

    public static final ConfigOption<Duration> SPIN =
            ConfigOptions.key("state.backend.stator.spin")
                    .durationType()
                    .defaultValue(Duration.ofNanos(50_000))
                    .withDescription("How long a task spins for a result before it sleeps.");
}
