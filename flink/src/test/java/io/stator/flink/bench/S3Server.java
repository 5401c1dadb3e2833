package io.stator.flink.bench;

import io.stator.flink.testutils.Statord;

import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.List;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * The S3-compatible server of the remote tier's tests ({@code s3s} over {@code s3s-fs}) as a
 * process, {@code stator-bench s3-server}, holding every request {@code delayMs} before serving
 * it: object storage's latency for statord's remote tier. The binary sits beside statord's
 * ({@code -Dstator.bench} overrides it); the server exits when this object closes its standard
 * input or is closed.
 */
final class S3Server implements AutoCloseable {

    static final String BUCKET = "stator";
    static final String KEY = "stator-test-key";
    static final String SECRET = "stator-test-secret";

    private static final Pattern LISTENING = Pattern.compile("listening on 127\\.0\\.0\\.1:(\\d+)");

    private final Process process;
    final int port;

    S3Server(Path dir, long delayMs) throws IOException {
        Files.createDirectories(dir);
        String bench = System.getProperty(
                "stator.bench", Path.of(Statord.binary()).resolveSibling("stator-bench").toString());
        process = new ProcessBuilder(List.of(
                        bench, "s3-server", "--dir", dir.toString(), "--delay-ms", Long.toString(delayMs)))
                .redirectError(ProcessBuilder.Redirect.INHERIT)
                .start();
        BufferedReader out =
                new BufferedReader(new InputStreamReader(process.getInputStream(), StandardCharsets.UTF_8));
        String line = out.readLine();
        Matcher m = line == null ? null : LISTENING.matcher(line);
        if (m == null || !m.find()) {
            process.destroyForcibly();
            throw new IOException("stator-bench s3-server (" + bench + ") did not start: " + line);
        }
        port = Integer.parseInt(m.group(1));
    }

    /** statord's {@code [remote]} section for this server. */
    String statordConfig(long localCacheMib, int maxInFlight) {
        return String.join(
                "\n",
                "[remote]",
                "enabled = true",
                "bucket = \"" + BUCKET + "\"",
                "endpoint = \"http://127.0.0.1:" + port + "\"",
                "region = \"us-east-1\"",
                "access_key_id = \"" + KEY + "\"",
                "secret_access_key = \"" + SECRET + "\"",
                "allow_http = true",
                "local_cache_mib = " + localCacheMib,
                "max_in_flight = " + maxInFlight,
                "");
    }

    @Override
    public void close() throws InterruptedException {
        process.destroy();
        process.waitFor();
    }
}
