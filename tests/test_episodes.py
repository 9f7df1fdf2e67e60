"""The episode index (end steps per lane) against a brute-force reference, and the buffer's
`episodes()` / `episode(k)` views of it, across lanes, ring wrap-around and close/open."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import diskreplay as dr
from diskreplay.episodes import NO_END, EpisodeIndex

pytestmark = pytest.mark.usefixtures("no_fsync")

FIELDS = {"obs": dr.Field((), "int64"), "done": dr.Field((), "bool")}


# ---- brute-force reference --------------------------------------------------------------------


def ref_table(done_lanes, lo, hi):
    """[(lane, start, length, complete)] by walking every readable step."""
    rows = []
    for lane, done in enumerate(done_lanes):
        a, b = int(lo[lane]), int(hi[lane])
        if b <= a:
            continue
        start = a
        true_start = a == 0 or bool(done[a - 1])
        for t in range(a, b):
            if done[t]:
                rows.append((lane, start, t - start + 1, true_start))
                start, true_start = t + 1, True
        if start < b:
            rows.append((lane, start, b - start, False))  # open: not ended yet
    return rows


def ref_next_end(done, step):
    for t in range(step, len(done)):
        if done[t]:
            return t
    return NO_END


def ref_episode_start(done, step):
    for t in range(step - 1, -1, -1):
        if done[t]:
            return t + 1
    return 0


def ref_window_starts(done_lanes, lo, hi, L):
    return [(lane, s, n - L + 1) for lane, s, n, _ in ref_table(done_lanes, lo, hi) if n >= L]


def table_rows(t):
    return list(zip(t.lane.tolist(), t.start.tolist(), t.length.tolist(), t.complete.tolist()))


# ---- EpisodeIndex vs reference (hypothesis) ---------------------------------------------------


@st.composite
def scenarios(draw):
    num_envs = draw(st.integers(1, 3))
    lane_cap = draw(st.one_of(st.none(), st.integers(1, 12)))
    n_lanes = [draw(st.lists(st.booleans(), min_size=0, max_size=40)) for _ in range(num_envs)]
    # append each lane's steps in random pieces (pieces of 0 steps are no-ops)
    pieces = [draw(st.lists(st.integers(1, 9), min_size=0, max_size=10)) for _ in range(num_envs)]
    seq_len = draw(st.integers(1, 5))
    return num_envs, lane_cap, n_lanes, pieces, seq_len


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_episode_index_matches_reference(scenario):
    num_envs, lane_cap, done_lanes, pieces, L = scenario
    index = EpisodeIndex(num_envs, ("terminated", "truncated"))
    for lane, done in enumerate(done_lanes):
        done = np.array(done, bool)
        pos = 0
        for size in pieces[lane] + [len(done)]:
            part = done[pos:pos + size]
            if len(part) == 0:
                break
            # split the flag over the two end fields at random-ish but deterministically
            term = part & (np.arange(len(part)) % 2 == 0)
            index.on_append(lane, pos, {"terminated": term, "truncated": part & ~term})
            pos += len(part)
    hi = np.array([len(d) for d in done_lanes], np.int64)
    lo = hi * 0 if lane_cap is None else np.maximum(hi - lane_cap, 0)

    assert table_rows(index.table(lo, hi)) == ref_table(done_lanes, lo, hi)

    lanes, firsts, counts = index.window_starts(lo, hi, L)
    assert list(zip(lanes.tolist(), firsts.tolist(), counts.tolist())) == ref_window_starts(done_lanes, lo, hi, L)

    lane = np.concatenate([np.full(int(high - low), e) for e, (low, high) in enumerate(zip(lo, hi))]
                          + [np.zeros(0, int)])
    step = np.concatenate([np.arange(low, high) for low, high in zip(lo, hi)] + [np.zeros(0, int)])
    order = np.random.default_rng(len(step)).permutation(len(step))  # mixed lanes in one call
    lane, step = lane[order].astype(np.int64), step[order].astype(np.int64)
    assert index.next_end(lane, step).tolist() == [ref_next_end(done_lanes[e], s) for e, s in zip(lane, step)]
    assert index.episode_start(lane, step).tolist() == [ref_episode_start(done_lanes[e], s)
                                                         for e, s in zip(lane, step)]
    assert index.end_ordinal(lane, step).tolist() == [int(np.sum(done_lanes[e][:s])) for e, s in zip(lane, step)]
    # saved and restored: the same answers
    copy = EpisodeIndex(num_envs, ("terminated", "truncated"))
    copy.load_state_dict(index.state_dict())
    assert table_rows(copy.table(lo, hi)) == table_rows(index.table(lo, hi))
    assert np.array_equal(copy.next_end(lane, step), index.next_end(lane, step))


def test_prune_keeps_answers():
    rng = np.random.default_rng(0)
    done = rng.random(8000) < 0.6  # thousands of episodes
    index = EpisodeIndex(1, ("done",))
    index.on_append(0, 0, {"done": done})
    lo, hi = np.array([6000]), np.array([8000])
    before = table_rows(index.table(lo, hi))
    steps = np.arange(6000, 8000)
    ne, es = index.next_end(np.zeros_like(steps), steps), index.episode_start(np.zeros_like(steps), steps)
    index.prune(lo)
    assert len(index.ends(0)) < done.sum()  # it did drop something
    assert table_rows(index.table(lo, hi)) == before == ref_table([done], lo, hi)
    assert np.array_equal(index.next_end(np.zeros_like(steps), steps), ne)
    assert np.array_equal(index.episode_start(np.zeros_like(steps), steps), es)


# ---- the buffer's episode views -----------------------------------------------------------------


def make(tmp_path, name="buf", **kw):
    kw.setdefault("compression", None)
    kw.setdefault("chunk_rows", 8)
    return dr.ReplayBuffer.create(tmp_path / name, FIELDS, **kw)


def fill(buf, done):
    """Append ``done`` ([n, num_envs]) with obs = row id."""
    e = buf.num_envs
    n = done.shape[0]
    steps = buf.storage.total[None, :] + np.arange(n)[:, None]
    obs = steps * e + np.arange(e)
    if e == 1:
        buf.extend({"obs": obs[:, 0], "done": done[:, 0]})
    else:
        buf.extend({"obs": obs, "done": done})


@pytest.mark.parametrize("capacity", [None, 3 * 25])
def test_buffer_episodes_and_episode(tmp_path, capacity):
    rng = np.random.default_rng(1)
    e = 3
    buf = make(tmp_path, capacity=capacity, num_envs=e)
    done_all = np.zeros((0, e), bool)
    for n in (13, 30, 4, 22):  # 69 steps per lane: wraps a 25-step ring twice
        done = rng.random((n, e)) < 0.15
        fill(buf, done)
        done_all = np.concatenate([done_all, done])
    lo, hi = buf.storage.window()
    want = ref_table([done_all[:, k] for k in range(e)], lo, hi)
    table = buf.episodes()
    assert table_rows(table) == want
    assert len(table) == len(want)
    if capacity is not None:
        assert not table.complete[table.start == lo[table.lane]].all() or (lo == 0).all()
    for k in list(range(len(table))) + [-1, -len(table)]:
        lane, start, length, _ = want[k]
        rows = buf.episode(k)
        ids = (start + np.arange(length)) * e + lane
        np.testing.assert_array_equal(rows["index"], ids)
        np.testing.assert_array_equal(rows["obs"], ids)
        np.testing.assert_array_equal(rows["done"], done_all[start:start + length, lane])
    with pytest.raises(IndexError):
        buf.episode(len(table))
    # identical after close/open (writer and reader)
    last = buf.episode(-1)["obs"]
    buf.close()
    for mode in ("r+", "r"):
        again = dr.ReplayBuffer.open(tmp_path / "buf", mode=mode)
        assert table_rows(again.episodes()) == want
        np.testing.assert_array_equal(again.episode(-1)["obs"], last)
        again.close()


def test_partially_overwritten_episode_is_incomplete(tmp_path):
    buf = make(tmp_path, capacity=10)
    done = np.zeros((14, 1), bool)
    done[[5, 11], 0] = True  # episodes 0..5 (overwritten at the front), 6..11, 12..13 (open)
    fill(buf, done[:8])
    assert table_rows(buf.episodes()) == [(0, 0, 6, True), (0, 6, 2, False)]
    fill(buf, done[8:])  # readable steps 4..13
    assert table_rows(buf.episodes()) == [(0, 4, 2, False), (0, 6, 6, True), (0, 12, 2, False)]
    np.testing.assert_array_equal(buf.episode(0)["obs"], [4, 5])
    fill(buf, np.zeros((2, 1), bool))  # steps 4, 5 (the rest of the first episode) overwritten
    lo, hi = buf.storage.window()
    assert (lo[0], hi[0]) == (6, 16)
    assert table_rows(buf.episodes()) == [(0, 6, 6, True), (0, 12, 4, False)]
    fill(buf, np.zeros((1, 1), bool))  # now step 6 is gone: the episode 6..11 is partial
    assert table_rows(buf.episodes()) == [(0, 7, 5, False), (0, 12, 5, False)]


def test_episode_end_fields(tmp_path):
    tt = {"obs": dr.Field((), "int64"), "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.create(tmp_path / "tt", tt, compression=None)
    buf.extend({"obs": np.arange(6), "terminated": np.eye(1, 6, 1, dtype=bool)[0],
                "truncated": np.eye(1, 6, 3, dtype=bool)[0]})
    assert table_rows(buf.episodes()) == [(0, 0, 2, True), (0, 2, 2, True), (0, 4, 2, False)]
    only = dr.ReplayBuffer.create(tmp_path / "only", tt, compression=None, episode_end="terminated")
    only.extend({"obs": np.arange(6), "terminated": np.eye(1, 6, 1, dtype=bool)[0],
                 "truncated": np.eye(1, 6, 3, dtype=bool)[0]})
    assert table_rows(only.episodes()) == [(0, 0, 2, True), (0, 2, 4, False)]
    none = dr.ReplayBuffer.create(tmp_path / "none", tt, compression=None, episode_end=None)
    with pytest.raises(ValueError):
        none.episodes()
    with pytest.raises(dr.SchemaError):
        dr.ReplayBuffer.create(tmp_path / "bad", tt, compression=None, episode_end="obs")


def test_extend_longer_than_ring_keeps_episode_start(tmp_path):
    buf = make(tmp_path, capacity=8)
    done = np.zeros((12, 1), bool)
    done[[3, 9], 0] = True
    fill(buf, done)  # only steps 4..11 are stored; the episode 4..9 began right after an end
    assert table_rows(buf.episodes()) == [(0, 4, 6, True), (0, 10, 2, False)]


def test_lane_without_any_end(tmp_path):
    buf = make(tmp_path, capacity=3 * 10, num_envs=3)
    done = np.zeros((14, 3), bool)
    done[4, 1] = True  # lanes 0 and 2 never end an episode
    fill(buf, done)  # ring wrapped: readable steps 4..13
    assert table_rows(buf.episodes()) == [(0, 4, 10, False), (1, 4, 1, False), (1, 5, 9, False),
                                          (2, 4, 10, False)]
    batch = buf.sample(64, seq_len=3, pad=True)
    lane, step = batch["start"] % 3, batch["start"] // 3
    last = np.where((lane == 1) & (step == 4), 4, 13)  # lane 1's one-step episode; else the newest step
    np.testing.assert_array_equal(batch["mask"], step[:, None] + np.arange(3) <= last[:, None])
    empty = make(tmp_path, "empty", capacity=None)
    fill(empty, np.zeros((5, 1), bool))
    assert table_rows(empty.episodes()) == [(0, 0, 5, False)]


def test_reader_refresh_sees_new_episodes(tmp_path):
    w = make(tmp_path, capacity=None)
    fill(w, np.eye(1, 6, 2, dtype=bool).T)
    w.flush()
    r = dr.ReplayBuffer.open(tmp_path / "buf", mode="r")
    fill(w, np.eye(1, 6, 2, dtype=bool).T)
    w.flush()
    assert r.refresh()
    assert table_rows(r.episodes()) == table_rows(w.episodes())
