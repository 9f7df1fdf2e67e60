"""The exceptions diskreplay raises.

Each subclasses the builtin that a caller would naturally catch (ValueError, KeyError, ...), so
code that does not know diskreplay still handles them sensibly.
"""


class DiskReplayError(Exception):
    """Base class of every diskreplay error."""


class SchemaError(DiskReplayError, ValueError):
    """Incoming rows do not match the buffer's fields (name, shape, dtype or leading axis)."""


class NotABufferError(DiskReplayError, FileNotFoundError):
    """The URL holds no diskreplay buffer (or its metadata is unreadable)."""


class BufferExistsError(DiskReplayError, FileExistsError):
    """`create` found a buffer at the URL and `overwrite=True` was not given."""


class ReadOnlyError(DiskReplayError, PermissionError):
    """A write was attempted on a buffer opened with mode="r"."""


class EmptyBufferError(DiskReplayError, IndexError):
    """Sampling was asked of a buffer (or lane) that holds no rows."""


class CorruptBufferError(DiskReplayError, OSError):
    """Stored data contradicts the last commit: a missing or undecodable chunk, bad metadata."""


class LockedError(DiskReplayError, RuntimeError):
    """Another writer holds the buffer's write lock (or took it from this writer)."""


class ResizeInProgressError(LockedError):
    """A capacity change of the buffer is under way, or was interrupted (its writer was killed):
    the buffer's writer finishes it when it opens the buffer (``mode="r+"``)."""


class ClosedError(DiskReplayError, ValueError):
    """The buffer (or dataset) was closed: open it again to use it."""


class StaleReadError(DiskReplayError, IndexError):
    """A reader asked for rows the writer overwrote after the reader's last refresh. The reader
    has adopted the newest commit: draw again from its window (`ReplayBuffer.sample` does)."""


class CommitNotKeptError(DiskReplayError, LookupError):
    """A commit asked for (``ReplayBuffer.open(url, "r", at_commit=n)``, ``unpin``) is not kept:
    neither pinned (`ReplayBuffer.pin`) nor the newest, or the writer has since overwritten rows
    of the newest commit a reader opened unpinned. The message lists the commits that can be opened."""


class StoreUnavailableError(DiskReplayError, OSError):
    """A remote read or write kept failing with transient errors after every retry."""


class RateLimitTimeout(DiskReplayError, TimeoutError):
    """A `RateLimiter` kept a learner from sampling (or an actor from inserting) for longer than
    its timeout: the other side is not keeping up, or not running."""
