"""Scale benchmark: diskreplay from 1M to 200M rows (more than RAM) vs TorchRL memmap and cpprb.

Workload: the five fields of ``benchlib.WORKLOAD_FIELDS`` (165 bytes per row), batch 256. diskreplay
buffers are raw (``compression=None``) with the default ``chunk_rows`` (4,096, longer past 16,384
chunk files: 16,384 at 50M rows, 65,536 at 200M), read through a read-only reader
(``ReplayBuffer.open(path, "r")``, the library's default ``cache_bytes``). TorchRL is
``TensorDictReplayBuffer(storage=LazyMemmapStorage(n), batch_size=256)`` with
``torch.set_num_threads(1)``, reopened from its files like a reader (``storage.loads``).

Measured:
1. warm uniform sample(256) at each of ``--sizes`` (default 1M, 10M, 50M, 200M; 200M rows = 33 GB,
   more than this machine's RAM): every file read once, then 2,000 untimed batches (or 20 s), then
   interleaved repeats, medians. Where both stores do not fit on disk together (200M), each is
   built, timed and deleted in turn (not interleaved). Cost curve: diskreplay's time at the largest
   size that was resident in the page cache over its time at the smallest.
2. cold sample at 1M and 10M: every file of both stores evicted from the page cache (fsync +
   ``POSIX_FADV_DONTNEED``, checked with mincore), a freshly opened reader, then the first batch and
   the next 50 batches timed; contestants alternate, medians.
3. PER: sample(256, beta=0.4) + update_priorities(256) at ``--per-sizes`` (16M, 64M) vs cpprb
   ``PrioritizedReplayBuffer`` (alpha 0.6); interleaved where both fit in RAM, else one after the
   other (cpprb freed first).
4. memory of a fresh reader process sampling 10,000 batches from the 50M buffer: private
   (RssAnon) and file-backed (RssFile) pages from /proc/self/status; the same for TorchRL.
5. profile of warm sample(256) at 1M, by timing components (not cProfile): the index draw alone;
   gather = numpy floor − draw; Python and bookkeeping = diskreplay − numpy floor.
6. the numpy floor at 1M (and every size up to 10M): ``rng.integers`` + ``np.take(v, idx, axis=0)``
   per field on in-RAM arrays.

Stores live under ``--dir`` with a ``.complete`` marker beside each; a later run reuses complete
ones. Without ``--keep`` they are deleted at the end. ``--quick``: sizes 200k and 1M, PER at 1M,
few repeats (under a minute on a 2-core machine).

Usage: python tools/bench_scale.py [--quick] [--sizes 1M,10M,50M,200M] [--per-sizes 16M,64M]
       [--dir /tmp/diskreplay-scale] [--out FILE] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl

import diskreplay as dr

BATCH, BLOCK = 256, 1_000_000
ALPHA, BETA = 0.6, 0.4
COLD_NEXT = 50  # batches timed after the cold first one
FLOOR_MAX_ROWS = 10_000_000  # the numpy floor keeps its arrays in RAM: only up to this size
FIELDS = {name: dr.Field(*spec) for name, spec in bl.WORKLOAD_FIELDS.items()}
ROW_BYTES = sum(f.row_bytes for f in FIELDS.values())  # 165
TRL_ROW_BYTES = ROW_BYTES + 8  # TensorDictReplayBuffer also stores an int64 "index" per row
DATA_VERSION = 1  # bump when the generated rows change: stores marked with another version are rebuilt
CACHE_BYTES = inspect.signature(dr.ReplayBuffer.open).parameters["cache_bytes"].default
DR, TRL, CPPRB, FLOOR = "diskreplay", "TorchRL memmap", "cpprb", "numpy floor"
DRAW = "index draw alone"
PACKAGES = ["diskreplay", "numpy", "zarr", "torch", "torchrl", "tensordict", "cpprb"]
log = bl.log


parse_size, label = bl.parse_count, bl.format_count


def repeat(fn: Callable[[], Any], n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            fn()
    return run


# ---- data -------------------------------------------------------------------------------------


class Rows:
    """The rows of every store: one random block of 1M rows; row ``k * 1M + r`` is block row ``r``
    with ``k`` added to its float fields. Cheap to produce (writing 200M rows is I/O bound), and
    every row differs, so `check` catches a wrong gather."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.base = {
            "obs": rng.standard_normal((BLOCK, 17), dtype=np.float32),
            "action": rng.standard_normal((BLOCK, 6), dtype=np.float32),
            "reward": rng.standard_normal(BLOCK, dtype=np.float32),
            "next_obs": rng.standard_normal((BLOCK, 17), dtype=np.float32),
            "done": rng.random(BLOCK) < 1e-3,  # episodes of ~1000 steps
        }

    def of(self, k: int, r: Any) -> dict[str, np.ndarray]:
        """Rows ``r`` (a slice or indices) of block ``k``."""
        return {name: v[r] if v.dtype == bool else v[r] + np.float32(k) for name, v in self.base.items()}

    def blocks(self, rows: int) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, rows, BLOCK):
            yield self.of(start // BLOCK, slice(0, min(BLOCK, rows - start)))

    def arrays(self, rows: int) -> dict[str, np.ndarray]:
        parts = list(self.blocks(rows))
        return {name: np.concatenate([p[name] for p in parts]) for name in self.base}

    def check(self, batch: Mapping[str, Any], who: str) -> None:
        index = np.asarray(batch["index"]).reshape(-1)
        k, r = np.divmod(index, BLOCK)
        for name, v in self.base.items():
            want = v[r] if v.dtype == bool else v[r] + k.astype(np.float32).reshape(-1, *[1] * (v.ndim - 1))
            if not np.array_equal(np.asarray(batch[name]).reshape(want.shape), want):
                raise RuntimeError(f"{who}: sampled {name!r} differs from the rows written at {index[:4]}...")


# ---- stores -----------------------------------------------------------------------------------


def build_dr(path: str, rows: int, data: Rows, sampler: dr.Sampler | None = None) -> None:
    buf = dr.ReplayBuffer.create(path, FIELDS, capacity=rows, compression=None,
                                 sampler=sampler, seed=0)
    try:
        for block in data.blocks(rows):
            buf.extend(block)
        buf.flush()
    finally:
        buf.close()


def build_trl(path: str, rows: int, data: Rows) -> None:
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
    storage = LazyMemmapStorage(rows, scratch_dir=path)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=BATCH)
    for block in data.blocks(rows):
        rb.extend(bl.as_tensordict(block))
    storage.dumps(path)  # zero-copy (same directory): TorchRL's storage_metadata.json beside the memmaps
    del rb, storage
    gc.collect()


def open_trl(path: str, rows: int):
    """A TorchRL buffer over the memmaps under ``path`` (no copy), as a reader process would open it."""
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
    storage = LazyMemmapStorage(rows, scratch_dir=path)
    storage.loads(Path(path))
    return TensorDictReplayBuffer(storage=storage, batch_size=BATCH)


@dataclass
class Store:
    kind: str  # "dr", "torchrl" or "dr-per"
    rows: int
    path: str

    @property
    def nbytes(self) -> int:
        return self.rows * (TRL_ROW_BYTES if self.kind == "torchrl" else ROW_BYTES) + 64 * bl.MiB

    @property
    def marker(self) -> str:
        return self.path + ".complete"

    def complete(self) -> bool:
        try:
            with open(self.marker) as f:
                return json.load(f) == {"rows": self.rows, "version": DATA_VERSION}
        except (OSError, ValueError):
            return False

    def delete(self) -> None:
        if os.path.exists(self.marker):
            os.remove(self.marker)
        shutil.rmtree(self.path, ignore_errors=True)


class Stores:
    """The stores of one run under ``root``: built on demand (or reused), deleted to make room."""

    def __init__(self, root: str, data: Rows):
        self.root, self.data = root, data
        self.known: dict[str, Store] = {}
        self.build_s: dict[str, float] = {}

    def get(self, kind: str, rows: int) -> Store:
        st = Store(kind, rows, os.path.join(self.root, f"{kind}_{label(rows)}"))
        return self.known.setdefault(st.path, st)

    def fit_together(self, stores: list[Store]) -> bool:
        missing = sum(s.nbytes for s in stores if not s.complete())
        others = sum(os.path.getsize(f) for s in self.known.values() if s not in stores for f in bl.files_under(s.path)
                     if os.path.exists(s.path))
        return missing <= bl.free_bytes(self.root) + others - 2 * bl.GB

    def ensure(self, st: Store, in_use: tuple[Store, ...] = ()) -> None:
        if st.complete() and self._usable(st):
            log(f"  reusing {st.path}")
            return
        st.delete()
        self._make_room(st.nbytes, (st, *in_use))
        log(f"  writing {st.rows:,} rows to {st.path} (~{bl.format_bytes(st.nbytes - 64 * bl.MiB)})")
        start = time.perf_counter()
        if st.kind == "torchrl":
            build_trl(st.path, st.rows, self.data)
        else:
            build_dr(st.path, st.rows, self.data,
                     dr.Prioritized(alpha=ALPHA, beta=BETA) if st.kind == "dr-per" else None)
        self.build_s[st.path] = time.perf_counter() - start
        with open(st.marker, "w") as f:
            json.dump({"rows": st.rows, "version": DATA_VERSION}, f)
        log(f"  written in {self.build_s[st.path]:.0f} s")

    @staticmethod
    def _usable(st: Store) -> bool:
        if st.kind == "torchrl":
            return os.path.exists(os.path.join(st.path, "storage_metadata.json"))
        try:  # the library may have changed its format since the store was written
            with dr.ReplayBuffer.open(st.path, "r") as buf:
                return len(buf) == st.rows
        except Exception as exc:
            log(f"  {st.path} unusable ({type(exc).__name__}: {exc}); rewriting it")
            return False

    def _make_room(self, needed: int, in_use: tuple[Store, ...]) -> None:
        """Delete other stores (smallest first, they are the cheapest to rebuild) until ``needed`` fits."""
        for other in sorted(self.known.values(), key=lambda s: s.rows):
            if bl.free_bytes(self.root) >= needed + 2 * bl.GB:
                break
            if other not in in_use and os.path.exists(other.path):
                log(f"  deleting {other.path} to make room")
                other.delete()
        bl.require_free_space(self.root, needed, margin=2 * bl.GB)

    def cleanup(self) -> None:
        for st in self.known.values():
            st.delete()


def resident_share(st: Store) -> float:
    resident, total = bl.resident_bytes(st.path)
    return resident / total if total else float("nan")


# ---- contestants ------------------------------------------------------------------------------


def open_sampler(st: Store, data: Rows | None = None) -> tuple[Callable[[], Any], Callable[[], None]]:
    """(sample one batch, close) for a freshly opened reader of ``st``; with ``data``, one batch is
    checked against the rows written first."""
    if st.kind == "torchrl":
        rb = open_trl(st.path, st.rows)
        if data is not None:
            data.check({k: v.numpy() for k, v in rb.sample().items()}, TRL)
        return rb.sample, lambda: None
    reader = dr.ReplayBuffer.open(st.path, "r")
    if data is not None:
        data.check(reader.sample(BATCH), DR)
    return (lambda: reader.sample(BATCH)), reader.close


def floor_fns(arrays: dict[str, np.ndarray], profile: bool) -> dict[str, Callable[[], Any]]:
    """The numpy floor; with ``profile``, also its index draw alone (the rest of the floor is the gather)."""
    n = len(arrays["obs"])
    rng = np.random.default_rng(1)

    def floor():
        idx = rng.integers(0, n, BATCH)
        return {k: np.take(v, idx, axis=0) for k, v in arrays.items()}
    fns = {FLOOR: floor}
    if profile:
        fns[DRAW] = lambda: rng.integers(0, n, BATCH)
    return fns


def warm_up(fn: Callable[[], Any], batches: int, seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    for _ in range(batches):
        fn()
        if time.perf_counter() > deadline:
            break


def per_call(fn: Callable[[], Any], calls: int = 21, seconds: float = 5.0) -> float:
    """Median seconds of up to ``calls`` separately timed calls (fewer once ``seconds`` have passed)."""
    times = []
    deadline = time.perf_counter() + seconds
    while len(times) < calls and (not times or time.perf_counter() < deadline):
        times.append(bl.timed(fn)[0])
    return float(np.median(times))


def time_interleaved(fns: dict[str, Callable[[], Any]], cfg: argparse.Namespace,
                     warm: bool = True) -> dict[str, bl.Stats]:
    """Warm up each (unless done already), size the repeats from the slowest (about ``cfg.repeat_s``
    each), time them interleaved."""
    for fn in fns.values() if warm else ():
        warm_up(fn, cfg.warm_batches, cfg.warm_s)
    slowest = max(per_call(fn) for fn in fns.values())
    number = int(min(cfg.batches, max(3, cfg.repeat_s / slowest)))
    log(f"  timing: {cfg.repeats} interleaved repeats x {number} calls of {', '.join(fns)} "
        f"(slowest ~{bl.format_seconds(slowest)} per call)")
    return bl.interleaved({k: repeat(f, number) for k, f in fns.items()}, cfg.repeats, number=number)


# ---- 1, 5, 6. warm sampling ----------------------------------------------------------------------


@dataclass
class Results:
    warm: dict[int, dict[str, bl.Stats]] = field(default_factory=dict)
    resident: dict[int, dict[str, float]] = field(default_factory=dict)
    sequential: set[int] = field(default_factory=set)
    cold: dict[int, dict[str, bl.Stats]] = field(default_factory=dict)
    cold_resident: dict[int, dict[str, float]] = field(default_factory=dict)  # worst "evicted", "after open"
    cold_first: dict[int, dict[str, float]] = field(default_factory=dict)  # store share cached by the first batch
    per_resident: dict[int, float] = field(default_factory=dict)
    per: dict[int, dict[str, bl.Stats]] = field(default_factory=dict)
    per_notes: dict[int, str] = field(default_factory=dict)
    memory: dict[str, dict] | None = None
    skipped: list[str] = field(default_factory=list)
    memory_rows: int = 0


def measure_warm(stores: list[Store], data: Rows, cfg: argparse.Namespace, res: Results) -> None:
    size = stores[0].rows
    fns: dict[str, Callable[[], Any]] = {}
    closers = []
    for st in stores:
        got, secs = bl.read_files(st.path)
        log(f"  read {st.path} once ({bl.format_bytes(got)}, {secs:.0f} s)")
    for st in stores:
        name = TRL if st.kind == "torchrl" else DR
        fns[name], close = open_sampler(st, data)
        closers.append(close)
    if DR in fns and size <= FLOOR_MAX_ROWS:
        fns.update(floor_fns(data.arrays(size), profile=size == cfg.profile_size))
    for fn in fns.values():
        warm_up(fn, cfg.warm_batches, cfg.warm_s)
    for st in stores:
        res.resident.setdefault(size, {})[TRL if st.kind == "torchrl" else DR] = resident_share(st)
    res.warm.setdefault(size, {}).update(time_interleaved(fns, cfg, warm=False))
    for close in closers:
        close()
    del fns, closers
    gc.collect()
    log("  " + ", ".join(f"{k}: {bl.format_seconds(v.median, 'us')}" for k, v in res.warm[size].items()))


def warm_size(size: int, stores: Stores, cfg: argparse.Namespace, res: Results) -> None:
    pair = [stores.get("dr", size), stores.get("torchrl", size)]
    log(f"[warm] sample(256) at {label(size)} rows")
    if stores.fit_together(pair):
        stores.ensure(pair[0], in_use=(pair[1],))
        stores.ensure(pair[1], in_use=(pair[0],))
        measure_warm(pair, stores.data, cfg, res)
        if size in cfg.cold_sizes:
            measure_cold(pair, cfg, res)
        if size == cfg.memory_size:
            measure_memory(pair, cfg, res)
        return
    log("  both stores do not fit on disk together: one after the other (the one on disk first)")
    res.sequential.add(size)
    for what, asked in (("cold sampling", size in cfg.cold_sizes), ("the reader-memory test", size == cfg.memory_size)):
        if asked:
            res.skipped.append(f"{what} at {label(size)} rows (it needs both stores on disk at once)")
    for st in sorted(pair, key=lambda s: not s.complete()):
        stores.ensure(st)
        measure_warm([st], stores.data, cfg, res)


# ---- 2. cold sampling ------------------------------------------------------------------------------


def measure_cold(pair: list[Store], cfg: argparse.Namespace, res: Results) -> None:
    size = pair[0].rows
    worst = res.cold_resident.setdefault(size, {"evicted": 0.0, "after open": 0.0})

    def turn(st: Store, name: str) -> Callable[[], Mapping[str, float]]:
        def run():
            gc.collect()  # drop the last turn's mappings: mapped pages survive eviction
            for s in pair:
                bl.evict_page_cache(s.path)
            worst["evicted"] = max(worst["evicted"], *(resident_share(s) for s in pair))
            sample, close = open_sampler(st)  # no check batch: it would warm the cache
            worst["after open"] = max(worst["after open"], resident_share(st))
            first, _ = bl.timed(sample)
            cached = res.cold_first.setdefault(size, {})
            cached[name] = max(cached.get(name, 0.0), resident_share(st))
            rest, _ = bl.timed(repeat(sample, COLD_NEXT))
            close()
            return {"total": first, f"next {COLD_NEXT}": rest}
        return run
    log(f"[cold] {label(size)} rows: {cfg.cold_repeats} alternating repeats, page cache evicted before each")
    res.cold[size] = bl.interleaved({DR: turn(pair[0], DR), TRL: turn(pair[1], TRL)}, cfg.cold_repeats)
    gc.collect()
    log("  " + ", ".join(f"{k}: first {bl.format_seconds(v.median)}, next {COLD_NEXT} "
                         f"{bl.format_seconds(v.phases[f'next {COLD_NEXT}'].median)}"
                         for k, v in res.cold[size].items()))


# ---- 3. PER ------------------------------------------------------------------------------------------


def dr_per_pair(st: Store, pool: np.ndarray) -> tuple[Callable[[], Any], Callable[[], None]]:
    bl.read_files(st.path)
    reader = dr.ReplayBuffer.open(st.path, "r")  # its Prioritized sampler comes from the commit
    turn = iter(range(1 << 62))

    def pair():
        batch = reader.sample(BATCH, beta=BETA)
        reader.update_priorities(batch["index"], pool[next(turn) % len(pool)])
    return pair, reader.close


def cpprb_per(rows: int, data: Rows, pool: np.ndarray) -> Callable[[], Any]:
    import cpprb
    cb = cpprb.PrioritizedReplayBuffer(rows, env_dict={
        "obs": {"shape": 17}, "action": {"shape": 6}, "reward": {}, "next_obs": {"shape": 17},
        "done": {"dtype": np.bool_}}, alpha=ALPHA)
    for block in data.blocks(rows):
        cb.add(**block)
    turn = iter(range(1 << 62))

    def pair():
        s = cb.sample(BATCH, beta=BETA)
        cb.update_priorities(s["indexes"], pool[next(turn) % len(pool)])
    return pair


def per_size(size: int, stores: Stores, cfg: argparse.Namespace, res: Results) -> None:
    pool = np.random.default_rng(1).exponential(1.0, (64, BATCH))  # |TD errors|
    st = stores.get("dr-per", size)
    need = 1.3 * size * ROW_BYTES + 1 * bl.GB  # cpprb's arrays and trees, with room to spare
    avail = bl.mem_available() or 0
    together = 2 * need < 0.6 * avail
    per_cfg = argparse.Namespace(**{**vars(cfg), "batches": cfg.per_number, "warm_batches": cfg.per_warm})
    log(f"[PER] {label(size)} rows, {'interleaved' if together else 'one after the other'}")
    fns: dict[str, Callable[[], Any]] = {}
    stats: dict[str, bl.Stats] = {}
    if avail < need:
        res.per_notes[size] = f"cpprb not run: needs ~{bl.format_bytes(need)}, {bl.format_bytes(avail)} available"
        log("  " + res.per_notes[size])
    else:
        log("  filling cpprb PrioritizedReplayBuffer")
        rss = bl.self_rss() or 0
        fns[CPPRB] = cpprb_per(size, stores.data, pool)
        res.per_notes[size] = f"cpprb held {bl.format_bytes((bl.self_rss() or 0) - rss)}"
        if not together:
            stats.update(time_interleaved(fns, per_cfg))
            fns.clear()
            gc.collect()
            res.per_notes[size] += ", freed before diskreplay ran: one after the other"
    stores.ensure(st)
    fns[DR], close = dr_per_pair(st, pool)
    for fn in fns.values():
        warm_up(fn, per_cfg.warm_batches, per_cfg.warm_s)
    res.per_resident[size] = resident_share(st)
    stats.update(time_interleaved(fns, per_cfg, warm=False))
    close()
    res.per[size] = stats
    fns.clear()
    gc.collect()
    log("  " + ", ".join(f"{k}: {bl.format_seconds(v.median, 'us')}" for k, v in stats.items()))


# ---- 4. memory of a reader process -------------------------------------------------------------


def measure_memory(pair: list[Store], cfg: argparse.Namespace, res: Results) -> None:
    log(f"[memory] fresh reader processes, {cfg.mem_batches:,} batches from {label(pair[0].rows)} rows")
    res.memory, res.memory_rows = {}, pair[0].rows
    for st, name in zip(pair, (DR, TRL)):
        out = bl.run_child([sys.executable, __file__, "--child-memory", st.kind, st.path, str(st.rows),
                            str(cfg.mem_batches)])
        if out.returncode:
            raise RuntimeError(f"{name} memory child failed ({out.returncode}): {out.stderr.strip()[-500:]}")
        res.memory[name] = json.loads(out.stdout.strip().splitlines()[-1]) | {"polled_hwm": out.peak_rss}
        log(f"  {name}: " + ", ".join(f"{k} {bl.format_bytes(v)}" for k, v in res.memory[name]["end"].items()))


def child_memory(kind: str, path: str, rows: int, batches: int) -> None:
    """Subprocess: open a reader, sample ``batches``, print /proc/self/status figures as JSON."""
    if kind == "torchrl":
        import torch
        bl.import_torchrl()
        torch.set_num_threads(1)
        imported = bl.self_status()
        rb = open_trl(path, rows)
        sample = rb.sample
    else:
        imported = bl.self_status()
        reader = dr.ReplayBuffer.open(path, "r")

        def sample():
            return reader.sample(BATCH)
    opened = bl.self_status()
    secs, _ = bl.timed(repeat(sample, batches))
    print(json.dumps({"imported": imported, "opened": opened, "end": bl.self_status(), "per_batch": secs / batches}))


# ---- report ---------------------------------------------------------------------------------------


def us(s: float) -> str:
    return bl.format_seconds(s, "us")


def med(stats: Mapping[str, bl.Stats], name: str) -> float | None:
    return stats[name].median if name in stats else None


def warm_tables(res: Results) -> str:
    t = bl.Table([DR, TRL, FLOOR], corner="warm sample(256), per batch")
    r = bl.Table([DR, TRL], corner="page cache held at the start of timing")
    for size, stats in sorted(res.warm.items()):
        seq = " (one after the other)" if size in res.sequential else ""
        t.add(f"{label(size)} rows{seq}", {c: med(stats, c) for c in (DR, TRL, FLOOR)}, unit="us", baseline=TRL)
        r.add(f"{label(size)} rows ({bl.format_bytes(size * ROW_BYTES)} per store)",
              {c: f"{v:.0%}" for c, v in res.resident[size].items()}, kind="text")
    return t.render() + "\n\n" + r.render()


def cold_table(res: Results) -> str:
    t = bl.Table([DR, TRL], corner="cold sample(256), fresh reader, page cache evicted")
    for size, stats in sorted(res.cold.items()):
        t.add(f"{label(size)} rows: first batch", {c: stats[c].median for c in stats}, baseline=TRL)
        t.add(f"{label(size)} rows: next {COLD_NEXT} batches (total)",
              {c: stats[c].phases[f"next {COLD_NEXT}"].median for c in stats}, baseline=TRL)
        t.add(f"{label(size)} rows: share of the store in the page cache after the first batch",
              {c: f"{v:.1%}" for c, v in res.cold_first[size].items()}, kind="text")
    return t.render()


def per_table(res: Results) -> str:
    t = bl.Table([DR, CPPRB], corner="PER sample(256) + update_priorities(256), per pair")
    for size, stats in sorted(res.per.items()):
        note = f" ({res.per_notes[size]})" if size in res.per_notes else ""
        note += f" (diskreplay store {res.per_resident[size]:.0%} in the page cache)"
        t.add(f"{label(size)} rows{note}", {c: med(stats, c) for c in (DR, CPPRB)}, unit="us", baseline=CPPRB)
    return t.render()


def memory_table(res: Results) -> str:
    t = bl.Table([DR, TRL], corner=f"reader process, {label(res.memory_rows)} rows")
    m = res.memory
    for when, what in (("imported", "after imports"), ("opened", "after open"), ("end", "after sampling")):
        t.add(f"private (RssAnon) {what}", {c: m[c][when]["RssAnon"] for c in m}, kind="bytes")
    t.add("file-backed (RssFile) after sampling", {c: m[c]["end"]["RssFile"] for c in m}, kind="bytes")
    t.add("shared memory (RssShmem) after sampling", {c: m[c]["end"]["RssShmem"] for c in m}, kind="bytes")
    t.add("peak resident set (VmHWM)", {c: m[c]["end"]["VmHWM"] for c in m}, kind="bytes")
    t.add("sample(256), mean per batch", {c: m[c]["per_batch"] for c in m}, unit="us")
    return t.render()


def profile_table(stats: Mapping[str, bl.Stats], size: int) -> str:
    total, floor, draw = stats[DR].median, stats[FLOOR].median, stats[DRAW].median
    t = bl.Table(["per batch", "share"], corner=f"diskreplay warm sample(256) at {label(size)} rows")
    for name, v in (("index draw (`rng.integers` timed alone)", draw),
                    ("gather (`np.take` x 5 fields in RAM: numpy floor − draw)", floor - draw),
                    ("Python and bookkeeping (diskreplay − numpy floor)", total - floor), ("total", total)):
        t.add(name, {"per batch": bl.format_seconds(v, "us"), "share": f"{v / total:.0%}"}, kind="text")
    return t.render()


def targets(res: Results, cfg: argparse.Namespace) -> list[bl.Target]:
    out = []
    for size in sorted(set(res.warm) | {10_000_000, 50_000_000, 200_000_000}):
        limit = 1.0 if size >= 200_000_000 else 1.2 if size >= 10_000_000 else None
        if limit is None:
            continue
        what = f"warm sample(256) at {label(size)} rows ≤ {limit:g}× TorchRL memmap"
        if size not in res.warm:
            out.append(bl.Target(what, "not run (--sizes)", None))
            continue
        d, t = res.warm[size][DR].median, res.warm[size][TRL].median
        out.append(bl.Target(what, f"{us(d)} vs {us(t)}: {bl.format_ratio(d / t)}", d <= limit * t))
    out += cost_curve(res)
    # a reader's first read takes its own rows and the fill of the rest runs behind it, sharing the
    # disk with the next batches: what a cold start costs is the first batch and those, in all
    for size, stats in sorted(res.cold.items()):
        for part, get in (("first batch", lambda s: s.median),
                          (f"first batch and the next {COLD_NEXT}, in all",
                           lambda s: s.median + s.phases[f"next {COLD_NEXT}"].median)):
            d, t = get(stats[DR]), get(stats[TRL])
            out.append(bl.Target(f"cold {part} at {label(size)} rows ≤ 1.5× TorchRL",
                                 f"{bl.format_seconds(d)} vs {bl.format_seconds(t)}: {bl.format_ratio(d / t)}",
                                 d <= 1.5 * t))
    for size, stats in sorted(res.per.items()):
        what = f"PER sample+update at {label(size)} rows ≤ cpprb"
        if CPPRB not in stats:
            out.append(bl.Target(what, res.per_notes.get(size, "cpprb not run"), None))
            continue
        d, c = stats[DR].median, stats[CPPRB].median
        out.append(bl.Target(what, f"{us(d)} vs {us(c)}: {bl.format_ratio(d / c)}", d <= c))
    if res.memory:
        anon, limit = res.memory[DR]["end"]["RssAnon"], CACHE_BYTES + 150e6
        reduced = "" if res.memory_rows == 50_000_000 else f" (**reduced: {label(res.memory_rows)} rows**)"
        out.append(bl.Target(f"reader private memory ≤ cache_bytes + 150 MB{reduced}",
                             f"{bl.format_bytes(anon)} ≤ {bl.format_bytes(limit)}", anon <= limit))
    if cfg.profile_size in res.warm and FLOOR in res.warm[cfg.profile_size]:
        stats = res.warm[cfg.profile_size]
        d, f = stats[DR].median, stats[FLOOR].median
        out.append(bl.Target(f"warm sample(256) at {label(cfg.profile_size)} rows ≤ 1.3× numpy floor",
                             f"{us(d)} vs {us(f)}: {bl.format_ratio(d / f)}", d <= 1.3 * f))
    return out


def cost_curve(res: Results) -> list[bl.Target]:
    if len(res.warm) < 2:
        return []
    small = min(res.warm)
    resident = [s for s in res.warm if s > small and res.resident[s].get(DR, 0) >= 0.95]
    out = []
    base = res.warm[small][DR].median
    if resident:
        big = max(resident)
        r = res.warm[big][DR].median / base
        out.append(bl.Target(f"cost curve {label(small)} → {label(big)} (largest resident size) within 2×",
                             f"{us(res.warm[big][DR].median)} / {us(base)} = {bl.format_ratio(r)}", r <= 2))
    for big in sorted(s for s in res.warm if s > small and s not in resident):
        r = res.warm[big][DR].median / base
        out.append(bl.Target(f"… {label(small)} → {label(big)} (not resident: reported, no target)",
                             f"{us(res.warm[big][DR].median)} / {us(base)} = {bl.format_ratio(r)}", None))
    return out


def build_report(res: Results, cfg: argparse.Namespace, stores: Stores) -> str:
    parts = ["## Warm sampling", warm_tables(res)]
    if cfg.profile_size in res.warm and DRAW in res.warm[cfg.profile_size]:
        parts += ["## Profile", profile_table(res.warm[cfg.profile_size], cfg.profile_size)]
    if res.cold:
        parts += ["## Cold sampling", cold_table(res)]
    if res.per:
        parts += ["## Prioritized replay", per_table(res)]
    if res.memory:
        parts += ["## Memory of a reader process", memory_table(res),
                  ("File-backed pages (RssFile) of a read-only mapping are the OS page cache: shared with every "
                   "other process reading the same files and reclaimed by the kernel under memory pressure, so "
                   "they are not the process's own memory; private memory (RssAnon) is.")]
    tgts = targets(res, cfg)
    parts += ["## Targets", bl.render_targets(tgts), "\n".join(notes(res, cfg, stores)),
              "\n".join(f"{t.verdict}: {t.description} — {t.measured}" for t in tgts),
              f"Command: `{bl.command_line()}`"]
    return "\n\n".join(parts)


def spread(stats: Mapping[str, bl.Stats]) -> str:
    name = max(stats, key=lambda k: stats[k].spread)
    return f"{stats[name].spread:.0%} ({name})"


def notes(res: Results, cfg: argparse.Namespace, stores: Stores) -> list[str]:
    out = [
        (f"- warm: every file read once, then up to {cfg.warm_batches:,} untimed batches ({cfg.warm_s:g} s at most) "
        f"per contestant; then {cfg.repeats} interleaved repeats of up to {cfg.batches:,} batches (fewer when a batch "
        "is slow), medians. diskreplay: a fresh `ReplayBuffer.open(path, 'r')` with default cache_bytes "
        f"({bl.format_bytes(CACHE_BYTES)}). TorchRL: `TensorDictReplayBuffer(LazyMemmapStorage)` reopened with "
        "`storage.loads(dir)` (zero-copy), `rb.sample()`, torch.set_num_threads(1); it also stores an int64 'index' "
        f"per row ({TRL_ROW_BYTES} B/row vs {ROW_BYTES}). Rows are checked against what was written once per reader."),
        ("- numpy floor: `idx = rng.integers(0, n, 256)` + `np.take(v, idx, axis=0)` per field on in-RAM arrays. "
        "Profile method: component timing, not cProfile. The index draw is timed alone in the same interleaved "
        "repeats; gather = floor − draw; Python and bookkeeping = diskreplay − floor (diskreplay gathers from "
        "mapped or cached chunks, the floor from one in-RAM array per field, so any extra cost of that lands there)."),
    ]
    if res.sequential:
        out.append(f"- {', '.join(label(s) for s in sorted(res.sequential))} rows: the two stores do not fit on disk "
                   "together, so each was built, timed and deleted in turn (not interleaved; compare with care).")
    if res.cold:
        worst = max(v["evicted"] for v in res.cold_resident.values())
        opened = max(v["after open"] for v in res.cold_resident.values())
        out.append(f"- cold: {cfg.cold_repeats} repeats alternating contestants; before each turn every file of both "
                   "stores is fsynced and advised POSIX_FADV_DONTNEED (readers closed first: mapped pages stay). "
                   f"Most of a store left in the page cache after eviction: {worst:.1%}; after opening the reader: "
                   f"{opened:.1%} (mincore). The reader is opened fresh each turn (not timed). A page fault on a "
                   f"mapped file reads about the disk's read-ahead ({bl.read_ahead_kb(cfg.dir)} KiB here) around it, "
                   "so a mapped reader's first batch can pull most of a small store into the page cache (see the "
                   "'after the first batch' row).")
    if res.per:
        out.append(f"- PER: alpha {ALPHA}, beta {BETA}; diskreplay store created with `sampler=dr.Prioritized(...)`, "
                   "read by a fresh read-only reader (sampler restored from the commit), `sample(256, beta=0.4)` + "
                   "`update_priorities(batch['index'], td)`; cpprb `PrioritizedReplayBuffer(n, env_dict, alpha)`, "
                   "`sample(256, beta)` + `update_priorities(s['indexes'], td)`; TD errors from a pool drawn up front.")
    if res.memory:
        out.append(f"- memory: fresh `python {Path(__file__).name} --child-memory` processes, {cfg.mem_batches:,} "
                   "batches each, /proc/self/status read in the child after imports, after open and after sampling.")
    out.append("- noise, worst (max−min)/median of the repeats: " + "; ".join(
        f"{section} {label(size)} {spread(stats)}"
        for section, runs in (("warm", res.warm), ("cold", res.cold), ("PER", res.per))
        for size, stats in sorted(runs.items())) + ". Medians are reported.")
    if res.skipped:
        out.append("- **skipped**: " + "; ".join(res.skipped) + ".")
    out.append("- stores written this run: " + (", ".join(
        f"{os.path.basename(p)} {s:.0f} s" for p, s in stores.build_s.items()) or "none") + "; others were reused.")
    return out


# ---- main ------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/diskreplay-scale", help="work directory on the local disk to test")
    p.add_argument("--sizes", help="rows for warm sampling (default 1M,10M,50M,200M; quick 200k,1M)")
    p.add_argument("--per-sizes", help="rows for PER (default 16M,64M; quick 1M); empty: skip")
    p.add_argument("--cold-sizes", help="of --sizes, where to time cold sampling (default 1M,10M; quick 200k,1M)")
    p.add_argument("--memory-size", help="of --sizes, the reader-memory test's size (default 50M, else the "
                   "largest size below 200M)")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (about a minute)")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--keep", action="store_true", help="keep the stores for the next run (default: delete them)")
    p.add_argument("--child-memory", nargs=4, metavar=("KIND", "PATH", "ROWS", "BATCHES"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_memory:
        return args
    q = args.quick

    def sizes(text: str | None, default: str) -> list[int]:
        return [parse_size(s) for s in (default if text is None else text).split(",") if s.strip()]
    args.sizes = sorted(sizes(args.sizes, "200k,1M" if q else "1M,10M,50M,200M"))
    args.per_sizes = sorted(sizes(args.per_sizes, "1M" if q else "16M,64M"))
    args.cold_sizes = set(sizes(args.cold_sizes, "200k,1M" if q else "1M,10M")) & set(args.sizes)
    below = [s for s in args.sizes if s < 200_000_000] or args.sizes
    args.memory_size = parse_size(args.memory_size) if args.memory_size else (
        50_000_000 if 50_000_000 in args.sizes else max(below))
    args.profile_size = 1_000_000 if 1_000_000 in args.sizes else min(args.sizes)
    args.repeats, args.batches, args.repeat_s = (3, 300, 0.3) if q else (7, 2000, 1.0)
    args.warm_batches, args.warm_s = (300, 3.0) if q else (2000, 20.0)
    args.cold_repeats = 3 if q else 5
    args.per_number, args.per_warm = (200, 200) if q else (1000, 1000)
    args.mem_batches = 2000 if q else 10_000
    return args


def main() -> None:
    args = parse_args()
    if args.child_memory:
        kind, path, rows, batches = args.child_memory
        return child_memory(kind, path, int(rows), int(batches))
    os.makedirs(args.dir, exist_ok=True)
    import torch
    bl.import_torchrl()
    torch.set_num_threads(1)
    header = bl.report_header("diskreplay scale benchmark", args.quick, PACKAGES, args.dir, [
        f"sizes {', '.join(map(label, args.sizes))}; cold at {', '.join(map(label, sorted(args.cold_sizes)))}; "
        f"PER at {', '.join(map(label, args.per_sizes)) or 'none'}; reader memory at {label(args.memory_size)}",
        f"torch intra-op threads: {torch.get_num_threads()}; diskreplay default cache_bytes "
        f"{bl.format_bytes(CACHE_BYTES)}; read-ahead of the data dir's disk: {bl.read_ahead_kb(args.dir)} KiB"])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    stores, res = Stores(args.dir, Rows()), Results()
    try:
        for size in args.sizes:
            warm_size(size, stores, args, res)
        for size in args.per_sizes:
            per_size(size, stores, args, res)
    finally:
        if not args.keep:
            stores.cleanup()
    bl.publish_report(header, build_report(res, args, stores), args.out, started)


if __name__ == "__main__":
    main()
