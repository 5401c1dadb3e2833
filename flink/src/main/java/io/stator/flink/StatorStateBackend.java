package io.stator.flink;

import org.apache.flink.configuration.ReadableConfig;
import org.apache.flink.core.execution.SavepointFormatType;
import org.apache.flink.runtime.state.AbstractKeyedStateBackend;
import org.apache.flink.runtime.state.AbstractStateBackend;
import org.apache.flink.runtime.state.AsyncKeyedStateBackend;
import org.apache.flink.runtime.state.ConfigurableStateBackend;
import org.apache.flink.runtime.state.DefaultOperatorStateBackendBuilder;
import org.apache.flink.runtime.state.OperatorStateBackend;
import org.apache.flink.runtime.state.BackendBuildingException;

import java.io.IOException;
import java.time.Duration;

/**
 * Apache Flink's keyed state in statord, the Stator daemon on this host: select it with {@code
 * state.backend.type: io.stator.flink.StatorStateBackendFactory}, or set an instance on the
 * environment. Operator state stays Flink's own (as with every Flink backend).
 *
 * <p>Checkpoints are statord's native checkpoints (metadata, not bytes): Flink keeps a small
 * handle per subtask; restore and rescale reference the checkpoint's segments in statord.
 */
public class StatorStateBackend extends AbstractStateBackend implements ConfigurableStateBackend {

    private static final long serialVersionUID = 1L;

    /** What {@code getBackendTypeIdentifier} says. */
    public static final String IDENTIFIER = "stator";

    private String socket;
    private String job;
    private int queueEntries;
    private long arenaBytes;
    private int inFlight;
    private int asyncInFlight;
    private int writeBatch;
    private long spinNanos;

    public StatorStateBackend() {
        String env = System.getenv("STATOR_SOCKET");
        this.socket = env != null && !env.isEmpty() ? env : StatorOptions.SOCKET.defaultValue();
        this.job = StatorOptions.JOB.defaultValue();
        this.queueEntries = StatorOptions.QUEUE_ENTRIES.defaultValue();
        this.arenaBytes = StatorOptions.ARENA_SIZE.defaultValue().getBytes();
        this.inFlight = StatorOptions.IN_FLIGHT.defaultValue();
        this.asyncInFlight = StatorOptions.ASYNC_IN_FLIGHT.defaultValue();
        this.writeBatch = StatorOptions.WRITE_BATCH.defaultValue();
        this.spinNanos = StatorOptions.SPIN.defaultValue().toNanos();
    }

    private StatorStateBackend(StatorStateBackend original, ReadableConfig config) {
        super();
        this.latencyTrackingConfigBuilder = original.latencyTrackingConfigBuilder.configure(config);
        this.sizeTrackingConfigBuilder = original.sizeTrackingConfigBuilder.configure(config);
        this.socket = config.getOptional(StatorOptions.SOCKET).orElse(original.socket);
        this.job = config.getOptional(StatorOptions.JOB).orElse(original.job);
        this.queueEntries = config.getOptional(StatorOptions.QUEUE_ENTRIES).orElse(original.queueEntries);
        this.arenaBytes =
                config.getOptional(StatorOptions.ARENA_SIZE).map(m -> m.getBytes()).orElse(original.arenaBytes);
        this.inFlight = config.getOptional(StatorOptions.IN_FLIGHT).orElse(original.inFlight);
        this.asyncInFlight = config.getOptional(StatorOptions.ASYNC_IN_FLIGHT).orElse(original.asyncInFlight);
        this.writeBatch = config.getOptional(StatorOptions.WRITE_BATCH).orElse(original.writeBatch);
        this.spinNanos = config.getOptional(StatorOptions.SPIN).map(Duration::toNanos).orElse(original.spinNanos);
        validate();
    }

    private void validate() {
        check(Integer.bitCount(queueEntries) == 1 && queueEntries >= 64, StatorOptions.QUEUE_ENTRIES.key(), queueEntries);
        // A power of two from 1 MiB to 1 GiB: a Java direct buffer spans at most 2 GiB - 1.
        check(
                Long.bitCount(arenaBytes) == 1 && arenaBytes >= (1 << 20) && arenaBytes <= (1 << 30),
                StatorOptions.ARENA_SIZE.key(),
                arenaBytes);
        check(Integer.bitCount(inFlight) == 1 && inFlight <= queueEntries, StatorOptions.IN_FLIGHT.key(), inFlight);
        check(
                Integer.bitCount(asyncInFlight) == 1 && asyncInFlight >= 64 && asyncInFlight <= (1 << 17),
                StatorOptions.ASYNC_IN_FLIGHT.key(),
                asyncInFlight);
        check(writeBatch >= 1, StatorOptions.WRITE_BATCH.key(), writeBatch);
    }

    private static void check(boolean ok, String key, long value) {
        if (!ok) {
            throw new IllegalArgumentException(
                    "invalid " + key + ": " + value + " (see io.stator.flink.StatorOptions for what it takes)");
        }
    }

    @Override
    public StatorStateBackend configure(ReadableConfig config, ClassLoader classLoader) {
        return new StatorStateBackend(this, config);
    }

    /** statord's control socket. */
    public StatorStateBackend setSocket(String socket) {
        this.socket = socket;
        return this;
    }

    public String getSocket() {
        return socket;
    }

    /** The name state is kept under in statord (empty: the Flink job id). */
    public StatorStateBackend setJob(String job) {
        this.job = job;
        return this;
    }

    /** Requests one task with asynchronous state may have in statord at once. */
    public StatorStateBackend setAsyncInFlight(int asyncInFlight) {
        this.asyncInFlight = asyncInFlight;
        validate();
        return this;
    }

    public StatorStateBackend setArenaBytes(long arenaBytes) {
        this.arenaBytes = arenaBytes;
        validate();
        return this;
    }

    @Override
    public String getName() {
        return "StatorStateBackend";
    }

    @Override
    public boolean supportsNoClaimRestoreMode() {
        // statord reference-counts segments: a new job's checkpoints never depend on the files
        // of the checkpoint it started from being kept.
        return true;
    }

    @Override
    public boolean supportsSavepointFormat(SavepointFormatType formatType) {
        // Both: a native-format savepoint is written in the canonical format (see
        // StatorKeyedStateBackend#snapshot). Refusing it made Flink fail the job over.
        return true;
    }

    @Override
    public <K> AbstractKeyedStateBackend<K> createKeyedStateBackend(KeyedStateBackendParameters<K> parameters)
            throws IOException {
        return build(parameters, queueEntries, inFlight);
    }

    @Override
    public boolean supportsAsyncKeyedStateBackend() {
        return true;
    }

    /**
     * The asynchronous backend (State V2): the same session, state and checkpoints as {@link
     * #createKeyedStateBackend}, with queues for {@code state.backend.stator.async.in-flight}
     * requests in flight.
     */
    @Override
    public <K> AsyncKeyedStateBackend<K> createAsyncKeyedStateBackend(KeyedStateBackendParameters<K> parameters)
            throws IOException {
        StatorKeyedStateBackend<K> backend =
                build(parameters, Math.max(queueEntries, asyncInFlight), asyncInFlight);
        return new StatorAsyncKeyedStateBackend<>(backend, parameters.getTtlTimeProvider(), parameters.getMetricGroup());
    }

    private <K> StatorKeyedStateBackend<K> build(
            KeyedStateBackendParameters<K> parameters, int queueEntries, int inFlight) throws IOException {
        return new StatorKeyedStateBackendBuilder<>(
                        parameters,
                        socket,
                        job,
                        queueEntries,
                        arenaBytes,
                        inFlight,
                        writeBatch,
                        spinNanos,
                        latencyTrackingConfigBuilder.setMetricGroup(parameters.getMetricGroup()).build(),
                        sizeTrackingConfigBuilder.setMetricGroup(parameters.getMetricGroup()).build())
                .build();
    }

    @Override
    public OperatorStateBackend createOperatorStateBackend(OperatorStateBackendParameters parameters)
            throws BackendBuildingException {
        return new DefaultOperatorStateBackendBuilder(
                        parameters.getEnv().getUserCodeClassLoader().asClassLoader(),
                        parameters.getEnv().getExecutionConfig(),
                        true,
                        parameters.getStateHandles(),
                        parameters.getCancelStreamRegistry())
                .build();
    }
}
