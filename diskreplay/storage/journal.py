"""`Journal`: one journal's objects in a store (`format.journal` has the layout), written by a
commit in the commit protocol's order (objects first, then the record that names them) and read
back checked.

A commit that fails after writing log chunks keeps its records pending: the next commit writes
them again before its own (once, where its own records begin with them, as a list that only
grows does), so a log chunk is only ever rewritten with the same bytes (a failure may hide a
success, and a reader may already follow the commit that names it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import Codec, checksum
from ..format.journal import BASE_CHUNK, LOG_CHUNK, JournalChange, JournalContent, JournalRef, new_name
from ..io.store import Blob, ChunkStore

Wanted = tuple[str, np.dtype, int]
"""An object of a journal to read: its key, the dtype and the count of its elements."""
FIRST_ROUND = 1024
"""Objects `read_journals` asks for before it knows whether any is missing: a damaged reference
that claims a huge journal fails after this many, not after a request per object it claims."""


class MissingObject(Exception):
    """An object a commit names is gone: the writer replaced that commit meanwhile (readers retry)."""


class Journal:
    """The journal at one state path: the committed reference, the records of its tail, and
    the records of a commit that failed."""

    def __init__(self, store: ChunkStore, url: str, path: str):
        self.store, self.url, self.path = store, url, path
        self.ref: JournalRef | None = None
        self.tail: np.ndarray | None = None  # records past the last full log chunk of `ref`
        self.pending: np.ndarray | None = None  # records a failed commit wrote, written again first
        self.staged: tuple[JournalRef, np.ndarray, np.ndarray] | None = None  # ref, records, tail
        self.known: dict[str, np.ndarray] = {}  # a reader: the write-once objects (bases, full log chunks) read

    def stage(self, change: JournalChange, sequence: int, durable: bool) -> JournalRef:
        """Write what ``change`` needs for commit ``sequence``; the reference to commit.

        Raises ValueError for records appended to no generation (the first change needs a base)."""
        records, self.known = change.records, {}  # a writer reads once, at open: keep no copies
        if change.base is None:
            if self.ref is None or self.tail is None or self.ref.record_dtype != records.dtype:
                raise ValueError(f"journal {self.path!r}: records appended before any base was committed")
            ref, tail = self.ref, self.tail
            pending = self.pending
            if pending is not None and not np.array_equal(records[:len(pending)], pending):
                records = np.concatenate([pending, records])
            if not len(records):
                return ref
        else:
            ref = JournalRef(self.path, new_name(sequence), change.base.dtype, records.dtype, len(change.base), 0, None)
            tail = records[:0]
            for key, start in zip(ref.base_keys(), range(0, ref.base, BASE_CHUNK)):
                self._put(ref, key, change.base[start:start + BASE_CHUNK], durable)
        joined = np.concatenate([tail, records])
        first_chunk = (ref.records - len(tail)) // LOG_CHUNK
        full = len(joined) // LOG_CHUNK
        for i in range(full):
            self._put(ref, ref.log_key(first_chunk + i), joined[i * LOG_CHUNK:(i + 1) * LOG_CHUNK], durable)
        rest = joined[full * LOG_CHUNK:].copy()
        ref = replace(ref, records=ref.records + len(records), tail=new_name(sequence) if len(rest) else None)
        tail_key = ref.tail_key()
        if tail_key is not None:
            self._put(ref, tail_key, rest, durable)
        self.staged = (ref, records, rest)
        return ref

    def _put(self, ref: JournalRef, key: str, values: np.ndarray, durable: bool) -> None:
        """Write the object ``key`` of ``ref``'s generation: ``values``, then their checksum if
        the generation has checksums."""
        body = np.ascontiguousarray(values).tobytes()
        self.store.put(key, (body, checksum(body)) if ref.checksummed else body, durable)

    def committed(self) -> list[str]:
        """The staged reference was committed. Returns the objects the previous one named that
        this one does not: its tail, or after a new base, its whole generation."""
        old, new = self.ref, self.staged[0] if self.staged is not None else self.ref
        if self.staged is not None:
            self.ref, _, self.tail = self.staged
        self.staged, self.pending = None, None
        if old is None or new is None or old is new:
            return []
        if old.generation != new.generation:
            return old.keys()
        tail = old.tail_key()
        return [tail] if tail is not None and tail != new.tail_key() else []

    def failed(self) -> list[str]:
        """The staged commit failed: an append keeps its records for the next commit. Returns
        the objects it wrote that the committed reference does not name."""
        if self.staged is None:
            return []
        ref, records, _ = self.staged
        if self.ref is not None and ref.generation == self.ref.generation:
            self.pending = records
        self.staged = None
        return [key for key in ref.keys() if not self.holds(key)]

    def holds(self, key: str) -> bool:
        """Whether the committed reference names ``key``."""
        return self.ref is not None and self.ref.names(key)

    def read(self, ref: JournalRef) -> JournalContent:
        """The content of the journal at ``ref`` (`read_journals`)."""
        return read_journals([(self, ref)])[0]

    def _wanted(self, ref: JournalRef) -> tuple[list[Wanted], list[Wanted], Wanted | None]:
        """What ``ref`` consists of (`parts`), the objects of another generation forgotten."""
        if self.ref is None or self.ref.generation != ref.generation:
            self.known = {}
        return parts(ref)

    def _adopt(self, ref: JournalRef, parts: tuple[list[Wanted], list[Wanted], Wanted | None],
               got: dict[str, np.ndarray]) -> JournalContent:
        """The content at ``ref`` from ``got`` (the objects read) and the write-once objects known."""
        bases, logs, last = parts
        tail = got.pop(last[0]) if last else np.zeros(0, ref.record_dtype)
        self.known.update(got)
        base = np.concatenate([self.known[key] for key, _, _ in bases]) if bases else np.zeros(0, ref.base_dtype)
        records = np.concatenate([*(self.known[key] for key, _, _ in logs), tail])
        self.ref, self.tail, self.pending, self.staged = ref, tail, None, None
        return JournalContent(base, records)


def parts(ref: JournalRef) -> tuple[list[Wanted], list[Wanted], Wanted | None]:
    """What ``ref`` consists of: its bases, its full log chunks and its tail (None: none)."""
    bases = [(key, ref.base_dtype, min(BASE_CHUNK, ref.base - start))
             for key, start in zip(ref.base_keys(), range(0, ref.base, BASE_CHUNK))]
    logs = [(ref.log_key(i), ref.record_dtype, LOG_CHUNK) for i in range(ref.records // LOG_CHUNK)]
    tail_key = ref.tail_key()
    return bases, logs, (tail_key, ref.record_dtype, ref.records % LOG_CHUNK) if tail_key else None


def object_sizes(refs: list[JournalRef]) -> dict[str, int]:
    """The bytes of each object a reader that knows none of them reads for ``refs``."""
    return {key: count * dtype.itemsize + ref.trailer()
            for ref in refs for bases, logs, last in [parts(ref)]
            for key, dtype, count in [*bases, *logs, *([last] if last else [])]}


def read_journals(reads: list[tuple[Journal, JournalRef]],
                  read_ahead: Mapping[str, Blob | None] | None = None) -> list[JournalContent]:
    """Each journal's content at its reference, which becomes its committed state. Bases and full
    log chunks are written once: those read for an earlier reference of the same generation are
    not read again (a reader following commits reads what was appended). The objects of all the
    journals are fetched together, from the first one's store (one round trip on an object store;
    two past `FIRST_ROUND` objects), but for those in ``read_ahead`` (key -> bytes, None: missing),
    read already.

    Raises MissingObject (an object is gone) or CorruptBufferError (one has the wrong size or
    fails its checksum: the first object in order that does)."""
    if not reads:
        return []
    parts = [journal._wanted(ref) for journal, ref in reads]
    items = [(i, key, dtype, count, count * dtype.itemsize + ref.trailer())
             for i, ((journal, ref), (bases, logs, last)) in enumerate(zip(reads, parts))
             for key, dtype, count in [*(one for one in bases + logs if one[0] not in journal.known),
                                       *([last] if last else [])]]
    ahead = read_ahead or {}
    missing = [key for _, key, *_ in items if key not in ahead]
    limit = max((size for *_, size in items), default=0) + 1
    fetched: dict[str, Blob | None] = {}
    for round_keys in (missing[:FIRST_ROUND], missing[FIRST_ROUND:]):
        if round_keys and None not in fetched.values():
            fetched.update(zip(round_keys, reads[0][0].store.get_many(round_keys, limit=limit)))
    blobs = [ahead[key] if key in ahead else fetched.get(key) for _, key, *_ in items]
    got: list[dict[str, np.ndarray]] = [{} for _ in reads]
    for (i, key, dtype, count, size), blob in zip(items, blobs):
        journal, ref = reads[i]
        got[i][key] = _checked(journal.url, ref, key, dtype, count, size, blob)
    return [journal._adopt(ref, part, found) for (journal, ref), part, found in zip(reads, parts, got)]


def _checked(url: str, ref: JournalRef, key: str, dtype: np.dtype, count: int, size: int,
             blob: Blob | None) -> np.ndarray:
    """The ``count`` elements of the object ``key`` of ``ref``, its size and checksum checked."""
    if blob is None:
        raise MissingObject(key)
    if len(blob) != size:
        then = ", then a CRC32C" if ref.checksummed else ""
        raise CorruptBufferError(f"{url!r}: journal object {key!r}: expected {size} bytes "
                                 f"({count} of {dtype}{then}), got {'more' if len(blob) > size else len(blob)}")
    try:
        body = Codec.verified_body(memoryview(blob)) if ref.checksummed else blob
    except ValueError as exc:
        raise CorruptBufferError(f"{url!r}: journal object {key!r} is damaged: {exc}") from None
    return np.frombuffer(body, dtype=dtype)  # read-only: `_adopt` concatenates the pieces
