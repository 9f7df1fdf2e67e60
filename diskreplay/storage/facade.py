"""`Storage`: the read side of a buffer's chunks and commits, behind a small facade.

It composes the parts of this package and is all the layers above see of them: a `Log` (what is
committed), a `ChunkReader` (the read paths) over one `ChunkCache`, and the `ChunkIO` they
share. Two kinds share it: `BufferStorage`, one buffer (its writer, or a reader of it), and
`UnionStorage`, the shards of a sharded buffer read together by a learner. Not thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ClosedError
from ..format.codecs import Codec
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.ragged import decode_text, ends_name
from ..io.store import ChunkStore
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .file_maps import FileMaps
from .frames import FrameReads
from .loading import ChunkLoader
from .log import Log
from .mapped import MappedChunks
from .outputs import Rows
from .ragged_reads import RaggedReads
from .read_ahead import READ_AHEAD_BYTES, Steps
from .reader import ChunkReader
from .row_reads import RowReads


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
    chunks_read_ahead: int = 0
    """Of ``chunks_loaded``, those fetched and decoded ahead of the reads (`Storage.read_ahead`)."""
    rows_read_directly: int = 0
    """Rows read straight from their chunk objects, not through the cache (cold reads of raw fields)."""
    ranges_read: int = 0
    """Byte ranges those reads fetched (one request each on an object store; ranges of one
    object a page or less apart are read as one)."""



class Storage(ABC):
    """What every storage reads: chunks at (lane, step) through one cache, the commit it shows
    and its window, cached copies dropped when it follows a newer commit."""

    sharded = False
    """Whether this storage reads the shards of a sharded buffer together (read-only)."""

    def __init__(self, url: str, config: BufferConfig, log: Log, io: ChunkIO, cache: ChunkCache, loader: ChunkLoader,
                 reader: ChunkReader, files: FileMaps, ragged: RaggedReads | None,
                 storage_options: Mapping[str, Any] | None):
        self.url = url
        self.config = config
        self.schema = config.schema
        self.layout = config.layout
        self.storage_options = storage_options
        self._log, self._io, self._cache, self._loader = log, io, cache, loader
        self._reader, self._files = reader, files
        self._ragged = ragged
        encoded = {name: f for name, f in config.user_schema.items() if f.codec is not None}
        self._frames = FrameReads(encoded, self.layout, io.workers) if encoded else None

    # ---- what it is ------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self._log.mode

    @property
    def closed(self) -> bool:
        return self._log.closed

    @property
    def store(self) -> ChunkStore:
        return self._io.store

    @property
    def at_commit(self) -> int | None:
        """The commit a reader opened ``at_commit`` stays at (None: it follows the newest)."""
        return None

    @property
    def record(self) -> CommitRecord:
        """The commit this storage shows (a reader's adopted one, a writer's last)."""
        return self._log.record

    @property
    def total(self) -> np.ndarray:
        """Per lane, steps added (a reader: committed). The live array: do not write into it."""
        return self._log.cursors.total

    @property
    def codecs(self) -> dict[str, Codec]:
        """The codec of each stored field's chunks."""
        return self._io.codecs

    def chunk_key(self, name: str, lane: int, chunk: int) -> str:
        return self._io.key(name, lane, chunk)

    def read_chunk(self, name: str, lane: int, chunk: int) -> np.ndarray:
        """One whole stored chunk of one field, decoded (``[chunk_rows, *shape]``), bypassing the
        cache. Raises CorruptBufferError if it is missing or does not decode."""
        return self.read_chunks((name,), lane, np.array([chunk]))[name]

    def read_chunks(self, names: Sequence[str], lane: int, chunks: np.ndarray) -> dict[str, np.ndarray]:
        """Whole stored chunks ``chunks`` of one lane, of the fields ``names`` only, decoded and
        laid end to end: ``{name: [len(chunks) * chunk_rows, *shape]}``. Read at once (concurrent
        requests, decoded on the I/O threads), bypassing the cache; no other field is read.
        Raises CorruptBufferError if one is missing or does not decode; KeyError: an unknown name."""
        rows = self.layout.chunk_rows
        out = {name: np.empty((len(chunks) * rows, *self.schema[name].shape), self.schema[name].dtype)
               for name in names}
        self._io.read([(self._io.key(name, lane, chunk), self._io.codecs[name], out[name][i * rows:(i + 1) * rows])
                       for name in names for i, chunk in enumerate(np.asarray(chunks).tolist())], must_exist=True)
        return out

    @property
    def mapped(self) -> MappedChunks | None:
        """The memory maps of raw chunk files (None: rows are read through the cache)."""
        return self._files.mapped

    @property
    def row_reads(self) -> RowReads | None:
        """The row-by-row reads of sharded fields (None: chunks are read whole)."""
        return self._files.row_reads

    def stats(self) -> StorageStats:
        row_fields = self.row_reads.names if self.row_reads is not None else ()
        return StorageStats(
            self.layout.chunk_rows, self._cache.slots, self._cache.cached_chunks(), self._loader.chunks_loaded,
            self.mapped is not None, self.mapped.maps if self.mapped is not None else 0,
            {name: int(self._io.codecs[name].inner_rows or 0) for name in row_fields},
            self._reader.warmer.resident_span is not None, self._log.record.sequence,
            self._reader.retired.stale_reads, self._reader.ahead.started,
            *((points.rows_read, points.ranges_read) if (points := self._reader.points) is not None else (0, 0)))

    # ---- windows ---------------------------------------------------------------------------

    def committed_window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the steps ``[lo, hi)`` of the last commit: what a reader would see."""
        return self._log.cursors.window_of(self._log.record.committed)

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the readable steps ``[lo, hi)``: everything added (writer) or committed (reader)."""
        return self._log.cursors.window()

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
        if self._log.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        if self._ragged is None:
            return self._reader.gather(lane, step, names, out)
        names = tuple(self.config.user_schema.fields) if names is None else names
        if not any(name in self._ragged.fields for name in names):
            return self._reader.gather(lane, step, names, out)
        return self._gather_ragged(self._ragged, lane, step, names, out or {})

    def _gather_ragged(self, ragged: RaggedReads, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...],
                       out: Mapping[str, np.ndarray], decode: bool = True) -> Rows:
        """Rows with ragged fields: their ends (this row's and the previous row's of its chunk)
        with the fixed fields, then the values those ends delimit (`RaggedReads`); encoded frame
        fields decoded (`FrameReads`; ``decode=False``: their bytes)."""
        fields = self.config.user_schema
        if decode and self._frames is not None and any(fields[name].codec is not None for name in names):
            return self._gather_frames(self._frames, ragged, lane, step, names, out)
        varying = [name for name in names if name in ragged.fields]
        ends = tuple(dict.fromkeys(ends_name(fields[name].length_of or name) for name in varying))
        fixed = tuple(name for name in names if name not in ragged.fields)
        rows = self._reader.gather(lane, step, fixed + ends, {k: v for k, v in out.items() if k in fixed})
        chunk, offset = self.layout.chunk_and_offset(step)
        inner = offset > 0
        before = self._reader.gather(lane[inner], step[inner] - 1, ends) if inner.any() else {}
        result: Rows = {}
        for name in names:
            if name not in ragged.fields:
                result[name] = rows[name]
                continue
            key = ends_name(fields[name].length_of or name)
            start = np.zeros(len(step), np.int64)
            if inner.any():
                start[inner] = before[key]
            values = ragged.read(name, lane, step, chunk, start, rows[key].astype(np.int64), self._log.cursors.total,
                                 self._reader.retired.check)
            result[name] = decode_text(values) if fields[name].text else values  # type: ignore[assignment]
        return result

    def _gather_frames(self, frames: FrameReads, ragged: RaggedReads, lane: np.ndarray, step: np.ndarray,
                       names: tuple[str, ...], out: Mapping[str, np.ndarray]) -> Rows:
        encoded = [name for name in names if self.config.user_schema[name].codec is not None]
        rest = tuple(name for name in names if name not in encoded)
        result: Rows = self._gather_ragged(ragged, lane, step, rest, out) if rest else {}

        def fetch(name: str, lanes: np.ndarray, steps: np.ndarray) -> Any:
            return self._gather_ragged(ragged, lanes, steps, (name,), {}, decode=False)[name]

        for name in encoded:
            result[name] = frames.read(name, lane, step, self._log.cursors.total, fetch,
                                       f"{self.url!r}: encoded frame field {name!r}")
        return {name: result[name] for name in names}

    def lengths(self, lane: np.ndarray, step: np.ndarray, name: str) -> np.ndarray:
        """The lengths (int64) of rows (lane, step) of ragged field ``name``, from its ends alone
        (no values read). The caller guarantees the steps lie inside `window`.

        Raises:
            ValueError: ``name`` is not a ragged field of this storage.
            StaleReadError, CorruptBufferError (ends that do not add up), ClosedError: as `gather`.
        """
        if self._log.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        if self._ragged is None or name not in self._ragged.fields:
            raise ValueError(f"{name!r} is not a ragged field of {self.url!r}")
        key = ends_name(self.config.user_schema[name].length_of or name)
        end = self._reader.gather(lane, step, (key,))[key].astype(np.int64)
        chunk, offset = self.layout.chunk_and_offset(step)
        inner = offset > 0
        start = np.zeros(len(step), np.int64)
        if inner.any():
            start[inner] = self._reader.gather(lane[inner], step[inner] - 1, (key,))[key]
        return self._ragged.lengths(name, lane, chunk, start, end)

    def read_ahead(self, steps: Steps | None, budget_bytes: int = READ_AHEAD_BYTES) -> None:
        """Announce the next reads: ``steps`` yields (lane, step) arrays in the order `gather`
        will ask for them (read lazily). Their chunks are then fetched and decoded on threads
        ahead of those reads, in that order, with up to ``budget_bytes`` of decoded chunks
        (at most half the cache) started and not yet read; each read waits only for its own
        chunks. Replaces an earlier announcement; None: stop reading ahead. Reads that differ
        from the announcement stay right (they load what they miss). A no-op where reads need
        no read-ahead (memory-mapped files, raw chunks on local disk, a local window held whole
        in the cache). Raises ClosedError for a closed storage (stopping is no error)."""
        if steps is not None and self._log.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        self._reader.read_ahead(steps, budget_bytes)

    def warm(self) -> None:
        """Start the first-read fill if it is due, and wait until it is in (see `Warmer`)."""
        self._reader.warmer.wait()

    def read_newest(self) -> CommitRecord:
        """The newest commit record in the store (validated)."""
        return self._log.read_newest()

    def adopt(self, record: CommitRecord) -> None:
        """Reader: follow ``record``, dropping cached or mapped chunks it may have rewritten."""
        self._reader.ahead.drop()
        shown = self._log.record
        for lane in np.flatnonzero(shown.committed != record.committed).tolist():
            old = min(int(shown.committed[lane]), int(record.committed[lane]))
            self.forget_cached(lane, old - old % self.layout.chunk_rows, int(record.committed[lane]))
        self._log.adopt(record)
        self._cache.ensure_chunks(self.layout.chunks_per_lane(int(record.committed.max(initial=0))))

    def forget_cached(self, lane: int, first: int, end: int) -> None:
        """Reader: cached or mapped copies of steps ``[first, end)`` are out of date (rewritten by
        the writer, or a field of them patched after they were committed: episodic returns)."""
        chunks = self.layout.chunks_between(first, end)
        self._reader.ahead.drop()  # its pinned chunks would stay
        self._cache.invalidate(lane, chunks)
        self._files.forget(lane, chunks)
        self._reader.warmer.reset(lane, chunks)

    # ---- shards ----------------------------------------------------------------------------

    @property
    def shards(self) -> int:
        """Shards read together (1: one buffer)."""
        return 1

    @abstractmethod
    def shard_records(self, newest: bool = False, shards: Sequence[int] | None = None) -> list[CommitRecord]:
        """The commit each shard (or each of ``shards``) shows, or its ``newest`` in the store
        (read all at once); one buffer is its own only shard."""

    # ---- lifecycle -------------------------------------------------------------------------

    def require_writable(self) -> None:
        """Raises ClosedError, LockedError (this writer lost its lock) or ReadOnlyError."""
        self._log.require_writable()

    def close(self) -> None:
        """Release threads, maps and the writer lock (idempotent). Nothing is written."""
        if self._log.closed:
            return
        self._reader.ahead.close()
        self._reader.warmer.close()
        self._io.close()
        self._files.close()
        self._log.close()
