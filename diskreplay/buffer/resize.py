"""A ring's capacity changed at open: ``ReplayBuffer.open(url, "r+", capacity=n)``.

The buffer keeps its format: it becomes the ring it would be had it been created with ``n`` rows
(``n // num_envs`` steps per lane) and had it kept the rows it keeps. Every step keeps its number
(row ids, the episode index and the ``final/`` side store stay as they are); its row moves to its
slot ``step % lane_capacity`` under the new capacity. Growing keeps every row; shrinking keeps the
newest ``n // num_envs`` of each lane (the lane's ``lower`` rises past the others, as when a ring
overwrites them) and warns how many it dropped. Priorities move with their rows; the generator,
the sampler's other state, the episode index and the ``next_*`` of each lane's newest step are
kept as committed. The change is made visible at once (`diskreplay.storage.resizing`).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import NotABufferError
from ..format import state as state_files
from ..format.codecs import checksum
from ..format.commit import CommitRecord, state_key
from ..format.keys import objects_prefix
from ..format.lanes import LaneLayout
from ..io import ChunkStore, open_chunkstore
from ..sampling import Sampler, with_defaults
from ..sampling.state import check_sampler_state
from ..storage import Options, Storage
from ..storage.pins import read_index
from ..storage.resizing import ResizeIntent, finish, lock_buffer, make_visible, stage_documents, staging
from .setup import lane_capacity_of, read_sharded_root

if TYPE_CHECKING:
    from .replay_buffer import ReplayBuffer

STAGE_BYTES = 64 << 20
"""Rows (of every field) a change of capacity stages at once: what it holds in RAM, about twice."""


def resize(cls: type[ReplayBuffer], url: str, mode: str, capacity: Any, options: Options,
           sampler: Sampler | None) -> None:
    """Change the capacity of the ring at ``url`` to ``capacity`` rows (`ReplayBuffer.open`'s
    ``capacity=``; ``options`` and ``sampler``: that call's). Raises ValueError for a
    ``capacity`` the buffer cannot take (nothing is changed then), and as `ReplayBuffer.open`."""
    if mode != "r+":
        raise ValueError(f"capacity= changes the buffer {url!r}: open it with mode='r+', not {mode!r}")
    try:
        store, objects, lock = lock_buffer(url, options.storage_options, options.break_lock, options.lease_s)
    except NotABufferError:
        if read_sharded_root(open_chunkstore(url, options.storage_options), url) is not None:
            raise ValueError(f"{url!r} is a sharded buffer: capacity= is not supported there (its shards share "
                             f"one config); create a new sharded buffer with the capacity you need") from None
        raise
    try:
        finish(url, store, objects)  # an interrupted change first
        staging(objects).clear()  # what a change killed before its commit point left
        reader = cls.open(url, "r", sampler=sampler, storage_options=options.storage_options, cache_bytes=1,
                          io_threads=options.io_threads, retry=options.retry)  # reads bypass the cache
        try:
            intent = _stage(reader, capacity, store, objects)
        finally:
            reader.close()
        if intent is not None:
            lock.verify(True)  # still this writer's buffer (LockedError: it was taken over)
            make_visible(objects, intent)
            finish(url, store, objects)
    finally:
        lock.release()


def lane_capacity_for(url: str, capacity: Any, layout: LaneLayout) -> int:
    """Steps per lane of a ring of ``capacity`` rows over ``layout``'s lanes. Raises ValueError."""
    if layout.lane_capacity is None:
        raise ValueError(f"{url!r} is a dataset (it grows without a capacity): capacity= applies to rings only")
    if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
    envs, rows = layout.num_envs, layout.chunk_rows
    if capacity % envs:
        raise ValueError(f"capacity={capacity} is not a multiple of num_envs={envs} (a ring keeps "
                         f"capacity // num_envs rows per lane): use e.g. {max(capacity // envs, 1) * envs}")
    if capacity // envs < rows:
        raise ValueError(f"capacity={capacity} gives {capacity // envs} rows per lane, fewer than "
                         f"chunk_rows={rows}: at least {rows * envs} rows")
    return int(lane_capacity_of(int(capacity), envs, rows) or 0)  # and the limits of create


def _stage(reader: ReplayBuffer, capacity: Any, store: ChunkStore, objects: ChunkStore) -> ResizeIntent | None:
    """Stage the buffer ``reader`` shows at ``capacity`` rows (``store``: the buffer's, ``objects``:
    its own objects'); its intent (None: no change)."""
    storage, url = reader.storage, reader.url
    old = storage.layout.lane_capacity
    new = lane_capacity_for(url, capacity, storage.layout)
    if new == old:
        return None
    assert old is not None
    if pins := read_index(objects, url).pins:
        raise ValueError(f"{url!r} has pinned commits {[pin.commit for pin in pins]}: a change of capacity "
                         f"deletes what they keep; unpin them first (buf.unpin(n))")
    record = storage.record
    first, _ = storage.committed_window()
    lower = np.maximum(record.lower, record.committed - min(old, new))
    state = _resized_state(reader, old, new, lower, record.committed)
    target = staging(objects)
    for lane in range(storage.layout.num_envs):
        _stage_lane(storage, target, lane, np.arange(lower[lane], record.committed[lane]), new)
    stage_documents(url, store, target, new)
    _warn_dropped(url, int(capacity), new, lower - first)
    return ResizeIntent(old, new, replace(_staged_record(storage, target, record, lower, state), lane_capacity=new))


def _stage_lane(storage: Storage, target: ChunkStore, lane: int, steps: np.ndarray, new: int) -> None:
    """Stage in ``target`` the chunks of ``lane`` that hold ``steps`` at their slots of ``new``
    steps per lane, a few chunks at a time (about `STAGE_BYTES` of rows): every chunk of the
    ring's window of the new capacity, as a ring's reads and writes expect them all to exist
    (those slots of it that hold no kept step are zeros)."""
    rows = storage.layout.chunk_rows
    new_chunk = (steps % new) // rows
    order = np.argsort(new_chunk, kind="stable")
    stop = int(steps[-1]) + 1 if len(steps) else 0
    ordered, chunks = new_chunk[order], np.unique(np.arange(max(0, stop - new), stop) % new // rows)
    per_batch = max(1, STAGE_BYTES // (rows * storage.schema.row_bytes))
    for start in range(0, len(chunks), per_batch):
        batch = chunks[start:start + per_batch]
        first, end = np.searchsorted(ordered, [batch[0], batch[-1] + 1])
        _stage_chunks(storage, target, lane, steps[np.sort(order[first:end])], new, batch)


def _stage_chunks(storage: Storage, target: ChunkStore, lane: int, steps: np.ndarray, new: int,
                  chunks: np.ndarray) -> None:
    """Stage the new chunks ``chunks`` of ``lane``, which hold ``steps`` (every field's, one
    field at a time), read from the chunks that hold them now."""
    rows = storage.layout.chunk_rows
    old_slots, new_slots = storage.layout.slot(steps), steps % new
    sources = np.unique(old_slots // rows)
    source_at = np.searchsorted(sources, old_slots // rows) * rows + old_slots % rows
    target_at = np.searchsorted(chunks, new_slots // rows) * rows + new_slots % rows
    for name, field in storage.schema.items():
        stored = storage.read_chunks((name,), lane, sources)[name]
        staged = np.zeros((len(chunks) * rows, *field.shape), field.dtype)
        staged[target_at] = stored[source_at]
        keys = [storage.chunk_key(name, lane, chunk) for chunk in chunks.tolist()]
        for i, key in enumerate(keys):
            target.put(key, storage.codecs[name].encode(staged[i * rows:(i + 1) * rows]))
        target.sync(keys)


def _resized_state(reader: ReplayBuffer, old: int, new: int, lower: np.ndarray,
                   committed: np.ndarray) -> dict[str, Any]:
    """The committed state, its priorities moved to the slots of ``new`` steps per lane and checked
    against the new layout (ValueError: a sampler whose state cannot follow)."""
    state = {k: v for k, v in reader.state_dict().items() if k != "total"}
    sampler = dict(state["sampler"])
    if sampler.get("stride") == old and isinstance(sampler.get("leaves"), np.ndarray):
        envs = reader.num_envs
        leaves, moved = sampler["leaves"].reshape(envs, old), np.zeros((envs, new), sampler["leaves"].dtype)
        for lane in range(envs):
            steps = np.arange(lower[lane], committed[lane])
            moved[lane, steps % new] = leaves[lane, steps % old]
        sampler.update(stride=new, leaves=moved.reshape(-1))
    layout = LaneLayout(reader.num_envs, new, reader.layout.chunk_rows)
    try:
        check_sampler_state(with_defaults(reader.sampler), sampler, layout, committed)
    except ValueError as exc:
        raise ValueError(f"{reader.url!r}: the state of its sampler cannot follow a change of capacity "
                         f"({exc})") from None
    return {**state, "sampler": sampler}


def _staged_record(storage: Storage, target: ChunkStore, record: CommitRecord, lower: np.ndarray,
                   state: dict[str, Any]) -> CommitRecord:
    """The commit record of the new buffer, its state object staged in ``target``."""
    meta, arrays = state_files.split(state)
    key, crc = None, None
    if arrays:
        key = state_key(record.sequence + 1)
        blob = state_files.arrays_to_bytes(arrays)
        crc = int.from_bytes(checksum(blob), "little")
        target.put(objects_prefix(storage.config.format) + key, blob, durable=True)
    return record.next(record.committed, lower, time.time(), state=meta, state_arrays=key, state_checksum=crc)


def _warn_dropped(url: str, capacity: int, new: int, dropped: np.ndarray) -> None:
    if dropped.any():
        warnings.warn(f"{url!r}: capacity={capacity} keeps the newest {new} rows per lane: dropped "
                      f"{dropped.tolist()} rows per lane ({int(dropped.sum())} in all)", UserWarning, stacklevel=5)
