"""Micro-benchmark of the segment trees used for prioritized sampling.

Prints median microseconds per iteration of:
  * SumSegmentTree: update of 256 random leaves + find_prefix_sum of 256 thresholds,
    on 2**20 and 2**24 leaves (all leaves filled with random priorities first);
  * MinSegmentTree: update of 256 random leaves + min(), on 2**20 and 2**24 leaves.

Usage: python tools/bench_segment_tree.py [--reps N] [--batch B]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diskreplay.segment_tree import MinSegmentTree, SumSegmentTree  # noqa: E402


def median_us(fn: Callable[[int], None], reps: int, warmup: int = 50) -> float:
    """Median wall time of ``fn(i)`` in microseconds over ``reps`` calls."""
    for i in range(warmup):
        fn(i)
    times = np.empty(reps, dtype=np.int64)
    for i in range(reps):
        start = time.perf_counter_ns()
        fn(i)
        times[i] = time.perf_counter_ns() - start
    return float(np.median(times)) / 1e3


def bench_sum(capacity: int, batch: int, reps: int, rng: np.random.Generator) -> float:
    tree = SumSegmentTree.from_state_dict({"leaves": rng.random(capacity)})
    pool = reps
    idx = rng.integers(0, capacity, (pool, batch))
    vals = rng.random((pool, batch))
    fracs = rng.random((pool, batch))

    def step(i: int) -> None:
        k = i % pool
        tree.update(idx[k], vals[k])
        tree.find_prefix_sum(fracs[k] * tree.total())

    return median_us(step, reps)


def bench_min(capacity: int, batch: int, reps: int, rng: np.random.Generator) -> float:
    tree = MinSegmentTree.from_state_dict({"leaves": rng.random(capacity)})
    pool = reps
    idx = rng.integers(0, capacity, (pool, batch))
    vals = rng.random((pool, batch))

    def step(i: int) -> None:
        k = i % pool
        tree.update(idx[k], vals[k])
        tree.min()

    return median_us(step, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for log2 in (20, 24):
        cap = 1 << log2
        us = bench_sum(cap, args.batch, args.reps, rng)
        print(f"SumSegmentTree 2^{log2}: update {args.batch} + find_prefix_sum {args.batch}: "
              f"{us:8.1f} us (median)")
    for log2 in (20, 24):
        cap = 1 << log2
        us = bench_min(cap, args.batch, args.reps, rng)
        print(f"MinSegmentTree 2^{log2}: update {args.batch} + min(): {us:8.1f} us (median)")


if __name__ == "__main__":
    main()
