"""A ring's capacity change made visible at once: staged objects, one intent record, a roll-forward.

A new capacity moves every stored step (its slot is ``step % lane_capacity``), so the change
cannot be made in place row by row without a moment where neither capacity reads right. It is
made in three steps:

1. `stage`: the new chunks and the new ``zarr.json`` documents are written under
   ``<objects>/resize-staging/`` (keyed as in the buffer), the new state object under
   ``<objects>/state/``; the buffer itself is untouched (a crash here leaves the old buffer and
   some garbage that the next change deletes).
2. `make_visible`: ``<objects>/resize.json`` is written in one atomic put (the commit point): the
   capacities before and after, and the new commit record.
3. `finish`: the staged objects are copied over the buffer's (chunks and arrays' documents, the
   group's last), the new commit record replaces ``commit.json``, chunks outside the new grid and
   state objects no commit names are deleted, then the staging and ``resize.json``. Every step
   can be repeated, so a writer that finds ``resize.json`` when it opens the buffer repeats them
   all (a crash anywhere after step 2 leaves the new buffer); a reader refuses to open meanwhile
   (`ResizeInProgressError`).
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
    RESIZE_KEY,
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

COPY_BATCH = 64
"""Staged objects read (and held) at once while they are copied into place."""


@dataclass(frozen=True)
class ResizeIntent:
    """The content of ``resize.json``: ``previous`` and ``lane_capacity`` (steps per lane before
    and after the change) and ``record``, the commit record that shows the new buffer."""

    previous: int
    lane_capacity: int
    record: CommitRecord

    def to_bytes(self) -> bytes:
        return json.dumps({"previous": self.previous, "lane_capacity": self.lane_capacity,
                           "commit": json.loads(self.record.to_bytes())}).encode()

    @classmethod
    def from_bytes(cls, blob: bytes, url: str, num_envs: int) -> ResizeIntent:
        """Raises CorruptBufferError naming ``resize.json`` and the field."""
        data = json_object(blob, RESIZE_KEY, url)
        for name in ("previous", "lane_capacity"):
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STEPS:
                raise CorruptBufferError(f"{url!r}: {RESIZE_KEY} field {name!r}: expected an int in "
                                         f"[1, {MAX_STEPS}], got {value!r:.100}")
        if not isinstance(data.get("commit"), dict):
            raise CorruptBufferError(f"{url!r}: {RESIZE_KEY} field 'commit': expected an object, "
                                     f"got {data.get('commit')!r:.100}")
        record = CommitRecord.from_bytes(json.dumps(data["commit"]).encode(), url, num_envs,
                                         key=f"{RESIZE_KEY} field 'commit'")
        return cls(data["previous"], data["lane_capacity"], record)


def resize_pending(url: str, blob: bytes | None) -> None:
    """Raise ResizeInProgressError if ``blob`` (what ``resize.json`` holds) shows a change under way."""
    if blob is not None:
        raise ResizeInProgressError(f"{url!r}: a change of its capacity is under way, or was interrupted "
                                    f"({RESIZE_KEY} is present); its writer finishes it: "
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
    objects.put(RESIZE_KEY, intent.to_bytes(), durable=True)


def finish(url: str, store: ChunkStore, objects: ChunkStore) -> ResizeIntent | None:
    """Complete a change whose ``resize.json`` is present (the caller holds the writer lock);
    returns its intent, or None when there is none."""
    blob = objects.get(RESIZE_KEY, limit=MAX_METADATA_BYTES + 1)
    if blob is None:
        return None
    config = read_config(functools.partial(store.get, limit=MAX_METADATA_BYTES + 1), url)
    intent = ResizeIntent.from_bytes(blob, url, config.num_envs)
    staged = staging(objects)
    keys = sorted(staged.sizes(), key=lambda key: key == GROUP_KEY)  # the group's document last
    _copy(staged, store, keys)
    objects.put(COMMIT_KEY, intent.record.to_bytes(), durable=True)
    for key in _outside_grid(config, intent):
        store.delete(key)
    for key in objects.sizes():
        if (is_state_key(key) or is_journal_key(key)) and key != intent.record.state_arrays:
            objects.delete(key)
    staged.clear()
    objects.delete(RESIZE_KEY)
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
