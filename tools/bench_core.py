"""Core benchmark (issue #2): diskreplay vs TorchRL memmap vs cpprb vs the numpy floor, one run.

Workload: five fields — obs (17,) f32, action (6,) f32, reward () f32, next_obs (17,) f32,
done () bool — 1,000,000 rows, batch 256, local disk (``--dir``), data in the OS page cache.

Measured, side by side, repeats interleaved across contestants (median reported):
1. uniform sample(256): µs per batch, index generation included for every contestant; the numpy
   column is the floor: ``idx = rng.integers(0, n, 256)`` + ``np.take(v, idx, axis=0)`` per field
   on in-RAM arrays;
2. single-step add: µs per add into an empty 1M-capacity buffer (diskreplay: adds alone, and
   separately the durable flush that follows);
3. extend of 1M rows (+ a flush that writes and commits everything, not fsynced, as TorchRL
   does not sync either), and separately the fsync that makes it durable: seconds;
4. memory: a 20M-row uncompressed buffer (written once in a subprocess, reused if present),
   opened read-only in a fresh subprocess with cache_bytes=256 MiB, 10,000 batches of 256:
   private (RssAnon) and file-backed (RssFile) memory at the end, peak RSS, µs per batch.

Prints the machine, a markdown table and PASS/FAIL for the issue's targets; ``--out FILE`` also
writes the report there. ``--quick`` shrinks everything to run in about a minute or two.

Usage: python tools/bench_core.py [--quick] [--dir /tmp/diskreplay-bench] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl

import diskreplay as dr
from diskreplay.storage.chunk_io import default_io_threads

N_ROWS = 1_000_000
BATCH = 256
CHUNK_ROWS = 4096
FIELDS = {name: dr.Field(*spec) for name, spec in bl.WORKLOAD_FIELDS.items()}
WARM_BATCHES = 2000  # untimed batches per contestant before timing: fills caches, faults in pages
ROW_BYTES = sum(f.row_bytes for f in FIELDS.values())  # 165

DR_RAW, DR_RAW_R = "diskreplay raw", "diskreplay raw (reader)"
DR_ZSTD, DR_ZSTD_R = "diskreplay zstd", "diskreplay zstd (reader)"
TRL, CPPRB, NUMPY = "TorchRL memmap", "cpprb", "numpy"
COLUMNS = [DR_RAW, DR_RAW_R, DR_ZSTD, DR_ZSTD_R, TRL, CPPRB, NUMPY]
COMPRESSION = {DR_RAW: None, DR_ZSTD: "zstd"}
PACKAGES = ["diskreplay", "numpy", "zarr", "numcodecs", "torch", "torchrl", "tensordict", "cpprb"]

PRIVATE_SLACK = 150e6  # bytes of private memory allowed beyond cache_bytes ("+ 150 MB")
log = bl.log


def make_data(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.standard_normal((rows, 17), dtype=np.float32),
        "action": rng.standard_normal((rows, 6), dtype=np.float32),
        "reward": rng.standard_normal(rows, dtype=np.float32),
        "next_obs": rng.standard_normal((rows, 17), dtype=np.float32),
        "done": rng.random(rows) < 0.01,
    }


# ---- contestants ----------------------------------------------------------------------------


def cpprb_buffer(capacity: int):
    import cpprb
    return cpprb.ReplayBuffer(capacity, env_dict={
        "obs": {"shape": 17}, "action": {"shape": 6}, "reward": {}, "next_obs": {"shape": 17},
        "done": {"dtype": np.bool_}})


def torchrl_buffer(capacity: int, scratch_dir: str):
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
    os.makedirs(scratch_dir, exist_ok=True)
    return TensorDictReplayBuffer(storage=LazyMemmapStorage(capacity, scratch_dir=scratch_dir),
                                  batch_size=BATCH)


def fresh_dir(path: str) -> str:
    shutil.rmtree(path, ignore_errors=True)
    return path


def dr_create(path: str, compression: str | None) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.create(fresh_dir(path), FIELDS, capacity=N_ROWS, chunk_rows=CHUNK_ROWS,
                                  compression=compression, seed=0)


# ---- 1. sampling ----------------------------------------------------------------------------


def bench_sample(data, work: str, repeats: int, number: int) -> dict[str, bl.Stats]:
    log("[1/4] uniform sample(256): building contestants")
    samplers: dict[str, Callable[[], Any]] = {}
    keep: list[Any] = []
    for name, comp in COMPRESSION.items():
        path = os.path.join(work, f"sample_{comp or 'raw'}")
        buf = dr_create(path, comp)
        buf.extend(data)
        buf.flush()
        reader = dr.ReplayBuffer.open(path, "r")
        keep += [buf, reader]
        samplers[name] = lambda b=buf: b.sample(BATCH)
        samplers[name + " (reader)"] = lambda b=reader: b.sample(BATCH)
    trl = torchrl_buffer(N_ROWS, fresh_dir(os.path.join(work, "sample_torchrl")))
    trl.extend(bl.as_tensordict(data))
    samplers[TRL] = trl.sample
    cb = cpprb_buffer(N_ROWS)
    cb.add(**data)
    samplers[CPPRB] = lambda: cb.sample(BATCH)
    rng = np.random.default_rng(1)

    def numpy_floor():
        idx = rng.integers(0, N_ROWS, BATCH)
        return {k: np.take(v, idx, axis=0) for k, v in data.items()}
    samplers[NUMPY] = numpy_floor

    def repeat(fn, n=number):
        def run():
            for _ in range(n):
                fn()
        return run
    samplers = {c: samplers[c] for c in COLUMNS}
    log(f"[1/4] sampling: warm-up ({WARM_BATCHES} batches each), then {repeats} interleaved repeats x {number} batches")
    for fn in samplers.values():
        repeat(fn, WARM_BATCHES)()
    stats = bl.interleaved({k: repeat(f) for k, f in samplers.items()}, repeats, number=number)
    for b in keep:
        b.close()
    del trl, keep
    return stats


# ---- 2. single-step add ---------------------------------------------------------------------


def bench_add(data, work: str, repeats: int, adds: int) -> dict[str, bl.Stats]:
    pool = 1024  # per-step inputs prepared up front, in each library's native form
    rows = [{k: v[i] for k, v in data.items()} for i in range(pool)]
    td = bl.as_tensordict({k: v[:pool] for k, v in data.items()})
    td_rows = [td[i] for i in range(pool)]

    def dr_case(comp):
        def run():
            buf = dr_create(os.path.join(work, f"add_{comp or 'raw'}"), comp)
            add = buf.add
            start = time.perf_counter_ns()
            for i in range(adds):
                add(**rows[i % pool])
            added = (time.perf_counter_ns() - start) / 1e9
            flush, _ = bl.timed(buf.flush)
            buf.close()
            # interleaved() divides phases by `number` (adds) too; the flush is one operation
            return {"total": added, "flush": flush * adds}
        return run

    def trl_case():
        rb = torchrl_buffer(N_ROWS, fresh_dir(os.path.join(work, "add_torchrl")))
        add = rb.add
        start = time.perf_counter_ns()
        for i in range(adds):
            add(td_rows[i % pool])
        return (time.perf_counter_ns() - start) / 1e9

    def cpprb_case():
        rb = cpprb_buffer(N_ROWS)
        add = rb.add
        start = time.perf_counter_ns()
        for i in range(adds):
            add(**rows[i % pool])
        return (time.perf_counter_ns() - start) / 1e9

    def numpy_case():
        store = {k: np.empty((N_ROWS, *v.shape[1:]), v.dtype) for k, v in data.items()}
        start = time.perf_counter_ns()
        for i in range(adds):
            for k, v in rows[i % pool].items():
                store[k][i] = v
        return (time.perf_counter_ns() - start) / 1e9

    cases = {DR_RAW: dr_case(None), DR_ZSTD: dr_case("zstd"), TRL: trl_case, CPPRB: cpprb_case, NUMPY: numpy_case}
    log(f"[2/4] single-step add: {repeats} interleaved repeats x {adds:,} adds into empty 1M buffers")
    return bl.interleaved(cases, repeats, number=adds)


# ---- 3. extend 1M rows ----------------------------------------------------------------------


def zstd_encode_seconds(data: dict[str, np.ndarray], repeats: int = 3) -> float:
    """The floor of a zstd extend: encoding every chunk of ``data`` on diskreplay's I/O threads."""
    from concurrent.futures import ThreadPoolExecutor

    import numcodecs

    codec = numcodecs.Zstd(level=3)
    chunks = [v[i:i + CHUNK_ROWS] for v in data.values() for i in range(0, len(v), CHUNK_ROWS)]
    with ThreadPoolExecutor(default_io_threads(".")) as pool:
        return min(bl.timed(lambda: list(pool.map(codec.encode, chunks)))[0] for _ in range(repeats))


def checksum_seconds(data: dict[str, np.ndarray], repeats: int = 3) -> float:
    """What the chunks' CRC32C costs an extend of ``data`` (uncompressed): one checksum per chunk
    of every field, on one thread (the I/O threads compute them in parallel with the writes)."""
    from diskreplay.format.codecs import checksum

    chunks = [memoryview(np.ascontiguousarray(v[i:i + CHUNK_ROWS])).cast("B")
              for v in data.values() for i in range(0, len(v), CHUNK_ROWS)]
    return min(bl.timed(lambda: [checksum(c) for c in chunks])[0] for _ in range(repeats))


def bench_extend(data, work: str, repeats: int) -> dict[str, bl.Stats]:
    td = bl.as_tensordict(data)

    def dr_case(comp):
        def run():
            buf = dr_create(os.path.join(work, f"extend_{comp or 'raw'}"), comp)
            ext, _ = bl.timed(lambda: buf.extend(data))
            flush, _ = bl.timed(lambda: buf.flush(durable=False))
            sync, _ = bl.timed(buf.flush)  # nothing left to write: the cost of durability (fsync)
            buf.close()
            return {"total": ext + flush, "extend": ext, "flush": flush, "sync": sync}
        return run

    def trl_case():
        rb = torchrl_buffer(N_ROWS, fresh_dir(os.path.join(work, "extend_torchrl")))
        secs, _ = bl.timed(lambda: rb.extend(td))
        return secs

    def cpprb_case():
        rb = cpprb_buffer(N_ROWS)
        secs, _ = bl.timed(lambda: rb.add(**data))
        return secs

    def numpy_case():
        store = {k: np.empty_like(v) for k, v in data.items()}

        def copy():
            for k, v in data.items():
                store[k][:] = v
        secs, _ = bl.timed(copy)
        return secs

    cases = {DR_RAW: dr_case(None), DR_ZSTD: dr_case("zstd"), TRL: trl_case, CPPRB: cpprb_case, NUMPY: numpy_case}
    log(f"[3/4] extend of {N_ROWS:,} rows: {repeats} interleaved repeats")
    return bl.interleaved(cases, repeats)


# ---- 4. big buffer, bounded memory ------------------------------------------------------------


def big_buffer(work: str, rows: int) -> tuple[str, float | None]:
    """Path of an uncompressed ``rows``-row buffer under ``work``; written (in a child) if missing."""
    path = os.path.join(work, f"big_{rows}")
    if os.path.exists(os.path.join(path, "zarr.json")):
        try:
            with dr.ReplayBuffer.open(path, "r", cache_bytes=0) as buf:
                if len(buf) == rows and buf.fields == FIELDS:
                    log(f"[4/4] reusing {path} ({rows:,} rows)")
                    return path, None
        except dr.DiskReplayError as exc:
            log(f"[4/4] {path} is unusable ({exc}); rewriting it")
    bl.require_free_space(work, rows * ROW_BYTES)
    log(f"[4/4] writing {rows:,} rows ({bl.format_bytes(rows * ROW_BYTES)}) to {path} in a subprocess")
    res = bl.run_child([sys.executable, __file__, "--child-write", path, str(rows)])
    if res.returncode:
        raise SystemExit(f"writer subprocess failed ({res.returncode}):\n{res.stdout}")
    return path, res.wall


def warm_page_cache(path: str) -> float:
    """Read every file under ``path`` once so the data sits in the OS page cache. Returns seconds."""
    buf = bytearray(8 * bl.MiB)
    view = memoryview(buf)
    start = time.perf_counter()
    for root, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while f.readinto(view):
                    pass
    return time.perf_counter() - start


def bench_memory(work: str, rows: int, batches: int, cache_mib: int, seconds: float | None) -> dict[str, Any]:
    path, write_s = big_buffer(work, rows)
    warm_s = warm_page_cache(path)
    log(f"[4/4] page cache warmed in {warm_s:.1f} s; sampling {batches:,} batches in a fresh subprocess")
    res = bl.run_child([sys.executable, __file__, "--child-sample", path, str(batches), str(cache_mib),
                        str(seconds or 0)])
    if res.returncode:
        raise RuntimeError(f"sampler subprocess failed (exit {res.returncode}): {res.stderr.strip()[-500:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out.update(rows=rows, asked=batches, cache_mib=cache_mib, peak_rss_polled=res.peak_rss,
               write_s=write_s, path=path)
    return out


def child_write(path: str, rows: int) -> None:
    piece = 1_000_000
    buf = dr.ReplayBuffer.create(path, FIELDS, capacity=rows, chunk_rows=CHUNK_ROWS, compression=None,
                                 overwrite=True, seed=0)
    for start in range(0, rows, piece):
        n = min(piece, rows - start)
        buf.extend(make_data(n, seed=start))
    buf.close()


def child_sample(path: str, batches: int, cache_mib: int, seconds: float) -> None:
    """Subprocess: open read-only with a bounded cache, sample, print one JSON line of results."""
    rss_start = bl.self_rss()
    buf = dr.ReplayBuffer.open(path, "r", cache_bytes=cache_mib * bl.MiB)
    rss_open = bl.self_rss()
    block = max(1, batches // 10)
    times = np.zeros(batches)
    done = 0
    start_all = time.perf_counter_ns()
    deadline = start_all + seconds * 1e9 if seconds else None
    while done < batches:
        start = time.perf_counter_ns()
        buf.sample(BATCH)
        now = time.perf_counter_ns()
        times[done] = (now - start) / 1e9
        done += 1
        if done % block == 0:
            log(f"      {done:,}/{batches:,} batches, {(now - start_all) / 1e9:.0f} s, "
                f"RSS {bl.format_bytes(bl.self_rss())}")
        if deadline is not None and now > deadline:
            log(f"      time cap of {seconds:g} s reached after {done:,} batches")
            break
    total = (time.perf_counter_ns() - start_all) / 1e9
    times = times[:done]
    print(json.dumps({
        "batches": done, "mean_s": total / done, "first_s": float(times[0]),
        "median_s": float(np.median(times)), "steady_mean_s": float(times[min(done - 1, 10):].mean()),
        "rss_after_imports": rss_start, "rss_after_open": rss_open, "rss_end": bl.self_rss(),
        "peak_rss_self": bl.self_peak_rss(), "cache_slots": buf.stats().cache_slots,
        "private_end": bl.self_status()["RssAnon"], "file_backed_end": bl.self_status()["RssFile"],
        "chunks": -(-len(buf) // CHUNK_ROWS)}))
    buf.close()


# ---- report ---------------------------------------------------------------------------------


def build_report(args, sample, add, extend, compress_s, checksum_s, mem, adds: int) -> str:
    table = bl.Table(COLUMNS)
    table.add("uniform sample(256), per batch", {c: sample[c].median for c in COLUMNS}, baseline=NUMPY)
    table.add("single-step add, per add", {c: add[c].median for c in add}, baseline=CPPRB)
    table.add(f"flush after {adds:,} adds (durable)",
              {c: add[c].phases["flush"].median for c in (DR_RAW, DR_ZSTD)})
    table.add(f"extend {N_ROWS:,} rows (+ flush, not fsynced, for diskreplay)",
              {c: extend[c].median for c in extend}, unit="s", baseline=TRL)
    table.add("… of which extend", {c: extend[c].phases["extend"].median for c in (DR_RAW, DR_ZSTD)}, unit="s")
    table.add("… of which flush", {c: extend[c].phases["flush"].median for c in (DR_RAW, DR_ZSTD)}, unit="s")
    table.add("then making it durable (fsync)", {c: extend[c].phases["sync"].median for c in (DR_RAW, DR_ZSTD)},
              unit="s")
    table.add("CRC32C of every chunk written (in the extend above, one thread)", {DR_RAW: checksum_s}, unit="s")
    if mem and "error" in mem:
        table.add("big-buffer memory test", {DR_RAW_R: "failed, see notes"}, kind="text")
    elif mem:
        label = f"{mem['rows'] / 1e6:g}M rows, cache {mem['cache_mib']} MiB, {mem['batches']:,} batches"
        table.add(f"{label}: sample(256) per batch", {DR_RAW_R: mem["mean_s"]})
        table.add(f"{label}: private memory (RssAnon) at the end", {DR_RAW_R: mem["private_end"]}, kind="bytes")
        table.add(f"{label}: file-backed pages (RssFile: page cache) at the end", {DR_RAW_R: mem["file_backed_end"]},
                  kind="bytes")
        table.add(f"{label}: peak RSS (both)", {DR_RAW_R: mem["peak_rss_self"]}, kind="bytes")

    s_raw = max(sample[DR_RAW].median, sample[DR_RAW_R].median)
    s_raw_who = DR_RAW if sample[DR_RAW].median >= sample[DR_RAW_R].median else DR_RAW_R
    a_dr = max(add[DR_RAW].median, add[DR_ZSTD].median)
    e_raw, e_zstd, e_trl = extend[DR_RAW].median, extend[DR_ZSTD].median, extend[TRL].median
    us = lambda s: bl.format_seconds(s, "us")  # noqa: E731
    targets = [
        bl.Target("sample(256): diskreplay uncompressed no slower than cpprb",
                  f"{us(s_raw)} ({s_raw_who}) vs {us(sample[CPPRB].median)}: "
                  f"{bl.format_ratio(s_raw / sample[CPPRB].median)}", s_raw <= sample[CPPRB].median),
        bl.Target("sample(256): at least 2× faster than TorchRL memmap",
                  f"{bl.format_ratio(sample[TRL].median / s_raw)} faster", sample[TRL].median >= 2 * s_raw),
        bl.Target("sample(256): within 1.5× of the numpy floor",
                  f"{bl.format_ratio(s_raw / sample[NUMPY].median)} of numpy", s_raw <= 1.5 * sample[NUMPY].median),
        bl.Target("warm sample(256) ≤ 1.3× numpy floor (diskreplay raw reader)",
                  f"{us(sample[DR_RAW_R].median)} vs {us(sample[NUMPY].median)}: "
                  f"{bl.format_ratio(sample[DR_RAW_R].median / sample[NUMPY].median)}",
                  sample[DR_RAW_R].median <= 1.3 * sample[NUMPY].median),
        bl.Target("single-step add within 2× of cpprb (slower of raw/zstd)",
                  f"{us(a_dr)} vs {us(add[CPPRB].median)}: {bl.format_ratio(a_dr / add[CPPRB].median)}",
                  a_dr <= 2 * add[CPPRB].median),
        bl.Target("extend 1M rows + flush at least as fast as TorchRL extend into memmap "
                  "(uncompressed, as TorchRL stores them)",
                  f"{bl.format_seconds(e_raw, 's')} vs {bl.format_seconds(e_trl, 's')}: "
                  f"{bl.format_ratio(e_raw / e_trl)}", e_raw <= e_trl),
        bl.Target("… the same with zstd (not a target: compression alone costs "
                  f"{bl.format_seconds(compress_s, 's')} here on {default_io_threads('.')} threads)",
                  f"{bl.format_seconds(e_zstd, 's')}: {bl.format_ratio(e_zstd / e_trl)} of TorchRL", None),
    ]
    memory_target = "20M-row buffer, 10,000 batches, cache_bytes=256 MiB: private memory ≤ cache_bytes + 150 MB"
    if mem and "error" in mem:
        targets.append(bl.Target(memory_target, f"test failed: {mem['error'][:200]}", None))
    elif mem:
        spec = mem["rows"] >= 20_000_000 and mem["batches"] >= 10_000 and mem["cache_mib"] == 256
        limit = mem["cache_mib"] * bl.MiB + PRIVATE_SLACK
        targets.append(bl.Target(
            memory_target + ("" if spec else f" (**reduced run: {mem['rows']:,} rows, {mem['batches']:,} batches"
                             f"{' (time cap)' if mem['batches'] < mem['asked'] else ''}**)"),
            f"{bl.format_bytes(mem['private_end'])} private (limit {bl.format_bytes(limit)}); "
            f"{bl.format_bytes(mem['file_backed_end'])} file-backed", mem["private_end"] <= limit))
    else:
        targets.append(bl.Target(memory_target, "skipped (--skip-memory)", None))

    def spread(stats):
        name = max(stats, key=lambda c: stats[c].spread)
        return f"{stats[name].spread:.0%} ({name})"
    notes = [
        f"- sampling: median of {args.repeats} interleaved repeats x {args.batches:,} batches; batch {BATCH}, "
        f"{N_ROWS:,} rows, index generation included everywhere. diskreplay writers sample from the process "
        "that wrote the data; readers are fresh `ReplayBuffer.open(path, 'r')` in the same process; all warmed "
        f"({WARM_BATCHES} untimed batches each). TorchRL: `TensorDictReplayBuffer(LazyMemmapStorage)`, "
        "default RandomSampler, `rb.sample()`. numpy (the floor): `rng.integers` + `np.take(v, idx, axis=0)` per "
        "field over in-RAM arrays.",
        f"- add: median of {args.add_repeats} interleaved repeats x {adds:,} adds into a fresh 1M-capacity "
        "buffer; per-step inputs prebuilt in each library's native form (numpy rows; TensorDict rows for "
        "TorchRL). diskreplay adds are not durable until `flush()`, timed separately (fsync included). "
        "numpy column: row assignment into preallocated arrays.",
        f"- extend: median of {args.extend_repeats} interleaved repeats into fresh buffers; diskreplay includes "
        "`flush(durable=False)` (every row written and committed, not fsynced), like TorchRL/cpprb/numpy, "
        "which never sync; the fsync of a durable `flush()` is its own row. Baseline for this row is TorchRL.",
        f"- noise, worst (max−min)/median of the repeats: sample {spread(sample)}, add {spread(add)}, "
        f"extend {spread(extend)}. Medians are reported; ratios are more stable than absolute times here.",
    ]
    if mem and "error" not in mem:
        notes.append(
            f"- memory: `{mem['path']}` ({mem['rows']:,} rows, raw, chunk_rows {CHUNK_ROWS}, "
            f"{mem['chunks']:,} chunks; cache {mem['cache_slots']} chunk slots), opened read-only in a fresh "
            f"subprocess; page cache warmed first. RSS after imports {bl.format_bytes(mem['rss_after_imports'])}, "
            f"after open {bl.format_bytes(mem['rss_after_open'])}, at end {bl.format_bytes(mem['rss_end'])}; "
            f"peak (child's own VmHWM at exit) {bl.format_bytes(mem['peak_rss_self'])}, (polled by the parent) "
            f"{bl.format_bytes(mem['peak_rss_polled'])}; of it at the end {bl.format_bytes(mem['private_end'])} "
            f"private and {bl.format_bytes(mem['file_backed_end'])} file-backed: pages of the read-only chunk maps, "
            "the OS page cache (shared with every reader of the files, reclaimed under memory pressure). "
            f"Per batch: mean {bl.format_seconds(mem['mean_s'])}, median {bl.format_seconds(mem['median_s'])}, "
            f"first {bl.format_seconds(mem['first_s'])} (cold cache)."
            + (f" Buffer written in {mem['write_s']:.1f} s." if mem["write_s"] else ""))
    return "\n\n".join([table.render(), "## Targets (issue #2)", bl.render_targets(targets), "\n".join(notes)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/diskreplay-bench", help="work directory on the local disk to test")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--quick", action="store_true", help="fewer repeats, 2M-row memory test (~1-2 minutes)")
    p.add_argument("--repeats", type=int, help="sampling repeats (default 7; quick 5)")
    p.add_argument("--batches", type=int, help="batches per sampling repeat (default 2000; quick 500)")
    p.add_argument("--adds", type=int, help="single-step adds per repeat (default 50,000; quick 10,000)")
    p.add_argument("--add-repeats", type=int, help="add repeats (default 5; quick 3)")
    p.add_argument("--extend-repeats", type=int, help="extend repeats (default 3; quick 2)")
    p.add_argument("--mem-rows", type=int, help="rows of the memory-test buffer (default 20M; quick 2M)")
    p.add_argument("--mem-batches", type=int, help="batches in the memory test (default 10,000; quick 1,000)")
    p.add_argument("--mem-seconds", type=float, help="stop the memory test's sampling after this many "
                   "seconds (reported as a reduced run); default 360 (quick 120); 0 = no limit")
    p.add_argument("--cache-mib", type=int, default=256, help="cache_bytes of the memory test, MiB")
    p.add_argument("--skip-memory", action="store_true", help="skip the big-buffer memory test")
    p.add_argument("--child-write", nargs=2, metavar=("PATH", "ROWS"), help=argparse.SUPPRESS)
    p.add_argument("--child-sample", nargs=4, metavar=("PATH", "BATCHES", "MIB", "SECONDS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_write:
        return child_write(args.child_write[0], int(args.child_write[1]))
    if args.child_sample:
        return child_sample(args.child_sample[0], int(args.child_sample[1]), int(args.child_sample[2]),
                            float(args.child_sample[3]))

    q = args.quick
    args.repeats = args.repeats or (5 if q else 7)
    args.batches = args.batches or (500 if q else 2000)
    args.adds = args.adds or (10_000 if q else 50_000)
    args.add_repeats = args.add_repeats or (3 if q else 5)
    args.extend_repeats = args.extend_repeats or (2 if q else 3)
    args.mem_rows = args.mem_rows or (2_000_000 if q else 20_000_000)
    args.mem_batches = args.mem_batches or (1_000 if q else 10_000)
    if args.mem_seconds is None:
        args.mem_seconds = 120.0 if q else 360.0

    os.makedirs(args.dir, exist_ok=True)
    work = os.path.join(args.dir, "core")
    os.makedirs(work, exist_ok=True)
    # working set of sections 1-3: ~4 diskreplay copies + TorchRL memmap of 1M rows
    bl.require_free_space(args.dir, 6 * N_ROWS * ROW_BYTES)
    bl.import_torchrl()
    import torch
    header = bl.report_header("diskreplay core benchmark", q, PACKAGES, args.dir, [
        f"torch intra-op threads: {torch.get_num_threads()} (default; TorchRL runs with it)",
        f"settings: sampling {args.repeats}x{args.batches} batches, add {args.add_repeats}x{args.adds}, "
        f"extend x{args.extend_repeats}, memory test {args.mem_rows:,} rows / {args.mem_batches:,} batches "
        f"(time cap {args.mem_seconds:g} s)"])
    print(header + "\n", flush=True)
    started = time.perf_counter()

    data = make_data(N_ROWS, seed=0)
    def summary(stats, unit):
        log("      " + ", ".join(f"{c}: {bl.format_seconds(v.median, unit)}" for c, v in stats.items()))
    sample = bench_sample(data, work, args.repeats, args.batches)
    summary(sample, "us")
    add = bench_add(data, work, args.add_repeats, args.adds)
    summary(add, "us")
    extend = bench_extend(data, work, args.extend_repeats)
    summary(extend, "s")
    compress_s = zstd_encode_seconds(data)
    checksum_s = checksum_seconds(data)
    del data
    shutil.rmtree(work, ignore_errors=True)
    mem = None
    if not args.skip_memory:
        try:
            mem = bench_memory(args.dir, args.mem_rows, args.mem_batches, args.cache_mib, args.mem_seconds)
        except (RuntimeError, OSError, SystemExit) as exc:
            log(f"[4/4] memory test failed: {exc}")
            mem = {"error": str(exc)}

    bl.publish_report(header, build_report(args, sample, add, extend, compress_s, checksum_s, mem, args.adds),
                      args.out, started)


if __name__ == "__main__":
    main()
