"""Index arithmetic of diskreplay.lanes against brute-force enumeration."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from diskreplay.buffer.row_lookup import readable_lane_steps
from diskreplay.format.lanes import LaneLayout, flat_to_lane_step, row_ids, split_row_ids


@st.composite
def layouts(draw):
    """Layouts as buffers build them: a ring's chunk is never longer than the ring."""
    num_envs = draw(st.integers(1, 4))
    cap = draw(st.one_of(st.none(), st.integers(1, 40)))
    chunk_rows = draw(st.integers(1, 12 if cap is None else min(cap, 12)))
    return LaneLayout(num_envs, cap, chunk_rows)


def brute_slot(layout: LaneLayout, step: int) -> int:
    return step if layout.lane_capacity is None else step % layout.lane_capacity


steps = st.integers(0, 300)


@given(layouts(), st.lists(steps, min_size=1, max_size=20))
def test_slot_and_chunk_and_offset(layout, step_list):
    arr = np.array(step_list, dtype=np.int64)
    slots = layout.slot(arr)
    np.testing.assert_array_equal(slots, [brute_slot(layout, s) for s in step_list])
    for s in step_list:
        assert layout.slot(s) == brute_slot(layout, s)
    chunk, offset = layout.chunk_and_offset(arr)
    np.testing.assert_array_equal(chunk * layout.chunk_rows + offset, slots)
    assert ((0 <= offset) & (offset < layout.chunk_rows)).all()
    if layout.lane_capacity is not None:
        assert (chunk < layout.chunks_per_lane()).all()
    else:
        assert (chunk < layout.chunks_per_lane(int(arr.max()) + 1)).all()


@given(layouts(), st.lists(steps, min_size=1, max_size=8))
def test_oldest_and_chunks_per_lane(layout, totals):
    total = np.array(totals, dtype=np.int64)
    cap = layout.lane_capacity
    want = [0 if cap is None else max(0, t - cap) for t in totals]
    np.testing.assert_array_equal(layout.oldest(total), want)
    rows = cap if cap is not None else max(max(totals), 1)
    assert layout.chunks_per_lane(max(totals)) == -(-rows // layout.chunk_rows)
    # every slot that exists lies in one of chunks_per_lane chunks, and the last chunk is used
    assert (rows - 1) // layout.chunk_rows == layout.chunks_per_lane(max(totals)) - 1


@given(layouts(), steps, st.integers(1, 100))
def test_piece_length(layout, step, remaining):
    def same_piece(k):
        a, b = brute_slot(layout, step), brute_slot(layout, step + k)
        return b == a + k and a // layout.chunk_rows == b // layout.chunk_rows

    want = 1
    while want < remaining and same_piece(want):
        want += 1
    assert layout.piece_length(step, remaining) == want


@settings(max_examples=300)
@given(layouts(), steps, st.integers(0, 100))
def test_chunks_between(layout, first, length):
    last = first + length
    want = sorted({brute_slot(layout, s) // layout.chunk_rows for s in range(first, last)})
    got = layout.chunks_between(first, last)
    assert got.dtype.kind == "i"
    assert got.tolist() == want
    assert layout.chunks_between(last, first).size == 0 or length == 0


@given(layouts(), st.integers(0, 300), st.integers(0, 40))
def test_newest_in_chunk(layout, total, chunk):
    assume(layout.lane_capacity is None or chunk < layout.chunks_per_lane())
    want = max((s for s in range(total) if brute_slot(layout, s) // layout.chunk_rows == chunk), default=-1)
    assert layout.newest_in_chunk(total, chunk) == want


@given(st.integers(1, 6), st.lists(st.integers(0, 10**12), min_size=0, max_size=30))
def test_row_ids_and_split_are_inverse(num_envs, ids_list):
    ids = np.array(ids_list, dtype=np.int64)
    lane, step = split_row_ids(ids, num_envs)
    assert ((0 <= lane) & (lane < num_envs)).all() and (step >= 0).all()
    np.testing.assert_array_equal(row_ids(lane, step, num_envs), ids)
    lanes = ids % num_envs
    steps_ = ids // 7
    back_lane, back_step = split_row_ids(row_ids(lanes, steps_, num_envs), num_envs)
    np.testing.assert_array_equal(back_lane, lanes)
    np.testing.assert_array_equal(back_step, steps_)


def test_row_id_of_one_lane_is_the_step():
    ids = np.arange(10)
    lane, step = split_row_ids(ids, 1)
    np.testing.assert_array_equal(lane, 0)
    np.testing.assert_array_equal(step, ids)
    assert row_ids(np.int64(2), np.int64(5), 3) == 17


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 6)), min_size=1, max_size=5))
def test_flat_to_lane_step_matches_enumeration(windows):
    lo = np.array([a for a, _ in windows], dtype=np.int64)
    hi = lo + np.array([n for _, n in windows], dtype=np.int64)
    pairs = [(lane, step) for lane in range(len(windows)) for step in range(lo[lane], hi[lane])]
    pos = np.arange(len(pairs), dtype=np.int64)
    lane, step = flat_to_lane_step(pos, lo, hi)
    assert list(zip(lane.tolist(), step.tolist())) == pairs
    # any order of positions, repeated
    if pairs:
        shuffled = np.random.default_rng(0).integers(0, len(pairs), 50)
        lane, step = flat_to_lane_step(shuffled, lo, hi)
        assert list(zip(lane.tolist(), step.tolist())) == [pairs[p] for p in shuffled]


@given(st.integers(1, 3), st.data())
def test_readable_lane_steps_accept_exactly_the_window(num_envs, data):
    """Ids are accepted iff each one's step lies in its lane's ``[lo, hi)``; else the first bad
    id is named."""
    lo = np.array(data.draw(st.lists(st.integers(0, 10), min_size=num_envs, max_size=num_envs)), np.int64)
    hi = lo + np.array(data.draw(st.lists(st.integers(0, 10), min_size=num_envs, max_size=num_envs)), np.int64)
    lanes = data.draw(st.lists(st.integers(0, num_envs - 1), max_size=12))
    ids = np.array([data.draw(st.integers(lo[e] - 2, hi[e] + 1)) * num_envs + e for e in lanes], np.int64)
    bad = [int(i) for i in ids if i < 0 or not lo[i % num_envs] <= i // num_envs < hi[i % num_envs]]
    if bad:
        with pytest.raises(IndexError, match=rf"^row id {bad[0]} is not in the buffer"):
            readable_lane_steps(ids, lo, hi, num_envs)
        return
    shape, lane, step = readable_lane_steps(ids, lo, hi, num_envs)
    assert shape == ids.shape
    np.testing.assert_array_equal(row_ids(lane, step, num_envs), ids)
