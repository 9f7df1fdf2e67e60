"""Row ids users hold, checked against the readable window and turned into (lane, step) pairs."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.lanes import row_ids, split_row_ids


def readable_lane_steps(ids: Any, lo: np.ndarray, hi: np.ndarray,
                        num_envs: int) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
    """``(shape of ids, lanes, steps)`` of row ids that are all readable in ``[lo, hi)``.

    Raises IndexError for ids that are not integers, negative, not yet added or overwritten."""
    arr = np.asarray(ids)
    if arr.size == 0:
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise IndexError(f"row ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise IndexError(f"row id {int(arr.max())} is not in the buffer (larger than any row id)")
    flat = arr.reshape(-1).astype(np.int64)
    lane, step = split_row_ids(flat, num_envs)
    if num_envs == 1 and (not flat.size or (flat.min() >= max(int(lo[0]), 0) and flat.max() < hi[0])):
        return arr.shape, lane, step
    bad = (flat < 0) | (step < lo[lane]) | (step >= hi[lane])
    if bad.any():
        raise IndexError(f"row id {int(flat[bad][0])} is not in the buffer (readable ids per lane: steps "
                         f"{lo.tolist()} to {(hi - 1).tolist()}, id = step * {num_envs} + lane)")
    return arr.shape, lane, step


def newest_ids(lo: np.ndarray, hi: np.ndarray, n: int, num_envs: int) -> np.ndarray:
    """The ``n`` highest readable row ids (fewer if there are fewer), ascending."""
    ids = np.sort(np.concatenate([row_ids(lane, np.arange(max(int(lo[lane]), int(hi[lane]) - n), hi[lane]), num_envs)
                                  for lane in range(num_envs)]))
    return ids[max(len(ids) - n, 0):]  # each lane's newest n hold the n highest ids


def readable_ids(lo: np.ndarray, hi: np.ndarray, num_envs: int) -> np.ndarray:
    """Every readable row id, lane by lane in time order (int64)."""
    return np.concatenate([row_ids(lane, np.arange(lo[lane], hi[lane]), num_envs) for lane in range(num_envs)])


def sampled_lane_steps(index: Any, num_envs: int) -> tuple[np.ndarray, np.ndarray]:
    """``(lanes, steps)`` of row ids a batch gave (any shape, flattened). Raises IndexError for
    ids that are not non-negative integers (ids no longer readable are the sampler's to skip)."""
    ids = np.asarray(index).reshape(-1)
    if ids.dtype.kind not in "iu" or (ids < 0).any():
        raise IndexError(f"row ids must be non-negative integers, got {ids[:5]}... (dtype {ids.dtype})")
    return split_row_ids(ids.astype(np.int64), num_envs)


def locate(ids: Any, num_envs: int, shard_envs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(shard, lane, step)`` of each row id of a buffer of ``num_envs`` lanes, ``shard_envs``
    per shard. Raises IndexError for a negative id."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.size and ids.min() < 0:
        raise IndexError(f"row ids must be >= 0, got {int(ids.min())}")
    step, lane = np.divmod(ids, num_envs)
    shard, lane = np.divmod(lane, shard_envs)
    return shard, lane, step
