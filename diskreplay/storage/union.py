"""`UnionStorage`: the shards of a sharded buffer read together by a learner, as one read-only
storage whose lanes are theirs side by side; its log, `UnionLog`, holds the shards' logs.

Lane ``e`` of shard ``s`` is lane ``s * num_envs + e`` of the union (`open_union_storage`), so
samplers, the episode index and the transforms work on the union unchanged, a slice or an n-step
window never leaves one shard, and the union's rows are read through one cache and one read path.
The union's commit record is composed from the shards' (`compose`); each shard keeps its own log
(its commits, state objects and journals).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np

from ..errors import ClosedError, ReadOnlyError
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.lanes import LaneLayout
from ..io.threads import Threads
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .commit_log import CommitLog
from .cursors import Cursors
from .facade import Storage
from .file_maps import FileMaps
from .loading import ChunkLoader
from .reader import ChunkReader

T = TypeVar("T")


def compose(records: Sequence[CommitRecord]) -> CommitRecord:
    """The union's record of the shards' ``records``: cursors side by side; its sequence (the
    sum of theirs) grows whenever any shard commits."""
    return CommitRecord(sum(r.sequence for r in records), np.concatenate([r.committed for r in records]),
                        np.concatenate([r.lower for r in records]), max(r.time for r in records))


def union_threads(shards: int) -> Threads:
    """The threads a union's per-shard reads run on (its metadata when it opens, the shards'
    newest commits when it refreshes): one per shard, at most 16."""
    return Threads(min(max(shards, 1), 16), "diskreplay-logs")


class UnionLog:
    """What a union storage knows of commits: the shards' logs, and the record composed of theirs."""

    mode = "r"

    def __init__(self, url: str, logs: Sequence[CommitLog], layout: LaneLayout, threads: Threads | None = None):
        self.url, self.logs = url, list(logs)
        self.shard_envs = layout.num_envs // len(self.logs)
        self.record = compose([log.record for log in self.logs])
        self.cursors = Cursors(layout, self.record.committed.copy(), self.record.lower.copy(), frozen=True)
        self.closed = False
        self._threads = threads or union_threads(len(self.logs))  # the threads that opened them, if given

    def require_writable(self) -> NoReturn:
        """Always raises: ClosedError, or ReadOnlyError (each shard has its own writer)."""
        if self.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        raise ReadOnlyError(f"{self.url!r} is a sharded buffer, read here as the union of its {len(self.logs)} "
                            f"shards (read-only); write with dr.ReplayBuffer.open_shard(url, shard=i)")

    def read_newest(self) -> CommitRecord:
        """The union's record of every shard's newest commit (one small read per shard)."""
        return compose(self.each(CommitLog.read_newest))

    def each(self, call: Callable[[CommitLog], T], logs: Sequence[CommitLog] | None = None) -> list[T]:
        """``call(log)`` for every shard's log (or ``logs``), all in flight at once on a remote
        store (a local read costs microseconds: one after the other)."""
        logs = self.logs if logs is None else logs
        if self.logs[0].store.supports_mmap or len(logs) < 2:
            return [call(log) for log in logs]
        return list(self._threads.map(call, logs))

    def with_shards(self, records: Mapping[int, CommitRecord]) -> CommitRecord:
        """The union's record once shard ``s`` shows ``records[s]`` (the others as now)."""
        return compose([records.get(s, log.record) for s, log in enumerate(self.logs)])

    def adopt(self, record: CommitRecord) -> None:
        """Follow ``record``, composed by `with_shards` of the records the shards' logs then adopt."""
        self.record = record
        self.cursors.follow(record.committed, record.lower)

    def close(self) -> None:
        self.closed = True
        self._threads.shutdown()
        for log in self.logs:
            log.close()


class UnionStorage(Storage):
    """The shards of a sharded buffer read as one storage, read-only (`open_union_storage`)."""

    sharded = True
    _log: UnionLog

    def __init__(self, url: str, config: BufferConfig, log: UnionLog, io: ChunkIO, cache: ChunkCache,
                 loader: ChunkLoader, reader: ChunkReader, files: FileMaps, storage_options: Mapping[str, Any] | None):
        super().__init__(url, config, log, io, cache, loader, reader, files, storage_options)
        self._log = log

    @property
    def shards(self) -> int:
        """Shards read together."""
        return len(self._log.logs)

    def shard_records(self, newest: bool = False, shards: Sequence[int] | None = None) -> list[CommitRecord]:
        logs = self._log.logs if shards is None else [self._log.logs[s] for s in shards]
        return self._log.each(CommitLog.read_newest, logs) if newest else [log.record for log in logs]

    def shard_states(self, shards: Sequence[int]) -> list[tuple[CommitRecord, dict[str, Any]]]:
        """The newest commit of each of ``shards`` and the state saved with it (`CommitLog.load_state`)."""
        return self._log.each(_newest_state, [self._log.logs[s] for s in shards])

    def adopt_shards(self, records: Mapping[int, CommitRecord]) -> None:
        """Show ``records[s]``, a newer commit of shard ``s`` (see `adopt`)."""
        self.adopt(self._log.with_shards(records))
        for s, record in records.items():
            self._log.logs[s].adopt(record)

    def append(self, lane: int, rows: Mapping[str, np.ndarray], count: int) -> tuple[int, int]:
        """Never done: raises ReadOnlyError (or ClosedError), as every write to the union. Here
        so that the union is a `RowStore` that `RowView` reads, as one buffer's storage is."""
        self._log.require_writable()

    def update_rows(self, lane: int, first: int, values: Mapping[str, np.ndarray]) -> None:
        """Never done: raises as `append`."""
        self._log.require_writable()


def _newest_state(log: CommitLog) -> tuple[CommitRecord, dict[str, Any]]:
    return log.load_state(newest=True)
