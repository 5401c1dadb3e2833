#!/usr/bin/env bash
# Stator's Flink benchmarks, every backend in one run (HashMap, EmbeddedRocksDB, Stator):
#   1. JMH state benchmarks (value, list, map; 500 K setup keys; ops/ms, sampled latency and
#      JMH's gc profiler), after apache/flink-benchmarks;
#   2. the MiniCluster job benchmark (records/s and checkpoint duration at two state sizes);
#   3. the asynchronous-state (State V2) job benchmark: ForSt, EmbeddedRocksDB and Stator's
#      asynchronous backend, state in memory, four times the memory budget on disk, and on
#      object storage 23 ms away (statord's remote tier on `stator-bench s3-server`).
# Usage: flink/bench.sh [--quick] [--state-only | --job-only | --async-only] [--cases=LIST]
#                       [JMH benchmark regex]
#   --cases=LIST: the asynchronous job's cases (default memory,disk,remote; disk-pagecache is the
#                 disk case with RocksDB and ForSt reading through the page cache, not judged).
# Results: flink/target/bench/{state.json,state.txt,job.json,async.json,async.svg} and a summary
# on stdout.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
quick=0 state=1 job=1 async=1 regex="" cases=()
for a in "$@"; do
    case "$a" in
        --quick) quick=1 ;;
        --state-only) job=0 async=0 ;;
        --job-only) state=0 async=0 ;;
        --async-only) state=0 job=0 ;;
        --cases=*) cases=(--cases "${a#--cases=}") ;;
        -*) echo "unknown option $a" >&2; exit 2 ;;
        *) regex="$a" ;;
    esac
done
cd "$root"
cargo build --release -p stator-jni -p statord -p stator-bench
cd flink
mvn -B -q -ntp test-compile -Dstator.cargo.skip=true
mvn -B -q -ntp dependency:build-classpath -Dmdep.includeScope=test -Dmdep.outputFile=target/bench.classpath
out=target/bench
mkdir -p "$out"
cp="target/test-classes:target/classes:$(cat target/bench.classpath)"
opens="--add-opens=java.base/java.util=ALL-UNNAMED --add-opens=java.base/java.lang=ALL-UNNAMED --add-opens=java.base/java.nio=ALL-UNNAMED"
props="-Dstator.statord=$root/target/release/statord -Dlog4j2.level=warn"
if [ "$state" = 1 ]; then
    args=(-prof gc -rf json -rff "$out/state.json" -jvmArgsAppend "$props $opens")
    if [ "$quick" = 1 ]; then
        args+=(-wi 1 -w 500ms -i 2 -r 500ms -p setupKeyCount=50000)
    fi
    java -cp "$cp" org.openjdk.jmh.Main "${args[@]}" ${regex:+"$regex"} | tee "$out/state.txt"
    python3 "$root/flink/bench-summary.py" "$out/state.json"
fi
if [ "$state" = 1 ] && [ "$job" = 1 ]; then echo; fi
if [ "$job" = 1 ]; then
    q=()
    if [ "$quick" = 1 ]; then q=(--quick); fi
    # shellcheck disable=SC2086
    java $opens $props -Xmx4g -cp "$cp" io.stator.flink.bench.JobBenchmark "${q[@]}" --json "$out/job.json"
fi
if [ "$async" = 1 ]; then
    if [ "$state" = 1 ] || [ "$job" = 1 ]; then echo; fi
    q=()
    if [ "$quick" = 1 ]; then q=(--quick); fi
    # shellcheck disable=SC2086
    java $opens $props -Xmx4g -cp "$cp" io.stator.flink.bench.AsyncJobBenchmark "${q[@]}" "${cases[@]}" --json "$out/async.json"
    python3 "$root/flink/async-plot.py" "$out/async.json" "$out/async.svg"
fi
