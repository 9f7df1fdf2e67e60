"""A ring's capacity change made visible at once: staged objects, one marked commit, a roll-forward.

A new capacity moves every stored step (its slot is ``step % lane_capacity``), so the change
cannot be made in place row by row without a moment where neither capacity reads right. It is
made in three steps:

1. `stage`: the new chunks, the new ``zarr.json`` documents and the new state object are written
   under ``<objects>/resize-staging/`` (keyed as in the buffer); the buffer itself is untouched
   (a crash here leaves the old buffer and some garbage that the next change deletes).
2. `make_visible`: ``commit.json`` is replaced, in one atomic put (the commit point), by the new
   commit record *marked* with ``extra.resize`` (the capacities before and after). Readers read
   ``commit.json`` first anyway: a marked one costs them no request, and they refuse it
   (`ResizeInProgressError`).
3. `finish`: the staged objects are copied over the buffer's (the group's ``zarr.json`` last),
   chunks outside the new grid and state objects the new record does not name are deleted, the
   staging too; then the record is put again without its mark. Every step can be repeated, so a
   writer that opens a buffer whose record is marked repeats them all (a crash anywhere after
   step 2 leaves the new buffer).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import CorruptBufferError, ResizeInProgressError
from ..format.commit import CommitRecord, is_state_key
from ..format.config import MAX_STEPS, BufferConfig
from ..format.journal import is_journal_key
from ..format.keys import (
    COMMIT_KEY,
    GROUP_KEY,
    MAX_METADATA_BYTES,
    RESIZE_STAGING,
    array_key,
    chunk_key,
    json_object,
    objects_prefix,
)
from ..format.layout import read_config, read_layout, resized_document
from ..io.backends import open_chunkstore
from ..io.lock import WriterLock
from ..io.store import ChunkStore, objects_at

RESIZE_MARK = "resize"
"""The field of a commit record's ``extra`` that marks a change of capacity not yet in place."""
COPY_BATCH = 64
"""Staged objects read (and held) at once while they are copied into place."""


@dataclass(frozen=True)
class ResizeIntent:
    """A change of capacity: ``previous`` and ``lane_capacity`` (steps per lane before and after)
    and ``record``, the commit record of the new buffer."""

    previous: int
    lane_capacity: int
    record: CommitRecord

    def to_bytes(self) -> bytes:
        """The record marked with the change (`RESIZE_MARK` in its ``extra``)."""
        data = json.loads(self.record.to_bytes())
        data["extra"][RESIZE_MARK] = {"previous": self.previous, "lane_capacity": self.lane_capacity}
        return json.dumps(data).encode()

    @classmethod
    def from_bytes(cls, blob: bytes, url: str, num_envs: int) -> ResizeIntent | None:
        """The change a commit record's bytes are marked with (None: not marked). Raises
        CorruptBufferError naming the field."""
        record = CommitRecord.from_bytes(blob, url, num_envs)
        mark = marked(blob, url)
        if mark is None:
            return None
        for name in ("previous", "lane_capacity"):
            value = mark.get(name) if isinstance(mark, dict) else None
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STEPS:
                raise CorruptBufferError(f"{url!r}: {COMMIT_KEY} field 'extra.{RESIZE_MARK}.{name}': expected an "
                                         f"int in [1, {MAX_STEPS}], got {value!r:.100}")
        return cls(mark["previous"], mark["lane_capacity"], record)


def marked(blob: bytes, url: str) -> Any:
    """The mark of a change of capacity in the commit record ``blob`` (None: none)."""
    extra = json_object(blob, COMMIT_KEY, url).get("extra")
    return extra.get(RESIZE_MARK) if isinstance(extra, dict) else None


def resize_pending(url: str, blob: bytes) -> None:
    """Raise ResizeInProgressError if the commit record ``blob`` is marked with a change."""
    if marked(blob, url) is not None:
        raise ResizeInProgressError(f"{url!r}: a change of its capacity is under way, or was interrupted "
                                    f"({COMMIT_KEY} has 'extra.{RESIZE_MARK}'); its writer finishes it: "
                                    f"ReplayBuffer.open(url, 'r+')")


def lock_buffer(url: str, storage_options: Mapping[str, Any] | None, break_lock: bool,
                lease_s: float | None) -> tuple[ChunkStore, ChunkStore, WriterLock]:
    """The buffer's store, the store of its own objects and its writer lock, taken.
    Raises NotABufferError, CorruptBufferError (no buffer's config there), LockedError."""
    store = open_chunkstore(url, storage_options)
    config = read_config(functools.partial(store.get, limit=MAX_METADATA_BYTES + 1), url)
    objects = objects_at(store, objects_prefix(config.format))
    return store, objects, WriterLock(url, objects, lease_s).acquire(break_lock)


def staging(objects: ChunkStore) -> ChunkStore:
    """Where a change's new objects wait (keyed as in the buffer)."""
    return objects_at(objects, RESIZE_STAGING)


def stage_documents(url: str, store: ChunkStore, target: ChunkStore, lane_capacity: int) -> None:
    """Stage in ``target`` the group's and every array's ``zarr.json`` of the buffer in ``store``,
    for ``lane_capacity`` steps per lane."""
    get = functools.partial(store.get, limit=MAX_METADATA_BYTES + 1)
    config, arrays = read_layout(get, url)
    for name, meta in arrays.items():
        target.put(array_key(name), resized_document(meta, lane_capacity), durable=True)
    group = json_object(get(GROUP_KEY) or b"", GROUP_KEY, url)
    group["attributes"]["diskreplay"]["lane_capacity"] = lane_capacity
    target.put(GROUP_KEY, json.dumps(group, indent=2).encode(), durable=True)


def make_visible(objects: ChunkStore, intent: ResizeIntent) -> None:
    """The commit point: after this, the change is made (now or by the next writer)."""
    objects.put(COMMIT_KEY, intent.to_bytes(), durable=True)


def finish(url: str, store: ChunkStore, objects: ChunkStore) -> ResizeIntent | None:
    """Complete a change whose marked record is ``commit.json`` (the caller holds the writer
    lock); returns it, or None when the record is not marked."""
    config = read_config(functools.partial(store.get, limit=MAX_METADATA_BYTES + 1), url)
    blob = objects.get(COMMIT_KEY, limit=MAX_METADATA_BYTES + 1)
    intent = None if blob is None else ResizeIntent.from_bytes(blob, url, config.num_envs)
    if intent is None:
        return None
    staged = staging(objects)
    keys = sorted(staged.sizes(), key=lambda key: key == GROUP_KEY)  # the group's document last
    _copy(staged, store, keys)
    for key in _outside_grid(config, intent):
        store.delete(key)
    for key in objects.sizes():
        if (is_state_key(key) or is_journal_key(key)) and key != intent.record.state_arrays:
            objects.delete(key)
    staged.clear()
    objects.put(COMMIT_KEY, intent.record.to_bytes(), durable=True)
    return intent


def _copy(source: ChunkStore, target: ChunkStore, keys: list[str]) -> None:
    """``keys`` of ``source`` to ``target`` (made durable), a batch at a time, in order."""
    for start in range(0, len(keys), COPY_BATCH):
        batch = keys[start:start + COPY_BATCH]
        for key, blob in zip(batch, source.get_many(batch)):
            if blob is None:
                raise CorruptBufferError(f"{source.url!r}: staged object {key!r} disappeared")
            target.put(key, blob, durable=key.endswith("zarr.json"))
        target.sync(batch)


def _outside_grid(config: BufferConfig, intent: ResizeIntent) -> Iterable[str]:
    """The chunk keys of the old capacity that the new one's grid lacks (a shrink's)."""
    rows = config.chunk_rows
    first, end = -(-intent.lane_capacity // rows), -(-intent.previous // rows)
    for name, field in config.schema.items():
        for lane in range(config.num_envs):
            for chunk in range(first, end):
                yield chunk_key(name, field, lane, chunk, config.chunk_key_separator)
