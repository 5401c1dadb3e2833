package io.stator.flink.testutils;

import java.io.File;
import java.io.IOException;
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
