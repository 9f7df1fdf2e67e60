"""Micro-benchmark of the segment trees behind prioritized sampling.

Prints the median wall time, in microseconds per iteration, of
  * SumSegmentTree: ``update`` of B random leaves + ``find_prefix_sum`` of B
    random thresholds (and each half alone), on 2**20 and 2**24 leaves;
  * MinSegmentTree: ``update`` of B random leaves + ``min()``, same sizes.
Trees start with every leaf set to a random priority. Every iteration uses
fresh random indices, values and thresholds (all drawn up front), so caches
are not kept warm by repeating one batch. The 1-minute load average is printed
because other processes on a small machine inflate the medians.

Usage: python tools/bench_segment_tree.py [--reps N] [--batch B]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diskreplay.sampling.segment_tree import MinSegmentTree, SumSegmentTree

SIZES_LOG2 = (20, 24)


def median_us(fn: Callable[[int], object], reps: int, warmup: int = 50) -> float:
    """Median wall time of ``fn(i)`` for ``i in range(reps)``, in microseconds."""
    for i in range(min(warmup, reps)):
        fn(i)
    times = np.empty(reps, dtype=np.int64)
    for i in range(reps):
        start = time.perf_counter_ns()
        fn(i)
        times[i] = time.perf_counter_ns() - start
    return float(np.median(times)) / 1e3


def bench_sum(capacity: int, batch: int, reps: int, rng: np.random.Generator) -> dict[str, float]:
    """Medians (µs) of update, find_prefix_sum and both, on a full random tree."""
    tree = SumSegmentTree.from_state_dict({"leaves": rng.random(capacity)})
    idx = rng.integers(0, capacity, (reps, batch))
    vals = rng.random((reps, batch))
    fracs = rng.random((reps, batch))

    def both(i: int) -> None:
        tree.update(idx[i], vals[i])
        tree.find_prefix_sum(fracs[i] * tree.total())

    thresholds = fracs * tree.total()
    return {
        "update+find": median_us(both, reps),
        "update": median_us(lambda i: tree.update(idx[i], vals[i]), reps),
        "find": median_us(lambda i: tree.find_prefix_sum(thresholds[i]), reps),
    }


def bench_min(capacity: int, batch: int, reps: int, rng: np.random.Generator) -> float:
    """Median (µs) of update + min() on a full random tree."""
    tree = MinSegmentTree.from_state_dict({"leaves": rng.random(capacity)})
    idx = rng.integers(0, capacity, (reps, batch))
    vals = rng.random((reps, batch))

    def step(i: int) -> None:
        tree.update(idx[i], vals[i])
        tree.min()

    return median_us(step, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3000, help="timed iterations per case")
    parser.add_argument("--batch", type=int, default=256, help="indices/thresholds per call")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    b = args.batch
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
    for log2 in SIZES_LOG2:
        res = bench_sum(1 << log2, b, args.reps, rng)
        print(
            f"SumSegmentTree 2^{log2}: update {b} + find_prefix_sum {b}: "
            f"{res['update+find']:7.1f} us  (update {res['update']:.1f}, find {res['find']:.1f})"
        )
    for log2 in SIZES_LOG2:
        us = bench_min(1 << log2, b, args.reps, rng)
        print(f"MinSegmentTree 2^{log2}: update {b} + min(): {us:7.1f} us")
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
