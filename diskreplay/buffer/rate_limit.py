"""`RateLimiter`: a learner's sampled rows per inserted row kept near a target, as Reverb's
``SampleToInsertRatio``, with no server: the learner publishes its progress in the sharded
buffer's location (``learner.json``) and each actor reads it there.

With ``I`` rows inserted (every shard's committed steps) and ``S`` rows sampled, the learner may
sample ``n`` more rows when ``I >= min_size`` and ``S + n <= spi * (I - min_size) + error_buffer``;
an actor may insert ``k`` more rows when ``S >= spi * (I + k - min_size) - error_buffer``.

The learner's bound is exact. An actor reads one object per check, ``learner.json``: ``S`` and
the other shards' inserts as the learner last published them, plus its own rows exactly. The
other shards' rows the learner had not yet adopted (committed since its last refresh, or in the
`PUBLISH_EVERY_S` before it published) are not counted, so actors together may pass the lower
bound by ``spi`` times those rows (and by ``spi`` times what they insert at the same moment);
before a learner first publishes, an actor counts its own rows only. The learner publishes on a
thread of its own (`Publisher`): its ``sample`` never waits on the store.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..checks import check_int
from ..errors import RateLimitTimeout
from ..format.shards import LearnerProgress, ShardedRoot
from ..io import ChunkStore
from ..storage import UnionStorage
from .learner import LearnerState

PUBLISH_EVERY_S = 0.05
"""How often a learner that is not waiting publishes its progress (seconds)."""


class SharedCounts(Protocol):
    """Where a rate limit's counts live when an engine keeps them (``diskreplay.ray.RateLimiterActor``)
    instead of the store, answered from memory. Each side sends its own count, not a difference:
    a message sent twice, or a writer that reopens its shard after a crash (its rows not committed
    are gone), leaves the counts right. Must pickle: actors are other processes."""

    def set_samples(self, samples: int) -> None:
        """The learner has sampled ``samples`` rows in all (need not wait for the engine)."""

    def set_inserts(self, shard: int, rows: int) -> tuple[int, int]:
        """Shard ``shard``'s writer holds ``rows`` rows; the counts then, ``(rows inserted over
        all shards, rows sampled)``."""


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
        poll_s: seconds between checks while waiting. An actor's check reads one object (the
            learner's progress): one GET per check on an object store, whatever the shard count.
        counts: where the counts live, if an engine keeps them (`SharedCounts`, e.g.
            ``diskreplay.ray.EngineCounts()``): then the learner tells it the rows it
            samples and each actor the rows it adds, and an actor's check is answered from the
            engine's memory; nothing is read from or written to the store. None: ``learner.json``.

    Raises ValueError naming the first argument out of range.
    """

    samples_per_insert: float
    error_buffer: float
    min_size: int = 1
    timeout_s: float = 600.0
    poll_s: float = 0.005
    counts: SharedCounts | None = None

    def __post_init__(self) -> None:
        for name in ("samples_per_insert", "error_buffer", "timeout_s", "poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"RateLimiter: {name} must be a finite number > 0, got {value!r}")
        check_int(self.min_size, "RateLimiter: min_size", 1)
        if self.counts is not None and not all(callable(getattr(self.counts, name, None))
                                               for name in ("set_samples", "set_inserts")):
            raise ValueError(f"RateLimiter: counts must be None or a SharedCounts (set_samples, set_inserts), "
                             f"got {type(self.counts).__name__}")

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

    def read(self) -> LearnerProgress:
        """The learner's last published progress (nothing sampled or seen before it publishes):
        one GET. Raises CorruptBufferError for a damaged ``learner.json``."""
        blob = self.store.get(self.key, limit=1 << 20)
        if blob is None:
            return LearnerProgress(0, (0,) * self.shards, 0.0)
        return LearnerProgress.from_bytes(blob, self.url, self.shards)

    def write(self, progress: LearnerProgress) -> None:
        """Put ``progress`` as ``learner.json`` (one PUT)."""
        self.store.put(self.key, progress.to_bytes())


class Publisher:
    """Writes a learner's progress on a thread of its own, so that `ReplayBuffer.sample` never
    waits on the store: the newest value offered wins, written at most every `PUBLISH_EVERY_S`
    seconds (at once when ``urgent``). A failed write is raised by the next `offer` or `flush`."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.pending: LearnerProgress | None = None
        self.urgent = self.stopping = False
        self.written = 0.0
        self.writing = False
        self.error: BaseException | None = None
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def offer(self, progress: LearnerProgress, urgent: bool = False) -> None:
        """Have ``progress`` written soon (replacing any value not yet written)."""
        with self.cond:
            self._raise_error()
            self.pending, self.urgent = progress, self.urgent or urgent
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="diskreplay-learner-progress", daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def flush(self) -> None:
        """Return once every value offered is written. Raises the write's error."""
        with self.cond:
            self.urgent = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: (self.pending is None and not self.writing) or self.error is not None)
            self._raise_error()

    def close(self) -> None:
        """Flush, then end the thread. Raises the last write's error."""
        try:
            self.flush()
        finally:
            with self.cond:
                self.stopping = True
                self.cond.notify_all()
            if self.thread is not None:
                self.thread.join()

    def _raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error

    def _due(self) -> bool:
        return self.stopping or (self.pending is not None and (
            self.urgent or time.monotonic() - self.written >= PUBLISH_EVERY_S))

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._due():
                    left = None if self.pending is None else self.written + PUBLISH_EVERY_S - time.monotonic()
                    self.cond.wait(left)
                if self.stopping:
                    return
                value, self.pending, self.urgent, self.writing = self.pending, None, False, True
            try:
                self.progress.write(value)  # type: ignore[arg-type]  # _due: pending was set
            except BaseException as exc:  # raised in the learner's thread
                with self.cond:
                    self.error = exc
            with self.cond:
                self.written, self.writing = time.monotonic(), False
                self.cond.notify_all()


class Gate(Protocol):
    """What `ReplayBuffer.sample` asks before and tells after each draw."""

    def before(self, count: int) -> None:
        """Return once ``count`` rows may be sampled."""

    def after(self, count: int) -> None:
        """``count`` rows were sampled."""

    def close(self) -> None:
        """The buffer closes: write what is left to write."""


class Ungated:
    """One buffer's sampling: never waits, counts nothing."""

    def before(self, count: int) -> None:
        pass

    def after(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


UNGATED = Ungated()


class LearnerGate:
    """A learner's side of the limit: waits before a draw, counts the rows drawn, publishes them
    (through a `Publisher`: never in the caller's thread)."""

    def __init__(self, limiter: RateLimiter | None, progress: Progress, union: UnionStorage, state: LearnerState,
                 refresh: Callable[[], object]):
        self.limiter, self.progress, self.union, self.state, self.refresh = limiter, progress, union, state, refresh
        self.publisher = Publisher(progress)

    def before(self, count: int) -> None:
        """Wait until ``count`` more rows may be sampled (refreshing meanwhile). Raises RateLimitTimeout."""
        limiter = self.limiter
        if limiter is None:
            return

        def allowed() -> bool:
            return limiter.sample_allowed(int(self.union.total.sum()), self.state.samples, count)

        def refresh() -> None:
            self.refresh()
            self.publish()  # the inserts adopted: what actors count

        if not allowed():
            self.publish(urgent=True)
            limiter.wait(allowed, refresh, f"sample({count})")

    def after(self, count: int) -> None:
        """``count`` rows were sampled."""
        self.state.samples += count
        if self.limiter is not None:
            self.publish()

    def publish(self, urgent: bool = False, force: bool = False) -> None:
        """Make the learner's progress known: to the engine that keeps the counts, if any (a
        message; the store is not touched), else written to the store within `PUBLISH_EVERY_S`
        seconds, at once if ``urgent``; ``force``: written before this returns."""
        if self.limiter is not None and self.limiter.counts is not None:
            self.limiter.counts.set_samples(self.state.samples)
            return
        inserts = self.union.total.reshape(self.union.shards, -1).sum(axis=1)
        progress = LearnerProgress(self.state.samples, tuple(inserts.tolist()), time.time(),
                                   self.state.sampler.type_name)
        self.publisher.offer(progress, urgent)
        if force:
            self.publisher.flush()

    def close(self) -> None:
        self.publisher.close()


class ActorGate:
    """An actor's side of the limit: whether its next rows may be inserted, by the learner's
    published progress (one read: its sample count and every shard's inserts it had adopted)
    and the actor's own rows."""

    def __init__(self, limiter: RateLimiter, progress: Progress, shard: int, total: Callable[[], int],
                 commit: Callable[[], object]):
        """``total()``: rows the actor added; ``commit()``: commits them (what a learner counts)."""
        self.limiter, self.progress, self.shard, self.total = limiter, progress, shard, total
        self.commit = commit

    def allowed(self, count: int) -> bool:
        if self.limiter.counts is not None:
            inserts, samples = self.limiter.counts.set_inserts(self.shard, self.total())
            return self.limiter.insert_allowed(inserts, samples, count)
        published = self.progress.read()
        others = sum(published.inserts) - published.inserts[self.shard]
        return self.limiter.insert_allowed(others + self.total(), published.samples, count)

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
