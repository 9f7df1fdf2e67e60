"""Compressed frames past the cache, by decode threads (issue #13): sample(256) of LZ4, LZ4-HC
and zstd rings against a raw one, with ``io_threads`` = 1, 2, 4, ... decode threads.

The frames are `bench_pixels`' ("noise plus structure", or MsPacman's with ``--frames atari``;
84x84 uint8), in four rings of ``--rows`` transitions (``derive_next=("obs",)``, automatic chunk
rows): raw, ``"lz4"``, ``"lz4hc"`` (level 6) and ``"zstd"``. Each is reopened for writing (as
`bench_pixels` samples its writers) per thread count, with a cache smaller than its files
(``--cache-bytes``): the raw one copies frames out of its memory maps, the compressed ones decode
each frame from the shard maps, so every batch decodes 512 frames (obs and the following obs).
Repeats are interleaved, and each row of the table is one thread count: how the codec's floor
(about 5 us per LZ4 frame and 11 us per zstd frame on the 2-core machine here) divides with cores.

Usage: python tools/bench_frame_codecs.py [--rows 100000] [--frames noise|atari] [--threads 1,2,4] [--out report.md]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl
from bench_pixels import PIECE, Frames, dr_create

import diskreplay as dr

CODECS = {"raw": None, "lz4": "lz4", "lz4hc": "lz4hc", "zstd": "zstd"}
PACKED = tuple(CODECS)[1:]
log = bl.log


def build(work: str, rows: int, source: str) -> dict[str, str]:
    """The three rings, filled from one stream of ``source`` frames; their paths."""
    frames, paths = Frames(rows, source=source), {}
    for name, codec in CODECS.items():
        paths[name] = os.path.join(work, name)
        start = time.perf_counter()
        buf = dr_create(paths[name], codec, rows)
        for t0 in range(0, rows, PIECE):
            buf.extend(frames.rows(t0, PIECE))
        buf.close()
        log(f"built {name}: {rows:,} rows in {time.perf_counter() - start:.1f} s")
    return paths


def measure(paths: dict[str, str], threads: int, cache_bytes: int, repeats: int, batches: int,
            warm: int) -> dict[str, float]:
    """Median seconds per sample(256) of each ring, read with ``threads`` io threads."""
    buffers = {name: dr.ReplayBuffer.open(path, "r+", io_threads=threads, cache_bytes=cache_bytes)
               for name, path in paths.items()}
    try:
        def run(buf: dr.ReplayBuffer) -> None:
            for _ in range(batches):
                buf.sample(256)
        stats = bl.interleaved({name: (lambda b=b: run(b)) for name, b in buffers.items()}, repeats,
                               number=batches, warmup=max(1, warm // batches))
        return {name: s.median for name, s in stats.items()}
    finally:
        for buf in buffers.values():
            buf.close()


def report(rows: int, source: str, results: dict[int, dict[str, float]]) -> str:
    lines = [f"sample(256) of {rows:,}-row rings of {source} frames, not in the cache "
             "(medians of interleaved repeats):", "",
             "| io_threads | " + " | ".join(CODECS) + " | " + " | ".join(f"{c} / raw" for c in PACKED) + " |",
             "|---:" * (1 + len(CODECS) + len(PACKED)) + "|"]
    for threads, t in results.items():
        lines.append(f"| {threads} | " + " | ".join(bl.format_seconds(t[c]) for c in CODECS) + " | "
                     + " | ".join(f"{t[c] / t['raw']:.2f}x" for c in PACKED) + " |")
    return "\n".join(lines)


def main() -> None:
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/diskreplay-frame-codecs", help="work directory on the local disk")
    p.add_argument("--rows", type=int, default=100_000, help="transitions per ring (a multiple of 1,000)")
    p.add_argument("--frames", choices=("noise", "atari"), default="noise",
                   help="bench_pixels' noise plus structure (default), or MsPacman frames recorded with ale-py")
    p.add_argument("--threads", default="1,2,4", help="io_threads counts, comma-separated")
    p.add_argument("--cache-bytes", type=int, default=32 * bl.MiB, help="each buffer's cache (default 32 MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batches", type=int, default=50, help="batches per repeat")
    p.add_argument("--warm", type=int, default=200, help="untimed batches per buffer first")
    p.add_argument("--out", help="also write the markdown report to this file")
    args = p.parse_args()
    if args.rows % PIECE:
        raise SystemExit(f"--rows must be a multiple of {PIECE}")
    counts = [int(c) for c in args.threads.split(",")]
    work = os.path.join(args.dir, "rings")
    os.makedirs(work, exist_ok=True)
    try:
        paths = build(work, args.rows, args.frames)
        for name, path in paths.items():
            if bl.stored_bytes(path) <= args.cache_bytes:
                raise SystemExit(f"the {name} ring's files fit --cache-bytes: give more --rows or a smaller cache")
        results = {}
        for threads in counts:
            results[threads] = measure(paths, threads, args.cache_bytes, args.repeats, args.batches, args.warm)
            times = ", ".join(f"{name} {bl.format_seconds(t)}" for name, t in results[threads].items())
            log(f"io_threads={threads}: {times}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = bl.report_header("Compressed frames past the cache, by decode threads", False, ["diskreplay", "numpy"],
                              data_dir=args.dir)
    bl.publish_report(header, report(args.rows, args.frames, results), args.out, started)


if __name__ == "__main__":
    main()
