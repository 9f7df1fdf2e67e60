"""Derived fields: next_obs read from step t+1 (with final observations kept apart) and the
episodic return-to-go stored when an episode ends."""

import numpy as np
import pytest
import zarr
from reference_returns import ref_episodic

import diskreplay as dr

FIELDS = {"obs": dr.Field((3,), "float32"), "next_obs": dr.Field((3,), "float32"),
          "reward": dr.Field((), "float32"), "terminated": dr.Field((), "bool"),
          "truncated": dr.Field((), "bool")}


def make_lane(rng, n):
    """A lane's steps: next_obs[t] is obs[t+1] inside an episode and a fresh final obs at its end."""
    term = rng.random(n) < 0.04
    trunc = (rng.random(n) < 0.03) & ~term
    done = term | trunc
    obs = rng.standard_normal((n + 1, 3)).astype(np.float32)
    next_obs = obs[1:].copy()
    next_obs[done] = rng.standard_normal((int(done.sum()), 3)).astype(np.float32)
    return {"obs": obs[:-1], "next_obs": next_obs, "reward": rng.standard_normal(n).astype(np.float32),
            "terminated": term, "truncated": trunc}


def fill(buf, lanes, steps, rng):
    """Add lanes' steps in random-sized pieces, mixing add (subsets of lanes) and extend."""
    num_envs = len(lanes)
    pos = np.zeros(num_envs, dtype=int)
    while (pos < steps).any():
        if rng.random() < 0.5:
            env = [e for e in range(num_envs) if pos[e] < steps]
            env = sorted(rng.choice(env, size=rng.integers(1, len(env) + 1), replace=False).tolist())
            buf.add(env_ids=env if num_envs > 1 else None,
                    **{k: np.stack([lanes[e][k][pos[e]] for e in env]) if num_envs > 1 else lanes[0][k][pos[0]]
                       for k in lanes[0]})
            pos[env] += 1
        else:
            n = int(min(rng.integers(1, 90), steps - pos.max()))
            if n <= 0 or len(set(pos.tolist())) > 1:
                continue
            p = pos[0]
            data = {k: np.stack([lanes[e][k][p:p + n] for e in range(num_envs)], axis=1) for k in lanes[0]}
            buf.extend(data if num_envs > 1 else {k: v[:, 0] for k, v in data.items()})
            pos += n
        if rng.random() < 0.05:
            buf.flush()


@pytest.mark.parametrize("capacity", [None, 240])
@pytest.mark.parametrize("num_envs", [1, 2])
def test_next_obs_derived_and_returns_equal_reference(tmp_path, capacity, num_envs):
    rng = np.random.default_rng(capacity or 7 + num_envs)
    steps = 400
    lanes = [make_lane(rng, steps) for _ in range(num_envs)]
    spec = dr.EpisodicReturn(gamma=0.9, default_return=-1.0, clip=(-1.0, 1.0))
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=capacity and capacity * num_envs, num_envs=num_envs,
                                 chunk_rows=16, derive_next=("obs",), episodic_return=spec, seed=0)
    fill(buf, lanes, steps, rng)

    def check(b):
        ids = b.row_ids()
        lane, step = ids % num_envs, ids // num_envs
        rows = b[ids]
        for e in range(num_envs):
            sel = lane == e
            src = lanes[e]
            done = src["terminated"] | src["truncated"]
            ret, _ = ref_episodic(src["reward"], done, 0.9, -1.0, (-1.0, 1.0))
            ret = np.asarray(ret)
            np.testing.assert_array_equal(rows["obs"][sel], src["obs"][step[sel]])
            np.testing.assert_array_equal(rows["next_obs"][sel], src["next_obs"][step[sel]])
            np.testing.assert_allclose(rows["return"][sel], ret[step[sel]], rtol=1e-5, atol=1e-5)

    check(buf)
    batch = buf.sample(64, n_step=3, gamma=0.9)
    assert batch["next_obs"].shape == (64, 3)
    buf.close()
    check(dr.ReplayBuffer.open(url, "r"))
    again = dr.ReplayBuffer.open(url, "r+")
    check(again)
    again.close()


def test_next_obs_is_not_stored_twice(tmp_path):
    rng = np.random.default_rng(0)
    lane = make_lane(rng, 500)
    url = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(url, FIELDS, chunk_rows=64, derive_next=("obs",), compression=None) as buf:
        buf.extend(lane)
    group = zarr.open_group(url, mode="r")
    assert "next_obs" not in group.array_keys()
    assert sorted(group.array_keys()) == ["obs", "reward", "terminated", "truncated"]
    finals = group["final"]["obs"]
    ends = np.flatnonzero(lane["terminated"] | lane["truncated"])
    np.testing.assert_array_equal(finals[0, : len(ends)], lane["next_obs"][ends])


def test_unflushed_steps_after_reopen_are_replaced_consistently(tmp_path):
    """A writer that adds (and ends episodes) after its last flush, then dies: the reopened
    writer re-adds different steps; final observations must follow the new steps, and the
    episode the crash cut ends at the last committed step (closed as truncated, with the next
    observation the dead writer had seen), never merged with the new writer's first episode."""
    rng = np.random.default_rng(3)
    first, second = make_lane(rng, 300), make_lane(rng, 300)
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, chunk_rows=16, derive_next=("obs",))
    buf.extend({k: v[:150] for k, v in first.items()})
    buf.flush()
    buf.extend({k: v[150:] for k, v in first.items()})
    buf.view.finals.flush()  # the side store may run ahead of the main commit
    for storage in (buf.storage, buf.view.finals):  # simulate the process dying without closing
        storage._log.lock.release()
    again = dr.ReplayBuffer.open(url, "r+")
    assert len(again) == 150
    again.extend({k: v[150:] for k, v in second.items()})
    rows = again[again.row_ids()]
    expected = {k: np.concatenate([first[k][:150], second[k][150:]]) for k in first}
    expected["truncated"][149] |= not expected["terminated"][149]
    np.testing.assert_array_equal(rows["next_obs"], expected["next_obs"])
    ends = np.flatnonzero(expected["terminated"] | expected["truncated"])
    np.testing.assert_array_equal(again.view.finals.gather(np.zeros(len(ends), int), np.arange(len(ends)))["obs"],
                                  expected["next_obs"][ends])
    again.close()


def test_derived_field_configuration_errors(tmp_path):
    with pytest.raises(ValueError, match="derive_next: expected fields 'action' and 'next_action'"):
        dr.ReplayBuffer.create(str(tmp_path / "a"), FIELDS, derive_next=("action",))
    with pytest.raises(ValueError, match="need episode ends"):
        dr.ReplayBuffer.create(str(tmp_path / "b"), FIELDS, derive_next=("obs",), episode_end=None)
    with pytest.raises(dr.SchemaError, match="'return' is computed by the buffer"):
        dr.ReplayBuffer.create(str(tmp_path / "c"), {**FIELDS, "return": dr.Field((), "float32")},
                               episodic_return=dr.EpisodicReturn())
    with pytest.raises(dr.SchemaError, match="expected a scalar reward field 'r'"):
        dr.ReplayBuffer.create(str(tmp_path / "d"), FIELDS, episodic_return=dr.EpisodicReturn(reward="r"))
    with pytest.raises(ValueError, match="gamma must be in"):
        dr.EpisodicReturn(gamma=1.5)


def test_return_field_is_not_an_input(tmp_path):
    buf = dr.ReplayBuffer.create(str(tmp_path / "buf"), FIELDS, episodic_return=dr.EpisodicReturn(gamma=0.5))
    step = {"obs": np.zeros(3), "next_obs": np.zeros(3), "reward": 1.0, "terminated": False, "truncated": False}
    with pytest.raises(dr.SchemaError, match="unknown \\['return'\\]"):
        buf.add(**step, **{"return": 0.0})
    buf.add(**step)
    assert buf[0]["return"] == 0.0  # default until the episode ends
    buf.add(**{**step, "terminated": True})
    np.testing.assert_allclose(buf[[0, 1]]["return"], [1.5, 1.0])
    assert "return" in buf.fields


def test_episode_index_is_pruned_and_derived_rows_stay_right(tmp_path):
    """Thousands of short episodes through a small ring: the index drops ends older than the
    window at flush, and ordinals of final observations stay aligned (also after reopen)."""
    rng = np.random.default_rng(11)
    lane = make_lane(rng, 12_000)
    lane["terminated"] = rng.random(12_000) < 0.4  # ~4,800 episode ends
    lane["truncated"][:] = False
    done = lane["terminated"]
    lane["next_obs"] = np.where(done[:, None], rng.standard_normal((12_000, 3)).astype(np.float32),
                                np.concatenate([lane["obs"][1:], lane["obs"][-1:]]))
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=500, chunk_rows=50, derive_next=("obs",))
    for start in range(0, 12_000, 1000):
        buf.extend({k: v[start:start + 1000] for k, v in lane.items()})
        buf.flush()
    assert len(buf.episode_index.ends(0)) < 1500  # pruned: far fewer than the ~4,800 ends
    for b in (buf, dr.ReplayBuffer.open(url, "r")):
        ids = b.row_ids()
        rows = b[ids]
        np.testing.assert_array_equal(rows["next_obs"], lane["next_obs"][ids])
        table = b.episodes()
        assert table.start[0] == ids[0] and table.length.sum() == len(ids)


@pytest.mark.parametrize("capacity", [None, 240])
@pytest.mark.parametrize("kwargs", [dict(stack=4), dict(stack=3, n_step=2, gamma=0.9), dict(stack=1)])
def test_frame_stacks_of_a_derived_next_equal_those_of_a_stored_one(tmp_path, capacity, kwargs):
    """Stacks cross episode ends (final observations), the newest step (its next_obs in RAM)
    and, in the ring, the wrap; the stacks of obs and next_obs share their frames."""
    rng = np.random.default_rng(5)
    lanes = [make_lane(rng, 400) for _ in range(2)]
    bufs = []
    for name, derive in (("derived", ("obs",)), ("stored", ())):
        buf = dr.ReplayBuffer.create(str(tmp_path / name), FIELDS, capacity=capacity and 2 * capacity, num_envs=2,
                                     chunk_rows=16, derive_next=derive, episode_end=("terminated", "truncated"),
                                     seed=3)
        fill(buf, lanes, 400, np.random.default_rng(9))
        bufs.append(buf)
    for seed in range(3):
        derived, stored = (b.sample(128, seed=seed, **kwargs) for b in bufs)
        assert derived.keys() == stored.keys()
        for key in stored:
            np.testing.assert_array_equal(derived[key], stored[key], err_msg=key)
    if "n_step" not in kwargs and kwargs["stack"] > 1:
        assert np.shares_memory(derived["obs"], derived["next_obs"])
        np.testing.assert_array_equal(derived["obs"][:, 1:], derived["next_obs"][:, :-1])
    with pytest.raises(ValueError, match=r"stack_fields: 'pixels' is not a field; the buffer has \['obs', "):
        bufs[0].sample(4, stack=2, stack_fields=("pixels",))


def test_a_derived_twin_and_its_base_come_from_one_gather(tmp_path):
    """The base at the steps and the following steps, and the small stored fields with it, are
    one storage gather; a large field that is not a base is read at the steps only."""
    rng = np.random.default_rng(3)
    lane = make_lane(rng, 300)
    lane["frame"] = rng.integers(0, 256, (300, 300), dtype=np.uint8)  # 300 B rows: more than PAIRED_ROW_BYTES
    fields = {**FIELDS, "frame": dr.Field((300,), "uint8")}
    buf = dr.ReplayBuffer.create(str(tmp_path / "buf"), fields, chunk_rows=32, derive_next=("obs",))
    buf.extend(lane)
    calls = []
    storage_gather = buf.view.storage.gather

    def counted(lanes, steps, names=None, out=None):
        calls.append((tuple(names), len(steps)))
        return storage_gather(lanes, steps, names, out)

    buf.view.storage.gather = counted
    step = np.array([0, 5, 17, 118, 299] + np.flatnonzero(lane["terminated"] | lane["truncated"])[:3].tolist())
    zeros = np.zeros(len(step), dtype=np.int64)
    rows = buf.view.gather(zeros, step)
    assert calls == [(("obs", "reward", "terminated", "truncated"), 2 * len(step)), (("frame",), len(step))]
    for name, values in rows.items():
        np.testing.assert_array_equal(values, lane[name][step], err_msg=name)
    calls.clear()
    rows = buf.view.gather(zeros, step, ("next_obs",))  # the base alone: at the following steps only
    assert calls == [(("obs",), len(step))]
    np.testing.assert_array_equal(rows["next_obs"], lane["next_obs"][step])
    calls.clear()
    out = {"next_obs": np.empty((len(step), 3), np.float32)}
    rows = buf.view.gather(zeros, step, ("obs", "next_obs"), out=out)  # out=: each at its own steps
    assert calls == [(("obs",), len(step)), (("obs",), len(step))]
    assert rows["next_obs"] is out["next_obs"]
    np.testing.assert_array_equal(out["next_obs"], lane["next_obs"][step])
    buf.close()
