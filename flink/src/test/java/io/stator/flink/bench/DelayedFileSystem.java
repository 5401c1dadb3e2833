package io.stator.flink.bench;

import org.apache.flink.core.fs.BlockLocation;
import org.apache.flink.core.fs.FSDataInputStream;
import org.apache.flink.core.fs.FSDataOutputStream;
import org.apache.flink.core.fs.FileStatus;
import org.apache.flink.core.fs.FileSystem;
import org.apache.flink.core.fs.FileSystemFactory;
import org.apache.flink.core.fs.Path;
import org.apache.flink.core.fs.local.LocalFileSystem;

import java.io.IOException;
import java.io.InterruptedIOException;
import java.net.URI;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

/**
 * A directory behind object storage's latency, for the asynchronous job benchmark's {@code remote}
 * case: {@code delayed:///some/dir} is the local {@code /some/dir}, but every request an object
 * store would answer with one round trip waits {@code -Dstator.bench.delay-ms} (default 23 ms)
 * first, as statord's remote tier waits for the benchmark's S3 server: a read at a new position
 * (a ranged GET; reads that continue where the last one ended stream on), a file's creation (the
 * PUT, counted at close), a status, listing, delete, rename or mkdirs. It lets ForSt keep its
 * primary storage "remotely" without an S3 file system plugin.
 *
 * <p>Registered through {@code META-INF/services/org.apache.flink.core.fs.FileSystemFactory} of
 * the test classpath.
 */
public final class DelayedFileSystem extends FileSystem {

    public static final String SCHEME = "delayed";

    private static final URI URI_ROOT = URI.create(SCHEME + ":///");

    /** Reads that took a round trip (ranged GETs), over every instance. */
    static final AtomicLong READS = new AtomicLong();

    private final LocalFileSystem local = LocalFileSystem.getSharedInstance();
    private final long delayNanos;

    DelayedFileSystem(long delayNanos) {
        this.delayNanos = delayNanos;
    }

    /** The factory of {@code delayed://}. */
    public static final class Factory implements FileSystemFactory {
        @Override
        public String getScheme() {
            return SCHEME;
        }

        @Override
        public FileSystem create(URI fsUri) {
            return new DelayedFileSystem(TimeUnit.MILLISECONDS.toNanos(Long.getLong("stator.bench.delay-ms", 23)));
        }
    }

    /** One round trip to the object store. */
    void roundTrip() throws IOException {
        try {
            TimeUnit.NANOSECONDS.sleep(delayNanos);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new InterruptedIOException("interrupted while waiting for the delayed file system");
        }
    }

    private static Path toLocal(Path p) {
        return new Path("file", null, p.toUri().getPath());
    }

    private static Path fromLocal(Path p) {
        return new Path(SCHEME, null, p.toUri().getPath());
    }

    @Override
    public Path getWorkingDirectory() {
        return fromLocal(local.getWorkingDirectory());
    }

    @Override
    public Path getHomeDirectory() {
        return fromLocal(local.getHomeDirectory());
    }

    @Override
    public URI getUri() {
        return URI_ROOT;
    }

    @Override
    public FileStatus getFileStatus(Path f) throws IOException {
        roundTrip();
        return new Status(local.getFileStatus(toLocal(f)));
    }

    @Override
    public BlockLocation[] getFileBlockLocations(FileStatus file, long start, long len) throws IOException {
        return local.getFileBlockLocations(local.getFileStatus(toLocal(file.getPath())), start, len);
    }

    @Override
    public FSDataInputStream open(Path f, int bufferSize) throws IOException {
        return open(f);
    }

    @Override
    public FSDataInputStream open(Path f) throws IOException {
        return new In(local.open(toLocal(f)));
    }

    @Override
    public FileStatus[] listStatus(Path f) throws IOException {
        roundTrip();
        FileStatus[] l = local.listStatus(toLocal(f));
        if (l == null) {
            return null;
        }
        FileStatus[] out = new FileStatus[l.length];
        for (int i = 0; i < l.length; i++) {
            out[i] = new Status(l[i]);
        }
        return out;
    }

    @Override
    public boolean delete(Path f, boolean recursive) throws IOException {
        roundTrip();
        return local.delete(toLocal(f), recursive);
    }

    @Override
    public boolean mkdirs(Path f) throws IOException {
        roundTrip();
        return local.mkdirs(toLocal(f));
    }

    @Override
    public FSDataOutputStream create(Path f, WriteMode overwriteMode) throws IOException {
        return new Out(local.create(toLocal(f), overwriteMode));
    }

    @Override
    public boolean rename(Path src, Path dst) throws IOException {
        roundTrip();
        return local.rename(toLocal(src), toLocal(dst));
    }

    @Override
    public boolean isDistributedFS() {
        return true;
    }

    /** A local file's status under the delayed scheme. */
    private static final class Status implements FileStatus {
        private final FileStatus s;

        Status(FileStatus s) {
            this.s = s;
        }

        @Override
        public long getLen() {
            return s.getLen();
        }

        @Override
        public long getBlockSize() {
            return s.getBlockSize();
        }

        @Override
        public short getReplication() {
            return s.getReplication();
        }

        @Override
        public long getModificationTime() {
            return s.getModificationTime();
        }

        @Override
        public long getAccessTime() {
            return s.getAccessTime();
        }

        @Override
        public boolean isDir() {
            return s.isDir();
        }

        @Override
        public Path getPath() {
            return fromLocal(s.getPath());
        }
    }

    /** Reads: a round trip before the first read at a position the last read did not end at. */
    private final class In extends FSDataInputStream {
        private final FSDataInputStream in;
        private boolean streaming;

        In(FSDataInputStream in) {
            this.in = in;
        }

        private void request() throws IOException {
            if (!streaming) {
                READS.incrementAndGet();
                roundTrip();
                streaming = true;
            }
        }

        @Override
        public void seek(long desired) throws IOException {
            if (desired != in.getPos()) {
                streaming = false;
                in.seek(desired);
            }
        }

        @Override
        public long getPos() throws IOException {
            return in.getPos();
        }

        @Override
        public int read() throws IOException {
            request();
            return in.read();
        }

        @Override
        public int read(byte[] b, int off, int len) throws IOException {
            request();
            return in.read(b, off, len);
        }

        @Override
        public long skip(long n) throws IOException {
            streaming = false;
            return in.skip(n);
        }

        @Override
        public int available() throws IOException {
            return in.available();
        }

        @Override
        public void close() throws IOException {
            in.close();
        }
    }

    /** Writes: one round trip when the file is complete (its PUT). */
    private final class Out extends FSDataOutputStream {
        private final FSDataOutputStream out;
        private boolean closed;

        Out(FSDataOutputStream out) {
            this.out = out;
        }

        @Override
        public long getPos() throws IOException {
            return out.getPos();
        }

        @Override
        public void write(int b) throws IOException {
            out.write(b);
        }

        @Override
        public void write(byte[] b, int off, int len) throws IOException {
            out.write(b, off, len);
        }

        @Override
        public void flush() throws IOException {
            out.flush();
        }

        @Override
        public void sync() throws IOException {
            out.sync();
        }

        @Override
        public void close() throws IOException {
            if (!closed) {
                closed = true;
                out.close();
                roundTrip();
            }
        }
    }
}
