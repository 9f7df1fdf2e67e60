"""The learner's side of a sharded buffer: its own state (`LearnerState`: generator, sampler,
the rows it has seen) and the adoption of every shard's newest commit (`ShardAdoption`).

The shards' writers own their rows and episode indexes; the learner owns the sampler over the
union (priorities of every shard's rows). Rows a shard commits reach the sampler as appended rows
when the learner adopts that commit, as a writer's own rows reach its sampler when added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..episodes import EpisodeIndex, RowView
from ..errors import CorruptBufferError, EmptyBufferError
from ..format.commit import CommitRecord
from ..format.lanes import is_empty, row_ids
from ..format.shards import shard_url
from ..sampling import BaseSampler, Draw, Sampler, check_sampler_state, load_sampler_state
from ..storage import UnionStorage
from .following import forget_named_finals
from .state import announce, check_rng_state, state_origin

if TYPE_CHECKING:
    from .following import Follower
    from .rate_limit import LearnerGate, RateLimiter


class LearnerState:
    """The learner's state: generator, sampler and, per union lane, the steps its sampler knows."""

    def __init__(self, union: UnionStorage, rng: np.random.Generator, sampler: BaseSampler):
        self.union, self.rng, self.sampler = union, rng, sampler
        self.samples = 0
        """Rows this learner sampled (what a `RateLimiter` counts)."""

    def current(self) -> dict[str, Any]:
        """The state now: ``rng``, ``sampler`` and ``samples`` (``ReplayBuffer.state_dict`` adds
        ``total``, the steps per union lane the sampler knows)."""
        return {"rng": self.rng.bit_generator.state, "sampler": self.sampler.state_dict(), "samples": self.samples}

    def load(self, state: Mapping[str, Any], origin: str | None) -> None:
        """Continue from a `ReplayBuffer.state_dict` of this learner: rows committed since it was
        taken reach the sampler as new rows. Raises ValueError (CorruptBufferError naming
        ``origin``) for a state of another buffer, or newer than what the shards hold."""
        try:
            total = self._check(state)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            if origin is None:
                raise ValueError(f"state for {self.union.url!r} does not fit this buffer: {exc}") from None
            raise CorruptBufferError(f"{origin}: {exc}") from None
        self.rng.bit_generator.state = state["rng"]
        load_sampler_state(self.sampler, state["sampler"])
        self.samples = int(state["samples"])
        announce(self.sampler, self.union.window()[0], total, self.union.total)

    def _check(self, state: Mapping[str, Any]) -> np.ndarray:
        if not isinstance(state, Mapping) or "total" not in state:
            raise ValueError("expected the mapping ReplayBuffer.state_dict() returns (with 'total')")
        total, have = np.asarray(state["total"]), self.union.total
        if total.shape != have.shape or total.dtype.kind not in "iu" or (total > have).any() or (total < 0).any():
            raise ValueError(f"'total': expected at most {have.tolist()} steps per lane (what the shards hold), "
                             f"got {total.tolist()}")
        check_rng_state(state.get("rng"))
        check_sampler_state(self.sampler, state.get("sampler"), self.union.layout, total)
        samples = state.get("samples")
        if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 0:
            raise ValueError(f"'samples': expected an int >= 0, got {samples!r}")
        return total


@dataclass(frozen=True)
class ShardCommit:
    """A commit of one shard as a learner adopted it: its record, the shard's episode ends and
    ``next_*`` values saved with it (checked), and the record of its ``derive_next`` side store."""

    record: CommitRecord
    state: dict[str, Any]
    finals: CommitRecord | None


@dataclass(frozen=True)
class ShardCommits:
    """Shard commits a learner adopted (`ReplayBuffer.shard_commits`), by shard: small and
    picklable, so that one learner rank reads the shards and the others adopt exactly what it did
    (`ReplayBuffer.refresh` with ``commits``)."""

    shards: dict[int, ShardCommit]


class ShardAdoption:
    """A learner adopting every shard's newest commit: rows, episode ends and ``next_*`` values."""

    def __init__(self, union: UnionStorage, finals: UnionStorage | None, sampler: Sampler, view: RowView):
        self.union, self.finals, self.sampler, self.view = union, finals, sampler, view
        self.episodes, self.returns = view.episodes, view.returns
        self.shard_envs = union.layout.num_envs // union.shards
        self.shard_index = EpisodeIndex(self.shard_envs, view.episodes.end_fields)
        self.shard_states: list[dict[str, Any]] = [{} for _ in range(union.shards)]

    def start(self, states: list[tuple[CommitRecord, Mapping[str, Any]]]) -> None:
        """At open: the states of the commits the shards show; every readable row is new."""
        for s, (record, state) in enumerate(states):
            self.shard_states[s] = self._parse(s, record, state)
        self._apply()
        lo, hi = self.union.window()
        announce(self.sampler, lo, lo, hi)

    def refresh(self) -> bool:
        """Adopt each shard's newest commit, all together or not at all. Returns whether any
        shard had a newer one. Raises CorruptBufferError naming the shard's object (nothing changed).

        Reads which shards committed (`UnionStorage.committed_shards`: one listing of the commit
        index), then only those shards' newest commit and its state."""
        shown = self.union.shard_records()
        candidates = self.union.committed_shards()
        loaded = self.union.shard_states(candidates) if candidates else []
        newer = {s: (record, self._parse(s, record, state)) for s, (record, state) in zip(candidates, loaded)
                 if not record.same_as(shown[s])}
        if not newer:
            return False
        finals = self.finals.shard_records(newest=True, shards=list(newer)) if self.finals is not None else []
        self._adopt({s: ShardCommit(record, parsed, finals[i] if finals else None)
                     for i, (s, (record, parsed)) in enumerate(newer.items())})
        return True

    def commits(self, shards: Sequence[int] | None = None) -> ShardCommits:
        """The commits of ``shards`` (default: all) this learner shows now (nothing is read)."""
        shards = range(self.union.shards) if shards is None else shards
        records, finals = self.union.shard_records(), self.finals.shard_records() if self.finals else None
        return ShardCommits({s: ShardCommit(records[s], self.shard_states[s], finals[s] if finals else None)
                             for s in shards})

    def adopt(self, commits: ShardCommits) -> bool:
        """Adopt those of ``commits`` newer than what the shards show, as `refresh` adopts the
        commits it reads (nothing is read). Returns whether any was newer."""
        shown = self.union.shard_records()
        newer = {s: ShardCommit(dataclasses.replace(c.record), c.state,  # copies: their cursors read-only
                                dataclasses.replace(c.finals) if c.finals else None)
                 for s, c in commits.shards.items() if c.record.sequence > shown[s].sequence}
        if not newer:
            return False
        self._adopt(newer)
        return True

    def _adopt(self, newer: Mapping[int, ShardCommit]) -> None:
        """These shards' commits adopted: rows, episode ends, ``next_*`` values, the sampler's rows."""
        before, last_ends, ended = self.union.total.copy(), self.episodes.last_ends(), self.episodes.ended()
        self.union.adopt_shards({s: c.record for s, c in newer.items()})
        if self.finals is not None:
            self.finals.adopt_shards({s: c.finals for s, c in newer.items() if c.finals})
        for s, commit in newer.items():
            self.shard_states[s] = commit.state
        self._apply()
        if self.finals is not None:
            forget_named_finals(self.finals, ended, self.episodes.ended())
        announce(self.sampler, self.union.window()[0], before, self.union.total)
        for lane, first, end in self.view.patched_since(before, last_ends):  # cached copies are stale
            self.union.forget_cached(lane, first, end)

    def _parse(self, shard: int, record: CommitRecord, state: Mapping[str, Any]) -> dict[str, Any]:
        """A shard's saved episode ends and ``next_*`` values, checked (the rest is its writer's)."""
        origin = state_origin(shard_url(self.union.url, shard), record)
        try:
            episodes = self.shard_index.check_state(state["episodes"], record.committed) if state else None
            last_next = state.get("last_next") or {}
            lanes = self.shard_envs
            for twin, want in self.view.last_next.items():
                value = last_next.get(twin)
                shape = (lanes, *want.shape[1:])
                if not isinstance(value, np.ndarray) or value.shape != shape or value.dtype != want.dtype:
                    raise ValueError(f"'last_next.{twin}': expected {want.dtype} shaped {shape}, "
                                     f"got {getattr(value, 'dtype', type(value).__name__)}")
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            raise CorruptBufferError(f"{origin}: {exc}") from None
        return {"episodes": episodes, "last_next": last_next}

    def _apply(self) -> None:
        """Load the union's episode index and ``next_*`` values from every shard's."""
        if self.episodes.enabled:
            plains = [self._episodes_of(state) for state in self.shard_states]
            self.episodes.load_state_dict({
                "end_fields": list(self.episodes.end_fields),
                "count": np.concatenate([p["count"] for p in plains]),
                "pruned": np.concatenate([p["pruned"] for p in plains]),
                "ends": np.concatenate([p["ends"] for p in plains])})
        for twin, value in self.view.last_next.items():
            for s, state in enumerate(self.shard_states):
                if twin in state["last_next"]:
                    value[s * self.shard_envs:(s + 1) * self.shard_envs] = state["last_next"][twin]

    def _episodes_of(self, state: Mapping[str, Any]) -> Mapping[str, Any]:
        episodes: Mapping[str, Any] | None = state.get("episodes")
        if episodes is not None:
            return episodes
        lanes = self.shard_envs
        return {"count": np.zeros(lanes, np.int64), "pruned": np.zeros(lanes, np.int64), "ends": np.zeros(0, np.int64)}



class LearnerRank:
    """One of several learner ranks that keep one sampling state (`ReplayBuffer.learner_rank`,
    for ``diskreplay.torch.DistributedLearner``): the steps of `ReplayBuffer.sample` and
    `ReplayBuffer.refresh` taken apart, so that the ranks can agree between them. Nothing here
    adopts a commit on its own (a stale read raises), and only the rank asked to publishes the
    learner's progress."""

    def __init__(self, state: LearnerState, follower: Follower, gate: LearnerGate, view: RowView):
        self.state, self.follower, self.gate, self.view = state, follower, gate, view
        self.shards: ShardAdoption = follower.adoption  # type: ignore[assignment]  # a learner's

    @property
    def limiter(self) -> RateLimiter | None:
        """The rate limiter the buffer was opened with."""
        return self.gate.limiter

    def allowed(self, count: int) -> bool:
        """Whether ``count`` more rows may be sampled now (always, without a rate limiter)."""
        limiter, state = self.gate.limiter, self.state
        return limiter is None or limiter.sample_allowed(int(state.union.total.sum()), state.samples, count)

    def publish(self) -> None:
        """Publish the learner's progress now (for actors waiting on it), if rate limited."""
        if self.gate.limiter is not None:
            self.gate.publish(force=True)

    def refresh(self) -> ShardCommits:
        """Adopt every shard's newest commit (`ReplayBuffer.refresh`); the commits that changed."""
        before = self.state.union.shard_records()
        self.follower.refresh()
        after = self.state.union.shard_records()
        return self.shards.commits([s for s, record in enumerate(after) if not record.same_as(before[s])])

    def draw(self, count: int, options: Mapping[str, Any]) -> Draw:
        """``count`` rows drawn as `ReplayBuffer.sample` draws them. Raises EmptyBufferError."""
        union = self.state.union
        lo, hi = union.window()
        if is_empty(lo, hi):
            raise EmptyBufferError(f"cannot sample from an empty buffer ({union.url!r} holds 0 readable rows)")
        return self.state.sampler.sample(self.state.rng, count, lo, hi, **options)

    def gather(self, draw: Draw, part: slice) -> dict[str, np.ndarray]:
        """The rows ``part`` of ``draw``, with their ``index`` (and ``weight``, extras). Raises
        StaleReadError (adopting nothing) if a writer overwrote any."""
        lane, step = draw.lane[part], draw.step[part]
        batch = self.view.gather(lane, step)
        batch["index"] = row_ids(lane, step, self.state.union.layout.num_envs)
        if draw.weight is not None:
            batch["weight"] = draw.weight[part]
        batch.update({name: value[part] for name, value in draw.extra.items()})
        return batch

    def count(self, rows: int, publish: bool) -> None:
        """``rows`` were sampled (by all ranks together): counted, and published if ``publish``."""
        if publish:
            self.gate.after(rows)
        else:
            self.state.samples += rows
