"""`diskreplay demo`: a ten-second tour — collect CartPole experience, sample it, resume it.

Steps: create a ring buffer with 4 env lanes; collect experience from gymnasium's CartPole-v1
with a random policy (a tiny synthetic env stands in when gymnasium is not installed); sample
it uniformly, with priorities (when `dr.Prioritized` exists) and through a torch DataLoader;
close it, reopen it with ``mode="r+"`` and keep collecting where it stopped. Without a directory
the buffer goes to a temp dir that is removed at the end.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import diskreplay as dr

BATCH = 256


class TinyEnv:
    """A stand-in for CartPole when gymnasium is missing: 4-d observations, 2 actions."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.t = 0

    def reset(self, seed: int | None = None) -> tuple[np.ndarray, dict]:
        """A new episode: ``(obs, info)``, obs float32 ``[4]`` (``seed`` is ignored)."""
        self.t = 0
        return self.rng.normal(0, 0.05, 4).astype(np.float32), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        """``(obs, reward, terminated, truncated, info)`` like gymnasium: obs float32 ``[4]``, reward
        1.0, terminated with probability 0.05, truncated after 200 steps (``action`` is ignored)."""
        self.t += 1
        obs = self.rng.normal(0, 0.5, 4).astype(np.float32)
        return obs, 1.0, bool(self.rng.random() < 0.05), self.t >= 200, {}


def make_envs(num_envs: int, seed: int) -> tuple[list[Any], str]:
    """``num_envs`` CartPole-v1 envs (`TinyEnv` ones, seeded ``seed + i``, without gymnasium) and
    a one-line description of which."""
    try:
        import gymnasium as gym
    except ImportError:
        return [TinyEnv(seed + i) for i in range(num_envs)], "synthetic (gymnasium not installed)"
    return [gym.make("CartPole-v1") for _ in range(num_envs)], "gymnasium CartPole-v1"


FIELDS = {
    "obs": dr.Field((4,), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
    "next_obs": dr.Field((4,), "float32"), "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool"),
}


class Collector:
    """Steps ``num_envs`` envs with a random policy; each step is one `buf.add` over all lanes."""

    def __init__(self, envs: list[Any], seed: int):
        self.envs = envs
        self.rng = np.random.default_rng(seed)
        self.obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]).astype(np.float32)

    def collect(self, buf: dr.ReplayBuffer, steps: int) -> int:
        """Add ``steps`` steps of every env to ``buf``; returns the rows added (``steps * num_envs``)."""
        n = len(self.envs)
        for _ in range(steps):
            actions = self.rng.integers(0, 2, n)
            step = [env.step(int(a)) for env, a in zip(self.envs, actions)]
            next_obs = np.stack([s[0] for s in step]).astype(np.float32)
            term = np.array([s[2] for s in step])
            trunc = np.array([s[3] for s in step])
            buf.add(obs=self.obs, action=actions, reward=np.array([s[1] for s in step], np.float32),
                    next_obs=next_obs, terminated=term, truncated=trunc)
            for i in np.flatnonzero(term | trunc):
                next_obs[i] = self.envs[i].reset()[0]
            self.obs = next_obs
        return steps * n


def _timed(fn: Callable[[], int], min_seconds: float) -> tuple[float, int]:
    """Run fn (returns rows handled) repeatedly for at least min_seconds: (rows/s, rows)."""
    start, rows = time.perf_counter(), 0
    while True:
        rows += fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return rows / elapsed, rows


def _disk_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 1e6


def run_demo(directory: str | None = None, *, steps: int = 4000, num_envs: int = 4, seed: int = 0,
             seconds: float = 1.0, out: Callable[[str], None] = print) -> dict[str, float]:
    """Run the tour with its buffer in ``directory`` (kept), or in a temp dir removed at the end.

    ``steps``: env steps per lane; ``seconds``: time per throughput measurement. Returns the
    measured numbers (rows/s, MB on disk) and ``"rows"``, the buffer's final row count.
    """
    if directory is not None:
        return _tour(directory, steps, num_envs, seed, seconds, out, kept=True)
    with tempfile.TemporaryDirectory(prefix="diskreplay-demo-") as tmp:
        return _tour(tmp, steps, num_envs, seed, seconds, out, kept=False)


def _print_table(results: dict[str, float], out: Callable[[str], None]) -> None:
    width = max(len(k) for k in results)
    out("")
    out(f"{'measure':<{width}}  {'value':>12}")
    out(f"{'-' * width}  {'-' * 12}")
    for key, value in results.items():
        out(f"{key:<{width}}  {value:>12,.1f}")
    out("")


def _tour(directory: str, steps: int, num_envs: int, seed: int, seconds: float, out: Callable[[str], None],
          kept: bool) -> dict[str, float]:
    path = os.path.join(directory, "cartpole.zarr")
    envs, env_name = make_envs(num_envs, seed)
    out(f"diskreplay demo: {env_name}, {num_envs} env lanes, buffer at {path}")
    buf = dr.ReplayBuffer.create(path, FIELDS, capacity=100_000, num_envs=num_envs, chunk_rows=1024,
                                 sampler=dr.Prioritized(), seed=seed, overwrite=True)
    collector = Collector(envs, seed)
    results: dict[str, float] = {}

    start = time.perf_counter()
    added = collector.collect(buf, steps)
    buf.flush()
    results[f"rows added/s (one buf.add per step, {num_envs} lanes)"] = added / (time.perf_counter() - start)

    reader = dr.ReplayBuffer.open(path, "r", sampler=dr.Uniform())
    rng = np.random.default_rng(seed)
    results["uniform samples/s (batch 256)"] = _timed(lambda: len(reader.sample(BATCH, rng=rng)["index"]), seconds)[0]

    def per_step() -> int:
        batch = buf.sample(BATCH)
        buf.update_priorities(batch["index"], rng.random(BATCH))
        return BATCH
    results["prioritized sample+update rows/s"] = _timed(per_step, seconds)[0]

    dataset, how = reader.as_dataset(batch_size=BATCH), "buf.as_dataset"
    import torch

    loader = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0))
    results[f"DataLoader rows/s ({how})"] = _timed(lambda: len(next(loader)["index"]), seconds)[0]
    reader.close()

    rows_before, sequence = len(buf), buf.stats().commit_sequence
    buf.close()
    results["MB on disk"] = _disk_mb(path)
    buf = dr.ReplayBuffer.open(path, mode="r+")
    collector.collect(buf, steps // 4)
    rows_after = len(buf)
    buf.close()

    _print_table(results, out)
    out(f"resume: closed at {rows_before:,} rows (commit #{sequence}); reopened with "
        f"ReplayBuffer.open(path, mode='r+'), added {rows_after - rows_before:,} more -> {rows_after:,} rows.")
    out("        The sampler, its priorities and the random generator are restored from the last commit;")
    out("        unflushed rows are the only thing a crash can lose (buf.flush() commits).")
    if kept:
        out(f"inspect it:  diskreplay info {path}   |   diskreplay verify {path}")
    else:
        out("the buffer is in a temp dir, removed as the demo ends: "
            "run 'diskreplay demo DIR' to keep it and inspect it")
    results["rows"] = rows_after
    return results
