"""`Storage`: one buffer's chunks and commits behind a small facade.

It composes the parts of this package and is all the layers above see of them: a `CommitLog`
(what is committed), a `StagingWriter` (staged rows, whole-chunk writes), a `ChunkReader` (the
read paths) over one `ChunkCache`, and the `ChunkIO` they share. Not thread-safe: one writer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ..errors import ClosedError
from ..format.codecs import Codec
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..io.store import ChunkStore
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .commit_log import CommitLog
from .file_maps import FileMaps
from .loading import ChunkLoader
from .mapped import MappedChunks
from .outputs import Rows
from .reader import ChunkReader
from .row_reads import RowReads
from .union import UnionLog, compose
from .writer import StagingWriter

T = TypeVar("T")


@dataclass(frozen=True)
class StorageStats:
    """What a storage holds and did, for tools and tests. Counts, not timings."""

    chunk_rows: int
    cache_slots: int
    cached_chunks: int
    chunks_loaded: int
    """Chunks read from the store into the cache since open."""
    mapped: bool
    """Whether raw chunk files are read through memory maps."""
    maps: int
    """Chunk files mapped now (0 without memory maps)."""
    row_fields: dict[str, int]
    """Fields read row by row (sharded images): their rows per inner chunk."""
    resident: bool
    """Whether the cache holds the whole window in lane-major order (slab rows found from steps)."""
    commit_sequence: int
    stale_reads: int
    """Reads refused (`StaleReadError`) because the writer had overwritten rows they asked for."""


class Storage:
    """The chunks, cache and commits of one buffer (`open_storage`, `create_storage`)."""

    def __init__(self, url: str, config: BufferConfig, log: CommitLog | UnionLog, io: ChunkIO, cache: ChunkCache,
                 loader: ChunkLoader, reader: ChunkReader, writer: StagingWriter | None, files: FileMaps,
                 storage_options: Mapping[str, Any] | None):
        self.url = url
        self.config = config
        self.schema = config.schema
        self.layout = config.layout
        self.storage_options = storage_options
        self.log, self.io, self.cache, self.loader = log, io, cache, loader
        self.reader, self.writer = reader, writer
        self.files = files

    # ---- what it is ------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self.log.mode

    @property
    def closed(self) -> bool:
        return self.log.closed

    @property
    def store(self) -> ChunkStore:
        return self.io.store

    @property
    def record(self) -> CommitRecord:
        """The commit this storage shows (a reader's adopted one, a writer's last)."""
        return self.log.record

    @property
    def total(self) -> np.ndarray:
        """Per lane, steps added (a reader: committed). The live array: do not write into it."""
        return self.log.cursors.total

    @property
    def codecs(self) -> dict[str, Codec]:
        """The codec of each stored field's chunks."""
        return self.io.codecs

    def chunk_key(self, name: str, lane: int, chunk: int) -> str:
        return self.io.key(name, lane, chunk)

    def read_chunk(self, name: str, lane: int, chunk: int) -> np.ndarray:
        """One whole stored chunk of one field, decoded (``[chunk_rows, *shape]``), bypassing the
        cache. Raises CorruptBufferError if it is missing or does not decode."""
        field = self.schema[name]
        rows = np.empty((self.layout.chunk_rows, *field.shape), field.dtype)
        self.io.read([(self.io.key(name, lane, chunk), self.io.codecs[name], rows)], must_exist=True)
        return rows

    @property
    def mapped(self) -> MappedChunks | None:
        """The memory maps of raw chunk files (None: rows are read through the cache)."""
        return self.files.mapped

    @property
    def row_reads(self) -> RowReads | None:
        """The row-by-row reads of sharded fields (None: chunks are read whole)."""
        return self.files.row_reads

    def stats(self) -> StorageStats:
        row_fields = self.row_reads.names if self.row_reads is not None else ()
        return StorageStats(
            self.layout.chunk_rows, self.cache.slots, self.cache.cached_chunks(), self.loader.chunks_loaded,
            self.mapped is not None, self.mapped.maps if self.mapped is not None else 0,
            {name: int(self.io.codecs[name].inner_rows or 0) for name in row_fields},
            self.reader.warmer.resident_span is not None, self.log.record.sequence, self.reader.retired.stale_reads)

    # ---- windows ---------------------------------------------------------------------------

    def committed_window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the steps ``[lo, hi)`` of the last commit: what a reader would see."""
        return self.log.cursors.window_of(self.log.record.committed)

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the readable steps ``[lo, hi)``: everything added (writer) or committed (reader)."""
        return self.log.cursors.window()

    # ---- reads -----------------------------------------------------------------------------

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: Mapping[str, np.ndarray] | None = None) -> Rows:
        """Rows at (lane, step) of every field (or of ``names``): arrays with leading axis ``len(step)``.

        ``out`` may hold, for some of those fields, C-contiguous arrays of exactly that shape and
        the field's dtype: their rows are gathered straight into them (no extra copy), and they
        are what is returned for those fields. The caller guarantees the steps lie inside `window`.

        Raises:
            StaleReadError: a ring reader's rows were overwritten since its commit; nothing was adopted.
            CorruptBufferError: a chunk the commit covers is missing, short or fails its checksum.
            ClosedError: the storage was closed.
        """
        if self.log.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        if self.writer is not None and self.writer.reads.old:
            self.writer.reads.merge()
        return self.reader.gather(lane, step, names, out)

    def read_newest(self) -> CommitRecord:
        """The newest commit record in the store (validated)."""
        return self.log.read_newest()

    def load_state(self, newest: bool) -> tuple[CommitRecord, dict[str, Any]]:
        """The commit this storage shows (or the store's ``newest``) and the state saved with it.
        Raises TypeError for the union of a sharded buffer's shards (each shard has its state)."""
        if not isinstance(self.log, CommitLog):
            raise TypeError(f"{self.url!r}: the union of a sharded buffer's shards has no state of its own")
        return self.log.load_state(newest)

    # ---- shards: a learner reads a sharded buffer's shards as one storage -------------------

    @property
    def sharded(self) -> bool:
        """Whether this storage reads the shards of a sharded buffer together (read-only)."""
        return isinstance(self.log, UnionLog)

    @property
    def shards(self) -> int:
        """Shards read together (1: one buffer)."""
        return len(self._logs())

    def shard_records(self, newest: bool = False, shards: Sequence[int] | None = None) -> list[CommitRecord]:
        """The commit each shard (or each of ``shards``) shows, or its ``newest`` in the store
        (read all at once)."""
        logs = self._logs() if shards is None else [self._logs()[s] for s in shards]
        return self._each(CommitLog.read_newest, logs) if newest else [log.record for log in logs]

    def shard_states(self, shards: Sequence[int]) -> list[tuple[CommitRecord, dict[str, Any]]]:
        """The newest commit of each of ``shards`` and the state saved with it (see `load_state`)."""
        logs = self._logs()
        return self._each(_newest_state, [logs[s] for s in shards])

    def adopt_shards(self, records: Mapping[int, CommitRecord]) -> None:
        """Reader: show ``records[s]``, a newer commit of shard ``s`` (see `adopt`)."""
        logs = self._logs()
        self.adopt(compose([records.get(s, log.record) for s, log in enumerate(logs)]))
        for s, record in records.items():
            logs[s].adopt(record)

    def _logs(self) -> list[CommitLog]:
        return self.log.logs if isinstance(self.log, UnionLog) else [self.log]

    def _each(self, call: Callable[[CommitLog], T], logs: Sequence[CommitLog] | None = None) -> list[T]:
        if isinstance(self.log, UnionLog):
            return self.log.each(call, logs)
        return [call(log) for log in (logs if logs is not None else [self.log])]

    def adopt(self, record: CommitRecord) -> None:
        """Reader: follow ``record``, dropping cached or mapped chunks it may have rewritten."""
        for lane in np.flatnonzero(self.log.record.committed != record.committed).tolist():
            old = min(int(self.log.record.committed[lane]), int(record.committed[lane]))
            self.forget_cached(lane, old - old % self.layout.chunk_rows, int(record.committed[lane]))
        self.log.adopt(record)
        self.cache.ensure_chunks(self.layout.chunks_per_lane(int(record.committed.max(initial=0))))

    def forget_cached(self, lane: int, first: int, end: int) -> None:
        """Reader: cached or mapped copies of steps ``[first, end)`` are out of date (rewritten by
        the writer, or a field of them patched after they were committed: episodic returns)."""
        chunks = self.layout.chunks_between(first, end)
        self.cache.invalidate(lane, chunks)
        self.files.forget(lane, chunks)
        self.reader.warmer.reset()

    # ---- writes ----------------------------------------------------------------------------

    def require_writable(self) -> None:
        """Raises ClosedError, LockedError (this writer lost its lock) or ReadOnlyError."""
        self.log.require_writable()

    def _writable(self) -> StagingWriter:
        self.log.require_writable()
        assert self.writer is not None
        return self.writer

    def append(self, lane: int, rows: Mapping[str, np.ndarray], count: int) -> tuple[int, int]:
        """Stage ``count`` steps for one lane; the steps stored ``[first, end)`` (`StagingWriter.append`)."""
        return self._writable().append(lane, rows, count)

    def unappend(self, lane: int, start: int, attempted_end: int) -> None:
        """Forget steps a failed call staged or wrote (`StagingWriter.unappend`)."""
        self._writable().unappend(lane, start, attempted_end)

    def update_rows(self, lane: int, first: int, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite fields of steps already added (`StagingWriter.update_rows`)."""
        self._writable().update_rows(lane, first, values)

    def rewind(self, total: np.ndarray) -> None:
        """Writer, right after open: forget steps at or after ``total`` per lane."""
        self._writable().rewind(total)

    def retire_all(self) -> None:
        """Writer: every row added so far stops being readable (at once for this writer, for
        readers at the next commit). Steps go on counting."""
        self._writable().settle(wait=True)
        self.log.cursors.lower = self.log.cursors.total.copy()

    def write_behind(self) -> None:
        """Start writing the full chunks waiting on the background thread (`StagingWriter.write_behind`)."""
        self._writable().write_behind()

    def settle(self) -> None:
        """Raise the error of a failed background write, once (`StagingWriter.settle`)."""
        self._writable().settle()

    def flush(self, durable: bool = True, state: dict[str, Any] | None = None,
              side: Storage | None = None) -> None:
        """Make everything added durable and visible, with ``state`` (None: keep the last).

        In this order: the state's arrays go to a new state object; the ``side`` storage (the
        ``derive_next`` store of final observations) commits; the sealed and every partial tail
        chunk are written (fsynced if ``durable``); a dataset's arrays grow; ``commit.json`` is
        replaced; the previous state object is deleted. If it raises, nothing new is committed
        and the rows stay staged."""
        writer = self._writable()
        writer.settle(wait=True)
        log = writer.log
        staged = log.stage_state(state, durable) if state is not None else None
        try:
            if side is not None:
                side.flush(durable)
            writer.write_all(durable)
            log.grow_arrays(int(log.cursors.total.max(initial=0)))
            log.commit(log.cursors.total.copy(), log.cursors.first_kept(), durable, staged)
        except BaseException:
            if staged is not None:
                log.discard(staged)
            raise
        log.collect_garbage()

    def close(self) -> None:
        """Release threads, maps and the writer lock (idempotent). Nothing is written."""
        if self.log.closed:
            return
        if self.writer is not None:
            self.writer.close()
        self.io.close()
        self.files.close()
        self.log.close()


def _newest_state(log: CommitLog) -> tuple[CommitRecord, dict[str, Any]]:
    return log.load_state(newest=True)
