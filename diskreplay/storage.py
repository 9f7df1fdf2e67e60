"""The Zarr-backed store of a buffer: staged writes, the commit protocol and the chunk cache.

Writes. Rows are copied into the chunk they belong to, which sits pinned in the chunk cache
(its *staging* slot). A chunk that fills up is *sealed* and written whole, once; `flush` also
writes each lane's partial tail chunk. The whole chunks an append covers skip staging: they are
written straight from the caller's arrays before `append` returns. No zarr-python call is made per
row or per chunk.

Commit protocol. Chunk objects are written first; then one small JSON object, ``commit.json``,
is replaced atomically (temp + fsync + rename locally, one PUT on object stores). It holds, per
lane, ``committed`` (steps visible to readers) and ``lower`` (first visible step). Readers and a
reopening writer see exactly the steps ``[max(lower, committed - capacity), committed)`` of the last
commit. In a full ring, writing a chunk destroys the oldest rows of its slots, so before any such
write the writer first commits a raised ``lower``: a reader never reads a row that is being
overwritten, and a crash at any point leaves the last commit's visible rows intact.

Reads. `gather` maps steps to cache slots; missing chunks are fetched concurrently (a thread
pool; fsspec's async gather for remote stores), decoded once into their slot, and every field is
then gathered with one ``take``.

Readers that have not refreshed. A reader keeps the window of the commit it last adopted
(``open``/``refresh``), while the writer goes on. Cached chunks stay right for that window: a row
of a step never changes, and a cached copy predates any overwrite of it. A chunk *fetched* later
may already hold the writer's next round in a ring; but the writer commits a raised ``lower``
before overwriting. So after a reader (ring buffers only) fetches chunks, it re-reads
``commit.json`` (one small GET) and, if the newest commit's first visible step has passed any row
it asked for from those chunks, it drops them, adopts that commit (as `refresh` would) and raises
`StaleReadError` (an IndexError) naming the rows: the caller draws again from the new window.
If only rows it did not ask for were retired, it returns the rows asked for but does not keep
those chunks cached (their other slots may hold the next round). Every cached chunk is thus
right for every step of the reader's window that maps to it, so cache hits need no check; nor
do dataset-mode buffers (they never overwrite a row). Rows a reader returns are never from a
half-written or newer ring round.

The writer lock. A writer (`create`, `open` with ``mode="r+"``) holds ``writer.lock`` (see
`diskreplay.lock`) from open to `close`; readers take none.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import mapped, zarr_layout
from .cache import ChunkCache
from .chunkstore import ChunkStore, LocalChunkStore, is_local, open_chunkstore
from .errors import CorruptBufferError, NotABufferError, ReadOnlyError, StaleReadError
from .lock import WriterLock
from .lanes import LaneLayout
from .schema import Field, Schema
from .zarr_layout import Codec

COMMIT_KEY = "commit.json"
INCOMPLETE_IMPORT_KEY = "import-incomplete.json"
DEFAULT_CACHE_BYTES = 512 * 2**20
SYNC_FILES_ONE_BY_ONE = 32
"""Above this many files to make durable, one ``syncfs`` is cheaper than an fsync per file."""


def default_io_threads(url: str) -> int:
    """Local disk is bound by CPU and the filesystem: threads beyond the cores only contend.
    Object stores are bound by latency: many requests in flight."""
    return min(4, os.cpu_count() or 1) if is_local(url) else 16


@dataclass
class Commit:
    """The durable cursor record: which steps of each lane are visible."""

    sequence: int
    committed: np.ndarray
    lower: np.ndarray
    time: float
    extra: dict[str, Any]

    def to_bytes(self) -> bytes:
        return json.dumps({
            "sequence": self.sequence, "time": self.time,
            "committed": self.committed.tolist(), "lower": self.lower.tolist(), "extra": self.extra,
        }).encode()

    @classmethod
    def from_bytes(cls, blob: bytes, url: str, num_envs: int) -> "Commit":
        try:
            data = json.loads(blob)
            commit = cls(int(data["sequence"]), np.asarray(data["committed"], dtype=np.int64),
                         np.asarray(data["lower"], dtype=np.int64), float(data["time"]), data["extra"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptBufferError(f"{url!r}: {COMMIT_KEY} is unreadable ({exc})") from None
        if commit.committed.shape != (num_envs,) or commit.lower.shape != (num_envs,):
            raise CorruptBufferError(f"{url!r}: {COMMIT_KEY} has cursors for the wrong number of lanes")
        return commit


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


class Storage:
    """Chunk I/O, staging, the cache and commits for one buffer. Not thread-safe (one writer)."""

    def __init__(self, url: str, config: dict[str, Any], commit: Commit, *, mode: str,
                 storage_options: dict | None, cache_bytes: int, io_threads: int | None,
                 writer_lock: WriterLock | None = None, store: ChunkStore | None = None,
                 memory_map: bool | None = None):
        self.url = url
        self.mode = mode
        self.storage_options = storage_options
        self.config = config
        self.schema = Schema.from_json(config["fields"])
        self.layout = LaneLayout(config["num_envs"], config["lane_capacity"], config["chunk_rows"])
        self.codec = Codec(config["compression"], config["level"])
        self.key_separator = config["chunk_key_separator"]
        self.io_threads = io_threads or default_io_threads(url)
        self.store: ChunkStore = store or open_chunkstore(url, storage_options, concurrency=self.io_threads)
        self.writer_lock = writer_lock
        # released on close, or when the storage is collected / the interpreter exits unclosed
        self._lock_finalizer = weakref.finalize(self, writer_lock.release) if writer_lock else None
        self.commit_record = commit
        self.committed = commit.committed.copy()
        self.lower = commit.lower.copy()
        if mode != "r":
            # After a crash between a retire commit and the next commit, ``lower`` may exceed
            # ``committed``: the steps in between were never committed and are re-added fresh.
            self.lower = np.minimum(self.lower, self.committed)
        self.total = commit.committed.copy()
        self.staging = np.full(self.layout.num_envs, -1, dtype=np.int64)
        self.dirty = np.zeros(self.layout.num_envs, dtype=bool)
        self.sealed: list[tuple[int, int, int]] = []
        self.unsynced: set[str] = set()
        slots = ChunkCache.slots_for_budget(self.schema, self.layout.chunk_rows, cache_bytes,
                                            minimum=2 * self.layout.num_envs + 2)
        if self.layout.lane_capacity is not None:  # more slots than a ring has chunks are dead weight
            slots = min(slots, max(2 * self.layout.num_envs + 2,
                                   self.layout.num_envs * self.layout.chunks_per_lane()))
        self.cache = ChunkCache(self.schema, self.layout.num_envs, self.layout.chunk_rows, slots,
                                self.layout.chunks_per_lane(int(self.total.max(initial=0))))
        self.io = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="diskreplay-io")
        self.mapped = None
        if memory_map is None:  # map only where it is faster: when the rows do not fit the cache
            rows = self.layout.lane_capacity or int(self.total.max(initial=0))
            memory_map = self.layout.num_envs * rows * self.schema.row_bytes > cache_bytes
        if memory_map and self.codec.raw and isinstance(self.store, LocalChunkStore) and mapped.supported():
            self.mapped = mapped.MappedChunks(self.store, self.chunk_key, self.schema, self.layout, cache_bytes,
                                              self.layout.chunks_per_lane(int(self.total.max(initial=0))))
        self.group_lane_rows = config.get("lane_rows_allocated", 0)

    # ---- creation and opening -------------------------------------------------------------

    @classmethod
    def create(cls, url: str, schema: Schema, *, num_envs: int, lane_capacity: int | None,
               chunk_rows: int, compression: str | None, level: int, storage_options: dict | None,
               cache_bytes: int, io_threads: int | None, extra: dict[str, Any],
               options: dict[str, Any] | None = None, break_lock: bool = False,
               commit: bool = True, memory_map: bool | None = None) -> "Storage":
        zarr_layout.check_schema_compatible(schema)
        codec = Codec(compression, level)
        config = {"fields": schema.to_json(), "num_envs": num_envs, "lane_capacity": lane_capacity,
                  "chunk_rows": chunk_rows, "compression": compression, "level": level,
                  "chunk_key_separator": zarr_layout.CHUNK_KEY_SEPARATOR, **(options or {})}
        store = open_chunkstore(url, storage_options, concurrency=io_threads or default_io_threads(url))
        lock = WriterLock(url, store=store)
        holder = lock.holder()
        if holder is not None and not break_lock:  # refuse before destroying anything
            lock.acquire()
        store.delete(COMMIT_KEY)
        group = zarr_layout.open_group(url, "w", storage_options)  # clears the location
        lock.acquire(break_lock)
        try:
            zarr_layout.create_arrays(group, schema, num_envs, lane_capacity or 0, chunk_rows, codec, config)
            record = Commit(0, np.zeros(num_envs, np.int64), np.zeros(num_envs, np.int64), time.time(), extra)
            if commit:
                store.put(COMMIT_KEY, record.to_bytes(), durable=True)
            return cls(url, config, record, mode="r+", storage_options=storage_options,
                       cache_bytes=cache_bytes, io_threads=io_threads, writer_lock=lock, store=store,
                       memory_map=memory_map)
        except BaseException:
            lock.release()
            raise

    @classmethod
    def open(cls, url: str, *, mode: str, storage_options: dict | None, cache_bytes: int,
             io_threads: int | None, break_lock: bool = False, memory_map: bool | None = None) -> "Storage":
        store = open_chunkstore(url, storage_options, concurrency=io_threads or default_io_threads(url))
        blob = store.get(COMMIT_KEY)
        if blob is None:
            if store.exists(INCOMPLETE_IMPORT_KEY):
                raise NotABufferError(f"{url!r} holds an interrupted import (no {COMMIT_KEY}); "
                                      f"import it again with overwrite=True")
            raise NotABufferError(f"{url!r} is not a diskreplay buffer (no {COMMIT_KEY})")
        try:
            group = zarr_layout.open_group(url, "r", storage_options)
        except Exception as exc:  # zarr raises several types for "no group here"
            raise NotABufferError(f"{url!r} is not a diskreplay buffer ({exc})") from None
        config = zarr_layout.read_config(group, url)
        commit = Commit.from_bytes(blob, url, config["num_envs"])
        lock = WriterLock(url, store=store).acquire(break_lock) if mode != "r" else None
        try:
            if lock is not None:  # the commit may have moved while we waited for the lock
                blob = store.get(COMMIT_KEY)
                if blob is None:
                    raise NotABufferError(f"{url!r} is not a diskreplay buffer (no {COMMIT_KEY})")
                commit = Commit.from_bytes(blob, url, config["num_envs"])
            storage = cls(url, config, commit, mode=mode, storage_options=storage_options,
                          cache_bytes=cache_bytes, io_threads=io_threads, writer_lock=lock, store=store,
                          memory_map=memory_map)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        # the smallest: a writer killed while resizing leaves some arrays grown, some not
        storage.group_lane_rows = min(group[name].shape[1] for name in storage.schema)
        return storage

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
        if self.mode == "r":
            return self.committed_window()
        lo = np.maximum(self.lower, self.layout.oldest(self.total))
        return np.minimum(lo, self.total), self.total

    # ---- writes ----------------------------------------------------------------------------

    def append(self, lane: int, rows: dict[str, np.ndarray], count: int) -> tuple[int, int]:
        """Stage ``count`` steps for one lane. Returns the steps actually stored ``[first, end)``.

        In a ring, only the last ``lane_capacity`` of them are stored (the others would be
        overwritten at once).
        """
        self._require_writable()
        start = int(self.total[lane])
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
            if len(self.sealed) * 2 > self.cache.slots:
                self.write_sealed(durable=False)
        self.total[lane] = start + count
        self._write_whole(lane, rows, whole)
        return start + skip, start + count

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
        self._put_chunks([(self.chunk_key(name, lane, chunk), rows[name][i:i + n], self._never_committed(lane, chunk))
                          for chunk, i in whole for name in self.schema.fields], durable=False)
        if self.mapped is not None:
            self.mapped.forget(lane, np.array([chunk for chunk, _ in whole]))

    def _staging_slot(self, lane: int, chunk: int, chunk_first_step: int) -> int:
        if self.staging[lane] == chunk:
            return int(self.cache.table[lane, chunk])
        if self.staging[lane] >= 0:
            self._seal(lane)
        self.cache.ensure_chunks(chunk + 1)
        slot = int(self.cache.table[lane, chunk])
        if slot >= 0:
            self.cache.pinned[slot] = True
        else:
            slot = int(self.cache.assign(np.array([lane]), np.array([chunk]))[0])
            if self._holds_data(lane, chunk_first_step):
                self._fetch_into([(lane, chunk, slot)], must_exist=self._holds_visible(lane, chunk_first_step))
            else:  # a recycled slot holds another chunk's rows: never write those into this chunk
                for name in self.cache.slabs:
                    self.cache.chunk_rows_of(name, slot)[...] = 0
        self.staging[lane] = chunk
        return slot

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

        For fields derived after the fact (episodic returns). Chunks already written are read,
        patched in the cache and queued to be rewritten with the next chunk writes.
        """
        self._require_writable()
        count = len(next(iter(values.values())))
        step, i = first, 0
        while i < count:
            piece = self.layout.piece_length(step, count - i)
            chunk, offset = divmod(self.layout.slot(step), self.layout.chunk_rows)
            base = self._patchable_slot(lane, chunk) * self.layout.chunk_rows + offset
            for name, value in values.items():
                self.cache.slabs[name][base:base + piece] = value[i:i + piece]
            i += piece
            step += piece

    def _patchable_slot(self, lane: int, chunk: int) -> int:
        if self.staging[lane] == chunk:
            self.dirty[lane] = True
            return int(self.cache.table[lane, chunk])
        for sealed_lane, sealed_chunk, slot in self.sealed:
            if (sealed_lane, sealed_chunk) == (lane, chunk):
                return slot
        slot = int(self.cache.table[lane, chunk])
        if slot >= 0:
            self.cache.pinned[slot] = True
        else:
            slot = int(self.cache.assign(np.array([lane]), np.array([chunk]))[0])
            self._fetch_into([(lane, chunk, slot)], must_exist=True)
        self.sealed.append((lane, chunk, slot))
        return slot

    def write_sealed(self, durable: bool) -> None:
        """Write every sealed chunk (and nothing else), after retiring the rows they overwrite."""
        self._write_chunks(self.sealed, durable)
        self._release_sealed()

    def _release_sealed(self) -> None:
        """Unpin written sealed chunks, except a lane's current staging chunk (a ring that wraps
        within one append re-stages a chunk it already sealed)."""
        for _, _, slot in self.sealed:
            self.cache.pinned[slot] = False
        self.sealed = []
        lanes = np.flatnonzero(self.staging >= 0)
        self.cache.pinned[self.cache.table[lanes, self.staging[lanes]]] = True

    def flush(self, durable: bool = True, extra: dict[str, Any] | None = None) -> None:
        """Write sealed chunks and every lane's partial tail chunk, then commit."""
        self._require_writable()
        tails = [(lane, int(self.staging[lane]), int(self.cache.table[lane, self.staging[lane]]))
                 for lane in np.flatnonzero(self.dirty)]
        self._write_chunks(self.sealed + tails, durable)
        self._release_sealed()
        self.dirty[:] = False
        if durable:
            self._sync_written()
        self._grow_arrays()
        self.commit(self.total.copy(), np.maximum(self.lower, self.layout.oldest(self.total)),
                    durable, extra)

    def _write_chunks(self, chunks: list[tuple[int, int, int]], durable: bool) -> None:
        if not chunks:
            return
        self._retire_overwritten(durable)
        self._put_chunks([(self.chunk_key(name, lane, chunk), self.cache.chunk_rows_of(name, slot),
                           self._never_committed(lane, chunk))
                          for lane, chunk, slot in chunks for name in self.schema.fields], durable)
        if self.mapped is not None:
            for lane, chunk, _ in chunks:
                self.mapped.forget(lane, np.array([chunk]))

    def _never_committed(self, lane: int, chunk: int) -> bool:
        """No commit ever covered a row of this chunk (its first-round steps are all newer)."""
        return int(self.committed[lane]) <= chunk * self.layout.chunk_rows

    def _put_chunks(self, work: list[tuple[str, np.ndarray, bool]], durable: bool) -> None:
        """Write ``(key, rows, fresh)`` chunks on the I/O threads, a few long jobs rather than
        one per chunk (queueing a job costs about as much as writing a small chunk)."""
        batches = [work[k::self.io_threads] for k in range(min(self.io_threads, len(work)))]
        for job in [self.io.submit(self._put_batch, batch, durable) for batch in batches]:
            job.result()

    def _put_batch(self, work: list[tuple[str, np.ndarray, bool]], durable: bool) -> None:
        for key, rows, fresh in work:
            self._put_chunk(key, rows, durable, fresh)

    def _put_chunk(self, key: str, rows: np.ndarray, durable: bool, fresh: bool) -> None:
        """Write one chunk object. A chunk no commit ever covered is written in place (local
        disk: no temp file or rename); a torn write of it is invisible to every commit."""
        data = self.codec.encode(rows)
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
        # Always durable: a chunk overwrite that reaches the disk before this commit would, after
        # a power loss, show new rows under old step numbers. One small fsync per chunk write batch.
        oldest = self.layout.oldest(self.total)
        if np.any(oldest > self.lower):
            self.commit(self.committed, np.maximum(self.lower, oldest), True, self.commit_record.extra)

    def _grow_arrays(self) -> None:
        if self.layout.lane_capacity is not None:
            return
        rows = int(self.total.max(initial=0))
        if rows > self.group_lane_rows:
            group = zarr_layout.open_group(self.url, "r+", self.storage_options)
            zarr_layout.resize_lanes(group, self.schema, self.layout.num_envs, rows)
            self.group_lane_rows = rows

    def commit(self, committed: np.ndarray, lower: np.ndarray, durable: bool,
               extra: dict[str, Any] | None) -> None:
        record = Commit(self.commit_record.sequence + 1, committed.copy(), lower.copy(), time.time(),
                        self.commit_record.extra if extra is None else extra)
        self.store.put(COMMIT_KEY, record.to_bytes(), durable)
        self.commit_record = record
        self.committed = record.committed.copy()
        self.lower = record.lower.copy()

    def _require_writable(self) -> None:
        if self.mode == "r":
            raise ReadOnlyError(f"buffer {self.url!r} was opened read-only (mode='r'); open it with mode='r+' to write")

    # ---- reads -----------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Reader: adopt the newest commit, dropping cached chunks it rewrote. True if it changed."""
        record = self._read_commit()
        if record.sequence == self.commit_record.sequence:
            return False
        self._adopt(record)
        return True

    def _read_commit(self) -> Commit:
        blob = self.store.get(COMMIT_KEY)
        if blob is None:
            raise CorruptBufferError(f"{self.url!r}: {COMMIT_KEY} disappeared")
        return Commit.from_bytes(blob, self.url, self.layout.num_envs)

    def _adopt(self, record: Commit) -> None:
        for lane in range(self.layout.num_envs):
            old = int(self.committed[lane])
            first = old - old % self.layout.chunk_rows
            rewritten = self.layout.chunks_between(first, int(record.committed[lane]))
            self.cache.invalidate(lane, rewritten)
            if self.mapped is not None:
                self.mapped.forget(lane, rewritten)
        self.commit_record = record
        self.committed, self.lower = record.committed.copy(), record.lower.copy()
        self.total = self.committed.copy()
        self.cache.ensure_chunks(self.layout.chunks_per_lane(int(self.total.max(initial=0))))

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Rows at (lane, step) of every field (or of ``names``): arrays with leading axis ``len(step)``.

        ``out`` may hold, for some of those fields, C-contiguous arrays of exactly that shape and
        the field's dtype: their rows are gathered straight into them (no extra copy), and they
        are what is returned for those fields. The caller guarantees the steps lie inside `window`.
        """
        names = names or tuple(self.schema.fields)
        chunk, offset = self.layout.chunk_and_offset(step)
        slots = self.cache.table[lane, chunk]
        cached = self.mapped is None and (slots >= 0).all()
        if cached:
            self.cache.touch(slots)
            index = slots * self.layout.chunk_rows + offset
            if out is None:  # the hot path
                return {name: self.cache.slabs[name].take(index, axis=0) for name in names}
        given = out or {}
        out = {name: output_rows(name, self.schema[name], len(step), given.get(name)) for name in names}
        if cached:
            for name, rows in out.items():
                _take_into(self.cache.slabs[name], index, rows)
        elif self.mapped is not None:
            self._gather_mapped(lane, step, chunk, offset, slots, out)
        else:
            self._gather_with_misses(lane, chunk, offset, slots, step, out)
        return out

    def _gather_mapped(self, lane, step, chunk, offset, slots, out) -> None:
        """Rows of chunks the writer holds in the cache (staged, or written but pinned) come from
        the cache; all others from the memory-mapped chunk files."""
        cached = slots >= 0
        if cached.all():
            index = slots * self.layout.chunk_rows + offset
            for name, rows in out.items():
                _take_into(self.cache.slabs[name], index, rows)
            return
        filed = ~cached
        lanes, chunks = self.mapped.ensure(lane[filed], chunk[filed])
        if len(chunks):
            for ln, stale in self._check_not_overwritten(lane[filed], step[filed], lanes, chunks):
                self.mapped.forget(ln, stale)
        if not cached.any():
            for name, rows in out.items():
                self.mapped.take(name, lane, chunk, offset, out=rows)
        else:
            index = slots[cached] * self.layout.chunk_rows + offset[cached]
            for name, rows in out.items():
                rows[filed] = self.mapped.take(name, lane[filed], chunk[filed], offset[filed])
                rows[cached] = self.cache.slabs[name].take(index, axis=0)
        self.mapped.bound_resident()

    def _gather_with_misses(self, lane, chunk, offset, slots, step, out) -> None:
        miss = slots < 0
        width = self.cache.table.shape[1]
        keys = np.unique(lane[miss] * width + chunk[miss])
        room = self.cache.evictable()
        if room == 0:
            raise RuntimeError("chunk cache has no free slot: raise cache_bytes")
        todo = ~miss
        self._fill(out, todo, lane, chunk, offset)
        for start in range(0, len(keys), room):
            group = keys[start:start + room]
            self._load(group // width, group % width)
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
        if self.mode != "r" or self.layout.lane_capacity is None or not len(step):
            return []
        record = self._read_commit()
        if record.sequence == self.commit_record.sequence:
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
        old = self.commit_record.sequence
        self._adopt(record)
        ids = (step[gone] * self.layout.num_envs + lane[gone])[:5].tolist()
        raise StaleReadError(
            f"{self.url!r}: rows {ids}{'...' if gone.sum() > 5 else ''} were overwritten by the writer "
            f"after this reader's commit {old}; the reader now follows commit {record.sequence} "
            f"(first readable steps per lane {first.tolist()}): sample again")

    def _fill(self, out, mask, lane, chunk, offset) -> None:
        if not mask.any():
            return
        slots = self.cache.table[lane[mask], chunk[mask]]
        self.cache.touch(slots)
        index = slots * self.layout.chunk_rows + offset[mask]
        for name, rows in out.items():
            rows[mask] = self.cache.slabs[name].take(index, axis=0)

    def _load(self, lanes: np.ndarray, chunks: np.ndarray) -> None:
        slots = self.cache.assign(lanes, chunks)
        try:
            self._fetch_into(list(zip(lanes.tolist(), chunks.tolist(), slots.tolist())), must_exist=True)
        except BaseException:
            self.cache.evict(slots)
            raise
        finally:
            self.cache.pinned[slots] = False

    def _fetch_into(self, targets: list[tuple[int, int, int]], must_exist: bool) -> None:
        """Read chunks into their slots; a missing chunk is an error if ``must_exist`` else zeros."""
        work = [(self.chunk_key(name, lane, chunk), self.cache.chunk_rows_of(name, slot))
                for lane, chunk, slot in targets for name in self.schema.fields]
        if isinstance(self.store, LocalChunkStore) and self.codec.raw:
            found = [self._read_raw(key, rows) for key, rows in work]  # memcpy-bound: threads only add overhead
        else:
            blobs = self.store.get_many([key for key, _ in work])
            found = list(self.io.map(lambda kb: self._decode(kb[0][0], kb[1], kb[0][1]), zip(work, blobs)))
        for (key, rows), ok in zip(work, found):
            if not ok:
                if must_exist:
                    raise CorruptBufferError(
                        f"{self.url!r}: chunk {key!r} is missing, but the last commit says it holds rows")
                rows[...] = 0

    def _read_raw(self, key: str, rows: np.ndarray) -> bool:
        got = self.store.read_into(key, memoryview(rows.reshape(-1).view(np.uint8)))
        if got is not None and got != rows.nbytes:
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} has {got} bytes, expected {rows.nbytes}")
        return got is not None

    def _decode(self, key: str, blob: bytes | None, rows: np.ndarray) -> bool:
        if blob is None:
            return False
        try:
            self.codec.decode_into(blob, rows)
        except Exception as exc:
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} does not decode ({exc})") from None
        return True

    def close(self) -> None:
        self.io.shutdown(wait=True)
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self._lock_finalizer is not None:
            self._lock_finalizer()  # releases the writer lock (once)
