"""`RateLimiter`: a learner's sampled rows per inserted row kept near a target, as Reverb's
``SampleToInsertRatio``, with no server: the learner publishes its progress in the sharded
buffer's location (``learner.json``) and each actor reads it there.

With ``I`` rows inserted (every shard's committed steps) and ``S`` rows sampled, the learner may
sample ``n`` more rows when ``I >= min_size`` and ``S + n <= spi * (I - min_size) + error_buffer``;
an actor may insert ``k`` more rows when ``S >= spi * (I + k - min_size) - error_buffer``.

The learner's bound is exact. An actor counts ``I`` from every shard's newest commit and ``S``
as the learner last published it, so actors that decide at the same moment may together insert
more than one of them would: the lower bound holds up to ``spi`` times the rows they insert at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..checks import check_int
from ..errors import CorruptBufferError, RateLimitTimeout
from ..format.commit import CommitRecord
from ..format.keys import COMMIT_KEY, objects_prefix
from ..format.shards import LearnerProgress, ShardedRoot, shard_name
from ..io import ChunkStore
from ..storage import UnionStorage
from .learner import LearnerState

PUBLISH_EVERY_S = 0.05
"""How often a learner that is not waiting publishes its progress (seconds)."""


@dataclass(frozen=True)
class RateLimiter:
    """Keep ``samples_per_insert`` sampled rows per inserted row, within ``error_buffer`` rows.

    Args:
        samples_per_insert: the target ratio of sampled rows (a batch of 256 counts 256) to
            inserted rows, over all shards.
        error_buffer: how many sampled rows the learner may run ahead of (or behind) the target.
            At least ``(batch_size + samples_per_insert * rows an actor inserts between checks) / 2``,
            or learner and actors can wait for each other.
        min_size: rows inserted before the learner may sample at all.
        timeout_s: how long `ReplayBuffer.sample` (or an actor's ``insert_allowed(rows, wait=True)``)
            waits before raising `RateLimitTimeout`.
        poll_s: seconds between checks while waiting. An actor's check reads the learner's
            progress and every other shard's newest commit (all in flight at once): on an object
            store that is ``shards`` GETs per check, so raise ``poll_s`` there (e.g. 0.05-0.2).

    Raises ValueError naming the first argument out of range.
    """

    samples_per_insert: float
    error_buffer: float
    min_size: int = 1
    timeout_s: float = 600.0
    poll_s: float = 0.005

    def __post_init__(self) -> None:
        for name in ("samples_per_insert", "error_buffer", "timeout_s", "poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RateLimiter: {name} must be a finite number > 0, got {value!r}")
        check_int(self.min_size, "RateLimiter: min_size", 1)

    def sample_allowed(self, inserts: int, samples: int, count: int) -> bool:
        """Whether a learner that sampled ``samples`` rows of ``inserts`` may sample ``count`` more."""
        return inserts >= self.min_size and samples + count <= self.samples_per_insert * (
            inserts - self.min_size) + self.error_buffer

    def insert_allowed(self, inserts: int, samples: int, count: int) -> bool:
        """Whether ``count`` more rows may be inserted after ``inserts``, ``samples`` rows sampled."""
        return samples >= self.samples_per_insert * (inserts + count - self.min_size) - self.error_buffer

    def wait(self, allowed: Callable[[], bool], between: Callable[[], object], what: str) -> None:
        """Call ``between`` every ``poll_s`` seconds until ``allowed()``. Raises RateLimitTimeout
        (saying ``what`` waited) after ``timeout_s`` seconds."""
        deadline = time.monotonic() + self.timeout_s
        while not allowed():
            if time.monotonic() > deadline:
                raise RateLimitTimeout(f"{what} waited {self.timeout_s:g} s for the rate limiter "
                                       f"(samples_per_insert={self.samples_per_insert:g}, min_size={self.min_size}, "
                                       f"error_buffer={self.error_buffer:g})")
            time.sleep(self.poll_s)
            between()


class Progress:
    """``learner.json`` among a sharded buffer's root objects: written by the learner, read by actors."""

    def __init__(self, store: ChunkStore, url: str, root: ShardedRoot):
        self.store, self.url, self.shards, self.key = store, url, root.count, root.learner_key
        self.own = objects_prefix(root.format)
        self.published = 0.0

    def read(self) -> LearnerProgress:
        """The learner's last published progress (nothing sampled or seen before it publishes).
        Raises CorruptBufferError for a damaged ``learner.json``."""
        blob = self.store.get(self.key, limit=1 << 20)
        if blob is None:
            return LearnerProgress(0, (0,) * self.shards, 0.0)
        return LearnerProgress.from_bytes(blob, self.url, self.shards)

    def publish(self, samples: int, inserts: tuple[int, ...], force: bool = False, sampler: str | None = None) -> None:
        """Write the learner's progress (and its sampler's type), at most every `PUBLISH_EVERY_S`
        seconds unless ``force``."""
        now = time.time()
        if force or now - self.published >= PUBLISH_EVERY_S:
            self.store.put(self.key, LearnerProgress(samples, inserts, now, sampler).to_bytes())
            self.published = now

    def inserts(self, shard: int, own_total: int, num_envs: int) -> int:
        """Rows inserted as actor ``shard``, with ``own_total`` rows added, counts them: its own
        exactly, every other shard's from that shard's newest commit (read all at once).
        Raises CorruptBufferError for a missing or damaged ``commit.json``."""
        keys = [f"{shard_name(s)}/{self.own}{COMMIT_KEY}" for s in range(self.shards) if s != shard]
        total = own_total
        for key, blob in zip(keys, self.store.get_many(keys)):
            if blob is None:
                raise CorruptBufferError(f"{self.url!r}: {key} is missing")
            total += int(CommitRecord.from_bytes(blob, f"{self.url}/{key.split('/')[0]}", num_envs).committed.sum())
        return total


class Gate(Protocol):
    """What `ReplayBuffer.sample` asks before and tells after each draw."""

    def before(self, count: int) -> None:
        """Return once ``count`` rows may be sampled."""

    def after(self, count: int) -> None:
        """``count`` rows were sampled."""


class Ungated:
    """One buffer's sampling: never waits, counts nothing."""

    def before(self, count: int) -> None:
        pass

    def after(self, count: int) -> None:
        pass


UNGATED = Ungated()


class LearnerGate:
    """A learner's side of the limit: waits before a draw, counts the rows drawn, publishes them."""

    def __init__(self, limiter: RateLimiter | None, progress: Progress, union: UnionStorage, state: LearnerState,
                 refresh: Callable[[], object]):
        self.limiter, self.progress, self.union, self.state, self.refresh = limiter, progress, union, state, refresh

    def before(self, count: int) -> None:
        """Wait until ``count`` more rows may be sampled (refreshing meanwhile). Raises RateLimitTimeout."""
        limiter = self.limiter
        if limiter is None:
            return

        def allowed() -> bool:
            return limiter.sample_allowed(int(self.union.total.sum()), self.state.samples, count)

        if not allowed():
            self.publish(force=True)
            limiter.wait(allowed, self.refresh, f"sample({count})")

    def after(self, count: int) -> None:
        """``count`` rows were sampled."""
        self.state.samples += count
        if self.limiter is not None:
            self.publish()

    def publish(self, force: bool = False) -> None:
        inserts = self.union.total.reshape(self.union.shards, -1).sum(axis=1)
        self.progress.publish(self.state.samples, tuple(inserts.tolist()), force, self.state.sampler.type_name)


class ActorGate:
    """An actor's side of the limit: whether its next rows may be inserted, by the learner's
    published sample count and every shard's newest commit."""

    def __init__(self, limiter: RateLimiter, progress: Progress, shard: int, total: Callable[[], int], num_envs: int,
                 commit: Callable[[], object]):
        """``total()``: rows the actor added; ``commit()``: commits them (what a learner counts)."""
        self.limiter, self.progress, self.shard, self.total, self.num_envs = limiter, progress, shard, total, num_envs
        self.commit = commit

    def allowed(self, count: int) -> bool:
        samples = self.progress.read().samples
        inserts = self.progress.inserts(self.shard, self.total(), self.num_envs)
        return self.limiter.insert_allowed(inserts, samples, count)

    def wait(self, count: int) -> bool:
        """Block until ``count`` rows may be inserted (True), after committing the rows added so
        far if it must wait: the learner counts committed rows only, so waiting on rows it cannot
        see could wait for good. Raises RateLimitTimeout."""
        if not self.allowed(count):
            self.commit()
            what = f"inserting {count} rows into shard {self.shard}"
            self.limiter.wait(lambda: self.allowed(count), lambda: None, what)
        return True


class NoActorGate:
    """A shard writer opened without a rate limiter: asking raises ValueError."""

    def allowed(self, count: int) -> bool:
        raise ValueError("this buffer has no rate limiter: open the shard with "
                         "dr.ReplayBuffer.open_shard(url, shard, rate_limiter=dr.RateLimiter(...))")

    wait = allowed


NO_ACTOR_GATE = NoActorGate()
