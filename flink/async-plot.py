#!/usr/bin/env python3
"""Plots flink/bench.sh's asynchronous-job results (target/bench/async.json, one JSON object per
case and backend): records/s per case, one bar per backend, the slowest one-second window as a
tick on each bar, and each backend's ratio to ForSt above it. Plain SVG, no plotting library.

Usage: flink/async-plot.py ASYNC_JSON OUT_SVG"""
import json
import sys

COLOURS = {"forst": "#8c8c8c", "rocksdb": "#d08c3a", "stator": "#2f6db3"}
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
cases, backends, cell = [], [], {}
for r in rows:
    case, backend, _ = r["case"].split("/")
    if case not in cases:
        cases.append(case)
    if backend not in backends:
        backends.append(backend)
    cell[(case, backend)] = r

top = max(r["ops_per_sec"] for r in rows) * 1.15
w, h, left, bottom, plot_h = 140 + 190 * len(cases), 360, 70, 60, 260
bar = 150 / max(len(backends), 1)
svg = [
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
    f'<text x="{left}" y="16" font-size="13">Asynchronous-state job: records/s (p50 bar, slowest window tick)</text>',
]
for i in range(6):
    v = top * i / 5
    y = h - bottom - plot_h * i / 5
    svg.append(f'<line x1="{left}" x2="{w - 20}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
    svg.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v / 1000:.0f} K</text>')
for ci, case in enumerate(cases):
    x0 = left + 20 + ci * 190
    svg.append(f'<text x="{x0 + 75}" y="{h - bottom + 30}" text-anchor="middle" font-size="12">{case}</text>')
    forst = cell.get((case, "forst"))
    for bi, backend in enumerate(backends):
        r = cell.get((case, backend))
        if r is None:
            continue
        x = x0 + bi * bar
        bh = plot_h * r["ops_per_sec"] / top
        y = h - bottom - bh
        svg.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar - 6:.1f}" height="{bh:.1f}" fill="{COLOURS.get(backend, "#555")}"/>'
        )
        ym = h - bottom - plot_h * r["min_window_ops_per_sec"] / top
        svg.append(f'<line x1="{x:.1f}" x2="{x + bar - 6:.1f}" y1="{ym:.1f}" y2="{ym:.1f}" stroke="#000"/>')
        label = f'{r["ops_per_sec"] / 1000:.0f} K'
        if forst and backend != "forst":
            label += f' {r["ops_per_sec"] / forst["ops_per_sec"]:.2f}x'
        svg.append(f'<text x="{x + (bar - 6) / 2:.1f}" y="{y - 4:.1f}" text-anchor="middle" font-size="9">{label}</text>')
        svg.append(
            f'<text x="{x + (bar - 6) / 2:.1f}" y="{h - bottom + 14}" text-anchor="middle" font-size="9">{backend}</text>'
        )
svg.append("</svg>")
open(sys.argv[2], "w").write("\n".join(svg) + "\n")
