package io.stator.flink.testutils;

import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.JsonNode;
import org.apache.flink.shaded.jackson2.com.fasterxml.jackson.databind.ObjectMapper;

import java.io.File;
import java.io.IOException;
import java.net.UnixDomainSocketAddress;
import java.nio.ByteBuffer;
import java.nio.channels.Channels;
import java.nio.channels.SocketChannel;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * A real statord process for a test: its own data and run directories, started from the Cargo
 * workspace's release build ({@code -Dstator.statord}, set by the Maven build), stopped with
 * SIGTERM (or killed, for crash tests).
 */
public final class Statord implements AutoCloseable {

    private final Path dir;
    private final List<String> extraArgs;
    private int memoryBudgetMib = 512;
    private String config;
    private Process process;

    public Statord(Path dir, String... extraArgs) {
        this.dir = dir;
        this.extraArgs = List.of(extraArgs);
    }

    public static String binary() {
        String b = System.getProperty("stator.statord");
        if (b == null || !new File(b).canExecute()) {
            throw new IllegalStateException(
                    "no statord binary at -Dstator.statord=" + b + " (build it: cargo build --release -p statord)");
        }
        return b;
    }

    /** The daemon's memory budget (default 512 MiB); before {@link #start()}. */
    public Statord memoryBudgetMib(int mib) {
        this.memoryBudgetMib = mib;
        return this;
    }

    /**
     * A configuration file's text (TOML, daemon/README.md) that statord reads with {@code
     * --config}; the flags this class passes override it. Before {@link #start()}.
     */
    public Statord config(String toml) {
        this.config = toml;
        return this;
    }

    public Path dataDir() {
        return dir.resolve("data");
    }

    public Path runDir() {
        return dir.resolve("run");
    }

    public String socket() {
        return runDir().resolve("stator.sock").toString();
    }

    /** Starts statord and waits until its control socket listens. */
    public Statord start() throws IOException, InterruptedException {
        Files.createDirectories(dataDir());
        Files.createDirectories(runDir());
        Files.deleteIfExists(runDir().resolve("stator.sock"));
        List<String> cmd = new ArrayList<>();
        cmd.add(binary());
        cmd.add("--data-dir");
        cmd.add(dataDir().toString());
        cmd.add("--run-dir");
        cmd.add(runDir().toString());
        cmd.add("--shards");
        cmd.add("1");
        cmd.add("--memory-budget-mib");
        cmd.add(Integer.toString(memoryBudgetMib));
        if (config != null) {
            Path file = dir.resolve("statord.toml");
            Files.writeString(file, config);
            cmd.add("--config");
            cmd.add(file.toString());
        }
        cmd.addAll(extraArgs);
        ProcessBuilder pb = new ProcessBuilder(cmd);
        pb.redirectErrorStream(true);
        pb.redirectOutput(dir.resolve("statord.log").toFile());
        pb.environment().put("STATOR_LOG", "warn");
        process = pb.start();
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(60);
        while (!Files.exists(runDir().resolve("stator.sock"))) {
            if (!process.isAlive()) {
                throw new IOException("statord exited at start: " + Files.readString(dir.resolve("statord.log")));
            }
            if (System.nanoTime() > deadline) {
                throw new IOException("statord did not listen within 60 s");
            }
            Thread.sleep(10);
        }
        return this;
    }

    /** statord's {@code /status} document (daemon/STATUS.md), from its status socket. */
    public JsonNode status() throws IOException {
        try (SocketChannel ch = SocketChannel.open(UnixDomainSocketAddress.of(runDir().resolve("status.sock")))) {
            ch.write(ByteBuffer.wrap("GET /status HTTP/1.0\r\n\r\n".getBytes(StandardCharsets.US_ASCII)));
            String reply = new String(Channels.newInputStream(ch).readAllBytes(), StandardCharsets.UTF_8);
            int body = reply.indexOf("\r\n\r\n");
            if (!reply.startsWith("HTTP/1.") || !reply.contains(" 200 ") || body < 0) {
                throw new IOException("statord's /status answered: " + reply);
            }
            return new ObjectMapper().readTree(reply.substring(body + 4));
        }
    }

    /** The checkpoints statord retains of a job (completed or not), from {@link #status()}. */
    public long checkpointsOf(String job) throws IOException {
        long n = 0;
        for (JsonNode c : status().path("checkpoints")) {
            if (job.equals(c.path("job").asText())) {
                n++;
            }
        }
        return n;
    }

    /**
     * Waits until statord's status shows {@code n} checkpoints of a job (the status is published
     * a few times a second); fails after 30 s, naming the last count.
     */
    public void awaitCheckpointsOf(String job, long n) throws IOException, InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(30);
        long seen;
        while ((seen = checkpointsOf(job)) != n) {
            if (System.nanoTime() > deadline) {
                throw new AssertionError("statord shows " + seen + " checkpoints of " + job + ", not " + n);
            }
            Thread.sleep(20);
        }
    }

    /** SIGKILL: the daemon dies with whatever it had in flight. */
    public void kill() throws InterruptedException {
        if (process != null) {
            process.destroyForcibly();
            process.waitFor();
            process = null;
        }
    }

    /** SIGTERM, and waits for statord to drain and exit. */
    @Override
    public void close() throws InterruptedException {
        if (process != null) {
            process.destroy();
            if (!process.waitFor(60, TimeUnit.SECONDS)) {
                process.destroyForcibly();
                process.waitFor();
            }
            process = null;
        }
    }
}
