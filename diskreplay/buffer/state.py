"""`BufferState`: the small in-RAM state of a buffer (generator, sampler, episode index, derived
``next_*`` values), gathered for a commit or a snapshot, and checked whole before any of it loads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..episodes import EpisodeIndex, RowView
from ..errors import CorruptBufferError
from ..format.commit import CommitRecord
from ..format.keys import COMMIT_KEY
from ..sampling import SAMPLER_TYPES, BaseSampler, Sampler, check_sampler_state, load_sampler_state, sampler_from_state
from ..storage import BufferStorage

STATE_PARTS = ("rng", "sampler", "episodes")


class BufferState:
    """Reads, checks and loads the state of a buffer's parts."""

    def __init__(self, storage: BufferStorage, rng: np.random.Generator, sampler: BaseSampler, episodes: EpisodeIndex,
                 view: RowView):
        self.storage, self.rng, self.sampler, self.episodes, self.view = storage, rng, sampler, episodes, view
        self.url, self.layout = storage.url, storage.layout
        self.announced = np.zeros(self.layout.num_envs, np.int64)
        """Per lane, the steps a sampler of another type than the saved one was told of."""

    def current(self) -> dict[str, Any]:
        """The state now: JSON values and numpy arrays."""
        return {"rng": self.rng.bit_generator.state, "sampler": self.sampler.state_dict(),
                "episodes": self.episodes.state_dict(), "last_next": self.view.state_dict()}

    def for_commit(self) -> dict[str, Any]:
        """`current` as a commit saves it: the growing parts (priorities, episode ends) as the
        changes since the last commit (`JournalChange`)."""
        return {"rng": self.rng.bit_generator.state, "sampler": self.sampler.commit_state(),
                "episodes": self.episodes.commit_state(), "last_next": self.view.state_dict()}

    def committed(self) -> None:
        """The state of the last `for_commit` was committed."""
        self.sampler.committed()
        self.episodes.committed()

    def parse(self, state: Mapping[str, Any], total: np.ndarray, origin: str | None) -> dict[str, Any]:
        """``state`` checked against a buffer holding ``total`` steps per lane (every part,
        before any is used).

        Raises CorruptBufferError naming ``origin`` (the file it was read from), the part and what
        is wrong; ``ValueError`` for a state the caller gave (``origin=None``)."""
        if not state:
            return {}
        try:
            if not isinstance(state, Mapping):
                raise ValueError(f"expected a mapping, got {type(state).__name__}")
            for part in STATE_PARTS:
                if part not in state:
                    raise ValueError(f"{part!r} is missing")
            check_rng_state(state["rng"])
            check_sampler_state(self.sampler, state["sampler"], self.layout, total)
            episodes = self.episodes.check_state(state["episodes"], total)
            self.view.check_state(state.get("last_next") or {})
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            if origin is None:
                raise ValueError(f"state for {self.url!r} does not fit this buffer: {exc}") from None
            raise CorruptBufferError(f"{origin}: {exc}") from None
        return {**state, "episodes": episodes}

    def load(self, state: Mapping[str, Any], origin: str | None) -> None:
        """Load a `ReplayBuffer.state_dict` of this very buffer (its cursors must match).

        Raises ValueError (or CorruptBufferError naming ``origin``): nothing is loaded then."""
        if not isinstance(state, Mapping) or "total" not in state:
            raise ValueError("state: expected the mapping ReplayBuffer.state_dict() returns (with 'total')")
        total, have = np.asarray(state["total"]), self.storage.total
        if total.shape != have.shape or not np.array_equal(total, have):
            raise ValueError(f"state is for a buffer with {total.tolist()} steps per lane; this buffer "
                             f"has {have.tolist()}")
        parts = {k: v for k, v in state.items() if k != "total"}
        self.apply(self.parse(parts, have, origin), with_rng=True)

    def apply(self, state: Mapping[str, Any], with_rng: bool) -> None:
        """Load a state checked by `parse` (nothing here can fail on its content)."""
        if not state:
            return
        if with_rng:
            self.rng.bit_generator.state = state["rng"]
        if not load_sampler_state(self.sampler, state["sampler"]):  # a sampler of the reader's own: new rows
            lo, hi = self.storage.window()
            announce(self.sampler, lo, self.announced, hi)
            self.announced = hi.copy()
        self.episodes.load_state_dict(state["episodes"])
        if state.get("last_next"):
            self.view.load_state_dict(state["last_next"])


def check_rng_state(state: Any) -> None:
    """Raise ValueError naming 'rng' unless ``state`` can be loaded into a generator."""
    try:
        np.random.default_rng().bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise ValueError(f"'rng': not a generator state ({type(exc).__name__}: {exc})") from None


def state_origin(url: str, record: CommitRecord) -> str:
    """How errors name the state saved with a commit."""
    if record.state_arrays is None:
        return f"{url!r}: the state of commit {record.sequence}"
    return f"{url!r}: the state object {record.state_arrays!r} of commit {record.sequence}"


def saved_sampler(url: str, record: CommitRecord, state: Mapping[str, Any]) -> Sampler:
    """The sampler a buffer was saved with (raises CorruptBufferError for unreadable settings)."""
    saved = state.get("sampler")
    if isinstance(saved, dict) and saved.get("type") not in SAMPLER_TYPES:
        return sampler_from_state(saved)  # ValueError: a sampler type of the user's, pass sampler=
    try:
        if saved is not None and not isinstance(saved, dict):
            raise TypeError(f"expected an object, got {type(saved).__name__}")
        return sampler_from_state(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptBufferError(f"{url!r}: {COMMIT_KEY} field 'extra.state.sampler' (commit "
                                 f"{record.sequence}): the saved sampler settings are unreadable "
                                 f"({exc})") from None


def announce(sampler: Sampler, lo: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
    """Tell ``sampler`` of the steps ``[before, after)`` per lane that are readable (``>= lo``)."""
    for lane in np.flatnonzero(after > before).tolist():
        sampler.on_append(lane, max(int(before[lane]), int(lo[lane])), int(after[lane]))
