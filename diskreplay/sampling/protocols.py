"""What a buffer needs of a sampler (`Sampler`), of one that takes priorities (`PrioritySampler`),
and what a sampler answers (`Draw`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..format.lanes import LaneLayout


@dataclass
class Draw:
    """A sampler's answer: rows ``(lane[i], step[i])`` and optional importance weights.

    ``lane`` and ``step`` are int64 arrays ``[batch_size]``; ``weight`` (float32 ``[batch_size]``)
    and each array of ``extra`` (``[batch_size, ...]``) are added to the batch.
    """

    lane: np.ndarray
    step: np.ndarray
    weight: np.ndarray | None = None
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    @staticmethod
    def joined(draws: list[Draw]) -> Draw:
        """One draw of the rows of ``draws`` (at least one) in order; weights and extras joined too."""
        if len(draws) == 1:
            return draws[0]
        first = draws[0]
        weight = None if first.weight is None else np.concatenate([d.weight for d in draws if d.weight is not None])
        return Draw(np.concatenate([d.lane for d in draws]), np.concatenate([d.step for d in draws]), weight,
                    {name: np.concatenate([d.extra[name] for d in draws]) for name in first.extra})


class Sampler(Protocol):
    """What a buffer needs of its sampler (`Uniform`, `Prioritized`, `WithoutReplacement`, or
    your own class with these methods). A sampler may take keyword options in ``sample`` (e.g.
    ``beta``), passed through from `ReplayBuffer.sample`."""

    def attach(self, layout: LaneLayout) -> None:
        """Called once when the buffer is created or opened."""

    def on_append(self, lane: int, first: int, end: int) -> None:
        """Steps ``[first, end)`` of ``lane`` were just stored."""

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray) -> Draw:
        """``batch_size`` (lane, step) pairs drawn among each lane's readable steps ``[lo, hi)``."""

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state as plain data, saved with each commit."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict`."""


@runtime_checkable
class PrioritySampler(Sampler, Protocol):
    """A `Sampler` whose rows have priorities that training updates (`Prioritized`, or your own).
    `ReplayBuffer.update_priorities` needs one."""

    def update_priorities(self, lane: np.ndarray, step: np.ndarray, td_errors: np.ndarray,
                          lo: np.ndarray, hi: np.ndarray) -> int:
        """Set the priorities of rows ``(lane[i], step[i])`` (int64 ``[n]``) from ``td_errors``
        (``[n]``); rows outside the readable steps ``[lo, hi)`` (overwritten since they were
        sampled) are skipped. Returns how many rows were updated.

        Raises ValueError (nothing changed) for TD errors that are not finite or not one per row.
        """


@runtime_checkable
class WithinSampler(Sampler, Protocol):
    """A `Sampler` that can also draw among given ranges of steps (`Prioritized`): trajectory
    slices use it where the starts that fit hold too little of its mass to be found by drawing
    again."""

    def sample_within(self, rng: np.random.Generator, batch_size: int, lane: np.ndarray, first: np.ndarray,
                      end: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> Draw:
        """``batch_size`` (lane, step) pairs drawn as `sample` draws them, among the steps
        ``[first[i], end[i])`` of lane ``lane[i]`` only (int64 ``[k]``: ranges of the readable
        steps ``[lo, hi)``, at least one step in all)."""
