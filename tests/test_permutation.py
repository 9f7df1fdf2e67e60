"""`SeededPermutation` (the order of a without-replacement epoch): a bijection at every size, a
uniform shuffle, and evaluated lazily beyond a million rows; `WithoutReplacement` over such an
epoch draws every row once, also across a save and a reopen."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import diskreplay as dr
from diskreplay.sampling.permutation import STORED_MAX, SeededPermutation


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 1000, STORED_MAX, STORED_MAX + 1, 3_000_001])
def test_every_size_is_a_bijection(n):
    values = SeededPermutation(n, 7)[np.arange(n)]
    np.testing.assert_array_equal(np.sort(values), np.arange(n))


def test_a_billion_rows_are_never_stored():
    order = SeededPermutation(10**9, 3)
    assert order.stored is None
    values = order[np.arange(10**9 - 100_000, 10**9)]
    assert len(np.unique(values)) == len(values) and values.min() >= 0 and values.max() < 10**9
    np.testing.assert_array_equal(SeededPermutation(10**9, 3)[np.arange(5)], order[np.arange(5)])  # pure


def test_the_lazy_order_is_a_uniform_shuffle():
    n = STORED_MAX + 7
    first, last = np.zeros(16), np.zeros(16)
    for seed in range(3000):
        v = SeededPermutation(n, seed)[np.array([0, n - 1])]
        first[v[0] * 16 // n] += 1
        last[v[1] * 16 // n] += 1
    assert stats.chisquare(first).pvalue > 1e-3 and stats.chisquare(last).pvalue > 1e-3
    v = SeededPermutation(n, 5)[np.arange(n)]
    assert abs(np.corrcoef(np.arange(n), v)[0, 1]) < 0.01
    assert abs(np.corrcoef(v[:-1], v[1:])[0, 1]) < 0.01


def test_an_epoch_past_a_million_rows_draws_each_row_once_across_a_reopen(tmp_path):
    n = STORED_MAX + 50_000
    fields = {"x": dr.Field((), "int64")}
    with dr.ReplayBuffer.create(tmp_path / "b", fields, capacity=None, num_envs=2, chunk_rows=1 << 16, seed=1,
                                sampler=dr.WithoutReplacement()) as buf:
        buf.extend({"x": np.arange(n).reshape(-1, 2)})
        seen = [buf.sample(100_000)["index"] for _ in range(4)]
    with dr.ReplayBuffer.open(tmp_path / "b", "r+") as buf:  # the epoch resumes mid-way
        seen += [buf.sample(100_000)["index"] for _ in range((n - 400_000) // 100_000)]
        seen.append(buf.sample(n % 100_000)["index"])
    ids = np.concatenate(seen)
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    assert abs(np.corrcoef(np.arange(n), ids)[0, 1]) < 0.01
