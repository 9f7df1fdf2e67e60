"""Add benchmark (issue #41, item 5): one `add` of a step vs SB3's in-RAM numpy assignment, one run.

Workload: five fields — obs (17,) f32, action (6,) f32, reward () f32, next_obs (17,) f32,
done () bool — added one step per call into an empty 1M-capacity buffer on the local disk.

Contestants, repeats interleaved (median reported), each compared with the numpy floor of the
same number of lanes:
- ``numpy (SB3-style), num_envs=N``: what SB3's in-RAM ``ReplayBuffer.add`` with ``n_envs=N`` does
  per field: ``np.array(v)`` of the ``(N, *shape)`` step assigned at one index of a preallocated
  ``(capacity // N, N, *shape)`` array (``(capacity, *shape)`` for one lane): the baselines;
- ``SB3 ReplayBuffer, num_envs=N``: SB3's own buffer, if stable-baselines3 is installed;
- diskreplay ``add`` with num_envs 1 / 4 / 16 (one row per lane per call), uniform and prioritized
  sampler, raw and zstd chunks: µs per call and per row, and the ratio per call to the floor of
  its num_envs.

Two clocks: wall time (what the caller waits, with the writer's background thread competing for
the CPU as it encodes and writes the chunks the adds fill) and the calling thread's CPU time
(``time.thread_time``: the cost of the ``add`` call itself).

Usage: python tools/bench_add.py [--adds 20000] [--repeats 5] [--dir /tmp/diskreplay-bench-add] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl

import diskreplay as dr

CAPACITY = 1 << 20  # divisible by every lane count below
FIELDS = {name: dr.Field(*spec) for name, spec in bl.WORKLOAD_FIELDS.items()}
LANES = (1, 4, 16)
POOL = 1024
NUMPY, SB3 = "numpy (SB3-style), num_envs={}", "SB3 ReplayBuffer, num_envs={}"


def steps(num_envs: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """POOL prepared steps: each field shaped ``(num_envs, *shape)`` (``shape`` alone for one lane)."""
    rng = np.random.default_rng(seed)
    lead = () if num_envs == 1 else (num_envs,)
    out = []
    for _ in range(POOL):
        out.append({name: (rng.standard_normal(lead + f.shape).astype(f.dtype) if f.dtype != np.bool_
                           else rng.random(lead + f.shape) < 0.01) for name, f in FIELDS.items()})
    return out


Timed = dict[str, float]


def timed(loop: Callable[[], None]) -> Timed:
    """Wall and calling-thread CPU seconds of ``loop()``."""
    wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
    loop()
    return {"total": (time.perf_counter_ns() - wall) / 1e9, "cpu": (time.thread_time_ns() - cpu) / 1e9}


def numpy_case(adds: int, num_envs: int) -> Callable[[], Timed]:
    rows = steps(num_envs)
    lead = (CAPACITY,) if num_envs == 1 else (CAPACITY // num_envs, num_envs)

    def run() -> Timed:
        store = {k: np.zeros((*lead, *f.shape), f.dtype) for k, f in FIELDS.items()}

        def loop() -> None:
            for i in range(adds):
                for k, v in rows[i % POOL].items():
                    store[k][i] = np.array(v)
        return timed(loop)
    return run


def sb3_case(adds: int, num_envs: int) -> Callable[[], Timed] | None:
    try:
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer
    except ImportError:
        return None
    rows = steps(num_envs)
    obs_space = spaces.Box(-np.inf, np.inf, (17,), np.float32)
    act_space = spaces.Box(-1, 1, (6,), np.float32)
    infos: list[dict[str, object]] = [{} for _ in range(num_envs)]

    def run() -> Timed:
        rb = SB3Buffer(CAPACITY, obs_space, act_space, device="cpu", n_envs=num_envs)

        def loop() -> None:
            for i in range(adds):
                s = rows[i % POOL]
                rb.add(s["obs"], s["next_obs"], s["action"], s["reward"], s["done"], infos)
        return timed(loop)
    return run


def dr_case(work: str, adds: int, num_envs: int, prioritized: bool, compression: str | None) -> Callable[[], Timed]:
    rows = steps(num_envs)
    path = os.path.join(work, f"add_{num_envs}_{int(prioritized)}_{compression or 'raw'}")

    def run() -> Timed:
        shutil.rmtree(path, ignore_errors=True)
        buf = dr.ReplayBuffer.create(path, FIELDS, capacity=CAPACITY, num_envs=num_envs, chunk_rows=4096,
                                     compression=compression, seed=0,
                                     sampler=dr.Prioritized() if prioritized else None)
        add = buf.add

        def loop() -> None:
            for i in range(adds):
                add(**rows[i % POOL])
        took = timed(loop)
        buf.close()
        return took
    return run


def label(num_envs: int, prioritized: bool, compression: str | None) -> str:
    return f"diskreplay {compression or 'raw'}, {'prioritized' if prioritized else 'uniform'}, num_envs={num_envs}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/diskreplay-bench-add", help="work directory on the local disk")
    p.add_argument("--adds", type=int, default=20_000, help="add calls per repeat")
    p.add_argument("--repeats", type=int, default=5, help="interleaved repeats")
    p.add_argument("--out", help="also write the markdown report to this file")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    cases: dict[str, Callable[[], Timed]] = {}
    lanes: dict[str, int] = {}
    for n in LANES:
        cases[NUMPY.format(n)], lanes[NUMPY.format(n)] = numpy_case(args.adds, n), n
        sb3 = sb3_case(args.adds, n)
        if sb3 is not None:
            cases[SB3.format(n)], lanes[SB3.format(n)] = sb3, n
    for compression in (None, "zstd"):
        for prioritized in (False, True):
            for n in LANES:
                name = label(n, prioritized, compression)
                cases[name], lanes[name] = dr_case(args.dir, args.adds, n, prioritized, compression), n
    bl.log(f"{args.repeats} interleaved repeats x {args.adds:,} add calls")
    stats = bl.interleaved(cases, args.repeats, number=args.adds)
    lines = ["| contestant | wall per call (vs numpy) | wall per row | caller CPU per call (vs numpy) |",
             "|---|---:|---:|---:|"]
    for name, st in stats.items():
        wall, cpu, n = st.median, st.phases["cpu"].median, lanes[name]
        floor, floor_cpu = stats[NUMPY.format(n)].median, stats[NUMPY.format(n)].phases["cpu"].median
        lines.append(f"| {name} | {wall * 1e6:.2f} µs ({wall / floor:.2f}×) | {wall / n * 1e6:.2f} µs | "
                     f"{cpu * 1e6:.2f} µs ({cpu / floor_cpu:.2f}×) |")
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
