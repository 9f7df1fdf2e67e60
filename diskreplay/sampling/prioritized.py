"""Proportional prioritized replay over the readable rows, on sum and min segment trees."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from ..format.journal import JournalChange, JournalContent
from ..format.lanes import LaneLayout
from .priority_table import PriorityTable
from .protocols import BaseSampler, Draw, PrioritySampler
from .state import is_int

PRIORITY_RECORD = np.dtype([("leaf", "<i8"), ("value", "<f4")])
"""A journal record of the priorities: one leaf set to a value."""
MAX_LEAF = float(np.finfo(np.float32).max)


class Prioritized(BaseSampler, PrioritySampler):
    """Proportional prioritized replay (Schaul et al. 2016) on in-RAM sum and min segment trees.

    New rows get the largest priority seen so far (or ``initial_priority``). ``update_priorities``
    sets ``p = (|td| + eps) ** alpha``; P(i) = p_i / sum(p). Importance weights are
    ``(N * P(i)) ** -beta`` normalized by their maximum over the *whole buffer*, which comes from
    the minimum priority (as cpprb and TorchRL), not by the batch maximum: ``w_i = (p_i / p_min)
    ** -beta``. Sampling is stratified (one draw in each of ``batch_size`` equal slices of the
    total) unless ``stratified=False``.

    Leaves are storage slots, so an overwritten ring row simply takes the new row's priority. An
    update naming a row that was overwritten since it was sampled (a stale row id) is ignored.

    Leaves are float32 (`PriorityTable`: 6 bytes of RAM per row in all). A commit saves the
    leaves changed since the last one, as ``(leaf, value)`` records of a journal; once the records
    since the journal's base pass an eighth of the leaves, a commit writes all leaves as a new base.
    """

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6,
                 initial_priority: float | None = None, stratified: bool = True):
        """Raises ValueError for ``alpha``, ``beta`` or ``eps`` not finite and >= 0, or an
        ``initial_priority`` not finite and > 0."""
        for name, value in (("alpha", alpha), ("beta", beta), ("eps", eps)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if initial_priority is not None and not (math.isfinite(initial_priority) and initial_priority > 0):
            raise ValueError(f"initial_priority must be a finite number > 0, got {initial_priority!r}")
        self.alpha, self.beta, self.eps = float(alpha), float(beta), float(eps)
        self.initial_priority = initial_priority
        self.stratified = stratified
        self.max_priority = 1.0 if initial_priority is None else float(initial_priority)
        self._pending: list[tuple[int | range, int, int]] = []  # (lane or lanes, first, end) queued
        self._changed: list[np.ndarray] | None = None  # leaves changed since the last commit; None: all
        self._changed_count = 0
        self._logged = 0  # records in the journal since its base
        self._staged: JournalChange | None = None

    def attach(self, layout: LaneLayout) -> None:
        """One leaf per storage slot of every lane (dataset mode: 65,536 per lane, growing)."""
        self.layout = layout
        self.stride = layout.lane_capacity or 1 << 16
        self._lanes = range(layout.num_envs)
        self._make_trees(layout.num_envs * self.stride)

    def _make_trees(self, leaves: int) -> None:
        self.table = PriorityTable(leaves)
        self._changed = None

    def _leaf(self, lane: np.ndarray, step: np.ndarray) -> np.ndarray:
        leaf: np.ndarray = lane * self.stride + self.layout.slot(step)
        return leaf

    def _grow(self, steps_needed: int) -> None:
        """Dataset mode: widen each lane's range of leaves (rebuilding the trees)."""
        stride = self.stride
        while stride < steps_needed:
            stride *= 2
        if stride == self.stride:
            return
        old = self.table.leaves.reshape(self.layout.num_envs, self.stride)
        leaves = np.zeros((self.layout.num_envs, stride), np.float32)
        leaves[:, : old.shape[1]] = old
        self.stride = stride
        self.table = PriorityTable.from_leaves(leaves.reshape(-1))
        self._changed = None

    def _set_leaves(self, leaves: np.ndarray, values: np.ndarray) -> None:
        self.table.set(leaves, values)
        if self._changed is not None:
            self._changed.append(leaves)
            self._changed_count += len(leaves)
            if self._changed_count > self._rebase_after():
                self._changed = None  # the next commit writes every leaf

    def _rebase_after(self) -> int:
        """Records in the journal past which a commit writes a new base instead."""
        return max(self.table.capacity // 8, 1 << 16) - self._logged

    def on_append(self, lane: int, first: int, end: int) -> None:
        """Queue the new rows; they get the max priority before the next draw or update."""
        self._queue(lane, first, end)

    def on_append_lanes(self, lanes: int, first: int, end: int) -> None:
        """Queue the new rows of lanes ``0 .. lanes - 1`` (see `on_append`)."""
        self._queue(self._lanes if lanes == len(self._lanes) else range(lanes), first, end)

    def _queue(self, lanes: int | range, first: int, end: int) -> None:
        """Queue rows; the steps right after those of the last entry of the same lanes extend it."""
        pending = self._pending
        if pending:
            last_lanes, last_first, last_end = pending[-1]
            if last_end == first and last_lanes == lanes:
                pending[-1] = (lanes, last_first, end)
                return
        pending.append((lanes, first, end))

    def _apply_pending(self) -> None:
        """Give newly appended rows the current max priority (batched: adds stay cheap)."""
        if not self._pending:
            return
        if self.layout.lane_capacity is None:
            self._grow(max(end for _, _, end in self._pending))
        rows = [_queued_rows(lanes, f, e) for lanes, f, e in self._pending]
        lanes, steps = np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])
        self._pending = []
        self._set_leaves(self._leaf(lanes, steps), np.full(len(steps), self.max_priority ** self.alpha))

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray,
               beta: float | None = None) -> Draw:
        """Rows drawn in proportion to their priorities, among the readable steps ``[lo, hi)``
        only (a reader's commit may have retired rows whose slots still hold priorities)."""
        self._apply_pending()
        leaves = _LeafRanges.readable(self, lo, hi)
        return self._draw(rng, batch_size, leaves, lo, hi, beta, leaves.min())

    def sample_within(self, rng: np.random.Generator, batch_size: int, lane: np.ndarray, first: np.ndarray,
                      end: np.ndarray, lo: np.ndarray, hi: np.ndarray, beta: float | None = None) -> Draw:
        """Rows drawn in proportion to their priorities among the steps ``[first[i], end[i])``
        of lane ``lane[i]`` (int64 ``[k]``: ranges of the readable steps ``[lo, hi)``, at least
        one step, e.g. where a slice fits), weighted as `sample` weights them."""
        self._apply_pending()
        within = _LeafRanges.of_steps(self, lane, first, end)
        return self._draw(rng, batch_size, within, lo, hi, beta, _LeafRanges.readable(self, lo, hi).min())

    def _draw(self, rng: np.random.Generator, batch_size: int, leaves: _LeafRanges, lo: np.ndarray, hi: np.ndarray,
              beta: float | None, p_min: float) -> Draw:
        """Leaves drawn in proportion to their priorities among ``leaves``, as readable steps."""
        total = leaves.mass()
        if self.stratified:
            thresholds = (np.arange(batch_size) + rng.random(batch_size)) * (total / batch_size)
        else:
            thresholds = rng.random(batch_size) * total
        leaf = leaves.find(thresholds)
        for _ in range(64):  # rounding may land a draw just outside a range: draw it again
            lane, slot = np.divmod(leaf, self.stride)
            step = self._step_of_slot(lane, slot, hi)
            outside = (step < lo[lane]) | (step >= hi[lane])
            if not outside.any():
                return Draw(lane, step, self._weights(leaf, beta, p_min))
            leaf[outside] = leaves.find(rng.random(int(outside.sum())) * total)
        raise RuntimeError("prioritized sampler keeps drawing rows outside the readable window; "
                           "its state does not match the buffer's commit")

    def _step_of_slot(self, lane: np.ndarray, slot: np.ndarray, hi: np.ndarray) -> np.ndarray:
        cap = self.layout.lane_capacity
        if cap is None:
            return slot
        last = hi[lane] - 1
        step: np.ndarray = last - (last - slot) % cap
        return step

    def _weights(self, leaf: np.ndarray, beta: float | None, p_min: float) -> np.ndarray:
        beta = self.beta if beta is None else beta
        p = self.table[leaf]
        return ((p / p_min) ** -beta).astype(np.float32)

    def update_priorities(self, lane: np.ndarray, step: np.ndarray, td_errors: np.ndarray,
                          lo: np.ndarray, hi: np.ndarray) -> int:
        """Set priorities from TD errors; returns how many rows were updated (stale ones skipped).

        Raises ValueError (nothing changed) if a TD error is NaN or infinite.
        """
        td = np.asarray(td_errors, dtype=np.float64).reshape(-1)
        if td.shape != step.shape:
            raise ValueError(f"update_priorities: expected {step.shape[0]} priorities (one per index), "
                             f"got shape {np.shape(td_errors)}")
        if not np.isfinite(td).all():
            bad = td[~np.isfinite(td)][0]
            raise ValueError(f"update_priorities: priorities must be finite, got {bad} "
                             f"at position {int(np.flatnonzero(~np.isfinite(td))[0])}")
        self._apply_pending()
        live = (step >= lo[lane]) & (step < hi[lane])
        priority = np.abs(td[live]) + self.eps
        if priority.size:
            leaves = priority ** self.alpha
            if not (leaves <= MAX_LEAF).all():
                bad = int(np.flatnonzero(~(leaves <= MAX_LEAF))[0])
                raise ValueError(f"update_priorities: TD error {td[live][bad]} gives priority {leaves[bad]}, above "
                                 f"{MAX_LEAF:.3g}, the largest float32 priority")
            self.max_priority = max(self.max_priority, float(priority.max()))
            self._set_leaves(self._leaf(lane[live], step[live]), leaves)
        return int(live.sum())

    def state_dict(self) -> dict[str, Any]:
        """Settings, max priority, stride and every leaf (float32 ``[num_envs * stride]``)."""
        self._apply_pending()
        return {**self._settings(), "leaves": self.table.leaves.copy()}

    def _settings(self) -> dict[str, Any]:
        return {"type": "Prioritized", "alpha": self.alpha, "beta": self.beta, "eps": self.eps,
                "initial_priority": self.initial_priority, "stratified": self.stratified,
                "max_priority": self.max_priority, "stride": self.stride}

    def commit_state(self) -> dict[str, Any]:
        """`state_dict` for a commit: the leaves changed since the last commit, as a journal change."""
        self._apply_pending()
        if self._changed is None:
            self._staged = JournalChange(np.zeros(0, PRIORITY_RECORD), self.table.leaves)
        else:
            leaf = np.unique(np.concatenate(self._changed)) if self._changed else np.zeros(0, np.int64)
            records = np.empty(len(leaf), PRIORITY_RECORD)
            records["leaf"], records["value"] = leaf, self.table.leaves[leaf]
            self._staged = JournalChange(records)
        return {**self._settings(), "leaves": self._staged}

    def committed(self) -> None:
        """The last `commit_state` was committed: count changes from here."""
        if self._staged is not None:
            self._logged = len(self._staged.records) + (0 if self._staged.base is not None else self._logged)
            self._changed, self._changed_count, self._staged = [], 0, None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Rebuild the trees from the saved leaves (or the journal a commit left)."""
        self.max_priority = float(state["max_priority"])
        self._pending = []
        self.stride = int(state["stride"])
        leaves = state["leaves"]
        if isinstance(leaves, JournalContent):
            self.table = PriorityTable(len(leaves.base))
            replay(leaves, self.table.leaves)
            self.table.rebuild()
            self._logged, self._changed, self._changed_count = len(leaves.records), [], 0
        else:
            self.table = PriorityTable.from_leaves(np.asarray(leaves, np.float32))
            self._logged, self._changed = 0, None

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Self:
        """A sampler with the settings saved in ``state`` (its priorities come with `load_state_dict`)."""
        return cls(state["alpha"], state["beta"], state["eps"], state["initial_priority"], state["stratified"])

    @staticmethod
    def check_state(state: dict[str, Any], layout: LaneLayout, total: np.ndarray) -> None:
        """Raise ValueError unless ``state`` is a `state_dict` (or a commit's) of this layout:
        leaves for every lane's slots, finite and >= 0, none > 0 (and no journal record) in a
        slot that none of the ``total`` steps per lane has filled, and a finite max priority > 0."""
        stride = state["stride"]
        most = int(total.max(initial=0))
        if layout.lane_capacity is not None:
            expected_stride = stride == layout.lane_capacity
        else:
            expected_stride = (is_int(stride) and max(most, 1 << 16) <= stride <= 2 * max(most, 1 << 16)
                               and stride & (stride - 1) == 0)
        if not is_int(stride) or not expected_stride:
            wanted = layout.lane_capacity or f"a power of two >= 65536 and >= {most}, the most steps of a lane"
            raise ValueError(f"'sampler.stride': expected {wanted}, got {stride!r}")
        size = layout.num_envs * stride
        filled = np.minimum(total, stride)  # per lane, the slots that hold a step
        leaves = state["leaves"]
        if isinstance(leaves, JournalContent):
            _check_journal(leaves, size, filled)
        elif (not isinstance(leaves, np.ndarray) or leaves.dtype not in (np.float32, np.float64)
                or leaves.shape != (size,) or not (np.isfinite(leaves) & (leaves >= 0) & (leaves <= MAX_LEAF)).all()):
            raise ValueError(f"'sampler.leaves': expected {size} finite float32 values >= 0, got "
                             f"{getattr(leaves, 'dtype', type(leaves).__name__)} "
                             f"shaped {getattr(leaves, 'shape', None)}")
        else:
            _check_filled(leaves, filled, "")
        peak = state["max_priority"]
        if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not (math.isfinite(peak) and peak > 0):
            raise ValueError(f"'sampler.max_priority': expected a finite number > 0, got {peak!r}")


def _check_journal(journal: JournalContent, size: int, filled: np.ndarray) -> None:
    base, records = journal.base, journal.records
    if base.dtype != np.float32 or base.shape != (size,) or not (np.isfinite(base) & (base >= 0)).all():
        raise ValueError(f"'sampler.leaves' (journal base): expected {size} finite float32 values >= 0, got "
                         f"{base.dtype} shaped {base.shape}")
    _check_filled(base, filled, " (journal base)")
    if records.dtype != PRIORITY_RECORD:
        raise ValueError(f"'sampler.leaves' (journal records): expected {PRIORITY_RECORD}, got {records.dtype}")
    bad = ~((records["leaf"] >= 0) & (records["leaf"] < size) & np.isfinite(records["value"]) & (records["value"] >= 0))
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise ValueError(f"'sampler.leaves' (journal record {at}): expected a leaf in [0, {size}) and a finite "
                         f"value >= 0, got leaf {int(records['leaf'][at])}, value {float(records['value'][at])}")
    lane, slot = np.divmod(records["leaf"], size // len(filled))
    empty = np.flatnonzero(slot >= filled[lane])
    if empty.size:
        at = int(empty[0])
        raise ValueError(f"'sampler.leaves' (journal record {at}): leaf {int(records['leaf'][at])} is slot "
                         f"{int(slot[at])} of lane {int(lane[at])}, which holds steps in slots "
                         f"[0, {int(filled[lane[at]])}) only")


def _check_filled(leaves: np.ndarray, filled: np.ndarray, where: str) -> None:
    """Raise ValueError if a leaf > 0 sits in a slot that holds no step (``filled``: per lane,
    the slots that do)."""
    grid = leaves.reshape(len(filled), -1)
    for lane in np.flatnonzero(filled < grid.shape[1]).tolist():
        rest = grid[lane, filled[lane]:]
        if rest.any():
            slot = int(filled[lane] + np.argmax(rest > 0))
            raise ValueError(f"'sampler.leaves'{where}: leaf {lane * grid.shape[1] + slot} (slot {slot} of lane "
                             f"{lane}) holds priority {float(grid[lane, slot])}, but the lane holds steps in slots "
                             f"[0, {int(filled[lane])}) only")


def replay(journal: JournalContent, leaves: np.ndarray) -> None:
    """Write into ``leaves`` what a journal ends with: its base, then each record's write (the
    last one of a leaf wins)."""
    leaves[:] = journal.base
    if len(journal.records):
        backwards = journal.records[::-1]
        leaf, last = np.unique(backwards["leaf"], return_index=True)
        leaves[leaf] = backwards["value"][last]


def _queued_rows(lanes: int | range, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """(lane, step) of the rows of a queue entry, in the order they were added: step by step."""
    steps = np.arange(first, end, dtype=np.int64)
    if isinstance(lanes, int):
        return np.full(end - first, lanes, np.int64), steps
    ids = np.arange(lanes.start, lanes.stop, dtype=np.int64)
    return np.tile(ids, end - first), np.repeat(steps, len(ids))


@dataclass
class _LeafRanges:
    """The leaves of a prioritized sampler's readable rows: all of them, or, where some slots
    still hold priorities of rows a commit retired, ranges ``[start, end)`` of leaves (at most two
    per lane), each with the priority mass before it and inside it."""

    sampler: Prioritized
    start: np.ndarray | None = None
    end: np.ndarray | None = None
    before: np.ndarray | None = None
    inside: np.ndarray | None = None

    @classmethod
    def readable(cls, sampler: Prioritized, lo: np.ndarray, hi: np.ndarray) -> _LeafRanges:
        cap = sampler.layout.lane_capacity
        if (lo == (0 if cap is None else np.maximum(hi - cap, 0))).all():  # no row retired (`clear`, a retire commit)
            return cls(sampler)
        return cls.of_steps(sampler, np.arange(len(lo)), lo, hi)

    @classmethod
    def of_steps(cls, sampler: Prioritized, lanes: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> _LeafRanges:
        """The leaves of the steps ``[lo[i], hi[i])`` of lane ``lanes[i]`` (each inside its lane's ring)."""
        cap = sampler.layout.lane_capacity or sampler.stride  # a dataset's steps fit its stride: its slots do not wrap
        some = hi > lo
        lo, hi, base = lo[some], hi[some], lanes[some].astype(np.int64) * sampler.stride
        first, last = lo % cap, (hi - 1) % cap + 1
        wraps = first >= last  # two ranges: to the ring's end, then from its start (in this order)
        start = np.stack([base + first, base], axis=1)
        end = np.stack([np.where(wraps, base + cap, base + last), base + last], axis=1)
        kept = np.stack([np.ones(len(base), bool), wraps], axis=1)
        start, end = start[kept].astype(np.int64), end[kept].astype(np.int64)
        tree = sampler.table
        return cls(sampler, start, end, tree.range_sums(np.zeros_like(start), start), tree.range_sums(start, end))

    def mass(self) -> float:
        if self.start is None:
            return self.sampler.table.total()
        assert self.inside is not None  # set together with start
        return float(self.inside.sum())

    def find(self, thresholds: np.ndarray) -> np.ndarray:
        """The leaf of each threshold in ``[0, mass())``."""
        if self.start is None:
            return self.sampler.table.find(thresholds)
        assert self.inside is not None and self.before is not None  # set together with start
        cumulative = np.cumsum(self.inside)
        where = np.minimum(np.searchsorted(cumulative, thresholds, side="right"), len(cumulative) - 1)
        offset = thresholds - (cumulative[where] - self.inside[where])
        return self.sampler.table.find(self.before[where] + offset)

    def min(self) -> float:
        if self.start is None:
            return self.sampler.table.min()
        assert self.end is not None  # set together with start
        return float(self.sampler.table.range_mins(self.start, self.end).min(initial=np.inf))
