"""Sampling without replacement: every readable row once per epoch, in a seeded random order."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.lanes import LaneLayout, flat_to_lane_step
from .permutation import SeededPermutation
from .protocols import BaseSampler, Draw
from .state import is_int

BLOCK = 1 << 16
"""Positions of the epoch's order computed at a time (1 MiB of rows)."""


class WithoutReplacement(BaseSampler):
    """Each readable row once per epoch, in a seeded random order; then a new epoch.

    An epoch's order is a pure function of (epoch seed, rows readable at the epoch's start), so
    the saved state is a few integers. It is computed `BLOCK` positions at a time
    (`SeededPermutation`), so an epoch over a billion rows takes no more RAM than one over a
    million. Rows overwritten during an epoch are skipped; rows added during an epoch wait for the
    next one. A batch that crosses an epoch end is completed from the next epoch.
    """

    def __init__(self) -> None:
        """No epoch yet: the first `sample` starts epoch 0."""
        self.epoch = -1
        self.cursor = 0
        self.epoch_seed = 0
        self.epoch_lo = np.zeros(0, np.int64)
        self.epoch_hi = np.zeros(0, np.int64)
        self._order: SeededPermutation | None = None
        self._block: tuple[int, np.ndarray, np.ndarray] = (-1, np.zeros(0, np.int64), np.zeros(0, np.int64))

    def attach(self, layout: LaneLayout) -> None:
        """Keep the buffer's lane layout."""
        self.layout = layout

    def on_append(self, lane: int, first: int, end: int) -> None:
        """Nothing to track: rows added during an epoch wait for the next one."""

    def on_append_lanes(self, lanes: int, first: int, end: int) -> None:
        """Nothing to track (see `on_append`)."""

    def _start_epoch(self, rng: np.random.Generator, lo: np.ndarray, hi: np.ndarray) -> None:
        self.epoch += 1
        self.cursor = 0
        self.epoch_seed = int(rng.integers(0, 2**63 - 1))
        self.epoch_lo, self.epoch_hi = lo.copy(), hi.copy()
        self._order = None

    def size(self) -> int:
        """Rows in this epoch."""
        return int((self.epoch_hi - self.epoch_lo).sum())

    def rows(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(lane, step) of positions ``[first, first + count)`` of this epoch's order; fewer
        where the `BLOCK` of positions holding ``first`` ends before."""
        if self._order is None:
            self._order = SeededPermutation(self.size(), self.epoch_seed)
            self._block = (-1, *self._block[1:])
        block = first // BLOCK
        if self._block[0] != block:
            positions = np.arange(block * BLOCK, min(self.size(), (block + 1) * BLOCK))
            self._block = (block, *flat_to_lane_step(self._order[positions], self.epoch_lo, self.epoch_hi))
        start = first - block * BLOCK
        return self._block[1][start:start + count], self._block[2][start:start + count]

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray) -> Draw:
        """The next ``batch_size`` rows of this epoch still readable (``step >= lo``), starting
        a new epoch (seeded from ``rng``) over ``[lo, hi)`` whenever one runs out."""
        lanes, steps = [], []
        need = batch_size
        while need > 0:
            if self.epoch < 0 or self.cursor >= self.size():
                self._start_epoch(rng, lo, hi)
            take_lane, take_step = self.rows(self.cursor, min(need, self.size() - self.cursor))
            self.cursor += len(take_lane)
            live = take_step >= lo[take_lane]
            lanes.append(take_lane[live])
            steps.append(take_step[live])
            need -= int(live.sum())
        return Draw(np.concatenate(lanes), np.concatenate(steps))

    def state_dict(self) -> dict[str, Any]:
        """Epoch number, cursor, epoch seed and the epoch's per-lane window."""
        return {"type": "WithoutReplacement", "epoch": self.epoch, "cursor": self.cursor,
                "epoch_seed": self.epoch_seed, "epoch_lo": self.epoch_lo.copy(), "epoch_hi": self.epoch_hi.copy()}

    @staticmethod
    def check_state(state: dict[str, Any], layout: LaneLayout, total: np.ndarray) -> None:
        """Raise ValueError unless ``state`` is a `state_dict` whose epoch covers readable steps
        (before the first epoch: no steps, ``epoch_lo`` and ``epoch_hi`` empty)."""
        for name in ("epoch", "cursor", "epoch_seed"):
            if not is_int(state[name]) or not -1 <= state[name] < 2**63:
                raise ValueError(f"'sampler.{name}': expected an int, got {state[name]!r}")
        lo, hi = np.asarray(state["epoch_lo"]), np.asarray(state["epoch_hi"])
        lanes = 0 if state["epoch"] == -1 else layout.num_envs
        if (lo.shape != (lanes,) or hi.shape != lo.shape or lo.dtype.kind not in "iu" or hi.dtype.kind not in "iu"
                or (lo < 0).any() or (hi < lo).any() or (hi > total[:lanes]).any()):
            wanted = (f"{lanes} steps per lane with 0 <= lo <= hi <= {total.tolist()}" if lanes
                      else "no steps before the first epoch (epoch -1)")
            raise ValueError(f"'sampler.epoch_lo/epoch_hi': expected {wanted}, got {lo.tolist()} and {hi.tolist()}")
        if not 0 <= state["cursor"] <= int((hi - lo).sum()):
            raise ValueError(f"'sampler.cursor': expected an int in [0, {int((hi - lo).sum())}], got {state['cursor']}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved epoch (its order is recomputed from the seed on first use)."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.epoch_seed = int(state["epoch_seed"])
        self.epoch_lo = np.asarray(state["epoch_lo"], np.int64)
        self.epoch_hi = np.asarray(state["epoch_hi"], np.int64)
        self._order = None
