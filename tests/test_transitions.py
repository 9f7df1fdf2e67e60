"""Sample-time transitions (n-step, frame stacks, HER) and the episode table, against a
plain-Python reference of every row ever added per lane.

Buffers are rings (capacity smaller than the rows added, small chunks) with several env lanes
filled unevenly (``add``/``extend`` with ``env_ids`` subsets); episodes have random lengths and
end by termination, truncation or both.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diskreplay as dr
from diskreplay.episodes import transforms as transitions

LANE_STRIDE = 10_000  # obs[0] = lane * LANE_STRIDE + step: every row ever added is identifiable

FIELDS = {
    "obs": dr.Field((2,), "float32"),
    "next_obs": dr.Field((2,), "float32"),
    "reward": dr.Field((), "float32"),
    "terminated": dr.Field((), "bool"),
    "truncated": dr.Field((), "bool"),
    "achieved_goal": dr.Field((2,), "float32"),
    "next_achieved_goal": dr.Field((2,), "float32"),
    "desired_goal": dr.Field((2,), "float32"),
}
DONE_FIELDS = {
    "obs": dr.Field((2,), "float32"),
    "next_obs": dr.Field((2,), "float32"),
    "reward": dr.Field((), "float32"),
    "done": dr.Field((), "bool"),
}

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def her_reward(achieved, goal):
    return -np.abs(np.asarray(achieved, np.float64) - np.asarray(goal, np.float64)).sum(-1)


# --------------------------------------------------------------------------- #
# the reference world: every row ever added per lane, and the buffer fed the same rows
# --------------------------------------------------------------------------- #
class World:
    def __init__(self, buf: dr.ReplayBuffer, seed: int, done_only: bool = False, max_episode: int = 9):
        self.buf = buf
        self.E = buf.num_envs
        self.cap = buf.capacity // self.E if buf.capacity else None
        self.rng = np.random.default_rng(seed)
        self.done_only = done_only
        self.max_episode = max_episode
        self.rows: list[list[dict]] = [[] for _ in range(self.E)]
        self.left = [int(self.rng.integers(1, max_episode + 1)) for _ in range(self.E)]

    # -- generation
    def _row(self, lane: int) -> dict:
        t = len(self.rows[lane])
        rid = float(lane * LANE_STRIDE + t)
        self.left[lane] -= 1
        end = self.left[lane] == 0
        kind = int(self.rng.integers(0, 3))  # 0 terminated, 1 truncated, 2 both
        row = {"obs": np.array([rid, 0], np.float32), "next_obs": np.array([rid, 1], np.float32),
               "reward": np.float32(self.rng.normal())}
        if self.done_only:
            row["done"] = np.bool_(end)
        else:
            row["terminated"] = np.bool_(end and kind != 1)
            row["truncated"] = np.bool_(end and kind != 0)
            row["achieved_goal"] = np.array([rid, 2], np.float32)
            row["next_achieved_goal"] = np.array([rid, 3], np.float32)
            row["desired_goal"] = np.array([rid, 4], np.float32)
        if end:
            self.left[lane] = int(self.rng.integers(1, self.max_episode + 1))
        self.rows[lane].append(row)
        return row

    def _lanes(self) -> np.ndarray | None:
        if self.rng.random() < 0.25:
            return None
        size = int(self.rng.integers(1, self.E + 1))
        return np.sort(self.rng.choice(self.E, size, replace=False))

    def add_step(self) -> None:
        ids = self._lanes()
        lanes = range(self.E) if ids is None else ids.tolist()
        rows = [self._row(lane) for lane in lanes]
        data = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        if self.E == 1 and ids is None:
            self.buf.add(**{k: v[0] for k, v in data.items()})
        else:
            self.buf.add(env_ids=ids, **data)

    def extend(self, count: int) -> None:
        ids = self._lanes()
        lanes = list(range(self.E)) if ids is None else ids.tolist()
        per_lane = [[self._row(lane) for _ in range(count)] for lane in lanes]  # [lane][time]
        data = {k: np.stack([np.stack([per_lane[j][i][k] for j in range(len(lanes))]) for i in range(count)])
                for k in per_lane[0][0]}
        if self.E == 1 and ids is None:
            self.buf.extend({k: v[:, 0] for k, v in data.items()})
        else:
            self.buf.extend(data, env_ids=ids)

    def fill(self, ops: int) -> None:
        for _ in range(ops):
            if self.rng.random() < 0.2:
                self.extend(int(self.rng.integers(1, 12)))
            else:
                self.add_step()

    # -- reference queries (plain Python)
    def window(self, lane: int) -> tuple[int, int]:
        hi = len(self.rows[lane])
        lo = 0 if self.cap is None else max(0, hi - self.cap)
        return lo, hi

    def done(self, lane: int, t: int) -> bool:
        r = self.rows[lane][t]
        return bool(r["done"]) if self.done_only else bool(r["terminated"] or r["truncated"])

    def terminated(self, lane: int, t: int) -> bool:
        r = self.rows[lane][t]
        return bool(r["done"]) if self.done_only else bool(r["terminated"])

    def true_start(self, lane: int, t: int) -> int:
        s = t
        while s > 0 and not self.done(lane, s - 1):
            s -= 1
        return s

    def first_step(self, lane: int, t: int) -> int:
        return max(self.true_start(lane, t), self.window(lane)[0])

    def last_step(self, lane: int, t: int) -> int:
        hi = self.window(lane)[1]
        s = t
        while s < hi - 1 and not self.done(lane, s):
            s += 1
        return s

    def decode(self, row_id: int) -> tuple[int, int]:
        step, lane = divmod(int(row_id), self.E)
        lo, hi = self.window(lane)
        assert lo <= step < hi, f"row id {row_id} (lane {lane}, step {step}) outside window [{lo}, {hi})"
        return lane, step

    def ref_episodes(self):
        out = []
        for lane in range(self.E):
            lo, hi = self.window(lane)
            t = lo
            while t < hi:
                end = self.last_step(lane, t)
                ended = self.done(lane, end)
                out.append((lane, t, end - t + 1, bool(ended and self.true_start(lane, t) == t)))
                t = end + 1
        return out


def make_world(url, *, num_envs=3, lane_cap=20, chunk_rows=8, seed=0, done_only=False, sampler=None,
               max_episode=9) -> World:
    capacity = None if lane_cap is None else lane_cap * num_envs
    buf = dr.ReplayBuffer.create(url, DONE_FIELDS if done_only else FIELDS, capacity, num_envs=num_envs,
                                 chunk_rows=chunk_rows, sampler=sampler, seed=seed, compression=None,
                                 cache_bytes=1 << 16)
    return World(buf, seed, done_only, max_episode)


worlds = st.fixed_dictionaries({
    "num_envs": st.sampled_from([3, 3, 1]),
    "lane_cap": st.sampled_from([None, 9, 13, 20, 32, 40]),
    "chunk_rows": st.sampled_from([8, 16, 32]),
    "seed": st.integers(0, 2**31 - 1),
    "ops": st.integers(1, 90),
})


def build(params, memory_url_factory, **kw) -> World:
    w = make_world(memory_url_factory(), num_envs=params["num_envs"], lane_cap=params["lane_cap"],
                   chunk_rows=params["chunk_rows"], seed=params["seed"], **kw)
    w.fill(params["ops"])
    return w


@pytest.fixture
def new_url():
    import uuid

    import fsspec

    names = []

    def factory():
        name = f"diskreplay-transitions-{uuid.uuid4().hex}"
        names.append(name)
        return f"memory://{name}"

    yield factory
    gc.collect()  # unclosed buffers release their locks now, not mid-way through rm
    fs = fsspec.filesystem("memory")
    for name in names:
        for _ in range(3):  # an unclosed buffer's chunk write behind may race the removal: again
            try:
                if fs.exists(f"/{name}"):
                    fs.rm(f"/{name}", recursive=True)
                break
            except FileNotFoundError:
                continue


# --------------------------------------------------------------------------- #
# checks against the reference
# --------------------------------------------------------------------------- #
def check_plain(w: World, batch: dict, skip=()) -> None:
    for b, rid in enumerate(batch["index"].tolist()):
        lane, t = w.decode(rid)
        for name, value in w.rows[lane][t].items():
            if name not in skip:
                np.testing.assert_array_equal(batch[name][b], value, err_msg=f"{name} row {rid}")


def check_nstep(w: World, batch: dict, n: int, gamma: float) -> None:
    next_fields = [k for k in w.rows[0][0] if k.startswith("next_")] if any(w.rows) else []
    for b, rid in enumerate(batch["index"].tolist()):
        lane, t = w.decode(rid)
        hi = w.window(lane)[1]
        total, k = 0.0, 0
        for i in range(n):
            s = t + i
            if s >= hi:
                break
            total += gamma ** i * float(w.rows[lane][s]["reward"])
            k += 1
            if w.done(lane, s):
                break
        last = t + k - 1
        discount = gamma ** k * (0.0 if w.terminated(lane, last) else 1.0)
        assert batch["reward"][b] == pytest.approx(total, rel=1e-5, abs=1e-5), (rid, n, gamma)
        assert batch["discount"][b] == pytest.approx(discount, rel=1e-6, abs=1e-7), (rid, k, last)
        for name in next_fields:
            np.testing.assert_array_equal(batch[name][b], w.rows[lane][last][name], err_msg=f"{name} row {rid}")
    assert batch["reward"].dtype == np.float32 and batch["discount"].dtype == np.float32


def check_stack(w: World, batch: dict, frames: int) -> None:
    assert batch["obs"].shape == (len(batch["index"]), frames, 2)
    assert batch["next_obs"].shape == (len(batch["index"]), frames, 2)
    for b, rid in enumerate(batch["index"].tolist()):
        lane, t = w.decode(rid)
        first = w.first_step(lane, t)
        for i in range(frames):
            s = max(t - (frames - 1) + i, first)
            np.testing.assert_array_equal(batch["obs"][b, i], w.rows[lane][s]["obs"], err_msg=f"row {rid} frame {i}")
        np.testing.assert_array_equal(batch["next_obs"][b, :-1], batch["obs"][b, 1:])
        np.testing.assert_array_equal(batch["next_obs"][b, -1], w.rows[lane][t]["next_obs"])
        # never another lane, never another episode
        lanes = batch["obs"][b, :, 0] // LANE_STRIDE
        steps = batch["obs"][b, :, 0] % LANE_STRIDE
        assert (lanes == lane).all() and (steps >= first).all() and (np.diff(steps) >= 0).all()


def check_her(w: World, batch: dict, her: dr.HER, batch_size: int) -> None:
    relabelled = batch["relabelled"]
    assert relabelled.dtype == np.bool_ and relabelled.shape == (batch_size,)
    ended = np.array([w.done(lane, w.last_step(lane, t)) for lane, t in map(w.decode, batch["index"].tolist())])
    eligible = ended if her.unfinished == "skip" else np.ones(batch_size, bool)
    assert int(relabelled.sum()) == round(int(eligible.sum()) * her.k / (her.k + 1))
    assert not (relabelled & ~eligible).any(), "a row of an unfinished episode was relabelled"
    for b, rid in enumerate(batch["index"].tolist()):
        lane, t = w.decode(rid)
        row = w.rows[lane][t]
        if not relabelled[b]:
            np.testing.assert_array_equal(batch["desired_goal"][b], row["desired_goal"])
            assert batch["reward"][b] == row["reward"]
            continue
        goal = batch["desired_goal"][b]
        assert goal[1] == 3, f"relabelled goal {goal} is not a next_achieved_goal"
        src_lane, src = divmod(int(goal[0]), LANE_STRIDE)
        assert src_lane == lane
        np.testing.assert_array_equal(goal, w.rows[lane][src]["next_achieved_goal"])
        last = w.last_step(lane, t)
        if her.strategy == "future":
            assert t <= src <= last, (rid, src, last)
        elif her.strategy == "final":
            assert src == last, (rid, src, last)
        else:
            assert w.first_step(lane, t) <= src <= last, (rid, src)
        assert batch["reward"][b] == np.float32(her_reward(row["next_achieved_goal"], goal))
        # untouched fields
        np.testing.assert_array_equal(batch["obs"][b], row["obs"])
        np.testing.assert_array_equal(batch["achieved_goal"][b], row["achieved_goal"])


def check_episodes(w: World) -> None:
    table = w.buf.episodes()
    got = list(zip(table.lane.tolist(), table.start.tolist(), table.length.tolist(), table.complete.tolist()))
    assert got == w.ref_episodes()
    for k in list(range(min(len(table), 4))) + [-1]:
        if not len(table):
            break
        lane, start, length, _ = got[k]
        rows = w.buf.episode(k)
        steps = np.arange(start, start + length)
        np.testing.assert_array_equal(rows["index"], steps * w.E + lane)
        np.testing.assert_array_equal(rows["obs"][:, 0], lane * LANE_STRIDE + steps)
        np.testing.assert_array_equal(rows["reward"], [w.rows[lane][s]["reward"] for s in steps])


# --------------------------------------------------------------------------- #
# n-step
# --------------------------------------------------------------------------- #
@SETTINGS
@given(params=worlds, n=st.integers(1, 6), gamma=st.sampled_from([0.0, 0.5, 0.9, 0.99, 1.0]))
def test_nstep_matches_reference(new_url, params, n, gamma):
    w = build(params, new_url)
    batch = w.buf.sample(64, n_step=n, gamma=gamma, seed=params["seed"])
    check_nstep(w, batch, n, gamma)
    check_plain(w, batch, skip=("reward", "next_obs", "next_achieved_goal"))


@SETTINGS
@given(params=worlds, n=st.integers(1, 5))
def test_nstep_done_only_buffer(new_url, params, n):
    w = build(params, new_url, done_only=True)
    batch = w.buf.sample(48, n_step=n, gamma=0.9, seed=1)
    check_nstep(w, batch, n, 0.9)


@SETTINGS
@given(params=worlds, n=st.integers(1, 5))
def test_nstep_with_prioritized_sampler(new_url, params, n):
    w = build(params, new_url, sampler=dr.Prioritized(alpha=0.7))
    batch = w.buf.sample(32, n_step=n, gamma=0.95, seed=3)
    assert batch["weight"].shape == (32,)
    check_nstep(w, batch, n, 0.95)
    w.buf.update_priorities(batch["index"], np.abs(batch["reward"]) + np.arange(32))
    batch = w.buf.sample(32, n_step=n, gamma=0.95, seed=4)
    check_nstep(w, batch, n, 0.95)


def test_nstep_truncation_bootstraps_termination_does_not(new_url):
    buf = dr.ReplayBuffer.create(new_url(), FIELDS, 30, num_envs=1, chunk_rows=8, cache_bytes=1 << 16)
    w = World(buf, 0)
    # hand-written episodes: 3 steps terminated, 3 steps truncated, then 2 steps open
    flags = [(0, 0), (0, 0), (1, 0), (0, 0), (0, 0), (0, 1), (0, 0), (0, 0)]
    for t, (term, trunc) in enumerate(flags):
        row = {"obs": np.array([t, 0], np.float32), "next_obs": np.array([t, 1], np.float32),
               "reward": np.float32(t + 1), "terminated": np.bool_(term), "truncated": np.bool_(trunc),
               "achieved_goal": np.array([t, 2], np.float32), "next_achieved_goal": np.array([t, 3], np.float32),
               "desired_goal": np.array([t, 4], np.float32)}
        w.rows[0].append(row)
        buf.add(**row)
    batch = buf.sample(200, n_step=3, gamma=0.5, seed=0)
    check_nstep(w, batch, 3, 0.5)
    got = {int(i): (float(r), float(d), float(nx[0])) for i, r, d, nx in
           zip(batch["index"], batch["reward"], batch["discount"], batch["next_obs"])}
    assert got[0] == (1 + 0.5 * 2 + 0.25 * 3, 0.0, 2)  # terminated at step 2
    assert got[3] == (4 + 0.5 * 5 + 0.25 * 6, 0.125, 5)  # truncated at 5: bootstraps
    assert got[4] == (5 + 0.5 * 6, 0.25, 5)
    assert got[6] == (7 + 0.5 * 8, 0.25, 7)  # stops at the newest row, bootstraps
    assert got[7] == (8, 0.5, 7)


# --------------------------------------------------------------------------- #
# frame stacks
# --------------------------------------------------------------------------- #
@SETTINGS
@given(params=worlds, frames=st.sampled_from([1, 2, 4]))
def test_frame_stack_matches_reference(new_url, params, frames):
    w = build(params, new_url)
    batch = w.buf.sample(64, stack=frames, seed=params["seed"])
    check_stack(w, batch, frames)
    check_plain(w, batch, skip=("obs", "next_obs"))
    # other stack_fields: each stacked with its next_ twin, obs left alone
    batch = w.buf.sample(16, stack=frames, stack_fields=("achieved_goal",), seed=1)
    check_plain(w, batch, skip=("achieved_goal", "next_achieved_goal"))
    for b, rid in enumerate(batch["index"].tolist()):
        lane, t = w.decode(rid)
        first = w.first_step(lane, t)
        want = [w.rows[lane][max(t - frames + 1 + i, first)]["achieved_goal"] for i in range(frames)]
        np.testing.assert_array_equal(batch["achieved_goal"][b], want)
        np.testing.assert_array_equal(batch["next_achieved_goal"][b],
                                      want[1:] + [w.rows[lane][t]["next_achieved_goal"]])


def check_nstep_stack(w: World, batch: dict, n: int, frames: int) -> None:
    """With n-step returns the next_ stack belongs to the last step used, t+k-1."""
    for b, rid in enumerate(batch["index"].tolist()):
        lane, t = w.decode(rid)
        first, last = w.first_step(lane, t), min(t + n - 1, w.last_step(lane, t))
        want = [w.rows[lane][max(last - frames + 1 + i, first)]["obs"] for i in range(frames)]
        want = want[1:] + [w.rows[lane][last]["next_obs"]]
        np.testing.assert_array_equal(batch["next_obs"][b], want, err_msg=f"row {rid}")


@SETTINGS
@given(params=worlds, n=st.integers(1, 4), frames=st.sampled_from([1, 3]))
def test_frame_stack_next_step(new_url, params, n, frames):
    w = build(params, new_url)
    buf = w.buf
    lo, hi = buf.storage.window()
    ids = buf.row_ids()
    lane, step = np.divmod(ids, w.E)[::-1]
    next_step = np.minimum(step + n - 1, transitions.episode_last_step(buf.episode_index, lane, step, hi))
    out = transitions.frame_stack(buf.view, buf.episode_index, lane, step, lo, frames, ("obs",), next_step=next_step)
    for b, _rid in enumerate(ids.tolist()):
        t, first = int(step[b]), w.first_step(int(lane[b]), int(step[b]))
        want = [w.rows[lane[b]][max(t - frames + 1 + i, first)]["obs"] for i in range(frames)]
        np.testing.assert_array_equal(out["obs"][b], want)
    check_nstep_stack(w, {"index": ids, "next_obs": out["next_obs"]}, n, frames)


def test_nstep_with_frame_stack(new_url):
    w = make_world(new_url(), num_envs=3, lane_cap=20, chunk_rows=8, seed=2)
    w.fill(60)
    batch = w.buf.sample(64, n_step=3, gamma=0.9, stack=4, seed=0)
    check_nstep_stack(w, batch, 3, 4)


# --------------------------------------------------------------------------- #
# HER
# --------------------------------------------------------------------------- #
@SETTINGS
@given(params=worlds, strategy=st.sampled_from(["future", "final", "episode"]), k=st.sampled_from([0, 1, 4]),
       batch_size=st.sampled_from([1, 5, 40]), unfinished=st.sampled_from(["skip", "newest"]))
def test_her_relabels_from_same_episode(new_url, params, strategy, k, batch_size, unfinished):
    w = build(params, new_url)
    her = dr.HER(reward_fn=her_reward, strategy=strategy, k=k, unfinished=unfinished)
    batch = w.buf.sample(batch_size, her=her, seed=params["seed"])
    check_her(w, batch, her, batch_size)


def test_her_future_covers_the_episode_tail(new_url):
    w = make_world(new_url(), num_envs=3, lane_cap=20, chunk_rows=8, seed=5)
    w.fill(80)
    her = dr.HER(reward_fn=her_reward, strategy="future", k=4)
    seen = set()
    for seed in range(10):
        batch = w.buf.sample(100, her=her, seed=seed)
        check_her(w, batch, her, 100)
        for b in np.flatnonzero(batch["relabelled"]):
            lane, t = w.decode(batch["index"][b])
            seen.add(int(batch["desired_goal"][b, 0]) % LANE_STRIDE - t)
    assert 0 in seen and max(seen) >= 3  # offsets 0.. drawn, not only the step itself


# --------------------------------------------------------------------------- #
# episodes()
# --------------------------------------------------------------------------- #
@SETTINGS
@given(params=worlds)
def test_episodes_table_matches_reference(new_url, params):
    w = build(params, new_url)
    check_episodes(w)


def test_episodes_partial_and_open(new_url):
    buf = dr.ReplayBuffer.create(new_url(), DONE_FIELDS, 16, num_envs=2, chunk_rows=8, cache_bytes=1 << 16)
    w = World(buf, 0, done_only=True)
    lengths = [[5, 4, 3], [2, 7]]  # lane 0: 12 steps +3 open; lane 1: 9 steps +4 open
    for lane, eps in enumerate(lengths):
        for length in eps:
            for i in range(length):
                w.rows[lane].append({"obs": np.array([lane * LANE_STRIDE + len(w.rows[lane]), 0], np.float32),
                                     "next_obs": np.zeros(2, np.float32), "reward": np.float32(i),
                                     "done": np.bool_(i == length - 1)})
    for lane, extra in enumerate([3, 4]):
        for i in range(extra):
            w.rows[lane].append({"obs": np.array([lane * LANE_STRIDE + len(w.rows[lane]), 0], np.float32),
                                 "next_obs": np.zeros(2, np.float32), "reward": np.float32(i),
                                 "done": np.bool_(False)})
    for lane in range(2):
        rows = w.rows[lane]
        buf.extend({k: np.stack([r[k] for r in rows])[:, None] for k in rows[0]}, env_ids=[lane])
    table = buf.episodes()
    got = list(zip(table.lane.tolist(), table.start.tolist(), table.length.tolist(), table.complete.tolist()))
    assert got == [(0, 7, 2, False), (0, 9, 3, True), (0, 12, 3, False),
                   (1, 5, 4, False), (1, 9, 4, False)]
    assert got == w.ref_episodes()
    check_episodes(w)
    with pytest.raises(IndexError):
        buf.episode(len(table))


# --------------------------------------------------------------------------- #
# close / reopen
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("sampler", [None, "prioritized"])
def test_identical_after_reopen(tmp_path, sampler):
    path = os.fspath(tmp_path / "buf")
    w = make_world(path, num_envs=3, lane_cap=16, chunk_rows=8, seed=11,
                   sampler=dr.Prioritized() if sampler else None)
    w.fill(70)
    if sampler:
        batch = w.buf.sample(16, seed=0)
        w.buf.update_priorities(batch["index"], np.arange(16) + 0.5)
    her = dr.HER(reward_fn=her_reward, strategy="future", k=4)
    kinds = [dict(n_step=3, gamma=0.9), dict(stack=4), dict(her=her), dict(n_step=2, stack=2), dict(stack=2, her=her)]
    before = [w.buf.sample(32, seed=7, **kw) for kw in kinds]
    table = w.buf.episodes()
    w.buf.close()

    w.buf = dr.ReplayBuffer.open(path, mode="r+")
    after = [w.buf.sample(32, seed=7, **kw) for kw in kinds]
    for a, b in zip(before, after):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    table2 = w.buf.episodes()
    for name in ("lane", "start", "length", "complete"):
        np.testing.assert_array_equal(getattr(table, name), getattr(table2, name))
    check_nstep(w, after[0], 3, 0.9)
    check_stack(w, after[1], 4)
    check_her(w, after[2], her, 32)
    check_episodes(w)
    # keep writing after reopen: the episode index continues across the reopen
    w.fill(40)
    check_nstep(w, w.buf.sample(64, n_step=4, gamma=0.8, seed=1), 4, 0.8)
    check_stack(w, w.buf.sample(64, stack=3, seed=2), 3)
    check_episodes(w)
    w.buf.close()

    reader = dr.ReplayBuffer.open(path, mode="r")
    w.buf = reader
    check_nstep(w, reader.sample(64, n_step=3, gamma=0.9, seed=5), 3, 0.9)
    check_episodes(w)
    reader.close()


# --------------------------------------------------------------------------- #
# argument errors
# --------------------------------------------------------------------------- #
def test_bad_arguments(new_url):
    w = make_world(new_url(), seed=0)
    w.fill(10)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError):
            w.buf.sample(4, n_step=bad)
        with pytest.raises(ValueError):
            w.buf.sample(4, stack=bad)
    with pytest.raises(ValueError):
        w.buf.sample(4, n_step=2, gamma=1.5)
    with pytest.raises(ValueError):
        dr.HER(reward_fn=her_reward, strategy="nearest")
    with pytest.raises(ValueError):
        dr.HER(reward_fn=her_reward, k=-1)
    plain = dr.ReplayBuffer.create(new_url(), DONE_FIELDS, 8, episode_end=None, cache_bytes=1 << 16)
    plain.add(obs=np.zeros(2), next_obs=np.zeros(2), reward=0.0, done=False)
    with pytest.raises(ValueError):
        plain.sample(2, n_step=2)
