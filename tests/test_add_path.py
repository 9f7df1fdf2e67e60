"""The short path of a single-step ``add`` (issue 41): a step whose fields all have their stored
dtype and shape is copied into the staged chunks in place. It must store, index and offer to the
sampler exactly what the long path (`Schema.rows` casts, `StagingWriter.append`) does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import writes_done

import diskreplay as dr
from diskreplay.format.lanes import LaneLayout
from diskreplay.sampling import Draw, Prioritized
from diskreplay.sampling.prioritized import _queued_rows

FIELDS = {"obs": dr.Field((3,), "float32"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}


def steps(count: int, num_envs: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    lead = () if num_envs == 1 else (num_envs,)
    return [{"obs": rng.standard_normal(lead + (3,), dtype=np.float32),
             "reward": rng.standard_normal(lead, dtype=np.float32) if lead else np.float32(rng.standard_normal()),
             "done": rng.random(lead) < 0.2 if lead else np.bool_(rng.random() < 0.2)} for _ in range(count)]


def long_way(step: dict[str, Any]) -> dict[str, Any]:
    """The same step as float64 lists and Python bools: the long path casts them."""
    return {k: np.asarray(v).tolist() if k != "obs" else np.asarray(v, np.float64) for k, v in step.items()}


def created(tmp_path, name: str, num_envs: int, capacity: int | None, sampler=None) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.create(tmp_path / name, FIELDS, capacity=capacity, num_envs=num_envs, chunk_rows=8,
                                  compression=None, seed=3, sampler=sampler)


def short_path_calls(buf: dr.ReplayBuffer) -> list[int]:
    """Counts the steps the short path stages (patched onto this buffer's writer)."""
    staging = buf.storage.writer.steps
    taken: list[int] = []
    inner = staging.append

    def counted(rows):
        step = inner(rows)
        if step >= 0:
            taken.append(step)
        return step
    staging.append = counted
    return taken


@pytest.mark.parametrize("num_envs, capacity", [(1, None), (1, 20), (3, 60), (4, 64)])
@pytest.mark.parametrize("prioritized", [False, True])
def test_short_path_stores_samples_and_indexes_as_the_long_path(tmp_path, num_envs, capacity, prioritized):
    """Rings that wrap mid-chunk (20 per lane, chunks of 8) and a growing dataset: rows, episodes,
    row ids and sampled batches (drawn right after adds, so they include the newest row) equal."""
    fast = created(tmp_path, "fast", num_envs, capacity, Prioritized() if prioritized else None)
    slow = created(tmp_path, "slow", num_envs, capacity, Prioritized() if prioritized else None)
    taken = short_path_calls(fast)
    for i, step in enumerate(steps(70, num_envs)):
        fast.add(**step)
        writes_done(fast)  # a chunk sealed while one is written waits for the long way to start it
        slow.add(**long_way(step))
        if i % 9 == 4:
            a, b = fast.sample(16, seed=i), slow.sample(16, seed=i)
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
            if prioritized:
                for buf in (fast, slow):
                    buf.update_priorities(a["index"], np.arange(16, dtype=np.float64))
        if i == 40:
            fast.flush(), slow.flush()
    assert len(taken) > 40  # all but a chunk's first and last rows (and one after the flush)
    np.testing.assert_array_equal(fast.row_ids(), slow.row_ids())
    for k, v in slow.rows(slow.row_ids()).items():
        np.testing.assert_array_equal(fast.rows(fast.row_ids())[k], v, err_msg=k)
    for k, v in vars(slow.episodes()).items():
        np.testing.assert_array_equal(vars(fast.episodes())[k], v, err_msg=k)
    fast.close(), slow.close()


def test_a_sample_right_after_an_add_draws_the_new_row_with_max_priority(tmp_path):
    buf = created(tmp_path, "b", 1, 64, Prioritized(alpha=1.0))
    taken = short_path_calls(buf)
    buf.add(**steps(1, 1)[0])
    buf.add(**steps(1, 1, seed=1)[0])
    assert taken == [1]
    first = buf.sample(8, seed=0)
    buf.update_priorities(np.array([0, 1]), np.array([1e-3, 1e-3]))
    buf.add(**steps(1, 1, seed=2)[0])
    assert taken == [1, 2]
    batch = buf.sample(64, seed=1)
    assert set(first["index"].tolist()) <= {0, 1}
    assert (batch["index"] == 2).mean() > 0.9  # priority 1 (the max) against two of ~1e-3
    np.testing.assert_array_equal(buf.rows(np.array([2]))["obs"][0], steps(1, 1, seed=2)[0]["obs"])
    buf.close()


def test_bad_input_after_short_path_steps_raises_as_before_and_changes_nothing(tmp_path):
    buf = created(tmp_path, "b", 2, 32)
    good = steps(3, 2)
    for step in good:
        buf.add(**step)
    before = {k: v.copy() for k, v in buf.rows(buf.row_ids()).items()}
    bad = dict(good[0], obs=np.zeros((2, 4), np.float32))
    with pytest.raises(dr.SchemaError, match=r"field 'obs': expected shape \(2, 3\), got \(2, 4\)"):
        buf.add(**bad)
    with pytest.raises(dr.SchemaError, match=r"missing \['done'\], unknown \['don'\]"):
        buf.add(obs=good[0]["obs"], reward=good[0]["reward"], don=good[0]["done"])
    with pytest.raises(dr.SchemaError, match="field 'reward': expected dtype float32"):
        buf.add(**dict(good[0], reward=np.array(["a", "b"])))
    assert len(buf) == 6
    for k, v in buf.rows(buf.row_ids()).items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    buf.add(**good[0])
    assert len(buf) == 8
    buf.close()


class Recording:
    """A sampler of one's own (no `BaseSampler`): it records what it is told."""

    def __init__(self) -> None:
        self.appended: list[tuple[int, int, int]] = []

    def attach(self, layout) -> None:
        self.layout = layout

    def on_append(self, lane: int, first: int, end: int) -> None:
        self.appended.append((lane, first, end))

    def sample(self, rng, batch_size, lo, hi) -> Draw:
        return Draw(np.zeros(batch_size, np.int64), hi[:1].repeat(batch_size) - 1)

    def state_dict(self) -> dict[str, Any]:
        return {"type": "Recording"}

    def load_state_dict(self, state) -> None:
        pass


def test_a_sampler_of_ones_own_is_told_of_every_lane_of_a_short_path_step(tmp_path):
    sampler = Recording()
    buf = created(tmp_path, "b", 3, 30, sampler)
    taken = short_path_calls(buf)
    for step in steps(3, 3):
        buf.add(**step)
    assert taken == [1, 2]
    assert sampler.appended == [(lane, step, step + 1) for step in range(3) for lane in range(3)]
    buf.close()


def test_prioritized_queue_merges_consecutive_steps_in_the_order_they_came():
    sampler = Prioritized()
    sampler.attach(LaneLayout(3, 10, 8))
    for step in range(4):
        sampler.on_append_lanes(3, step, step + 1)
    sampler.on_append(1, 4, 6)
    sampler.on_append(1, 6, 7)
    assert sampler._pending == [(range(3), 0, 4), (1, 4, 7)]
    lanes, steps_ = _queued_rows(range(3), 0, 2)
    assert lanes.tolist() == [0, 1, 2, 0, 1, 2] and steps_.tolist() == [0, 0, 0, 1, 1, 1]


def test_one_lane_steps_of_0d_arrays_end_episodes_as_numpy_scalars_do(tmp_path):
    """With one lane a scalar field may come as a numpy scalar or a 0-d array: both take the short
    way, and a true end flag of either ends the episode there."""
    scalars, arrays = created(tmp_path, "scalars", 1, None), created(tmp_path, "arrays", 1, None)
    taken = short_path_calls(arrays)
    for step in steps(30, 1, seed=5):
        scalars.add(**step)
        arrays.add(**{k: np.asarray(v) for k, v in step.items()})
    assert len(taken) > 20
    ends = [i for i, step in enumerate(steps(30, 1, seed=5)) if step["done"]]
    assert ends and arrays.episodes().start.tolist() == scalars.episodes().start.tolist() == [0] + [
        e + 1 for e in ends if e + 1 < 30]
    scalars.close(), arrays.close()
