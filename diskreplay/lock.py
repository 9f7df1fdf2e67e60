"""The writer lock: one writer per buffer, enforced with a ``writer.lock`` object in the store.

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
was broken does not delete its successor's. A writer killed without closing leaves its lock
behind. On local disk a lock whose pid no longer runs on this host (or was reused by another
process) is reported as stale; breaking it is explicit: ``ReplayBuffer.open(url, "r+",
break_lock=True)``, `break_lock` here, or ``diskreplay unlock URL``. Readers never take the lock.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .chunkstore import ChunkStore, open_chunkstore
from .errors import LockedError

LOCK_KEY = "writer.lock"


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
    def from_bytes(cls, blob: bytes) -> "LockInfo":
        try:
            data = json.loads(blob)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError:
            return cls(None, "?", None, "", None, blob)
        pid = data.get("pid")
        return cls(pid if isinstance(pid, int) else None, str(data.get("host", "?")),
                   data.get("time") if isinstance(data.get("time"), (int, float)) else None,
                   str(data.get("token", "")), data.get("start_ticks"), blob)

    def stale_reason(self) -> str | None:
        """Why the holder is known to be gone (same host only), or None if it may be alive."""
        if self.pid is None or self.host != socket.gethostname():
            return None
        if not _pid_alive(self.pid):
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

    def __init__(self, url: str, storage_options: dict | None = None, store: ChunkStore | None = None):
        self.url = url
        self.store = store if store is not None else open_chunkstore(url, storage_options)
        self.token = uuid.uuid4().hex
        self.held = False

    def _payload(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                           "token": self.token, "start_ticks": _start_ticks(os.getpid()),
                           "url": self.url}).encode()

    def acquire(self, break_lock: bool = False) -> "WriterLock":
        """Take the lock, or raise `LockedError`. ``break_lock``: remove any existing lock first."""
        if break_lock:
            self.store.delete(LOCK_KEY)
        if self.store.put_if_absent(LOCK_KEY, self._payload()):
            self.held = True
            return self
        holder = self.holder()
        if holder is not None and holder.token == self.token:  # our PUT landed; its reply was lost
            self.held = True
            return self
        raise LockedError(locked_message(self.url, holder))

    def holder(self) -> LockInfo | None:
        blob = self.store.get(LOCK_KEY)
        return None if blob is None else LockInfo.from_bytes(blob)

    def release(self) -> None:
        """Remove the lock if it is still ours. Idempotent; never raises for a lock already gone."""
        if not self.held:
            return
        self.held = False
        holder = self.holder()
        if holder is not None and holder.token == self.token:
            self.store.delete(LOCK_KEY)

    def __enter__(self) -> "WriterLock":
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


def lock_holder(url: str, storage_options: dict | None = None) -> LockInfo | None:
    """Who holds the writer lock of ``url``, or None if nobody does."""
    return WriterLock(url, storage_options).holder()


def break_lock(url: str, storage_options: dict | None = None) -> LockInfo | None:
    """Remove the writer lock of ``url`` whoever holds it; returns the holder it removed (or None).

    Only for a writer known to be gone: a live writer that loses its lock keeps writing.
    """
    lock = WriterLock(url, storage_options)
    holder = lock.holder()
    if holder is not None:
        lock.store.delete(LOCK_KEY)
    return holder


def check_unlocked(url: str, storage_options: dict | None = None, break_lock: bool = False) -> None:
    """Raise `LockedError` if a writer holds ``url`` (before replacing a buffer); ``break_lock``
    removes the lock instead."""
    lock = WriterLock(url, storage_options)
    holder = lock.holder()
    if holder is None:
        return
    if not break_lock:
        raise LockedError(locked_message(url, holder))
    lock.store.delete(LOCK_KEY)


def _pid_alive(pid: int) -> bool:
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
