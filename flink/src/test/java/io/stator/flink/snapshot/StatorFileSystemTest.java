package io.stator.flink.snapshot;

import org.apache.flink.core.fs.FSDataInputStream;
import org.apache.flink.core.fs.FileSystem;
import org.apache.flink.core.fs.Path;

import org.junit.jupiter.api.Test;

import java.io.FileNotFoundException;
import java.util.Random;

import static org.assertj.core.api.Assertions.assertThat;
import static org.assertj.core.api.Assertions.assertThatThrownBy;

/** The {@code stator:} path codec and its read-only file system (no statord needed). */
class StatorFileSystemTest {

    @Test
    void aPathCarriesItsSocketAndStreamThroughFlinksPathAndFileSystem() throws Exception {
        byte[] stream = new byte[3000];
        new Random(7).nextBytes(stream);
        String socket = "/run/stätor/stator.sock";
        Path p = StatorFileSystem.path(socket, stream);
        // As Flink's metadata keeps it: a string, parsed again.
        Path again = new Path(p.toString());
        assertThat(StatorFileSystem.socketOf(again)).isEqualTo(socket);
        assertThat(StatorFileSystem.bytesOf(again)).isEqualTo(stream);
        FileSystem fs = again.getFileSystem();
        assertThat(fs).isInstanceOf(StatorFileSystem.class);
        assertThat(fs.getFileStatus(again).getLen()).isEqualTo(stream.length);
        try (FSDataInputStream in = fs.open(again)) {
            in.seek(1000);
            byte[] rest = in.readAllBytes();
            assertThat(rest).hasSize(2000);
            assertThat(rest[0]).isEqualTo(stream[1000]);
            assertThat(in.read()).isEqualTo(-1);
        }
    }

    @Test
    void aStreamTooLongForFlinksMetadataGetsNoPath() {
        assertThat(StatorFileSystem.path("/s", new byte[StatorFileSystem.MAX_PATH])).isNull();
    }

    @Test
    void otherPathsAreNotFoundAndNothingIsWritten() {
        StatorFileSystem fs = new StatorFileSystem();
        for (String p : new String[] {"stator:/", "stator:/abc", "stator:/a/b/c", "stator:/a/!!", "file:/tmp/x"}) {
            assertThatThrownBy(() -> fs.getFileStatus(new Path(p))).as(p).isInstanceOf(FileNotFoundException.class);
        }
        Path p = StatorFileSystem.path("/s", new byte[] {1});
        assertThatThrownBy(() -> fs.create(p, FileSystem.WriteMode.OVERWRITE)).hasMessageContaining("read-only");
        assertThatThrownBy(() -> fs.delete(p, false)).hasMessageContaining("not a Stator checkpoint stream");
    }
}
