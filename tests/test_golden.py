"""Golden batches: the same seeds and calls give the same bytes as when `tests/golden.json` was
written. They pin today's behaviour across refactors (issue 15): every sampler, transform,
dataset mode and layout, on rings that wrapped and datasets that grew.

A change that is meant to change batches regenerates the file, and says why in its commit:
``DISKREPLAY_WRITE_GOLDEN=1 python -m pytest tests/test_golden.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import diskreplay as dr
from diskreplay.episodes import index as episode_index
from diskreplay.sampling import draws

GOLDEN = Path(__file__).with_name("golden.json")
FIELDS = {"obs": dr.Field((3, 2), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "next_obs": dr.Field((3, 2), "float32"), "achieved_goal": dr.Field((2,), "float32"),
          "desired_goal": dr.Field((2,), "float32"), "terminated": dr.Field((), "bool"),
          "truncated": dr.Field((), "bool")}


def steps(first: int, count: int, lanes: int) -> dict[str, np.ndarray]:
    """Deterministic steps ``first .. first+count-1`` of every lane; episodes of 7 to 19 steps."""
    t = np.arange(first, first + count)[:, None] + 1000 * np.arange(lanes)[None, :]
    length = 7 + (t // 1000 * 5 + t % 1000 // 23) % 13
    ends = (t % 1000) % length == length - 1
    obs = (t[..., None, None] * np.float32(0.5) + np.arange(6, dtype=np.float32).reshape(3, 2)).astype(np.float32)
    return {"obs": obs, "action": t % 5, "reward": (t % 3).astype(np.float32) - 1, "next_obs": obs + 0.5,
            "achieved_goal": np.stack([t % 11, t % 7], -1).astype(np.float32),
            "desired_goal": np.stack([t % 5, t % 3], -1).astype(np.float32),
            "terminated": ends & (t % 2 == 0), "truncated": ends & (t % 2 == 1)}


def fill(buf: dr.ReplayBuffer, count: int, piece: int = 37) -> None:
    for first in range(0, count, piece):
        rows = steps(first, min(piece, count - first), buf.num_envs)
        buf.extend(rows if buf.num_envs > 1 else {k: v[:, 0] for k, v in rows.items()})


def her_reward(achieved: np.ndarray, goal: np.ndarray) -> np.ndarray:
    return -(np.abs(achieved - goal).sum(-1) > 1).astype(np.float32)


def digest(value: Any) -> Any:
    """A batch (dicts, tuples, arrays, tensors) as hashes of its arrays' dtype, shape and bytes."""
    if isinstance(value, dict):
        return {k: digest(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [digest(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.numpy()
    array = np.ascontiguousarray(value)
    return f"{array.dtype.str}{list(array.shape)}:{hashlib.sha256(array.tobytes()).hexdigest()[:16]}"


def ring_calls(buf: dr.ReplayBuffer) -> list[Any]:
    her = dr.HER(reward_fn=her_reward, strategy="future", k=3)
    return [buf.sample(16), buf.sample(16, seed=3), buf.sample(8, n_step=3, gamma=0.9),
            buf.sample(8, stack=3), buf.sample(8, n_step=2, gamma=0.5, stack=2), buf.sample(6, seq_len=4),
            buf.sample(6, seq_len=5, pad=True), buf.sample(16, her=her), buf[buf.row_ids()[::7]],
            buf.latest(5), buf.episodes().length, buf.episodes().start]


def uniform_ring(tmp: Path, compression: str | None, lanes: int) -> list[Any]:
    with dr.ReplayBuffer.create(tmp / "b", FIELDS, capacity=96, num_envs=lanes, chunk_rows=8,
                                compression=compression, seed=11) as buf:
        fill(buf, 230)
        first = ring_calls(buf)
        buf.flush()
    with dr.ReplayBuffer.open(tmp / "b", "r") as reader:
        return first + ring_calls(reader)


def prioritized(tmp: Path) -> list[Any]:
    out = []
    with dr.ReplayBuffer.create(tmp / "b", FIELDS, capacity=64, num_envs=2, chunk_rows=8, seed=5,
                                sampler=dr.Prioritized(alpha=0.7, beta=0.5)) as buf:
        fill(buf, 100)
        for k in range(4):
            batch = buf.sample(16, beta=0.4 + 0.1 * k)
            buf.update_priorities(batch["index"], np.sin(batch["index"] * 0.37 + k) * 3)
            out.append(batch)
        fill(buf, 20)
        out.append(buf.sample(16, n_step=3, gamma=0.9))
    return out


def prioritized_adds(tmp: Path) -> list[Any]:
    """Single-step adds (the short path of `add`), sampled and updated between them: 1 and 3 lanes."""
    out = []
    for lanes in (1, 3):
        with dr.ReplayBuffer.create(tmp / f"b{lanes}", FIELDS, capacity=48, num_envs=lanes, chunk_rows=8, seed=7,
                                    sampler=dr.Prioritized(alpha=0.6, beta=0.4)) as buf:
            for t in range(70):
                rows = steps(t, 1, lanes)
                buf.add(**{k: v[0] if lanes > 1 else v[0, 0] for k, v in rows.items()})
                if t % 11 == 10:
                    batch = buf.sample(8)
                    buf.update_priorities(batch["index"], np.cos(batch["index"] * 0.29 + t) * 2)
                    out.append(batch)
            out.append(buf.sample(16, n_step=2, gamma=0.9))
    return out


def without_replacement(tmp: Path) -> list[Any]:
    with dr.ReplayBuffer.create(tmp / "b", FIELDS, capacity=None, chunk_rows=8, seed=2,
                                sampler=dr.WithoutReplacement()) as buf:
        fill(buf, 45)
        return [buf.sample(10) for _ in range(6)]


def derived(tmp: Path) -> list[Any]:
    fields = {k: v for k, v in FIELDS.items() if k not in ("achieved_goal", "desired_goal")}
    with dr.ReplayBuffer.create(tmp / "b", fields, capacity=80, num_envs=2, chunk_rows=8, seed=9,
                                derive_next=("obs",), episodic_return=dr.EpisodicReturn(gamma=0.9)) as buf:
        for first in range(0, 150, 29):
            rows = {k: v for k, v in steps(first, 29, 2).items() if k in fields}
            buf.extend(rows)
        return [buf.sample(12), buf.sample(8, stack=3), buf.sample(8, n_step=3, gamma=0.8), buf[buf.row_ids()]]


def datasets(tmp: Path) -> list[Any]:
    with dr.ReplayBuffer.create(tmp / "b", FIELDS, capacity=None, num_envs=2, chunk_rows=8, seed=1) as buf:
        fill(buf, 75)
    out = []
    for shuffle in ("block", "global", "none"):
        ds = dr.make_dataset(tmp / "b", 16, "epoch", seed=4, shuffle=shuffle, shuffle_window=2)
        out += [list(ds), list(ds)]  # two epochs
    sample = iter(dr.make_dataset(tmp / "b", 16, "sample", seed=4))
    out.append([next(sample) for _ in range(3)])
    return out


def rollout(tmp: Path) -> list[Any]:
    fields = {"obs": dr.Field((2,), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
              "value": dr.Field((), "float32"), "log_prob": dr.Field((), "float32"),
              "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
    ro = dr.RolloutBuffer(fields, num_steps=12, num_envs=3)
    for t in range(12):
        k = t * 3 + np.arange(3)
        ro.add(obs=np.stack([k, -k], -1).astype(np.float32), action=k % 4, reward=np.cos(k).astype(np.float32),
               value=np.sin(k).astype(np.float32), log_prob=(-k / 10).astype(np.float32),
               terminated=k % 7 == 6, truncated=k % 11 == 10)
    ro.compute_returns_and_advantages(np.array([0.1, 0.2, 0.3]), np.array([False, True, False]), gamma=0.9,
                                      gae_lambda=0.8)
    out = list(ro.minibatches(num_minibatches=3, epochs=2, seed=6))
    ro.close()
    return out


CASES: dict[str, Callable[[Path], list[Any]]] = {
    "uniform ring raw 1 lane": lambda tmp: uniform_ring(tmp, None, 1),
    "uniform ring zstd 3 lanes": lambda tmp: uniform_ring(tmp, "zstd", 3),
    "uniform ring lz4 2 lanes": lambda tmp: uniform_ring(tmp, "lz4", 2),
    "prioritized": prioritized,
    "prioritized after single-step adds": prioritized_adds,
    "without replacement": without_replacement,
    "derived next and returns": derived,
    "datasets": datasets,
    "rollout": rollout,
}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


@pytest.mark.parametrize("case", list(CASES))
def test_batches_equal_the_golden_ones(case, tmp_path, golden):
    got = digest(CASES[case](tmp_path))
    if os.environ.get("DISKREPLAY_WRITE_GOLDEN"):
        stored = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**stored, case: got}, indent=1, sort_keys=True) + "\n")
        return
    assert case in golden, f"no golden batches for {case!r}: write them with DISKREPLAY_WRITE_GOLDEN=1"
    assert got == golden[case]


def test_the_golden_file_has_no_case_that_is_gone(golden):
    assert sorted(golden) == sorted(CASES)


@pytest.mark.parametrize("case", ["uniform ring raw 1 lane", "uniform ring lz4 2 lanes", "derived next and returns"])
def test_batches_without_the_compiled_loops_equal_the_golden_ones(case, tmp_path, golden, monkeypatch):
    """Where no C compiler was found at install, draws and episode searches run in numpy: the
    same batches."""
    monkeypatch.setattr(draws, "_draws", None)
    monkeypatch.setattr(episode_index, "_search", None)
    assert digest(CASES[case](tmp_path)) == golden[case]
