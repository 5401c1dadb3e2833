#!/usr/bin/env python3
"""Summarises flink/bench.sh's JMH results: per operation, every backend's ops/ms, sampled
p50/p99/p99.9 latency and bytes allocated per operation, and Stator's ratio to EmbeddedRocksDB
(the issue's floors: writes >= 3x, reads >= 1x)."""
import json
import sys

WRITES = {"valueUpdate", "valueAdd", "listAdd", "listAddAll", "listUpdate", "mapPut", "mapRemove"}
rows = {}
for r in json.load(open(sys.argv[1])):
    op = r["benchmark"].rsplit(".", 1)[1]
    backend = r["params"]["backend"]
    cell = rows.setdefault(op, {}).setdefault(backend, {})
    m = r["primaryMetric"]
    if r["mode"] == "thrpt":
        cell["ops_ms"] = m["score"]
        alloc = r.get("secondaryMetrics", {}).get("gc.alloc.rate.norm")
        cell["bytes_op"] = alloc["score"] if alloc else float("nan")
    elif r["mode"] == "sample":
        p = m["scorePercentiles"]
        # sample mode's unit is ms/op here: report ns
        cell["p50"] = p["50.0"] * 1e6
        cell["p99"] = p["99.0"] * 1e6
        cell["p999"] = p["99.9"] * 1e6

backends = ["hashmap", "rocksdb", "stator"]
print("%-12s %-5s " % ("operation", "kind") + " ".join("%-34s" % b for b in backends) + " stator/rocksdb")
print("%-12s %-5s " % ("", "") + " ".join("%-34s" % "ops/ms  p50/p99/p99.9 ns  B/op" for _ in backends))
for op in sorted(rows, key=lambda o: (o[:3], o)):
    cells = rows[op]
    line = "%-12s %-5s " % (op, "write" if op in WRITES else "read")
    for b in backends:
        c = cells.get(b, {})
        line += "%-34s " % ("%7.0f %6.0f/%6.0f/%7.0f %5.0f" % (
            c.get("ops_ms", float("nan")), c.get("p50", float("nan")), c.get("p99", float("nan")),
            c.get("p999", float("nan")), c.get("bytes_op", float("nan"))))
    s = cells.get("stator", {}).get("ops_ms")
    r = cells.get("rocksdb", {}).get("ops_ms")
    line += "%6.2fx" % (s / r) if s and r else "   n/a"
    print(line)
