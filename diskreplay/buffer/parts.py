"""What a `ReplayBuffer` is made of, computed by its factories before it is constructed: one
buffer's storages and saved state (`BufferOpening`), or a learner's union of a sharded buffer's
shards (`LearnerOpening`); and the parts that differ between the two (`Parts`): its state, how it
follows commits, how it writes, and how its sampling and inserts are rate limited."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..episodes import RowView
from ..format.commit import CommitRecord
from ..io import RetryPolicy
from ..sampling import Sampler, with_defaults
from ..storage import BufferStorage, UnionStorage
from .appending import Appender
from .following import CommitAdoption, Follower
from .learner import LearnerState, ShardAdoption
from .rate_limit import NO_ACTOR_GATE, UNGATED, ActorGate, Gate, LearnerGate, NoActorGate, Progress, RateLimiter
from .state import BufferState, state_origin


@dataclass(frozen=True)
class Parts:
    state: BufferState | LearnerState
    follower: Follower
    appender: Appender | None = None
    gate: Gate = UNGATED
    actor: ActorGate | NoActorGate = NO_ACTOR_GATE


@dataclass(frozen=True)
class ActorLimit:
    """A shard writer's side of a learner's rate limit: the limiter, where the learner publishes
    its progress, and the shard."""

    limiter: RateLimiter
    progress: Progress
    shard: int

    def gate(self, storage: BufferStorage, commit: Callable[[], object]) -> ActorGate:
        """The gate of the writer of ``storage``, which ``commit()`` commits."""
        return ActorGate(self.limiter, self.progress, self.shard, lambda: int(storage.total.sum()), commit)


@dataclass(frozen=True)
class BufferOpening:
    """What one buffer (its writer, or a reader of it) is made of: its storage and ``derive_next``
    side store; for an existing buffer, the commit they show and the state saved with it
    (``saved``, None: a new buffer) and the lanes whose open episode its writer closes, as cut, at
    their next rows; for a shard's writer, its side of the learner's rate limit."""

    storage: BufferStorage
    finals: BufferStorage | None = None
    saved: tuple[CommitRecord, Mapping[str, Any]] | None = None
    cut: frozenset[int] = frozenset()
    actor: ActorLimit | None = None

    def parts(self, sampler: Sampler, rng: np.random.Generator, view: RowView, retry: RetryPolicy,
              commit: Callable[[], object]) -> Parts:
        """One buffer's parts: its state saved with each commit (loaded from ``saved``), the
        commits it follows (a reader) or makes (a writer, through its `Appender`; ``commit()``
        commits). Raises CorruptBufferError for a damaged saved state."""
        storage, finals, sampler = self.storage, self.finals, with_defaults(sampler)
        state = BufferState(storage, rng, sampler, view.episodes, view)
        appender = Appender(storage, finals, view, sampler, view.inputs(), state, set(self.cut))
        follower = Follower(storage, CommitAdoption(storage, finals, state, view), retry)
        if self.saved is not None:
            record, saved = self.saved
            state.apply(state.parse(saved, record.committed, state_origin(storage.url, record)), with_rng=True)
            if finals is not None and storage.mode == "r+":  # the side store commits first: it may
                finals.rewind(view.episodes.ended())  # hold finals of episodes no main commit ended
        actor = NO_ACTOR_GATE if self.actor is None else self.actor.gate(storage, commit)
        return Parts(state, follower, appender, actor=actor)


@dataclass(frozen=True)
class LearnerOpening:
    """What a learner is made of: the union of a sharded buffer's shards (and of their
    ``derive_next`` side stores), the commit each shard shows and its state, where the learner
    publishes its progress, and its rate limiter."""

    storage: UnionStorage
    finals: UnionStorage | None
    states: list[tuple[CommitRecord, Mapping[str, Any]]]
    progress: Progress
    limiter: RateLimiter | None

    def parts(self, sampler: Sampler, rng: np.random.Generator, view: RowView, retry: RetryPolicy,
              commit: Callable[[], object]) -> Parts:
        """A learner's parts: its own state, every shard's commits adopted, its sampling counted
        (and limited); it commits nothing. Raises CorruptBufferError for a shard's damaged state."""
        union, sampler = self.storage, with_defaults(sampler)
        state = LearnerState(union, rng, sampler)
        shards = ShardAdoption(union, self.finals, sampler, view)
        follower = Follower(union, shards, retry)
        shards.start(self.states)
        return Parts(state, follower, gate=LearnerGate(self.limiter, self.progress, union, state, follower.refresh))
