"""What a buffer needs of a sampler (`Sampler`), of one that takes priorities (`PrioritySampler`),
what a sampler answers (`Draw`), and the base class of the built-in samplers (`BaseSampler`: the
optional methods and their defaults), which a sampler of your own gets through `with_defaults`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Self, runtime_checkable

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
    ``beta``), passed through from `ReplayBuffer.sample`. The optional methods of `BaseSampler`
    (``commit_state``, ``committed``, ``check_state``) are used where your class has them."""

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


class BaseSampler(Sampler):
    """A `Sampler` with the optional methods a buffer calls, and their defaults: the base class of
    the built-in samplers. A sampler of your own need not subclass it (`with_defaults`)."""

    def on_append_lanes(self, lanes: int, first: int, end: int) -> None:
        """Steps ``[first, end)`` of each lane ``0 .. lanes - 1`` were just stored; by default
        `on_append` of each lane."""
        for lane in range(lanes):
            self.on_append(lane, first, end)

    def commit_state(self) -> dict[str, Any]:
        """The state a commit saves; by default `state_dict`. A sampler whose state grows (the
        priorities) saves what changed since the last commit instead (a `JournalChange`)."""
        return self.state_dict()

    def committed(self) -> None:
        """The state of the last `commit_state` was committed; by default nothing to do."""

    def check_state(self, state: dict[str, Any], layout: LaneLayout, total: np.ndarray) -> None:
        """Raise ValueError (or KeyError, for a missing key) unless ``state``, saved by a sampler
        of this type, can be loaded into a buffer of ``layout`` holding ``total`` steps per lane
        (`load_state_dict` must not fail on it); by default every state is accepted."""

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Self:
        """A sampler with the settings saved in ``state`` (its state comes with `load_state_dict`);
        by default ``cls()``."""
        return cls()

    @property
    def type_name(self) -> str:
        """The sampler's type as its saved state names it (``state_dict()["type"]``): its class name."""
        return type(self).__name__


def with_defaults(sampler: Sampler) -> BaseSampler:
    """``sampler`` itself if it is a `BaseSampler`, else ``sampler`` with the defaults of
    `BaseSampler` for the optional methods it lacks (a sampler of your own, which only needs the
    methods of `Sampler`)."""
    return sampler if isinstance(sampler, BaseSampler) else _Adapted(sampler)


class _Adapted(BaseSampler):
    """A sampler that is no `BaseSampler`: its own methods, and `BaseSampler`'s defaults for the
    optional ones it does not have."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self._commit_state = getattr(sampler, "commit_state", sampler.state_dict)
        self._committed = getattr(sampler, "committed", None)
        self._check_state = getattr(sampler, "check_state", None)

    def attach(self, layout: LaneLayout) -> None:
        self.sampler.attach(layout)

    def on_append(self, lane: int, first: int, end: int) -> None:
        self.sampler.on_append(lane, first, end)

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray,
               **options: Any) -> Draw:
        return self.sampler.sample(rng, batch_size, lo, hi, **options)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)

    def commit_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self._commit_state()
        return state

    def committed(self) -> None:
        if self._committed is not None:
            self._committed()

    def check_state(self, state: dict[str, Any], layout: LaneLayout, total: np.ndarray) -> None:
        if self._check_state is not None:
            self._check_state(state, layout, total)

    @property
    def type_name(self) -> str:
        return type(self.sampler).__name__
