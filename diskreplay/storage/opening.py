"""Creating and opening a `Storage`: metadata planned and checked before anything is written,
the store, the writer lock and the read paths chosen for the buffer's size and store."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from ..errors import CorruptBufferError, NotABufferError, ResizeInProgressError
from ..format.codecs import Codec
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.keys import (
    COMMIT_KEY,
    FORMAT,
    GROUP_KEY,
    INCOMPLETE_IMPORT_KEY,
    MAX_METADATA_BYTES,
    OWN_PREFIXES,
    array_key,
    failed_write_error,
    objects_prefix,
)
from ..format.layout import (
    ArrayMeta,
    buffer_codec,
    checked_arrays,
    field_codecs,
    lane_rows,
    metadata_documents,
    read_config,
    read_layout,
)
from ..format.pins import KEPT, pin_prefix
from ..format.shard_table import ShardTable
from ..io.backends import open_chunkstore
from ..io.lock import WriterLock
from ..io.mmap import map_budget
from ..io.mmap import supported as mmap_supported
from ..io.retry import RetryPolicy
from ..io.store import Blob, ChunkStore, as_bytes, broken_path, is_local, local_path, objects_at
from ..io.threads import Threads
from . import resizing
from .buffer_storage import BufferStorage
from .cache import ChunkCache
from .chunk_io import ChunkIO, default_io_threads
from .commit_log import Announcer, CommitLog, state_reads
from .cursors import Cursors
from .file_maps import FileMaps
from .loading import ChunkLoader
from .log import Log
from .mapped import MappedChunks
from .pins import hold_newest, hold_pinned, not_kept, pinned_record, read_index
from .point_reads import PointReads
from .ragged_reads import RaggedReads
from .read_ahead import ReadAhead
from .reader import ChunkReader
from .row_reads import RowReads
from .shard_maps import ShardMaps
from .shard_tables import TabledIndexes, Tables, inner_chunks, read_tables, sharded_fields
from .sizing import DEFAULT_CACHE_BYTES, cache_slots, fields_read_by_rows
from .stale import RetiredCheck
from .union import CommitIndex, UnionLog, UnionStorage, union_threads
from .warm import Warmer
from .writer import StagingWriter


@dataclass(frozen=True)
class Options:
    """How a storage is opened: see `ReplayBuffer.create` for each."""

    storage_options: Mapping[str, Any] | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    io_threads: int | None = None
    memory_map: bool | None = None
    break_lock: bool = False
    retry: RetryPolicy | None = None
    lease_s: float | None = None
    announcer: Announcer | None = None
    """A shard's writer: where it announces its commits."""


@dataclass(frozen=True)
class NewStorage:
    """A buffer to be created: its location, config and metadata documents (``{key: bytes}``)."""

    url: str
    config: BufferConfig
    documents: dict[str, bytes]


def plan_storage(url: str, config: BufferConfig, cache_bytes: int) -> NewStorage:
    """A new buffer's metadata, built and checked before anything is written.

    Raises ValueError / SchemaError for a bad codec, level, schema or ``cache_bytes``."""
    Codec(config.compression, config.level)
    documents = metadata_documents(config, config.lane_capacity or 0)
    read_layout(documents.get, url)  # what open will check, checked now
    cache_slots(config.schema, config.layout, cache_bytes, writer=True)
    return NewStorage(url, config, documents)


def create_storage(plan: NewStorage, options: Options, commit: bool = True) -> BufferStorage:
    """Write a planned buffer's metadata (the location already cleared) and open it for
    writing. ``commit=False`` writes no commit record yet (the location is not a buffer until
    the first flush)."""
    store = _store(plan.url, options)
    config, arrays = read_layout(plan.documents.get, plan.url)
    objects = objects_at(store, objects_prefix(config.format))
    lock = WriterLock(plan.url, objects, options.lease_s).acquire(options.break_lock)
    try:
        objects.delete(COMMIT_KEY)
        for key, blob in sorted(plan.documents.items(), key=lambda kv: kv[0] == GROUP_KEY):
            store.put(key, blob, durable=True)  # the arrays, then the group
        record = CommitRecord.empty(config.num_envs, time.time())
        if commit:
            objects.put(COMMIT_KEY, record.to_bytes(), durable=True)
        return _writable(plan.url, store, objects, config, arrays, record, "r+", lock, options)
    except BaseException:
        lock.release()
        raise


def open_storage(url: str, mode: str, options: Options, at_commit: int | str | None = None,
                 with_state: bool = False) -> BufferStorage:
    """Open an existing buffer's storage, read-only (``mode="r"``) or as its writer (``"r+"``);
    ``at_commit``: read-only, held at that commit (`open_at_commit`); ``with_state``: read the
    state saved with the commit beside the fields' documents, for the log's first `load_state`.

    Raises NotABufferError, CorruptBufferError (naming the object and field), LockedError,
    CommitNotKeptError; ResizeInProgressError: a reader, while a change of capacity is under
    way (a writer finishes it)."""
    store = _store(url, options)
    now = with_state and mode == "r" and at_commit is None  # a writer reads its metadata again, locked
    try:
        config, arrays, record, read_ahead = _read_buffer(url, store, now)
    except ResizeInProgressError:
        if mode == "r":
            raise
        config = read_config(functools.partial(store.get, limit=MAX_METADATA_BYTES + 1), url)
    objects = objects_at(store, objects_prefix(config.format))
    if at_commit is not None:
        return open_at_commit(url, store, objects, (config, arrays, record), at_commit, options)
    lock = WriterLock(url, objects, options.lease_s).acquire(options.break_lock) if mode != "r" else None
    try:
        if lock is not None:  # the commit may have moved while we waited for the lock
            config, arrays, record, read_ahead = _read_writable(url, store, objects, with_state)
        return _writable(url, store, objects, config, arrays, record, mode, lock, options, read_ahead=read_ahead)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def open_union_storage(url: str, parts: Sequence[str], options: Options,
                       index: CommitIndex | None = None) -> UnionStorage:
    """The buffers at ``parts`` (locations under ``url``, all with one config), read-only as one
    storage whose lanes are theirs side by side: one cache, one read path, chunks read through
    the store at ``url``; its log is a `UnionLog` of theirs. The parts' metadata is read on the
    union's threads, all parts at once on a remote store (`_part_logs`). ``index``: the root's
    commit index (None: it declares none).

    Raises NotABufferError / CorruptBufferError naming the part (one whose config differs too)."""
    threads = union_threads(len(parts))
    try:
        logs = _part_logs(parts, options, threads)
    except BaseException:
        threads.shutdown()
        raise
    first = logs[0]
    for other in logs[1:]:
        if other.config.to_json() != first.config.to_json():
            threads.shutdown()
            raise CorruptBufferError(f"{other.url!r}: its config differs from {first.url!r}'s "
                                     f"({other.config.to_json()} vs {first.config.to_json()})")
    config = replace(first.config, num_envs=len(logs) * first.config.num_envs)
    log = UnionLog(url, logs, config.layout, threads)
    root = _store(url, options)
    prefixes = [part[len(url.rstrip("/")) + 1:] + "/" for part in parts]
    io = ChunkIO(root, config, field_codecs(buffer_codec(first.arrays, first.url), config),
                 options.io_threads or default_io_threads(url), prefixes)
    cache, loader, reader, files, ragged = _read_side(url, config, first.arrays, log, io, options)
    return UnionStorage(url, config, log, io, cache, loader, reader, files, ragged, options.storage_options, index)


def _part_logs(parts: Sequence[str], options: Options, threads: Threads) -> list[CommitLog]:
    """Each part's read-only log, its metadata read and checked (`_read_buffer`: its group, its
    commit record, then its fields' documents together): on ``threads`` for a remote store,
    so that every part's reads are in flight at once (a local read costs microseconds: in order).
    Raises the error of the first part, in order, that fails."""
    def part_log(part: str) -> CommitLog:
        store = _store(part, options)
        config, arrays, record, _ = _read_buffer(part, store)
        cursors = Cursors(config.layout, record.committed.copy(), record.lower.copy(), frozen=True)
        objects = objects_at(store, objects_prefix(config.format))
        return CommitLog(part, store, objects, config, arrays, record, cursors, "r", None)
    if len(parts) < 2 or is_local(parts[0]):
        return [part_log(part) for part in parts]
    return list(threads.map(part_log, parts))


def open_at_commit(url: str, store: ChunkStore, objects: ChunkStore,
                   read: tuple[BufferConfig, dict[str, ArrayMeta], CommitRecord], at: int | str,
                   options: Options) -> BufferStorage:
    """A reader of the buffer at commit ``at`` (a sequence, or a pin's name), held there: a kept
    pin's copy (its record, state and chunks), else the newest commit itself (``read``: the
    buffer's metadata and newest record), read until the writer retires rows of it.

    Raises CommitNotKeptError (naming the commits that can be opened), CorruptBufferError."""
    config, arrays, newest = read
    if isinstance(at, bool) or not isinstance(at, (int, np.integer, str)):
        raise TypeError(f"at_commit: expected a commit sequence (int) or a pin's name (str), got {at!r:.80}")
    at = at if isinstance(at, str) else int(at)
    index = read_index(objects, url)
    pin = index.find(at)
    if pin is not None and pin.status == KEPT:
        copy, record = objects_at(objects, pin_prefix(pin.commit)), pinned_record(objects, url, pin, config.num_envs)
        if config.lane_capacity is None:
            record.check_covered(url, lane_rows(arrays))
        storage = _writable(url, store, copy, config, arrays, record, "r", None, options, chunks=copy,
                            hold=hold_pinned)
    elif at == newest.sequence:
        hold = functools.partial(hold_newest, index=lambda: read_index(objects, url))
        storage = _writable(url, store, objects, config, arrays, newest, "r", None, options, hold=hold)
    else:
        raise not_kept(url, at, index, newest.sequence)
    return storage


def _writable(url: str, store: ChunkStore, objects: ChunkStore, config: BufferConfig, arrays: dict[str, ArrayMeta],
              record: CommitRecord, mode: str, lock: WriterLock | None, options: Options,
              chunks: ChunkStore | None = None,
              hold: Callable[[CommitLog], Callable[[], CommitRecord]] | None = None,
              read_ahead: Mapping[str, Blob | None] | None = None) -> BufferStorage:
    """One buffer's storage, as its writer (``mode="r+"``) or a reader of it; ``chunks``: where
    its chunks are read (default: ``store``, with its arrays); ``hold``: holds a reader's log at
    its commit (`pins.hold_pinned`); ``read_ahead``: objects of ``record``'s state, read already."""
    cursors = Cursors(config.layout, record.committed.copy(), record.lower.copy(), frozen=mode == "r")
    log = CommitLog(url, store, objects, config, arrays, record, cursors, mode, lock,
                    options.announcer if mode == "r+" else None, hold, read_ahead)
    io = ChunkIO(store if chunks is None else chunks, config, field_codecs(buffer_codec(arrays, url), config),
                 options.io_threads or default_io_threads(url))
    cache, loader, reader, files, ragged = _read_side(url, config, arrays, log, io, options, _tables(url, log, io))
    writer = (StagingWriter(cursors, log, io, cache, loader, files.forget, keep_written=files.mapped is None)
              if mode != "r" else None)
    return BufferStorage(url, config, log, io, cache, loader, reader, writer, files, ragged, options.storage_options)


def check_location(url: str) -> None:
    """Raise NotABufferError if the local ``url`` is a file, a symbolic link to nothing, or a
    path that runs into a loop of symbolic links."""
    if is_local(url) and os.path.isfile(local_path(url)):
        raise NotABufferError(f"{url!r} is a file, not a diskreplay buffer (a buffer is a directory)")
    problem = broken_path(url)
    if problem is not None:
        raise NotABufferError(f"{url!r} is not a diskreplay buffer ({problem})")


class Metadata(NamedTuple):
    """A buffer's validated metadata and commit record, as `_read_buffer` read them."""

    config: BufferConfig
    arrays: dict[str, ArrayMeta]
    record: CommitRecord
    read_ahead: dict[str, Blob | None]
    """The objects of the record's state, read beside the metadata (`state_reads`; empty: none)."""


def _read_buffer(url: str, store: ChunkStore, with_state: bool = False) -> Metadata:
    """A buffer's validated metadata and commit record (``with_state``: and the objects of the
    state the record names, read beside the fields' documents). Raises NotABufferError,
    CorruptBufferError."""
    check_location(url)
    config, blob = _config_and_commit(url, store)
    objects = objects_at(store, objects_prefix(config.format))
    if blob is None:
        if objects.exists(INCOMPLETE_IMPORT_KEY):
            raise NotABufferError(f"{url!r} holds an interrupted import (no {COMMIT_KEY}); "
                                  f"import it again with overwrite=True")
        raise NotABufferError(f"{url!r} is not a diskreplay buffer (no {COMMIT_KEY})")
    resizing.resize_pending(url, blob)  # before the arrays: they may be either capacity's then
    try:
        record: CommitRecord | CorruptBufferError = CommitRecord.from_bytes(blob, url, config.num_envs)
    except CorruptBufferError as exc:  # said after the documents: a config they contradict is named there
        record = exc
    # after the commit (they cover its rows), every field's at once, and its state beside them
    keys = [array_key(name) for name in config.schema.fields]
    beside = state_reads(record) if with_state and isinstance(record, CommitRecord) else []
    fetched, read_ahead = _documents(store, keys, objects, beside)
    arrays = checked_arrays(fetched.get, url, config)
    if isinstance(record, CorruptBufferError):
        raise record
    if config.lane_capacity is None:
        record.check_covered(url, lane_rows(arrays))
    return Metadata(config, arrays, record, read_ahead)


def _documents(store: ChunkStore, keys: list[str], objects: ChunkStore, beside: list[tuple[list[str], int | None]]
               ) -> tuple[dict[str, bytes | None], dict[str, Blob | None]]:
    """The metadata documents ``keys``, and the reads ``beside`` of ``objects`` (``(keys,
    limit)``), on threads of their own where a read waits for a server: one round trip for all."""
    def documents() -> dict[str, bytes | None]:
        return dict(zip(keys, map(as_bytes, store.get_many(keys, limit=MAX_METADATA_BYTES + 1))))

    def read(wanted: list[str], limit: int | None) -> dict[str, Blob | None]:
        return dict(zip(wanted, objects.get_many(wanted, limit)))

    if not beside or store.supports_mmap:  # plain files: a read costs less than a thread
        return documents(), {key: blob for wanted, limit in beside for key, blob in read(wanted, limit).items()}
    with ThreadPoolExecutor(len(beside)) as pool:
        reads = [pool.submit(read, wanted, limit) for wanted, limit in beside]
        return documents(), {key: blob for done in reads for key, blob in done.result().items()}


def _config_and_commit(url: str, store: ChunkStore) -> tuple[BufferConfig, bytes | None]:
    """The buffer's config and its commit record's bytes (None: none), read together (one round
    trip on an object store) where the group cannot have changed since the commit: a dataset's
    group never changes. A ring's changes with its capacity (`resizing`), so its commit record
    is read again, after its group, as a reader must."""
    group, commit = map(as_bytes, store.get_many([GROUP_KEY, objects_prefix(FORMAT) + COMMIT_KEY],
                                                 limit=MAX_METADATA_BYTES + 1))
    if group is None and (error := failed_write_error(lambda key: store.get(key, MAX_METADATA_BYTES + 1), url)):
        raise NotABufferError(f"{url!r} is not a diskreplay buffer: a write there failed ({error}); "
                              f"a buffer made there replaces what it left")
    config = read_config(lambda key: group if key == GROUP_KEY else None, url)
    if config.lane_capacity is not None or config.format != FORMAT:
        commit = objects_at(store, objects_prefix(config.format)).get(COMMIT_KEY, limit=MAX_METADATA_BYTES + 1)
    return config, commit


def _read_writable(url: str, store: ChunkStore, objects: ChunkStore, with_state: bool) -> Metadata:
    """`_read_buffer` for its writer (the lock held): a change of capacity that a killed writer
    made visible is finished first."""
    try:
        return _read_buffer(url, store, with_state)
    except ResizeInProgressError:
        resizing.finish(url, store, objects)
        return _read_buffer(url, store, with_state)


def _store(url: str, options: Options) -> ChunkStore:
    return open_chunkstore(url, options.storage_options,
                           concurrency=options.io_threads or default_io_threads(url), retry=options.retry)


class ReadSide(NamedTuple):
    """The parts of a storage's read side, wired together (`_read_side`)."""

    cache: ChunkCache
    loader: ChunkLoader
    reader: ChunkReader
    files: FileMaps
    ragged: RaggedReads | None
    """The reads of the ragged fields (None: none), their value chunks cached within ``cache_bytes``."""


def _tables(url: str, log: CommitLog, io: ChunkIO) -> Tables:
    """The shard index tables of this buffer that describe its shards at the commit ``log`` shows."""
    inner = inner_chunks(io, log.config.layout)
    read: dict[tuple, dict[str, ShardTable]] = {}

    def tables(names: tuple[str, ...]) -> dict[str, ShardTable]:  # read once per commit for every reader of them
        key = (names, log.record.sequence, log.record.time)
        if key not in read:
            read.clear()
            read[key] = read_tables(log.objects, url, log.record, names, inner, log.config.num_envs)
        return read[key]
    return tables


def _read_side(url: str, config: BufferConfig, arrays: dict[str, ArrayMeta], log: Log, io: ChunkIO,
               options: Options, tables: Tables | None = None) -> ReadSide:
    """The read side of a storage, its read paths chosen for its size and store (``tables``: a
    reader's shard index tables, `PointReads`)."""
    layout, schema, store, cursors, mode = config.layout, config.schema, io.store, log.cursors, log.mode
    codec, record = buffer_codec(arrays, url), log.record
    stored_bytes = layout.num_envs * (config.lane_capacity or int(record.committed.max(initial=0))) * schema.row_bytes
    fits = stored_bytes <= options.cache_bytes
    chunks_per_lane = layout.chunks_per_lane(int(record.committed.max(initial=0)))
    # sharded fields are read row by row on a miss, unless every field fits the cache (remote: readers)
    row_fields = () if fits or not (store.supports_mmap or mode == "r") else fields_read_by_rows(
        schema, io.codecs, layout.num_envs * chunks_per_lane, layout.chunk_rows, options.cache_bytes, mode == "r")
    slots, full_slots = cache_slots(schema, layout, options.cache_bytes, mode != "r", row_fields)
    cache = ChunkCache(schema, layout.num_envs, layout.chunk_rows, slots, chunks_per_lane, full_slots, row_fields)
    loader = ChunkLoader(cache, io, tuple(name for name in schema.fields if name not in row_fields))
    memory_map = not fits if options.memory_map is None else options.memory_map
    mapped = (MappedChunks(store, io.key, schema, layout, chunks_per_lane, trailer=codec.trailer)
              if memory_map and codec.raw and store.supports_mmap and mmap_supported() else None)
    retired = RetiredCheck(log, cache, cursors.window)
    points = PointReads(io, layout.chunk_rows, tables) if mode == "r" else None
    row_reads = (_row_reads(row_fields, io, cache, retired, points, tables if mode == "r" else None)
                 if row_fields else None)
    files = FileMaps(mapped, row_reads, points)
    warmer = Warmer(loader, mapped, retired, cursors.window, files.forget, stored_bytes, mode == "r",
                    store.supports_mmap)
    reader = ChunkReader(schema, cursors, cache, loader, mapped, row_reads, retired, warmer, mode == "r",
                         ReadAhead(loader, retired), points)
    ragged = RaggedReads(config, io, mode != "r", options.cache_bytes) if config.user_schema.ragged else None
    return ReadSide(cache, loader, reader, files, ragged)


def _row_reads(names: tuple[str, ...], io: ChunkIO, cache: ChunkCache, retired: RetiredCheck,
               points: PointReads | None, tables: Tables | None) -> RowReads:
    """Row-by-row reads of the sharded fields ``names``: their shard files mapped as read (their
    indexes taken from ``tables`` where these hold them), or (an object store's reader) their
    inner chunks read as byte ranges."""
    schema = io.schema
    if not io.store.supports_mmap:
        assert points is not None, "remote row reads are a reader's"
        return RowReads(names, schema, cache, io, points, retired)
    codecs = {name: io.codecs[name] for name in names}
    inner_bytes = {name: int(codecs[name].inner_rows or 0) * schema[name].row_bytes for name in names}
    maps = ShardMaps(io.store, io.key, cache.chunk_rows, codecs, inner_bytes, map_budget(len(schema.fields)),
                     io.threads, TabledIndexes(tables, sharded_fields(io)))
    return RowReads(names, schema, cache, io, maps, retired)


def own_stores(url: str, storage_options: Mapping[str, Any] | None = None) -> list[ChunkStore]:
    """Every place the buffer at ``url`` may keep its own objects (commit record, writer lock),
    one per format, newest first: for questions asked before its format is known. Raises
    NotABufferError for a local path that can hold nothing (`check_location`)."""
    check_location(url)
    store = open_chunkstore(url, storage_options)
    return [objects_at(store, prefix) for prefix in OWN_PREFIXES]
