"""DataLoader benchmark (issues #5, #13): diskreplay datasets vs TorchRL memmap vs an in-RAM TensorDataset.

Workload (as tools/bench_core.py): obs (17,) f32, action (6,) f32, reward () f32, next_obs (17,)
f32, done () bool; 1,000,000 rows (``--quick``: 100,000), 4096-row chunks, local disk, batch 256.
Each measurement takes a first batch, then 256 untimed batches (``--quick``: 32; every worker is
running by then), then times up to 3,000 batches (``--quick``: 300; all within one epoch) or 1 s,
whichever comes first: throughput in the steady state, not the workers' start.

For num_workers 0, 1 and 2, each contestant is iterated through ``torch.utils.data.DataLoader``
(fork workers, not persistent):
- diskreplay sample / epoch mode, zstd and uncompressed: ``make_dataset`` + ``batch_size=None``;
- the same datasets through ``diskreplay.torch.Loader`` (its workers hand over blocks of up to 8
  batches in one DataLoader item; num_workers=0: the dataset iterated in this process);
- TorchRL ``ReplayBuffer(LazyMemmapStorage)``: an IterableDataset yielding ``rb.sample()``,
  ``batch_size=None`` (the same way);
- ``TensorDataset`` over in-RAM tensors: ``DataLoader(batch_size=256, shuffle=True)`` (per-row
  indexing + default collate: what most code does).
- "DataLoader floor": an IterableDataset yielding a constant 256-byte item: the most batches per
  second the DataLoader itself passes at that num_workers (its per-item IPC), whatever the data.
Reported: samples/s over the timed batches, time to first batch (workers
started, buffer opened, caches cold), RSS and USS per worker (main process for 0 workers), and
ratios to TensorDataset and TorchRL at the same num_workers. Then the in-process cost of one
dataset batch (``next()`` on ``iter(make_dataset(...))``) against ``buf.sample(256)`` on the same
buffer, and PASS/FAIL lines for the issue #13 targets (ratios within this run):
- every diskreplay Loader with num_workers=2 at >= 0.8x its num_workers=0 samples/s (the plain
  DataLoader rows are reported as "info": one item per batch, torch's own floor bounds them);
- every diskreplay loader at >= 2x TorchRL at each num_workers;
- a sample-mode dataset batch in-process at <= 1.3x ``buf.sample(256)``.
A last table: chunk fetches and bytes per epoch of epoch mode, block vs global shuffle, with a
cache smaller than the data.

Usage: python tools/bench_loader.py [--quick] [--dir /tmp/diskreplay-bench-loader] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl

import diskreplay as dr
from diskreplay.torch.data import make_dataset
from diskreplay.torch.loader import Loader

BATCH = 256
CHUNK_ROWS = 4096
FIELDS = {name: dr.Field(*spec) for name, spec in bl.WORKLOAD_FIELDS.items()}
PACKAGES = ["diskreplay", "numpy", "zarr", "torch", "torchdata", "torchrl", "tensordict"]
TENSOR_DS, TORCHRL, FLOOR = "TensorDataset (RAM)", "TorchRL memmap", "DataLoader floor (no data)"
LOADER = "diskreplay Loader"


def make_rows(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 17), dtype=np.float32),
            "action": rng.standard_normal((n, 6), dtype=np.float32),
            "reward": rng.standard_normal(n, dtype=np.float32),
            "next_obs": rng.standard_normal((n, 17), dtype=np.float32),
            "done": rng.random(n) < 0.01}


def write_buffer(path: str, rows: dict[str, np.ndarray], compression: str | None,
                 chunk_rows: int = CHUNK_ROWS) -> str:
    buf = dr.ReplayBuffer.create(path, FIELDS, None, chunk_rows=chunk_rows, compression=compression,
                                 overwrite=True)
    buf.extend(rows)
    buf.close()
    return path


class FloorStream(IterableDataset):
    """The DataLoader's own cost per item: ``{"reward": 256 bytes}`` (passed through untouched)."""

    def __iter__(self):
        item = {"reward": bytes(BATCH)}
        while True:
            yield item


class TorchRLStream(IterableDataset):
    """Endless ``rb.sample()`` batches as dicts of tensors (fork workers share the memmaps)."""

    def __init__(self, rb: Any):
        self.rb = rb

    def __iter__(self):
        while True:
            td = self.rb.sample()
            yield {k: td.get(k) for k in FIELDS}


def make_torchrl(rows: dict[str, np.ndarray], scratch: str) -> Any:
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer
    n = len(rows["reward"])
    rb = ReplayBuffer(storage=LazyMemmapStorage(n, scratch_dir=scratch), batch_size=BATCH)
    rb.extend(TensorDict({k: torch.from_numpy(v) for k, v in rows.items()}, batch_size=[n]))
    return rb


def loaders(data: dict[str, Any]) -> dict[str, Callable[[int], Any]]:
    """name -> (num_workers -> a fresh DataLoader, or a diskreplay `Loader`)."""
    def fork(w: int) -> dict[str, Any]:
        return {"num_workers": w, "multiprocessing_context": "fork"} if w else {"num_workers": 0}

    out: dict[str, Callable[[int], Any]] = {}
    for comp, url in (("zstd", data["zstd"]), ("raw", data["raw"])):
        for mode in ("sample", "epoch"):
            def build(w, url=url, mode=mode):
                return DataLoader(make_dataset(url, BATCH, mode, seed=0), batch_size=None, **fork(w))

            def build_loader(w, url=url, mode=mode):
                return Loader(make_dataset(url, BATCH, mode, seed=0), **fork(w))
            out[f"diskreplay {mode} {comp}"] = build
            out[f"{LOADER} {mode} {comp}"] = build_loader
    out[TORCHRL] = lambda w: DataLoader(TorchRLStream(data["torchrl"]), batch_size=None, **fork(w))
    out[TENSOR_DS] = lambda w: DataLoader(data["tensors"], batch_size=BATCH, shuffle=True, **fork(w))
    out[FLOOR] = lambda w: DataLoader(FloorStream(), batch_size=None, **fork(w))
    return out


def memory_of(workers: int) -> tuple[float, float]:
    """Mean (RSS, USS) bytes of the DataLoader workers, or of this process without workers."""
    procs = psutil.Process().children(recursive=True) if workers else [psutil.Process()]
    infos = [p.memory_full_info() for p in procs if p.is_running()]
    if not infos:
        return float("nan"), float("nan")
    return statistics.mean(i.rss for i in infos), statistics.mean(i.uss for i in infos)


@dataclass(frozen=True)
class Window:
    """What one measurement times: after the first batch, ``warm`` untimed batches, then up to
    ``batches`` batches or ``seconds``, whichever ends first."""
    warm: int
    batches: int
    seconds: float = 1.0


def measure(build: Callable[[int], Any], workers: int, window: Window) -> dict[str, float]:
    gc.collect()  # the previous contestant's buffers and caches: not inherited by this one's forked workers
    start = time.perf_counter()
    it = iter(build(workers))
    next(it)
    first = time.perf_counter() - start
    for _ in range(window.warm):
        next(it)
    start = time.perf_counter()
    rows, elapsed = 0, 0.0
    for _ in range(window.batches):
        batch = next(it)
        rows += len(batch[0] if isinstance(batch, (list, tuple)) else batch["reward"])
        elapsed = time.perf_counter() - start
        if elapsed >= window.seconds:
            break
    rss, uss = memory_of(workers)
    del it
    return {"rate": rows / elapsed, "first": first, "rss": rss, "uss": uss}


def throughput_table(data: dict[str, Any], worker_counts: list[int], window: Window, repeats: int
                     ) -> tuple[str, dict[tuple[str, int], dict[str, float]]]:
    builders = loaders(data)
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    names = list(builders)
    for r in range(repeats):
        for w in worker_counts:
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                bl.log(f"  repeat {r + 1}/{repeats}: {name}, num_workers={w}")
                results.setdefault((name, w), []).append(measure(builders[name], w, window))
    med = {key: {m: statistics.median(x[m] for x in runs) for m in runs[0]} for key, runs in results.items()}
    lines = ["| loader | num_workers | samples/s | × TensorDataset | × TorchRL | first batch "
             "| RSS / worker | USS / worker |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        for w in worker_counts:
            m = med[(name, w)]
            vs_ram = bl.format_ratio(m["rate"] / med[(TENSOR_DS, w)]["rate"])
            vs_trl = bl.format_ratio(m["rate"] / med[(TORCHRL, w)]["rate"])
            lines.append(f"| {name} | {w} | {m['rate']:,.0f} | {vs_ram} | {vs_trl} | {bl.format_seconds(m['first'])} "
                         f"| {bl.format_bytes(m['rss'])} | {bl.format_bytes(m['uss'])} |")
    return "\n".join(lines), med


def throughput_checks(med: dict[tuple[str, int], dict[str, float]], worker_counts: list[int]) -> list[str]:
    """PASS/FAIL lines: num_workers=2 vs 0 (>= 0.8x) for each diskreplay `Loader` (the plain
    DataLoader rows as "info": torch's per-item floor bounds them), and vs TorchRL (>= 2x) for each
    diskreplay row."""
    lines = []
    for name in sorted({n for n, _ in med if n.startswith("diskreplay")}):
        if 0 in worker_counts and 2 in worker_counts:
            ratio = med[(name, 2)]["rate"] / med[(name, 0)]["rate"]
            verdict = ("PASS" if ratio >= 0.8 else "FAIL") if name.startswith(LOADER) else "info"
            lines.append(f"{verdict} {name}: num_workers=2 {med[(name, 2)]['rate']:,.0f} "
                         f"samples/s = {ratio:.2f}x num_workers=0 {med[(name, 0)]['rate']:,.0f} (target >= 0.80x"
                         f"{'' if verdict != 'info' else ' for the Loader; a plain DataLoader: one item per batch'})")
        for w in worker_counts:
            ratio = med[(name, w)]["rate"] / med[(TORCHRL, w)]["rate"]
            lines.append(f"{'PASS' if ratio >= 2 else 'FAIL'} {name}: num_workers={w} {ratio:.2f}x TorchRL "
                         f"({med[(name, w)]['rate']:,.0f} vs {med[(TORCHRL, w)]['rate']:,.0f} samples/s; target >= 2x)")
    return lines


def inprocess_table(data: dict[str, Any], batches: int, repeats: int) -> tuple[str, list[str]]:
    """Microseconds per batch in this process: ``buf.sample(256)`` vs a dataset's ``next()``
    (sample and epoch mode), interleaved, median over ``repeats`` runs of ``batches`` batches;
    also ``buf.sample(256, format="torch")``, the same tensors without a dataset, and
    ``buf.sample_batches(256, 8)`` per batch (neither a target)."""
    lines = ["| buffer | buf.sample(256) | sample-mode dataset batch | ratio | epoch-mode dataset batch | ratio "
             "| buf.sample(256, format='torch') | sample-mode batch ÷ it | buf.sample_batches(256, 8), per batch |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    checks = []
    for comp in ("zstd", "raw"):
        buf = dr.ReplayBuffer.open(data[comp], "r")
        contestants = {"sample()": lambda buf=buf: buf.sample(BATCH),
                       "sample(torch)": lambda buf=buf: buf.sample(BATCH, format="torch"),
                       "sample_batches": _one_at_a_time(lambda buf=buf: buf.sample_batches(BATCH, 8)),
                       "sample": _endless(lambda url=data[comp]: make_dataset(url, BATCH, "sample", seed=0)),
                       "epoch": _endless(lambda url=data[comp]: make_dataset(url, BATCH, "epoch", seed=0))}
        for step in contestants.values():
            step()  # warm: readers opened, chunks cached
        times: dict[str, list[float]] = {k: [] for k in contestants}
        for _ in range(repeats):
            for name, step in contestants.items():
                start = time.perf_counter()
                for _ in range(batches):
                    step()
                times[name].append((time.perf_counter() - start) / batches * 1e6)
        us = {k: statistics.median(v) for k, v in times.items()}
        buf.close()
        ratio, ratio_epoch = us["sample"] / us["sample()"], us["epoch"] / us["sample()"]
        lines.append(f"| {comp} | {us['sample()']:.0f} µs | {us['sample']:.0f} µs | {ratio:.2f}× "
                     f"| {us['epoch']:.0f} µs | {ratio_epoch:.2f}× | {us['sample(torch)']:.0f} µs "
                     f"| {us['sample'] / us['sample(torch)']:.2f}× | {us['sample_batches']:.0f} µs |")
        checks.append(f"{'PASS' if ratio <= 1.3 else 'FAIL'} in-process {comp}: sample-mode dataset batch "
                      f"{us['sample']:.0f} µs = {ratio:.2f}x buf.sample(256) {us['sample()']:.0f} µs (target <= 1.30x)")
    return "\n".join(lines), checks


def _one_at_a_time(read: Callable[[], list[Any]]) -> Callable[[], Any]:
    """A step function: the next batch of the lists ``read()`` returns."""
    pending: list[Any] = []

    def step() -> Any:
        if not pending:
            pending.extend(reversed(read()))
        return pending.pop()
    return step


def _endless(make: Callable[[], Any]) -> Callable[[], Any]:
    """A step function: the next batch of a dataset, starting its next epoch when one ends."""
    ds = make()
    state = {"it": iter(ds)}

    def step() -> Any:
        try:
            return next(state["it"])
        except StopIteration:
            state["it"] = iter(ds)
            return next(state["it"])
    return step


def epoch_io_table(root: str, rows: int) -> str:
    """Chunk fetches per epoch, block vs global shuffle, cache = 1/4 of the decoded data."""
    chunk_rows = 1024
    data = make_rows(rows, seed=1)
    chunk_bytes = chunk_rows * sum(f.row_bytes for f in FIELDS.values())
    chunks = -(-rows // chunk_rows)
    cache = max(chunks // 4, 8) * chunk_bytes
    lines = ["| compression | shuffle | chunk fetches / epoch | chunks | decoded MB / epoch "
             "| stored MB / epoch | epoch time |", "|---|---|---:|---:|---:|---:|---:|"]
    for comp in ("zstd", None):
        path = write_buffer(os.path.join(root, f"io-{comp}"), data, comp, chunk_rows)
        stored = sum(f.stat().st_size for f in Path(path).rglob("*")
                     if f.is_file() and (f.name.startswith("c.") or "c" in f.relative_to(path).parts)) / max(chunks, 1)
        for shuffle in ("block", "global"):
            ds = make_dataset(path, BATCH, "epoch", shuffle=shuffle, shuffle_window=4, cache_bytes=cache)
            start = time.perf_counter()
            n = sum(len(b["index"]) for b in ds)
            elapsed = time.perf_counter() - start
            assert n == rows
            stats = ds.io_stats()
            lines.append(f"| {comp or 'none'} | {shuffle} | {stats['chunk_fetches']:,} | {chunks} "
                         f"| {stats['bytes_decoded'] / 1e6:,.1f} | {stats['chunk_fetches'] * stored / 1e6:,.1f} "
                         f"| {bl.format_seconds(elapsed)} |")
    return (f"{rows:,} rows in {chunk_rows}-row chunks ({chunk_bytes / 1e6:.2f} MB decoded each), cache "
            f"{cache // chunk_bytes} chunks, shuffle_window 4, num_workers=0; stored MB = fetches × mean "
            f"stored chunk size (all fields)\n\n" + "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, one repeat (a few minutes)")
    parser.add_argument("--dir", default="/tmp/diskreplay-bench-loader")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated num_workers values")
    args = parser.parse_args()
    rows, repeats = (100_000, 1) if args.quick else (1_000_000, 3)
    window = Window(32, 300) if args.quick else Window(256, 3000)
    workers = [int(w) for w in args.workers.split(",")]
    os.makedirs(args.dir, exist_ok=True)
    bl.require_free_space(args.dir, 4 * rows * 165)
    bl.log(f"writing {rows:,} rows (zstd, raw, TorchRL memmap) under {args.dir}")
    data_rows = make_rows(rows)
    scratch = os.path.join(args.dir, "torchrl")
    shutil.rmtree(scratch, ignore_errors=True)
    data = {"zstd": write_buffer(os.path.join(args.dir, "zstd"), data_rows, "zstd"),
            "raw": write_buffer(os.path.join(args.dir, "raw"), data_rows, None),
            "torchrl": make_torchrl(data_rows, scratch),
            "tensors": TensorDataset(*(torch.from_numpy(v) for v in data_rows.values()))}
    torch.set_num_threads(1)
    bl.log("throughput")
    table, med = throughput_table(data, workers, window, repeats)
    bl.log("in-process batch cost")
    inproc, inproc_checks = inprocess_table(data, 100 if args.quick else 500, 15 if args.quick else 31)
    checks = throughput_checks(med, workers) + inproc_checks
    bl.log("epoch I/O")
    io = epoch_io_table(args.dir, 65_536 if args.quick else 262_144)
    report = "\n".join([
        bl.report_header("DataLoader benchmark (tools/bench_loader.py)", False, PACKAGES, args.dir), "",
        f"{rows:,} rows × 165 B, batch {BATCH}; after the first batch and {window.warm} untimed ones, up to "
        f"{window.batches:,} batches or {window.seconds:g} s timed, median of {repeats}; "
        "fork workers; data in the page cache.", "", table, "",
        "## In-process batch cost (num_workers=0, no DataLoader)", "",
        "Median µs per batch of interleaved runs; dataset batch = ``next()`` on "
        f"``iter(make_dataset(url, {BATCH}, mode))``.",
        "", inproc, "", "## Targets (issue #13)", "", "```", *checks, "```", "",
        "## Epoch mode: bytes read per epoch", "", io, ""])
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
