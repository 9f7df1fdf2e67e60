"""`CommitLog`: everything that is committed, and the only writer of it.

A commit makes rows visible: per lane, steps ``[max(lower, committed - lane_capacity), committed)``
(`CommitRecord`). It is one small object, ``commit.json``, replaced atomically after the chunks
it covers are written. With it goes the buffer's state (generator, sampler, episode index...): its
JSON part inside the record, its arrays in a state object, ``state/<sequence>-<token>.safetensors``,
written under a new name before the record names it (a reader of the previous commit still finds
its own) and deleted once no commit names it.

Before every commit, state object and growth of the arrays the log checks that this writer still
holds the writer lock: a writer whose lock was broken and taken stops writing for good.

The record is *fenced*: each commit replaces it only if it is still the version this writer
wrote last (`ChunkStore.put_if_version`), and a writer that opens the buffer after replacing
another's lock (an expired lease, a dead holder, ``break_lock``) first rewrites it (a commit of
the same rows). A writer that was taken over therefore cannot commit, even one that checked its
lock just before it was paused: its commit finds another version and raises `LockedError`.

The record, the state objects and the lock are diskreplay's own objects (``objects``: their
directory, `objects_prefix`); the arrays' metadata is in the buffer's ``store``.

A log owns the objects of one store: a buffer made of several independently committed parts
(one per writer) gives each its own store under the buffer's location, as the ``derive_next`` side
store already is, and its readers union them.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import ClosedError, CommitNotKeptError, CorruptBufferError, LockedError, ReadOnlyError, StaleReadError
from ..format import state as state_files
from ..format.codecs import checksum
from ..format.commit import CommitRecord, is_state_key, state_key
from ..format.config import BufferConfig
from ..format.journal import JournalChange, JournalRef, is_journal_key
from ..format.keys import COMMIT_KEY, MAX_METADATA_BYTES, array_key
from ..format.layout import ArrayMeta, lane_rows, read_layout, resized_document
from ..io.lock import WriterLock, fenced
from ..io.store import Blob, ChunkStore, as_bytes
from .cursors import Cursors
from .journal import Journal, MissingObject, object_sizes, read_journals
from .resizing import marked

STATE_ATTEMPTS = 10
"""Reads of the newest commit a reader makes while its writer keeps replacing the state object."""


@dataclass(frozen=True)
class StagedState:
    """A state about to be committed: its JSON part, the key of the object holding its arrays
    and the journals it appended to."""

    meta: dict[str, Any]
    key: str | None
    journals: tuple[Journal, ...] = ()
    checksum: int | None = None  # the CRC32C of the object at ``key``


class Announcer(Protocol):
    """Where a shard's writer announces its commits (a sharded root's commit index)."""

    def start(self, sequence: int) -> None:
        """The writer opened at commit ``sequence``."""

    def announce(self, sequence: int) -> None:
        """Commit ``sequence`` is about to be made."""


def state_reads(record: CommitRecord) -> list[tuple[list[str], int | None]]:
    """What the first `CommitLog.load_state` of ``record`` reads from the buffer's own objects,
    as ``(keys, limit)`` reads that can run side by side: its state object, its journals' objects.
    A reference it cannot parse is left to `load_state`, which says what is wrong with it."""
    if record.state is None:
        return []
    key = record.state_arrays
    reads: list[tuple[list[str], int | None]] = [([key], None)] if key is not None and is_state_key(key) else []
    try:
        sizes = object_sizes(list(journal_refs(record).values()))
    except ValueError:
        return reads
    return reads + ([(list(sizes), max(sizes.values()) + 1)] if sizes else [])


def journal_refs(record: CommitRecord) -> dict[str, JournalRef]:
    """The journals ``record``'s state names, by path. Raises ValueError naming a bad reference."""
    return {path: JournalRef.from_json(path, value, record.sequence)
            for path, value in state_files.journal_values(record.state).items()}


class CommitLog:
    """The commit record, its state objects, the arrays' growth and the writer lock of one buffer."""

    def __init__(self, url: str, store: ChunkStore, objects: ChunkStore, config: BufferConfig,
                 arrays: dict[str, ArrayMeta], record: CommitRecord, cursors: Cursors, mode: str,
                 lock: WriterLock | None, announcer: Announcer | None = None,
                 hold: Callable[[CommitLog], Callable[[], CommitRecord]] | None = None,
                 read_ahead: Mapping[str, Blob | None] | None = None):
        """``hold``: for a reader held at its commit, makes the `held` of this log (`pins`);
        ``read_ahead``: objects of ``record``'s state read with the metadata (`state_reads`;
        key -> bytes, None: missing), which the first `load_state` takes instead of reading them."""
        self.url = url
        self.store = store
        self.objects = objects
        self.config = config
        self.arrays = arrays
        self.lane_rows = lane_rows(arrays)
        self.record = record
        self.cursors = cursors
        self.mode = mode
        self.lock = lock
        # released on close, or when the log is collected / the interpreter exits unclosed
        self._release = weakref.finalize(self, lock.release_from_anywhere) if lock is not None else None
        self.closed = False
        self._newest: tuple[bytes, CommitRecord] | None = None  # the last record read_newest parsed, and its bytes
        self.lost_lock: str | None = None
        self._garbage: list[str] = []  # state objects no commit names, deleted after the next commit
        self.journals: dict[str, Journal] = {}
        self.announcer = announcer
        self._read_ahead = dict(read_ahead or {})
        self._version: str | None = None  # of the commit record as this writer last wrote or read it
        """A reader opened at one commit: what `read_newest` answers instead (`pins.hold_pinned`)."""
        if lock is not None:
            self._fence(lock.replaced is not None)
        if announcer is not None:
            announcer.start(self.record.sequence)
        self.held: Callable[[], CommitRecord] | None = hold(self) if hold is not None else None

    def _fence(self, rewrite: bool) -> None:
        """Writer: note the commit record's version (``rewrite``: and replace it by a commit of
        the same rows), so that no writer that held the lock before this one can commit."""
        found = self.objects.get_versioned(COMMIT_KEY, limit=MAX_METADATA_BYTES + 1)
        if found is None:  # a new buffer's first commit is yet to come
            return
        blob, self._version = found
        if not CommitRecord.from_bytes(blob, self.url, self.config.num_envs).same_as(self.record):
            raise LockedError(f"{self.url!r}: another writer committed while this one opened the buffer; open it again")
        if rewrite:
            self._put_record(self.record.next(self.record.committed, self.record.lower, time.time()), True)

    # ---- the writer's right to write -------------------------------------------------------

    def require_writable(self) -> None:
        """Raises ClosedError, LockedError (this writer lost its lock) or ReadOnlyError."""
        if self.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        if self.lost_lock is not None:
            raise LockedError(self.lost_lock)
        if self.mode == "r":
            raise ReadOnlyError(f"buffer {self.url!r} was opened read-only (mode='r'); open it with mode='r+' to write")

    def check_lock(self, renew: bool = True) -> None:
        """Refuse to write unless this writer still holds the lock (it may have been broken and
        taken by another writer, which this one must not overwrite)."""
        self.require_writable()
        assert self.lock is not None
        try:
            self.lock.verify(renew)
        except LockedError as exc:
            self.lost_lock = str(exc)  # stop for good: every later write is refused without asking the store
            raise

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Chunk writes after a `check_lock`. On local disk no takeover comes between the check
        and the writes (`fenced`): a writer taken over cannot overwrite its successor's chunks.
        On an object store, PUTs in flight when the writer was paused can still land later."""
        with fenced(self.objects):
            self.check_lock(renew=False)
            yield

    # ---- commits ---------------------------------------------------------------------------

    def commit(self, committed: np.ndarray, lower: np.ndarray, durable: bool,
               staged: StagedState | None = None) -> None:
        """Replace ``commit.json``. ``lower`` is recorded at most ``committed`` (a retire commit
        may raise it past the rows committed so far); the cursors keep the writer's own, higher,
        bound. ``staged``: the state this commit saves (default: the last commit's)."""
        self.check_lock()
        state = {} if staged is None else {"state": staged.meta, "state_arrays": staged.key,
                                           "state_checksum": staged.checksum}
        record = self.record.next(committed, np.minimum(lower, committed), time.time(), **state)
        previous = self.record.state_arrays
        self._put_record(record, durable)
        if staged is not None and previous and previous != staged.key:
            self._garbage.append(previous)
        for journal in staged.journals if staged is not None else ():
            self._garbage += journal.committed()
        self.cursors.lower = np.maximum(self.cursors.lower, lower)

    def _put_record(self, record: CommitRecord, durable: bool) -> None:
        """Replace the commit record by ``record`` if it is still as this writer left it; announced
        first (a shard's writer), so that the announcements may lead the commits, never lag them."""
        if self.announcer is not None:
            self.announcer.announce(record.sequence)
        version = self.objects.put_if_version(COMMIT_KEY, record.to_bytes(), self._version, durable)
        if version is None:
            self.lost_lock = (f"{self.url!r}: this writer's commit was refused: {COMMIT_KEY} changed since its last "
                              f"commit (another writer took the buffer over: this writer's lease expired or its lock "
                              f"was broken); it stopped writing so as not to overwrite that writer's rows. Open the "
                              f"buffer again to write")
            raise LockedError(self.lost_lock)
        self._version, self.record = version, record

    def retire(self, first_kept: np.ndarray, needed: np.ndarray | None = None) -> None:
        """Before chunk writes: commit the raised lower bound ``first_kept`` (per lane) if the last
        commit still shows a step below ``needed`` (default ``first_kept``), the first step the
        writes keep (the writer's own bound may be higher already: a failed call retires rows in
        RAM only). Always durable: a chunk overwrite that reaches the disk before this commit
        would, after a power loss, show new rows under old step numbers. One small fsync per
        chunk write batch whose rows an earlier retire did not cover."""
        needed = first_kept if needed is None else needed
        if np.any(np.minimum(needed, self.record.committed) > self.record.lower):
            self.commit(self.record.committed, first_kept, True)

    def grow_arrays(self, rows: int) -> None:
        """Dataset mode: grow every array's step axis to ``rows`` (metadata only, before the
        commit that covers them)."""
        if self.config.lane_capacity is not None or rows <= self.lane_rows:
            return
        self.check_lock()
        for name, meta in self.arrays.items():
            self.store.put(array_key(name), resized_document(meta, rows), durable=True)
            meta["shape"][1] = rows
        self.lane_rows = rows

    def read_newest_of(self, lanes: np.ndarray) -> CommitRecord:
        """`read_newest`: one buffer's lanes are all in its one commit."""
        return self.read_newest()

    def read_newest(self) -> CommitRecord:
        """The newest commit record in the store (validated); a reader held at one commit: that
        one (`held`)."""
        return self.read_store_newest() if self.held is None else self.held()

    def read_store_newest(self) -> CommitRecord:
        """The newest commit record in the store (validated)."""
        read_small = functools.partial(self.store.get, limit=MAX_METADATA_BYTES + 1)
        blob = self.objects.get(COMMIT_KEY, limit=MAX_METADATA_BYTES + 1)
        if blob is None:
            raise CorruptBufferError(f"{self.url!r}: {COMMIT_KEY} disappeared")
        if self._newest is not None and self._newest[0] == blob:  # unchanged: parsed and checked already
            return self._newest[1]
        record = CommitRecord.from_bytes(blob, self.url, self.config.num_envs)
        if record.lane_capacity not in (None, self.config.lane_capacity) or marked(blob, self.url):
            raise StaleReadError(f"{self.url!r}: the ring's capacity was changed since this reader opened it "
                                 f"({self.config.lane_capacity} steps per lane): open the buffer again to read on")
        if self.config.lane_capacity is None and int(record.committed.max(initial=0)) > self.lane_rows:
            _, arrays = read_layout(read_small, self.url)  # the writer grew them since
            record.check_covered(self.url, lane_rows(arrays))
            self.arrays, self.lane_rows = arrays, lane_rows(arrays)
        self._newest = blob, record
        return record

    def adopt(self, record: CommitRecord) -> None:
        """Reader: follow ``record``: its cursors become this reader's."""
        self.record = record
        self.cursors.follow(record.committed, record.lower)

    # ---- state objects ---------------------------------------------------------------------

    def stage_state(self, state: dict[str, Any], durable: bool) -> StagedState:
        """Write the arrays of ``state`` (if any) to a new state object for the next commit,
        and its journal changes to their journals."""
        sequence = self.record.sequence + 1
        journals: list[Journal] = []

        def stage(path: str, change: JournalChange) -> dict[str, Any]:
            self.check_lock()
            journals.append(self._journal(path))
            return journals[-1].stage(change, sequence, durable).to_json()

        crc = None
        try:
            meta, arrays = state_files.split(state, stage)
            key = state_key(sequence) if arrays else None
            if key is not None:
                self.check_lock()
                blob = state_files.arrays_to_bytes(arrays)
                crc = int.from_bytes(checksum(blob), "little")
                self.objects.put(key, blob, durable)
        except BaseException:
            self.discard(StagedState({}, None, tuple(journals)))
            raise
        return StagedState(meta, key, tuple(journals), crc)

    def discard(self, staged: StagedState) -> None:
        """A staged state whose commit failed: delete its objects later (a commit may still
        name them, if the failure hid a success)."""
        if staged.key is not None:
            self._garbage.append(staged.key)
        for journal in staged.journals:
            self._garbage += journal.failed()

    def _journal(self, path: str) -> Journal:
        if path not in self.journals:
            self.journals[path] = Journal(self.objects, self.url, path)
        return self.journals[path]

    def collect_garbage(self) -> None:
        """Delete state objects no commit names; a failure is retried after the next commit."""
        keep = []
        for key in self._garbage:
            try:
                live = key == self.record.state_arrays or any(j.holds(key) for j in self.journals.values())
                if not live and (is_state_key(key) or is_journal_key(key)):
                    self.check_lock()
                    self.objects.delete(key)
            except OSError:
                keep.append(key)
        self._garbage = keep

    def load_state(self, newest: bool) -> tuple[CommitRecord, dict[str, Any]]:
        """A commit and the state saved with it (empty for a new buffer): this log's commit, or
        (``newest``) the store's newest.

        A reader may race the writer: the commit it read names a state object the writer has
        since replaced. It then reads the newer commit and that one's state.

        A reader held at its commit (`held`) never adopts another: asked for the newest, it
        answers its own commit and no state (the one it loaded when opened is its own).

        Raises CorruptBufferError: the state object is missing or unreadable (naming it).
        """
        if newest and self.held is not None:
            return self.read_newest(), {}
        return self._state_of(self.read_newest() if newest else self.record)

    def newer_state(self) -> tuple[CommitRecord, dict[str, Any]] | None:
        """The store's newest commit and the state saved with it (`load_state`), or None where
        that is this log's commit (then nothing more is read: a reader following a buffer that
        did not change reads its commit record only)."""
        record = self.read_newest()
        return None if record.same_as(self.record) else self._state_of(record)

    def _state_of(self, record: CommitRecord) -> tuple[CommitRecord, dict[str, Any]]:
        """``record`` and its state, or (a reader racing the writer) a newer commit and its state."""
        key = record.state_arrays
        for attempt in range(STATE_ATTEMPTS):
            if attempt:
                record = self.read_newest()
            key, ahead, self._read_ahead = record.state_arrays, self._read_ahead, {}
            if record.state is None:
                return record, {}
            blob = (as_bytes(ahead[key]) if key in ahead else self._get_state(key)) if key else b""
            if blob is not None:
                record.check_state_object(blob, self.url)
                try:
                    arrays = state_files.arrays_from_bytes(blob) if key else {}
                    return record, state_files.join(record.state, arrays, self._read_journals(record, ahead))
                except MissingObject as missing:
                    key = str(missing)
                except (ValueError, KeyError, TypeError) as exc:
                    what = f"state object {key!r}" if key else f"the state of commit {record.sequence}"
                    raise CorruptBufferError(f"{self.url!r}: {what} does not load ({exc})") from None
            if self.mode != "r" or self.held is not None:
                break
        if self.held is not None and not self.read_store_newest().same_as(record):
            raise CommitNotKeptError(f"{self.url!r}: commit {record.sequence} is not kept: the writer committed since, "
                                     f"and deleted its state object {key!r} (pin a commit to read it later)")
        raise CorruptBufferError(f"{self.url!r}: state object {key!r} is missing (the last commit names it)")

    def _read_journals(self, record: CommitRecord, ahead: Mapping[str, Blob | None]) -> Callable[[str, Any], Any]:
        """The journals ``record``'s state names, read together (but for the objects in
        ``ahead``, read already): what each reference stands for."""
        refs = journal_refs(record)
        reads = [(self._journal(path), ref) for path, ref in refs.items()]
        contents = dict(zip(refs, read_journals(reads, ahead)))
        return lambda path, value: contents[path]

    def _get_state(self, key: str) -> bytes | None:
        if not is_state_key(key):  # the record was validated; this guards other callers
            raise CorruptBufferError(f"{self.url!r}: {key!r} is not a state object name")
        return self.objects.get(key)

    def close(self) -> None:
        """Release the writer lock (once)."""
        self.closed = True
        if self.lock is not None and self._release is not None and self._release.detach():
            self.lock.release()  # on this thread: the lock is gone when close returns
