"""`UnionStorage`: the shards of a sharded buffer read together by a learner, as one read-only
storage whose lanes are theirs side by side; its log, `UnionLog`, holds the shards' logs.

Lane ``e`` of shard ``s`` is lane ``s * num_envs + e`` of the union (`open_union_storage`), so
samplers, the episode index and the transforms work on the union unchanged, a slice or an n-step
window never leaves one shard, and the union's rows are read through one cache and one read path.
The union's commit record is composed from the shards' (`compose`); each shard keeps its own log
(its commits, state objects and journals). Where the root declares a commit index, the shards'
writers announce each commit in it (`CommitIndex`) and a refresh lists it once to learn which
shards committed, instead of reading every shard's record.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

import numpy as np

from ..errors import ClosedError, ReadOnlyError
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.lanes import LaneLayout
from ..format.shards import index_name, index_sequences
from ..io.store import ChunkStore
from ..io.threads import Threads
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .commit_log import CommitLog
from .cursors import Cursors
from .facade import Storage
from .file_maps import FileMaps
from .loading import ChunkLoader
from .ragged_reads import RaggedReads
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


class CommitIndex:
    """The commit index of a sharded buffer (`diskreplay.format.shards`): ``store`` holds only its
    names, so one listing of it tells every shard's newest announced sequence."""

    def __init__(self, store: ChunkStore, count: int):
        self.store, self.count = store, count
        self._announced: dict[int, int] = {}  # per shard: the name this writer put last (-1: none yet)

    def sequences(self) -> dict[int, int]:
        """``{shard: newest sequence announced}`` (one listing; shards never announced are absent)."""
        return index_sequences(self._names(), self.count)

    def _names(self) -> list[str]:
        """The names in the index: one listing (locally, of a directory whose files writers
        replace meanwhile: names only, no sizes that a deleted file would lack)."""
        if not self.store.supports_mmap:
            return list(self.store.sizes())
        try:
            return os.listdir(os.path.dirname(self.store.path("name")))
        except FileNotFoundError:  # no shard announced a commit yet
            return []

    def of_shard(self, shard: int) -> ShardAnnouncer:
        """The `Announcer` of the writer of ``shard``."""
        return ShardAnnouncer(self, shard)

    def start(self, shard: int, sequence: int) -> None:
        """The writer of ``shard``, opened at commit ``sequence``: announce it (an announcement
        of a commit that was never made may be ahead of it) and delete every other name of it."""
        ours = [name for name in self._names() if index_sequences([name], self.count).keys() == {shard}]
        self._announced[shard] = -1
        self.announce(shard, sequence, ours)

    def announce(self, shard: int, sequence: int, older: Sequence[str] | None = None) -> None:
        """Before commit ``sequence`` of ``shard`` (or at its writer's open): put its name, then
        delete the one put before (or ``older``). Raises what the store raises: the commit is
        then not made (a name ahead of the commits only makes refreshes read that shard's)."""
        name, before = index_name(shard, sequence), self._announced.get(shard, -1)
        stale = [n for n in (older or []) if n != name]
        if before >= 0 and before != sequence:
            stale.append(index_name(shard, before))
        if name not in (older or []):
            self.store.put(name, b"")
        self._announced[shard] = sequence
        for old in stale:
            self.store.delete(old)


class ShardAnnouncer:
    """A shard writer's `Announcer`: its commits announced in the root's `CommitIndex`."""

    def __init__(self, index: CommitIndex, shard: int):
        self.index, self.shard = index, shard

    def start(self, sequence: int) -> None:
        self.index.start(self.shard, sequence)

    def announce(self, sequence: int) -> None:
        self.index.announce(self.shard, sequence)


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

    def read_newest_of(self, lanes: np.ndarray) -> CommitRecord:
        """The union's record with the newest commit of the shards holding ``lanes`` (union
        lanes), the others' as shown: one small read per shard of those lanes."""
        shards = np.unique(np.asarray(lanes) // self.shard_envs).tolist()
        newest = self.each(CommitLog.read_newest, [self.logs[s] for s in shards])
        return self.with_shards(dict(zip(shards, newest)))

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
                 loader: ChunkLoader, reader: ChunkReader, files: FileMaps, ragged: RaggedReads | None,
                 storage_options: Mapping[str, Any] | None, index: CommitIndex | None = None):
        super().__init__(url, config, log, io, cache, loader, reader, files, ragged, storage_options)
        self._log = log
        self.index = index
        """The root's commit index, if it declares one."""

    def committed_shards(self) -> list[int]:
        """The shards whose newest commit may be newer than the one shown: from one listing of
        the commit index, or (a root without one) from every shard's newest record."""
        shown = self.shard_records()
        if self.index is None:
            newest = self.shard_records(newest=True)
            return [s for s, record in enumerate(newest) if not record.same_as(shown[s])]
        announced = self.index.sequences()
        return [s for s, record in enumerate(shown) if announced.get(s, -1) > record.sequence]

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

    def adopt(self, record: CommitRecord) -> None:
        """Follow ``record`` (see `Storage.adopt`). A lane's tail chunk that the cache holds, with
        rows appended to it since, is patched rather than dropped: the appended rows are read as
        one byte range per field, all lanes' ranges at once, when every cached field is stored
        raw (a compressed chunk cannot be read in part: it is dropped, and read whole when needed)."""
        self._reader.ahead.drop()
        shown, rows = self._log.record, self.layout.chunk_rows
        patched = patch_tails(self._cache, self._io, self.layout, shown.committed, record.committed)
        for lane in np.flatnonzero(shown.committed != record.committed).tolist():
            old, new = sorted((int(shown.committed[lane]), int(record.committed[lane])))
            first = old - old % rows
            if lane in patched:  # its steps up to the end of the patched chunk are right
                self._files.forget(lane, np.array([patched[lane]]))  # a map of it shows the old file
                first = old + self.layout.piece_length(old, new - old)
            if first < int(record.committed[lane]):
                self.forget_cached(lane, first, int(record.committed[lane]))
        self._log.adopt(record)
        self._cache.ensure_chunks(self.layout.chunks_per_lane(int(record.committed.max(initial=0))))

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


def patch_tails(cache: ChunkCache, io: ChunkIO, layout: LaneLayout, shown: np.ndarray,
                newest: np.ndarray) -> dict[int, int]:
    """Write into ``cache`` the rows each lane appended, from ``shown`` to ``newest`` steps, to a
    cached chunk holding its committed rows in part (all fields raw). Returns ``{lane: chunk}``
    patched: those slots hold every row of the newest commit in that chunk."""
    if not cache.slabs or not all(io.codecs[name].raw and io.codecs[name].inner_rows is None for name in cache.slabs):
        return {}
    plans: list[tuple[int, int, int, int, int]] = []  # lane, chunk, slot, first row, rows
    for lane in np.flatnonzero(newest > shown).tolist():
        old, new = int(shown[lane]), int(newest[lane])
        chunk, offset = (int(v) for v in layout.chunk_and_offset(np.array(old)))
        if offset == 0 or (layout.lane_capacity is not None and new - (old - offset) > layout.lane_capacity):
            continue  # nothing of it cached in part, or the new rows come round to it again
        slot = cache.slot_of(lane, chunk)
        if slot >= 0 and not cache.is_pinned(slot) and not cache.is_partial(slot):
            plans.append((lane, chunk, slot, offset, layout.piece_length(old, new - old)))
    ranges = [(io.key(name, lane, chunk), first * f.row_bytes, (first + count) * f.row_bytes)
              for lane, chunk, _, first, count in plans for name, f in ((n, io.schema[n]) for n in cache.slabs)]
    got = iter(io.store.get_ranges(ranges) if ranges else [])
    patched = {}  # not from a short range, nor from an object without its chunk's size: that chunk is read whole
    for lane, chunk, slot, first, count in plans:
        values = {name: next(got) for name in cache.slabs}
        if all(v is not None and len(v[0]) == count * io.schema[n].row_bytes
               and v[1] in (layout.chunk_rows * io.schema[n].row_bytes + io.codecs[n].trailer, -1)
               for n, v in values.items()):
            cache.write_rows(slot, first, {n: np.frombuffer(v[0], io.schema[n].dtype).reshape(  # type: ignore[index]
                count, *io.schema[n].shape) for n, v in values.items()}, 0, count)
            patched[lane] = chunk
    return patched


def _newest_state(log: CommitLog) -> tuple[CommitRecord, dict[str, Any]]:
    return log.load_state(newest=True)
