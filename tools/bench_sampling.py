"""Sampling benchmark (issue #3): prioritized replay, segment trees and trajectory slices, one run.

1. PER: one ``sample(256)`` + ``update_priorities(256)`` pair on a 1,000,000-row buffer (five
   fields: obs (17,) f32, action (6,) f32, reward f32, next_obs (17,) f32, done bool), alpha 0.6,
   beta 0.4. diskreplay (compression None, local disk, chunk cache warm) vs cpprb
   ``PrioritizedReplayBuffer`` vs TorchRL ``TensorDictPrioritizedReplayBuffer(alpha, beta,
   storage=LazyMemmapStorage)`` (whose C++ segment-tree extension may be missing for this torch:
   then the column says so). Targets: no slower than cpprb, faster than TorchRL.
2. Segment tree: batched ``update`` of 256 leaves + ``find_prefix_sum`` of 256 thresholds on a
   2**24-leaf ``dr.SumSegmentTree`` (target < 150 µs); the min tree and the pair of both shown too.
3. Slices: ``sample(64, seq_len=16)`` (1,024 rows) vs uniform ``sample(1024)`` on a 1M-row buffer
   of ~1,000-step episodes: target within 2x.

Repeats are interleaved across contestants (median reported; see tools/benchlib.py). Prints the
machine, a markdown table, PASS/FAIL per target and the command line; ``--out FILE`` also writes
the report. ``--quick`` keeps the sizes (the targets are defined at them) but times fewer repeats.

Usage: python tools/bench_sampling.py [--quick] [--dir /tmp/diskreplay-bench] [--out FILE]
"""

from __future__ import annotations

import argparse
import logging
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

N_ROWS = 1_000_000
BATCH = 256
ALPHA, BETA = 0.6, 0.4
CHUNK_ROWS = 4096
TREE_LEAVES = 1 << 24
SEQ_BATCH, SEQ_LEN = 64, 16
EPISODE_LEN = 1000
FIELDS = {name: dr.Field(*spec) for name, spec in bl.WORKLOAD_FIELDS.items()}
PACKAGES = ["diskreplay", "numpy", "zarr", "torch", "torchrl", "tensordict", "cpprb"]
DR, CPPRB, TRL = "diskreplay", "cpprb", "TorchRL"
log = bl.log


def make_data(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Random rows; ``done`` ends episodes of 500..1500 steps (mean ~1000)."""
    rng = np.random.default_rng(seed)
    done = np.zeros(rows, bool)
    ends = np.cumsum(rng.integers(EPISODE_LEN // 2, 3 * EPISODE_LEN // 2 + 1, rows // (EPISODE_LEN // 2) + 2)) - 1
    done[ends[ends < rows]] = True
    return {
        "obs": rng.standard_normal((rows, 17), dtype=np.float32),
        "action": rng.standard_normal((rows, 6), dtype=np.float32),
        "reward": rng.standard_normal(rows, dtype=np.float32),
        "next_obs": rng.standard_normal((rows, 17), dtype=np.float32),
        "done": done,
    }


def dr_buffer(path: str, data: dict[str, np.ndarray], sampler: dr.Sampler) -> dr.ReplayBuffer:
    shutil.rmtree(path, ignore_errors=True)
    buf = dr.ReplayBuffer.create(path, FIELDS, capacity=N_ROWS, chunk_rows=CHUNK_ROWS, compression=None,
                                 sampler=sampler, seed=0)
    buf.extend(data)
    buf.flush()
    return buf


def repeat(fn: Callable[[], Any], n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            fn()
    return run


# ---- 1. PER sample + update ---------------------------------------------------------------------


def per_contestants(data, work: str, warm: int) -> tuple[dict[str, Callable[[], Any]], dict[str, str], list]:
    """One callable per library doing one sample(256) + update_priorities(256) pair."""
    rng = np.random.default_rng(1)
    pool = rng.exponential(1.0, (64, BATCH))  # |TD errors|, drawn up front
    counter = iter(range(10**12))
    fns: dict[str, Callable[[], Any]] = {}
    notes: dict[str, str] = {}
    keep: list = []

    log("[1/3] PER: diskreplay buffer (1M rows, compression None)")
    buf = dr_buffer(os.path.join(work, "per"), data, dr.Prioritized(alpha=ALPHA, beta=BETA))
    keep.append(buf)

    def dr_pair():
        batch = buf.sample(BATCH)
        buf.update_priorities(batch["index"], pool[next(counter) % 64])
    fns[DR] = dr_pair

    log("[1/3] PER: cpprb PrioritizedReplayBuffer")
    import cpprb
    cb = cpprb.PrioritizedReplayBuffer(N_ROWS, env_dict={
        "obs": {"shape": 17}, "action": {"shape": 6}, "reward": {}, "next_obs": {"shape": 17},
        "done": {"dtype": np.bool_}}, alpha=ALPHA)
    cb.add(**data)
    keep.append(cb)

    def cpprb_pair():
        s = cb.sample(BATCH, beta=BETA)
        cb.update_priorities(s["indexes"], pool[next(counter) % 64])
    fns[CPPRB] = cpprb_pair

    log("[1/3] PER: TorchRL TensorDictPrioritizedReplayBuffer(LazyMemmapStorage)")
    try:
        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyMemmapStorage, TensorDictPrioritizedReplayBuffer
        scratch = os.path.join(work, "torchrl")
        shutil.rmtree(scratch, ignore_errors=True)
        rb = TensorDictPrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, batch_size=BATCH,
                                               storage=LazyMemmapStorage(N_ROWS, scratch_dir=scratch))
        rb.extend(TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=[N_ROWS]))
        tpool = torch.from_numpy(pool)
        keep.append(rb)

        def trl_pair():
            s = rb.sample()
            rb.update_priority(s["index"], tpool[next(counter) % 64])
        trl_pair()
        fns[TRL] = trl_pair
    except Exception as exc:
        msg = (str(exc).splitlines() or [""])[0].replace(" See warning above.", "")
        import torch
        notes[TRL] = (f"n/a: {type(exc).__name__}: {msg} (torchrl's C++ segment-tree extension does not "
                      f"load with torch {torch.__version__})" if "SegmentTree" in msg
                      else f"n/a: {type(exc).__name__}: {msg}")
        log(f"      TorchRL unavailable: {notes[TRL]}")

    log(f"[1/3] PER: warm-up ({warm} untimed pairs each)")
    for fn in fns.values():
        repeat(fn, warm)()
    return fns, notes, keep


# ---- 2. segment tree ------------------------------------------------------------------------------


def tree_contestants(leaves: int) -> dict[str, Callable[[], Any]]:
    rng = np.random.default_rng(2)
    log(f"[2/3] segment trees: {leaves:,} leaves, filled with random priorities")
    init = rng.random(leaves)
    s = dr.SumSegmentTree(leaves)
    m = dr.MinSegmentTree(leaves)
    s.update(np.arange(leaves), init)
    m.update(np.arange(leaves), init)
    del init
    pool = 256
    idx = rng.integers(0, leaves, (pool, BATCH))
    vals = rng.random((pool, BATCH))
    fracs = rng.random((pool, BATCH))
    counter = iter(range(10**12))

    def sum_pair():
        k = next(counter) % pool
        s.update(idx[k], vals[k])
        s.find_prefix_sum(fracs[k] * s.total())

    def min_pair():
        k = next(counter) % pool
        m.update(idx[k], vals[k])
        m.min()

    def both():  # what one PER update + sample costs in trees: sum and min updated, then searched
        k = next(counter) % pool
        s.update(idx[k], vals[k])
        m.update(idx[k], vals[k])
        s.find_prefix_sum(fracs[k] * s.total())
        m.min()
    return {"sum: update + find_prefix_sum": sum_pair, "min: update + min()": min_pair,
            "sum + min (a PER step's tree work)": both}


# ---- 3. slices ---------------------------------------------------------------------------------------


def slice_contestants(data, work: str, warm: int) -> tuple[dict[str, Callable[[], Any]], list, str]:
    log("[3/3] slices: diskreplay buffer (1M rows, episodes of ~1000 steps)")
    buf = dr_buffer(os.path.join(work, "slices"), data, dr.Uniform())
    table = buf.episodes()
    info = (f"{len(table):,} episodes, mean length {table.length.mean():.0f} "
            f"(min {table.length.min()}, max {table.length.max()})")
    per = dr_buffer(os.path.join(work, "slices_per"), data, dr.Prioritized(alpha=ALPHA, beta=BETA))
    fns = {
        f"uniform sample({SEQ_BATCH * SEQ_LEN})": lambda: buf.sample(SEQ_BATCH * SEQ_LEN),
        f"sample({SEQ_BATCH}, seq_len={SEQ_LEN})": lambda: buf.sample(SEQ_BATCH, seq_len=SEQ_LEN),
        f"sample({SEQ_BATCH}, seq_len={SEQ_LEN}, pad=True)": lambda: buf.sample(SEQ_BATCH, seq_len=SEQ_LEN, pad=True),
        f"Prioritized sample({SEQ_BATCH}, seq_len={SEQ_LEN})": lambda: per.sample(SEQ_BATCH, seq_len=SEQ_LEN),
    }
    log(f"[3/3] slices: warm-up ({warm} untimed calls each)")
    for fn in fns.values():
        repeat(fn, warm)()
    return fns, [buf, per], info


# ---- report -------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/diskreplay-bench", help="work directory on the local disk")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--quick", action="store_true", help="fewer repeats (same sizes): about a minute")
    p.add_argument("--repeats", type=int, help="interleaved repeats per section (default 9; quick 5)")
    p.add_argument("--number", type=int, help="operations per repeat (default 1000; quick 200)")
    args = p.parse_args()
    q = args.quick
    args.repeats = args.repeats or (5 if q else 9)
    args.number = args.number or (200 if q else 1000)
    warm = 200 if q else 1000

    work = os.path.join(args.dir, "sampling")
    os.makedirs(work, exist_ok=True)
    bl.require_free_space(args.dir, 4 * N_ROWS * 165)
    bl.import_torchrl(logging.ERROR)
    header = bl.report_header("diskreplay sampling benchmark", q, PACKAGES, args.dir)
    print(header + "\n", flush=True)
    started = time.perf_counter()
    data = make_data(N_ROWS, seed=0)
    us = lambda s: bl.format_seconds(s, "us")  # noqa: E731
    n, r = args.number, args.repeats

    # 1. PER
    fns, notes, keep = per_contestants(data, work, warm)
    log(f"[1/3] PER: {r} interleaved repeats x {n} pairs")
    per = bl.interleaved({k: repeat(f, n) for k, f in fns.items()}, r, number=n)
    del keep, fns
    log("      " + ", ".join(f"{k}: {us(v.median)}" for k, v in per.items()))

    # 2. trees
    tfns = tree_contestants(TREE_LEAVES)
    log(f"[2/3] segment trees: {r} interleaved repeats x {n} ops")
    tree = bl.interleaved({k: repeat(f, n) for k, f in tfns.items()}, r, number=n)
    del tfns
    log("      " + ", ".join(f"{k}: {us(v.median)}" for k, v in tree.items()))

    # 3. slices
    sfns, keep, ep_info = slice_contestants(data, work, warm // 4)
    sn = max(n // 4, 20)
    log(f"[3/3] slices: {r} interleaved repeats x {sn} calls")
    sl = bl.interleaved({k: repeat(f, sn) for k, f in sfns.items()}, r, number=sn)
    for b in keep:
        b.close()
    del keep, sfns, data
    shutil.rmtree(work, ignore_errors=True)
    log("      " + ", ".join(f"{k}: {us(v.median)}" for k, v in sl.items()))

    # tables
    t1 = bl.Table([DR, CPPRB, TRL], corner="PER, 1M rows, batch 256")
    t1.add("sample(256) + update_priorities(256), per pair",
           {c: (per[c].median if c in per else None) for c in (DR, CPPRB, TRL)}, unit="us", baseline=CPPRB,
           notes={k: f"({v})" for k, v in notes.items()})
    t2 = bl.Table(["median", "min", "max"], corner=f"segment trees, {TREE_LEAVES:,} leaves, batch 256")
    for k, v in tree.items():
        t2.add(k, {"median": v.median, "min": v.min, "max": v.max}, unit="us")
    base = f"uniform sample({SEQ_BATCH * SEQ_LEN})"
    t3 = bl.Table(["per call"], corner=f"slices on 1M rows ({SEQ_BATCH * SEQ_LEN} rows per call)")
    for k, v in sl.items():
        t3.add(k, {"per call": v.median}, unit="us",
               notes={"per call": f"({bl.format_ratio(v.median / sl[base].median)} of uniform)"})

    d, c = per[DR].median, per[CPPRB].median
    slice_key = f"sample({SEQ_BATCH}, seq_len={SEQ_LEN})"
    slice_ratio = sl[slice_key].median / sl[base].median
    tsum = tree["sum: update + find_prefix_sum"].median
    targets = [
        bl.Target("PER sample(256)+update(256) on 1M rows: no slower than cpprb",
                  f"{us(d)} vs {us(c)}: {bl.format_ratio(d / c)}", d <= c),
        bl.Target("PER pair: faster than TorchRL TensorDictPrioritizedReplayBuffer",
                  (f"{us(d)} vs {us(per[TRL].median)}: {bl.format_ratio(per[TRL].median / d)} faster"
                   if TRL in per else notes.get(TRL, "n/a")),
                  (d < per[TRL].median) if TRL in per else None),
        bl.Target("SumSegmentTree 2^24 leaves: update(256) + find_prefix_sum(256) < 150 µs",
                  us(tsum), tsum < 150e-6),
        bl.Target(f"sample({SEQ_BATCH}, seq_len={SEQ_LEN}) within 2× of uniform sample({SEQ_BATCH * SEQ_LEN})",
                  f"{us(sl[slice_key].median)} vs {us(sl[base].median)}: {bl.format_ratio(slice_ratio)}",
                  slice_ratio <= 2.0),
    ]

    def spread(stats):
        name = max(stats, key=lambda k: stats[k].spread)
        return f"{stats[name].spread:.0%} ({name})"
    notes_md = [
        f"- every row: median of {r} interleaved repeats x {n} operations ({sn} for slices), after "
        f"{warm} untimed warm-up operations each; 1,000,000 rows of 165 bytes (obs 17 f32, action 6 f32, "
        "reward, next_obs 17 f32, done), index generation included everywhere.",
        f"- diskreplay: `ReplayBuffer.create(..., capacity=1_000_000, compression=None, chunk_rows={CHUNK_ROWS}, "
        f"sampler=dr.Prioritized(alpha={ALPHA}, beta={BETA}))`, extended and flushed, sampled by the writer "
        "(chunk cache warm); a pair is `b = buf.sample(256)` (gathers every field, IS weights) + "
        "`buf.update_priorities(b['index'], td)`. cpprb: `PrioritizedReplayBuffer(1_000_000, env_dict, "
        f"alpha={ALPHA})`, `sample(256, beta={BETA})` + `update_priorities(s['indexes'], td)`. TorchRL: "
        f"`TensorDictPrioritizedReplayBuffer(alpha={ALPHA}, beta={BETA}, storage=LazyMemmapStorage(1_000_000))`, "
        "`sample()` + `update_priority(s['index'], td)`.",
        f"- slices: {ep_info}; uniform sampler unless marked Prioritized; both sides gather "
        f"{SEQ_BATCH * SEQ_LEN} rows of every field.",
        f"- noise, worst (max−min)/median: PER {spread(per)}, trees {spread(tree)}, slices {spread(sl)}; "
        f"1-min load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.",
    ]
    body = "\n\n".join([t1.render(), t2.render(), t3.render(), "## Targets (issue #3)",
                        bl.render_targets(targets), "\n".join(notes_md)])
    body += "\n\n" + "\n".join(f"{t.verdict}: {t.description}" for t in targets)
    bl.publish_report(header, body, args.out, started)


if __name__ == "__main__":
    main()
