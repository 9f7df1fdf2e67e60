"""The writer lock: one writer per buffer, enforced with a ``writer.lock`` object among the
buffer's own objects.

A writer (``create``, ``open(mode="r+")``) creates the lock object *only if it does not exist*
and removes it on close; a second writer finds it and gets `LockedError` naming the holder.

- Local disk: the record is written to a fsynced temp file, then hard-linked to ``writer.lock``
  (``link`` fails if the name exists: an atomic create-if-absent that never exposes a half-written
  record, even if the process is killed between the two); ``O_CREAT | O_EXCL`` where the file
  system has no hard links.
- Object stores: a conditional PUT (``If-None-Match: *``; S3 and moto honour it, s3fs sends it
  for ``mode="create"``). Filesystems without conditional writes fall back to write-then-read-back,
  which narrows but does not close the race between two writers starting at the same instant.

The lock records ``pid``, ``host``, the process start time (Linux), ``time`` and a random
``token``; release deletes the object only while it still holds our token, so a writer whose lock
was broken does not delete its successor's, and a writer checks that the lock still holds its
token before every commit (`WriterLock.verify`): one whose lock was broken stops writing.

A writer killed without closing leaves its lock behind. A lock whose holder is known to be gone
(a pid that no longer runs on this host, or was reused by another process) is *stale*: the next
writer takes it over with a warning. Takeovers on one host are serialized by a host-local file
lock, so two processes resuming at once cannot both take it. A holder on another host, or one
that looks alive, is never taken over silently: breaking it is explicit, with
``ReplayBuffer.open(url, "r+", break_lock=True)``, `break_lock` here, or ``diskreplay unlock URL``.
Readers never take the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LockedError
from .store import ChunkStore, is_local, local_path

LOCK_KEY = "writer.lock"
MAX_LOCK_BYTES = 4096

log = logging.getLogger(__name__)


def _is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


@dataclass
class LockInfo:
    """Who holds a lock, as recorded in the lock object."""

    pid: int | None
    host: str
    time: float | None
    token: str
    start_ticks: int | None = None
    raw: bytes = b""

    @classmethod
    def from_bytes(cls, blob: bytes) -> LockInfo:
        """The record in a lock object. Anything unreadable or out of range (a lock object is
        never trusted) makes an unknown holder, which is never called stale."""
        try:
            data = json.loads(blob)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError):
            return cls(None, "?", None, "", None, blob)
        pid, stamp, ticks = data.get("pid"), data.get("time"), data.get("start_ticks")
        return cls(pid if _is_int(pid, 1, 2**31) else None, str(data.get("host", "?"))[:255],
                   float(stamp) if isinstance(stamp, (int, float)) and not isinstance(stamp, bool)
                   and 0 <= stamp < 2**40 else None,
                   str(data.get("token", ""))[:64], ticks if _is_int(ticks, -2**62, 2**62) else None, blob)

    def stale_reason(self) -> str | None:
        """Why the holder is known to be gone (same host only), or None if it may be alive."""
        if self.pid is None or self.host != socket.gethostname():
            return None
        if not pid_alive(self.pid):
            return f"process {self.pid} is no longer running on this host"
        ticks = _start_ticks(self.pid)
        if self.start_ticks is not None and ticks is not None and ticks != self.start_ticks:
            return f"pid {self.pid} now belongs to another process (the holder exited)"
        return None

    def describe(self) -> str:
        if self.pid is None:
            return f"an unreadable lock object ({self.raw[:60]!r})"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time)) if self.time else "?"
        age = f", {_age(time.time() - self.time)} ago" if self.time else ""
        who = "this process" if self.pid == os.getpid() and self.host == socket.gethostname() else f"pid {self.pid}"
        return f"{who} on host {self.host!r} since {when}{age}"


class WriterLock:
    """The lock of one buffer, held by this process after `acquire` until `release`."""

    def __init__(self, url: str, store: ChunkStore):
        """The lock of the buffer at ``url``, kept as `LOCK_KEY` in ``store`` (its own objects)."""
        self.url = url
        self.store = store
        self.token = uuid.uuid4().hex
        self.held = False

    def _payload(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                           "token": self.token, "start_ticks": _start_ticks(os.getpid()),
                           "url": self.url}).encode()

    def acquire(self, break_lock: bool = False) -> WriterLock:
        """Take the lock, or raise `LockedError`. A stale lock (its holder is gone, see the module
        docstring) is taken over with a warning; ``break_lock``: remove any existing lock first."""
        if break_lock:
            self.store.delete(LOCK_KEY)
        if self._create():
            return self
        holder = self.holder()
        if holder is not None and holder.stale_reason():
            return self._take_over(holder)
        raise LockedError(locked_message(self.url, holder))

    def _create(self) -> bool:
        if self.store.put_if_absent(LOCK_KEY, self._payload()):
            self.held = True
        else:  # our PUT may have landed with its reply lost
            holder = self.holder()
            self.held = holder is not None and holder.token == self.token
        return self.held

    def _take_over(self, stale: LockInfo) -> WriterLock:
        with _takeover_guard(self.url):
            holder = self.holder()
            if holder is not None and (holder.raw != stale.raw or not holder.stale_reason()):
                raise LockedError(locked_message(self.url, holder))  # someone else resumed first
            self.store.delete(LOCK_KEY)
            if not self._create():
                raise LockedError(locked_message(self.url, self.holder()))
        log.warning("%r: took over the writer lock left by %s (%s); its committed rows are kept, its "
                    "unflushed rows are lost", self.url, stale.describe(), stale.stale_reason())
        return self

    def verify(self) -> None:
        """Raise `LockedError` unless this writer still holds the lock (the lock object still
        holds its token): a writer whose lock was broken must not write over its successor."""
        holder = self.holder() if self.held else None
        if holder is not None and holder.token == self.token:
            return
        self.held = False
        lost = "it was removed" if holder is None else f"it is now held by {holder.describe()}"
        raise LockedError(f"{self.url!r}: this writer no longer holds the writer lock {LOCK_KEY!r} ({lost}); "
                          f"it stopped writing so as not to overwrite another writer's rows. Open the buffer "
                          f"again to write")

    def holder(self) -> LockInfo | None:
        blob = self.store.get(LOCK_KEY, limit=MAX_LOCK_BYTES)
        return None if blob is None else LockInfo.from_bytes(blob)

    def release(self) -> None:
        """Remove the lock if it is still ours. Idempotent; never raises for a lock already gone."""
        if not self.held:
            return
        self.held = False
        holder = self.holder()
        if holder is not None and holder.token == self.token:
            self.store.delete(LOCK_KEY)

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def locked_message(url: str, holder: LockInfo | None) -> str:
    if holder is None:
        return f"{url!r}: could not take the writer lock {LOCK_KEY!r} (it appeared and vanished); try again"
    stale = holder.stale_reason()
    status = (f"the lock is stale: {stale}" if stale else
              "if that writer is gone (killed, crashed, another machine), the lock is stale")
    return (f"{url!r} is already open for writing by {holder.describe()}; {status}. One writer per buffer: "
            f"open it read-only with mode='r', or break the lock with "
            f"ReplayBuffer.open(url, 'r+', break_lock=True) or `diskreplay unlock {url}`")


def lock_holder(url: str, stores: Sequence[ChunkStore]) -> LockInfo | None:
    """Who holds the writer lock of ``url`` kept in any of ``stores``, or None if nobody does."""
    for store in stores:
        holder = WriterLock(url, store).holder()
        if holder is not None:
            return holder
    return None


def break_lock(url: str, stores: Sequence[ChunkStore]) -> LockInfo | None:
    """Remove the writer lock of ``url`` from ``stores`` whoever holds it; returns the holder it
    removed (or None).

    Only for a writer known to be gone: a live writer that loses its lock keeps writing.
    """
    holder = lock_holder(url, stores)
    for store in stores:
        store.delete(LOCK_KEY)
    return holder


def check_unlocked(url: str, stores: Sequence[ChunkStore], break_lock: bool = False) -> None:
    """Raise `LockedError` if a live writer holds ``url`` (its lock kept in any of ``stores``),
    before replacing a buffer. A stale lock is no obstacle; ``break_lock`` removes any lock."""
    for store in stores:
        holder = WriterLock(url, store).holder()
        if holder is None or holder.stale_reason():
            continue
        if not break_lock:
            raise LockedError(locked_message(url, holder))
        store.delete(LOCK_KEY)


@contextlib.contextmanager
def _takeover_guard(url: str) -> Iterator[None]:
    """An exclusive lock, on this host, on taking over ``url``'s writer lock."""
    name = os.path.realpath(local_path(url)) if is_local(url) else url
    folder = os.path.join(tempfile.gettempdir(), "diskreplay-takeover")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, hashlib.sha256(name.encode()).hexdigest()[:32] + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (a zombie does not; one we may not
    signal does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    if _is_zombie(pid):
        return False
    return True


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] == b"Z"


def _start_ticks(pid: int) -> int | None:
    """The process start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
