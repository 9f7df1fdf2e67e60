"""Tests of diskreplay.segment_tree against plain numpy references."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diskreplay.sampling import segment_tree as seg
from diskreplay.sampling.segment_tree import MinSegmentTree, SumSegmentTree

# (levels recomputed whole by update, levels resolved by searchsorted): small
# values force trees of a few hundred leaves through the per-level code paths.
TOP_SETTINGS = [(0, 0), (1, 2), (3, 1), (2, 5), (10, 10)]


@contextmanager
def top_levels(update_levels: int, search_levels: int) -> Iterator[None]:
    with (
        mock.patch.object(seg, "_TOP_UPDATE_LEVELS", update_levels),
        mock.patch.object(seg, "_TOP_SEARCH_LEVELS", search_levels),
    ):
        yield


def reference_find(leaves: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Exact-arithmetic reference: searchsorted, clamped to the last non-zero leaf."""
    found = np.searchsorted(np.cumsum(leaves), thresholds, side="right")
    return np.minimum(found, np.flatnonzero(leaves)[-1])


def assert_valid_pick(leaves: np.ndarray, thresholds: np.ndarray, found: np.ndarray) -> None:
    """Each pick holds positive mass and brackets its threshold up to rounding."""
    assert found.dtype == np.int64
    assert (leaves[found] > 0).all()
    cum = np.cumsum(leaves)
    tol = 1e-9 * cum[-1]
    below = cum[found] - leaves[found]
    inside = thresholds < cum[-1] - tol
    assert (below[inside] <= thresholds[inside] + tol).all()
    assert (thresholds[inside] < cum[found][inside] + tol).all()


def boundary_thresholds(leaves: np.ndarray, total: float) -> np.ndarray:
    cum = np.cumsum(leaves)
    near = np.concatenate([cum, np.nextafter(cum, 0.0), np.nextafter(cum, np.inf)])
    tail = [total, np.nextafter(total, 0.0), np.nextafter(total, np.inf), 2 * total, 0.0]
    return np.concatenate([near, tail]).clip(0.0)


value_st = st.one_of(
    st.sampled_from([0.0, 0.0, 1.0, 2.0, 3.0]),
    st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False),
)


@st.composite
def batches(draw: st.DrawFn, capacity: int, integral: bool = False) -> list[tuple]:
    values = st.integers(0, 5).map(float) if integral else value_st
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(0, 40))
        idx = draw(st.lists(st.integers(0, capacity - 1), min_size=n, max_size=n))
        vals = draw(st.lists(values, min_size=n, max_size=n))
        out.append((np.array(idx, dtype=np.int64), np.array(vals, dtype=np.float64)))
    return out


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 300),
    tops=st.sampled_from(TOP_SETTINGS),
    data=st.data(),
)
def test_updates_match_numpy_reference(capacity: int, tops: tuple, data: st.DataObject) -> None:
    with top_levels(*tops):
        sum_tree, min_tree = SumSegmentTree(capacity), MinSegmentTree(capacity)
    sum_ref, min_ref = np.zeros(capacity), np.full(capacity, np.inf)
    for idx, vals in data.draw(batches(capacity)):
        sum_tree.update(idx, vals)
        min_tree.update(idx, -vals)
        sum_ref[idx] = vals
        min_ref[idx] = -vals
        np.testing.assert_array_equal(sum_tree[np.arange(capacity)], sum_ref)
        np.testing.assert_array_equal(min_tree[np.arange(capacity)], min_ref)
        assert math.isclose(sum_tree.total(), sum_ref.sum(), rel_tol=1e-12, abs_tol=1e-9)
        assert min_tree.min() == min_ref.min()
    for _ in range(5):
        start = data.draw(st.integers(0, capacity))
        end = data.draw(st.integers(start, capacity))
        expected_sum = sum_ref[start:end].sum()
        assert math.isclose(sum_tree.sum(start, end), expected_sum, rel_tol=1e-12, abs_tol=1e-9)
        expected_min = min_ref[start:end].min() if end > start else np.inf
        assert min_tree.min(start, end) == expected_min


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 300),
    tops=st.sampled_from(TOP_SETTINGS),
    data=st.data(),
)
def test_find_prefix_sum_exact_on_integer_priorities(
    capacity: int, tops: tuple, data: st.DataObject
) -> None:
    with top_levels(*tops):
        tree = SumSegmentTree(capacity)
    leaves = np.zeros(capacity)
    for idx, vals in data.draw(batches(capacity, integral=True)):
        tree.update(idx, vals)
        leaves[idx] = vals
    if leaves.sum() == 0:
        leaves[capacity // 2] = 1.0
        tree.update(np.array([capacity // 2]), np.array([1.0]))
    total = tree.total()
    assert total == leaves.sum()
    seed = data.draw(st.integers(0, 2**32 - 1))
    random = np.random.default_rng(seed).uniform(0.0, total, 64)
    thresholds = np.concatenate([random, boundary_thresholds(leaves, total)])
    found = tree.find_prefix_sum(thresholds)
    np.testing.assert_array_equal(found, reference_find(leaves, thresholds))
    assert (leaves[found] > 0).all()


@settings(max_examples=100, deadline=None)
@given(
    capacity=st.integers(1, 300),
    tops=st.sampled_from(TOP_SETTINGS),
    zero_fraction=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**32 - 1),
)
def test_find_prefix_sum_float_priorities_never_pick_zero(
    capacity: int, tops: tuple, zero_fraction: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    leaves = rng.lognormal(0.0, 3.0, capacity) * (rng.random(capacity) >= zero_fraction)
    leaves[rng.integers(capacity)] = rng.random() + 1e-3
    with top_levels(*tops):
        tree = SumSegmentTree(capacity)
    tree.update(np.arange(capacity), leaves)
    total = tree.total()
    thresholds = np.concatenate([rng.uniform(0.0, total, 256), boundary_thresholds(leaves, total)])
    found = tree.find_prefix_sum(thresholds)
    assert_valid_pick(leaves, thresholds, found)
    beyond = thresholds >= total
    assert (found[beyond] == np.flatnonzero(leaves)[-1]).all()


@pytest.mark.parametrize("capacity", [2**11 + 3, 5000, 2**16 + 1])
def test_large_trees_use_every_code_path(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    sum_tree, min_tree = SumSegmentTree(capacity), MinSegmentTree(capacity)
    sum_ref, min_ref = np.zeros(capacity), np.full(capacity, np.inf)
    for _ in range(30):
        idx = rng.integers(0, capacity, 256)
        vals = rng.integers(0, 4, 256).astype(np.float64)
        sum_tree.update(idx, vals)
        min_tree.update(idx, vals)
        sum_ref[idx] = vals
        min_ref[idx] = vals
    assert sum_tree.total() == sum_ref.sum()
    assert min_tree.min() == min_ref.min()
    assert sum_tree.sum(17, capacity - 5) == sum_ref[17 : capacity - 5].sum()
    assert min_tree.min(100, 2000) == min_ref[100:2000].min()
    thresholds = np.concatenate(
        [rng.uniform(0, sum_tree.total(), 1000), boundary_thresholds(sum_ref, sum_tree.total())]
    )
    found = sum_tree.find_prefix_sum(thresholds)
    np.testing.assert_array_equal(found, reference_find(sum_ref, thresholds))


def test_duplicate_indices_last_write_wins() -> None:
    tree = SumSegmentTree(8)
    tree.update(np.array([3, 5, 3, 3]), np.array([1.0, 2.0, 7.0, 4.0]))
    assert tree[3] == 4.0
    assert tree.total() == 6.0
    min_tree = MinSegmentTree(8)
    min_tree.update(np.array([2, 2]), np.array([-1.0, 5.0]))
    assert min_tree.min() == 5.0


def test_find_prefix_sum_at_and_past_total_skips_trailing_zeros() -> None:
    tree = SumSegmentTree(6)
    tree.update(np.arange(6), np.array([0.0, 0.1, 0.2, 0.0, 0.7, 0.0]))
    total = tree.total()
    found = tree.find_prefix_sum(np.array([0.0, 0.1, total, np.nextafter(total, 0), 10.0]))
    np.testing.assert_array_equal(found, [1, 2, 4, 4, 4])


@pytest.mark.parametrize(
    ("leaves", "expected"),
    [([0.3, 0.0, 0.7, 0.0, 0.0], 2), ([0.0, 0.5, 0.2, 0.0, 0.5, 0.9, 0.8, 0.0], 6)],
)
def test_rounding_into_a_zero_run_is_pulled_back(leaves: list[float], expected: int) -> None:
    with top_levels(0, 0):
        tree = SumSegmentTree(len(leaves))
    tree.update(np.arange(len(leaves)), np.array(leaves))
    # Subtracting left-subtree sums on the way down carries a threshold just
    # below total() past the last non-zero leaf; the result must be pulled back.
    with mock.patch.object(
        SumSegmentTree, "_fix_zero_hits", autospec=True, side_effect=SumSegmentTree._fix_zero_hits
    ) as fix:
        found = tree.find_prefix_sum(np.array([np.nextafter(tree.total(), 0.0)]))
    assert fix.called
    assert found.tolist() == [expected]


def test_last_nonzero_before() -> None:
    tree = SumSegmentTree(8)
    tree.update(np.array([2, 5]), np.array([1.0, 1.0]))
    assert [tree._last_nonzero_before(i) for i in (3, 5, 6, 7)] == [2, 2, 5, 5]
    assert tree._last_nonzero_before(0) == 5  # nothing before: the last non-zero leaf


def test_find_prefix_sum_shapes_and_dtype() -> None:
    tree = SumSegmentTree(10)
    tree.update(np.arange(10), np.ones(10))
    out = tree.find_prefix_sum(np.array([[0.5, 1.5], [9.5, 2.0]]))
    assert out.dtype == np.int64 and out.shape == (2, 2)
    np.testing.assert_array_equal(out, [[0, 1], [9, 2]])
    assert tree.find_prefix_sum(np.array([])).shape == (0,)
    assert tree.find_prefix_sum(3.2).shape == ()


def test_scalar_value_broadcasts() -> None:
    tree = SumSegmentTree(5)
    tree.update(np.array([0, 2, 4]), 2.5)
    np.testing.assert_array_equal(tree[np.arange(5)], [2.5, 0, 2.5, 0, 2.5])


@pytest.mark.parametrize("cls", [SumSegmentTree, MinSegmentTree])
@pytest.mark.parametrize("bad", [7, 100, -1, -8])
def test_out_of_range_index_is_refused_and_changes_nothing(cls: type, bad: int) -> None:
    tree = cls(7)
    tree.update(np.array([1, 2]), np.array([1.0, 2.0]))
    before = tree.state_dict()["leaves"]
    with pytest.raises(IndexError, match=rf"index {bad} is out of range.*capacity 7"):
        tree.update(np.array([0, bad, 3]), np.array([5.0, 5.0, 5.0]))
    np.testing.assert_array_equal(tree.state_dict()["leaves"], before)


def test_uint_and_int32_indices_are_checked() -> None:
    tree = SumSegmentTree(4)
    tree.update(np.array([3], dtype=np.uint8), np.array([1.0]))
    tree.update(np.array([2], dtype=np.int32), np.array([1.0]))
    assert tree.total() == 2.0
    with pytest.raises(IndexError, match="index 4"):
        tree.update(np.array([4], dtype=np.uint64), np.array([1.0]))
    with pytest.raises(IndexError, match="index -2"):
        tree.update(np.array([-2], dtype=np.int32), np.array([1.0]))


@pytest.mark.parametrize(
    ("value", "shown"), [(-1.5, "-1.5"), (float("nan"), "nan"), (float("inf"), "inf")]
)
def test_sum_tree_refuses_bad_values_and_changes_nothing(value: float, shown: str) -> None:
    tree = SumSegmentTree(5)
    tree.update(np.array([0, 1]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=rf"finite and >= 0, got {shown} at position 1"):
        tree.update(np.array([0, 2, 3]), np.array([9.0, value, 9.0]))
    np.testing.assert_array_equal(tree[np.arange(5)], [1.0, 2.0, 0.0, 0.0, 0.0])
    assert tree.total() == 3.0


def test_negative_zero_is_stored_as_zero() -> None:
    tree = SumSegmentTree(3)
    tree.update(np.array([1]), np.array([-0.0]))
    assert not np.signbit(tree[1])


def test_min_tree_refuses_nan_only() -> None:
    tree = MinSegmentTree(4)
    tree.update(np.array([0, 1]), np.array([-3.0, np.inf]))
    assert tree.min() == -3.0
    with pytest.raises(ValueError, match="must not be NaN, got nan at position 2"):
        tree.update(np.array([2, 3, 1]), np.array([1.0, 1.0, np.nan]))
    np.testing.assert_array_equal(tree[np.arange(4)], [-3.0, np.inf, np.inf, np.inf])


def test_other_argument_errors() -> None:
    tree = SumSegmentTree(4)
    with pytest.raises(TypeError, match="integer"):
        tree.update(np.array([1.0]), np.array([1.0]))
    with pytest.raises(ValueError, match="3 values for 2 indices"):
        tree.update(np.array([1, 2]), np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="total"):
        tree.find_prefix_sum(np.array([0.0]))
    tree.update(np.array([1]), np.array([1.0]))
    with pytest.raises(ValueError, match=r"thresholds must be >= 0, got -0.5"):
        tree.find_prefix_sum(np.array([0.2, -0.5]))
    with pytest.raises(ValueError, match="got nan"):
        tree.find_prefix_sum(np.array([np.nan]))
    with pytest.raises(IndexError, match="out of bounds"):
        tree.sum(0, 5)
    with pytest.raises(ValueError, match="start <= end"):
        tree.sum(3, 1)
    with pytest.raises(ValueError, match=">= 1"):
        SumSegmentTree(0)
    with pytest.raises(TypeError):
        SumSegmentTree(2.0)  # type: ignore[arg-type]


def test_empty_update_is_a_no_op() -> None:
    tree = MinSegmentTree(3)
    tree.update(np.array([], dtype=np.int64), np.array([]))
    tree.update([], [])
    assert tree.min() == np.inf


@pytest.mark.parametrize("capacity", [1, 5, 300, 4099])
def test_state_dict_round_trip(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    tree, min_tree = SumSegmentTree(capacity), MinSegmentTree(capacity)
    for _ in range(5):
        idx = rng.integers(0, capacity, 50)
        vals = rng.random(50) * (rng.random(50) > 0.3)
        tree.update(idx, vals)
        min_tree.update(idx, vals)
    state = tree.state_dict()
    assert set(state) == {"leaves"} and state["leaves"].shape == (capacity,)
    assert state["leaves"].dtype == np.float64
    copy = SumSegmentTree.from_state_dict(state)
    min_copy = MinSegmentTree.from_state_dict(min_tree.state_dict())
    assert copy.capacity == capacity
    assert copy.total() == tree.total()
    np.testing.assert_array_equal(copy._tree, tree._tree)
    np.testing.assert_array_equal(min_copy._tree, min_tree._tree)
    if tree.total() > 0:
        t = rng.uniform(0, tree.total(), 500)
        np.testing.assert_array_equal(copy.find_prefix_sum(t), tree.find_prefix_sum(t))
    state["leaves"][:] = 123.0
    np.testing.assert_array_equal(tree.state_dict()["leaves"], copy.state_dict()["leaves"])


def test_from_state_dict_validates() -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        SumSegmentTree.from_state_dict({"leaves": np.array([1.0, -2.0])})
    with pytest.raises(ValueError, match="1-D"):
        SumSegmentTree.from_state_dict({"leaves": np.zeros((2, 2))})
    with pytest.raises(ValueError, match="NaN"):
        MinSegmentTree.from_state_dict({"leaves": np.array([np.nan])})


@given(capacity=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_range_queries_of_many_ranges_at_once_equal_one_at_a_time(capacity: int, seed: int) -> None:
    """What a prioritized sampler's readable ranges use: every range's sum and min in one pass."""
    from diskreplay.sampling.priority_table import PriorityTable

    rng = np.random.default_rng(seed)
    leaves = (rng.random(capacity) ** 8 * 1e3).astype(np.float32)
    leaves[rng.random(capacity) < 0.2] = 0  # a zero leaf never counts for the min
    table = PriorityTable.from_leaves(leaves)
    a, b = rng.integers(0, capacity + 1, 40), rng.integers(0, capacity + 1, 40)
    start, end = np.minimum(a, b), np.maximum(a, b)
    c, d = rng.integers(0, table.sums.capacity + 1, 40), rng.integers(0, table.sums.capacity + 1, 40)
    lo, hi = np.minimum(c, d), np.maximum(c, d)  # the trees over the blocks: the same order, the same bits
    np.testing.assert_array_equal(table.sums.queries(lo, hi), [table.sums.sum(int(x), int(y)) for x, y in zip(lo, hi)])
    np.testing.assert_array_equal(table.mins.queries(lo, hi), [table.mins.min(int(x), int(y)) for x, y in zip(lo, hi)])
    np.testing.assert_array_equal(table.range_mins(start, end), [table.min(int(s), int(e)) for s, e in zip(start, end)])
    np.testing.assert_allclose(table.range_sums(start, end), [table.sum(int(s), int(e)) for s, e in zip(start, end)],
                               rtol=1e-13, atol=0)
