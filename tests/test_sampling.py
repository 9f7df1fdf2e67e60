"""Samplers composed with the buffer: prioritized (PER), without replacement, recent-ratio/ERE,
trajectory slices, and exact resume of every sampler after close/open.

All randomness is seeded; statistical checks use chi-square tests with fixed seeds (so they are
deterministic) and a generous significance level.
"""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
from scipy.stats import chisquare

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.sampling import draws

pytestmark = pytest.mark.usefixtures("no_fsync")

FIELDS = {"obs": dr.Field((), "int64"), "done": dr.Field((), "bool")}
P_MIN = 1e-3  # chi-square p-values below this fail a test (seeded, so deterministic)


# ---- helpers ------------------------------------------------------------------------------


def make(tmp_path, name="buf", fields=FIELDS, **kw):
    kw.setdefault("compression", None)
    kw.setdefault("chunk_rows", 8)
    kw.setdefault("seed", 0)
    return dr.ReplayBuffer.create(tmp_path / name, fields, **kw)


def extend(buf, n, done=None):
    """Append ``n`` steps to every lane; ``obs`` holds the step's row id (step * num_envs + lane)."""
    e = buf.num_envs
    total = buf.storage.total.copy()
    steps = total[None, :] + np.arange(n)[:, None]
    obs = steps * e + np.arange(e)[None, :]
    done = np.zeros((n, e), bool) if done is None else np.asarray(done, bool).reshape(n, e)
    if e == 1:
        buf.extend({"obs": obs[:, 0], "done": done[:, 0]})
    else:
        buf.extend({"obs": obs, "done": done})


def f32(values):
    """Priorities as the sampler keeps them (float32 leaves), back in float64."""
    return np.asarray(values, np.float32).astype(np.float64)


def leaf_values(buf, ids):
    """The stored priorities (p ** alpha) of row ids, read from the sampler's saved state."""
    s = buf.sampler
    state = s.state_dict()  # applies pending new-row priorities
    lane, step = np.asarray(ids) % buf.num_envs, np.asarray(ids) // buf.num_envs
    return state["leaves"][lane * state["stride"] + buf.storage.layout.slot(step)]


def per_buffer(tmp_path, n_rows, num_envs=1, name="per", **sampler_kw):
    buf = make(tmp_path, name, capacity=n_rows, num_envs=num_envs,
               sampler=dr.Prioritized(**{"alpha": 0.6, "beta": 0.4, **sampler_kw}))
    extend(buf, n_rows // num_envs)
    return buf


# ---- prioritized: distribution and weights ------------------------------------------------


@pytest.mark.parametrize("stratified", [True, False])
@pytest.mark.parametrize("num_envs", [1, 2])
def test_per_frequencies_follow_p_alpha(tmp_path, stratified, num_envs):
    n, alpha, eps = 16, 0.6, 1e-6
    buf = per_buffer(tmp_path, n, num_envs, alpha=alpha, eps=eps, stratified=stratified)
    ids = buf.row_ids()
    td = np.random.default_rng(1).uniform(0.05, 3.0, n)
    assert buf.update_priorities(ids, td) == n
    p = (np.abs(td) + eps) ** alpha
    expected_prob = p / p.sum()
    counts = np.zeros(n * 1, np.int64)
    pos = {int(i): k for k, i in enumerate(ids)}
    draws = 0
    for _ in range(200):
        batch = buf.sample(256)
        np.add.at(counts, [pos[int(i)] for i in batch["index"]], 1)
        draws += 256
    assert chisquare(counts, expected_prob * draws).pvalue > P_MIN
    # the test has power: the uniform hypothesis is rejected outright
    assert chisquare(counts, np.full(n, draws / n)).pvalue < 1e-12


def test_per_stratified_one_draw_per_stratum(tmp_path):
    buf = per_buffer(tmp_path, 64)
    buf.update_priorities(buf.row_ids(), np.ones(64))  # equal priorities: strata = equal id ranges
    for _ in range(20):
        idx = buf.sample(8)["index"]
        assert np.array_equal(idx // 8, np.arange(8))


@pytest.mark.parametrize("num_envs", [1, 2])
def test_is_weights_exact_and_beta_override(tmp_path, num_envs):
    n, alpha, beta, eps = 32, 0.7, 0.4, 1e-6
    buf = per_buffer(tmp_path, n, num_envs, alpha=alpha, beta=beta, eps=eps)
    ids = buf.row_ids()
    td = np.random.default_rng(2).normal(0, 2, n)  # negative errors too: |td| is used
    buf.update_priorities(ids, td)
    p = dict(zip(ids.tolist(), f32((np.abs(td) + eps) ** alpha)))
    p_min = min(p.values())

    def expected(index, b):
        # (N P(i))^-b / max_j (N P(j))^-b == (p_i / p_min)^-b
        return (np.array([p[int(i)] for i in index]) / p_min) ** -b

    for b in (None, 0.7, 1.0, 0.0, None):
        batch = buf.sample(64) if b is None else buf.sample(64, beta=b)
        assert batch["weight"].dtype == np.float32
        want = expected(batch["index"], beta if b is None else b).astype(np.float32)
        np.testing.assert_array_equal(batch["weight"], want)
        assert batch["weight"].max() <= 1.0
    # the lowest-priority row has weight exactly 1 (max over the whole buffer, not the batch)
    lowest = min(p, key=p.get)
    batch = buf.sample(4096)
    assert np.all(batch["weight"][batch["index"] == lowest] == 1.0)
    # the IS weights formula with N and P(i) written out agrees (to rounding)
    N = n
    P = np.array([p[int(i)] for i in batch["index"]]) / sum(p.values())
    w_all = (N * np.array(list(p.values())) / sum(p.values())) ** -beta
    np.testing.assert_allclose(batch["weight"], (N * P) ** -beta / w_all.max(), rtol=1e-6)


# ---- prioritized: new rows, overwrite, stale updates, errors --------------------------------


def test_new_rows_get_max_priority(tmp_path):
    alpha, eps = 0.5, 1e-6
    buf = make(tmp_path, capacity=64, sampler=dr.Prioritized(alpha=alpha, eps=eps))
    extend(buf, 8)
    np.testing.assert_array_equal(leaf_values(buf, np.arange(8)), 1.0)  # default max priority 1
    buf.update_priorities([0, 1, 2], [3.0, 0.5, -4.0])
    np.testing.assert_array_equal(leaf_values(buf, [0, 1, 2]), f32((np.array([3.0, 0.5, 4.0]) + eps) ** alpha))
    extend(buf, 4)
    np.testing.assert_array_equal(leaf_values(buf, np.arange(8, 12)), f32((4.0 + eps) ** alpha))
    buf.update_priorities([8], [0.1])  # lowering a row does not lower the running max
    extend(buf, 1)
    assert leaf_values(buf, [12])[0] == f32((4.0 + eps) ** alpha)
    buf.sample(4)  # new rows are given their priority before the next draw
    extend(buf, 1)
    buf.sample(4)
    assert leaf_values(buf, [13])[0] == f32((4.0 + eps) ** alpha)


def test_initial_priority(tmp_path):
    alpha, eps = 0.6, 1e-6
    buf = make(tmp_path, capacity=64, sampler=dr.Prioritized(alpha=alpha, eps=eps, initial_priority=2.0))
    extend(buf, 4)
    np.testing.assert_array_equal(leaf_values(buf, np.arange(4)), f32(2.0 ** alpha))
    buf.update_priorities([0], [0.5])  # below the initial priority: max stays 2
    extend(buf, 2)
    np.testing.assert_array_equal(leaf_values(buf, [4, 5]), f32(2.0 ** alpha))
    buf.update_priorities([1], [9.0])
    extend(buf, 2)
    np.testing.assert_array_equal(leaf_values(buf, [6, 7]), f32((9.0 + eps) ** alpha))
    with pytest.raises(ValueError):
        dr.Prioritized(initial_priority=0.0)
    with pytest.raises(ValueError):
        dr.Prioritized(alpha=float("nan"))


@pytest.mark.parametrize("num_envs", [1, 3])
def test_ring_overwrite_takes_new_rows_priority(tmp_path, num_envs):
    alpha, eps = 0.6, 1e-6
    cap = 8 * num_envs
    buf = make(tmp_path, capacity=cap, num_envs=num_envs, sampler=dr.Prioritized(alpha=alpha, eps=eps))
    extend(buf, 8)
    ids = buf.row_ids()
    td = np.full(cap, 0.01)
    td[-1] = 10.0
    buf.update_priorities(ids, td)
    old_slot_ids = np.sort(ids)[: 3 * num_envs]  # steps 0..2 of every lane
    assert np.all(leaf_values(buf, old_slot_ids) == f32((0.01 + eps) ** alpha))
    extend(buf, 3)  # overwrites steps 0..2 of every lane (the same leaves)
    new_ids = np.arange(8 * num_envs, 11 * num_envs)
    np.testing.assert_array_equal(leaf_values(buf, new_ids), f32((10.0 + eps) ** alpha))
    # the tree total is exactly the sum over readable rows (no ghost priority of old rows)
    live = buf.row_ids()
    assert len(live) == cap
    np.testing.assert_allclose(buf.sampler.table.total(), leaf_values(buf, live).astype(np.float64).sum(), rtol=1e-12)
    # and sampling never returns an overwritten id
    idx = buf.sample(2048)["index"]
    assert np.isin(idx, live).all()


@pytest.mark.parametrize("num_envs", [1, 2])
def test_stale_updates_are_ignored(tmp_path, num_envs):
    cap = 16 * num_envs
    buf = make(tmp_path, capacity=cap, num_envs=num_envs, sampler=dr.Prioritized(alpha=0.6))
    extend(buf, 16)
    batch = buf.sample(256)
    idx = batch["index"]
    extend(buf, 5)  # overwrites steps 0..4 of each lane
    stale = idx < 5 * num_envs
    assert stale.any() and (~stale).any()
    new_ids = np.arange(16 * num_envs, 21 * num_envs)
    before_new = leaf_values(buf, new_ids)
    td = np.full(len(idx), 123.0)
    assert buf.update_priorities(idx, td) == int((~stale).sum())
    np.testing.assert_array_equal(leaf_values(buf, new_ids), before_new)  # untouched
    np.testing.assert_array_equal(leaf_values(buf, np.unique(idx[~stale])), f32((123.0 + 1e-6) ** 0.6))
    # only stale ids: nothing updated
    assert buf.update_priorities(idx[stale], td[stale]) == 0
    np.testing.assert_array_equal(leaf_values(buf, new_ids), before_new)
    # ids never added are ignored as well
    assert buf.update_priorities([10**6], [1.0]) == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_td_raises_and_changes_nothing(tmp_path, bad):
    buf = per_buffer(tmp_path, 16)
    buf.update_priorities(np.arange(16), np.linspace(0.1, 2, 16))
    before = buf.sampler.state_dict()
    with pytest.raises(ValueError):
        buf.update_priorities([0, 1, 2], [5.0, bad, 7.0])
    after = buf.sampler.state_dict()
    np.testing.assert_array_equal(before["leaves"], after["leaves"])
    assert before["max_priority"] == after["max_priority"]
    with pytest.raises(ValueError):  # not one td per index
        buf.update_priorities([0, 1], [1.0])
    np.testing.assert_array_equal(before["leaves"], buf.sampler.state_dict()["leaves"])


@pytest.mark.parametrize("sampler", [dr.Uniform, dr.WithoutReplacement])
def test_update_priorities_without_priorities_raises(tmp_path, sampler):
    buf = make(tmp_path, capacity=16, sampler=sampler())
    extend(buf, 4)
    with pytest.raises(TypeError):
        buf.update_priorities(buf.sample(2)["index"], [1.0, 1.0])


def test_zero_priority_rows(tmp_path):
    """eps=0 and td=0 give a row probability 0: never drawn, and the weights of the others stay
    the normal (p_i / min positive p) ** -beta (the max is over rows that can be drawn)."""
    buf = per_buffer(tmp_path, 8, eps=0.0, alpha=1.0, beta=0.5)
    td = np.array([0.0, 1, 2, 3, 4, 5, 6, 7])
    buf.update_priorities(np.arange(8), td)
    batch = buf.sample(512)
    assert (batch["index"] != 0).all()
    np.testing.assert_array_equal(batch["weight"], ((td[batch["index"]] / 1.0) ** -0.5).astype(np.float32))
    assert np.isfinite(batch["weight"]).all()


# ---- without replacement --------------------------------------------------------------------


@pytest.mark.parametrize("num_envs,capacity,steps", [(1, None, 37), (3, None, 17), (3, 3 * 17, 30)])
@pytest.mark.parametrize("batch_size", [7, 10, 64])
def test_without_replacement_epochs(tmp_path, num_envs, capacity, steps, batch_size):
    buf = make(tmp_path, capacity=capacity, num_envs=num_envs, sampler=dr.WithoutReplacement())
    extend(buf, steps)  # in the ring case this wraps around
    rows = np.sort(buf.row_ids())
    n = len(rows)
    epochs = 4
    draws = np.concatenate([buf.sample(batch_size)["index"] for _ in range(-(-epochs * n // batch_size))])
    orders = []
    for e in range(epochs):
        epoch = draws[e * n:(e + 1) * n]
        np.testing.assert_array_equal(np.sort(epoch), rows)  # each row exactly once
        orders.append(epoch)
    assert not np.array_equal(orders[0], orders[1])  # a fresh random order each epoch
    # seeded: an identical buffer draws the identical sequence
    again = make(tmp_path, "again", capacity=capacity, num_envs=num_envs, sampler=dr.WithoutReplacement())
    extend(again, steps)
    draws2 = np.concatenate([again.sample(batch_size)["index"] for _ in range(-(-epochs * n // batch_size))])
    np.testing.assert_array_equal(draws, draws2)


def test_without_replacement_skips_overwritten_and_defers_new(tmp_path):
    buf = make(tmp_path, capacity=20, sampler=dr.WithoutReplacement())
    extend(buf, 20)
    first = buf.sample(5)["index"]
    order = buf.sampler.rows(0, buf.sampler.size())[1].copy()  # this epoch's sequence (1 lane: steps are row ids)
    np.testing.assert_array_equal(first, order[:5])
    extend(buf, 4)  # steps 0..3 overwritten mid-epoch; 20..23 added mid-epoch
    rest = [s for s in order[5:].tolist() if s >= 4]  # overwritten rows are skipped
    draws = np.concatenate([buf.sample(5)["index"] for _ in range(-(-(len(rest) + 20) // 5))])
    np.testing.assert_array_equal(draws[:len(rest)], rest)  # new rows wait for the next epoch
    np.testing.assert_array_equal(np.sort(draws[len(rest):len(rest) + 20]), np.arange(4, 24))


# ---- recent-ratio and ERE ---------------------------------------------------------------------


@pytest.mark.parametrize("num_envs", [1, 4])
@pytest.mark.parametrize("batch_size", [256, 30])
def test_recent_ratio_share(tmp_path, num_envs, batch_size):
    recent_rows = 40
    buf = make(tmp_path, capacity=None, num_envs=num_envs,
               sampler=dr.Uniform(recent_ratio=0.25, recent_rows=recent_rows))
    steps = 1000 // num_envs
    extend(buf, steps)
    n_recent = round(0.25 * batch_size)
    per_lane = -(-recent_rows // num_envs)
    old_counts = np.zeros(10)
    for _ in range(100):
        idx = buf.sample(batch_size)["index"]
        assert len(idx) == batch_size
        step = idx // num_envs
        assert (step[batch_size - n_recent:] >= steps - per_lane).all()  # exactly that share is recent
        np.add.at(old_counts, step[:batch_size - n_recent] * 10 // steps, 1)
    # the rest is uniform over all rows (not only the recent window)
    assert chisquare(old_counts).pvalue > P_MIN


def test_recent_ratio_validation():
    with pytest.raises(ValueError):
        dr.Uniform(recent_ratio=1.5, recent_rows=10)
    with pytest.raises(ValueError):
        dr.Uniform(recent_ratio=0.5)


def test_ere_schedule_values():
    N, K, eta, c_min = 100_000, 1000, 0.996, 2500
    values = list(dr.ere_schedule(N, K, eta, c_min))
    assert len(values) == K
    for k, c in enumerate(values):
        assert c == min(max(int(N * eta ** (k * 1000 / K)), c_min), N)
        assert c == dr.ere_recent_rows(N, k, K, eta, c_min)
    assert values[0] == N
    assert values[-1] == c_min  # 1e5 * 0.996**999 ~ 1.8e3 < c_min
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert dr.ere_recent_rows(1000, 0, 10, c_min=2500) == 1000  # capped at the rows present
    # a different number of updates per epoch only rescales k
    assert dr.ere_recent_rows(N, 500, 2000, eta, c_min) == dr.ere_recent_rows(N, 250, 1000, eta, c_min)


@pytest.mark.parametrize("num_envs", [1, 2])
def test_ere_recent_rows_bounds(tmp_path, num_envs):
    buf = make(tmp_path, capacity=1000 * num_envs, num_envs=num_envs)
    extend(buf, 1300)  # ring wrapped: readable steps 300..1299 per lane
    for c in dr.ere_schedule(len(buf), 20, eta=0.9, c_min=50):
        idx = buf.sample(512, recent_rows=c)["index"]
        step = idx // num_envs
        lower = 1300 - -(-c // num_envs)
        assert step.min() >= lower and step.max() <= 1299
        if c < len(buf):
            assert step.min() < lower + max(c // num_envs // 8, 1)  # the whole window is used
    # more rows than the buffer holds: the whole buffer
    idx = buf.sample(4096, recent_rows=10**9)["index"]
    assert (idx // num_envs).min() == 300
    with pytest.raises(ValueError):
        buf.sample(4, recent_rows=0)


# ---- trajectory slices --------------------------------------------------------------------------


TT_FIELDS = {"obs": dr.Field((), "int64"), "terminated": dr.Field((), "bool"),
             "truncated": dr.Field((), "bool")}


def random_episode_flags(rng, n, e, mean_len):
    term = rng.random((n, e)) < 0.5 / mean_len
    trunc = rng.random((n, e)) < 0.5 / mean_len
    return term, trunc


def test_slices_stay_inside_episodes_lanes_ring(tmp_path):
    rng = np.random.default_rng(5)
    e, lane_cap, L = 3, 60, 6
    buf = make(tmp_path, fields=TT_FIELDS, capacity=e * lane_cap, num_envs=e, chunk_rows=16)
    assert buf.episode_index.end_fields == ("terminated", "truncated")
    ends = [[] for _ in range(e)]
    total = 0
    for n in (25, 40, 7, 90, 33):  # 195 steps per lane: wraps the 60-step ring several times
        term, trunc = random_episode_flags(rng, n, e, 8)
        obs = (total + np.arange(n))[:, None] * e + np.arange(e)
        buf.extend({"obs": obs, "terminated": term, "truncated": trunc})
        for lane in range(e):
            ends[lane] += (total + np.flatnonzero(term[:, lane] | trunc[:, lane])).tolist()
        total += n
        lo = max(0, total - lane_cap)
        batch = buf.sample(256, seq_len=L)
        assert batch["obs"].shape == (256, L) and batch["index"].shape == (256, L)
        idx = batch["index"]
        np.testing.assert_array_equal(batch["obs"], idx)  # the rows read are the rows named
        np.testing.assert_array_equal(batch["start"], idx[:, 0])
        lane = idx % e
        step = idx // e
        assert (lane == lane[:, :1]).all()  # one lane
        assert (np.diff(step, axis=1) == 1).all()  # consecutive
        assert (step[:, 0] >= lo).all() and (step[:, -1] < total).all()  # readable
        flags = batch["terminated"] | batch["truncated"]
        assert not flags[:, :-1].any()  # no episode end inside a slice (the last step may end it)
        for b in range(0, 256, 17):
            lane_ends = np.array(ends[lane[b, 0]])
            assert not ((lane_ends >= step[b, 0]) & (lane_ends < step[b, -1])).any()


def small_episode_buffer(tmp_path, lengths, tail, name="small", **kw):
    """One lane, dataset mode: episodes of ``lengths`` then ``tail`` steps of an open episode."""
    buf = make(tmp_path, name, **kw)
    done = np.concatenate([np.eye(1, n, n - 1, dtype=bool)[0] for n in lengths] + [np.zeros(tail, bool)])
    extend(buf, len(done), done)
    return buf


def valid_windows(lengths, tail, L, lo=0):
    starts, s = [], 0
    for n in list(lengths) + [tail]:
        starts += list(range(max(s, lo), s + n - L + 1))
        s += n
    return np.array(starts)


def test_slices_uniform_over_valid_windows(tmp_path):
    lengths, tail, L = [5, 2, 7, 4, 1], 4, 3
    buf = small_episode_buffer(tmp_path, lengths, tail)
    windows = valid_windows(lengths, tail, L)  # 3 + 0 + 5 + 2 + 0 + 2 = 12 windows
    assert len(windows) == 12
    counts = np.zeros(int(sum(lengths) + tail), np.int64)
    for _ in range(100):
        np.add.at(counts, buf.sample(256, seq_len=L)["start"], 1)
    assert set(np.flatnonzero(counts).tolist()) == set(windows.tolist())  # short episodes skipped
    assert chisquare(counts[windows]).pvalue > P_MIN


def test_slices_no_room_raises(tmp_path):
    buf = small_episode_buffer(tmp_path, [2, 3], 1)
    with pytest.raises(dr.EmptyBufferError):
        buf.sample(4, seq_len=4)
    assert buf.sample(4, seq_len=4, pad=True)["mask"].shape == (4, 4)
    nobuf = make(tmp_path, "noep", episode_end=None)
    extend(nobuf, 10)
    with pytest.raises(ValueError):
        nobuf.sample(2, seq_len=2)


def test_slices_pad_mask(tmp_path):
    lengths, tail, L = [5, 2, 7, 1], 3, 4
    buf = small_episode_buffer(tmp_path, lengths, tail)
    ends = np.cumsum(lengths) - 1
    hi = sum(lengths) + tail
    batch = buf.sample(2000, seq_len=L, pad=True)
    start, idx, mask = batch["start"], batch["index"], batch["mask"]
    assert mask.dtype == np.bool_ and mask.shape == (2000, L)
    assert set(start.tolist()) == set(range(hi))  # any readable step may start a padded slice
    for b in range(2000):
        s = int(start[b])
        after = ends[ends >= s]
        last = int(after[0]) if len(after) else hi - 1
        want_mask = s + np.arange(L) <= last
        np.testing.assert_array_equal(mask[b], want_mask)
        np.testing.assert_array_equal(idx[b], np.minimum(s + np.arange(L), last))  # repeat the last step
        np.testing.assert_array_equal(batch["obs"][b], idx[b])
    assert mask[:, 0].all()


def test_prioritized_slices(tmp_path):
    lengths, tail, L, alpha, beta, eps = [6, 2, 9, 3], 5, 3, 0.6, 0.4, 1e-6
    n = sum(lengths) + tail
    buf = small_episode_buffer(tmp_path, lengths, tail, sampler=dr.Prioritized(alpha=alpha, beta=beta, eps=eps))
    td = np.random.default_rng(3).uniform(0.1, 4, n)
    buf.update_priorities(np.arange(n), td)
    p = f32((td + eps) ** alpha)
    windows = valid_windows(lengths, tail, L)
    counts = np.zeros(n, np.int64)
    for _ in range(60):
        batch = buf.sample(256, seq_len=L)
        start = batch["start"]
        assert np.isin(start, windows).all()
        np.testing.assert_array_equal(batch["index"], start[:, None] + np.arange(L))
        np.testing.assert_array_equal(batch["weight"], ((p[start] / p.min()) ** -beta).astype(np.float32))
        np.add.at(counts, start, 1)
    # a slice's priority is its start row's: P(start) proportional to p over the valid starts
    expected = p[windows] / p[windows].sum() * counts.sum()
    assert chisquare(counts[windows], expected).pvalue > P_MIN
    # updating through the slice's start ids works
    batch = buf.sample(8, seq_len=L, beta=0.9)
    np.testing.assert_array_equal(batch["weight"], ((p[batch["start"]] / p.min()) ** -0.9).astype(np.float32))
    assert buf.update_priorities(batch["start"], np.ones(8)) == 8
    # padded prioritized slices: any row may start one
    batch = buf.sample(512, seq_len=L, pad=True)
    assert "mask" in batch and len(set(batch["start"].tolist())) > len(windows)


def test_without_replacement_slices_stay_inside(tmp_path):
    lengths, tail, L = [6, 2, 9, 3], 5, 3
    buf = small_episode_buffer(tmp_path, lengths, tail, sampler=dr.WithoutReplacement())
    windows = valid_windows(lengths, tail, L)
    for _ in range(10):
        assert np.isin(buf.sample(16, seq_len=L)["start"], windows).all()


# ---- resume: identical batches after close/open --------------------------------------------------


SAMPLERS = {
    "uniform": lambda: dr.Uniform(),
    "uniform_recent": lambda: dr.Uniform(recent_ratio=0.25, recent_rows=24),
    "prioritized": lambda: dr.Prioritized(alpha=0.6, beta=0.4),
    "prioritized_iid": lambda: dr.Prioritized(alpha=0.7, beta=0.5, stratified=False, initial_priority=3.0),
    "without_replacement": lambda: dr.WithoutReplacement(),
}


def _ops(buf, rng_seed=11):
    """Adds (wrapping the ring), samples, priority updates: the same for both runs."""
    rng = np.random.default_rng(rng_seed)
    for n in (30, 45, 12):
        done = rng.random((n, buf.num_envs)) < 0.1
        extend(buf, n, done)
        for _ in range(3):
            batch = buf.sample(13)
            if isinstance(buf.sampler, dr.Prioritized):
                buf.update_priorities(batch["index"], rng.normal(0, 2, 13))
    buf.sample(5)  # WithoutReplacement: leave it mid-epoch


def _draws(buf, k=6):
    out = []
    for j in range(k):
        batch = buf.sample(17) if j % 3 else buf.sample(6, seq_len=3)
        out.append((batch["index"], batch.get("weight")))
        if isinstance(buf.sampler, dr.Prioritized):
            buf.update_priorities(batch["index"], np.linspace(0.1, 5, batch["index"].size))
    extend(buf, 9, np.eye(9, buf.num_envs, dtype=bool))
    for _ in range(3):
        batch = buf.sample(17)
        out.append((batch["index"], batch.get("weight")))
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for (ia, wa), (ib, wb) in zip(a, b):
        np.testing.assert_array_equal(ia, ib)
        if wa is None:
            assert wb is None
        else:
            np.testing.assert_array_equal(wa, wb)


@pytest.mark.parametrize("capacity", [2 * 40, None])
@pytest.mark.parametrize("name", list(SAMPLERS))
def test_resume_gives_identical_batches(tmp_path, name, capacity):
    kw = dict(capacity=capacity, num_envs=2, chunk_rows=8)
    a = make(tmp_path, "a", sampler=SAMPLERS[name](), **kw)
    _ops(a)
    a.flush()
    run_a = _draws(a)
    b = make(tmp_path, "b", sampler=SAMPLERS[name](), **kw)
    _ops(b)
    b.flush()
    b.close()
    b = dr.ReplayBuffer.open(tmp_path / "b", mode="r+")
    assert type(b.sampler) is type(a.sampler)
    run_b = _draws(b)
    _assert_same(run_a, run_b)
    b.close()


def test_resume_read_only_draws_the_same(tmp_path):
    # dataset mode: a reader of a ring may see fewer old rows than the writer did (the writer
    # raises the readers' lower cursor a chunk at a time), so its draws can legitimately differ
    a = make(tmp_path, "a", capacity=None, num_envs=2, sampler=dr.Prioritized())
    _ops(a)
    a.flush()
    r = dr.ReplayBuffer.open(tmp_path / "a", mode="r")  # a reader beside the writer
    got = [r.sample(9)["index"] for _ in range(3)]
    expect = [a.sample(9)["index"] for _ in range(3)]
    r.close()
    a.close()
    _assert_same([(x, None) for x in expect], [(x, None) for x in got])


def test_resume_prioritized_dataset_mode_trees_grow(tmp_path):
    """capacity=None: the per-lane leaf range starts at 2**16 and doubles; growth before and after
    a reopen must give the same draws as an uninterrupted run."""
    def ops(buf):
        rng = np.random.default_rng(0)
        extend(buf, 70_000)  # > 2**16 steps per lane: the trees grow
        batch = buf.sample(512)
        buf.update_priorities(batch["index"], rng.exponential(1, 512))

    def draws(buf):
        rng = np.random.default_rng(1)
        out = []
        for _ in range(3):
            batch = buf.sample(256)
            out.append((batch["index"], batch["weight"]))
            buf.update_priorities(batch["index"], rng.exponential(1, 256))
        extend(buf, 70_000)  # grows again (140k > 2**17)
        for _ in range(3):
            batch = buf.sample(256)
            out.append((batch["index"], batch["weight"]))
        return out

    kw = dict(capacity=None, num_envs=2, chunk_rows=4096, sampler=None)
    a = make(tmp_path, "a", **{**kw, "sampler": dr.Prioritized()})
    ops(a)
    a.flush()
    assert a.sampler.stride == 2**17
    run_a = draws(a)
    assert a.sampler.stride == 2**18
    b = make(tmp_path, "b", **{**kw, "sampler": dr.Prioritized()})
    ops(b)
    b.flush()
    b.close()
    b = dr.ReplayBuffer.open(tmp_path / "b", mode="r+")
    assert b.sampler.stride == 2**17
    run_b = draws(b)
    _assert_same(run_a, run_b)
    # priorities survive growth: rows that were updated keep their values
    assert np.array_equal(leaf_values(a, np.arange(0, 280_000, 997)), leaf_values(b, np.arange(0, 280_000, 997)))
    b.close()


def test_a_dataset_stride_too_short_for_its_steps_is_refused(tmp_path):
    """A saved stride must give every step of a lane a leaf of that lane's own."""
    buf = make(tmp_path, capacity=None, chunk_rows=4096, sampler=dr.Prioritized())
    extend(buf, 70_000)
    state = buf.state_dict()
    state["sampler"].update(stride=2**16, leaves=state["sampler"]["leaves"][:2**16])
    with pytest.raises(ValueError, match=r"'sampler\.stride': expected a power of two >= 65536 and >= 70000, the "
                                         r"most steps of a lane, got 65536"):
        buf.load_state_dict(state)
    assert buf.sampler.stride == 2**17
    buf.close()


def test_prioritized_uneven_lanes(tmp_path):
    """Lanes filled unevenly (env_ids subsets) in a ring: only readable rows, P(i) ∝ p_i^alpha."""
    buf = make(tmp_path, capacity=3 * 6, num_envs=3, sampler=dr.Prioritized(alpha=1.0, eps=0.0))
    for t in range(9):
        lanes = [0, 2] if t % 3 else [0, 1, 2]
        buf.add(env_ids=lanes, obs=np.zeros(len(lanes), np.int64), done=np.zeros(len(lanes), bool))
    ids = buf.row_ids()
    assert len(ids) == 6 + 3 + 6
    buf.update_priorities(ids, np.arange(1, len(ids) + 1, dtype=float))
    counts = dict.fromkeys(ids.tolist(), 0)
    for _ in range(40):
        for i in buf.sample(256)["index"].tolist():
            counts[i] += 1  # KeyError if an unreadable row came out
    got = np.array([counts[i] for i in ids.tolist()])
    p = np.arange(1, len(ids) + 1)
    assert chisquare(got, p / p.sum() * got.sum()).pvalue > P_MIN


@pytest.mark.parametrize("mode", ["r", "r+"])
def test_a_sampler_of_another_type_than_the_saved_one_is_told_of_every_row(tmp_path, mode):
    """A buffer saved with Uniform, opened with Prioritized: its rows (and, for a reader, rows
    committed later) reach the new sampler as new rows, at the max priority."""
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=100, chunk_rows=8) as w:
        w.extend({"obs": np.arange(50), "done": np.zeros(50, bool)})
    buf = dr.ReplayBuffer.open(url, mode, sampler=dr.Prioritized(alpha=1.0, beta=0.0))
    with buf:
        counts = np.bincount(buf.sample(25_000, seed=0)["index"], minlength=50)
        assert chisquare(counts).pvalue > 1e-3 and counts.min() > 0
        if mode == "r":
            with dr.ReplayBuffer.open(url, "r+") as w:
                w.extend({"obs": np.arange(50, 150), "done": np.zeros(100, bool)})
            assert buf.refresh()
            np.testing.assert_array_equal(np.unique(buf.sample(25_000, seed=1)["index"]), np.arange(50, 150))


# ---- every sampler reopens, whatever state it was closed in (issue 39) ---------------------------

REOPENED_SAMPLERS = {"uniform": dr.Uniform, "prioritized": dr.Prioritized, "without_replacement": dr.WithoutReplacement}
HISTORIES = {  # steps per lane added, then (if not None) steps added after a clear()
    "empty": (0, None), "some": (10, None), "cleared": (10, 0), "cleared_then_some": (10, 10),
    "many_cleared_then_some": (1000, 10)}


def _check_draws(buf, rows):
    """Every way of sampling ``buf`` draws its readable ``rows`` only (each once per epoch
    without replacement), with the rows' own values."""
    if not len(rows):
        with pytest.raises(dr.EmptyBufferError):
            buf.sample(4)
        return
    sampler = buf.sampler
    if isinstance(sampler, dr.WithoutReplacement):
        left = sampler.size() - sampler.cursor if sampler.epoch >= 0 else 0
        if left:  # the rest of the epoch the buffer was closed in
            assert np.isin(buf.sample(left)["index"], rows).all()
        np.testing.assert_array_equal(np.sort(buf.sample(len(rows))["index"]), rows)  # then a whole new one
    batch = buf.sample(1024)
    np.testing.assert_array_equal(np.unique(batch["index"]), rows)
    np.testing.assert_array_equal(batch["obs"], batch["index"])
    if isinstance(sampler, dr.Prioritized):
        np.testing.assert_array_equal(batch["weight"], np.ones(1024, np.float32))  # every row at the max priority
    for pad in (False, True):
        slices = buf.sample(64, seq_len=2, pad=pad)
        assert np.isin(slices["index"], rows).all()
        np.testing.assert_array_equal(slices["obs"], slices["index"])


@pytest.mark.parametrize("drawn", [False, True], ids=["not-drawn", "drawn"])
@pytest.mark.parametrize("history", list(HISTORIES))
@pytest.mark.parametrize("capacity", [32, None], ids=["ring", "dataset"])
@pytest.mark.parametrize("num_envs", [1, 2, 3])
@pytest.mark.parametrize("name", list(REOPENED_SAMPLERS))
def test_every_sampler_reopens_and_draws_its_rows(tmp_path, name, num_envs, capacity, history, drawn):
    """Closed with no rows, some, after clear() (ring or dataset, drawn from or not before close):
    the buffer reopens read-only and for writing, and draws exactly its readable rows."""
    before, after = HISTORIES[history]
    buf = make(tmp_path, capacity=capacity and capacity * num_envs, num_envs=num_envs,
               sampler=REOPENED_SAMPLERS[name]())
    extend(buf, before, np.arange(before * num_envs) % 5 == 4)  # episodes of a few steps
    if after is not None:
        buf.clear()
        extend(buf, after, np.arange(after * num_envs) % 5 == 4)
    rows = np.sort(buf.row_ids())
    assert len(rows) == num_envs * (after if after is not None else min(before, capacity or before))
    if drawn:
        _check_draws(buf, rows)
    buf.close()
    report = verify(str(tmp_path / "buf"))
    assert report.ok, str(report)
    for mode in ("r", "r+"):
        with dr.ReplayBuffer.open(tmp_path / "buf", mode, retry=dr.RetryPolicy(budget_s=0.01)) as again:
            assert type(again.sampler) is REOPENED_SAMPLERS[name]
            np.testing.assert_array_equal(np.sort(again.row_ids()), rows)
            _check_draws(again, rows)


# ---- several batches in one read ----------------------------------------------------------------


def _twins(tmp_path, name, **kw):
    """Two buffers with the same rows, priorities and sampler state."""
    bufs = []
    for tag in ("a", "b"):
        buf = make(tmp_path, f"{name}_{tag}", sampler=SAMPLERS[name](), capacity=81, num_envs=3, **kw)
        _ops(buf)
        bufs.append(buf)
    return bufs


def _assert_batches_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)
            assert g[key].dtype == w[key].dtype


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_sample_batches_are_the_batches_sample_draws(tmp_path, name):
    a, b = _twins(tmp_path, name)
    beta = {"beta": 0.9} if "prioritized" in name else {}
    _assert_batches_equal(a.sample_batches(11, 4, **beta), [b.sample(11, **beta) for _ in range(4)])
    _assert_batches_equal(a.sample_batches(7, 3, seed=5, **beta),
                          [b.sample(7, rng=g, **beta) for g in [np.random.default_rng(5)] * 3])
    seeds = [np.random.default_rng(s) for s in (1, 2, 3)]
    _assert_batches_equal(a.sample_batches(9, 3, rngs=seeds), [b.sample(9, seed=s) for s in (1, 2, 3)])
    _assert_batches_equal(a.sample_batches(5, 2), [b.sample(5) for _ in range(2)])  # the buffer's generator went on
    a.close()
    b.close()


def test_sample_batches_gather_once_and_share_one_block(tmp_path):
    buf = make(tmp_path, capacity=None, num_envs=2)
    extend(buf, 50)
    gathers = []
    gather = buf.view.gather
    buf.view.gather = lambda *args, **kw: gathers.append(len(args[0])) or gather(*args, **kw)
    batches = buf.sample_batches(16, 5, seed=0)
    assert gathers == [80]  # one read of every row of the five batches
    [buf.sample(16) for _ in range(5)]
    assert gathers == [80] + [16] * 5
    assert all(np.shares_memory(b["obs"], batches[0]["obs"].base) for b in batches)
    np.testing.assert_array_equal(batches[3]["obs"], batches[3]["index"])  # obs holds the row id
    torch_batches = buf.sample_batches(4, 2, seed=0, format="torch")
    assert [type(b["obs"]).__name__ for b in torch_batches] == ["Tensor", "Tensor"]
    np.testing.assert_array_equal(torch_batches[1]["index"].numpy(), buf.sample_batches(4, 2, seed=0)[1]["index"])
    buf.close()


def test_sample_batches_refuse_what_they_do_not_draw(tmp_path):
    buf = make(tmp_path, capacity=None)
    with pytest.raises(dr.EmptyBufferError, match="empty buffer"):
        buf.sample_batches(4, 2)
    extend(buf, 20)
    gens = [np.random.default_rng(i) for i in range(3)]
    cases = [
        ({"count": 0}, "count must be an int >= 1, got 0"),
        ({"count": True}, "count must be an int >= 1, got True"),
        ({"count": 2.0}, "count must be an int >= 1, got 2.0"),
        ({"count": 2, "rngs": gens}, r"rngs: expected 2 generators \(one per batch\), got 3"),
        ({"count": 3, "rngs": gens, "seed": 1}, "pass it without seed= or rng="),
        ({"count": 2, "n_step": 3}, "n_step: plain transitions only here; sample"),
        ({"count": 2, "stack": 4, "out": {}}, "out, stack: plain transitions only here"),
        ({"count": 2, "format": "jax"}, "format must be one of"),
        ({"count": 2, "colour": 1}, "Uniform takes no sampling option 'colour'"),
        ({"count": 10**15}, r"batch_size \* count=4,000,000,000,000,000 needs 68,000,000,000,000,000 bytes"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            buf.sample_batches(4, **kw)
    buf.close()
    with pytest.raises(dr.ClosedError, match="is closed"):
        buf.sample_batches(4, 2)


@pytest.mark.parametrize("bits", [np.random.PCG64, np.random.MT19937, np.random.Philox, np.random.SFC64])
def test_compiled_uniform_draws_are_numpys_numbers(bits):
    """`draws.integers` gives rng.integers' numbers and leaves the generator where numpy would:
    narrow, wide and rejection-heavy spans (3 * 2**30 + 1 rejects a quarter of the 32-bit draws),
    spans numpy draws another way (one value; more than 2**32), between numpy's own draws."""
    if draws._draws is None:
        assert not os.environ.get("CI"), "CI installs with a C compiler: the extension must be built"
        pytest.skip("diskreplay.sampling._draws was not built (no C compiler at install)")
    ours, theirs = np.random.Generator(bits(7)), np.random.Generator(bits(7))
    for low, high, size in [(0, 2, 9), (0, 10, 7), (-40, 60, 1), (5, 3 * 2**30 + 6, 500), (0, 2**31 + 1, 100),
                            (3, 2**32 + 2, 50), (0, 1, 4), (0, 2**40, 6), (10**6, 10**6 + 17, 300)]:
        ours.random(3), theirs.random(3)  # a 32-bit draw may be left over in the bit generator
        got = draws.integers(ours, low, high, size)
        assert got.dtype == np.int64 and got.tolist() == theirs.integers(low, high, size=size).tolist()
    assert ours.integers(0, 2**62, 8).tolist() == theirs.integers(0, 2**62, 8).tolist()


@pytest.mark.parametrize("compiled", [True, False])
def test_pcg64_states_set_many_at_once_are_numpys(compiled, monkeypatch):
    """`draws.set_pcg64_states` leaves each generator as PCG64's ``state`` setter does: the same
    state, the half-used 64-bit output dropped, the same draws after; the compiled setter and
    the fallback alike."""
    if compiled and draws._set_pcg64 is None:
        assert not os.environ.get("CI"), "CI installs with a C compiler: the extension must be built"
        pytest.skip("diskreplay.sampling._draws was not built (no C compiler at install)")
    if not compiled:
        monkeypatch.setattr(draws, "_set_pcg64", None)
    words = np.array([[2**64 - 1, 2**64 - 1, 2**64 - 1, 2**64 - 1], [0, 1, 0, 1], [2**63, 99, 12, 2**62 + 5]],
                     dtype=np.uint64)
    ours = [np.random.default_rng(s) for s in range(3)]
    for gen in ours:
        gen.integers(0, 10)  # half of a 64-bit output left buffered
    draws.set_pcg64_states(ours, words)
    for gen, (state_hi, state_lo, inc_hi, inc_lo) in zip(ours, words.tolist()):
        theirs = np.random.default_rng()
        theirs.bit_generator.state = {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0,
                                      "state": {"state": state_hi << 64 | state_lo, "inc": inc_hi << 64 | inc_lo}}
        assert gen.bit_generator.state == theirs.bit_generator.state
        assert gen.integers(0, 1000, 20).tolist() == theirs.integers(0, 1000, 20).tolist()


def test_the_compiled_pcg64_setter_is_used_only_where_it_agrees_with_numpy(monkeypatch):
    """The import-time check turns down a setter that leaves other states than numpy's."""
    if draws._draws is not None:
        assert draws._sets_pcg64_as_numpy()
    monkeypatch.setattr(draws, "_draws", types.SimpleNamespace(set_pcg64=lambda capsules, words: None))
    assert not draws._sets_pcg64_as_numpy()


def test_pcg64_states_refuse_other_generators_and_miscounted_states():
    words = np.zeros((1, 4), np.uint64)
    with pytest.raises(TypeError, match="PCG64 generators only"):
        draws.set_pcg64_states([np.random.Generator(np.random.MT19937(0))], words)
    with pytest.raises(TypeError, match="PCG64 generators only"):
        draws.set_pcg64_states([np.random.RandomState(0)], words)
    with pytest.raises(ValueError, match="2 generators, 1 states"):
        draws.set_pcg64_states([np.random.default_rng(0), np.random.default_rng(1)], words)


def test_uniform_samples_are_the_same_without_the_compiled_draws(tmp_path, monkeypatch):
    with dr.ReplayBuffer.create(str(tmp_path / "b"), {"x": dr.Field((), "int64")}, capacity=None, num_envs=3,
                                seed=0) as buf:
        buf.extend({"x": np.arange(300).reshape(100, 3)})
        compiled = [buf.sample(64, seed=s)["x"].tolist() for s in range(5)]
        monkeypatch.setattr(draws, "_draws", None)
        assert [buf.sample(64, seed=s)["x"].tolist() for s in range(5)] == compiled


def test_prioritized_slices_fit_where_the_starts_that_fit_hold_little_mass(tmp_path):
    """Rows 0-3 are one episode, rows 4-9 episodes of one step: slices of 3 steps fit only at
    starts 0 and 1, which hold 4e-6 of a mass of 8: drawing again almost never finds them. The
    starts are then drawn among those that fit, still in proportion to their priorities (1:3),
    and weighted against the least priority of all readable rows."""
    fields = {"id": dr.Field((), "int64"), "terminated": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.create(tmp_path / "b", fields, None, chunk_rows=4, seed=0,
                                 sampler=dr.Prioritized(alpha=1.0, beta=0.4, eps=0.0))
    buf.extend({"id": np.arange(10), "terminated": np.array([0, 0, 0, 1, 1, 1, 1, 1, 1, 1], bool)})
    buf.update_priorities(np.arange(10), np.array([1e-6, 3e-6] + [1.0] * 8))
    batch = buf.sample(2000, seq_len=3)
    starts, weights = batch["start"], batch["weight"]
    assert set(starts.tolist()) == {0, 1}
    counts = np.bincount(starts, minlength=2)
    assert chisquare(counts, [500, 1500]).pvalue > 1e-3, counts
    np.testing.assert_allclose(weights[starts == 0], 1.0, rtol=1e-5)
    np.testing.assert_allclose(weights[starts == 1], 3.0 ** -0.4, rtol=1e-5)
    np.testing.assert_array_equal(batch["id"], starts[:, None] + np.arange(3))
    buf.close()


def test_slices_with_a_recent_share_fit_where_few_starts_fit(tmp_path):
    """Rows 0-4 are one episode, rows 5-2004 episodes of one step, and half of each batch comes
    from the 5 newest rows: slices of 4 steps start only at 0 and 1, 1 in 1,000 of the rows.
    The draws that keep missing are drawn uniformly among the starts that fit instead of giving up."""
    fields = {"id": dr.Field((), "int64"), "terminated": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.create(tmp_path / "b", fields, None, chunk_rows=64, seed=0,
                                 sampler=dr.Uniform(recent_ratio=0.5, recent_rows=5))
    buf.extend({"id": np.arange(2005), "terminated": np.arange(2005) >= 4})
    starts = buf.sample(400, seq_len=4)["start"]
    assert set(starts.tolist()) == {0, 1}
    assert chisquare(np.bincount(starts, minlength=2)).pvalue > 1e-3
    buf.close()


# ---- samplers of the user's own -----------------------------------------------------------------


class Cycle:
    """A sampler of the user's own, no subclass of anything: the methods of `dr.Sampler` only.
    It draws the rows of lane 0 in order, from where its saved ``next`` left off."""

    def __init__(self):
        self.next = 0

    def attach(self, layout):
        self.lanes = layout.num_envs

    def on_append(self, lane, first, end):
        pass

    def sample(self, rng, batch_size, lo, hi, stride=1):
        step = lo[0] + (self.next + stride * np.arange(batch_size)) % (hi[0] - lo[0])
        self.next += stride * batch_size
        return dr.Draw(np.zeros(batch_size, np.int64), step)

    def state_dict(self):
        return {"type": "Cycle", "next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


class CheckedCycle(Cycle):
    """`Cycle` with the optional methods: its own commit state, told of commits, checks saved states."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def state_dict(self):
        return {"type": "CheckedCycle", "next": self.next}

    def commit_state(self):
        self.calls.append("commit_state")
        return {**self.state_dict(), "committed_at": self.next}

    def committed(self):
        self.calls.append("committed")

    @staticmethod
    def check_state(state, layout, total):
        if state["next"] < 0:
            raise ValueError(f"'sampler.next': expected an int >= 0, got {state['next']}")


def test_a_sampler_of_the_users_own_is_saved_with_each_commit_and_resumes(tmp_path):
    """A sampler that only has the methods of `dr.Sampler` gets the defaults of the optional ones:
    a commit saves its `state_dict`, and it resumes where it was."""
    buf = make(tmp_path, capacity=None, sampler=Cycle())
    extend(buf, 10)
    assert buf.sample(3)["obs"].tolist() == [0, 1, 2]
    assert buf.sample(2, stride=2)["obs"].tolist() == [3, 5]
    buf.close()
    with pytest.raises(ValueError, match=r"the buffer was saved with sampler 'Cycle'; pass sampler= to open"):
        dr.ReplayBuffer.open(tmp_path / "buf", "r")
    with dr.ReplayBuffer.open(tmp_path / "buf", "r+", sampler=Cycle()) as again:
        assert again.sampler.next == 7
        assert again.sample(4)["obs"].tolist() == [7, 8, 9, 0]
        state = again.state_dict()
        assert state["sampler"] == {"type": "Cycle", "next": 11}
        again.sample(1)
        again.load_state_dict(state)
        assert again.sampler.next == 11


def test_a_sampler_of_the_users_own_with_the_optional_methods_gets_them_called(tmp_path):
    buf = make(tmp_path, capacity=None, sampler=CheckedCycle())
    extend(buf, 10)
    buf.sample(3)
    buf.flush()
    calls = buf.sampler.calls
    assert len(calls) >= 2 and calls == ["commit_state", "committed"] * (len(calls) // 2)  # each commit, in order
    buf.close()
    with dr.ReplayBuffer.open(tmp_path / "buf", "r", sampler=CheckedCycle()) as again:
        assert again.sampler.next == 3
        state = again.state_dict()
        with pytest.raises(ValueError, match=r"does not fit this buffer: 'sampler.next': expected an int >= 0, got -1"):
            again.load_state_dict({**state, "sampler": {**state["sampler"], "next": -1}})
        assert again.sampler.next == 3
        with pytest.raises(ValueError, match=r"does not fit this buffer: 'sampler': 'next' is missing"):
            again.load_state_dict({**state, "sampler": {"type": "CheckedCycle"}})
