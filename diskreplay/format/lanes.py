"""Index arithmetic of env lanes, rings and chunks: pure functions over small integer arrays.

Vocabulary used across the package:
- *lane*: one env's time-ordered stream of steps (``num_envs`` lanes; 1 by default).
- *step*: a step's absolute position in its lane, counting every step ever added (never wraps).
- *slot*: where a step is stored along the lane axis: ``step % lane_capacity`` in a ring,
  ``step`` in dataset mode (``lane_capacity=None``).
- *row id*: the user-facing index of a step, ``step * num_envs + lane``. With one lane it is
  simply "the n-th row ever added". It stays valid until the ring overwrites that row.
- *window*: the steps of a lane currently readable, ``[lo, hi)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np


@dataclass(frozen=True)
class LaneLayout:
    """Shape of the storage: lanes, ring capacity per lane (None = grow forever), chunk length."""

    num_envs: int
    lane_capacity: int | None
    chunk_rows: int

    @overload
    def slot(self, step: int) -> int: ...
    @overload
    def slot(self, step: np.ndarray) -> np.ndarray: ...

    def slot(self, step: np.ndarray | int) -> np.ndarray | int:
        """Where each step is stored along its lane: ``step % lane_capacity`` in a ring."""
        return step % self.lane_capacity if self.lane_capacity else step

    def chunk_and_offset(self, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Chunk index along the lane and row inside that chunk, for each step."""
        slot, rows = self.slot(step), self.chunk_rows
        if rows & (rows - 1) or not isinstance(slot, np.ndarray) or slot.dtype.kind != "i":
            return np.divmod(slot, rows)
        return slot >> (rows.bit_length() - 1), slot & (rows - 1)  # a power of two: no division

    @overload
    def oldest(self, total: int) -> int: ...
    @overload
    def oldest(self, total: np.ndarray) -> np.ndarray: ...

    def oldest(self, total: np.ndarray | int) -> np.ndarray | int:
        """First step still stored in each lane once ``total`` steps were added."""
        if isinstance(total, int):
            return max(total - self.lane_capacity, 0) if self.lane_capacity is not None else 0
        if self.lane_capacity is None:
            return np.zeros_like(total)
        oldest: np.ndarray = np.maximum(total - self.lane_capacity, 0)
        return oldest

    def visible(self, lower: np.ndarray, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the steps ``[max(lower, total - lane_capacity), total)`` that are readable
        once ``total`` steps were added and those below ``lower`` retired (``hi`` is ``total``)."""
        if len(total) == 1:  # one lane: Python ints cost less than four array operations
            added = int(total[0])
            return np.array([min(max(int(lower[0]), self.oldest(added)), added)]), total
        return np.minimum(np.maximum(lower, self.oldest(total)), total), total

    def chunks_per_lane(self, total_steps: int = 0) -> int:
        if self.lane_capacity is not None:
            return -(-self.lane_capacity // self.chunk_rows)
        return -(-max(total_steps, 1) // self.chunk_rows)

    def piece_length(self, step: int, remaining: int) -> int:
        """How many of ``remaining`` steps from ``step`` fit before a chunk or ring boundary."""
        slot = self.slot(step)
        room = self.chunk_rows - slot % self.chunk_rows
        if self.lane_capacity is not None:
            room = min(room, self.lane_capacity - slot)
        return min(room, remaining)

    def newest_in_chunk(self, total: int, chunk: int) -> int:
        """The newest of a lane's first ``total`` steps stored in ``chunk`` (-1: none is). In a
        ring, ``chunk`` is one of its `chunks_per_lane`."""
        first_slot, rows = chunk * self.chunk_rows, self.chunk_rows
        last = total - 1
        if self.lane_capacity is None:
            return min(last, first_slot + rows - 1) if last >= first_slot else -1
        cap = self.lane_capacity
        end = min(first_slot + rows, cap) - 1  # the chunk's last slot
        newest = last if first_slot <= last % cap <= end else last - (last % cap - end) % cap
        return max(newest, -1)

    def chunks_between(self, first: int, last: int) -> np.ndarray:
        """Distinct chunk indices holding steps ``[first, last)`` of one lane, sorted."""
        if last <= first:
            return np.zeros(0, dtype=np.int64)
        cap = self.lane_capacity
        if cap is None:
            return np.arange(first // self.chunk_rows, (last - 1) // self.chunk_rows + 1, dtype=np.int64)
        if last - first >= cap:
            return np.arange(self.chunks_per_lane(), dtype=np.int64)
        # the steps occupy at most two slot runs: [slot(first), ...) and, after a wrap, [0, ...)
        a, b = first % cap // self.chunk_rows, (last - 1) % cap // self.chunk_rows
        if first % cap <= (last - 1) % cap:
            return np.arange(a, b + 1, dtype=np.int64)
        return np.union1d(np.arange(0, b + 1, dtype=np.int64),
                          np.arange(a, self.chunks_per_lane(), dtype=np.int64))


def is_empty(lo: np.ndarray, hi: np.ndarray) -> bool:
    """No lane's window ``[lo, hi)`` holds a step."""
    return bool(hi[0] <= lo[0]) if len(lo) == 1 else not (hi > lo).any()


def row_ids(lane: np.ndarray | int, step: np.ndarray, num_envs: int) -> np.ndarray:
    """The row id of each (lane, step): ``step * num_envs + lane`` (with one lane, the step)."""
    return step if num_envs == 1 else step * num_envs + lane


def split_row_ids(ids: np.ndarray, num_envs: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `row_ids`: (lane, step) per id (with one lane, ``step`` is ``ids`` itself)."""
    if num_envs == 1:
        return np.zeros_like(ids), ids
    step, lane = np.divmod(ids, num_envs)
    return lane, step


def flat_to_lane_step(pos: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Map positions in ``[0, sum(hi - lo))`` onto (lane, step), lane by lane in order.

    Uniform positions give uniform rows over all lanes' windows ``[lo, hi)``.
    """
    if lo.size == 1:
        return np.zeros_like(pos), lo[0] + pos
    ends = np.cumsum(hi - lo)
    lane = np.searchsorted(ends, pos, side="right")
    starts = ends - (hi - lo)
    return lane, lo[lane] + pos - starts[lane]
