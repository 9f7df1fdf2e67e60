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

Last (issue 41; alone with ``--epochs-only``): do workers add throughput to a training loop? Two
epochs over 2,000,000 zstd rows (``--epoch-rows``) with a stand-in training step after each batch
(a float32 matmul of fixed size, ~1 ms in one BLAS thread; ``--step-ms``/``--step-n``), through
``dr.Loader`` and a plain ``DataLoader(buf.as_dataset(...))`` (and with ``persistent_workers``):
epoch rows/s and their ratio to num_workers=0, time to each epoch's first batch, and the main
process's CPU time per batch (all its threads, the step included: the number that decides whether
workers add throughput, least disturbed by other load on a shared machine). Then where a worker's
start-up goes (``tools/worker_startup.py``): ``iter()`` to the first batch of num_workers=2, in
phases (fork, torch's set-up, the store's open in the worker, its first read and the cache fill in
it, the hand-over). ``--s3``: the same again from S3 (moto and the latency proxy of
``tests/s3server.py``, as ``tools/bench_cloud.py`` starts them; ``--s3-rows`` rows).

Usage: python tools/bench_loader.py [--quick] [--epochs-only [--s3]] [--dir /tmp/diskreplay-bench-loader] [--out FILE]
"""

from __future__ import annotations

# ruff: noqa: E402  (one BLAS thread is set before numpy is imported)
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

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # one BLAS thread: a fixed-cost step
    os.environ.setdefault(_var, "1")

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl
import worker_startup

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
                 chunk_rows: int = CHUNK_ROWS, storage_options: dict | None = None) -> str:
    buf = dr.ReplayBuffer.create(path, FIELDS, None, chunk_rows=chunk_rows, compression=compression,
                                 overwrite=True, storage_options=storage_options)
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
    import psutil  # only the throughput table needs it
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


# ---- issue 41: do workers add throughput to a training loop? ------------------------------------


def training_step(milliseconds: float, n: int | None = None) -> tuple[int, Callable[[], None]]:
    """A stand-in training step of fixed CPU cost: a float32 matmul of a size whose fastest of
    several timings here takes about ``milliseconds`` (one BLAS thread, set at the top), or of
    size ``n``. Returns the size and the step."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n or 64, n or 64), dtype=np.float32)
    while n is None:
        fastest = min(bl.timed(lambda a=a: a @ a)[0] for _ in range(30))
        if fastest * 1e3 >= milliseconds or len(a) >= 2048:
            n = len(a)
        else:
            a = rng.standard_normal((int(len(a) * 1.1),) * 2, dtype=np.float32)

    def step() -> None:
        a @ a
    return n, step


def epoch_contestants(url: str, batch: int, so: dict | None = None) -> dict[str, Callable[[int], Any]]:
    """name -> (num_workers -> an epoch iterable whose ``iter()`` runs one epoch); ``so``: the
    store's storage options."""
    def fork(w: int) -> dict[str, Any]:
        return {"num_workers": w, "multiprocessing_context": "fork"} if w else {"num_workers": 0}

    def plain(w: int, persistent: bool) -> Any:
        ds = dr.ReplayBuffer.open(url, "r", storage_options=so).as_dataset(batch, mode="epoch", seed=0)
        return DataLoader(ds, batch_size=None, persistent_workers=persistent and w > 0, **fork(w))

    return {"dr.Loader": lambda w: Loader(make_dataset(url, batch, "epoch", seed=0, storage_options=so), **fork(w)),
            "DataLoader(buf.as_dataset)": lambda w: plain(w, False),
            "DataLoader(buf.as_dataset, persistent_workers)": lambda w: plain(w, True)}


def run_epochs(iterable: Any, epochs: int, step: Callable[[], None]) -> list[dict[str, float]]:
    """Per epoch: rows, batches, wall seconds, seconds to its first batch and this process's CPU
    seconds (all its threads), with ``step()`` after each batch (a plain DataLoader's dataset is
    told its epoch, as its docs ask of non-persistent workers)."""
    out = []
    for epoch in range(epochs):
        if isinstance(iterable, DataLoader) and not iterable.persistent_workers:
            iterable.dataset.set_epoch(epoch)
        cpu, start = time.process_time(), time.perf_counter()
        first, rows, batches = None, 0, 0
        for b in iterable:
            if first is None:
                first = time.perf_counter() - start
            rows += len(b["reward"])
            batches += 1
            step()
        out.append({"rows": rows, "batches": batches, "seconds": time.perf_counter() - start,
                    "first": first or 0.0, "cpu": time.process_time() - cpu})
    return out


def epoch_workers_table(url: str, batch: int, worker_counts: list[int], repeats: int,
                        step: Callable[[], None], epochs: int = 2, so: dict | None = None) -> tuple[str, list[str]]:
    """Epoch rows/s with a training step per batch, per contestant and num_workers, epochs 1 and 2
    (and their first-batch times); ratios to the same contestant's num_workers=0. Interleaved
    repeats, medians."""
    builders = epoch_contestants(url, batch, so)
    runs: dict[tuple[str, int], list[list[dict[str, float]]]] = {}
    keys = [(name, w) for name in builders for w in worker_counts
            if not (w == 0 and "persistent" in name)]
    for r in range(repeats):
        for name, w in keys[r % len(keys):] + keys[:r % len(keys)]:
            bl.log(f"  repeat {r + 1}/{repeats}: {name}, num_workers={w}")
            gc.collect()
            runs.setdefault((name, w), []).append(run_epochs(builders[name](w), epochs, step))
    med = {key: [{m: statistics.median(run[e][m] for run in rs) for m in rs[0][e]} for e in range(epochs)]
           for key, rs in runs.items()}
    cols = " | ".join(f"epoch {e + 1} rows/s | × w0 | first batch {e + 1} | main CPU / batch {e + 1}"
                      for e in range(epochs))
    lines = [f"| loader | num_workers | {cols} |", "|---|---:|" + "---:|---:|---:|---:|" * epochs]
    checks = []
    for name, w in keys:
        base = med.get((name, 0), med[("DataLoader(buf.as_dataset)", 0)])
        cells = []
        for e in range(epochs):
            rate = med[(name, w)][e]["rows"] / med[(name, w)][e]["seconds"]
            ratio = rate / (base[e]["rows"] / base[e]["seconds"])
            m = med[(name, w)][e]
            cells.append(f"{rate:,.0f} | {ratio:.2f}× | {bl.format_seconds(m['first'])} "
                         f"| {m['cpu'] / m['batches'] * 1e6:,.0f} µs")
            if w:
                checks.append(f"{'PASS' if ratio >= 1 else 'FAIL'} {name} num_workers={w}, epoch {e + 1}: "
                              f"{ratio:.2f}x num_workers=0 (target >= 1.00x)")
        lines.append(f"| {name} | {w} | {' | '.join(cells)} |")
    return "\n".join(lines), checks


def open_seconds(url: str, repeats: int = 5, so: dict | None = None) -> float:
    """Median seconds of ``ReplayBuffer.open(url, "r")`` (what a worker does first)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dr.ReplayBuffer.open(url, "r", storage_options=so).close()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def startup_table(url: str, batch: int, repeats: int, so: dict | None = None) -> str:
    """Milliseconds from ``iter()`` to the first batch of num_workers=2 (fork), in the phases of
    `worker_startup` (worker 0's), medians of ``repeats`` fresh loaders each."""
    def fork2() -> dict[str, Any]:
        return {"num_workers": 2, "multiprocessing_context": "fork"}

    contestants: dict[str, Callable[[], Any]] = {
        "dr.Loader, epoch": lambda: Loader(make_dataset(url, batch, "epoch", seed=0, storage_options=so), **fork2()),
        "DataLoader(buf.as_dataset), epoch": lambda: DataLoader(
            dr.ReplayBuffer.open(url, "r", storage_options=so).as_dataset(batch, mode="epoch", seed=0),
            batch_size=None, **fork2()),
        "dr.Loader, sample": lambda: Loader(make_dataset(url, batch, "sample", seed=0, storage_options=so),
                                            **fork2())}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in contestants}
    with worker_startup.installed() as probe:
        for _ in range(repeats):
            for name, build in contestants.items():
                gc.collect()
                loader = build()
                it, phases = worker_startup.first_batch(probe, loader)
                runs[name].append(phases)
                del it, loader
    names = [*worker_startup.PHASES, "fill", "total", "rest"]
    lines = [f"| loader | {' | '.join(names)} |", "|---|" + "---:|" * len(names)]
    for name, got in runs.items():
        m = worker_startup.median_phases(got)
        lines.append(f"| {name} | " + " | ".join(f"{m[k] * 1e3:,.1f}" for k in names) + " |")
    return "\n".join(lines)


def epochs_section(args: argparse.Namespace) -> str:
    """Issue 41: epochs with a training step, workers vs in-process (zstd, local disk; ``--s3``:
    then from S3)."""
    rows = 200_000 if args.quick else args.epoch_rows
    url = os.path.join(args.dir, f"epochs-zstd-{rows}")
    if not os.path.exists(url):
        bl.log(f"writing {rows:,} rows (zstd) under {url}")
        write_buffer(url, make_rows(rows, seed=2), "zstd")
    parts = [epochs_report(args, url, rows, "local disk (page cache warm)")]
    if args.s3:
        parts.append(s3_epochs(args))
    return "\n".join(parts)


def s3_epochs(args: argparse.Namespace) -> str:
    """The epochs section from S3: moto and the latency proxy in a child process (`bench_cloud.Server`)."""
    from bench_cloud import BUCKET, Server, dr_options
    rows = 100_000 if args.quick else args.s3_rows
    server = Server(args.latency_ms / 1000)
    try:
        url = f"s3://{BUCKET}/epochs-zstd-{rows}"
        bl.log(f"writing {rows:,} rows (zstd) to {url}")
        write_buffer(url, make_rows(rows, seed=2), "zstd", storage_options=dr_options(server.endpoints["loopback"]))
        where = f"S3 (moto behind a proxy adding {args.latency_ms:g} ms per request, repeated GETs from its copy)"
        return epochs_report(args, url, rows, where, dr_options(server.endpoints["latency"]))
    finally:
        server.close()


def epochs_report(args: argparse.Namespace, url: str, rows: int, where: str, so: dict | None = None) -> str:
    """The epochs table, its checks and the start-up table for one store."""
    repeats = args.repeats or (1 if args.quick else 3)
    workers = [int(w) for w in args.workers.split(",")]
    torch.set_num_threads(1)
    opened = open_seconds(url, so=so)
    bl.log(f"epochs with a training step: {where}")
    n, step = training_step(args.step_ms, args.step_n)
    step_s = statistics.median(bl.timed(step)[0] for _ in range(200))
    table, checks = epoch_workers_table(url, args.epoch_batch, workers, repeats, step, so=so)
    bl.log(table)
    bl.log(f"worker start-up: {where}")
    startup = startup_table(url, args.epoch_batch, 3 if args.quick else 5, so)
    return "\n".join([
        f"## Epochs with a training step: do workers add throughput? (issue 41): {where}", "",
        f"{rows:,} rows × 165 B, zstd, {where}, batch {args.epoch_batch}; after each "
        f"batch the main process runs a stand-in training step (a {n}×{n} float32 matmul, one thread: "
        f"{bl.format_seconds(step_s)} median here); two epochs per iterable, each timed from its "
        f"``iter()`` to its last batch; "
        f"× w0: rows/s over the same loader's num_workers=0 (the plain DataLoaders': over the plain "
        f"DataLoader's num_workers=0); first batch: seconds from ``iter()``; main CPU / batch: this "
        f"process's CPU time (all threads, the training step included) per batch. Median of {repeats} "
        f"interleaved repeats; fork workers. Opening the store (``ReplayBuffer.open``): "
        f"{bl.format_seconds(opened)}.", "", table, "", "```", *checks, "```", "",
        "### Worker start-up (num_workers=2, fork): milliseconds from ``iter()`` to the first batch", "",
        "Worker 0's phases (tools/worker_startup.py): fork: until the worker runs; torch set-up: until "
        "the dataset's ``__iter__``; to open: until the store's open in the worker; to read: until its "
        "first read (the row order, the read-ahead announced, waiting for torch's first index); first "
        "read: that read (a Loader's: a block of batches), the cache fill (fill) included; hand-over: "
        "until the main process holds the batch; rest: the total less the open and the first read. Medians "
        "of fresh loaders, each phase's own.", "", startup, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, one repeat (a few minutes)")
    parser.add_argument("--dir", default="/tmp/diskreplay-bench-loader")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated num_workers values")
    parser.add_argument("--epochs-only", action="store_true", help="only the epochs-with-a-training-step section")
    parser.add_argument("--epoch-rows", type=bl.parse_count, default=2_000_000, help="rows of that section")
    parser.add_argument("--epoch-batch", type=int, default=BATCH, help="batch size of that section")
    parser.add_argument("--step-ms", type=float, default=1.0, help="the stand-in training step's CPU cost")
    parser.add_argument("--step-n", type=int, help="the step's matrix size (default: timed to --step-ms)")
    parser.add_argument("--repeats", type=int, help="repeats of that section (default 3, --quick 1)")
    parser.add_argument("--s3", action="store_true", help="that section also from S3 (moto + latency proxy)")
    parser.add_argument("--s3-rows", type=bl.parse_count, default=500_000, help="rows of the S3 run")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="latency the S3 proxy adds per request")
    args = parser.parse_args()
    if args.epochs_only:
        report = epochs_section(args)
        print(report)
        if args.out:
            Path(args.out).write_text(report)
        return
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
        "## Epoch mode: bytes read per epoch", "", io, "", epochs_section(args)])
    print(report)
    if args.out:
        Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
