package io.stator.flink.jni;

import java.io.IOException;
import java.io.InputStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.StandardCopyOption;

/**
 * Loads {@code libstator_jni.so} once per class loader: from {@code stator.jni.library} if set
 * (a path), else from this jar (extracted into a temporary file, as Flink's RocksDB backend
 * does with its own library).
 */
final class NativeLibrary {

    static final String RESOURCE = "/io/stator/flink/jni/linux-x86_64/libstator_jni.so";

    private NativeLibrary() {}

    static synchronized void load() {
        String explicit = System.getProperty("stator.jni.library");
        if (explicit != null && !explicit.isEmpty()) {
            System.load(explicit);
            return;
        }
        String os = System.getProperty("os.name", "");
        String arch = System.getProperty("os.arch", "");
        if (!os.toLowerCase().contains("linux") || !(arch.equals("amd64") || arch.equals("x86_64"))) {
            throw new UnsatisfiedLinkError(
                    "stator-flink carries libstator_jni.so for Linux x86_64 only, not "
                            + os
                            + " "
                            + arch
                            + "; set -Dstator.jni.library=/path/to/libstator_jni.so");
        }
        try (InputStream in = NativeLibrary.class.getResourceAsStream(RESOURCE)) {
            if (in == null) {
                throw new UnsatisfiedLinkError(
                        "libstator_jni.so is missing from the stator-flink jar ("
                                + RESOURCE
                                + "); build it with `cargo build --release -p stator-jni` before packaging");
            }
            Path tmp = Files.createTempFile("libstator_jni-", ".so");
            try {
                Files.copy(in, tmp, StandardCopyOption.REPLACE_EXISTING);
                System.load(tmp.toAbsolutePath().toString());
            } finally {
                // Linux keeps the mapping; the file is not needed once loaded.
                Files.deleteIfExists(tmp);
            }
        } catch (IOException e) {
            throw new UnsatisfiedLinkError("could not extract libstator_jni.so: " + e);
        }
    }
}
