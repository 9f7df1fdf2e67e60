"""Array-backed segment trees for prioritized replay (sum and min).

Both trees store ``2 * P`` float64 nodes in one flat numpy array, where ``P``
is the smallest power of two ``>= capacity``: the root is node 1 and the
leaves are nodes ``P .. 2P - 1``. Every internal node is always recomputed
from its two children (never maintained by deltas), so the tree is a pure
function of its leaves and sums do not drift.

All batched operations are vectorized over the batch; the only Python loops
run over tree levels. Bottom levels are processed a few levels per step on
cache-line-sized blocks of siblings, and the top levels (a few thousand
nodes) are recomputed whole, which is cheaper than gathering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np

__all__ = ["SumSegmentTree", "MinSegmentTree"]

_BLOCK_LEVELS = 3
"""Levels handled per gather step below the top region (2**3 float64 = one cache line)."""

_TOP_LEVELS = 10
"""Levels under the root that are recomputed whole (update) or scanned whole (search)."""

_ALIGN = 64
_SIGN_OR_NONFINITE = np.uint64(0x7FF0000000000000)


def _aligned_full(size: int, fill: float) -> np.ndarray:
    """A float64 array of ``size`` elements filled with ``fill``, 64-byte aligned."""
    pad = _ALIGN // 8
    raw = np.zeros(size + pad) if fill == 0.0 else np.full(size + pad, fill)
    offset = (-raw.ctypes.data % _ALIGN) // 8
    return raw[offset : offset + size]


def _split_levels(levels: int, step: int) -> list[int]:
    """Split ``levels`` into near-equal chunks of at most ``step`` levels."""
    if levels <= 0:
        return []
    count = -(-levels // step)
    base, extra = divmod(levels, count)
    return [base + 1] * extra + [base] * (count - extra)


class _SegmentTree:
    """Shared machinery; subclasses set the combining ufunc and neutral element."""

    _op: ClassVar[np.ufunc]
    _neutral: ClassVar[float]

    def __init__(self, capacity: int) -> None:
        """Create a tree of ``capacity`` leaves, all holding the neutral element.

        Raises:
            TypeError: ``capacity`` is not an integer.
            ValueError: ``capacity < 1``.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity: int = int(capacity)
        self._depth = (self.capacity - 1).bit_length()
        size = 1 << self._depth
        self._tree = _aligned_full(2 * size, self._neutral)
        self._levels = [self._tree[1 << lv : 2 << lv] for lv in range(self._depth + 1)]
        self._leaves = self._levels[self._depth][: self.capacity]
        self._plan()

    def _plan(self) -> None:
        """Precompute the per-level views used by ``update`` and searches."""
        depth = self._depth
        top = min(depth, _TOP_LEVELS)
        self._top = top
        self._top_plan = [
            (self._levels[lv + 1][0::2], self._levels[lv + 1][1::2], self._levels[lv])
            for lv in reversed(range(top))
        ]
        self._up_plan: list[tuple[int, np.ndarray, list[np.ndarray]]] = []
        level = depth
        for s in _split_levels(depth - top, _BLOCK_LEVELS):
            block = self._levels[level].reshape(-1, 1 << s)
            writes = [self._levels[level - r].reshape(-1, 1 << (s - r)) for r in range(1, s + 1)]
            self._up_plan.append((s, block, writes))
            level -= s
        self._down_plan = [(s, b) for s, b, _ in reversed(self._up_plan)]

    def __len__(self) -> int:
        return self.capacity

    def __getitem__(self, indices: Any) -> np.ndarray:
        """Leaf values (float64 copy) at ``indices`` (numpy indexing rules).

        Raises:
            IndexError: an index is outside ``[-capacity, capacity)``.
        """
        return np.array(self._leaves[indices], dtype=np.float64, copy=True)

    def update(self, indices: np.ndarray, values: np.ndarray | float) -> None:
        """Set ``leaves[indices] = values`` and recompute the affected ancestors.

        Args:
            indices: integer array of leaf indices, any shape; duplicates allowed,
                the last write wins (numpy assignment semantics).
            values: float64-castable array broadcastable to ``indices.shape``.

        Raises:
            TypeError: ``indices`` is not an integer array.
            IndexError: an index is negative or ``>= capacity`` (named in the message).
            ValueError: a value is not acceptable for this tree (named in the
                message), or ``values`` does not broadcast to ``indices``.
        Nothing is modified when an exception is raised.
        """
        idx = self._check_indices(indices)
        if idx.size == 0:
            return
        vals = self._check_values(self._broadcast_values(values, idx))
        self._levels[self._depth][idx] = vals
        self._propagate(idx)

    def _propagate(self, idx: np.ndarray) -> None:
        """Recompute all ancestors of leaf positions ``idx`` (local leaf indices)."""
        op = self._op
        for s, block, writes in self._up_plan:
            idx = idx >> s
            cur = block[idx]
            for view in writes:
                cur = op(cur[:, 0::2], cur[:, 1::2])
                view[idx] = cur
        for left, right, out in self._top_plan:
            op(left, right, out=out)

    def _rebuild(self) -> None:
        """Recompute every internal node from the leaves."""
        op = self._op
        for lv in reversed(range(self._depth)):
            child = self._levels[lv + 1]
            op(child[0::2], child[1::2], out=self._levels[lv])

    def _query(self, start: int, end: int | None) -> float:
        """Combine leaves ``[start, end)`` with the tree's operation."""
        end = self.capacity if end is None else end
        if not 0 <= start <= self.capacity or not 0 <= end <= self.capacity:
            raise IndexError(
                f"range [{start}, {end}) is out of bounds: expected "
                f"0 <= start <= end <= capacity={self.capacity}"
            )
        if start > end:
            raise ValueError(f"expected start <= end, got start={start}, end={end}")
        tree, op = self._tree, self._op
        result = self._neutral
        lo, hi = start + (1 << self._depth), end + (1 << self._depth)
        while lo < hi:
            if lo & 1:
                result = op(result, tree[lo])
                lo += 1
            if hi & 1:
                hi -= 1
                result = op(result, tree[hi])
            lo >>= 1
            hi >>= 1
        return float(result)

    def _check_indices(self, indices: Any) -> np.ndarray:
        """Validate ``indices`` and return them as a flat intp array."""
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            if idx.size:
                raise TypeError(f"indices must be an integer array, got dtype {idx.dtype}")
            idx = idx.astype(np.intp)
        idx = idx.ravel()
        if idx.size and not self._indices_in_range(idx):
            bad = idx[(idx < 0) | (idx >= self.capacity)][0]
            raise IndexError(
                f"index {bad} is out of range for {type(self).__name__} of capacity "
                f"{self.capacity}: expected 0 <= index < {self.capacity}"
            )
        return idx.astype(np.intp, copy=False)

    def _indices_in_range(self, idx: np.ndarray) -> bool:
        if idx.dtype == np.intp:
            return bool(np.maximum.reduce(idx.view(np.uintp)) < self.capacity)
        return bool(np.minimum.reduce(idx) >= 0 and np.maximum.reduce(idx) < self.capacity)

    @staticmethod
    def _broadcast_values(values: Any, idx: np.ndarray) -> np.ndarray:
        vals = np.asarray(values, dtype=np.float64)
        if vals.shape != idx.shape:
            if vals.size != idx.size and vals.size != 1:
                raise ValueError(
                    f"values of shape {vals.shape} do not match {idx.size} indices"
                )
            vals = np.broadcast_to(vals.ravel(), idx.shape)
        return np.ascontiguousarray(vals)

    def _check_values(self, vals: np.ndarray) -> np.ndarray:
        """Return ``vals`` (flat float64) if acceptable, else raise ValueError."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        """``{"leaves": float64 array of shape (capacity,)}``, a copy."""
        return {"leaves": self._leaves.copy()}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Any:
        """Rebuild a tree from :meth:`state_dict` output.

        Raises:
            KeyError: ``state`` has no ``"leaves"``.
            ValueError: leaves are not a non-empty 1-D array or hold refused values.
        """
        leaves = np.ascontiguousarray(state["leaves"], dtype=np.float64)
        if leaves.ndim != 1 or leaves.size == 0:
            raise ValueError(f"expected non-empty 1-D leaves, got shape {leaves.shape}")
        tree = cls(leaves.size)
        tree._leaves[:] = tree._check_values(leaves)
        tree._rebuild()
        return tree

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity})"


class SumSegmentTree(_SegmentTree):
    """Sum tree over ``capacity`` non-negative finite float64 leaves (initially 0)."""

    _op = np.add
    _neutral = 0.0

    def _check_values(self, vals: np.ndarray) -> np.ndarray:
        bits = vals.view(np.uint64)
        if bits.size == 0 or np.maximum.reduce(bits) < _SIGN_OR_NONFINITE:
            return vals
        bad = ~(vals >= 0) | ~np.isfinite(vals)
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"SumSegmentTree values must be finite and >= 0, got {vals[pos]!r} "
                f"at position {pos}"
            )
        return vals + 0.0  # turns -0.0 into 0.0

    def total(self) -> float:
        """Sum of all leaves."""
        return float(self._tree[1])

    def sum(self, start: int = 0, end: int | None = None) -> float:
        """Sum of leaves ``[start, end)``; ``end=None`` means ``capacity``.

        Raises:
            IndexError: bounds outside ``[0, capacity]``.
            ValueError: ``start > end``.
        """
        return self._query(start, end)

    def find_prefix_sum(self, thresholds: np.ndarray | float) -> np.ndarray:
        """For each threshold ``t`` the smallest ``i`` with ``sum(leaves[:i+1]) > t``.

        Args:
            thresholds: float array, any shape, each ``0 <= t < total()``.
                Larger thresholds (e.g. ``total()`` after rounding) return the
                last leaf with a non-zero value.

        Returns:
            int64 array of leaf indices, shape of ``thresholds``. A leaf holding
            0 (or a padding leaf) is never returned.

        Raises:
            ValueError: ``total() == 0``, or a threshold is negative or NaN.
        """
        t = np.array(thresholds, dtype=np.float64, copy=True)
        shape = t.shape
        t = t.reshape(-1)
        if t.size == 0:
            return np.zeros(shape, dtype=np.int64)
        if not self._tree[1] > 0:
            raise ValueError("find_prefix_sum needs total() > 0, got a tree summing to 0")
        if not np.minimum.reduce(t) >= 0:
            pos = int(np.flatnonzero(~(t >= 0))[0])
            raise ValueError(f"thresholds must be >= 0, got {t[pos]!r} at position {pos}")
        idx = self._search_top(t)
        for s, block in self._down_plan:
            idx = self._search_block(t, idx, s, block)
        return idx.astype(np.int64, copy=False).reshape(shape)

    def _search_top(self, t: np.ndarray) -> np.ndarray:
        """Descend from the root to level ``_top`` for all ``t`` at once (``t`` updated)."""
        level = self._levels[self._top]
        cum = np.empty(level.size + 1)
        cum[0] = 0.0
        np.cumsum(level, out=cum[1:])
        np.minimum(t, math.nextafter(cum[-1], -math.inf), out=t)
        idx = np.searchsorted(cum[1:], t, side="right")
        t -= cum[idx]
        return idx

    @staticmethod
    def _search_block(t: np.ndarray, idx: np.ndarray, s: int, block: np.ndarray) -> np.ndarray:
        """Descend ``s`` levels: pick, below each node ``idx``, the child holding ``t``."""
        width = 1 << s
        n = idx.size
        cum = np.empty((n, width + 1))
        cum[:, 0] = 0.0
        np.cumsum(block[idx], axis=1, out=cum[:, 1:])
        np.minimum(t, np.nextafter(cum[:, -1], -np.inf), out=t)
        step = np.add.reduce(cum[:, 1:] <= t[:, None], axis=1, dtype=np.intp)
        t -= cum.reshape(-1)[np.arange(0, n * (width + 1), width + 1) + step]
        idx <<= s
        idx += step
        return idx


class MinSegmentTree(_SegmentTree):
    """Min tree over ``capacity`` float64 leaves (initially ``+inf``); NaN is refused."""

    _op = np.minimum
    _neutral = math.inf

    def _check_values(self, vals: np.ndarray) -> np.ndarray:
        if vals.size == 0 or not np.isnan(np.minimum.reduce(vals)):
            return vals
        pos = int(np.flatnonzero(np.isnan(vals))[0])
        raise ValueError(f"MinSegmentTree values must not be NaN, got nan at position {pos}")

    def min(self, start: int = 0, end: int | None = None) -> float:
        """Minimum of leaves ``[start, end)`` (``+inf`` if empty or never set).

        Raises:
            IndexError: bounds outside ``[0, capacity]``.
            ValueError: ``start > end``.
        """
        if start == 0 and end is None:
            return float(self._tree[1])
        return self._query(start, end)


_Op = Callable[[np.ndarray, np.ndarray], np.ndarray]
