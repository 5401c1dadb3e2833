#!/usr/bin/env python3
"""Plots `stator-bench load --json` runs over time: ops/s and p99 per window
(also `stator-bench serve --window-ms N --json` runs of one depth: their
`t=` cases are windows the same way).

Usage: benches/plot-load.py OUT.svg LABEL=RUN.json [LABEL=RUN.json ...]
Writes a self-contained SVG (no plotting library needed): one panel of
throughput per window, one of p99 latency (log scale), a line per run.
"""
import json
import math
import sys

W, H, PAD = 900, 260, 60
COLORS = ["#c0392b", "#2471a3", "#229954", "#7d3c98"]


def windows(path):
    rows = [json.loads(l) for l in open(path) if l.startswith("{")]
    out = []
    for r in rows:
        c = r.get("case", "")
        if c.startswith("t=") and c.endswith("s"):
            out.append((float(c[2:-1]), r["ops_per_sec"], r["p99_ns"] / 1e6))
    return out


def panel(y0, title, series, value, log):
    vals = [value(p) for _, pts in series for p in pts]
    tmax = max(p[0] for _, pts in series for p in pts)
    lo, hi = (min(vals), max(vals))
    if log:
        lo, hi = math.log10(max(lo, 1e-3)), math.log10(hi)
    hi = hi if hi > lo else lo + 1
    f = (lambda v: math.log10(max(v, 1e-3))) if log else (lambda v: v)
    x = lambda t: PAD + (W - 2 * PAD) * t / tmax
    y = lambda v: y0 + H - 30 - (H - 60) * (f(v) - lo) / (hi - lo)
    s = [f'<text x="{PAD}" y="{y0 + 18}" font-size="14">{title}</text>']
    s.append(f'<line x1="{PAD}" y1="{y0 + H - 30}" x2="{W - PAD}" y2="{y0 + H - 30}" stroke="#888"/>')
    for frac in (0, 0.5, 1):
        v = lo + (hi - lo) * frac
        label = 10 ** v if log else v
        yy = y0 + H - 30 - (H - 60) * frac
        text = f"{label:,.0f}" if label >= 100 else f"{label:.3g}"
        s.append(f'<text x="4" y="{yy + 4}" font-size="11">{text}</text>')
    s.append(f'<text x="{W - PAD}" y="{y0 + H - 12}" font-size="11" text-anchor="end">t = {tmax:.0f} s</text>')
    for i, (name, pts) in enumerate(series):
        path = " ".join(f"{x(p[0]):.1f},{y(value(p)):.1f}" for p in pts)
        c = COLORS[i % len(COLORS)]
        s.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{path}"/>')
        s.append(f'<text x="{W - PAD - 200}" y="{y0 + 18 + 14 * i}" font-size="12" fill="{c}">{name}</text>')
    return s


def main():
    out, runs = sys.argv[1], sys.argv[2:]
    series = [(r.split("=", 1)[0], windows(r.split("=", 1)[1])) for r in runs]
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{2 * H}" font-family="sans-serif">']
    svg += panel(0, "ops/s per window", series, lambda p: p[1], False)
    svg += panel(H, "p99 latency per window, ms (log scale)", series, lambda p: p[2], True)
    svg.append("</svg>")
    open(out, "w").write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
