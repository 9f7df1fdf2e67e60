"""The writer lock: one writer per buffer, enforced with a ``writer.lock`` object among the
buffer's own objects. The lock is a *lease* with a *fencing* commit record.

A writer (``create``, ``open(mode="r+")``) creates the lock object *only if it does not exist*
and removes it on close; a second writer finds it and gets `LockedError` naming the holder and
when its lease expires.

Every write of the lock object is a compare-and-swap (`ChunkStore.put_if_version`): a
conditional PUT on S3 (``If-None-Match: *`` to create, ``If-Match: <ETag>`` to replace), a
compare-then-rename under an exclusive ``flock`` of the objects' directory on local disk.

**Lease.** The lock records ``pid``, ``host`` (`host_id`: ``$DISKREPLAY_HOST_ID`` if set, for
tests and containers, else the host name), the process start time (Linux), a random ``token``,
``lease_s`` and ``expires``, a Unix time ``lease_s`` after its last renewal. A daemon thread of
the holder renews it every ``lease_s / 3`` (and `verify`, before each write, renews a lease
past a third of its time), until close; in a forked child the lock is inert (it neither renews
nor releases). A lock whose lease has expired is taken over by the next writer *from any
host*, with a warning naming the old holder; one on this host whose pid no longer runs (or was
reused) is taken over at once, as before leases. Locks written before leases have no
``expires``: only the same-host rule applies to them. The lease relies on clocks agreeing to
well within ``lease_s``.

**Fencing.** A writer that opens the buffer after replacing a lock (an expired lease, a dead pid,
``break_lock``) first rewrites the commit record (a commit of the same rows, `CommitLog`), and
every commit is a compare-and-swap from the version of the record this writer wrote last. A
writer that was taken over (paused, partitioned) can therefore never commit again, even if it
checked its lock just before it stopped: its next commit finds another version and raises
`LockedError`. On local disk its chunk writes are fenced too: they run after a lock check under
the ``flock`` that a takeover takes (`fenced`). On object stores a chunk PUT cannot depend on the
lock: PUTs a writer had in flight when it was frozen can still land when it resumes.

Breaking a live writer's lock is explicit: ``ReplayBuffer.open(url, "r+", break_lock=True)``,
`break_lock` here, or ``diskreplay unlock URL``. Readers never take the lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LockedError
from .local import directory_locked
from .store import ChunkStore

LOCK_KEY = "writer.lock"
MAX_LOCK_BYTES = 4096
DEFAULT_LEASE_S = 30.0
"""How long a writer's lease lasts without a renewal (renewed every third of it)."""
HOST_ENV = "DISKREPLAY_HOST_ID"
"""The environment variable that names this host in locks (tests, containers sharing a host name)."""


log = logging.getLogger(__name__)


def _is_int(value: Any, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value < hi


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 2**40
    return float(value) if ok else None


def host_id() -> str:
    """This host's name in locks: ``$DISKREPLAY_HOST_ID`` if set, else the host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def check_lease(lease_s: float | None) -> float | None:
    """``lease_s`` if it is a lease duration (None: the default). Raises ValueError."""
    if lease_s is not None and (isinstance(lease_s, bool) or not isinstance(lease_s, (int, float))
                                or not math.isfinite(lease_s) or not 0.1 <= lease_s <= 86400):
        raise ValueError(f"lease_s: expected seconds in [0.1, 86400] (or None: {DEFAULT_LEASE_S:g}), got {lease_s!r}")
    return None if lease_s is None else float(lease_s)


@dataclass
class LockInfo:
    """Who holds a lock, as recorded in the lock object."""

    pid: int | None
    host: str
    time: float | None
    token: str
    start_ticks: int | None = None
    raw: bytes = b""
    expires: float | None = None
    version: str | None = None

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
        pid, ticks = data.get("pid"), data.get("start_ticks")
        return cls(pid if _is_int(pid, 1, 2**31) else None, str(data.get("host", "?"))[:255], _number(data.get("time")),
                   str(data.get("token", ""))[:64], ticks if _is_int(ticks, -2**62, 2**62) else None, blob,
                   _number(data.get("expires")))

    def stale_reason(self) -> str | None:
        """Why the holder has lost the lock: its lease expired (any host), or its process is
        known to be gone (this host); None if it may be alive."""
        if self.pid is None:
            return None
        if self.expires is not None and time.time() > self.expires:
            return f"its lease expired {_age(time.time() - self.expires)} ago without a renewal"
        if self.host != host_id():
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
        who = "this process" if self.pid == os.getpid() and self.host == host_id() else f"pid {self.pid}"
        return f"{who} on host {self.host!r} since {when}{age}{self._lease()}"

    def _lease(self) -> str:
        if self.expires is None:
            return ""
        left = self.expires - time.time()
        return f", its lease expires in {left:.1f} s" if left >= 0 else f", its lease expired {_age(-left)} ago"


class WriterLock:
    """The lock of one buffer, held by this process after `acquire` until `release`."""

    def __init__(self, url: str, store: ChunkStore, lease_s: float | None = None):
        """The lock of the buffer at ``url``, kept as `LOCK_KEY` in ``store`` (its own objects).
        ``lease_s``: its lease in seconds (None: `DEFAULT_LEASE_S`)."""
        self.url = url
        self.store = store
        self.token = uuid.uuid4().hex
        self.lease_s = check_lease(lease_s) or DEFAULT_LEASE_S
        self.held = False
        self.replaced: LockInfo | None = None
        """The lock this one replaced (taken over or broken): the commit record must be fenced."""
        self.version: str | None = None  # of the lock object as this writer last wrote it
        self.expires = 0.0
        self._since = time.time()
        self._pid = os.getpid()
        self._mutex = threading.Lock()
        self._stop = threading.Event()

    def _payload(self) -> bytes:
        self.expires = time.time() + self.lease_s
        return json.dumps({"pid": os.getpid(), "host": host_id(), "time": self._since, "token": self.token,
                           "start_ticks": _start_ticks(os.getpid()), "url": self.url, "lease_s": self.lease_s,
                           "expires": self.expires}).encode()

    def acquire(self, break_lock: bool = False) -> WriterLock:
        """Take the lock, or raise `LockedError`. A stale lock (an expired lease, a holder gone,
        see the module docstring) is taken over with a warning; ``break_lock``: remove any
        existing lock first."""
        if break_lock:
            self.replaced = self.holder()
            self.store.delete(LOCK_KEY)
        holder = self._put(None)
        if holder is not None and holder.stale_reason():
            self._take_over(holder)
        elif holder is not None:
            raise LockedError(locked_message(self.url, holder))
        self._renew_in_background()
        return self

    def _put(self, version: str | None) -> LockInfo | None:
        """Write our record over the lock object at ``version`` (None: none): None if done, else
        the holder found instead."""
        written = self.store.put_if_version(LOCK_KEY, self._payload(), version)
        if written is not None:
            self.held, self.version = True, written
            return None
        holder = self.holder()
        if holder is None:
            raise LockedError(f"{self.url!r}: could not take the writer lock {LOCK_KEY!r} (it appeared and vanished); "
                              f"try again")
        return holder

    def _take_over(self, stale: LockInfo) -> None:
        holder = self._put(stale.version)
        if holder is not None:  # someone else resumed first, or the holder renewed
            raise LockedError(locked_message(self.url, holder))
        self.replaced = stale
        log.warning("%r: took over the writer lock left by %s (%s); its committed rows are kept, its "
                    "unflushed rows are lost", self.url, stale.describe(), stale.stale_reason())

    def verify(self, renew: bool = True) -> None:
        """Raise `LockedError` unless this writer still holds the lock (the lock object still
        holds its token): a writer whose lock was broken must not write over its successor.
        ``renew``: renew a lease past a third of its time (never inside `fenced`)."""
        holder = self.holder() if self.held else None
        if holder is not None and holder.token == self.token:
            if renew and self.expires - time.time() < self.lease_s * 2 / 3:
                self.renew()
            return
        self.held = False
        lost = "it was removed" if holder is None else f"it is now held by {holder.describe()}"
        raise LockedError(f"{self.url!r}: this writer no longer holds the writer lock {LOCK_KEY!r} ({lost}); "
                          f"it stopped writing so as not to overwrite another writer's rows. Open the buffer "
                          f"again to write")

    def renew(self) -> bool:
        """Extend the lease by `lease_s` from now, if the lock object is still as this writer
        wrote it; False if it is not (taken over or broken) or this is a forked child."""
        with self._mutex:
            if not self.held or os.getpid() != self._pid:
                return False
            version = self.store.put_if_version(LOCK_KEY, self._payload(), self.version)
            if version is None:
                return False
            self.version = version
            return True

    def _renew_in_background(self) -> None:
        def renew() -> None:
            while not self._stop.wait(self.lease_s / 3):
                try:
                    if not self.renew():
                        return
                except Exception as exc:  # a store hiccup: the next period tries again
                    log.warning("%r: could not renew the writer lease: %s", self.url, exc)
        threading.Thread(target=renew, name="diskreplay-lease", daemon=True).start()

    def holder(self) -> LockInfo | None:
        found = self.store.get_versioned(LOCK_KEY, limit=MAX_LOCK_BYTES)
        if found is None:
            return None
        info = LockInfo.from_bytes(found[0])
        info.version = found[1]
        return info

    def release(self) -> None:
        """Remove the lock if it is still ours. Idempotent; never raises for a lock already gone.
        Does nothing in a forked child (the parent still holds it)."""
        self._stop.set()
        with self._mutex:
            if not self.held or os.getpid() != self._pid:
                return
            self.held = False
            holder = self.holder()
            if holder is not None and holder.token == self.token:
                self.store.delete(LOCK_KEY)

    def release_from_anywhere(self) -> None:
        """`release`, for a finalizer, which the garbage collector may run on any thread: on one
        that runs an event loop (fsspec's I/O thread), whose store calls would wait on that very
        loop, the release runs on a thread of its own."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.release()
            return
        threading.Thread(target=self.release, name="diskreplay-release").start()

    def __enter__(self) -> WriterLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextlib.contextmanager
def fenced(store: ChunkStore) -> Iterator[None]:
    """A section that no takeover of the lock kept in ``store`` can come between: on local disk
    the exclusive ``flock`` that every write of the lock object and of the commit record takes
    (`LocalChunkStore.put_if_version`); on object stores nothing (no such lock exists there)."""
    if not store.supports_mmap:
        yield
        return
    with directory_locked(os.path.dirname(store.path(LOCK_KEY))):
        yield


def locked_message(url: str, holder: LockInfo | None) -> str:
    if holder is None:
        return f"{url!r}: could not take the writer lock {LOCK_KEY!r} (it appeared and vanished); try again"
    stale = holder.stale_reason()
    status = (f"the lock is stale: {stale}" if stale else
              "if that writer is gone (killed, crashed, another machine), the lock is stale" if holder.expires is None
              else "a writer that stops renewing its lease (killed, crashed, paused, another machine) is taken "
              "over from any host once the lease has expired")
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
