"""Sharded buffers benchmark: writer scaling, the learner's union, and a Queue-fed numpy baseline.

Workload: a MuJoCo-like transition, six fields — obs (17,) f32, action (6,) f32, reward f32,
next_obs (17,) f32, terminated bool, truncated bool (166 B per row) — episodes of 1,000 steps.

1. Writer scaling. A sharded buffer of W shards (W = ``--writers``, default 1,2,4); W writer
   processes (multiprocessing, spawn), each ``open_shard`` on its own shard, wait at a barrier,
   then write ``--rows`` rows: ``add`` one step at a time (the actor pattern), ``flush()``
   (durable, the default) every ``--flush-every`` steps, one more ``flush()`` at the end; and
   the same with ``extend`` of 256-row batches (``--extend-rows`` rows per writer; on S3
   ``--s3-rows`` for both, as moto's flushes bound it). The worker processes are started once
   and reused (their start-up and each ``open_shard`` are outside the timing). Wall time
   runs from the earliest writer leaving the barrier to the last writer's final flush; rows/s in
   total and per writer, and the total's ratio to one writer. On local disk and on S3 (moto's
   server in a child process on 127.0.0.1; one Python process, so its CPU is shared with the
   writers and caps them). The library defaults otherwise (zstd, ``chunk_rows`` by row size).
2. The learner's union. For each total size (``--sizes``), the same rows as one shard and as
   16 shards (``create(..., shards=16)``, each shard ``num_envs=1`` and a 16th of the rows), raw
   (``compression=None``: the learner reads memory-mapped files or, where the rows fit
   ``cache_bytes``, its chunk cache), filled to capacity; plus, as controls, the one shard's
   folder opened as a plain buffer (no union) and one plain buffer with ``num_envs=16`` (16 lanes,
   no shards). ``sample(256)`` with Uniform and with Prioritized (every row at the max priority),
   timed interleaved across the buffers, after warm-up (page cache and chunk cache warm); the
   ratio of 16 shards to 1 shard (target: at most 1.5x). Then the memory of a fresh learner
   process per buffer after ``--memory-batches`` samples: private (RssAnon; USS from psutil)
   and file-backed (RssFile: mapped page cache, shared and reclaimable) separately.
3. Live: 4 actor processes inserting as fast as they can while the learner (this process)
   samples for ``--live-seconds``. diskreplay: 4 shards, actors ``add`` per step and flush
   every ``--flush-every`` steps, the learner ``sample(256)`` and ``refresh()`` every
   ``--refresh-every`` samples (one contestant per period, default 10 and 100); and actors that
   gather ``--flush-every`` steps into arrays and ``extend`` them at once. Baseline: a
   ``multiprocessing.Queue`` feeding a numpy ring in the learner (which drains the queue, at
   most ``--drain-max`` rows at a time, then samples 256 rows uniformly), the actors putting
   one step per ``put``, and putting a batch of ``--flush-every`` steps per ``put``. Reported:
   the learner's samples/s, the rows/s it actually took in (diskreplay: rows committed and
   adopted by ``refresh``), and its samples/s alone once the actors stopped. TorchRL's
   RayReplayBuffer (actors as Ray tasks, ``extend`` of ``--flush-every`` rows per call) joins
   when ray imports (not with ``--quick`` unless ``--ray``; ``--no-ray`` leaves it out).

4. What a learner's refresh costs. For S = ``--refresh-shards`` (default 4,16,64) shards, k of
   them (0, 2 and all S) commit ``--refresh-rows`` rows each, then the learner refreshes; the
   store operations of that refresh are counted (local disk: reads of the local store and
   listings of the commit index; S3: requests at the proxy of tests/s3server.py, in front of
   moto with ``--latency-ms`` per request, default 20), median over ``--refresh-rounds`` rounds,
   with the refresh's wall time. Both for a root with the commit index (buffers made now) and
   one without (buffers made before it: every shard's commit is read).

Usage: python tools/bench_shards.py [--quick] [--sizes 1M,16M] [--dir /tmp/diskreplay-shards] [--out FILE]
       [--only 1,2,3,4] [--[no-]ray] [--profile]
Built union buffers (section 2) are kept in ``--dir`` and reused by the next run (``--rebuild``
to write them anew).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing as mp
import os
import pstats
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import benchlib as bl  # noqa: E402

import diskreplay as dr  # noqa: E402

FIELDS = {"obs": dr.Field((17,), "float32"), "action": dr.Field((6,), "float32"),
          "reward": dr.Field((), "float32"), "next_obs": dr.Field((17,), "float32"),
          "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
ROW_BYTES = sum(f.row_bytes for f in FIELDS.values())
EPISODE = 1000
BATCH = 256
EXTEND_BATCH = 256
POOL = 1024  # distinct steps an actor cycles through (its "environment" costs nothing)
BUCKET = "bench"
UNION_SHARDS = 16
LIVE_ACTORS = 4
PACKAGES = ["diskreplay", "numpy", "zarr", "numcodecs", "fsspec", "s3fs", "moto", "psutil", "torch", "torchrl",
            "ray"]
PLAIN, ONE, MANY, LANES = "plain buffer (the shard's folder)", "1 shard", f"{UNION_SHARDS} shards", \
    f"plain, num_envs={UNION_SHARDS}"
log = bl.log


def now() -> float:
    """Seconds on CLOCK_MONOTONIC: one clock for every process of this host."""
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# ---- rows -----------------------------------------------------------------------------------


def columns(n: int, seed: int, first_step: int = 0) -> dict[str, np.ndarray]:
    """``n`` rows as arrays; episodes of `EPISODE` steps counted from ``first_step``."""
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((n + 1, 17), dtype=np.float32)
    t = np.arange(first_step, first_step + n)
    return {"obs": obs[:-1], "action": rng.uniform(-1, 1, (n, 6)).astype(np.float32),
            "reward": rng.standard_normal(n, dtype=np.float32), "next_obs": obs[1:],
            "terminated": t % EPISODE == EPISODE - 1, "truncated": np.zeros(n, bool)}


def steps(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` single steps as an env loop hands them over: arrays for obs/action, Python scalars
    for reward and the flags."""
    cols = columns(n, seed)
    return [{"obs": cols["obs"][i], "action": cols["action"][i], "reward": float(cols["reward"][i]),
             "next_obs": cols["next_obs"][i], "terminated": bool(cols["terminated"][i]), "truncated": False}
            for i in range(n)]


def batches(n_batches: int, seed: int) -> list[dict[str, np.ndarray]]:
    cols = columns(n_batches * EXTEND_BATCH, seed)
    return [{k: np.ascontiguousarray(v[b * EXTEND_BATCH:(b + 1) * EXTEND_BATCH]) for k, v in cols.items()}
            for b in range(n_batches)]


# ---- S3 server ------------------------------------------------------------------------------

SERVER_CODE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from s3server import MotoS3
s3 = MotoS3(sys.argv[2])
print(json.dumps({"endpoint": s3.endpoint}), flush=True)
sys.stdin.read()  # serve until the parent closes our stdin
"""


def start_s3() -> tuple[subprocess.Popen, dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(ROOT / "tests"), BUCKET],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the moto server did not start (is moto[server] installed?)")
    return proc, {"endpoint_url": json.loads(line)["endpoint"], "key": "bench", "secret": "bench"}


# ---- 1. writer scaling ----------------------------------------------------------------------


class Workers:
    """Worker processes (spawn) started once and given jobs: a writer of section 1, an actor of
    section 3. What they synchronize on (barriers, a stop event, the baseline's queues) is
    handed over at start, as multiprocessing requires; imports and start-up are paid once."""

    def __init__(self, count: int, writer_counts: list[int], queue_rows: int, batch_rows: int):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.stop = ctx.Event()
        shared = {"barriers": {w: ctx.Barrier(w) for w in sorted(set(writer_counts) | {LIVE_ACTORS})},
                  "stop": self.stop, "q_step": ctx.Queue(maxsize=queue_rows),
                  "q_batch": ctx.Queue(maxsize=max(8, queue_rows // batch_rows))}
        self.q_step, self.q_batch = shared["q_step"], shared["q_batch"]
        self.inboxes = [ctx.Queue() for _ in range(count)]
        self.procs = [ctx.Process(target=worker_loop, args=(i, self.inboxes[i], self.results, shared), daemon=True)
                      for i in range(count)]
        started = time.perf_counter()
        for p in self.procs:
            p.start()
        self.call(list(range(count)), [("ping", {})] * count)
        log(f"  {count} worker processes ready in {time.perf_counter() - started:.1f} s")

    def submit(self, who: list[int], jobs: list[tuple[str, dict[str, Any]]]) -> None:
        for i, job in zip(who, jobs):
            self.inboxes[i].put(job)

    def collect(self, n: int, timeout: float = 600, on_wait: Callable[[], None] | None = None) -> list[Any]:
        got, deadline = [], time.perf_counter() + timeout
        while len(got) < n:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"workers: {len(got)} of {n} results after {timeout:g} s")
            if on_wait:
                on_wait()
            try:
                got.append(self.results.get(timeout=0.05 if on_wait else 1.0))
            except queue.Empty:
                continue
        errors = [g["error"] for g in got if isinstance(g, dict) and "error" in g]
        if errors:
            raise RuntimeError(f"a worker failed: {errors[0]}")
        return got

    def call(self, who: list[int], jobs: list[tuple[str, dict[str, Any]]], timeout: float = 600) -> list[Any]:
        self.submit(who, jobs)
        return self.collect(len(jobs), timeout)

    def close(self) -> None:
        self.stop.set()
        for box in self.inboxes:
            box.put(None)
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.terminate()


def worker_loop(index: int, inbox: Any, results: Any, shared: dict[str, Any]) -> None:
    jobs = {"ping": lambda **kw: "pong", "write": writer_job, "dr_actor": dr_actor, "queue_actor": queue_actor}
    while (job := inbox.get()) is not None:
        name, kwargs = job
        try:
            results.put(jobs[name](shared=shared, **kwargs) if name != "ping" else "pong")
        except BaseException as exc:  # the parent reports it
            results.put({"error": f"worker {index}, {name}: {type(exc).__name__}: {exc}"})


def writer_job(url: str, storage_options: dict | None, shard: int, mode: str, rows: int, flush_every: int,
               writers: int, shared: dict[str, Any]) -> dict[str, Any]:
    """A writer: open its shard, wait at the barrier, write, report its times."""
    started = now()
    buf = dr.ReplayBuffer.open_shard(url, shard=shard, storage_options=storage_options)
    pool = steps(POOL, seed=shard) if mode == "add" else batches(POOL // EXTEND_BATCH, seed=shard)
    ready = now() - started
    shared["barriers"][writers].wait(timeout=300)
    t0 = now()
    flushes = 0
    if mode == "add":
        for i in range(rows):
            buf.add(**pool[i % POOL])
            if (i + 1) % flush_every == 0:
                buf.flush()
                flushes += 1
    else:
        done = 0
        for b in range(-(-rows // EXTEND_BATCH)):
            batch = pool[b % len(pool)]
            n = min(EXTEND_BATCH, rows - done)
            buf.extend(batch if n == EXTEND_BATCH else {k: v[:n] for k, v in batch.items()})
            if (done + n) // flush_every > done // flush_every:
                buf.flush()
                flushes += 1
            done += n
    buf.flush()
    t1 = now()
    buf.close()
    return {"shard": shard, "t0": t0, "t1": t1, "ready": ready, "flushes": flushes + 1}


def run_writers(workers: Workers, url: str, so: dict | None, writers: int, mode: str, rows: int,
                flush_every: int) -> dict[str, Any]:
    """One scaling run: create a buffer of ``writers`` shards, run the writers, check the rows."""
    dr.ReplayBuffer.create(url, FIELDS, capacity=rows, shards=writers, storage_options=so, overwrite=True).close()
    job = {"url": url, "storage_options": so, "mode": mode, "rows": rows, "flush_every": flush_every,
           "writers": writers}
    got = workers.call(list(range(writers)), [("write", {**job, "shard": s}) for s in range(writers)])
    with dr.ReplayBuffer.open(url, "r", storage_options=so) as union:
        held = len(union)
    if held != writers * rows:
        raise RuntimeError(f"{url}: the union holds {held:,} rows, expected {writers * rows:,}")
    wall = max(g["t1"] for g in got) - min(g["t0"] for g in got)
    per = [rows / (g["t1"] - g["t0"]) for g in got]
    return {"wall": wall, "total": writers * rows / wall, "per_writer": statistics.median(per),
            "slowest": min(per), "ready": max(g["ready"] for g in got),
            "skew": max(g["t0"] for g in got) - min(g["t0"] for g in got)}


def rows_per_writer(args: argparse.Namespace, so: dict | None, mode: str) -> int:
    """Local disk: ``--rows`` (add) / ``--extend-rows``; S3: ``--s3-rows`` (flushes bound it)."""
    return args.s3_rows if so is not None else args.rows if mode == "add" else args.extend_rows


def bench_scaling(workers: Workers, args: argparse.Namespace, backends: dict[str, tuple[str, dict | None]]) -> dict:
    """``{(backend, mode, writers): [result per repeat]}``, writer counts rotated per repeat."""
    out: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    counts = args.writers
    for r in range(args.repeats):
        for mode in ("add", "extend"):
            for backend, (root, so) in backends.items():
                order = counts[r % len(counts):] + counts[:r % len(counts)]
                for w in order:
                    url = f"{root}/scale-{mode}-w{w}-{uuid.uuid4().hex[:8]}"
                    res = run_writers(workers, url, so, w, mode, rows_per_writer(args, so, mode), args.flush_every)
                    log(f"  [{r + 1}/{args.repeats}] {backend} {mode} x{w}: {res['total']:,.0f} rows/s total, "
                        f"{res['per_writer']:,.0f} per writer (wall {res['wall']:.2f} s, start skew "
                        f"{res['skew'] * 1e3:.0f} ms, setup {res['ready']:.1f} s)")
                    out.setdefault((backend, mode, w), []).append(res)
                    if so is None:
                        shutil.rmtree(url, ignore_errors=True)
    return out


def scaling_report(res: dict, args: argparse.Namespace, backends: dict[str, tuple[str, dict | None]]) -> str:
    counts = args.writers
    head = [f"{w} writer{'s' if w > 1 else ''}" for w in counts]
    table = bl.Table(head, corner="rows/s (ratio: total vs 1 writer)")

    def med(key: tuple, field: str) -> float:
        return statistics.median(r[field] for r in res[key])

    for backend in backends:
        for mode in ("add", "extend"):
            rows = rows_per_writer(args, backends[backend][1], mode)
            what = (f"add (1 step), flush every {args.flush_every:,}" if mode == "add"
                    else f"extend ({EXTEND_BATCH} rows), flush every ~{args.flush_every:,}")
            one = 1 if 1 in counts else counts[0]
            base = med((backend, mode, one), "total") / one  # rows/s of one writer
            cells, per = {}, {}
            for w, col in zip(counts, head):
                total = med((backend, mode, w), "total")
                cells[col] = f"{total:,.0f} ({total / base:.2f}×)"
                per[col] = (f"{med((backend, mode, w), 'per_writer'):,.0f} "
                            f"(slowest {med((backend, mode, w), 'slowest'):,.0f})")
            table.add(f"{backend}: {what}, {bl.format_count(rows)} rows/writer — total", cells, kind="text")
            table.add(f"{backend}: {mode} — per writer (median)", per, kind="text")
    return table.render()


SCALING_NOTE = ("Ratios: the total over one writer's. On {cores} cores, 2 writers can at best double it and 4 "
                "add nothing more (their overhead shows as a ratio below the 2-writer one). Flushes are durable "
                "(fsync on local disk). S3 is moto, one Python process on the same cores: its CPU per request "
                "caps every writer's flushes together, unlike S3.")


def scaling_targets(res: dict, args: argparse.Namespace, backends: list[str]) -> list[bl.Target]:
    out = []
    if not {1, 2, 4} <= set(args.writers):
        return out
    cores = len(os.sched_getaffinity(0))
    for backend in backends:
        for mode in ("add", "extend"):
            t = {w: statistics.median(r["total"] for r in res[(backend, mode, w)]) for w in (1, 2, 4)}
            out.append(bl.Target(f"{backend} {mode}: 2 writers vs 1 (ideal {min(2, cores)}× on {cores} cores); "
                                 f"4 vs 2 (ideal {min(4, cores) / min(2, cores):.0f}×)",
                                 f"{t[2] / t[1]:.2f}×; {t[4] / t[2]:.2f}×", None))
    return out


# ---- 2. the learner's union -----------------------------------------------------------------


def fill_shard(path: str, rows: int, lanes: int, seed: int) -> None:
    """Fill the buffer at ``path`` (a shard's folder or a plain buffer) to ``rows`` rows."""
    buf = dr.ReplayBuffer.open(path, "r+")
    block = 1 << 16
    per_lane = rows // lanes
    step_block = max(1, block // lanes)
    base = columns(step_block * lanes, seed)
    for first in range(0, per_lane, step_block):
        n = min(step_block, per_lane - first)
        cols = {k: v[:n * lanes] for k, v in base.items()}
        if lanes > 1:
            cols = {k: v.reshape(n, lanes, *v.shape[1:]) for k, v in cols.items()}
        t = np.arange(first, first + n)
        end = np.broadcast_to((t % EPISODE == EPISODE - 1)[:, None] if lanes > 1 else t % EPISODE == EPISODE - 1,
                              cols["terminated"].shape)
        cols["terminated"] = np.ascontiguousarray(end)
        buf.extend(cols)
    buf.close()


def union_paths(root: str, total: int) -> dict[str, str]:
    size = bl.format_count(total)
    return {ONE: f"{root}/one-{size}", MANY: f"{root}/sharded{UNION_SHARDS}-{size}", LANES: f"{root}/lanes-{size}"}


def existing(path: str, total: int, shards: int | None) -> bool:
    """Whether ``path`` holds the buffer `build_unions` would write (a plain one: prioritized)."""
    try:
        with dr.ReplayBuffer.open(path, "r") as buf:
            return len(buf) == total and (buf.shards == shards if shards is not None
                                          else isinstance(buf.sampler, dr.Prioritized))
    except Exception:
        return False


def build_unions(root: str, total: int, chunk_rows: int | None, rebuild: bool, lanes_control: bool) -> dict:
    """The buffers of section 2 (reused when present); returns ``{name: (path, seconds to build or None)}``.
    Every buffer is created, then filled by a pool of processes (one per CPU), a shard or plain buffer
    per task (the one-shard and ``num_envs=16`` buffers are one task each)."""
    paths = union_paths(root, total)
    out: dict[str, tuple[str, float | None]] = {}
    specs = [(ONE, 1, 1), (MANY, UNION_SHARDS, 1)] + ([(LANES, None, UNION_SHARDS)] if lanes_control else [])
    tasks: list[tuple[str, int, int, int]] = []
    for name, shards, lanes in specs:
        path = paths[name]
        if not rebuild and existing(path, total, shards):
            out[name] = (path, None)
            continue
        log(f"  building {name}, {bl.format_count(total)} rows at {path}")
        if shards is None:
            dr.ReplayBuffer.create(path, FIELDS, capacity=total, num_envs=lanes, chunk_rows=chunk_rows,
                                   compression=None, sampler=dr.Prioritized(), overwrite=True).close()
            tasks.append((path, total, lanes, 0))
        else:
            dr.ReplayBuffer.create(path, FIELDS, capacity=total // shards, shards=shards, chunk_rows=chunk_rows,
                                   compression=None, overwrite=True).close()
            tasks += [(f"{path}/shard-{s:05d}", total // shards, 1, s) for s in range(shards)]
    if tasks:
        start = time.perf_counter()
        tasks.sort(key=lambda t: -t[1])  # the big ones first
        with ProcessPoolExecutor(len(os.sched_getaffinity(0)), mp_context=mp.get_context("spawn")) as pool:
            list(pool.map(fill_shard, *zip(*tasks)))
        seconds = time.perf_counter() - start
        for name, _, _ in specs:
            out.setdefault(name, (paths[name], seconds))
    out[PLAIN] = (f"{paths[ONE]}/shard-00000", None)
    return out


def make_sampler(name: str) -> dr.Sampler:
    return dr.Prioritized() if name == "Prioritized" else dr.Uniform()


def open_learner(name: str, path: str, sampler: str) -> dr.ReplayBuffer:
    if name in (ONE, MANY):
        return dr.ReplayBuffer.open(path, "r", sampler=make_sampler(sampler), seed=0)
    return dr.ReplayBuffer.open(path, "r", sampler=make_sampler(sampler))


def warm_up(buf: dr.ReplayBuffer, seconds: float, min_batches: int) -> int:
    """Sample until the timings settle: at least ``min_batches``, at most ``seconds``."""
    start, n = time.perf_counter(), 0
    while n < min_batches or (time.perf_counter() - start < seconds and n < 50 * min_batches):
        buf.sample(BATCH)
        n += 1
        if n >= min_batches and time.perf_counter() - start > seconds:
            break
    return n


def child_memory(name: str, path: str, sampler: str, batches: int) -> None:
    """A fresh learner process: open, sample ``batches`` batches, print memory and timings as JSON."""
    import psutil

    before = bl.self_status()
    start = time.perf_counter()
    buf = open_learner(name, path, sampler)
    open_s = time.perf_counter() - start
    times = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        buf.sample(BATCH)
        times.append((time.perf_counter_ns() - t) / 1e9)
    status = bl.self_status()
    info = psutil.Process().memory_full_info()
    print(json.dumps({"open_s": open_s, "median_s": statistics.median(times[len(times) // 2:]),
                      "anon": status["RssAnon"], "file": status["RssFile"], "uss": info.uss, "rss": info.rss,
                      "hwm": status["VmHWM"], "anon_at_start": before["RssAnon"],
                      "chunk_rows": buf.layout.chunk_rows, "lanes": buf.num_envs, "rows": len(buf)}))
    buf.close()


def bench_union(total: int, args: argparse.Namespace) -> dict[str, Any]:
    built = build_unions(args.dir, total, args.chunk_rows, args.rebuild, args.lanes_control)
    all_names = [PLAIN, ONE, MANY] + ([LANES] if args.lanes_control else [])
    out: dict[str, Any] = {"total": total, "built": {n: built[n][1] for n in built}, "time": {}, "memory": {}}
    for sampler in ("Uniform", "Prioritized"):
        names = all_names
        log(f"  [{bl.format_count(total)}] {sampler}: sample(256), interleaved over {', '.join(names)}")
        bufs = {n: open_learner(n, built[n][0], sampler) for n in names}
        try:
            for buf in bufs.values():
                warm_up(buf, args.warm_seconds, args.warm_batches)
            number = args.sample_batches

            def run(buf: dr.ReplayBuffer, number: int = number) -> Callable[[], None]:
                return lambda: [buf.sample(BATCH) for _ in range(number)] and None

            stats = bl.interleaved({n: run(b) for n, b in bufs.items()}, args.sample_repeats, number=number,
                                   warmup=1)
            out["time"][sampler] = {n: s.median for n, s in stats.items()}
            out["spread"] = max(out.get("spread", 0.0), *(s.spread for s in stats.values()))
            if args.profile:
                out.setdefault("profile", {})[sampler] = {n: profile_samples(bufs[n], number * 2) for n in (ONE, MANY)}
            out.setdefault("layout", {}).update({n: (b.layout.chunk_rows, b.num_envs) for n, b in bufs.items()})
        finally:
            for buf in bufs.values():
                buf.close()
        for n in names if not args.quick else [ONE, MANY]:
            res = bl.run_child([sys.executable, __file__, "--child-memory", n, built[n][0], sampler,
                                str(args.memory_batches)], timeout=600)
            if res.returncode:
                raise RuntimeError(f"memory child failed ({res.returncode}): {res.stderr.strip()[-800:]}")
            out["memory"][(sampler, n)] = json.loads(res.stdout.strip().splitlines()[-1])
    log(f"    {json.dumps({k: v for k, v in out.items() if k in ('time', 'built')})}")
    return out


def profile_samples(buf: dr.ReplayBuffer, n: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        buf.sample(BATCH)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    return text.getvalue()


def union_report(results: list[dict[str, Any]], args: argparse.Namespace) -> tuple[str, list[bl.Target]]:
    names = [PLAIN, ONE, MANY] + ([LANES] if args.lanes_control else [])
    table = bl.Table(names, corner="sample(256), µs per batch")
    mem = bl.Table(names, corner="fresh learner process: private (USS) / file-backed")
    targets = []
    for r in results:
        size = bl.format_count(r["total"])
        for sampler in ("Uniform", "Prioritized"):
            t = r["time"][sampler]
            table.add(f"{size} rows, {sampler}", {n: t.get(n) for n in names}, unit="us", baseline=ONE)
            ratio = t[MANY] / t[ONE]
            targets.append(bl.Target(f"sample(256), {UNION_SHARDS} shards vs 1 shard, {size} rows, {sampler}: "
                                     f"at most 1.5×", f"{ratio:.2f}× ({bl.format_seconds(t[MANY], 'us')} vs "
                                     f"{bl.format_seconds(t[ONE], 'us')})", ratio <= 1.5))
            mem.add(f"{size} rows, {sampler}",
                    {n: f"{bl.format_bytes(m['anon'])} ({bl.format_bytes(m['uss'])}) / {bl.format_bytes(m['file'])}"
                     for n in names if (m := r["memory"].get((sampler, n)))}, kind="text")
        opened = {n: (s, r["memory"][(s, n)]) for n in names for s in ("Uniform", "Prioritized")
                  if (s, n) in r["memory"]}  # the Prioritized open where there is one
        mem.add(f"{size} rows: open in a fresh process; chunk_rows × lanes",
                {n: f"{bl.format_seconds(m['open_s'])} ({s}); {m['chunk_rows']:,} × {m['lanes']}"
                 for n, (s, m) in opened.items()}, kind="text")
    notes = (f"`{PLAIN}`: the 1-shard buffer's only shard opened by itself (no union); `{LANES}`: one "
             f"buffer of {UNION_SHARDS} lanes, no shards (the union of {UNION_SHARDS} shards has "
             f"{UNION_SHARDS} lanes too: what it costs over 1 shard, the lanes alone cost too where this column "
             "matches).\n\n"
             "Private = RssAnon (USS from psutil in brackets: private pages of any kind); file-backed = RssFile "
             "(mapped files: page cache, shared and reclaimable). Rows fitting `cache_bytes` (512 MiB) are read "
             "from the chunk cache, which the first read fills with every chunk (private memory); larger buffers "
             "are read through memory maps (file-backed).")
    return table.render() + "\n\n" + mem.render() + "\n\n" + notes, targets


# ---- 3. live: actors and a learner ----------------------------------------------------------


def dr_actor(url: str, shard: int, flush_every: int, batched: bool, shared: dict[str, Any]) -> int:
    """Write steps to shard ``shard`` until stopped, flushing every ``flush_every``: ``add`` one
    step at a time, or (``batched``) the steps gathered into arrays as they come and one ``extend``."""
    buf = dr.ReplayBuffer.open_shard(url, shard=shard)
    pool = steps(POOL, seed=100 + shard)
    stop, n, names = shared["stop"], 0, list(FIELDS)
    while not stop.is_set():
        if batched:
            block = {k: np.empty((flush_every, *FIELDS[k].shape), FIELDS[k].dtype) for k in names}
            for i in range(flush_every):
                step = pool[(n + i) % POOL]
                for k in names:
                    block[k][i] = step[k]
            buf.extend(block)
            n += flush_every
        else:
            for _ in range(flush_every):
                buf.add(**pool[n % POOL])
                n += 1
        buf.flush()
    buf.close()
    return n


def queue_actor(shard: int, per_put: int, shared: dict[str, Any]) -> int:
    """Put steps on the baseline's queue until stopped: one step per put (``per_put`` 1, a tuple)
    or ``per_put`` steps gathered into fresh arrays per put."""
    q = shared["q_step"] if per_put == 1 else shared["q_batch"]
    pool = steps(POOL, seed=100 + shard)
    stop, n, names = shared["stop"], 0, list(FIELDS)
    while not stop.is_set():
        if per_put == 1:
            item: Any = tuple(pool[n % POOL][k] for k in names)
        else:  # fresh arrays: the queue pickles them later, on its feeder thread
            item = {k: np.empty((per_put, *FIELDS[k].shape), FIELDS[k].dtype) for k in names}
            for i in range(per_put):
                step = pool[(n + i) % POOL]
                for k in names:
                    item[k][i] = step[k]
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                n += per_put
                break
            except queue.Full:
                pass
    return n


class Ring:
    """The baseline's in-RAM ring: numpy arrays, uniform sampling."""

    def __init__(self, capacity: int, seed: int = 0):
        self.cols = {k: np.zeros((capacity, *f.shape), f.dtype) for k, f in FIELDS.items()}
        self.names = list(FIELDS)
        self.capacity, self.size, self.pos, self.inserted = capacity, 0, 0, 0
        self.rng = np.random.default_rng(seed)

    def put_step(self, item: tuple) -> None:
        for k, v in zip(self.names, item):
            self.cols[k][self.pos] = v
        self.pos = (self.pos + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        self.inserted += 1

    def put_batch(self, item: dict[str, np.ndarray]) -> None:
        n = len(item["reward"])
        idx = (self.pos + np.arange(n)) % self.capacity
        for k in self.names:
            self.cols[k][idx] = item[k]
        self.pos = (self.pos + n) % self.capacity
        self.size = min(self.size + n, self.capacity)
        self.inserted += n

    def drain(self, q: Any, most: int) -> None:
        """Take what the queue holds now (at most ``most`` rows) into the ring."""
        start = self.inserted
        while self.inserted - start < most:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                self.put_step(item)
            else:
                self.put_batch(item)

    def sample(self, n: int) -> dict[str, np.ndarray]:
        idx = self.rng.integers(0, self.size, n)
        return {k: v[idx] for k, v in self.cols.items()}


def empty_queue(q: Any, quiet_s: float = 0.3) -> None:
    """Discard what is left on ``q``, until nothing arrives for ``quiet_s``."""
    while True:
        try:
            q.get(timeout=quiet_s)
        except queue.Empty:
            return


def alone_rate(sample: Callable[[], Any], seconds: float) -> float:
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        sample()
        n += 1
    return n / (time.perf_counter() - start)


def live_diskreplay(workers: Workers, args: argparse.Namespace, root: str, refresh_every: int,
                    batched: bool = False) -> dict[str, Any]:
    url = f"{root}/live-{uuid.uuid4().hex[:8]}"
    dr.ReplayBuffer.create(url, FIELDS, capacity=args.live_capacity // LIVE_ACTORS, shards=LIVE_ACTORS).close()
    workers.stop.clear()
    jobs = [("dr_actor", {"url": url, "shard": s, "flush_every": args.flush_every, "batched": batched})
            for s in range(LIVE_ACTORS)]
    workers.submit(list(range(LIVE_ACTORS)), jobs)
    buf = dr.ReplayBuffer.open(url, "r", seed=0)
    stopped = False
    try:
        deadline = time.perf_counter() + 120
        while len(buf) < args.live_min_rows:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the actors committed only {len(buf):,} rows in 120 s")
            time.sleep(0.02)
            buf.refresh()
        before = int(buf.window()[1].sum())
        samples, refresh_s = 0, 0.0
        start = time.perf_counter()
        end = start + args.live_seconds
        while True:
            buf.sample(BATCH)
            samples += 1
            if samples % refresh_every == 0:
                t = time.perf_counter()
                buf.refresh()
                refresh_s += time.perf_counter() - t
                if t > end:
                    break
        elapsed = time.perf_counter() - start
        inserted = int(buf.window()[1].sum()) - before
        workers.stop.set()
        produced = workers.collect(LIVE_ACTORS)
        stopped = True
        buf.refresh()
        alone = alone_rate(lambda: buf.sample(BATCH), args.alone_seconds)
    finally:
        if not stopped:
            workers.stop.set()
            workers.collect(LIVE_ACTORS)
        buf.close()
        shutil.rmtree(url, ignore_errors=True)
    return {"samples": samples / elapsed, "rows": inserted / elapsed, "alone": alone, "produced": sum(produced),
            "refresh_share": refresh_s / elapsed, "refresh_us": refresh_s / max(1, samples // refresh_every) * 1e6}


def live_queue(workers: Workers, args: argparse.Namespace, per_put: int) -> dict[str, Any]:
    q = workers.q_step if per_put == 1 else workers.q_batch
    workers.stop.clear()
    workers.submit(list(range(LIVE_ACTORS)),
                   [("queue_actor", {"shard": s, "per_put": per_put}) for s in range(LIVE_ACTORS)])
    ring = Ring(args.live_capacity)
    stopped = False
    try:
        deadline = time.perf_counter() + 120
        while ring.size < args.live_min_rows:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the learner took in only {ring.size:,} rows in 120 s")
            ring.drain(q, args.drain_max)
            time.sleep(0.001)
        before, samples = ring.inserted, 0
        start = time.perf_counter()
        end = start + args.live_seconds
        while time.perf_counter() < end:
            ring.drain(q, args.drain_max)
            ring.sample(BATCH)
            samples += 1
        elapsed = time.perf_counter() - start
        inserted = ring.inserted - before
        workers.stop.set()
        produced = workers.collect(LIVE_ACTORS, on_wait=lambda: ring.drain(q, 10**9))
        stopped = True
        empty_queue(q)
        alone = alone_rate(lambda: ring.sample(BATCH), args.alone_seconds)
    finally:
        if not stopped:
            workers.stop.set()
            workers.collect(LIVE_ACTORS, on_wait=lambda: ring.drain(q, 10**9))
            empty_queue(q)
    return {"samples": samples / elapsed, "rows": inserted / elapsed, "alone": alone, "produced": sum(produced)}


def ray_actor_loop(client: Any, shard: int, per_call: int, stop_file: str) -> int:
    import torch
    from tensordict import TensorDict

    cols = columns(per_call, seed=100 + shard)
    td = TensorDict({k: torch.from_numpy(v) for k, v in cols.items()}, batch_size=[per_call])
    n = 0
    while not os.path.exists(stop_file):
        client.extend(td)
        n += per_call
    return n


def live_ray(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """TorchRL's RayReplayBuffer: the buffer in a Ray actor, the actors as Ray tasks (stopped by a file)."""
    from functools import partial

    import ray
    from torchrl.data import LazyTensorStorage, RayReplayBuffer

    stop_file = os.path.join(root, f"ray-stop-{uuid.uuid4().hex[:8]}")
    started = time.perf_counter()
    ray.init(num_cpus=LIVE_ACTORS + 1, include_dashboard=False, log_to_driver=False,
             object_store_memory=256 * bl.MiB)
    rb = None
    try:
        rb = RayReplayBuffer(storage=partial(LazyTensorStorage, args.live_capacity), batch_size=BATCH,
                             remote_config={"num_cpus": 1})
        setup = time.perf_counter() - started
        client = rb.client()
        task = ray.remote(num_cpus=1)(ray_actor_loop)
        refs = [task.remote(client, s, args.flush_every, stop_file) for s in range(LIVE_ACTORS)]
        limit = time.perf_counter() + 60
        while len(rb) < args.live_min_rows:
            if time.perf_counter() > limit:
                raise RuntimeError(f"RayReplayBuffer holds only {len(rb):,} rows after 60 s")
            time.sleep(0.05)
        before, samples = client.write_count, 0
        start = time.perf_counter()
        end = start + args.live_seconds
        while time.perf_counter() < end:
            rb.sample()
            samples += 1
        elapsed = time.perf_counter() - start
        inserted = client.write_count - before
        Path(stop_file).touch()
        produced = sum(ray.get(refs, timeout=120))
        alone = alone_rate(rb.sample, args.alone_seconds)
        return {"samples": samples / elapsed, "rows": inserted / elapsed, "alone": alone, "produced": produced,
                "setup": setup}
    finally:
        Path(stop_file).touch()  # the tasks end at their next extend
        if rb is not None:
            rb.close()
        ray.shutdown()


def bench_live(workers: Workers, args: argparse.Namespace, root: str, ray_note: str) -> str:
    contestants: dict[str, Callable[[], dict[str, Any]]] = {
        f"diskreplay, {LIVE_ACTORS} shards, add per step; refresh every {n} samples":
            (lambda n=n: live_diskreplay(workers, args, root, n)) for n in args.refresh_every}
    first_period = args.refresh_every[0]
    contestants |= {
        f"diskreplay, {LIVE_ACTORS} shards, extend of {args.flush_every:,} steps; refresh every {first_period} samples":
            lambda: live_diskreplay(workers, args, root, first_period, batched=True),
        "Queue → numpy ring, 1 step per put": lambda: live_queue(workers, args, 1),
        f"Queue → numpy ring, {args.flush_every:,} steps per put": lambda: live_queue(workers, args, args.flush_every),
    }
    if args.ray:
        contestants[f"TorchRL RayReplayBuffer, {args.flush_every:,} rows per extend"] = lambda: live_ray(args, root)
    names = list(contestants)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.live_repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            log(f"  [{r + 1}/{args.live_repeats}] {name}: {args.live_seconds:g} s")
            try:
                res = contestants[name]()
            except Exception as exc:  # report it, keep the others
                log(f"    failed: {type(exc).__name__}: {exc}")
                res = {"error": f"{type(exc).__name__}: {exc}"}
            log(f"    {json.dumps(res)}")
            runs[name].append(res)
    first = names[0]
    lines = [f"| {LIVE_ACTORS} actors + learner, {args.live_seconds:g} s | learner sample(256)/s | × diskreplay "
             "| rows/s taken in | × diskreplay | rows produced by the actors | learner alone, sample(256)/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]

    def med(name: str, key: str) -> float:
        vals = [x[key] for x in runs[name] if key in x]
        return statistics.median(vals) if vals else float("nan")

    for name in names:
        if all("error" in x for x in runs[name]):
            lines.append(f"| {name} | failed: {runs[name][0]['error']} | | | | | |")
            continue
        extra = ""
        if name.startswith("diskreplay"):
            extra = (f" (refresh: {med(name, 'refresh_share') * 100:.0f}% of the learner's time, "
                     f"{bl.format_seconds(med(name, 'refresh_us') * 1e-6)} each)")
        lines.append(f"| {name}{extra} | {med(name, 'samples'):,.0f} | "
                     f"{bl.format_ratio(med(name, 'samples') / med(first, 'samples'))} | {med(name, 'rows'):,.0f} | "
                     f"{bl.format_ratio(med(name, 'rows') / med(first, 'rows'))} | {med(name, 'produced'):,.0f} | "
                     f"{med(name, 'alone'):,.0f} |")
    notes = [f"Capacity {bl.format_count(args.live_capacity)} rows in all; timing starts once "
             f"{args.live_min_rows:,} rows are in; medians of {args.live_repeats} run(s), contestants rotated.",
             f"The Queue learner drains at most {args.drain_max:,} rows between two samples (queue bound: "
             f"{args.queue_rows:,} rows); rows produced count what the actors handed over (put, or committed), "
             "also during the warm-up and after the timed window.",
             ray_note]
    if args.ray and any("setup" in x for x in runs[names[-1]]):
        notes.append(f"Ray start-up (ray.init + the buffer actor): {med(names[-1], 'setup'):.1f} s (not timed).")
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes if n)


# ---- main -----------------------------------------------------------------------------------


# ---- 4. what a refresh costs --------------------------------------------------------------


class RefreshCounter:
    """Counts a learner's store operations: local store reads and commit index listings (local
    disk), or the requests a `FaultProxy` saw (S3)."""

    READS = ("get", "get_many", "get_ranges", "read_into", "sizes")

    def __init__(self, proxy: Any = None):
        from diskreplay.io.local import LocalChunkStore
        from diskreplay.storage.union import CommitIndex
        self.proxy, self.count, self.undo = proxy, 0, []
        if proxy is not None:
            return
        for cls, names in ((LocalChunkStore, self.READS), (CommitIndex, ("_names",))):
            for name in names:
                original = getattr(cls, name)
                self.undo.append((cls, name, original))
                setattr(cls, name, self._counted(original))

    def _counted(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)
        return counted

    def reset(self) -> None:
        self.count = 0
        if self.proxy is not None:
            self.proxy.reset_stats()

    def seen(self) -> int:
        return sum(self.proxy.hits.values()) if self.proxy is not None else self.count

    def close(self) -> None:
        for cls, name, original in self.undo:
            setattr(cls, name, original)


def drop_index(url: str, so: dict | None) -> None:
    """Make the root at ``url`` one made before the commit index (its learners read every shard)."""
    from diskreplay.io import open_chunkstore
    store = open_chunkstore(url, so)
    root = json.loads(store.get("zarr.json"))
    del root["attributes"]["diskreplay_shards"]["commit_index"]
    store.put("zarr.json", json.dumps(root).encode())


def refresh_rounds(url: str, so: dict | None, learner_so: dict | None, shards: int, k: int, index: bool,
                   counter: RefreshCounter, args: argparse.Namespace) -> dict[str, float]:
    dr.ReplayBuffer.create(url, FIELDS, capacity=4 * args.refresh_rows * args.refresh_rounds, shards=shards,
                           chunk_rows=256, storage_options=so).close()
    if not index:
        drop_index(url, so)
    writers = [dr.ReplayBuffer.open_shard(url, shard=s, storage_options=so) for s in range(k)]
    requests, times = [], []
    try:
        with dr.ReplayBuffer.open(url, "r", storage_options=learner_so) as learner:
            for r in range(args.refresh_rounds):
                for w in writers:
                    w.extend(columns(args.refresh_rows, r, r * args.refresh_rows))
                    w.flush()
                counter.reset()
                started = time.perf_counter()
                learner.refresh()
                times.append(time.perf_counter() - started)
                requests.append(counter.seen())
    finally:
        for w in writers:
            w.close()
    return {"requests": statistics.median(requests), "ms": 1e3 * statistics.median(times)}


def bench_refresh(args: argparse.Namespace, scratch: str, so: dict | None) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    from s3server import FaultProxy
    backends: list[tuple[str, str, dict | None, Any]] = [("local disk", scratch, None, None)]
    if so is not None:
        proxy = FaultProxy(so["endpoint_url"], latency_s=args.latency_ms / 1e3)
        backends.append((f"S3 (moto, {args.latency_ms:g} ms per request)", f"s3://{BUCKET}/refresh", so,
                         proxy))
    lines = ["| store | shards S | committed k | requests, index | requests, no index | ms, index | ms, no index |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, base, store_so, proxy in backends:
        counter = RefreshCounter(proxy)
        learner_so = None if proxy is None else {**store_so, "endpoint_url": proxy.endpoint}
        try:
            for shards in args.refresh_shards:
                for k in sorted({0, min(2, shards), shards}):
                    got = {index: refresh_rounds(f"{base}/{shards}-{k}-{index}-{uuid.uuid4().hex[:6]}", store_so,
                                                 learner_so, shards, k, index, counter, args)
                           for index in (True, False)}
                    log(f"  {name}: S={shards} k={k}: {got}")
                    lines.append(f"| {name} | {shards} | {k} | {got[True]['requests']:g} | {got[False]['requests']:g} "
                                 f"| {got[True]['ms']:.2f} | {got[False]['ms']:.2f} |")
        finally:
            counter.close()
            if proxy is not None:
                proxy.close()
    return "\n".join(lines) + "\n\n" + REFRESH_NOTE


REFRESH_NOTE = ("Requests (S3: counted at the proxy; local disk: store reads and listings) and wall time of one "
                "`refresh()`, median over the rounds. \"index\": a root with the commit index (every buffer "
                "made now): one listing, then the commit record and state of each shard that committed. "
                "\"no index\": a root made before it: every shard's commit record, then those that changed.")


def ray_status() -> tuple[bool, str]:
    try:
        import ray
    except Exception as exc:
        return False, f"TorchRL RayReplayBuffer: skipped, `import ray` fails ({type(exc).__name__}: {exc})."
    return True, f"ray {ray.__version__} imports"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (under a minute)")
    p.add_argument("--sizes", default=None, help="section 2 total rows (default 1M,16M; quick 200k)")
    p.add_argument("--writers", default="1,2,4", help="writer counts of section 1")
    p.add_argument("--rows", default=None, help="rows per writer, add (default 10k; quick 2k)")
    p.add_argument("--extend-rows", default=None, help="rows per writer, extend (default 60k; quick 10k)")
    p.add_argument("--flush-every", type=int, default=1000, help="steps between flushes (writers, actors)")
    p.add_argument("--s3-rows", default=None, help="rows per writer on S3, add and extend (default 4k; quick 1k)")
    p.add_argument("--repeats", type=int, default=None, help="section 1 repeats (default 2; quick 1)")
    p.add_argument("--no-s3", action="store_true", help="section 1 on local disk only")
    p.add_argument("--chunk-rows", type=int, default=None, help="section 2 chunk_rows (default: the library's)")
    p.add_argument("--no-lanes-control", dest="lanes_control", action="store_false",
                   help=f"leave out the plain num_envs={UNION_SHARDS} buffer of section 2")
    p.add_argument("--live-seconds", type=float, default=None, help="section 3 timed window (default 6; quick 1)")
    p.add_argument("--live-repeats", type=int, default=None, help="section 3 runs per contestant (default 1)")
    p.add_argument("--live-capacity", default="1M", help="section 3 rows kept in all")
    p.add_argument("--refresh-every", default=None, help="section 3 learner refresh periods (samples), "
                   "one diskreplay contestant each (default 10,100; quick 10)")
    p.add_argument("--drain-max", type=int, default=10_000, help="section 3 queue learner: rows per drain at most")
    p.add_argument("--queue-rows", type=int, default=100_000, help="section 3 queue bound, in rows")
    p.add_argument("--ray", action=argparse.BooleanOptionalAction, default=None,
                   help="TorchRL's RayReplayBuffer in section 3 when ray imports (default: yes; quick: no)")
    p.add_argument("--only", default="1,2,3,4", help="sections to run")
    p.add_argument("--refresh-shards", default="4,16,64", help="section 4 shard counts")
    p.add_argument("--refresh-rows", type=int, default=100, help="section 4 rows each committing shard adds per round")
    p.add_argument("--refresh-rounds", type=int, default=None, help="section 4 rounds (default 5; quick 3)")
    p.add_argument("--latency-ms", type=float, default=20.0, help="section 4 S3 latency per request")
    p.add_argument("--profile", action="store_true", help="cProfile sample(256) on 1 vs 16 shards")
    p.add_argument("--dir", default="/tmp/diskreplay-shards", help="section 2 buffers (kept) and scratch")
    p.add_argument("--rebuild", action="store_true", help="write section 2's buffers anew")
    p.add_argument("--out", default=None, help="also write the report to this file")
    p.add_argument("--child-memory", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    q = a.quick
    a.sizes = [bl.parse_count(s) for s in (a.sizes or ("200k" if q else "1M,16M")).split(",")]
    a.writers = [int(w) for w in a.writers.split(",")]
    a.rows = bl.parse_count(a.rows or ("2k" if q else "10k"))
    a.extend_rows = bl.parse_count(a.extend_rows or ("10k" if q else "60k"))
    a.s3_rows = bl.parse_count(a.s3_rows or ("1k" if q else "4k"))
    a.repeats = a.repeats or (1 if q else 2)
    a.live_seconds = a.live_seconds or (1.0 if q else 6.0)
    a.live_repeats = a.live_repeats or 1
    a.live_capacity = bl.parse_count(a.live_capacity)
    a.live_min_rows = 4 * a.flush_every
    a.alone_seconds = 0.3 if q else 1.5
    a.sample_batches = 50 if q else 200
    a.sample_repeats = 3 if q else 7
    a.warm_batches = 100 if q else 300
    a.warm_seconds = 0.5 if q else 2.0
    a.memory_batches = 300 if q else 1000
    a.only = {int(s) for s in a.only.split(",")}
    a.refresh_shards = [int(n) for n in a.refresh_shards.split(",")]
    a.refresh_rounds = a.refresh_rounds or (3 if q else 5)
    a.ray = (not q) if a.ray is None else a.ray
    a.refresh_every = [int(n) for n in (a.refresh_every or ("10" if q else "10,100")).split(",")]
    for size in a.sizes:
        if size % UNION_SHARDS:
            p.error(f"--sizes: {size} is not a multiple of {UNION_SHARDS}")
    return a


def main() -> None:
    args = parse_args()
    if args.child_memory:
        name, path, sampler, n = args.child_memory
        return child_memory(name, path, sampler, int(n))
    has_ray, ray_note = ray_status()
    if args.ray and not has_ray:
        args.ray = False
    elif has_ray and not args.ray:
        ray_note = f"TorchRL RayReplayBuffer: not run ({ray_note}; --ray runs it, as a run without --quick does)."
    elif has_ray:
        ray_note = ""
    os.makedirs(args.dir, exist_ok=True)
    header = bl.report_header("diskreplay sharded buffers benchmark", args.quick, PACKAGES, args.dir, [
        f"row: {', '.join(f'{k} {f.shape} {f.dtype}' for k, f in FIELDS.items())} = {ROW_BYTES} B; "
        f"episodes of {EPISODE:,} steps",
        f"section 1: writers {args.writers}; rows per writer: local disk {args.rows:,} (add), {args.extend_rows:,} "
        f"(extend), S3 {args.s3_rows:,}; flush every {args.flush_every:,}; {args.repeats} repeat(s)",
        f"section 2: totals {', '.join(map(bl.format_count, args.sizes))}; 1 vs {UNION_SHARDS} shards, raw",
        f"section 3: {LIVE_ACTORS} actors, {args.live_seconds:g} s per contestant",
        f"section 4: shards {args.refresh_shards}, {args.refresh_rows} rows per committing shard, "
        f"{args.refresh_rounds} rounds; S3 at {args.latency_ms:g} ms per request"])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    body = []
    scratch = tempfile.mkdtemp(prefix="scratch-", dir=args.dir)
    server = workers = None
    try:
        if args.only & {1, 3}:
            log("starting worker processes (spawn) ...")
            workers = Workers(max(max(args.writers), LIVE_ACTORS), args.writers, args.queue_rows, args.flush_every)
        so = None
        if args.only & {1, 4} and not args.no_s3:
            log("starting moto (S3) on 127.0.0.1 ...")
            server, so = start_s3()
        if 1 in args.only:
            backends: dict[str, tuple[str, dict | None]] = {"local disk": (scratch, None)}
            if so is not None:
                backends["S3 (moto, loopback)"] = (f"s3://{BUCKET}/shards", so)
            log("[1/4] writer scaling")
            section = time.perf_counter()
            scaling = bench_scaling(workers, args, backends)
            targets = scaling_targets(scaling, args, list(backends))
            body.append("## 1. Writer scaling: one shard per writer process\n\n"
                        + scaling_report(scaling, args, backends) + "\n\n" + SCALING_NOTE.format(
                            cores=len(os.sched_getaffinity(0)))
                        + ("\n\n" + bl.render_targets(targets) if targets else "")
                        + f"\n\nSection time: {time.perf_counter() - section:.0f} s.")
        if 2 in args.only:
            log("[2/4] the learner's union")
            section = time.perf_counter()
            results = [bench_union(size, args) for size in args.sizes]
            text, targets = union_report(results, args)
            built = "; ".join(f"{bl.format_count(r['total'])}: {', '.join(n for n, s in r['built'].items() if s)} in "
                              f"{max(s or 0 for s in r['built'].values()):.0f} s" for r in results
                              if any(r["built"].values()))
            body.append(f"## 2. Learner: sample(256) from {UNION_SHARDS} shards vs 1\n\n{text}\n\n"
                        f"Timing spread (max-min)/median, worst over the rows: "
                        f"{max(r['spread'] for r in results):.2f}. "
                        f"Buffers built this run (not timed): {built or 'none (reused)'}.\n\n"
                        + bl.render_targets(targets) + f"\n\nSection time: {time.perf_counter() - section:.0f} s.")
            if args.profile:
                for r in results:
                    for sampler, prof in r.get("profile", {}).items():
                        for n, text in prof.items():
                            body.append(f"### cProfile, {bl.format_count(r['total'])} rows, {sampler}, {n}\n\n"
                                        f"```\n{text.strip()}\n```")
        if 3 in args.only:
            log("[3/4] live: actors and a learner")
            section = time.perf_counter()
            body.append("## 3. Live: 4 actor processes and one learner\n\n"
                        + bench_live(workers, args, scratch, ray_note)
                        + f"\n\nSection time: {time.perf_counter() - section:.0f} s.")
        if 4 in args.only:
            log("[4/4] what a learner's refresh costs")
            section = time.perf_counter()
            body.append("## 4. Requests per learner refresh: S shards, k of them committed\n\n"
                        + bench_refresh(args, scratch, so)
                        + f"\n\nSection time: {time.perf_counter() - section:.0f} s.")
    finally:
        if workers is not None:
            workers.close()
        if server is not None:
            server.stdin.close()
            server.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)
    bl.publish_report(header, "\n\n".join(body), args.out, started)


if __name__ == "__main__":
    main()
