"""`ShardWriter`: a Ray actor that owns one shard of a sharded buffer and survives restarts.

Ray restarts an actor (``max_restarts``) by running its constructor again in a new worker
process, on any node: after its worker was killed, its node lost, or ``ray.kill(actor,
no_restart=False)``. The constructor (`ShardOwner`) opens the shard with
`ReplayBuffer.open_shard`, which takes over the dead writer's lock (at once on the same host,
once its lease expired on another) and closes the episode it cut as truncated. The lock of a
writer on another host is held until its lease expires, so the open is retried, with backoff,
for ``lease_s`` + `GRACE_S` seconds before it gives up with `LockedError`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import ray

from ..buffer import ReplayBuffer
from ..errors import BufferExistsError, LockedError
from ..io.lock import DEFAULT_LEASE_S, check_lease
from .plan import absolute

GRACE_S = 5.0
"""Seconds past the lease that a (re)started `ShardWriter` keeps trying to take its shard's lock."""
MAX_PAUSE_S = 1.0


class ShardOwner:
    """The body of the `ShardWriter` actor: the one writer of shard ``shard`` of the sharded
    buffer at ``url`` (usable without Ray too).

    Args:
        url: the sharded buffer (made by ``ReplayBuffer.create(..., shards=N)``).
        shard: which shard this writer owns.
        create: if given, ``ReplayBuffer.create`` arguments (``fields``, ``shards``,
            ``capacity``...) to create the sharded buffer with when there is none at ``url``
            (an existing one is never replaced). Many writers: create it once before starting
            them rather than let them race to create it.
        lease_s: the writer lock's lease in seconds (None: 30). It also bounds the wait for the
            lock of a writer that died on another host: ``lease_s`` + `GRACE_S` seconds.
        open_options: as in `ReplayBuffer.open_shard` (``storage_options``, ``rate_limiter``...).

    Raises:
        LockedError: a live writer still held the shard ``lease_s`` + `GRACE_S` seconds on.
        NotABufferError: no sharded buffer at ``url`` and no ``create``. And as `open_shard`.
    """

    def __init__(self, url: str, shard: int, *, create: Mapping[str, Any] | None = None,
                 lease_s: float | None = None, **open_options: Any):
        self.url, self.shard = os.fspath(url), shard
        self.lease_s = check_lease(lease_s) or DEFAULT_LEASE_S
        if create is not None:
            _create_if_missing(self.url, create, open_options)
        self.buffer = open_shard_patiently(self.url, shard, self.lease_s, open_options)

    def add(self, env_ids: Any = None, **step: Any) -> None:
        """`ReplayBuffer.add` of one step (every lane's, or those of ``env_ids``)."""
        self.buffer.add(env_ids, **step)

    def extend(self, data: Mapping[str, Any], env_ids: Any = None) -> None:
        """`ReplayBuffer.extend` of several steps."""
        self.buffer.extend(data, env_ids)

    def flush(self, durable: bool = True) -> int:
        """Commit every staged row (`ReplayBuffer.flush`); returns the rows committed now."""
        self.buffer.flush(durable)
        return self.committed()

    def rows(self) -> int:
        """Rows in the shard, staged ones included (lost if the actor dies before a flush)."""
        return len(self.buffer)

    def committed(self) -> int:
        """Rows in the shard's last commit: what learners read and a restart keeps."""
        lo, hi = self.buffer.window(committed=True)
        return int((hi - lo).sum())

    def window(self, committed: bool = False) -> tuple[Any, Any]:
        """Per lane, the readable steps ``[lo, hi)`` (`ReplayBuffer.window`)."""
        return self.buffer.window(committed)

    def pid(self) -> int:
        """The id of the process writing the shard (it changes when Ray restarts the actor)."""
        return os.getpid()

    def close(self) -> None:
        """Flush and release the shard's lock (`ReplayBuffer.close`). Later calls raise `ClosedError`."""
        self.buffer.close()


def _create_if_missing(url: str, create: Mapping[str, Any], open_options: Mapping[str, Any]) -> None:
    options = {"storage_options": open_options.get("storage_options"), "retry": open_options.get("retry"), **create}
    try:
        ReplayBuffer.create(url, overwrite=False, **options).close()
    except BufferExistsError:  # another actor created it first
        pass


def open_shard_patiently(url: str, shard: int, lease_s: float, open_options: Mapping[str, Any]) -> ReplayBuffer:
    """`ReplayBuffer.open_shard` of ``shard`` as its writer, tried again with backoff while another
    writer holds its lock, for ``lease_s`` + `GRACE_S` seconds: a writer that died on another host
    loses its lock when its lease expires. Raises `LockedError` naming the holder after that."""
    patience = lease_s + GRACE_S
    deadline = time.monotonic() + patience
    pause = 0.05
    while True:
        try:
            return ReplayBuffer.open_shard(url, shard, lease_s=lease_s, **open_options)
        except LockedError as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockedError(f"shard {shard} of {url!r}: its writer lock is still held after lease_s + "
                                  f"{GRACE_S:g} s = {patience:g} s of retries, so its writer is alive (or its "
                                  f"lease is longer than this writer's lease_s={lease_s:g}): {exc}") from exc
            time.sleep(min(pause, left))
            pause = min(pause * 2, MAX_PAUSE_S)


ShardWriter = ray.remote(max_restarts=-1, max_task_retries=0)(ShardOwner)
"""The Ray actor class of `ShardOwner`: ``ShardWriter.remote(url, shard, create=..., lease_s=...)``.

Ray restarts it whenever its process dies (``max_restarts=-1``; change it with
``ShardWriter.options(max_restarts=3)``); the restarted actor reopens its shard, keeping every
row committed before, and its next rows follow. Calls in flight when it died raise
``ray.exceptions.RayActorError`` and are not retried (``max_task_retries=0``): rows added since
the last `flush` are lost with the process, so the caller decides what to write again.
"""


def start_shard_writer(url: str, shard: int, *, create: Mapping[str, Any] | None = None,
                       lease_s: float | None = None, max_restarts: int = -1,
                       actor_options: Mapping[str, Any] | None = None, **open_options: Any) -> Any:
    """A `ShardWriter` actor owning shard ``shard`` of ``url`` (a ``ray.actor.ActorHandle``).

    ``max_restarts``: how often Ray restarts it (-1: always); ``actor_options``: any other
    ``ray.remote`` actor option (``num_cpus``, ``scheduling_strategy``...). The other arguments
    are `ShardOwner`'s; a local path is made absolute here (an actor's working directory is
    Ray's, not the caller's). Its methods return ``ObjectRef``s: ``ray.get(writer.flush.remote())``.
    """
    check_lease(lease_s)
    options = {**(actor_options or {}), "max_restarts": max_restarts}
    return ShardWriter.options(**options).remote(absolute(url), shard, create=create, lease_s=lease_s, **open_options)
