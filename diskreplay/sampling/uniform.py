"""Uniform sampling with replacement, with an optional share of recent rows (and ERE's schedule)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Self

import numpy as np

from ..format.lanes import LaneLayout
from .draws import integers
from .protocols import BaseSampler, Draw


class Uniform(BaseSampler):
    """Uniform sampling with replacement over every readable row of every lane.

    ``recent_ratio`` of each batch (rounded) is drawn from the newest ``recent_rows`` rows
    (split evenly over lanes) instead, as alf's ``recent_data_ratio``. ``sample(...,
    recent_rows=c)`` draws the whole batch from the newest ``c`` rows (ERE; see `ere_schedule`).
    """

    def __init__(self, recent_ratio: float = 0.0, recent_rows: int = 0):
        """Raises ValueError for ``recent_ratio`` outside [0, 1], or > 0 with ``recent_rows`` < 1."""
        if not 0.0 <= recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {recent_ratio}")
        if recent_ratio > 0 and recent_rows < 1:
            raise ValueError(f"recent_rows must be >= 1 when recent_ratio > 0, got {recent_rows}")
        self.recent_ratio = recent_ratio
        self.recent_rows = recent_rows

    def attach(self, layout: LaneLayout) -> None:
        """Keep the buffer's lane layout."""
        self.layout = layout

    def on_append(self, lane: int, first: int, end: int) -> None:
        """Nothing to track: every readable row is equally likely."""

    def on_append_lanes(self, lanes: int, first: int, end: int) -> None:
        """Nothing to track (see `on_append`)."""

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray,
               recent_rows: int | None = None) -> Draw:
        """``batch_size`` rows among the readable steps ``[lo, hi)`` (with ``recent_rows=c``: the
        newest ``c`` rows only). Raises ValueError for ``recent_rows`` < 1."""
        if recent_rows is not None:
            return _uniform(rng, batch_size, _recent(lo, hi, recent_rows), hi)
        n_recent = int(round(batch_size * self.recent_ratio))
        if n_recent == 0:
            return _uniform(rng, batch_size, lo, hi)
        old = _uniform(rng, batch_size - n_recent, lo, hi)
        new = _uniform(rng, n_recent, _recent(lo, hi, self.recent_rows), hi)
        return Draw(np.concatenate([old.lane, new.lane]), np.concatenate([old.step, new.step]))

    def state_dict(self) -> dict[str, Any]:
        """The settings (the draws depend on the buffer's generator only)."""
        return {"type": "Uniform", "recent_ratio": self.recent_ratio, "recent_rows": self.recent_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the settings come with `from_state_dict`."""

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Self:
        """A sampler with the settings saved in ``state``."""
        return cls(state.get("recent_ratio", 0.0), state.get("recent_rows", 0))


def _uniform(rng: np.random.Generator, n: int, lo: np.ndarray, hi: np.ndarray) -> Draw:
    if len(lo) == 1:
        step = integers(rng, int(lo[0]), int(hi[0]), n)
        return Draw(np.zeros(n, dtype=np.int64), step)
    sizes = hi - lo
    ends = sizes.cumsum()
    pos = integers(rng, 0, int(ends[-1]), n)
    lane = ends.searchsorted(pos, side="right")
    return Draw(lane, pos + (lo + sizes - ends)[lane])  # lo + the position inside the lane


def _recent(lo: np.ndarray, hi: np.ndarray, rows: int) -> np.ndarray:
    """Per-lane lower bounds that keep (about) the newest ``rows`` rows over all lanes."""
    if rows < 1:
        raise ValueError(f"recent_rows must be >= 1, got {rows}")
    per_lane = -(-rows // len(lo))
    bounds: np.ndarray = np.maximum(lo, hi - per_lane)
    return bounds


def ere_recent_rows(buffer_rows: int, k: int, updates: int, eta: float = 0.996, c_min: int = 2500) -> int:
    """ERE's window for update ``k`` of ``updates`` (Wang & Ross 2019):
    ``c_k = max(N * eta ** (k * 1000 / K), c_min)``, capped at ``N`` (the rows in the buffer)."""
    c_k = max(int(buffer_rows * eta ** (k * 1000 / updates)), c_min)
    return min(c_k, buffer_rows)


def ere_schedule(buffer_rows: int, updates: int, eta: float = 0.996, c_min: int = 2500) -> Iterator[int]:
    """Yield `ere_recent_rows` for k = 0..updates-1: pass each as ``buf.sample(B, recent_rows=c_k)``."""
    for k in range(updates):
        yield ere_recent_rows(buffer_rows, k, updates, eta, c_min)
