"""Samplers: which rows a minibatch takes. A buffer is composed with one; none subclasses it.

A sampler sees only lane windows (``lo``, ``hi``: the readable steps of each lane) and the
notifications of appended steps; it returns (lane, step) pairs. Its state is plain data
(`state_dict`), saved with the buffer at every commit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .lanes import LaneLayout, flat_to_lane_step


@dataclass
class Draw:
    """A sampler's answer: rows ``(lane[i], step[i])`` and optional importance weights."""

    lane: np.ndarray
    step: np.ndarray
    weight: np.ndarray | None = None
    extra: dict[str, np.ndarray] = field(default_factory=dict)


class Sampler(Protocol):
    def attach(self, layout: LaneLayout) -> None:
        """Called once when the buffer is created or opened."""

    def on_append(self, lane: int, first: int, end: int) -> None:
        """Steps ``[first, end)`` of ``lane`` were just stored."""

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray,
               **options: Any) -> Draw: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Uniform:
    """Uniform sampling with replacement over every readable row of every lane."""

    def attach(self, layout: LaneLayout) -> None:
        self.layout = layout

    def on_append(self, lane: int, first: int, end: int) -> None:
        pass

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray,
               **options: Any) -> Draw:
        if options:
            raise TypeError(f"Uniform.sample got unexpected options {sorted(options)}")
        pos = rng.integers(0, int((hi - lo).sum()), size=batch_size)
        lane, step = flat_to_lane_step(pos, lo, hi)
        return Draw(lane, step)

    def state_dict(self) -> dict[str, Any]:
        return {"type": "Uniform"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
