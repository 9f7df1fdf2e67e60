"""A reader keeping up with its writer: `CommitAdoption` adopts the newest commit with all its
state; `Follower` reads again when the writer overwrote (or retired) the rows a read wanted."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import numpy as np

from ..episodes import RowView
from ..errors import EmptyBufferError, StaleReadError
from ..io import RetryPolicy
from ..storage import BufferStorage, Storage
from .state import BufferState, state_origin

STALE_READ_PAUSE_S = 0.002
T = TypeVar("T")


class Adoption(Protocol):
    """How a reader adopts the newest commit(s) of what it reads."""

    def refresh(self) -> bool:
        """Adopt the newest commit with everything that belongs to it, all together or not at
        all. Returns whether there was a newer one. Raises CorruptBufferError (nothing changed)."""
        ...


class CommitAdoption:
    """A reader of one buffer adopting its writer's newest commit."""

    def __init__(self, storage: BufferStorage, finals: BufferStorage | None, state: BufferState, view: RowView):
        self.storage, self.finals, self.state, self.view = storage, finals, state, view
        self.episodes = view.episodes

    def refresh(self) -> bool:
        """Adopt the newest commit with everything that belongs to it (rows, episode index,
        derived-field state, sampler state), all together or not at all. Returns whether there
        was a newer one. Raises CorruptBufferError (nothing changed)."""
        newer = self.storage.newer_state()
        if newer is None:
            return False
        record, state = newer
        finals_record = self.finals.read_newest() if self.finals is not None else None
        parsed = self.state.parse(state, record.committed, state_origin(self.storage.url, record))
        committed, last_ends = self.storage.record.committed.copy(), self.episodes.last_ends()
        ended = self.episodes.ended()
        self.storage.adopt(record)
        if self.finals is not None and finals_record is not None:
            self.finals.adopt(finals_record)
        self.state.apply(parsed, with_rng=False)
        if self.finals is not None:
            forget_named_finals(self.finals, ended, self.episodes.ended())
        for lane, first, end in self.view.patched_since(committed, last_ends):  # cached copies are stale
            self.storage.forget_cached(lane, first, end)
        return True


def forget_named_finals(finals: Storage, before: np.ndarray, after: np.ndarray) -> None:
    """Reader, having adopted a commit: per lane, the side store's final observations
    ``[before, after)`` (the ordinals of the episodes that ended since the commit adopted
    before) are named for the first time: drop cached or mapped copies of them.

    The side store commits before the main commit, so this reader may have adopted a side
    store commit that no main commit ever named (its writer was killed in between) and cached
    its rows; the next writer resumes from the main commit and writes those ordinals anew."""
    for lane in np.flatnonzero(after > before).tolist():
        finals.forget_cached(lane, int(before[lane]), int(after[lane]))


class Follower:
    """Moves a read-only buffer to the newest commit (a writer has nothing to follow)."""

    def __init__(self, storage: Storage, adoption: Adoption, retry: RetryPolicy):
        self.storage, self.adoption, self.retry = storage, adoption, retry
        self.reader = storage.mode == "r"

    def refresh(self) -> bool:
        """Adopt the newest commit (`Adoption.refresh`); False for a writer."""
        return self.reader and self.adoption.refresh()

    def read_once(self, read: Callable[[], T]) -> T:
        """``read()``; if the writer overwrote its rows, adopt the newest commit and raise
        (`StaleReadError`: the caller's row ids may be gone)."""
        try:
            return read()
        except StaleReadError:
            self.refresh()
            raise

    def read_retrying(self, read: Callable[..., T], *args: Any) -> T:
        """``read(*args)`` (a draw), again after adopting the newest commit while the writer
        outruns this reader, until it succeeds or ``retry.budget_s`` seconds have passed; also
        while the newest commit retired every row (the writer is mid-way round its ring)."""
        deadline = None
        while True:
            try:
                return read(*args)
            except (StaleReadError, EmptyBufferError) as exc:
                if isinstance(exc, EmptyBufferError) and not self._behind_writer():
                    raise
                deadline = deadline if deadline is not None else time.monotonic() + self.retry.budget_s
                if time.monotonic() > deadline:
                    raise
                self._catch_up(deadline)

    def _behind_writer(self) -> bool:
        """A reader whose commit holds rows, every one retired by a writer going round its ring."""
        return self.reader and bool(self.storage.total.any()) and self._empty()

    def _empty(self) -> bool:
        lo, hi = self.storage.window()
        return not bool((hi - lo).sum())

    def _catch_up(self, deadline: float) -> None:
        """Adopt the newest commit; if that retired every row, wait for rows until ``deadline``."""
        self.refresh()
        while self._empty() and time.monotonic() < deadline:
            time.sleep(STALE_READ_PAUSE_S)
            self.refresh()
