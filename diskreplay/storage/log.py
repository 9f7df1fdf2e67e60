"""`Log`: what the read side of a storage needs of its commits, whether one buffer's
(`CommitLog`) or the union of a sharded buffer's shards (`UnionLog`)."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..format.commit import CommitRecord
from .cursors import Cursors


class Log(Protocol):
    """The commit a storage shows, its cursors, and the newest commit in the store."""

    url: str
    record: CommitRecord
    cursors: Cursors
    closed: bool

    @property
    def mode(self) -> str:
        """``"r"`` (a reader) or ``"r+"`` (the writer)."""
        ...

    def require_writable(self) -> None:
        """Raise unless this log may commit: ClosedError, LockedError or ReadOnlyError."""
        ...

    def read_newest(self) -> CommitRecord:
        """The newest commit record in the store (validated)."""
        ...

    def read_newest_of(self, lanes: np.ndarray) -> CommitRecord:
        """`read_newest` where only the commits holding ``lanes`` need be newest (a union reads
        those shards' alone; one buffer has one commit)."""
        ...

    def adopt(self, record: CommitRecord) -> None:
        """Show ``record`` (a reader following its writer)."""
        ...

    def close(self) -> None:
        """Release what the log holds (idempotent)."""
        ...
