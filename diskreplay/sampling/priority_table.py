"""`PriorityTable`: the priorities of a prioritized sampler, 6 bytes of RAM per row.

Leaves are float32 (as TorchRL's ``SumSegmentTreeFp32``; a priority needs no more). They are
grouped in blocks of `BLOCK` leaves, and float64 sum and min segment trees are kept over the
blocks only, not over every leaf: 64 M rows take 256 MB of leaves and 128 MB of trees, where two
float64 trees over every leaf take 2 GB (32 bytes per row). A draw descends the block tree to a
block, then finds its leaf with one prefix sum over the block's leaves (one cache line; vectorized
over the batch). Block sums are recomputed from the leaves, never kept by deltas, so they do not
drift.
"""

from __future__ import annotations

import numpy as np

from .segment_tree import MinSegmentTree, SumSegmentTree

BLOCK = 16
"""Leaves per block: a draw reads one block's leaves (64 bytes). Larger blocks save tree memory
(64: 4.5 bytes per row) but cost more per draw than the tree levels they remove (measured)."""


class PriorityTable:
    """``capacity`` float32 leaves (initially 0) with sums and minimums over any range, and
    draws proportional to the leaves (a leaf holding 0 is never drawn)."""

    def __init__(self, capacity: int):
        """Raises ValueError for a ``capacity`` < 1."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        blocks = -(-self.capacity // BLOCK)
        self._blocks = np.zeros((blocks, BLOCK), np.float32)
        self.leaves = self._blocks.reshape(-1)[: self.capacity]
        self.sums = SumSegmentTree(blocks)
        self.mins = MinSegmentTree(blocks)

    @classmethod
    def from_leaves(cls, leaves: np.ndarray) -> PriorityTable:
        """A table holding ``leaves`` (finite, >= 0; checked by the caller), built in vectorized passes."""
        table = cls(len(leaves))
        table.leaves[:] = leaves
        table.rebuild()
        return table

    def rebuild(self) -> None:
        """Recompute both trees from the leaves (after writing `leaves` directly)."""
        self.sums.refill(self._blocks.sum(axis=1, dtype=np.float64))
        self.mins.refill(_positive_min(self._blocks))

    def nbytes(self) -> int:
        """RAM held: leaves and both block trees."""
        return self._blocks.nbytes + self.sums.nbytes() + self.mins.nbytes()

    def set(self, leaf: np.ndarray, value: np.ndarray) -> None:
        """``leaves[leaf] = value`` (float32; the last write wins for a repeated leaf)."""
        self.leaves[leaf] = value
        blocks = (leaf // BLOCK).astype(np.intp, copy=False)  # repeated blocks get equal values
        rows = self._blocks[blocks]
        self.sums.assign(blocks, rows.sum(axis=1, dtype=np.float64))
        self.mins.assign(blocks, _positive_min(rows))

    def __getitem__(self, leaf: np.ndarray) -> np.ndarray:
        """Leaf values as float64."""
        values: np.ndarray = self.leaves[leaf].astype(np.float64)
        return values

    def total(self) -> float:
        """Sum of all leaves."""
        return self.sums.total()

    def sum(self, start: int, end: int) -> float:
        """Sum of leaves ``[start, end)``."""
        first, last = -(-start // BLOCK), end // BLOCK
        if first > last:
            return float(self.leaves[start:end].sum(dtype=np.float64))
        edges = self.leaves[start:first * BLOCK].sum(dtype=np.float64) + self.leaves[last * BLOCK:end].sum(
            dtype=np.float64)
        return self.sums.sum(first, last) + float(edges)

    def min(self, start: int = 0, end: int | None = None) -> float:
        """Smallest leaf > 0 in ``[start, end)`` (``inf`` if none)."""
        if start == 0 and end is None:
            return self.mins.min()  # padding leaves hold 0: not counted
        end = self.capacity if end is None else end
        first, last = -(-start // BLOCK), end // BLOCK
        if first > last:
            return float(_positive_min(self.leaves[start:end][None])[0])
        edges = _positive_min(np.concatenate([self.leaves[start:first * BLOCK], self.leaves[last * BLOCK:end]])[None])
        return min(self.mins.min(first, last), float(edges[0]))

    def range_sums(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """`sum` of every range ``[start[i], end[i])`` at once (float64; within ``[0, capacity]``):
        the same block sums, the leaves at the edges summed in another order (the last bit may differ)."""
        first, last = -(-start // BLOCK), end // BLOCK
        inner = first <= last
        edges = self._edges(start, np.where(inner, first * BLOCK, end), 0.0).sum(axis=1)
        edges += self._edges(np.where(inner, last * BLOCK, end), end, 0.0).sum(axis=1)
        out: np.ndarray = np.where(inner, self.sums.queries(np.minimum(first, last), last) + edges, edges)
        return out

    def range_mins(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """`min` of every range ``[start[i], end[i])`` at once (smallest leaf > 0, ``inf`` if none)."""
        first, last = -(-start // BLOCK), end // BLOCK
        inner = first <= last
        edges = np.minimum(self._edges(start, np.where(inner, first * BLOCK, end), np.inf).min(axis=1),
                           self._edges(np.where(inner, last * BLOCK, end), end, np.inf).min(axis=1))
        out: np.ndarray = np.where(inner, np.minimum(self.mins.queries(np.minimum(first, last), last), edges), edges)
        return out

    def _edges(self, start: np.ndarray, end: np.ndarray, fill: float) -> np.ndarray:
        """Per range ``[start[i], end[i])`` inside one block (or empty): that block's leaves,
        ``fill`` outside the range and where a leaf is 0 for a min (``fill`` inf)."""
        block = np.minimum(start // BLOCK, len(self._blocks) - 1)
        column = np.arange(BLOCK)
        rows: np.ndarray = self._blocks[block].astype(np.float64)
        outside = (column < (start - block * BLOCK)[:, None]) | (column >= (end - block * BLOCK)[:, None])
        if fill == np.inf:
            outside |= rows == 0
        rows[outside] = fill
        return rows

    def find(self, thresholds: np.ndarray) -> np.ndarray:
        """For each threshold ``t`` in ``[0, total())``, the leaf ``i`` with ``sum(leaves[:i]) <= t
        < sum(leaves[:i+1])`` (int64); rounding at a block's end gives its last leaf > 0."""
        block, rest = self.sums.locate(thresholds)
        rows = self._blocks[block]
        running = np.cumsum(rows.reshape(-1), dtype=np.float64)  # the blocks' leaves, one after another
        before = np.zeros(len(block))
        before[1:] = running[BLOCK - 1:-1:BLOCK]
        at = np.searchsorted(running, rest + before, side="right") - np.arange(0, len(running), BLOCK)
        past = at >= BLOCK
        if past.any():
            at[past] = BLOCK - 1 - np.argmax(rows[past][:, ::-1] > 0, axis=1)
        leaf: np.ndarray = block * BLOCK + at
        return leaf


def _positive_min(rows: np.ndarray) -> np.ndarray:
    """Per row, the smallest value > 0 (``inf`` where none): a zero leaf is never drawn, so it
    does not set the weights' minimum."""
    low: np.ndarray = np.minimum.reduce(rows, axis=1, initial=np.inf).astype(np.float64)
    zero = low == 0
    if zero.any():
        low[zero] = np.where(rows[zero] > 0, rows[zero], np.inf).min(axis=1, initial=np.inf)
    return low
