"""How `sample(stack=k)` reads its rows: the stacks and the other fields from one gather of each
row's window of steps, equal to what the rows hold, laid out as before (obs and next_obs two views of
one window, every other field its own array)."""

import copy
import os
import pickle

import numpy as np
import pytest

import diskreplay as dr
from diskreplay.episodes import EpisodeIndex, transforms
from diskreplay.episodes import index as episode_index
from diskreplay.episodes.index import NO_END

FIELDS = {"obs": dr.Field((3, 2), "uint8"), "next_obs": dr.Field((3, 2), "uint8"),
          "goal": dr.Field((2,), "float32"), "next_goal": dr.Field((2,), "float32"),
          "image": dr.Field((20, 20), "uint8"), "action": dr.Field((), "int64"),
          "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}


def make_steps(rng: np.random.Generator, n: int, lane: int) -> dict[str, np.ndarray]:
    """A lane's steps: each next_* is the following step's value inside an episode and a value
    no step holds at an episode's end."""
    done = rng.random(n) < 0.08
    t = np.arange(n)
    obs = (np.full((n + 1, 3, 2), lane * 97) + np.arange(n + 1)[:, None, None]) % 251
    goal = np.stack([np.arange(n + 1), -np.arange(n + 1) - lane], axis=1).astype(np.float32)
    next_obs, next_goal = obs[1:].copy(), goal[1:].copy()
    next_obs[done], next_goal[done] = 250, 0.5
    return {"obs": obs[:-1].astype(np.uint8), "next_obs": next_obs.astype(np.uint8), "goal": goal[:-1],
            "next_goal": next_goal, "image": np.broadcast_to((t % 256).astype(np.uint8)[:, None, None],
                                                            (n, 20, 20)).copy(),
            "action": t * 3 + lane, "reward": rng.random(n).astype(np.float32), "done": done}


def make_buffer(path, num_envs: int, capacity: int | None, derive_next: tuple[str, ...], steps: int = 300,
                flush: bool = True, **kw) -> dr.ReplayBuffer:
    rng = np.random.default_rng(num_envs * 7 + len(derive_next))
    lanes = [make_steps(rng, steps, e) for e in range(num_envs)]
    buf = dr.ReplayBuffer.create(str(path), FIELDS, capacity=capacity and capacity * num_envs, num_envs=num_envs,
                                 chunk_rows=16, derive_next=derive_next, episode_end="done", seed=1, **kw)
    for first in range(0, steps, 50):
        data = {k: np.stack([lane[k][first:first + 50] for lane in lanes], axis=1) for k in FIELDS}
        buf.extend(data if num_envs > 1 else {k: v[:, 0] for k, v in data.items()})
    if flush:
        buf.flush()
    return buf


def expected(buf: dr.ReplayBuffer, ids: np.ndarray, stack: int, stack_fields: tuple[str, ...]) -> dict:
    """The batch `sample(stack=...)` defines, from the rows ``buf[...]`` reads one by one."""
    lane, step = ids % buf.num_envs, ids // buf.num_envs
    lo, _ = buf.storage.window()
    first = np.maximum(buf.episode_index.episode_start(lane, step), lo[lane])
    frames = np.maximum(step[:, None] + np.arange(1 - stack, 1), first[:, None])
    at_step, in_stack = buf[ids], buf[frames * buf.num_envs + lane[:, None]]
    stacked = {*stack_fields, *(f"next_{name}" for name in stack_fields)}
    out = {name: at_step[name] for name in buf.view.schema.fields if name not in stacked}  # derived twins last
    for name in stack_fields:
        out[name] = in_stack[name]
        if f"next_{name}" in FIELDS:
            out[f"next_{name}"] = np.concatenate([in_stack[name][:, 1:], at_step[f"next_{name}"][:, None]], axis=1)
    return out


CASES = [(("obs",), 4), (("obs",), 1), (("obs", "goal", "action"), 3), (("image",), 2), (("goal", "obs"), 2),
         ((), 3), (("obs", "next_obs"), 3)]


@pytest.mark.parametrize("stack_fields,stack", CASES)
@pytest.mark.parametrize("derive_next", [("obs", "goal"), ("obs",), ()])
@pytest.mark.parametrize("num_envs,capacity,flush", [(1, 200, True), (1, None, False), (3, 120, False)])
def test_stacked_batches_hold_the_rows_they_name(tmp_path, stack_fields, stack, derive_next, num_envs, capacity,
                                                 flush):
    """Episode starts and ends, each lane's newest step, the ring's oldest step, staged chunks;
    twins derived, stored, or none; small and large other fields."""
    buf = make_buffer(tmp_path / "b", num_envs, capacity, derive_next, flush=flush)
    for seed in range(3):
        batch = buf.sample(200, stack=stack, stack_fields=stack_fields, seed=seed)
        want = expected(buf, batch["index"], stack, stack_fields)
        assert list(batch) == [*want, "index"]
        for name, value in want.items():
            np.testing.assert_array_equal(batch[name], value, err_msg=name)
            assert batch[name].dtype == value.dtype
        for name, value in batch.items():  # its own array, or a view of one window of frames per row
            twin = batch.get(f"next_{name}")
            if value.flags.c_contiguous:
                continue
            assert name in stack_fields or name[5:] in stack_fields, name
            if twin is not None and not twin.flags.c_contiguous:
                assert twin.base is value.base, name  # the twin's stack: the same frames, one later
    buf.close()


def test_a_stacked_batch_is_one_gather(tmp_path, monkeypatch):
    """Stacks of obs and its derived next_obs, and every other small field: one gather of the
    rows, when no row ends its episode or is its lane's newest; a large field: one more, at the
    steps only."""
    buf = make_buffer(tmp_path / "b", 1, None, ("obs",))
    step = np.setdiff1d(np.arange(len(buf) - 1), buf.episode_index.ends(0))[::7]
    calls = []
    gather = buf.storage.gather
    monkeypatch.setattr(buf.storage, "gather", lambda *a, **k: calls.append((len(a[1]), a[2])) or gather(*a, **k))
    others = buf._batches._unstacked_fields(("obs",))
    plan = transforms.stack_plan(buf.view, 4, ("obs",), others)
    lo, hi = buf.storage.window()
    out = transforms.stacked_rows(plan, buf.view, buf.episode_index, np.zeros_like(step), step, lo, hi)
    assert calls == [(5 * len(step), ("obs", "goal", "next_goal", "action", "reward", "done")), (len(step), ("image",))]
    for name, value in expected(buf, step, 4, ("obs",)).items():
        np.testing.assert_array_equal(out[name], value, err_msg=name)


def test_kept_apart_twins_are_read_where_they_are_kept(tmp_path, monkeypatch):
    """Rows that end their episode or are their lane's newest: their derived next_obs comes from
    the side store of finals or from RAM, without a read of the main storage."""
    buf = make_buffer(tmp_path / "b", 1, None, ("obs",))
    step = np.append(buf.episode_index.ends(0)[:5], len(buf) - 1)
    assert step[-1] not in buf.episode_index.ends(0)  # the newest step, its episode still open
    calls = []
    gather = buf.storage.gather
    monkeypatch.setattr(buf.storage, "gather", lambda *a, **k: calls.append((len(a[1]), a[2])) or gather(*a, **k))
    plan = transforms.stack_plan(buf.view, 3, ("obs",), buf._batches._unstacked_fields(("obs",)))
    lo, hi = buf.storage.window()
    out = transforms.stacked_rows(plan, buf.view, buf.episode_index, np.zeros_like(step), step, lo, hi)
    assert calls == [(4 * len(step), ("obs", "goal", "next_goal", "action", "reward", "done")), (len(step), ("image",))]
    for name, value in expected(buf, step, 3, ("obs",)).items():
        np.testing.assert_array_equal(out[name], value, err_msg=name)


def test_stack_must_be_a_positive_int(tmp_path):
    buf = make_buffer(tmp_path / "b", 1, None, ("obs",), steps=50)
    buf.sample(4, stack=2)
    for bad in (0, 2.0, "2"):
        with pytest.raises(ValueError, match="stack must be an int >= 1"):
            buf.sample(4, stack=bad)
    with pytest.raises(ValueError, match="stack_fields: 'pixels' is not a field"):
        buf.sample(4, stack=2, stack_fields=("pixels",))


def ref_bounds(ends: list[int], step: int) -> tuple[int, int]:
    before = [e for e in ends if e < step]
    after = [e for e in ends if e >= step]
    return (before[-1] + 1 if before else 0), (after[0] if after else np.iinfo(np.int64).max)


@pytest.fixture(params=["compiled", "numpy"])
def searches(request, monkeypatch):
    """Episode searches by the `_search` extension, then by numpy alone."""
    if request.param == "numpy":
        monkeypatch.setattr(episode_index, "_search", None)
    elif episode_index._search is None:
        assert not os.environ.get("CI"), "CI installs with a C compiler: the extension must be built"
        pytest.skip("diskreplay.episodes._search was not built (no C compiler at install)")
    return request.param


def test_episode_bounds_follow_every_change_of_the_index(searches):
    index = EpisodeIndex(2, ("done",))
    ends = [[], []]
    rng = np.random.default_rng(0)
    for round_ in range(60):
        lane = int(rng.integers(2))
        first = (ends[lane][-1] + 1) if ends[lane] else 0
        done = rng.random(40) < 0.3
        index.on_append(lane, first, {"done": done})
        ends[lane] += (first + np.flatnonzero(done)).tolist()
        if round_ % 7 == 3:  # a failed call's steps forgotten
            cut = first + 20
            index.rewind(lane, cut)
            ends[lane] = [e for e in ends[lane] if e < cut]
        if round_ % 11 == 5:
            index.add_end(lane, (ends[lane][-1] + 3) if ends[lane] else 3)
            ends[lane].append(index.ends(lane)[-1].item())
        lanes = rng.integers(0, 2, 300)
        steps = rng.integers(0, 2500, 300)
        start, end = index.bounds(lanes, steps)
        assert list(zip(start.tolist(), end.tolist())) == [ref_bounds(ends[e], s) for e, s in zip(lanes, steps)]
    copy = EpisodeIndex(2, ("done",))
    copy.load_state_dict(index.state_dict())
    assert all(np.array_equal(a, b) for a, b in zip(copy.bounds(lanes, steps), index.bounds(lanes, steps)))


def ref_window(ends: list[int], step: int, offsets: list[int], lo: int, hi: int, clamp_last: bool) -> list[int]:
    start, end = ref_bounds(ends, step)
    window = [max(step + k, start, lo) for k in offsets]
    if clamp_last:
        window[-1] = min(window[-1], end, hi - 1)
    return window


@pytest.mark.parametrize("clamp_last", [True, False])
def test_stack_windows_stay_inside_their_episode_and_the_readable_steps(searches, clamp_last):
    index = EpisodeIndex(3, ("done",))
    rng = np.random.default_rng(4)
    ends = []
    for lane in range(3):
        done = rng.random(3000) < (0.02, 0.3, 0.0)[lane]  # long episodes, short ones, one open episode
        index.on_append(lane, 0, {"done": done})
        ends.append(np.flatnonzero(done).tolist())
    index.prune(np.array([1500, 0, 0]))  # lane 0 forgets its oldest ends
    lo, hi = np.array([1500, 10, 0]), np.array([3000, 2000, 2900])
    offsets = np.array([-3, -2, -1, 0, 1])
    lane = rng.integers(0, 3, 500)
    step = rng.integers(lo[lane], hi[lane])
    step[:3], lane[:3] = hi[:3] - 1, np.arange(3)  # each lane's newest step
    window, kept, ended = index.stack_windows(lane, step, offsets, lo, hi, clamp_last)
    assert window.tolist() == [ref_window(ends[e], s, offsets.tolist(), lo[e], hi[e], clamp_last)
                               for e, s in zip(lane.tolist(), step.tolist())]
    last = [min(ref_bounds(ends[e], s)[1], hi[e] - 1) for e, s in zip(lane.tolist(), step.tolist())]
    expected = [i for i, s in enumerate(step.tolist()) if clamp_last and last[i] == s]
    assert kept.tolist() == expected
    assert ended.tolist() == [step[i] in ends[lane[i]] for i in expected]
    assert not clamp_last or 10 < len(expected) < 200 and 0 < sum(ended) < len(expected)  # both kinds met


def test_episode_searches_reject_a_lane_or_step_out_of_range(searches):
    index = EpisodeIndex(2, ("done",))
    if searches == "compiled":  # numpy raises its own IndexError for the lane
        with pytest.raises(ValueError, match=r"step 5 of lane 2: expected a step >= 0 of a lane in \[0, 2\)"):
            index.bounds(np.array([0, 2]), np.array([5, 5]))
        with pytest.raises(ValueError, match="step -1 of lane 0"):
            index.stack_windows(np.array([0]), np.array([-1]), np.array([0]), np.zeros(2, np.int64),
                                np.ones(2, np.int64), True)
    else:
        with pytest.raises(IndexError):
            index.bounds(np.array([0, 2]), np.array([5, 5]))


@pytest.mark.parametrize("cache_bytes", [1024, None])
def test_the_newest_step_never_reads_past_the_window(tmp_path, cache_bytes):
    """The newest step's next_obs is kept apart, never read from the step after it: with the
    window ending at a chunk boundary, that step's chunk does not exist (a mapped read of it
    would fail)."""
    buf = make_buffer(tmp_path / "b", 1, None, ("obs",), steps=96, compression=None)
    buf.close()
    reader = dr.ReplayBuffer.open(str(tmp_path / "b"), "r", **({"cache_bytes": cache_bytes} if cache_bytes else {}))
    assert reader.stats().mapped == (cache_bytes is not None)
    lo, hi = reader.storage.window()
    step = np.array([hi[0] - 1, hi[0] - 2, 0])
    others = reader._batches._unstacked_fields(("obs",))
    out = transforms.stacked_rows(transforms.stack_plan(reader.view, 3, ("obs",), others), reader.view,
                                  reader.episode_index, np.zeros_like(step), step, lo, hi)
    for name, value in expected(reader, step, 3, ("obs",)).items():
        np.testing.assert_array_equal(out[name], value, err_msg=name)


@pytest.mark.parametrize("how", ["pickled", "copied", "deep-copied"])
def test_a_copied_episode_index_searches_its_own_ends(searches, how):
    index = EpisodeIndex(2, ("done",))
    index.on_append(1, 0, {"done": np.arange(20) % 5 == 4})
    copies = {"pickled": lambda x: pickle.loads(pickle.dumps(x)), "copied": copy.copy, "deep-copied": copy.deepcopy}
    twin = copies[how](index)
    index.on_append(1, 20, {"done": np.arange(20) % 2 == 1})  # in place: the arrays have room
    steps = np.array([3, 22, 25])
    assert index.bounds(np.ones(3, np.int64), steps)[1].tolist() == [4, 23, 25]
    assert twin.bounds(np.ones(3, np.int64), steps)[1].tolist() == [4, NO_END, NO_END]
    index.on_append(1, 40, {"done": np.ones(100, bool)})  # new, larger arrays; the old ones freed
    del index
    assert twin.bounds(np.ones(3, np.int64), steps)[1].tolist() == [4, NO_END, NO_END]
