"""The Zarr-backed store of a buffer: staged writes, the commit protocol and the chunk cache.

Writes. Rows are copied into the chunk they belong to, which sits pinned in the chunk cache
(its *staging* slot). A chunk that fills up is *sealed* and written whole, once; `flush` also
writes each lane's partial tail chunk. The whole chunks an append covers skip staging: they are
written straight from the caller's arrays before `append` returns. No zarr-python call is made per
row or per chunk.

Failed writes. An `append` that fails (a full disk, an unreachable store) is undone before it
raises (`unappend`): the lane's cursor, staging and cache are as before the call, so nothing of it
is ever committed and a retry gets the same row ids. In a ring, the oldest rows the failed call
would have overwritten are retired (their slots may already hold its rows). A failed `flush`
leaves the rows staged; the next one writes them again.

Commit protocol. Chunk objects are written first; then one small JSON object, ``commit.json``
(`diskreplay.commit`), is replaced atomically. It holds, per lane, ``committed`` (steps visible to
readers) and ``lower`` (first visible step). Readers and a reopening writer see exactly the steps
``[max(lower, committed - capacity), committed)`` of the last commit. In a full ring, writing a
chunk destroys the oldest rows of its slots, so before any such write the writer first commits a
raised ``lower``: a reader never reads a row that is being overwritten, and a crash at any point
leaves the last commit's visible rows intact. Before every commit, state object and batch of
chunk writes the writer checks that it still holds the writer lock (`diskreplay.lock`).

Reads. `gather` maps steps to cache slots; missing chunks are fetched concurrently (a thread
pool; fsspec's async gather for remote stores), decoded (and checksummed) once into their slot,
and every field is then gathered with one ``take``.

Readers that have not refreshed. A reader keeps the window of the commit it last adopted,
while the writer goes on. Cached chunks stay right for that window: a row of a step never
changes, and a cached copy predates any overwrite of it. A chunk *fetched* later may already hold
the writer's next round in a ring; but the writer commits a raised ``lower`` before overwriting.
So after a reader (ring buffers only) fetches chunks, it re-reads ``commit.json`` (one small GET)
and, if the newest commit's first visible step has passed any row it asked for from those
chunks, it drops them and raises `StaleReadError` naming the rows: the buffer then adopts the
newest commit with all its in-RAM state (`ReplayBuffer.refresh`) and the caller draws again. If
only rows it did not ask for were retired, it returns the rows asked for but does not keep those
chunks cached (their other slots may hold the next round). Every cached chunk is thus right for
every step of the reader's window that maps to it, so cache hits need no check; nor do
dataset-mode buffers (they never overwrite a row).
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import mapped, zarr_layout
from .cache import ChunkCache
from .chunkstore import ChunkStore, LocalChunkStore, RetryPolicy, is_local, local_path, open_chunkstore
from .commit import COMMIT_KEY, Commit, is_state_key, state_key
from .errors import (ClosedError, CorruptBufferError, LockedError, NotABufferError, ReadOnlyError,
                     StaleReadError)
from .lanes import LaneLayout
from .lock import WriterLock
from .schema import Field, Schema
from .shard_maps import ShardMaps
from .zarr_layout import Codec

INCOMPLETE_IMPORT_KEY = "import-incomplete.json"
DEFAULT_CACHE_BYTES = 512 * 2**20
SYNC_FILES_ONE_BY_ONE = 32
"""Above this many files to make durable, one ``syncfs`` is cheaper than an fsync per file."""


@functools.cache
def physical_memory() -> int:
    """Bytes of RAM of this machine (2**40 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def default_io_threads(url: str) -> int:
    """Local disk is bound by CPU and the filesystem: threads beyond the cores only contend.
    Object stores are bound by latency: many requests in flight."""
    return min(4, os.cpu_count() or 1) if is_local(url) else 16


def output_rows(name: str, field: Field, count: int, given: np.ndarray | None) -> np.ndarray:
    """Where ``count`` rows of a field are gathered: ``given`` (checked) or a new array.

    Raises:
        ValueError: ``given`` is not a C-contiguous array of the field's dtype shaped ``(count, *shape)``.
    """
    if given is None:
        return np.empty((count, *field.shape), field.dtype)
    if given.shape != (count, *field.shape) or given.dtype != field.dtype or not given.flags.c_contiguous:
        raise ValueError(f"out[{name!r}]: expected a C-contiguous {field.dtype} array shaped "
                         f"{(count, *field.shape)}, got {given.dtype} shaped {given.shape}")
    return given


def _take_into(source: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """``source[index]`` written into ``out``. With ``out=``, numpy's default ``mode="raise"``
    gathers into a temporary first; our indices are always in range, so "clip" changes nothing."""
    np.take(source, index, axis=0, out=out, mode="clip")


DEFAULT_CHUNK_ROWS = 4096
CHUNK_BYTES = 1 << 20
"""Bytes of one chunk (all fields of its rows) that `default_chunk_rows` aims at: whole-chunk
reads, decodes and writes stay around a millisecond, so rows of 84x84 frames get 128-row chunks
where small rows get `DEFAULT_CHUNK_ROWS`."""
CHUNK_FILES_MAPPED = 1 << 14
"""Chunk files (chunks x fields) past which `default_chunk_rows` lengthens the chunks of raw
buffers: a quarter of Linux's default ``vm.max_map_count``, so every chunk can stay memory-mapped."""


def default_chunk_rows(schema: Schema, num_envs: int, capacity: int | None, cache_bytes: int,
                       mappable: bool = True) -> int:
    """Steps per chunk for a buffer of ``capacity`` rows over ``num_envs`` lanes (None: unknown).

    The largest power of two up to `DEFAULT_CHUNK_ROWS` whose chunk holds at most `CHUNK_BYTES`
    (at least one row). For a ``mappable`` (raw) buffer, then doubled while there would be more
    than `CHUNK_FILES_MAPPED` chunk files and a writer's staging (``2 * num_envs + 2`` chunks)
    still fits ``cache_bytes``. Arguments that are not positive ints leave out the doubling
    (`create` rejects them)."""
    rows = min(DEFAULT_CHUNK_ROWS, 1 << max(CHUNK_BYTES // max(schema.row_bytes, 1), 1).bit_length() - 1)
    if not mappable or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
                               for v in (num_envs, capacity, cache_bytes)):
        return rows
    lane_rows, staging_chunks = int(capacity) // int(num_envs), 2 * int(num_envs) + 2
    while (num_envs * -(-lane_rows // rows) * len(schema.fields) > CHUNK_FILES_MAPPED and rows < lane_rows
           and staging_chunks * 2 * rows * schema.row_bytes <= cache_bytes):
        rows *= 2
    return rows


def cache_slots(schema: Schema, layout: LaneLayout, cache_bytes: int, writer: bool,
                row_fields: tuple[str, ...] = ()) -> tuple[int, int]:
    """Chunk slots that fit ``cache_bytes``: ``(slots, full_slots)``. A writer stages a chunk per
    lane and seals as many again, so it needs ``2 * num_envs + 2`` slots; a reader gets at least
    one. With ``row_fields`` (read row by row) only the first ``full_slots`` (the staging) have
    room for them; the other slots, sized by the remaining fields, cache those.

    Raises ValueError (naming ``cache_bytes``) when a writer's staging does not fit the budget.
    """
    chunk_bytes = layout.chunk_rows * schema.row_bytes
    if not isinstance(cache_bytes, (int, np.integer)) or isinstance(cache_bytes, bool) or cache_bytes < 0:
        raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
    need = 2 * layout.num_envs + 2 if writer else 1
    if writer and need * chunk_bytes > cache_bytes:
        raise ValueError(f"cache_bytes={cache_bytes:,} is too small for a writer: staging needs {need} chunks "
                         f"(2 per env lane + 2) of {chunk_bytes:,} bytes = {need * chunk_bytes:,} bytes; raise "
                         f"cache_bytes or lower chunk_rows")
    slots = max(need, min(cache_bytes // chunk_bytes, ChunkCache.MAX_SLOTS))
    ring_chunks = layout.num_envs * layout.chunks_per_lane() if layout.lane_capacity is not None else None
    full = need if writer else 0
    if row_fields:
        small_bytes = layout.chunk_rows * sum(f.row_bytes for n, f in schema.items() if n not in row_fields)
        slots = full + max(cache_bytes - full * chunk_bytes, 0) // max(small_bytes, 1)
        slots = max(need, min(slots, ChunkCache.MAX_SLOTS))
    if ring_chunks is not None:  # more slots than a ring has chunks are dead weight
        slots = min(slots, max(need, ring_chunks))
    return int(slots), int(full if row_fields else slots)


@dataclass(frozen=True)
class NewStorage:
    """A buffer to be created: its location, metadata documents (``{key: bytes}``) and cache."""

    url: str
    documents: dict[str, bytes]
    cache_bytes: int


class Storage:
    """Chunk I/O, staging, the cache and commits for one buffer. Not thread-safe (one writer)."""

    def __init__(self, url: str, config: dict[str, Any], arrays: dict[str, dict], commit: Commit, *,
                 mode: str, storage_options: dict | None, cache_bytes: int, io_threads: int | None,
                 store: ChunkStore, writer_lock: WriterLock | None = None, memory_map: bool | None = None):
        self.url = url
        self.mode = mode
        self.storage_options = storage_options
        self.config = config
        self.arrays = arrays
        self.schema = Schema.from_json(config["fields"])
        self.field_names = tuple(self.schema.fields)
        self.layout = LaneLayout(config["num_envs"], config["lane_capacity"], config["chunk_rows"])
        self.codec = zarr_layout.buffer_codec(arrays, url)
        self.codecs = zarr_layout.field_codecs(self.codec, config, self.schema)
        self.key_separator = config["chunk_key_separator"]
        self.group_lane_rows = zarr_layout.lane_rows(arrays)
        self.io_threads = io_threads or default_io_threads(url)
        self.store = store
        self.writer_lock = writer_lock
        # released on close, or when the storage is collected / the interpreter exits unclosed
        self._lock_finalizer = weakref.finalize(self, writer_lock.release) if writer_lock else None
        self.closed = False
        self.lost_lock: str | None = None
        self.commit_record = commit
        self.committed = commit.committed.copy()
        self.lower = commit.lower.copy()
        self.total = commit.committed.copy()
        self.reader_window: tuple[np.ndarray, np.ndarray] | None = None
        self.staging = np.full(self.layout.num_envs, -1, dtype=np.int64)
        self.dirty = np.zeros(self.layout.num_envs, dtype=bool)
        self.sealed: list[tuple[int, int, int]] = []
        self.unsynced: set[str] = set()
        # read row by row on a miss (`_read_rows`), unless every field fits the cache
        self.row_fields = ({name: codec for name, codec in self.codecs.items() if codec.inner_rows is not None}
                           if isinstance(store, LocalChunkStore) and self._stored_bytes() > cache_bytes else {})
        self.cached_fields = tuple(name for name in self.field_names if name not in self.row_fields)
        self.shard_maps = (ShardMaps(store, self.chunk_key, self.layout.chunk_rows, self.row_fields,
                                     {name: codec.inner_rows * self.schema[name].row_bytes
                                      for name, codec in self.row_fields.items()},
                                     mapped.map_budget(len(self.schema.fields)))
                           if self.row_fields else None)
        slots, full_slots = cache_slots(self.schema, self.layout, cache_bytes, mode != "r", tuple(self.row_fields))
        self.cache = ChunkCache(self.schema, self.layout.num_envs, self.layout.chunk_rows, slots,
                                self.layout.chunks_per_lane(int(self.total.max(initial=0))), full_slots,
                                tuple(self.row_fields))
        self.io = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="diskreplay-io")
        self.mapped = None
        if memory_map is None:  # map only where it is faster: when the rows do not fit the cache
            memory_map = self._stored_bytes() > cache_bytes
        if memory_map and self.codec.raw and isinstance(self.store, LocalChunkStore) and mapped.supported():
            self.mapped = mapped.MappedChunks(self.store, self.chunk_key, self.schema, self.layout,
                                              self.layout.chunks_per_lane(int(self.total.max(initial=0))),
                                              trailer=self.codec.trailer)
        self.warm_pending = isinstance(store, LocalChunkStore)  # on the first read: see `_warm`
        self.resident_span: int | None = None  # set while a reader's cache holds its window in lane-major order
        self.home_width: int | None = None  # dataset mode: see `_home_width`

    # ---- creation and opening -------------------------------------------------------------

    @staticmethod
    def plan(url: str, schema: Schema, *, num_envs: int, lane_capacity: int | None, chunk_rows: int,
             compression: str | None, level: int, cache_bytes: int, options: dict[str, Any]) -> "NewStorage":
        """A new buffer's metadata, built and checked before anything is written.

        Raises ValueError / SchemaError for a bad codec, level, schema or ``cache_bytes``."""
        codec = Codec(compression, level)
        config = {"fields": schema.to_json(), "num_envs": num_envs, "lane_capacity": lane_capacity,
                  "chunk_rows": chunk_rows, "compression": compression, "level": level,
                  "chunk_key_separator": zarr_layout.CHUNK_KEY_SEPARATOR, "row_access": True, **options}
        documents = zarr_layout.metadata_documents(schema, num_envs, lane_capacity or 0, chunk_rows, codec, config)
        zarr_layout.read_layout(documents.get, url)  # what open will check, checked now
        cache_slots(schema, LaneLayout(num_envs, lane_capacity, chunk_rows), cache_bytes, writer=True)
        return NewStorage(url, documents, cache_bytes)

    @classmethod
    def create(cls, plan: "NewStorage", *, storage_options: dict | None, io_threads: int | None,
               extra: dict[str, Any], break_lock: bool = False, commit: bool = True,
               memory_map: bool | None = None, retry: RetryPolicy | None = None) -> "Storage":
        """Write a planned buffer's metadata (the location already cleared) and open it for
        writing. ``commit=False`` writes no commit record yet (the location is not a buffer
        until the first flush)."""
        url = plan.url
        store = open_chunkstore(url, storage_options, concurrency=io_threads or default_io_threads(url), retry=retry)
        config, arrays = zarr_layout.read_layout(plan.documents.get, url)
        lock = WriterLock(url, store=store).acquire(break_lock)
        try:
            store.delete(COMMIT_KEY)
            for key, blob in sorted(plan.documents.items(), key=lambda kv: kv[0] == zarr_layout.GROUP_KEY):
                store.put(key, blob, durable=True)  # the arrays, then the group
            record = Commit(0, np.zeros(config["num_envs"], np.int64), np.zeros(config["num_envs"], np.int64),
                            time.time(), extra)
            if commit:
                store.put(COMMIT_KEY, record.to_bytes(), durable=True)
            return cls(url, config, arrays, record, mode="r+", storage_options=storage_options,
                       cache_bytes=plan.cache_bytes, io_threads=io_threads, writer_lock=lock, store=store,
                       memory_map=memory_map)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def open(cls, url: str, *, mode: str, storage_options: dict | None, cache_bytes: int,
             io_threads: int | None, break_lock: bool = False, memory_map: bool | None = None,
             retry: RetryPolicy | None = None) -> "Storage":
        if is_local(url) and os.path.isfile(local_path(url)):
            raise NotABufferError(f"{url!r} is a file, not a diskreplay buffer (a buffer is a directory)")
        store = open_chunkstore(url, storage_options, concurrency=io_threads or default_io_threads(url), retry=retry)
        read_small = functools.partial(store.get, limit=zarr_layout.MAX_METADATA_BYTES + 1)
        blob = read_small(COMMIT_KEY)
        if blob is None:
            if store.exists(INCOMPLETE_IMPORT_KEY):
                raise NotABufferError(f"{url!r} holds an interrupted import (no {COMMIT_KEY}); "
                                      f"import it again with overwrite=True")
            raise NotABufferError(f"{url!r} is not a diskreplay buffer (no {COMMIT_KEY})")
        config, arrays = zarr_layout.read_layout(read_small, url)

        def parse(blob: bytes) -> Commit:
            record = Commit.from_bytes(blob, url, config["num_envs"])
            if config["lane_capacity"] is None:
                record.check_covered(url, zarr_layout.lane_rows(arrays))
            return record

        commit = parse(blob)
        lock = WriterLock(url, store=store).acquire(break_lock) if mode != "r" else None
        try:
            if lock is not None:  # the commit may have moved while we waited for the lock
                blob = read_small(COMMIT_KEY)
                if blob is None:
                    raise NotABufferError(f"{url!r} is not a diskreplay buffer (no {COMMIT_KEY})")
                commit = parse(blob)
            return cls(url, config, arrays, commit, mode=mode, storage_options=storage_options,
                       cache_bytes=cache_bytes, io_threads=io_threads, writer_lock=lock, store=store,
                       memory_map=memory_map)
        except BaseException:
            if lock is not None:
                lock.release()
            raise

    def _stored_bytes(self) -> int:
        """Bytes of the rows this buffer holds (a ring: when full)."""
        rows = self.layout.lane_capacity or int(self.total.max(initial=0))
        return self.layout.num_envs * rows * self.schema.row_bytes

    def chunk_key(self, name: str, lane: int, chunk: int) -> str:
        return zarr_layout.chunk_key(name, self.schema[name], lane, chunk, self.key_separator)

    # ---- windows ---------------------------------------------------------------------------

    def committed_window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the steps ``[lo, hi)`` of the last commit: what a reader would see."""
        hi = self.committed.copy()
        lo = np.maximum(self.lower, self.layout.oldest(hi))
        return np.minimum(lo, hi), hi

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the readable steps ``[lo, hi)``: everything added (writer) or committed (reader)."""
        if self.mode == "r":  # a reader's window moves only when it adopts a commit
            if self.reader_window is None:
                self.reader_window = self.committed_window()
            return self.reader_window
        lo = np.maximum(self.lower, self.layout.oldest(self.total))
        return np.minimum(lo, self.total), self.total

    # ---- writes ----------------------------------------------------------------------------

    def append(self, lane: int, rows: dict[str, np.ndarray], count: int) -> tuple[int, int]:
        """Stage ``count`` steps for one lane. Returns the steps actually stored ``[first, end)``.

        In a ring, only the last ``lane_capacity`` of them are stored (the others would be
        overwritten at once). All or nothing: if it raises, the lane is as before (`unappend`).
        """
        self._require_writable()
        start = int(self.total[lane])
        try:
            return self._append(lane, rows, count, start)
        except BaseException:
            self.unappend(lane, start, start + count)
            raise

    def _append(self, lane: int, rows: dict[str, np.ndarray], count: int, start: int) -> tuple[int, int]:
        cap = self.layout.lane_capacity
        skip = count - cap if cap is not None and count > cap else 0
        step, i = start + skip, skip
        whole: list[tuple[int, int]] = []  # (chunk, first row in ``rows``) written straight from ``rows``
        while i < count:
            piece = self.layout.piece_length(step, count - i)
            chunk, offset = divmod(self.layout.slot(step), self.layout.chunk_rows)
            if piece == self.layout.chunk_rows and self._unstaged(lane, chunk):
                whole.append((chunk, i))
                i += piece
                step += piece
                continue
            slot = self._staging_slot(lane, chunk, step - offset)
            base = slot * self.layout.chunk_rows + offset
            for name, slab in self.cache.slabs.items():
                slab[base:base + piece] = rows[name][i:i + piece]
            self.dirty[lane] = True
            i += piece
            step += piece
            if offset + piece == self.layout.chunk_rows or self.layout.slot(step) == 0:
                self._seal(lane)
            self.total[lane] = step
            if len(self.sealed) * 2 > self.cache.full_slots:
                self.write_sealed(durable=False)
        self.total[lane] = start + count
        self._write_whole(lane, rows, whole)
        return start + skip, start + count

    def unappend(self, lane: int, start: int, attempted_end: int) -> None:
        """Forget steps ``[start, attempted_end)`` of a lane that a failed call staged or wrote
        (never committed): the lane's cursor, staging and cache are as before that call.

        In a ring, the rows whose slots the call reached are retired (``lower``), as their bytes
        may already be gone. Chunk files written beyond the cursor stay, unseen, until rewritten.
        """
        layout = self.layout
        self.total[lane] = start
        if layout.lane_capacity is not None:
            self.lower[lane] = min(max(int(self.lower[lane]), int(layout.oldest(attempted_end))), start)
        touched = layout.chunks_between(start, attempted_end)
        keep = -1  # the chunk holding the steps just before ``start``, still valid
        if layout.slot(start) % layout.chunk_rows and layout.oldest(attempted_end) < start:
            keep = int(layout.slot(start) // layout.chunk_rows)
        self.sealed = [(ln, c, s) for ln, c, s in self.sealed if ln != lane or c not in touched]
        self.cache.drop(lane, touched[touched != keep])
        self._forget_files(lane, touched)
        slot = self._complete_slot(lane, keep) if keep >= 0 else -1
        if slot >= 0:  # staged again: its rows before ``start`` are written with the next chunks
            self.staging[lane], self.dirty[lane] = keep, True
            self.cache.pinned[slot] = True
        else:
            self.staging[lane], self.dirty[lane] = -1, False

    def _unstaged(self, lane: int, chunk: int) -> bool:
        """Whether a whole chunk can be written straight from the caller's rows: no staged or
        sealed copy of it waits in the cache (a cached clean copy is dropped)."""
        self.cache.ensure_chunks(chunk + 1)
        slot = int(self.cache.table[lane, chunk])
        if slot >= 0 and self.cache.pinned[slot]:
            return False
        if slot >= 0:
            self.cache.evict(np.array([slot]))
        return True

    def _write_whole(self, lane: int, rows: dict[str, np.ndarray], whole: list[tuple[int, int]]) -> None:
        """Write whole chunks from ``rows`` without staging them: one copy fewer for bulk extends.
        Done before `append` returns, as the caller may reuse its arrays."""
        if not whole:
            return
        self._retire_overwritten(durable=False)
        n = self.layout.chunk_rows
        self._put_chunks([(self.chunk_key(name, lane, chunk), self.codecs[name], rows[name][i:i + n],
                           self._never_committed(lane, chunk))
                          for chunk, i in whole for name in self.schema.fields], durable=False)
        self._forget_files(lane, np.array([chunk for chunk, _ in whole]))

    def _staging_slot(self, lane: int, chunk: int, chunk_first_step: int) -> int:
        if self.staging[lane] == chunk:
            return int(self.cache.table[lane, chunk])
        if self.staging[lane] >= 0:
            self._seal(lane)
        self.cache.ensure_chunks(chunk + 1)
        slot = self._complete_slot(lane, chunk)
        if slot >= 0:
            self.cache.pinned[slot] = True
        elif self._holds_data(lane, chunk_first_step):
            slot = self._load_one(lane, chunk, must_exist=self._holds_visible(lane, chunk_first_step))
        else:  # a recycled slot holds another chunk's rows: never write those into this chunk
            slot = int(self.cache.assign(np.array([lane]), np.array([chunk]))[0])
            for name in self.cache.slabs:
                self.cache.chunk_rows_of(name, slot)[...] = 0
        self.staging[lane] = chunk
        return slot

    def _load_one(self, lane: int, chunk: int, must_exist: bool) -> int:
        """A slot holding one stored chunk, pinned (see `_load_pinned`)."""
        return int(self._load_pinned(np.array([lane]), np.array([chunk]), must_exist)[0])

    def _holds_data(self, lane: int, chunk_first_step: int) -> bool:
        """Whether the chunk starting at this step already has stored rows (to keep on rewrite)."""
        cap = self.layout.lane_capacity
        earlier_round = cap is not None and chunk_first_step >= cap
        return earlier_round or self.total[lane] > chunk_first_step

    def _holds_visible(self, lane: int, chunk_first_step: int) -> bool:
        cap = self.layout.lane_capacity or 0
        lo = max(self.lower[lane], self.layout.oldest(self.committed[lane]))
        spans = [(chunk_first_step, chunk_first_step + self.layout.chunk_rows)]
        if cap:
            spans.append((chunk_first_step - cap, chunk_first_step - cap + self.layout.chunk_rows))
        return any(a < self.committed[lane] and b > lo for a, b in spans)

    def _seal(self, lane: int) -> None:
        chunk = int(self.staging[lane])
        if chunk >= 0 and self.dirty[lane]:
            self.sealed.append((lane, chunk, int(self.cache.table[lane, chunk])))
        elif chunk >= 0:
            self.cache.pinned[self.cache.table[lane, chunk]] = False
        self.staging[lane] = -1
        self.dirty[lane] = False

    def rewind(self, total: np.ndarray) -> None:
        """Writer, right after open: forget steps at or after ``total`` per lane (steps a parent
        buffer never committed); they are overwritten by the next appends."""
        self.total = np.minimum(self.total, total)

    def update_rows(self, lane: int, first: int, values: dict[str, np.ndarray]) -> None:
        """Overwrite fields of steps ``[first, first + n)`` of one lane, already added.

        For fields derived after the fact (episodic returns, an episode closed at reopen). Chunks
        already written are read first (all of them, before any value changes: a failed read
        changes nothing), patched in the cache and queued to be rewritten with the next chunk writes.
        """
        self._require_writable()
        count = len(next(iter(values.values())))
        pieces = []
        step, i = first, 0
        while i < count:
            piece = self.layout.piece_length(step, count - i)
            chunk, offset = divmod(self.layout.slot(step), self.layout.chunk_rows)
            pieces.append((self._patchable_slot(lane, chunk) * self.layout.chunk_rows + offset, i, piece))
            i += piece
            step += piece
        for base, i, piece in pieces:
            for name, value in values.items():
                self.cache.slabs[name][base:base + piece] = value[i:i + piece]

    def _patchable_slot(self, lane: int, chunk: int) -> int:
        if self.staging[lane] == chunk:
            self.dirty[lane] = True
            return int(self.cache.table[lane, chunk])
        for sealed_lane, sealed_chunk, slot in self.sealed:
            if (sealed_lane, sealed_chunk) == (lane, chunk):
                return slot
        slot = self._complete_slot(lane, chunk)
        if slot >= 0:
            self.cache.pinned[slot] = True
        else:
            slot = self._load_one(lane, chunk, must_exist=True)
        self.sealed.append((lane, chunk, slot))
        return slot

    def _complete_slot(self, lane: int, chunk: int) -> int:
        """The slot caching every field of this chunk, or -1 (a slot holding some fields only is
        dropped: the chunk is about to be rewritten from the cache)."""
        slot = int(self.cache.table[lane, chunk]) if chunk < self.cache.table.shape[1] else -1
        if slot >= 0 and self.cache.partial[slot]:
            self.cache.evict(np.array([slot]))
            return -1
        return slot

    def write_sealed(self, durable: bool) -> None:
        """Write every sealed chunk (and nothing else), after retiring the rows they overwrite."""
        self._write_chunks(self.sealed, durable)
        self._release_sealed()

    def _release_sealed(self) -> None:
        """Unpin written sealed chunks, except a lane's current staging chunk (a ring that wraps
        within one append re-stages a chunk it already sealed). With memory maps, the maps serve
        written chunks: the cache then holds only the chunks not written yet."""
        written = np.array([slot for _, _, slot in self.sealed], dtype=np.int64)
        self.cache.pinned[written] = False
        self.sealed = []
        lanes = np.flatnonzero(self.staging >= 0)
        self.cache.pinned[self.cache.table[lanes, self.staging[lanes]]] = True
        if self.mapped is not None:
            self.cache.evict(written[~self.cache.pinned[written]])

    def flush(self, durable: bool = True, extra: dict[str, Any] | None = None) -> None:
        """Write sealed chunks and every lane's partial tail chunk, then commit. If it raises,
        the rows stay staged and nothing new is committed."""
        self._require_writable()
        tails = [(lane, int(self.staging[lane]), int(self.cache.table[lane, self.staging[lane]]))
                 for lane in np.flatnonzero(self.dirty)]
        self._write_chunks(self.sealed + tails, durable)
        self._release_sealed()
        self.dirty[:] = False
        if durable:
            self._sync_written()
        self._grow_arrays()
        self.commit(self.total.copy(), np.maximum(self.lower, self.layout.oldest(self.total)), durable, extra)

    def _write_chunks(self, chunks: list[tuple[int, int, int]], durable: bool) -> None:
        if not chunks:
            return
        self._retire_overwritten(durable)
        self._put_chunks([(self.chunk_key(name, lane, chunk), self.codecs[name], self.cache.chunk_rows_of(name, slot),
                           self._never_committed(lane, chunk))
                          for lane, chunk, slot in chunks for name in self.schema.fields], durable)
        for lane, chunk, _ in chunks:
            self._forget_files(lane, np.array([chunk]))

    def _never_committed(self, lane: int, chunk: int) -> bool:
        """No commit ever covered a row of this chunk (its first-round steps are all newer)."""
        return int(self.committed[lane]) <= chunk * self.layout.chunk_rows

    def _put_chunks(self, work: list[tuple[str, Codec, np.ndarray, bool]], durable: bool) -> None:
        """Write ``(key, codec, rows, fresh)`` chunks on the I/O threads, a few long jobs rather than
        one per chunk (queueing a job costs about as much as writing a small chunk)."""
        self._check_lock()
        batches = [work[k::self.io_threads] for k in range(min(self.io_threads, len(work)))]
        jobs = [self.io.submit(self._put_batch, batch, durable) for batch in batches]
        for job in jobs:  # every job ends before this returns or raises: none writes on behind a failure
            job.exception()
        for job in jobs:
            job.result()

    def _put_batch(self, work: list[tuple[str, Codec, np.ndarray, bool]], durable: bool) -> None:
        for key, codec, rows, fresh in work:
            self._put_chunk(key, codec.encode(rows), durable, fresh)

    def _put_chunk(self, key: str, data: tuple[bytes | memoryview, ...], durable: bool, fresh: bool) -> None:
        """Write one chunk object. A chunk no commit ever covered is written in place (local
        disk: no temp file or rename); a torn write of it is invisible to every commit."""
        if fresh and isinstance(self.store, LocalChunkStore):
            self.store.put_in_place(key, data)
            self.unsynced.add(key)
            return
        self.store.put(key, data, durable)
        if not durable and isinstance(self.store, LocalChunkStore):
            self.unsynced.add(key)

    def _sync_written(self) -> None:
        """fsync chunk files written without durability since the last commit (local disk)."""
        if len(self.unsynced) > SYNC_FILES_ONE_BY_ONE:
            self.store.sync_all()
        elif self.unsynced:
            list(self.io.map(self.store.sync_file, self.unsynced))
            self.store.sync_dirs(self.unsynced)
        self.unsynced = set()

    def _retire_overwritten(self, durable: bool) -> None:
        """Before chunk writes: commit the raised lower bound of the rows they may overwrite, if
        the last commit still shows any of them (the writer's own bound may be higher already:
        a failed call retires rows in RAM only). Always durable: a chunk overwrite that reaches
        the disk before this commit would, after a power loss, show new rows under old step
        numbers. One small fsync per chunk write batch."""
        target = np.maximum(self.lower, self.layout.oldest(self.total))
        if np.any(np.minimum(target, self.committed) > self.commit_record.lower):
            self.commit(self.committed, target, True, self.commit_record.extra)

    def _grow_arrays(self) -> None:
        """Dataset mode: grow every array's step axis to the rows added (metadata only)."""
        rows = int(self.total.max(initial=0))
        if self.layout.lane_capacity is not None or rows <= self.group_lane_rows:
            return
        self._check_lock()
        for name, meta in self.arrays.items():
            self.store.put(zarr_layout.array_key(name), zarr_layout.resized_document(meta, rows), durable=True)
            meta["shape"][1] = rows
        self.group_lane_rows = rows

    def commit(self, committed: np.ndarray, lower: np.ndarray, durable: bool,
               extra: dict[str, Any] | None) -> None:
        """Replace ``commit.json``. ``lower`` is recorded at most ``committed`` (a retire commit
        may raise it past the rows committed so far); this writer keeps its own, higher, bound."""
        self._check_lock()
        record = Commit(self.commit_record.sequence + 1, committed.copy(), np.minimum(lower, committed),
                        time.time(), self.commit_record.extra if extra is None else extra)
        self.store.put(COMMIT_KEY, record.to_bytes(), durable)
        self.commit_record = record
        self.committed = record.committed.copy()
        self.lower = np.maximum(self.lower, lower)

    def _check_lock(self) -> None:
        """Refuse to write unless this writer still holds the lock (it may have been broken and
        taken by another writer, which this one must not overwrite)."""
        self._require_writable()
        try:
            self.writer_lock.verify()
        except LockedError as exc:
            self.lost_lock = str(exc)  # stop for good: every later write is refused without asking the store
            raise

    def _require_writable(self) -> None:
        if self.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        if self.lost_lock is not None:
            raise LockedError(self.lost_lock)
        if self.mode == "r":
            raise ReadOnlyError(f"buffer {self.url!r} was opened read-only (mode='r'); open it with mode='r+' to write")

    # ---- state objects ---------------------------------------------------------------------

    def put_state(self, blob: bytes, durable: bool) -> str:
        """Write a state object for the next commit; returns its key (new, never reused)."""
        key = state_key(self.commit_record.sequence + 1)
        self._check_lock()
        self.store.put(key, blob, durable)
        return key

    def get_state(self, key: str) -> bytes | None:
        if not is_state_key(key):  # the record was validated; this guards other callers
            raise CorruptBufferError(f"{self.url!r}: {key!r} is not a state object name")
        return self.store.get(key)

    def delete_state(self, key: str) -> None:
        """Remove a state object no commit refers to any more (only names of the naming rule)."""
        if is_state_key(key):
            self._check_lock()
            self.store.delete(key)

    # ---- reads -----------------------------------------------------------------------------

    def read_commit(self) -> Commit:
        """The newest commit record in the store (validated)."""
        read_small = functools.partial(self.store.get, limit=zarr_layout.MAX_METADATA_BYTES + 1)
        blob = read_small(COMMIT_KEY)
        if blob is None:
            raise CorruptBufferError(f"{self.url!r}: {COMMIT_KEY} disappeared")
        record = Commit.from_bytes(blob, self.url, self.layout.num_envs)
        if self.layout.lane_capacity is None and int(record.committed.max(initial=0)) > self.group_lane_rows:
            _, arrays = zarr_layout.read_layout(read_small, self.url)  # the writer grew them since
            record.check_covered(self.url, zarr_layout.lane_rows(arrays))
            self.arrays, self.group_lane_rows = arrays, zarr_layout.lane_rows(arrays)
        return record

    def adopt(self, record: Commit) -> None:
        """Reader: follow ``record``, dropping cached or mapped chunks it may have rewritten."""
        for lane in range(self.layout.num_envs):
            old = min(int(self.committed[lane]), int(record.committed[lane]))
            self.forget_cached(lane, old - old % self.layout.chunk_rows, int(record.committed[lane]))
        self.commit_record = record
        self.committed, self.lower = record.committed.copy(), record.lower.copy()
        self.total = self.committed.copy()
        self.reader_window = None
        self.cache.ensure_chunks(self.layout.chunks_per_lane(int(self.total.max(initial=0))))

    def forget_cached(self, lane: int, first: int, end: int) -> None:
        """Reader: cached or mapped copies of steps ``[first, end)`` are out of date (rewritten by
        the writer, or a field of them patched after they were committed: episodic returns)."""
        chunks = self.layout.chunks_between(first, end)
        self.cache.invalidate(lane, chunks)
        self._forget_files(lane, chunks)
        self.resident_span = None
        self.warm_pending = self.mode == "r" and isinstance(self.store, LocalChunkStore)  # fill again at the next read

    def _forget_files(self, lane: int, chunks: np.ndarray) -> None:
        """Chunk files mapped (raw rows or shards) that were rewritten: map them again when read."""
        if self.mapped is not None:
            self.mapped.forget(lane, chunks)
        if self.shard_maps is not None:
            self.shard_maps.forget(lane, chunks)

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Rows at (lane, step) of every field (or of ``names``): arrays with leading axis ``len(step)``.

        ``out`` may hold, for some of those fields, C-contiguous arrays of exactly that shape and
        the field's dtype: their rows are gathered straight into them (no extra copy), and they
        are what is returned for those fields. The caller guarantees the steps lie inside `window`.

        Raises:
            StaleReadError: a ring reader's rows were overwritten since its commit (see the
                module docstring); nothing was adopted.
            CorruptBufferError: a chunk the commit covers is missing, short or fails its checksum.
        """
        if self.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        names = names or self.field_names
        if self.warm_pending:
            self._warm()
        if self.resident_span is not None:
            return self._gather_resident(lane, step, names, out)
        if self.mapped is not None:
            return self._gather_mapped(lane, step, names, out or {})
        if self.row_fields and not self.row_fields.keys().isdisjoint(names):
            return self._gather_by_rows(lane, step, names, out or {})
        return self._gather_cached(lane, step, names, out)

    def _gather_cached(self, lane, step, names, out) -> dict[str, np.ndarray]:
        """Rows through the chunk cache, missing chunks loaded into it (`_gather_with_misses`)."""
        chunk, offset = self.layout.chunk_and_offset(step)
        slots = self.cache.table[0].take(chunk) if self.layout.num_envs == 1 else self.cache.table[lane, chunk]
        cached = (slots >= 0).all()
        if cached:
            self.cache.touch(slots)
            index = slots * self.layout.chunk_rows + offset
            if out is None:  # the hot path
                return {name: self.cache.slabs[name].take(index, axis=0) for name in names}
        out = self._outputs(names, len(step), out or {})
        if cached:
            for name, rows in out.items():
                _take_into(self.cache.slabs[name], index, rows)
        else:
            self._gather_with_misses(lane, chunk, offset, slots, step, out)
        return out

    def _gather_by_rows(self, lane, step, names, out) -> dict[str, np.ndarray]:
        """Sharded fields row by row (`_read_rows`), the others through the cache."""
        others = tuple(name for name in names if name not in self.row_fields)
        rows = self._gather_cached(lane, step, others, out) if others else {}
        for name in names:
            if name in self.row_fields:
                rows[name] = self._read_rows(name, lane, step, out.get(name))
        return {name: rows[name] for name in names}

    def _read_rows(self, name: str, lane: np.ndarray, step: np.ndarray, given: np.ndarray | None) -> np.ndarray:
        """One sharded field's rows: from chunks the cache holds whole (a writer's staged ones
        among them), else each distinct inner chunk read and decoded once, not cached."""
        rows = output_rows(name, self.schema[name], len(step), given)
        chunk, offset = self.layout.chunk_and_offset(step)
        width = self.cache.table.shape[1]
        slots = np.where(chunk < width, self.cache.table[lane, np.minimum(chunk, width - 1)], -1)
        cached = slots >= 0
        cached[cached] = ~self.cache.partial[slots[cached]]
        if cached.any():
            rows[cached] = self.cache.slabs[name].take(slots[cached] * self.layout.chunk_rows + offset[cached], axis=0)
        read = np.flatnonzero(~cached)
        if not len(read):
            return rows
        inner_rows = self.row_fields[name].inner_rows
        per_chunk = self.layout.chunk_rows // inner_rows
        block = (lane[read] * (chunk.max() + 1) + chunk[read]) * per_chunk + offset[read] // inner_rows
        unique, where = np.unique(block, return_inverse=True)
        first = np.zeros(len(unique), dtype=np.int64)
        first[where] = read
        # single-row inner chunks decode straight into the output; else into blocks, then picked
        order = np.argsort(first, kind="stable")  # bodies in output order: often decoded in place
        first = first[order]
        inner = offset[first] // inner_rows
        bodies = self.shard_maps.bodies(name, lane[first], chunk[first], inner)
        straight = inner_rows == 1 and len(first) == len(rows)  # then first == arange(len(rows))
        blocks = rows if straight else np.empty((len(first), inner_rows, *self.schema[name].shape), rows.dtype)
        self._decode_inner_chunks(name, bodies, blocks, lane[first], chunk[first])
        if not straight:
            rows[read] = blocks.reshape(len(first), inner_rows, *rows.shape[1:])[
                np.argsort(order)[where], offset[read] % inner_rows]
        self._check_not_overwritten(lane[read], step[read], lane[read], chunk[read])
        return rows

    def _decode_inner_chunks(self, name: str, bodies: list, out: np.ndarray, lanes: np.ndarray, chunks: np.ndarray) -> None:
        """Decode inner chunk bodies into ``out``. Raises CorruptBufferError naming a chunk that
        does not decode."""
        codec = self.row_fields[name]
        try:
            codec.decode_bodies(bodies, out, self.io_threads)
        except ValueError:
            for i, body in enumerate(bodies):  # which one
                try:
                    codec.decode_bodies([body], out[i:i + 1])
                except ValueError as exc:
                    key = self.chunk_key(name, int(lanes[i]), int(chunks[i]))
                    raise CorruptBufferError(f"{self.url!r}: chunk {key!r} does not decode ({exc})") from None
            raise

    def _gather_resident(self, lane, step, names, out) -> dict[str, np.ndarray]:
        """A reader whose cache holds its whole window, chunk ``(lane, c)`` in slot
        ``lane * width + c``: slab rows follow from the steps alone."""
        slot = self.layout.slot(step)
        index = slot if self.layout.num_envs == 1 else lane * self.resident_span + slot
        if out is None:
            return {name: self.cache.slabs[name].take(index, axis=0) for name in names}
        out = self._outputs(names, len(step), out)
        for name, rows in out.items():
            _take_into(self.cache.slabs[name], index, rows)
        return out

    def _outputs(self, names: tuple[str, ...], count: int, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {name: output_rows(name, self.schema[name], count, given.get(name)) for name in names}

    def _gather_mapped(self, lane, step, names, out) -> dict[str, np.ndarray]:
        """Rows from the memory-mapped chunk files, except a writer's chunks held in the cache
        (staged, or not yet written): those come from the cache."""
        slot = self.layout.slot(step)
        if self.mode != "r":
            slots = self.cache.table[lane, slot // self.layout.chunk_rows]
            if (slots >= 0).any():
                return self._gather_mixed(lane, step, slot, slots, self._outputs(names, len(step), out))
        if not self._map(lane, step, slot):  # more chunks than may be mapped at once
            return self._gather_unmapped(lane, step, self._outputs(names, len(step), out))
        if out:
            out = self._outputs(names, len(step), out)
        return self.mapped.gather(lane, slot, names, out)

    def _warm(self) -> None:
        """First read from local disk: bring the whole window close, so that later reads never
        wait for the disk (remote stores fetch what reads need). Rows that fit the cache are
        loaded into it (`_fill_cache`); rows that do not, but fit in half this machine's RAM, are
        mapped with their pages read (`MappedChunks.warm`); bigger ones are read page by page as
        sampled, each batch's pages asked for at once (`MappedChunks.read_randomly`).
        Best effort: a damaged chunk is reported by the read that needs it."""
        self.warm_pending = False
        lo, hi = self.window()
        spans = [self.layout.chunks_between(int(lo[ln]), int(hi[ln])) for ln in range(self.layout.num_envs)]
        lanes = np.concatenate([np.full(len(c), ln, dtype=np.int64) for ln, c in enumerate(spans)])
        chunks = np.concatenate(spans)
        if self.mapped is None:
            self._fill_cache(lanes, chunks, self.layout.chunks_per_lane(int(hi.max(initial=0))))
        elif self._stored_bytes() <= physical_memory() // 2:
            self._drop_if_moved(*self.mapped.warm(lanes, chunks))
        else:
            self.mapped.read_randomly()

    def _fill_cache(self, lanes: np.ndarray, chunks: np.ndarray, chunks_per_lane: int) -> None:
        """Load every chunk not cached, all files asked of the OS at once (many requests in
        flight), if they fit. A reader puts chunk ``(lane, c)`` in slot ``lane * width + c``:
        then its reads find rows from their steps alone (`_gather_resident`)."""
        width = self._home_width(chunks_per_lane)
        home = lanes * width + chunks
        at = self.cache.table[lanes, chunks]
        missing = at < 0
        in_place = (self.mode == "r" and len(home) > 0 and home.max() < self.cache.full_slots
                    and (at[~missing] == home[~missing]).all() and self.cache.free(home[missing]))
        staging = 0 if self.mode == "r" else 2 * self.layout.num_envs + 2
        if not in_place and missing.sum() > self.cache.evictable() - staging:
            return
        lanes, chunks, home = lanes[missing], chunks[missing], home[missing]
        self.store.prefetch([self.chunk_key(name, ln, ch) for ln, ch in zip(lanes.tolist(), chunks.tolist())
                             for name in self.schema.fields])
        try:
            self._load(lanes, chunks, home if in_place else None)
        except CorruptBufferError:
            return
        if not self._drop_if_moved(lanes, chunks) and in_place:
            self.resident_span = width * self.layout.chunk_rows

    def _home_width(self, needed: int) -> int:
        """Slots per lane of a reader's lane-major cache: the ring's chunks; in dataset mode
        room to grow (a power of two, while the cache has the slots), kept while it suffices."""
        if self.layout.lane_capacity is None and (self.home_width or 0) < needed:
            roomy = 1 << (needed - 1).bit_length()
            self.home_width = roomy if self.layout.num_envs * roomy <= self.cache.full_slots else needed
        return self.home_width or needed

    def _drop_if_moved(self, lanes: np.ndarray, chunks: np.ndarray) -> bool:
        """A ring reader that loaded or mapped chunks ahead of any read: forget those holding
        steps of its window the writer retired meanwhile (`_check_not_overwritten`). Returns
        whether it forgot any."""
        tainted = self._check_not_overwritten(lanes[:0], lanes[:0], lanes, chunks)
        for ln, stale in tainted:
            self.cache.invalidate(ln, stale)
            self._forget_files(ln, stale)
        return bool(tainted)

    def _map(self, lane: np.ndarray, step: np.ndarray, slot: np.ndarray) -> bool:
        """Map the chunks of these steps; False if they are more than may be mapped at once."""
        newly = self.mapped.ensure(lane, slot)
        if newly is None:
            return False
        lanes, chunks = newly
        if len(chunks):
            try:
                tainted = self._check_not_overwritten(lane, step, lanes, chunks)
            except StaleReadError:
                for ln in np.unique(lanes).tolist():
                    self.mapped.forget(ln, chunks[lanes == ln])
                raise
            for ln, stale in tainted:
                self.mapped.forget(ln, stale)
        return True

    def _gather_mixed(self, lane, step, slot, slots, out) -> dict[str, np.ndarray]:
        cached = slots >= 0
        filed = ~cached
        if filed.any() and not self._map(lane[filed], step[filed], slot[filed]):
            return self._gather_unmapped(lane, step, out)
        mapped = self.mapped.gather(lane[filed], slot[filed], tuple(out), {})
        index = slots[cached] * self.layout.chunk_rows + slot[cached] % self.layout.chunk_rows
        for name, rows in out.items():
            rows[filed] = mapped[name]
            rows[cached] = self.cache.slabs[name].take(index, axis=0)
        return out

    def _gather_unmapped(self, lane, step, out) -> dict[str, np.ndarray]:
        chunk, offset = self.layout.chunk_and_offset(step)
        self._gather_with_misses(lane, chunk, offset, self.cache.table[lane, chunk], step, out)
        return out

    def _gather_with_misses(self, lane, chunk, offset, slots, step, out) -> None:
        miss = slots < 0
        width = self.cache.table.shape[1]
        keys = np.unique(lane[miss] * width + chunk[miss])
        room = self.cache.evictable(whole=False)
        if room == 0:
            raise RuntimeError("chunk cache has no free slot: raise cache_bytes")
        todo = ~miss
        self._fill(out, todo, lane, chunk, offset)
        for start in range(0, len(keys), room):
            group = keys[start:start + room]
            self._load(group // width, group % width, whole=False)
            todo = miss & np.isin(lane * width + chunk, group)
            tainted = self._check_not_overwritten(lane[todo], step[todo], group // width, group % width)
            self._fill(out, todo, lane, chunk, offset)
            for ln, chunks in tainted:  # right for the rows asked for, not for all their slots
                self.cache.invalidate(ln, chunks)

    def _check_not_overwritten(self, lane, step, loaded_lanes, loaded_chunks) -> list:
        """Reader of a ring, after fetching chunks: raise `StaleReadError` if the writer had
        retired any of the requested steps by then (see the module docstring). Otherwise return
        the ``(lane, chunks)`` of fetched chunks holding other retired steps of this reader's
        window: their rows asked for are right, but they must not stay in the cache."""
        if self.mode != "r" or self.layout.lane_capacity is None or not len(loaded_chunks):
            return []
        record = self.read_commit()
        if record.same_as(self.commit_record):
            return []
        first = np.maximum(record.lower, self.layout.oldest(record.committed))
        lo, hi = self.window()
        tainted = []
        for ln in np.unique(loaded_lanes).tolist():
            retired_end = min(int(first[ln]), int(hi[ln]))
            if retired_end > lo[ln]:
                risky = np.intersect1d(loaded_chunks[loaded_lanes == ln],
                                       self.layout.chunks_between(int(lo[ln]), retired_end))
                if risky.size:
                    tainted.append((ln, risky))
        gone = step < first[lane]
        if not gone.any():
            return tainted
        for ln in np.unique(loaded_lanes).tolist():
            self.cache.invalidate(ln, loaded_chunks[loaded_lanes == ln])
        ids = (step[gone] * self.layout.num_envs + lane[gone])[:5].tolist()
        raise StaleReadError(
            f"{self.url!r}: rows {ids}{'...' if gone.sum() > 5 else ''} were overwritten by the writer "
            f"after this reader's commit {self.commit_record.sequence}; the newest is commit "
            f"{record.sequence} (first readable steps per lane {first.tolist()}): refresh and sample again")

    def _fill(self, out, mask, lane, chunk, offset) -> None:
        if not mask.any():
            return
        slots = self.cache.table[lane[mask], chunk[mask]]
        self.cache.touch(slots)
        index = slots * self.layout.chunk_rows + offset[mask]
        for name, rows in out.items():
            rows[mask] = self.cache.slabs[name].take(index, axis=0)

    def _load(self, lanes: np.ndarray, chunks: np.ndarray, slots: np.ndarray | None = None,
              whole: bool = True) -> None:
        """Load these chunks into the cache; unless ``whole``, only the fields not read row by row."""
        self.cache.pinned[self._load_pinned(lanes, chunks, must_exist=True, slots=slots, whole=whole)] = False

    def _load_pinned(self, lanes: np.ndarray, chunks: np.ndarray, must_exist: bool,
                     slots: np.ndarray | None = None, whole: bool = True) -> np.ndarray:
        """Slots holding these stored chunks (in ``slots``, free ones, if given; else the least
        recently used), pinned; on a failed read the slots are freed again."""
        slots = self.cache.assign(lanes, chunks, whole) if slots is None else self.cache.place(lanes, chunks, slots)
        names = self.field_names if whole else self.cached_fields
        try:
            self._fetch_into(list(zip(lanes.tolist(), chunks.tolist(), slots.tolist())), must_exist, names)
        except BaseException:
            self.cache.pinned[slots] = False
            self.cache.evict(slots)
            raise
        self.cache.partial[slots] |= len(names) < len(self.field_names)
        return slots

    def _fetch_into(self, targets: list[tuple[int, int, int]], must_exist: bool,
                    names: tuple[str, ...] | None = None) -> None:
        """Read chunks (the fields ``names``, default all) into their slots; a missing chunk is
        an error if ``must_exist`` else zeros."""
        work = [(self.chunk_key(name, lane, chunk), self.codecs[name], self.cache.chunk_rows_of(name, slot))
                for lane, chunk, slot in targets for name in names or self.field_names]
        if isinstance(self.store, LocalChunkStore) and self.codec.raw:
            found = [self._read_raw(key, rows) for key, _, rows in work]  # memcpy-bound: threads only add overhead
        else:
            blobs = self.store.get_many([key for key, _, _ in work])
            found = list(self.io.map(lambda kb: self._decode(*kb[0], kb[1]), zip(work, blobs)))
        for (key, _, rows), ok in zip(work, found):
            if not ok:
                if must_exist:
                    raise CorruptBufferError(
                        f"{self.url!r}: chunk {key!r} is missing, but the last commit says it holds rows")
                rows[...] = 0

    def _read_raw(self, key: str, rows: np.ndarray) -> bool:
        """Read a raw chunk file straight into ``rows`` (no copy), its checksum beside it."""
        values = memoryview(rows.reshape(-1).view(np.uint8))
        trailer = bytearray(self.codec.trailer + 1)  # one byte more: a longer file is found too
        got = self.store.read_into(key, [values, memoryview(trailer)])
        if got is None:
            return False
        if got != rows.nbytes + self.codec.trailer:
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} has {got} bytes, expected "
                                     f"{rows.nbytes + self.codec.trailer}")
        if self.codec.checksum and zarr_layout.checksum(values) != bytes(trailer[:-1]):
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} fails its checksum (the file is damaged)")
        return True

    def _decode(self, key: str, codec: Codec, rows: np.ndarray, blob: bytes | None) -> bool:
        if blob is None:
            return False
        try:
            codec.decode_into(blob, rows)
        except Exception as exc:
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} does not decode ({exc})") from None
        return True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.io.shutdown(wait=True)
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.shard_maps is not None:
            self.shard_maps.close()
        if self._lock_finalizer is not None:
            self._lock_finalizer()  # releases the writer lock (once)

