#!/usr/bin/env python3
"""Slow block-device requests, and what waited behind them, from a trace.

Record the block layer beside a benchmark, then read the trace:

    perf record -a -e block:block_rq_issue -e block:block_rq_complete \
        -o /tmp/blk.data -- target/release/stator-bench serve ...
    perf script -i /tmp/blk.data > /tmp/blk.txt
    benches/block-stalls.py /tmp/blk.txt [--over-ms 40]

For each request slower than `--over-ms` (time from issue to completion),
prints when it was issued (seconds from the trace's start), its type
(perf's rwbs: R read, W write, D discard, F flush, S sync), its size, who
issued it, and how many requests were issued while it ran and completed only
after it: reads stuck behind a slow write at the device show up there.
Requests are matched by device and sector.
"""

import argparse
import re
import sys

LINE = re.compile(r"^\s*(.+?)\s+\d+\s+\[\d+\]\s+([\d.]+):\s+block:block_rq_(issue|complete):\s+(.*)")
# "254,0 WS 1048576 () 95803392 + 2048 ..." on issue; no byte count on completion.
REQ = re.compile(r"(\d+,\d+)\s+(\S+)\s+(?:\d+\s+)?\(.*?\)\s+(\d+)\s+\+\s+(\d+)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="`perf script` output")
    ap.add_argument("--over-ms", type=float, default=40.0)
    a = ap.parse_args()
    t0 = None
    open_reqs = {}  # (dev, sector) -> (issue time, rwbs, sectors, comm, seq)
    done = []  # (issue, latency, rwbs, sectors, comm, seq, completed at)
    seq = 0
    with open(a.trace) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            comm, t, kind, rest = m.group(1), float(m.group(2)), m.group(3), m.group(4)
            r = REQ.match(rest)
            if not r:
                continue
            t0 = t if t0 is None else t0
            key = (r.group(1), r.group(3))
            if kind == "issue":
                open_reqs[key] = (t, r.group(2), int(r.group(4)), comm, seq)
                seq += 1
            elif key in open_reqs:
                ti, rwbs, n, c, s = open_reqs.pop(key)
                done.append((ti, t - ti, rwbs, n, c, s, t))
    if t0 is None:
        sys.exit("no block requests in the trace")
    slow = [d for d in done if d[1] * 1e3 > a.over_ms]
    for ti, lat, rwbs, n, comm, s, tc in sorted(slow):
        behind = sum(1 for d in done if d[5] > s and d[0] < tc <= d[6])
        print(
            f"{ti - t0:9.3f} s  {lat * 1e3:7.1f} ms  {rwbs:4} {n * 512 >> 10:8} KiB  "
            f"{comm:20} {behind} issued while it ran, completed after it"
        )
    print(f"{len(done)} requests, {len(slow)} slower than {a.over_ms} ms", file=sys.stderr)


if __name__ == "__main__":
    main()
