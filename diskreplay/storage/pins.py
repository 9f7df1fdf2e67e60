"""`Pins`: commits kept readable while the writer goes on (`format.pins` has the layout).

A pin is a copy of what its commit names (record, state objects, the chunks of its visible rows),
made by the writer under its lock in the commit protocol's order: its index entry as
``"copying"``, the copies (made durable), then the entry as ``"kept"``. Readers open only kept
pins; the writer's next `pin` or `unpin` deletes the copies of one it was interrupted making or
removing. A pin costs a copy of the rows its commit shows, once; the writer never has to keep a
chunk for it afterwards, and a reader of a pin reads nothing the writer rewrites.

Readers opened at a commit hold their log at it (`hold_pinned`, `hold_newest`): refreshes never
move them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..errors import CommitNotKeptError, CorruptBufferError
from ..format.commit import CommitRecord
from ..format.keys import COMMIT_KEY, FORMAT, FORMAT_1, MAX_METADATA_BYTES
from ..format.lanes import LaneLayout
from ..format.pins import COPYING, KEPT, MAX_NAME, PINS_KEY, REMOVING, Pin, PinIndex, pin_prefix, state_keys
from ..io.store import ChunkStore, objects_at
from .chunk_io import ChunkIO
from .commit_log import CommitLog

COPY_BATCH = 32
"""Objects read (and held in RAM) at once while a pin is made: a few MiB of chunks."""


def read_index(objects: ChunkStore, url: str) -> PinIndex:
    """The buffer's ``pins.json`` (empty: none), validated."""
    return PinIndex.from_bytes(objects.get(PINS_KEY, limit=MAX_METADATA_BYTES + 1), url)


def chunk_keys(record: CommitRecord, layout: LaneLayout, io: ChunkIO) -> list[str]:
    """The keys of every chunk that holds a visible row of commit ``record``, every field's."""
    lo, hi = layout.visible(record.lower, record.committed)
    return [io.key(name, lane, int(chunk)) for lane in range(layout.num_envs)
            for chunk in layout.chunks_between(int(lo[lane]), int(hi[lane])) for name in io.schema.fields]


def pinned_record(objects: ChunkStore, url: str, pin: Pin, num_envs: int) -> CommitRecord:
    """The record of the kept ``pin``. Raises CorruptBufferError naming it if missing or damaged."""
    key = pin_prefix(pin.commit) + COMMIT_KEY
    blob = objects.get(key, limit=MAX_METADATA_BYTES + 1)
    if blob is None:
        raise CorruptBufferError(f"{url!r}: {key} is missing, but {PINS_KEY} keeps commit {pin.commit}")
    record = CommitRecord.from_bytes(blob, url, num_envs, key)
    if record.sequence != pin.commit:
        raise CorruptBufferError(f"{url!r}: {key} field 'sequence': expected {pin.commit}, got {record.sequence}")
    return record


def not_kept(url: str, at: int | str, index: PinIndex, newest: int) -> CommitNotKeptError:
    """The error for a commit (or pin name) ``at`` that can no longer be opened."""
    kept = [pin.label() for pin in index.kept()]
    return CommitNotKeptError(f"{url!r}: commit {at!r} is not kept (only pinned commits and the newest can be "
                              f"opened at_commit=); commits that can be opened: the newest, {newest}, and the "
                              f"pinned: {', '.join(kept) if kept else 'none'}")


def hold_pinned(log: CommitLog) -> Callable[[], CommitRecord]:
    """A reader of a pinned commit: its newest commit is its own, for good."""
    return lambda: log.record


def hold_newest(log: CommitLog, index: Callable[[], PinIndex]) -> Callable[[], CommitRecord]:
    """A reader of the newest commit, not pinned, reading the buffer's own chunks: it stays at its
    commit; once the writer retires rows of it (to overwrite them) its reads raise
    `CommitNotKeptError` (`index()`: the pins, for the message)."""
    own, read = log.record, log.read_store_newest

    def newest() -> CommitRecord:
        record = read()
        if not record.same_as(own) and np.any(log.cursors.layout.visible(record.lower, record.committed)[0]
                                              > log.cursors.layout.visible(own.lower, own.committed)[0]):
            raise not_kept(log.url, own.sequence, index(), record.sequence)
        return own
    return newest


class Pins:
    """The pins of one buffer, as its writer makes and removes them."""

    def __init__(self, log: CommitLog, io: ChunkIO):
        self.log, self.io = log, io

    def index(self) -> PinIndex:
        return read_index(self.log.objects, self.log.url)

    def pin(self, name: str | None, commit: Callable[[], object]) -> int:
        """``commit()``, then keep the commit it made readable (`ReplayBuffer.pin`); its sequence.
        Raises ValueError for a bad name or one another pin has (before ``commit()``), or a
        commit pinned under another name."""
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= MAX_NAME and not name.isdigit()):
            raise ValueError(f"a pin's name is a string of 1 to {MAX_NAME} characters, not all digits; "
                             f"got {name!r:.80}")
        if self.log.config.format == FORMAT_1:  # its own objects share the root with the fields
            raise ValueError(f"{self.log.url!r} is a {FORMAT_1} buffer: pins need format {FORMAT}, whose own "
                             f"objects sit apart from the fields (docs/format.md, section 11)")
        if ragged := list(self.log.config.user_schema.ragged):
            raise ValueError(f"{self.log.url!r}: pins do not keep variable-length fields yet (the values arrays "
                             f"of {ragged}); copy the buffer to keep it as it is now")
        taken = self.index().find(name) if name is not None else None
        if taken is not None and taken.status == KEPT:
            raise ValueError(f"{self.log.url!r}: cannot pin as {name!r}: pin {taken.label()} exists (unpin it first)")
        commit()
        record, index = self.log.record, self._tidy(self.index())
        found, named = index.find(record.sequence), index.find(name) if name is not None else None
        if found is not None and name in (None, found.name):
            return record.sequence
        if found is not None or named is not None:
            taken = found if found is not None else named
            raise ValueError(f"{self.log.url!r}: cannot pin commit {record.sequence} as {name!r}: "
                             f"pin {taken.label()} exists (unpin it first)")  # type: ignore[union-attr]
        pin = Pin(record.sequence, name, time.time(), COPYING)
        self._put_index(index.with_pin(pin))
        self._copy(record)
        self._put_index(index.with_pin(replace(pin, status=KEPT)))
        return record.sequence

    def unpin(self, at: int | str) -> None:
        """Remove the pin of commit (or named) ``at`` and its copies. Raises CommitNotKeptError."""
        index = self._tidy(self.index())
        pin = index.find(at)
        if pin is None:
            raise not_kept(self.log.url, at, index, self.log.record.sequence)
        self._put_index(index.marked(pin.commit, REMOVING))
        self._delete(pin.commit)
        self._put_index(index.without(pin.commit))

    def _tidy(self, index: PinIndex) -> PinIndex:
        """Delete the copies of pins interrupted while made or removed; the index without them."""
        for pin in index.unfinished():
            self._delete(pin.commit)
            index = index.without(pin.commit)
            self._put_index(index)
        return index

    def _put_index(self, index: PinIndex) -> None:
        self.log.check_lock()
        if index.pins:
            self.log.objects.put(PINS_KEY, index.to_bytes(), durable=True)
        else:
            self.log.objects.delete(PINS_KEY)

    def _copy(self, record: CommitRecord) -> None:
        """Copy what ``record`` names under its pin: the record first (it says what the rest is)."""
        log = self.log
        target = objects_at(log.objects, pin_prefix(record.sequence))
        log.check_lock()
        target.put(COMMIT_KEY, record.to_bytes(), durable=True)
        copied = self._copy_keys(log.objects, state_keys(record), target, "state object")
        copied += self._copy_keys(self.io.store, chunk_keys(record, log.cursors.layout, self.io), target, "chunk")
        target.sync(copied)

    def _copy_keys(self, source: ChunkStore, keys: list[str], target: ChunkStore, what: str) -> list[str]:
        for start in range(0, len(keys), COPY_BATCH):
            batch = keys[start:start + COPY_BATCH]
            self.log.check_lock()
            for key, blob in zip(batch, source.get_many(batch)):
                if blob is None:
                    raise CorruptBufferError(f"{self.log.url!r}: {what} {key!r} is missing, but commit "
                                             f"{self.log.record.sequence} names it")
                target.put(key, blob)
        return keys

    def _delete(self, commit: int) -> None:
        """Delete the copies of a pin; its record last (it says what the rest is)."""
        log = self.log
        target = objects_at(log.objects, pin_prefix(commit))
        blob = target.get(COMMIT_KEY, limit=MAX_METADATA_BYTES + 1)
        if blob is not None:
            record = CommitRecord.from_bytes(blob, log.url, log.config.num_envs, pin_prefix(commit) + COMMIT_KEY)
            log.check_lock()
            for key in state_keys(record) + chunk_keys(record, log.cursors.layout, self.io):
                target.delete(key)
            target.delete(COMMIT_KEY)
        if target.supports_mmap:  # plain directories: remove those left empty, and pins/ if empty
            root = target.path("").rstrip("/")
            for directory in [*sorted((d for d, _, _ in os.walk(root)), reverse=True), os.path.dirname(root)]:
                _remove_empty(directory)


def _remove_empty(directory: str) -> None:
    try:
        os.rmdir(directory)
    except OSError:  # not empty, or gone
        pass
