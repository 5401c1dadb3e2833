package io.stator.flink.bench;

import org.apache.flink.state.forst.ForStOptionsFactory;
import org.apache.flink.state.rocksdb.RocksDBOptionsFactory;

import java.util.Collection;

/**
 * Options factories that make EmbeddedRocksDB and ForSt read and write their files with {@code
 * O_DIRECT}, as statord does, so that the benchmark's memory budget bounds all three: without
 * them the peers' block cache holds the budget while the kernel's page cache (most of this 24
 * GiB machine) silently holds the rest of their state. A container's memory limit charges the
 * page cache the same way; this is that limit without a cgroup.
 */
final class DirectReads {

    private DirectReads() {}

    /** EmbeddedRocksDB with direct reads, flushes and compactions. */
    public static final class RocksDB implements RocksDBOptionsFactory {
        private static final long serialVersionUID = 1L;

        @Override
        public org.rocksdb.DBOptions createDBOptions(
                org.rocksdb.DBOptions current, Collection<AutoCloseable> handlesToClose) {
            return current.setUseDirectReads(true).setUseDirectIoForFlushAndCompaction(true);
        }

        @Override
        public org.rocksdb.ColumnFamilyOptions createColumnOptions(
                org.rocksdb.ColumnFamilyOptions current, Collection<AutoCloseable> handlesToClose) {
            return current;
        }
    }

    /** ForSt with direct reads, flushes and compactions. */
    public static final class ForSt implements ForStOptionsFactory {
        private static final long serialVersionUID = 1L;

        @Override
        public org.forstdb.DBOptions createDBOptions(
                org.forstdb.DBOptions current, Collection<AutoCloseable> handlesToClose) {
            return current.setUseDirectReads(true).setUseDirectIoForFlushAndCompaction(true);
        }

        @Override
        public org.forstdb.ColumnFamilyOptions createColumnOptions(
                org.forstdb.ColumnFamilyOptions current, Collection<AutoCloseable> handlesToClose) {
            return current;
        }
    }
}
