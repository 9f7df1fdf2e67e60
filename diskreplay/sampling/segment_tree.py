"""Array-backed segment trees for prioritized replay (sum and min).

Both trees keep ``2 * P`` float64 nodes in one flat numpy array, ``P`` being
the smallest power of two ``>= capacity``: the root is node 1, the children of
node ``i`` are ``2i`` and ``2i + 1``, and the leaves are nodes ``P .. 2P - 1``.
Padding leaves hold the neutral element. Every internal node is recomputed
from its two children (never maintained by deltas), so the tree is a pure
function of its leaves and sums do not drift.

Batched operations are vectorized over the batch; the only Python loops run
over tree levels. ``update`` gathers sibling pairs through a complex128 view
of each level and recomputes the top levels whole (a thousand nodes are
cheaper to recompute than to gather). ``find_prefix_sum`` sorts the
thresholds, resolves the top levels with one ``searchsorted`` over a prefix
sum of one level and descends the rest one level per step. Per level and per
call, numpy overhead (~0.4 us) and, on big trees, cache misses dominate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Self

import numpy as np

__all__ = ["SumSegmentTree", "MinSegmentTree"]

_TOP_UPDATE_LEVELS = 12
_TOP_SEARCH_LEVELS = 10
_ALIGN_BYTES = 64
_NONNEG_FINITE_LIMIT = np.uint64(0x7FF0000000000000)


def _aligned_full(size: int, fill: float) -> np.ndarray:
    """Float64 array of ``size`` elements set to ``fill``, aligned to 64 bytes."""
    pad = _ALIGN_BYTES // 8
    raw = np.zeros(size + pad) if fill == 0.0 else np.full(size + pad, fill)
    offset = (-raw.ctypes.data % _ALIGN_BYTES) // 8
    return raw[offset : offset + size]


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
        self._tree = _aligned_full(2 << self._depth, self._neutral)
        self._levels = [self._tree[1 << lv : 2 << lv] for lv in range(self._depth + 1)]
        self._leaves = self._levels[self._depth][: self.capacity]
        self._plan()

    def _plan(self) -> None:
        """Precompute the per-level views used by ``update`` and searches."""
        depth, levels = self._depth, self._levels
        top = min(depth, _TOP_UPDATE_LEVELS)
        self._top_plan = [
            (levels[lv + 1][0::2], levels[lv + 1][1::2], levels[lv]) for lv in reversed(range(top))
        ]
        self._shifts = np.arange(1, depth - top + 1, dtype=np.intp)[:, None]
        self._pair_views = [levels[depth - r].view(np.complex128) for r in range(depth - top)]
        self._parent_views = [levels[depth - 1 - r] for r in range(depth - top)]

    def __len__(self) -> int:
        return self.capacity

    def nbytes(self) -> int:
        """RAM held by the nodes."""
        return int(self._tree.nbytes)

    def __getitem__(self, indices: Any) -> np.ndarray:
        """Leaf values (a float64 copy) at ``indices``, with numpy indexing rules.

        Raises:
            IndexError: an index is outside ``[-capacity, capacity)``.
        """
        return np.array(self._leaves[indices], dtype=np.float64, copy=True)

    def update(self, indices: Any, values: Any) -> None:
        """Set ``leaves[indices] = values`` and recompute their ancestors.

        Args:
            indices: integer array of leaf indices, any shape; with duplicates
                the last write wins (numpy assignment semantics).
            values: float64-castable, same size as ``indices`` or a scalar.

        Raises:
            TypeError: ``indices`` is not an integer array.
            IndexError: an index is negative or ``>= capacity`` (named in the message).
            ValueError: a value this tree refuses (named in the message), or
                ``values`` does not match ``indices`` in size.

        Nothing is modified when an exception is raised.
        """
        idx = self._check_indices(indices)
        if idx.size == 0:
            return
        self.assign(idx, self._check_values(self._match_values(values, idx)))

    def assign(self, idx: np.ndarray, vals: np.ndarray) -> None:
        """`update` without its checks, for callers that guarantee 1-D intp ``idx`` in range and
        values this tree accepts, shaped like ``idx`` (duplicates must carry equal values)."""
        self._levels[self._depth][idx] = vals
        self._propagate(idx)

    def refill(self, leaves: np.ndarray) -> None:
        """Set every leaf (``capacity`` values) and recompute every node, level by level.

        Raises ValueError for a value this tree refuses (nothing is modified then)."""
        self._leaves[:] = self._check_values(np.ascontiguousarray(leaves, dtype=np.float64))
        self._rebuild()

    def _propagate(self, idx: np.ndarray) -> None:
        """Recompute every ancestor of the leaves ``idx`` (1-D intp, in range)."""
        op = self._op
        ancestors = idx >> self._shifts
        for parents, pairs_view, parent_view in zip(ancestors, self._pair_views, self._parent_views):
            pairs = pairs_view[parents]
            parent_view[parents] = op(pairs.real, pairs.imag)
        for left, right, out in self._top_plan:
            op(left, right, out=out)

    def _rebuild(self) -> None:
        """Recompute every internal node from the leaves."""
        for lv in reversed(range(self._depth)):
            child = self._levels[lv + 1]
            self._op(child[0::2], child[1::2], out=self._levels[lv])

    def _query(self, start: int, end: int | None) -> float:
        """Combine the leaves ``[start, end)`` with the tree's operation."""
        end = self.capacity if end is None else end
        if not (0 <= start <= self.capacity and 0 <= end <= self.capacity):
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

    def queries(self, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """`_query` of every range ``[start[i], end[i])`` at once (float64; ranges checked by the
        caller), combined in the same order, so each equals its own query exactly."""
        tree, op = self._tree, self._op
        result = np.full(len(start), self._neutral)
        lo = np.asarray(start, np.int64) + (1 << self._depth)
        hi = np.asarray(end, np.int64) + (1 << self._depth)
        while (active := lo < hi).any():
            left = active & (lo & 1 == 1)
            result[left] = op(result[left], tree[lo[left]])
            lo += left
            right = active & (hi & 1 == 1)
            hi -= right
            result[right] = op(result[right], tree[hi[right]])
            lo >>= 1
            hi >>= 1
        return result

    def _check_indices(self, indices: Any) -> np.ndarray:
        """``indices`` as a flat intp array; raise if not integer or out of range."""
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            if idx.size:
                raise TypeError(f"indices must be an integer array, got dtype {idx.dtype}")
            idx = idx.astype(np.intp)
        idx = idx.reshape(-1)
        if idx.size and not self._in_range(idx):
            bad = idx[(idx < 0) | (idx >= self.capacity)][0]
            raise IndexError(
                f"index {bad} is out of range for {type(self).__name__} of capacity "
                f"{self.capacity}: expected 0 <= index < {self.capacity}"
            )
        return idx.astype(np.intp, copy=False)

    def _in_range(self, idx: np.ndarray) -> bool:
        if idx.dtype == np.intp:
            return bool(np.maximum.reduce(idx.view(np.uintp)) < self.capacity)
        return bool(np.minimum.reduce(idx) >= 0 and np.maximum.reduce(idx) < self.capacity)

    @staticmethod
    def _match_values(values: Any, idx: np.ndarray) -> np.ndarray:
        """``values`` as a contiguous float64 array shaped like ``idx``."""
        vals = np.asarray(values, dtype=np.float64)
        if vals.size != idx.size:
            if vals.size != 1:
                raise ValueError(f"got {vals.size} values for {idx.size} indices")
            return np.full(idx.shape, vals.reshape(-1)[0])
        return np.ascontiguousarray(vals.reshape(-1))

    def _check_values(self, vals: np.ndarray) -> np.ndarray:
        """``vals`` (1-D float64, possibly normalized) if acceptable, else ValueError."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        """``{"leaves": float64 array of shape (capacity,)}``, a copy."""
        return {"leaves": self._leaves.copy()}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Self:
        """Rebuild a tree from :meth:`state_dict` output.

        Raises:
            KeyError: ``state`` has no ``"leaves"``.
            ValueError: leaves are not a non-empty 1-D array, or hold refused values.
        """
        leaves = np.asarray(state["leaves"], dtype=np.float64)
        if leaves.ndim != 1 or leaves.size == 0:
            raise ValueError(f"expected non-empty 1-D leaves, got shape {leaves.shape}")
        tree = cls(leaves.size)
        tree.refill(leaves)
        return tree

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity})"


class SumSegmentTree(_SegmentTree):
    """Sum tree over ``capacity`` finite, non-negative float64 leaves (initially 0)."""

    _op = np.add
    _neutral = 0.0

    def _plan(self) -> None:
        super()._plan()
        self._search_levels = min(self._depth, _TOP_SEARCH_LEVELS)
        self._left_views = [
            self._levels[lv + 1][0::2] for lv in range(self._search_levels, self._depth)
        ]

    def _check_values(self, vals: np.ndarray) -> np.ndarray:
        if vals.size == 0 or np.maximum.reduce(vals.view(np.uint64)) < _NONNEG_FINITE_LIMIT:
            return vals
        bad = ~((vals >= 0) & np.isfinite(vals))
        if bad.any():
            pos = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"SumSegmentTree values must be finite and >= 0, got {float(vals[pos])} "
                f"at position {pos}"
            )
        return vals + 0.0  # only -0.0 got here; store it as +0.0

    def total(self) -> float:
        """Sum of all leaves."""
        return float(self._tree[1])

    def sum(self, start: int = 0, end: int | None = None) -> float:
        """Sum of the leaves ``[start, end)``; ``end=None`` means ``capacity``.

        Raises:
            IndexError: a bound outside ``[0, capacity]``.
            ValueError: ``start > end``.
        """
        return self._query(start, end)

    def find_prefix_sum(self, thresholds: Any) -> np.ndarray:
        """For each threshold ``t``, the smallest ``i`` with ``sum(leaves[:i+1]) > t``.

        Args:
            thresholds: float array, any shape, each ``0 <= t < total()``;
                larger ones (e.g. ``total()`` itself) give the last non-zero leaf.

        Returns:
            int64 array of leaf indices shaped like ``thresholds``. A leaf
            holding 0 (padding included) is never returned.

        Raises:
            ValueError: ``total()`` is 0, or a threshold is negative or NaN.
        """
        t = np.asarray(thresholds, dtype=np.float64)
        found, _ = self.locate(t.reshape(-1))
        return found.reshape(t.shape)

    def locate(self, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`find_prefix_sum` of 1-D ``thresholds``, with each threshold's remainder inside its leaf
        (``t - sum(leaves[:i])``; ``inf`` where rounding moved the result off a zero leaf).

        Raises ValueError as `find_prefix_sum`."""
        t = np.array(thresholds, dtype=np.float64)
        if t.size == 0:
            return np.zeros(0, dtype=np.int64), t
        if not self._tree[1] > 0:
            raise ValueError("find_prefix_sum needs total() > 0, but all leaves are 0")
        order = np.argsort(t)
        sorted_t = t[order]
        if not (sorted_t[0] >= 0 and sorted_t[-1] == sorted_t[-1]):
            pos = int(np.flatnonzero(~(t >= 0))[0])
            raise ValueError(f"thresholds must be >= 0, got {float(t[pos])} at position {pos}")
        t = sorted_t
        idx = self._descend_top(t)
        for left_view in self._left_views:
            left = left_view[idx]
            right = t >= left
            t -= left * right
            idx += idx
            idx += right
        if not np.minimum.reduce(self._levels[self._depth][idx]) > 0:
            t[self._fix_zero_hits(idx)] = np.inf
        found = np.empty(idx.size, dtype=np.int64)
        found[order] = idx
        rest = np.empty(idx.size)
        rest[order] = t
        return found, rest

    def _descend_top(self, t: np.ndarray) -> np.ndarray:
        """Node indices (within their level) after the top levels; subtracts from ``t``.

        ``t`` is sorted, which lets ``searchsorted`` narrow each search from the
        previous result (about twice as fast as on shuffled keys).
        """
        level = self._levels[self._search_levels]
        cumsum = np.empty(level.size + 1)
        cumsum[0] = 0.0
        np.add.accumulate(level, out=cumsum[1:])
        idx = np.searchsorted(cumsum[1:], t, side="right")
        np.minimum(idx, level.size - 1, out=idx)
        t -= cumsum[idx]
        return idx

    def _fix_zero_hits(self, idx: np.ndarray) -> np.ndarray:
        """Move results that landed on a zero leaf to the last non-zero leaf before them (returns
        their positions).

        Rounding can carry a threshold at (or past) the end of a subtree's mass
        into a run of zero leaves that follows it; the intended leaf is then the
        last non-zero one before the run.
        """
        moved = np.flatnonzero(self._levels[self._depth][idx] == 0)
        for pos in moved:
            idx[pos] = self._last_nonzero_before(int(idx[pos]))
        return moved

    def _last_nonzero_before(self, leaf: int) -> int:
        """Largest leaf index ``< leaf`` with a non-zero value (the last one if none)."""
        tree, size = self._tree, 1 << self._depth
        node = leaf + size
        while node > 1 and not (node & 1 and tree[node - 1] > 0):
            node >>= 1
        node = node - 1 if node > 1 else 1
        while node < size:
            node = 2 * node + 1 if tree[2 * node + 1] > 0 else 2 * node
        return node - size


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
        """Minimum of the leaves ``[start, end)`` (``+inf`` if empty or never set).

        Raises:
            IndexError: a bound outside ``[0, capacity]``.
            ValueError: ``start > end``.
        """
        if start == 0 and end is None:
            return float(self._tree[1])
        return self._query(start, end)
