package io.stator.flink.snapshot;

import org.apache.flink.core.fs.FileSystem;
import org.apache.flink.core.fs.FileSystemFactory;

import java.net.URI;

/** Gives Flink the {@code stator:} file system ({@link StatorFileSystem}); a service of the jar. */
public final class StatorFileSystemFactory implements FileSystemFactory {

    private static final StatorFileSystem FS = new StatorFileSystem();

    @Override
    public String getScheme() {
        return StatorFileSystem.SCHEME;
    }

    @Override
    public FileSystem create(URI fsUri) {
        return FS;
    }
}
