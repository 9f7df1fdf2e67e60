"""HER relabels the goal, every stored twin of it and the reward, and (by default, as SB3's
HerReplayBuffer) never a row of an episode that has not ended (issue 18).

Buffers are real, with two env lanes of known episodes. Every goal value names its lane's
episode and step: ``achieved_goal[t] = (ep, t, 0)``, ``next_achieved_goal[t] = (ep, t + 1, 0)``
(the achieved goal of step t + 1), ``desired_goal[t] = (ep, t, 2)``, ``next_desired_goal[t] =
(ep, t + 1, 2)``; the stored reward is 0.5. So a relabelled goal says exactly which episode and
step it came from, and a twin left with the old goal cannot pass for the new one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest

import diskreplay as dr
from diskreplay.offline import import_dataset

EPISODES = ([4, 6, 3], [5, 2, 7])  # ended episode lengths per lane
OPEN = (5, 3)  # steps of each lane's open (unfinished) episode
STORED_REWARD = np.float32(0.5)
GOAL = dr.Field((3,), "float32")


def reward_fn(achieved: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """Minus the step distance: exact in float32 for the small values used here."""
    return -np.abs(achieved - goal).sum(-1).astype(np.float32)


@dataclass(frozen=True)
class Step:
    """What the test knows of one step: its episode id, its episode's first and last step, and
    whether that episode has ended."""

    ep: int
    first: int
    last: int
    ended: bool


def lane_steps(lane: int) -> list[Step]:
    """Every step of one lane, in order (episode ids ``10 * lane + ordinal``)."""
    out: list[Step] = []
    for i, length in enumerate([*EPISODES[lane], OPEN[lane]]):
        first = len(out)
        out += [Step(10 * lane + i, first, first + length - 1, i < len(EPISODES[lane]))] * length
    return out


def lane_rows(lane: int, prefix: str) -> dict[str, np.ndarray]:
    """The rows of one lane, goal fields named with ``prefix`` (``""``, ``"obs_"``, ``"observations_"``)."""
    steps = lane_steps(lane)
    t = np.arange(len(steps), dtype=np.float32)
    ep = np.array([s.ep for s in steps], np.float32)
    end = np.array([s.ended and s.last == i for i, s in enumerate(steps)])
    goal = lambda step, kind: np.stack([ep, step, np.full_like(t, kind)], -1)  # noqa: E731
    return {"obs": np.stack([t, ep], -1), "reward": np.full(len(t), STORED_REWARD),
            "terminated": end & (ep % 2 == 0), "truncated": end & (ep % 2 == 1),
            f"{prefix}achieved_goal": goal(t, 0), f"next_{prefix}achieved_goal": goal(t + 1, 0),
            f"{prefix}desired_goal": goal(t, 2), f"next_{prefix}desired_goal": goal(t + 1, 2)}


def make_buffer(path: Path, prefix: str = "", derive: bool = False, capacity: int | None = None) -> dr.ReplayBuffer:
    """Two lanes of `EPISODES` then `OPEN` steps; ``derive``: the goals' ``next_`` twins derived."""
    fields = {"obs": dr.Field((2,), "float32"), "reward": dr.Field((), "float32"),
              "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool"),
              **{f"{nxt}{prefix}{name}": GOAL for nxt in ("", "next_") for name in ("achieved_goal", "desired_goal")}}
    derive_next = (f"{prefix}desired_goal", f"{prefix}achieved_goal") if derive else ()
    buf = dr.ReplayBuffer.create(path, fields, capacity, num_envs=2, chunk_rows=4, seed=0, derive_next=derive_next)
    for lane in range(2):
        buf.extend({k: v[:, None] for k, v in lane_rows(lane, prefix).items()}, env_ids=[lane])
    return buf


def window(lane: int, capacity: int | None) -> tuple[int, int]:
    """The readable steps ``[lo, hi)`` of a lane."""
    hi = len(lane_steps(lane))
    return (0 if capacity is None else max(0, hi - capacity // 2)), hi


def check_batch(batch: dict[str, np.ndarray], her: dr.HER, prefix: str, capacity: int | None) -> None:
    """Every row of ``batch`` against the layout: relabelled rows exactly, the others as stored."""
    goal, twin, achieved = f"{prefix}desired_goal", f"next_{prefix}desired_goal", f"{prefix}achieved_goal"
    lanes, steps = batch["index"] % 2, batch["index"] // 2
    info = [lane_steps(lane)[t] for lane, t in zip(lanes.tolist(), steps.tolist())]
    eligible = np.array([s.ended or her.unfinished == "newest" for s in info])
    relabelled = batch["relabelled"]
    assert int(relabelled.sum()) == round(int(eligible.sum()) * her.k / (her.k + 1))
    assert not (relabelled & ~eligible).any()
    for b, (lane, t, s) in enumerate(zip(lanes.tolist(), steps.tolist(), info)):
        np.testing.assert_array_equal(batch[achieved][b], [s.ep, t, 0])
        np.testing.assert_array_equal(batch[f"next_{achieved}"][b], [s.ep, t + 1, 0])
        if not relabelled[b]:
            np.testing.assert_array_equal(batch[goal][b], [s.ep, t, 2])
            np.testing.assert_array_equal(batch[twin][b], [s.ep, t + 1, 2])
            assert batch["reward"][b] == STORED_REWARD
            continue
        lo, hi = window(lane, capacity)
        last = s.last if s.ended else hi - 1  # "newest": the lane's newest step ends the open episode
        source = int(batch[goal][b, 1]) - 1  # the goal is next_achieved_goal of step `source`
        np.testing.assert_array_equal(batch[goal][b], [s.ep, source + 1, 0])
        np.testing.assert_array_equal(batch[twin][b], batch[goal][b])
        assert batch["reward"][b] == -abs(source - t)
        first = {"future": t, "final": last, "episode": max(s.first, lo)}[her.strategy]
        assert first <= source <= last, (lane, t, source)


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
@pytest.mark.parametrize("prefix", ["", "obs_", "observations_"])
@pytest.mark.parametrize("derive", [False, True])
def test_relabels_goal_twin_and_reward_exactly(tmp_path, strategy, prefix, derive):
    buf = make_buffer(tmp_path / "b", prefix, derive)
    her = dr.HER(reward_fn=reward_fn, strategy=strategy, k=3)
    assert her.relabelled_fields(buf.view.schema) == (f"{prefix}desired_goal", f"next_{prefix}desired_goal")
    drawn = set()  # (episode, t - source) of every relabelled row
    for seed in range(4):
        batch = buf.sample(200, her=her, seed=seed)
        check_batch(batch, her, prefix, None)
        goals = batch[f"{prefix}desired_goal"][batch["relabelled"]]
        drawn |= {(int(g[0]), int(i) // 2 - int(g[1]) + 1) for i, g in zip(batch["index"][batch["relabelled"]], goals)}
    offsets = {offset for _, offset in drawn}
    if strategy == "final":
        assert {ep for ep, _ in drawn} == {0, 1, 2, 10, 11, 12}  # every ended episode, none open
    else:  # the goal's step drawn at, after ("future") and before ("episode") the step itself
        assert 0 in offsets and (max(offsets) >= 3 if strategy == "episode" else min(offsets) <= -3)
    buf.close()


@pytest.mark.parametrize("strategy", ["future", "final", "episode"])
@pytest.mark.parametrize("capacity", [None, 20])
def test_unfinished_episodes_skipped_by_default_relabelled_when_asked(tmp_path, strategy, capacity):
    buf = make_buffer(tmp_path / "b", capacity=capacity)
    skip = dr.HER(reward_fn=reward_fn, strategy=strategy, k=4)
    newest = dr.HER(reward_fn=reward_fn, strategy=strategy, k=4, unfinished="newest")
    assert skip.unfinished == "skip"
    open_rows = 0
    for seed in range(3):
        batch = buf.sample(300, her=skip, seed=seed)
        check_batch(batch, skip, "", capacity)
        is_open = np.array([not lane_steps(i % 2)[i // 2].ended for i in batch["index"].tolist()])
        assert is_open.sum() > 30 and not batch["relabelled"][is_open].any()
        batch = buf.sample(300, her=newest, seed=seed)
        check_batch(batch, newest, "", capacity)
        open_rows += int(batch["relabelled"][is_open].sum())
        assert int(batch["relabelled"].sum()) == 240  # 300 * 4/5: every row may be relabelled
    assert open_rows > 0
    if strategy == "final":  # an open episode's "final" goal is its lane's newest next_achieved_goal
        batch = buf.sample(300, her=newest, seed=0)
        for b in np.flatnonzero(batch["relabelled"]):
            lane, t = int(batch["index"][b]) % 2, int(batch["index"][b]) // 2
            if not lane_steps(lane)[t].ended:
                assert batch["desired_goal"][b, 1] == len(lane_steps(lane))
    buf.close()


# Digests (tests/test_golden.py `digest`) of the HER batches of golden cases as written before the
# `unfinished` option: ring_calls' 8th call, on the writer and then on a reader.
BEFORE_UNFINISHED = {
    "raw 1 lane": (None, 1, [
        ("<i8[16]:ed4b3656aedbcbee", "<f4[16, 2]:d3d7a98c191b0647", "<f4[16]:efa2d1799d027e47",
         "|b1[16]:a43b449b344ae95d"),
        ("<i8[16]:8d0dfc0db2cb1460", "<f4[16, 2]:e6c60833103aa5c2", "<f4[16]:961f2ce09c542c0d",
         "|b1[16]:9b95ec47df466203")]),
    "zstd 3 lanes": ("zstd", 3, [
        ("<i8[16]:fb9149db3c16befb", "<f4[16, 2]:53680c85d7c5d66f", "<f4[16]:f3967c507292f4d7",
         "|b1[16]:a43b449b344ae95d"),
        ("<i8[16]:f32613814355f4a5", "<f4[16, 2]:0a2aeecd920c937e", "<f4[16]:57f6ea98659d7e91",
         "|b1[16]:9b95ec47df466203")]),
}


@pytest.mark.parametrize("case", list(BEFORE_UNFINISHED))
def test_newest_gives_the_batches_of_before(tmp_path, monkeypatch, case):
    """``unfinished="newest"`` keeps the former behaviour: the golden HER batches of before."""
    golden = pytest.importorskip("test_golden")
    compression, lanes, before = BEFORE_UNFINISHED[case]
    monkeypatch.setattr(dr, "HER", functools.partial(dr.HER, unfinished="newest"))
    calls = golden.uniform_ring(tmp_path, compression, lanes)
    for batch, digests in zip((calls[7], calls[19]), before):
        got = golden.digest(batch)
        assert tuple(got[k] for k in ("index", "desired_goal", "reward", "relabelled")) == digests


def test_bad_options_and_fields(tmp_path):
    with pytest.raises(ValueError, match=r"unfinished must be 'skip' .* or 'newest' .*got 'drop'"):
        dr.HER(reward_fn=reward_fn, unfinished="drop")
    buf = make_buffer(tmp_path / "b")
    with pytest.raises(ValueError, match=r"next_desired_goal.*frame-stacked.*stack_fields"):
        buf.sample(4, stack=2, stack_fields=("desired_goal",), her=dr.HER(reward_fn=reward_fn))
    with pytest.raises(ValueError, match=r"HER needs field 'goal'"):
        buf.sample(4, her=dr.HER(reward_fn=reward_fn, goal="goal"))
    with pytest.raises(ValueError, match=r"HER needs field 'reached'"):
        buf.sample(4, her=dr.HER(reward_fn=reward_fn, achieved_goal="reached"))
    buf.close()


def write_minari_goals(root: Path, lengths: tuple[int, ...]) -> None:
    """A Minari dataset whose observations are dicts of ``observation``, ``achieved_goal`` and
    ``desired_goal`` (as gymnasium-robotics' goal envs): goal values ``(episode, step, kind)``."""
    (root / "data").mkdir(parents=True)
    with h5py.File(root / "data" / "main_data.hdf5", "w") as f:
        for ep, length in enumerate(lengths):
            g = f.create_group(f"episode_{ep}")
            t = np.arange(length + 1, dtype=np.float32)
            goal = lambda kind: np.stack([np.full_like(t, ep), t, np.full_like(t, kind)], -1)  # noqa: E731,B023
            g["observations/observation"] = np.stack([t, t], -1)
            g["observations/achieved_goal"] = goal(0)
            g["observations/desired_goal"] = goal(2)
            g["actions"] = np.zeros((length, 1), np.float32)
            g["rewards"] = np.full(length, STORED_REWARD)
            g["terminations"] = np.arange(length) == length - 1
            g["truncations"] = np.zeros(length, bool)


def test_minari_dict_observations_relabel_both_flattened_goals(tmp_path):
    lengths = (4, 6, 3)
    write_minari_goals(tmp_path / "ds", lengths)
    buf = import_dataset(tmp_path / "ds", tmp_path / "b", chunk_rows=4, progress=False)
    her = dr.HER(reward_fn=reward_fn, strategy="final", k=3)  # default names, read under obs_
    assert her.relabelled_fields(buf.view.schema) == ("obs_desired_goal", "next_obs_desired_goal")
    batch = buf.sample(64, her=her, seed=1)
    assert int(batch["relabelled"].sum()) == 48
    starts = np.cumsum((0, *lengths))
    for b in np.flatnonzero(batch["relabelled"]):
        row = int(batch["index"][b])
        ep = int(np.searchsorted(starts, row, side="right")) - 1
        final = [ep, lengths[ep], 0]  # the achieved goal after the episode's last step
        np.testing.assert_array_equal(batch["obs_desired_goal"][b], final)
        np.testing.assert_array_equal(batch["next_obs_desired_goal"][b], final)
        assert batch["reward"][b] == -(lengths[ep] - (row - starts[ep]) - 1)
    buf.close()


def test_d4rl_observation_groups_relabel_both_flattened_goals(tmp_path):
    """A D4RL-layout HDF5 file with ``observations/<key>`` and ``next_observations/<key>`` groups:
    fields ``observations_desired_goal`` and ``next_observations_desired_goal`` both relabelled."""
    lengths = (5, 3, 4)  # the last episode has not ended (no terminal, no timeout)
    ep = np.repeat(np.arange(3), lengths).astype(np.float32)
    t = np.concatenate([np.arange(n) for n in lengths]).astype(np.float32)
    goal = lambda step, kind: np.stack([ep, step, np.full_like(t, kind)], -1)  # noqa: E731
    ends = np.concatenate([np.arange(n) == n - 1 for n in lengths]) & (ep < 2)
    with h5py.File(tmp_path / "d.hdf5", "w") as f:
        for group, shift in (("observations", 0), ("next_observations", 1)):
            f[f"{group}/achieved_goal"], f[f"{group}/desired_goal"] = goal(t + shift, 0), goal(t + shift, 2)
        f["actions"], f["rewards"] = np.zeros((len(t), 1), np.float32), np.full(len(t), STORED_REWARD)
        f["terminals"], f["timeouts"] = ends, np.zeros(len(t), bool)
    buf = import_dataset(tmp_path / "d.hdf5", tmp_path / "b", chunk_rows=4, progress=False)
    her = dr.HER(reward_fn=reward_fn, strategy="final", k=1)
    targets = ("observations_desired_goal", "next_observations_desired_goal")
    assert her.relabelled_fields(buf.view.schema) == targets
    batch = buf.sample(64, her=her, seed=2)
    rows = batch["index"]
    assert not batch["relabelled"][ep[rows] == 2].any()
    assert int(batch["relabelled"].sum()) == round(int((ep[rows] < 2).sum()) / 2)
    for b in np.flatnonzero(batch["relabelled"]):
        final = [ep[rows[b]], lengths[int(ep[rows[b]])], 0]  # next achieved goal of the last step
        for name in targets:
            np.testing.assert_array_equal(batch[name][b], final)
        assert batch["reward"][b] == -(lengths[int(ep[rows[b]])] - t[rows[b]] - 1)
    buf.close()
