"""`RateLimiterActor`: a rate limit's counts kept by one Ray actor, so that shard writers and the
learner coordinate through Ray's messages instead of the store.

The learner sends its sample count (without waiting for an answer), each shard writer its row
count with every check and gets the totals back: an actor's ``insert_allowed`` is one message,
no store request, and the learner's ``sample`` writes nothing to the store. The counts live as
long as the actor: make it ``detached`` (``options(lifetime="detached", name=...)``) to outlive
the driver; a restarted actor starts from zero and is right again once every side has sent its
count.
"""

from __future__ import annotations

from typing import Any

import ray


class _Counts:
    """The counts: rows each shard's writer holds, rows the learner sampled."""

    def __init__(self) -> None:
        self.inserts: dict[int, int] = {}
        self.samples = 0

    def set_samples(self, samples: int) -> None:
        self.samples = samples

    def set_inserts(self, shard: int, rows: int) -> tuple[int, int]:
        self.inserts[shard] = rows
        return sum(self.inserts.values()), self.samples

    def current(self) -> tuple[int, int]:
        """``(rows inserted over all shards, rows sampled)``."""
        return sum(self.inserts.values()), self.samples


RateLimiterActor = ray.remote(num_cpus=0)(_Counts)
"""The Ray actor class that keeps the counts (``RateLimiterActor.remote()``; no CPU reserved)."""


class EngineCounts:
    """The `diskreplay.buffer.rate_limit.SharedCounts` of a `RateLimiterActor`: pass it as
    ``dr.RateLimiter(..., counts=EngineCounts(handle))`` to the learner and to every shard writer
    (it pickles with the handle). ``EngineCounts()`` starts a new actor."""

    def __init__(self, actor: Any = None):
        self.actor: Any = RateLimiterActor.remote() if actor is None else actor

    def set_samples(self, samples: int) -> None:
        self.actor.set_samples.remote(samples)  # one caller's messages arrive in order: no need to wait

    def set_inserts(self, shard: int, rows: int) -> tuple[int, int]:
        inserts, samples = ray.get(self.actor.set_inserts.remote(shard, rows))
        return int(inserts), int(samples)

    def current(self) -> tuple[int, int]:
        """``(rows inserted over all shards, rows sampled)`` as the actor counts them now."""
        inserts, samples = ray.get(self.actor.current.remote())
        return int(inserts), int(samples)
