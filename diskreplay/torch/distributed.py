"""`DistributedLearner`: torch.distributed data-parallel learner ranks that keep one sampling state.

Every rank opens the sharded buffer as a learner (``dr.ReplayBuffer.open(url, "r", sampler=...,
rate_limiter=...)``) and wraps it. The ranks then hold the same state after every call, bit for
bit, because they take the same steps on the same data:

* `DistributedLearner.refresh`: rank 0 adopts the shards' newest commits and broadcasts what it
  adopted; the other ranks adopt exactly that (`ReplayBuffer.refresh` with ``commits``), reading
  no commit of their own.
* `DistributedLearner.sample`: every rank draws the whole global batch's row ids from the same
  generator and sampler state, and reads only its part (rank ``r`` of ``W``: rows
  ``[r * B / W, (r + 1) * B / W)``). The rate limiter counts the global batch once; rank 0 alone
  publishes the learner's progress. If the limiter holds the batch back, the ranks wait together,
  refreshing together; a stale read on any rank makes all of them refresh and draw again.
* `DistributedLearner.update_priorities`: the ranks' row ids and TD errors are all-gathered and
  every rank applies all of them, in rank order.

Calls are collective: every rank of the group makes the same calls in the same order. They pass
Python objects (``broadcast_object_list``, ``all_gather_object``): with NCCL, set each rank's CUDA
device first, as those need.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..buffer.learner import ShardCommit, ShardCommits
from ..buffer.output_format import output_converter
from ..buffer.replay_buffer import ReplayBuffer, Rows
from ..errors import RateLimitTimeout, StaleReadError


class DistributedLearner:
    """A learner rank of a torch.distributed group: one sampling state on every rank.

    Args:
        buffer: this rank's learner of the sharded buffer, opened read-only (``mode="r"``) with
            the same ``sampler`` and ``rate_limiter`` on every rank.
        group: the process group of the learner ranks (default: the default group).

    At construction the ranks adopt the newest commit each shard shows on any rank, then every
    rank loads rank 0's `ReplayBuffer.state_dict` (generator, priorities, rows sampled): seeds
    need not match, and a snapshot loaded by rank 0 (or by every rank) restores every rank.

    Raises ValueError for a buffer that is not a learner of a sharded buffer.
    """

    def __init__(self, buffer: ReplayBuffer, group: dist.ProcessGroup | None = None):
        self.buffer, self.group = buffer, group
        self.learner = buffer.learner_rank()
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._src = 0 if group is None else dist.get_global_rank(group, 0)
        self._align()

    def _align(self) -> None:
        """Every rank: the newest commit of each shard any rank shows, then rank 0's state."""
        shown: list[Any] = [None] * self.world_size
        dist.all_gather_object(shown, self.buffer.shard_commits(), group=self.group)
        newest: dict[int, ShardCommit] = {}
        for commits in shown:
            for s, commit in commits.shards.items():
                if s not in newest or commit.record.sequence > newest[s].record.sequence:
                    newest[s] = commit
        self.buffer.refresh(commits=ShardCommits(newest))
        self.buffer.load_state_dict(self._from_rank0(self.buffer.state_dict() if self.rank == 0 else None))

    def _from_rank0(self, value: Any) -> Any:
        """``value`` as rank 0 passed it (a broadcast: every rank calls this)."""
        box = [value]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]

    def refresh(self) -> bool:
        """Adopt the shards' newest commits on every rank: rank 0 reads them, the others adopt
        what it adopted. Returns whether any shard had a newer commit.

        Raises CorruptBufferError for a damaged commit (on every rank: rank 0's error, passed on).
        """
        return self._sync(False)[0]

    def _sync(self, stop: bool) -> tuple[bool, bool]:
        """`refresh`, and rank 0's ``stop`` (whether to give up waiting) passed to every rank."""
        sent: tuple[Any, bool] | None = None
        if self.rank == 0:
            try:
                sent = (self.learner.refresh(), stop)
            except Exception as exc:  # every rank raises it, none waits for rank 0
                sent = (exc, stop)
        commits, stop = self._from_rank0(sent)
        if isinstance(commits, Exception):
            raise commits
        if self.rank != 0:
            self.buffer.refresh(commits=commits)
        return bool(commits.shards), stop

    def sample(self, batch_size: int, *, beta: float | None = None, recent_rows: int | None = None,
               format: str = "numpy") -> Rows | Any:
        """This rank's part of a global batch of ``batch_size`` rows (plain transitions, as
        `ReplayBuffer.sample` draws them with ``beta`` and ``recent_rows``): rows
        ``[rank * n, (rank + 1) * n)`` of the batch, ``n = batch_size // world_size``, with their
        ``index`` (and ``weight`` with a prioritized sampler and ``beta``). The rate limiter
        counts ``batch_size``. ``format``: as in `ReplayBuffer.sample`.

        Raises:
            ValueError: ``batch_size`` not a multiple of the world size; an unknown ``format``.
            RateLimitTimeout: the limiter held the batch back for its ``timeout_s`` (rank 0's clock).
            StaleReadError: writers kept overwriting the rows drawn for the buffer's ``retry.budget_s``.
            EmptyBufferError: the buffer holds no rows.
        """
        convert = output_converter(format)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < self.world_size or batch_size % self.world_size:
            raise ValueError(f"batch_size: expected a multiple of the world size {self.world_size}, got {batch_size!r}")
        batch_size = int(batch_size)
        options = {k: v for k, v in (("beta", beta), ("recent_rows", recent_rows)) if v is not None}
        self._wait(batch_size)
        part = slice(self.rank * (batch_size // self.world_size), (self.rank + 1) * (batch_size // self.world_size))
        deadline = time.monotonic() + self.buffer.retry.budget_s
        while True:
            draw = self.learner.draw(batch_size, options)
            try:
                rows, stale = self.learner.gather(draw, part), 0
            except StaleReadError:
                rows, stale = {}, 1
            if not self._any(stale):
                break
            if self._sync(time.monotonic() > deadline)[1]:
                raise StaleReadError(f"{self.buffer.url!r}: writers kept overwriting the rows drawn for "
                                     f"{self.buffer.retry.budget_s:g} s (retry.budget_s)")
        self.learner.count(batch_size, publish=self.rank == 0)
        return convert(rows)

    def _any(self, flag: int) -> bool:
        """Whether ``flag`` is set on any rank."""
        flags: list[Any] = [None] * self.world_size
        dist.all_gather_object(flags, flag, group=self.group)
        return any(flags)

    def _wait(self, count: int) -> None:
        """Return once the rate limiter lets ``count`` rows be sampled, all ranks together."""
        limiter = self.learner.limiter
        if limiter is None or self.learner.allowed(count):
            return
        if self.rank == 0:
            self.learner.publish()
        deadline = time.monotonic() + limiter.timeout_s
        while not self.learner.allowed(count):
            time.sleep(limiter.poll_s)
            if self._sync(time.monotonic() > deadline)[1]:
                raise RateLimitTimeout(f"sample({count}) waited {limiter.timeout_s:g} s for the rate limiter "
                                       f"(samples_per_insert={limiter.samples_per_insert:g}, "
                                       f"min_size={limiter.min_size}, error_buffer={limiter.error_buffer:g})")

    def update_priorities(self, index: Any, td_errors: Any) -> int:
        """Set priorities from every rank's TD errors: the ranks' ``index`` (row ids, e.g. this
        rank's ``batch["index"]``) and ``td_errors`` are all-gathered and applied on every rank
        in rank order (`ReplayBuffer.update_priorities`). Returns the rows updated (all ranks').

        Raises as `ReplayBuffer.update_priorities` (on every rank, for any rank's bad values)."""
        mine = (_numpy(index), _numpy(td_errors))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.group)
        ids = np.concatenate([np.ravel(i) for i, _ in gathered])
        return self.buffer.update_priorities(ids, np.concatenate([np.ravel(t) for _, t in gathered]))

    def publish(self) -> None:
        """Rank 0 publishes the learner's progress now, if rate limited (it does so at most every
        50 ms while sampling): after the last step, for actors waiting on the last count. Not
        collective: the other ranks do nothing."""
        if self.rank == 0:
            self.learner.publish()

    def state_dict(self) -> dict[str, Any]:
        """The learners' state (`ReplayBuffer.state_dict`), the same on every rank."""
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` on every rank: rank 0's ``state`` is passed to the others (theirs
        is ignored). Raises ValueError as `ReplayBuffer.load_state_dict`."""
        self.buffer.load_state_dict(self._from_rank0(state if self.rank == 0 else None))

    def save_snapshot(self, directory: str | os.PathLike[str]) -> None:
        """Rank 0 writes `ReplayBuffer.save_snapshot` to ``directory``; every rank returns once
        it is written. Open it again with ``dr.ReplayBuffer.load_snapshot(directory, mode="r", ...)``
        on rank 0 (or every rank) and wrap that in a new `DistributedLearner`."""
        if self.rank == 0:
            self.buffer.save_snapshot(directory)
        dist.barrier(group=self.group)


def _numpy(value: Any) -> np.ndarray:
    """A tensor (any device) or array-like as a numpy array."""
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
