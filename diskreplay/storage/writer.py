"""`StagingWriter`: rows staged in cache slots, written as whole chunks, never per row.

Rows are copied into the chunk they belong to, which sits pinned in the chunk cache (its
*staging* slot). A chunk that fills up is *sealed* and written whole, once; `write_all` (at a
flush) also writes each lane's partial tail chunk. The whole chunks an append covers skip staging:
they are written straight from the caller's arrays before `append` returns. A single step of
every lane that lands inside the staged chunks takes a short way (`StepStaging`): one assignment
per field; the writer resets its plan whenever staging changes.

Failed writes. An `append` that fails (a full disk, an unreachable store) is undone before it
raises (`unappend`): the lane's cursor, staging and cache are as before the call, so nothing of it
is ever committed and a retry gets the same row ids. In a ring, the oldest rows the failed call
would have overwritten are retired (their slots may already hold its rows). A failed flush leaves
the rows staged; the next one writes them again.

In a full ring, writing a chunk destroys the oldest rows of its slots: before any such write the
writer has the commit log commit a raised lower bound (`CommitLog.retire`), so a reader never reads
a row that is being overwritten.

Writes behind the appends. The chunks an ``add`` or ``extend`` seals are written on a background
thread (`WriteBehind`), retire commit included, while the caller goes on: a short batch at a time,
each started as an append ends with none in flight (an idle writer's last sealed chunks wait for
its next append or flush). A retire commit covers every row added so far: the batches after it
whose chunks were sealed before it make none. A store that falls behind slows the appends down
(`_pace`). Until a chunk is written it stays pinned in the cache, where this
process reads it. A background write that fails leaves its chunks sealed, to be written again;
its error is raised once, by the next append (before it stages anything) or flush. Everything
else that writes, or changes a chunk in flight, waits for the batch first (`settle`). A ring
reads the chunks it will overwrite next ahead, on another thread (`RingReads`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from .cache import ChunkCache
from .chunk_io import ChunkIO, ChunkWrite
from .commit_log import CommitLog
from .cursors import Cursors
from .loading import ChunkLoader
from .ring_reads import RingReads
from .step_staging import StepStaging
from .stored_chunks import StoredChunks
from .write_behind import Sealed, WriteBehind

BACKLOG_SHARE = 4
"""Sealed chunks may wait for the background write up to 1/4 of the cache's full slots (riding out
the store's stalls); past that an append waits for the batch in flight."""
PACE_SHARE = 4
"""Past 1/PACE_SHARE of that backlog, each append gives the batch in flight up to `PACE_S`."""
PACE_S = 0.001

class StagingWriter:
    """Staging, sealing and chunk writes of the one writer of a buffer. Not thread-safe."""

    def __init__(self, cursors: Cursors, log: CommitLog, io: ChunkIO, cache: ChunkCache, loader: ChunkLoader,
                 forget_files: Callable[[int, np.ndarray], None], keep_written: bool):
        """``forget_files(lane, chunks)``: chunk files were rewritten (maps must follow).
        ``keep_written``: keep written chunks in the cache (False when memory maps serve them)."""
        self.cursors, self.log, self.io, self.cache, self.loader = cursors, log, io, cache, loader
        self.layout = cursors.layout
        self.stored = StoredChunks(cursors, log)
        self.forget_files = forget_files
        self.keep_written = keep_written
        self.staging = np.full(self.layout.num_envs, -1, dtype=np.int64)
        self.dirty = np.zeros(self.layout.num_envs, dtype=bool)
        self.sealed: list[Sealed] = []
        """Sealed chunks not yet written, nor being written (`behind` holds those): each once, its
        slot pinned until written (a pin is a flag: a second entry would outlive it)."""
        self.behind = WriteBehind()
        self.failure: BaseException | None = None
        """The error of the last background write, not raised yet."""
        self.reads = RingReads(cursors, io, cache, loader, self.stored, self.behind)
        self.steps = StepStaging(self)  # single steps the short way; told when staging changes

    # ---- appends ---------------------------------------------------------------------------

    def append(self, lane: int, rows: Mapping[str, np.ndarray], count: int) -> tuple[int, int]:
        """Stage ``count`` steps for one lane. Returns the steps actually stored ``[first, end)``.

        In a ring, only the last ``lane_capacity`` of them are stored (the others would be
        overwritten at once). All or nothing: if it raises, the lane is as before (`unappend`).
        """
        start = int(self.cursors.total[lane])
        try:
            self.reads.merge(lane, wait=False)
            return self._append(lane, rows, count, start)
        except BaseException:
            self.unappend(lane, start, start + count)
            raise

    def _append(self, lane: int, rows: Mapping[str, np.ndarray], count: int, start: int) -> tuple[int, int]:
        self.steps.reset()
        layout = self.layout
        cap = layout.lane_capacity
        skip = count - cap if cap is not None and count > cap else 0
        step, i = start + skip, skip
        whole: list[tuple[int, int]] = []  # (chunk, first row in ``rows``) written straight from ``rows``
        while i < count:
            piece = layout.piece_length(step, count - i)
            chunk, offset = divmod(int(layout.slot(step)), layout.chunk_rows)
            if piece == layout.chunk_rows and self._unstaged(lane, chunk):
                whole.append((chunk, i))
            else:
                self.cache.write_rows(self._staging_slot(lane, chunk, step - offset, offset), offset, rows, i, piece)
                self.dirty[lane] = True
                if offset + piece == layout.chunk_rows or layout.slot(step + piece) == 0:
                    self._seal(lane, complete=True)
                self.cursors.total[lane] = step + piece
                if (len(self.sealed) + len(self.behind.in_flight)) * 2 > self.cache.full_slots:
                    self.write_sealed(durable=False)
            i += piece
            step += piece
        self.cursors.total[lane] = start + count
        self._write_whole(lane, rows, whole)
        return start + skip, start + count

    def unappend(self, lane: int, start: int, attempted_end: int) -> None:
        """Forget steps ``[start, attempted_end)`` of a lane that a failed call staged or wrote
        (never committed): the lane's cursor, staging and cache are as before that call.

        In a ring, the rows whose slots the call reached are retired (``lower``), as their bytes
        may already be gone. Chunk files written beyond the cursor stay, unseen, until rewritten.
        """
        self.wait()
        self.reads.merge(lane)
        self.steps.reset()
        layout, cursors = self.layout, self.cursors
        cursors.total[lane] = start
        if layout.lane_capacity is not None:
            cursors.lower[lane] = min(max(int(cursors.lower[lane]), int(layout.oldest(attempted_end))), start)
        touched = layout.chunks_between(start, attempted_end)
        keep = -1  # the chunk holding the steps just before ``start``, still valid
        if layout.slot(start) % layout.chunk_rows and layout.oldest(attempted_end) < start:
            keep = int(layout.slot(start) // layout.chunk_rows)
        self.sealed = [(ln, c, s) for ln, c, s in self.sealed if ln != lane or c not in touched]
        self.cache.drop(lane, touched[touched != keep])
        self._rewritten(lane, touched)
        slot = self._complete_slot(lane, keep) if keep >= 0 else -1
        if slot >= 0:  # staged again: its rows before ``start`` are written with the next chunks
            self.staging[lane], self.dirty[lane] = keep, True
            self.cache.pin(slot)
        else:
            self.staging[lane], self.dirty[lane] = -1, False

    def rewind(self, total: np.ndarray) -> None:
        """Right after open: forget steps at or after ``total`` per lane (steps a parent buffer
        never committed); they are overwritten by the next appends."""
        self.steps.reset()
        self.cursors.total = np.minimum(self.cursors.total, total)

    def _unstaged(self, lane: int, chunk: int) -> bool:
        """Whether a whole chunk can be written straight from the caller's rows: no staged or
        sealed copy of it waits in the cache (a cached clean copy is dropped)."""
        self.cache.ensure_chunks(chunk + 1)
        slot = self.cache.slot_of(lane, chunk)
        if slot >= 0 and self.cache.is_pinned(slot):
            return False
        if slot >= 0:
            self.cache.evict(np.array([slot]))
        return True

    def _write_whole(self, lane: int, rows: Mapping[str, np.ndarray], whole: list[tuple[int, int]]) -> None:
        """Write whole chunks from ``rows`` without staging them: one copy fewer for bulk extends.
        Done before `append` returns, as the caller may reuse its arrays."""
        if not whole:
            return
        self.settle(wait=True)
        self.log.retire(self.cursors.first_kept())
        n = self.layout.chunk_rows
        self._put([(self.io.key(name, lane, chunk), self.io.codecs[name], rows[name][i:i + n],
                    self.stored.never_committed(lane, chunk))
                   for chunk, i in whole for name in self.io.schema.fields], durable=False)
        self._rewritten(lane, np.array([chunk for chunk, _ in whole]))

    def _staging_slot(self, lane: int, chunk: int, chunk_first_step: int, offset: int) -> int:
        if self.staging[lane] == chunk:
            return self.cache.slot_of(lane, chunk)
        if self.staging[lane] >= 0:
            self._seal(lane)
        if self.behind.holds(lane, chunk):  # a small ring came round to a chunk still being written
            self.settle(wait=True)
        self.cache.ensure_chunks(chunk + 1)
        slot = self._complete_slot(lane, chunk)
        if slot >= 0:
            self.cache.pin(slot)
        elif self.stored.holds_data(lane, chunk_first_step):
            slot = self.reads.load(lane, chunk, chunk_first_step, offset)
        else:
            slot = self.cache.assign_zeroed(lane, chunk)
        self.staging[lane] = chunk
        if self.reads.depth:
            self.reads.ahead(lane, chunk_first_step)
        return slot

    def _seal(self, lane: int, complete: bool = False) -> None:
        """Seal a lane's staged chunk (``complete``: every row of it added since it was staged)."""
        if complete:
            self.reads.forget_old(lane)
        self.reads.merge(lane)
        chunk = int(self.staging[lane])
        if chunk >= 0 and self.dirty[lane]:
            sealed = (lane, chunk, self.cache.slot_of(lane, chunk))
            if sealed not in self.sealed:  # staged again before its write: it waits once (one pin)
                self.sealed.append(sealed)
        elif chunk >= 0:
            self.cache.unpin(self.cache.slot_of(lane, chunk))
        self.staging[lane] = -1
        self.dirty[lane] = False
        self.steps.reset()

    # ---- patches ---------------------------------------------------------------------------

    def update_rows(self, lane: int, first: int, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite fields of steps ``[first, first + n)`` of one lane, already added.

        For fields derived after the fact (episodic returns, an episode closed at reopen). Chunks
        already written are read first (all of them, before any value changes: a failed read
        changes nothing), patched in the cache and queued to be rewritten with the next chunk writes.
        """
        self.reads.merge()
        count = len(next(iter(values.values())))
        pieces = []
        step, i = first, 0
        while i < count:
            piece = self.layout.piece_length(step, count - i)
            chunk, offset = divmod(int(self.layout.slot(step)), self.layout.chunk_rows)
            pieces.append((self._patchable_slot(lane, chunk), offset, i, piece))
            i += piece
            step += piece
        for slot, offset, i, piece in pieces:
            self.cache.write_rows(slot, offset, values, i, piece)

    def _patchable_slot(self, lane: int, chunk: int) -> int:
        if self.behind.holds(lane, chunk):
            self.settle(wait=True)
        if self.staging[lane] == chunk:
            self.dirty[lane] = True
            return self.cache.slot_of(lane, chunk)
        for sealed_lane, sealed_chunk, slot in self.sealed:
            if (sealed_lane, sealed_chunk) == (lane, chunk):
                return slot
        slot = self._complete_slot(lane, chunk)
        if slot >= 0:
            self.cache.pin(slot)
        else:
            slot = self.loader.load_one(lane, chunk, must_exist=True)
        self.sealed.append((lane, chunk, slot))
        return slot

    def _complete_slot(self, lane: int, chunk: int) -> int:
        """The slot caching every field of this chunk, or -1 (a slot holding some fields only is
        dropped: the chunk is about to be rewritten from the cache)."""
        slot = self.cache.slot_of(lane, chunk)
        if slot >= 0 and self.cache.is_partial(slot):
            self.cache.evict(np.array([slot]))
            return -1
        return slot

    # ---- chunk writes ----------------------------------------------------------------------

    def write_sealed(self, durable: bool) -> None:
        """Write every sealed chunk (and nothing else), after retiring the rows they overwrite."""
        self.settle(wait=True)
        self._write_chunks(self.sealed, durable)
        self._release(self.sealed)
        self.sealed = []

    def write_behind(self) -> None:
        """Start writing the sealed chunks on the background thread, unless a batch is in flight
        (they go with the next one) or the last one failed (`settle` raises its error first)."""
        self.reap(wait=False)
        self._pace()
        if not self.sealed or self.behind.busy or self.failure is not None:
            return
        if any(self.staging[lane] == chunk for lane, chunk, _ in self.sealed):
            return self.write_sealed(durable=False)  # a ring wrapped within the append, staging a sealed chunk again
        batch = max(self.io.threads, self.layout.num_envs)
        chunks, self.sealed = self.sealed[:batch], self.sealed[batch:]
        work, first_kept = self._work(chunks), self.cursors.first_kept()
        needed = self.stored.first_kept_after([(lane, chunk) for lane, chunk, _ in chunks])

        def write() -> None:
            self.log.retire(first_kept, needed)
            self._put(work, durable=False, behind=True)
        self.behind.start(chunks, write)

    def _pace(self) -> None:
        """A store that falls behind the appends slows them down, a little at a time: past
        1/`PACE_SHARE` of the backlog each append waits up to `PACE_S` for the batch in flight
        (the thread writing it gets the CPU); past the backlog, for the whole batch."""
        if not self.behind.busy:
            return
        if len(self.sealed) > self.cache.full_slots // BACKLOG_SHARE:
            self.settle(wait=True)
        elif len(self.sealed) > self.paced_past:
            self.behind.wait(PACE_S)
            self.reap(wait=False)

    @property
    def paced_past(self) -> int:
        """Sealed chunks past which each append gives the batch in flight a moment (`_pace`)."""
        return max(self.cache.full_slots // BACKLOG_SHARE // PACE_SHARE, 1)

    def settle(self, wait: bool = False) -> None:
        """Take back a background write that ended (``wait``: wait for the one in flight); raise
        its error, once, if it failed (its chunks are sealed again, written with the next batch)."""
        self.reap(wait)
        error, self.failure = self.failure, None
        if error is not None:
            raise error

    def wait(self) -> None:
        """Wait for the background write in flight; a failure is kept for the next call to raise."""
        self.reap(wait=True)

    def reap(self, wait: bool) -> None:
        """Take back the background write if it ended (``wait``: wait for it); a failure is kept
        for the next `settle` to raise, its chunks sealed again."""
        ended = self.behind.finish(wait)
        if ended is None:
            return
        chunks, error = ended
        for lane, chunk, _ in chunks:  # some may have been rewritten before a failure
            self._rewritten(lane, np.array([chunk]))
        if error is None:
            self._release(chunks)
        else:
            self.sealed = chunks + self.sealed
            self.failure = error

    def write_all(self, durable: bool) -> None:
        """Write sealed chunks and every lane's partial tail chunk (fsynced if ``durable``). If it
        raises, the rows stay staged."""
        self.settle(wait=True)
        self.reads.merge()
        tails = [(lane, int(self.staging[lane]), self.cache.slot_of(lane, int(self.staging[lane])))
                 for lane in np.flatnonzero(self.dirty).tolist()]
        self._write_chunks(self.sealed + tails, durable)
        self._release(self.sealed)
        self.sealed = []
        self.dirty[:] = False
        self.steps.reset()
        if durable:
            self.io.sync()

    def _release(self, chunks: list[Sealed]) -> None:
        """Unpin written chunks, except a lane's current staging chunk (a ring that wraps within
        one append re-stages a chunk it already sealed). With memory maps, the maps serve written
        chunks: the cache then holds only the chunks not written yet."""
        written = np.array([slot for _, _, slot in chunks], dtype=np.int64)
        self.cache.unpin(written)
        lanes = np.flatnonzero(self.staging >= 0)
        self.cache.pin(self.cache.slots_of(lanes, self.staging[lanes]))
        if not self.keep_written:
            self.cache.evict(written[~self.cache.is_pinned(written)])

    def _write_chunks(self, chunks: list[Sealed], durable: bool) -> None:
        if not chunks:
            return
        self.log.retire(self.cursors.first_kept())
        self._put(self._work(chunks), durable)
        for lane, chunk, _ in chunks:
            self._rewritten(lane, np.array([chunk]))

    def _rewritten(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks of a lane were (or may have been) rewritten: maps and reads ahead of them go."""
        self.forget_files(lane, chunks)
        self.behind.forget_reads(lane, chunks.tolist())

    def _work(self, chunks: list[Sealed]) -> list[ChunkWrite]:
        return [(self.io.key(name, lane, chunk), self.io.codecs[name], self.cache.chunk_rows_of(name, slot),
                 self.stored.never_committed(lane, chunk))
                for lane, chunk, slot in chunks for name in self.io.schema.fields]

    def _put(self, work: list[ChunkWrite], durable: bool, behind: bool = False) -> None:
        with self.log.fenced():
            self.io.put(work, durable, behind)

    def close(self) -> None:
        """Wait for the background write in flight and end the background threads. Nothing more is written."""
        self.behind.close()
