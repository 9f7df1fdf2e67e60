"""State at scale (issue 16): what a prioritized buffer's commits, reopen and trees cost, from 1M to
64M rows and beyond.

Per capacity (``--sizes``, default 1M,16M,64M), one PER buffer (``Prioritized(alpha=0.6)``) and one
Uniform buffer of the same rows, filled to capacity, raw (``compression=None``, memory-mapped
reads) with the default ``chunk_rows``. The rows are small (``obs`` float32 and ``done``, 5 bytes):
these figures are about the state, which does not depend on the row size. Episodes are 32 steps
long, so the episode index holds capacity/32 ends (2M at 64M rows).
Then ``--rounds`` rounds of: add 256 rows, four times sample(256) + update_priorities(256) (1,024
updates; Uniform: four sample(256)), and a timed ``flush()`` (durable, the default). Measured:

1. bytes a flush writes (``wchar`` of /proc/self/io: bytes handed to write()), PER and Uniform:
   median and max over the rounds, and the mean (it includes a new base when one falls due);
2. flush time, PER over Uniform (medians, rounds interleaved);
3. reopen time of each buffer read-only (``ReplayBuffer.open(path, "r")``: the trees rebuilt from
   the priorities' journal, the episode index from its own), median of 3; also with the priorities'
   journal at its longest (just under capacity/8 records past its base);
4. a fresh reader process (``cache_bytes`` 256 MiB) after 2,000 sample+update pairs: private
   memory (RssAnon) and file-backed pages (RssFile) from /proc/self/status;
5. sample(256)+update_priorities(256) per pair on that reader, median of repeats; the ratio to
   the smallest size.

Usage: python tools/bench_state.py [--sizes 1M,16M,64M] [--rounds 50] [--dir /tmp/diskreplay-state]
       [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

import benchlib as bl
import numpy as np

import diskreplay as dr

FIELDS = {"obs": dr.Field((), "float32"), "done": dr.Field((), "bool")}
BATCH = 256
CACHE_BYTES = 256 << 20
PACKAGES = ("diskreplay", "numpy", "zarr")


def rows(first: int, n: int) -> dict[str, np.ndarray]:
    t = np.arange(first, first + n)
    return {"obs": t.astype(np.float32), "done": t % 32 == 31}


def written_bytes() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("wchar"))


def build(path: str, size: int, sampler: dr.Sampler) -> dr.ReplayBuffer:
    buf = dr.ReplayBuffer.create(path, FIELDS, capacity=size, compression=None, sampler=sampler, seed=0,
                                 overwrite=True)
    for first in range(0, size, 1 << 22):
        buf.extend(rows(first, min(1 << 22, size - first)))
    buf.flush()
    return buf


def round_trip(buf: dr.ReplayBuffer, per: bool, rng: np.random.Generator, added: int) -> tuple[float, int]:
    """One round; returns the flush's seconds and bytes written."""
    buf.extend(rows(added, BATCH))
    for _ in range(4):
        batch = buf.sample(BATCH)
        if per:
            buf.update_priorities(batch["index"], rng.exponential(1.0, BATCH))
    before = written_bytes()
    start = time.perf_counter()
    buf.flush()
    return time.perf_counter() - start, written_bytes() - before


def rebase_and_longest_journal(buf: dr.ReplayBuffer, path: str, rng: np.random.Generator) -> dict[str, float]:
    """The flush that writes a new base (updates past an eighth of the leaves), then the reopen
    of a journal at its longest (just under that many records on top of the base)."""
    eighth = max(buf.capacity // 8, 1 << 16)
    ids = buf.row_ids()
    buf.update_priorities(ids[rng.integers(0, len(ids), eighth + 1)], rng.exponential(1.0, eighth + 1))
    before, start = written_bytes(), time.perf_counter()
    buf.flush()
    out = {"flush_s": time.perf_counter() - start, "bytes": written_bytes() - before}
    buf.update_priorities(ids[rng.permutation(len(ids))[:eighth - 1]], rng.exponential(1.0, eighth - 1))
    buf.flush()
    out["reopen_longest_s"] = reopen_seconds(path)
    return out


def reopen_seconds(path: str) -> float:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        dr.ReplayBuffer.open(path, "r").close()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(path: str, pairs: int) -> None:
    """Runs in a fresh process: sample+update pairs on a reader; prints JSON."""
    reader = dr.ReplayBuffer.open(path, "r", cache_bytes=CACHE_BYTES)
    rng = np.random.default_rng(0)
    pool = rng.exponential(1.0, (64, BATCH))

    def pair(k: int) -> None:
        batch = reader.sample(BATCH, beta=0.4)
        reader.update_priorities(batch["index"], pool[k % 64])
    for k in range(pairs):
        pair(k)
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for k in range(200):
            pair(k)
        times.append((time.perf_counter() - start) / 200)
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    kb = {k: int(status[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile")}
    print(json.dumps({"pair": statistics.median(times), **kb, "tables": reader.sampler.table.nbytes()}))


def measure(size: int, cfg: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"size": size}
    paths = {name: os.path.join(cfg.dir, f"{name}-{bl.format_count(size)}") for name in ("per", "uniform")}
    bl.log(f"[{bl.format_count(size)}] building PER and Uniform buffers")
    bufs = {"per": build(paths["per"], size, dr.Prioritized(alpha=0.6)),
            "uniform": build(paths["uniform"], size, dr.Uniform())}
    rng = np.random.default_rng(0)
    flushes: dict[str, list[tuple[float, int]]] = {"per": [], "uniform": []}
    for k in range(cfg.rounds):
        for name, buf in bufs.items():
            flushes[name].append(round_trip(buf, name == "per", rng, size + k * BATCH))
    out["rebase"] = rebase_and_longest_journal(bufs["per"], paths["per"], rng)
    for name, buf in bufs.items():
        buf.close()
        seconds, written = zip(*flushes[name])
        out[name] = {"flush_s": statistics.median(seconds), "bytes_median": statistics.median(written),
                     "bytes_max": max(written), "bytes_mean": statistics.mean(written),
                     "reopen_s": reopen_seconds(paths[name]), "files": bl.allocated_bytes(paths[name])}
    got = subprocess.run([sys.executable, __file__, "--child", paths["per"], str(cfg.pairs)], check=True,
                         capture_output=True, text=True).stdout
    out["reader"] = json.loads(got.strip().splitlines()[-1])
    bl.log(f"  {json.dumps(out)}")
    if not cfg.keep:
        for path in paths.values():
            shutil.rmtree(path, ignore_errors=True)
    return out


def report(results: list[dict[str, Any]]) -> str:
    small = results[0]["reader"]["pair"]
    lines = ["| capacity | flush bytes PER (Uniform): median / max | new base: bytes, time; amortized | "
             "flush PER / Uniform | reopen PER: now / longest journal (Uniform) | reader private / file-backed "
             "(priority tables) | sample+update | vs smallest |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        per, uni, rd, base = r["per"], r["uniform"], r["reader"], r["rebase"]
        amortized = per["bytes_median"] + base["bytes"] * 1024 / max(r["size"] // 8, 1 << 16)
        lines.append(
            f"| {bl.format_count(r['size'])} | {bl.format_bytes(per['bytes_median'])} / "
            f"{bl.format_bytes(per['bytes_max'])} ({bl.format_bytes(uni['bytes_median'])}) | "
            f"{bl.format_bytes(base['bytes'])}, {bl.format_seconds(base['flush_s'])}; "
            f"{bl.format_bytes(amortized)} per flush | {per['flush_s'] / uni['flush_s']:.2f}× "
            f"({bl.format_seconds(per['flush_s'])} / {bl.format_seconds(uni['flush_s'])}) | "
            f"{per['reopen_s']:.2f} s / {base['reopen_longest_s']:.2f} s ({uni['reopen_s']:.2f} s) | "
            f"{bl.format_bytes(rd['RssAnon'])} / {bl.format_bytes(rd['RssFile'])} ({bl.format_bytes(rd['tables'])}) | "
            f"{bl.format_seconds(rd['pair'], 'us')} | {rd['pair'] / small:.2f}× |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help="capacities (default 1M,16M,64M; quick 1M,4M)")
    p.add_argument("--rounds", type=int, default=None, help="flush rounds per buffer (default 50; quick 10)")
    p.add_argument("--dir", default="/tmp/diskreplay-state")
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.sizes = [bl.parse_count(s) for s in (args.sizes or ("1M,4M" if args.quick else "1M,16M,64M")).split(",")]
    args.rounds = args.rounds or (10 if args.quick else 50)
    args.pairs = 500 if args.quick else 2000
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args.child[0], int(args.child[1]))
    os.makedirs(args.dir, exist_ok=True)
    header = bl.report_header("diskreplay state benchmark", args.quick, PACKAGES, args.dir,
                              [f"capacities {', '.join(map(bl.format_count, args.sizes))}; {args.rounds} flush rounds"])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    results = [measure(size, args) for size in args.sizes]
    bl.publish_report(header, report(results), args.out, started)


if __name__ == "__main__":
    main()
