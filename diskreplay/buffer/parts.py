"""The parts of a `ReplayBuffer` that differ between one buffer (its writer, or a reader of it)
and the union of a sharded buffer's shards (a learner): its state, how it follows commits, how it
writes, and how its sampling is rate limited."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..episodes import RowView
from ..format.commit import CommitRecord
from ..io import RetryPolicy
from ..sampling import BaseSampler, Sampler, with_defaults
from ..storage import Storage
from .appending import Appender
from .following import CommitAdoption, Follower
from .learner import LearnerState, ShardAdoption
from .rate_limit import UNGATED, Gate, LearnerGate, Progress, RateLimiter
from .state import BufferState


@dataclass(frozen=True)
class LearnerOpening:
    """What a learner is opened with: the commit each shard shows and its state, where the
    learner publishes its progress, and its rate limiter."""

    states: list[tuple[CommitRecord, Mapping[str, Any]]]
    progress: Progress
    limiter: RateLimiter | None


@dataclass(frozen=True)
class Parts:
    state: BufferState | LearnerState
    follower: Follower
    appender: Appender | None = None
    gate: Gate = UNGATED


def make_parts(storage: Storage, finals: Storage | None, sampler: Sampler, rng: np.random.Generator,
               view: RowView, retry: RetryPolicy, learner: LearnerOpening | None) -> Parts:
    """A learner's parts for the union of a sharded buffer's shards, else one buffer's. A sampler
    of the user's that is no `BaseSampler` gets the defaults of its optional methods here."""
    sampler = with_defaults(sampler)
    if storage.sharded:
        assert learner is not None
        return learner_parts(storage, finals, sampler, rng, view, retry, learner)
    return buffer_parts(storage, finals, sampler, rng, view, retry)


def buffer_parts(storage: Storage, finals: Storage | None, sampler: BaseSampler, rng: np.random.Generator,
                 view: RowView, retry: RetryPolicy) -> Parts:
    """One buffer's parts: its state saved with each commit, the commits it follows (a reader)
    or makes (a writer, through its `Appender`)."""
    state = BufferState(storage, rng, sampler, view.episodes, view)
    appender = Appender(storage, finals, view, sampler, view.inputs(), state)
    return Parts(state, Follower(storage, CommitAdoption(storage, finals, state, view), retry), appender)


def learner_parts(union: Storage, finals: Storage | None, sampler: BaseSampler, rng: np.random.Generator,
                  view: RowView, retry: RetryPolicy, opening: LearnerOpening) -> Parts:
    """A learner's parts: its own state, every shard's commits adopted, its sampling counted
    (and limited). Raises CorruptBufferError for a shard's damaged state."""
    state = LearnerState(union, rng, sampler)
    shards = ShardAdoption(union, finals, sampler, view)
    follower = Follower(union, shards, retry)
    shards.start(opening.states)
    return Parts(state, follower, gate=LearnerGate(opening.limiter, opening.progress, union, state, follower.refresh))
