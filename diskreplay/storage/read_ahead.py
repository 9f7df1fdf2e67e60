"""`ReadAhead`: the chunks a reader will need next, fetched and decoded ahead of its reads.

A reader that knows the order of its next reads (an epoch, `Storage.read_ahead`) hands it over as
(lane, step) arrays, read lazily. Chunks are started in order of first need, each one job on a
pool of threads that keeps ``io.threads`` requests in flight locally, four times that on an object store:
it fetches the chunk of every field at once and decodes them (zstd, lz4 and checksums run
without the GIL) straight into a cache slot reserved for it, off the reader's thread. The slot is shown to reads
(`ChunkCache.place`) on the reader's thread when a read needs it, waiting for that chunk alone.

What is started and not yet read is bounded by bytes (decoded, ``budget_bytes``, at most half
the cache), not by a count of chunks or batches: each read frees what it used and the read-ahead
tops up at once, across batch and window boundaries. A failed job only frees its slot: the read
then loads the chunk itself and reports what is wrong.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..io.threads import Threads
from .loading import ChunkLoader
from .stale import RetiredCheck

READ_AHEAD_BYTES = 128 * 2**20
"""Default budget: decoded bytes fetched ahead of the reads and not yet read. Sized for object
stores (tens of ms per request): enough for every connection to be busy with chunks of any size."""

REMOTE_IN_FLIGHT = 4
"""On an object store, requests a read-ahead keeps in flight per I/O thread: the decoding of a
chunk and the round trip of the next overlap."""

Steps = Iterable[tuple[np.ndarray, np.ndarray]]
"""(lane, step) arrays, in the order they will be read."""


@dataclass
class _Fill:
    """A chunk started ahead: its reserved slot and the job that fills it."""

    lane: int
    chunk: int
    slot: int
    jobs: list[Future[bool]]


class ReadAhead:
    """Chunks fetched and decoded ahead of a reader's reads, in the order it gave."""

    def __init__(self, loader: ChunkLoader, retired: RetiredCheck):
        self.loader, self.cache, self.io, self.retired = loader, loader.cache, loader.io, retired
        self.layout = retired.layout
        self.slot_bytes = self.layout.chunk_rows * self.io.schema.row_bytes
        fields = len(loader.all_fields)  # one job per chunk, a request per field
        in_flight = self.io.threads * (1 if self.io.store.supports_mmap else REMOTE_IN_FLIGHT)
        self.workers = Threads(max(1, -(-in_flight // fields)), "diskreplay-ahead")
        self.budget = 0
        """Chunks that may be started and not yet read (0: no plan)."""
        self.started = 0
        """Chunks fetched ahead so far (each counted in ``loader.chunks_loaded`` too)."""
        self._next: Iterator[tuple[int, int]] = iter(())
        self._ahead: dict[tuple[int, int], _Fill] = {}

    @property
    def active(self) -> bool:
        return self.budget > 0 or bool(self._ahead)

    def plan(self, steps: Steps | None, budget_bytes: int = READ_AHEAD_BYTES) -> None:
        """Read ahead the chunks of ``steps`` (None: stop), and start the first at once. A cache
        of fewer than two slots reads nothing ahead."""
        self.drop()
        if steps is None:
            return
        self.budget = min(max(1, budget_bytes // self.slot_bytes), self.cache.full_slots // 2)
        self._next = self._chunks(steps)
        self.top_up()

    def _chunks(self, steps: Steps) -> Iterator[tuple[int, int]]:
        """Each (lane, chunk) of ``steps`` once, in order of first need."""
        lanes = self.cache.lanes
        seen = np.zeros(0, dtype=bool)  # by chunk * lanes + lane
        for lane, step in steps:
            keys = self.layout.chunk_and_offset(step)[0] * lanes + lane
            if len(keys) and keys.max() >= len(seen):
                seen = np.concatenate([seen, np.zeros(2 * int(keys.max()) + 1 - len(seen), dtype=bool)])
            new = _runs(keys[~seen[keys]])
            if not len(new):
                continue
            if len(new) > 1:
                _, first = np.unique(new, return_index=True)
                new = new[np.sort(first)]
            seen[new] = True
            yield from zip((new % lanes).tolist(), (new // lanes).tolist())

    def top_up(self) -> None:
        """Start chunks of the plan until the budget is used, looking at most ``4 * io.threads``
        chunks of it a call (chunks cached whole already are only marked recently used)."""
        wanted: list[tuple[int, int]] = []
        # a slot left for reads; a few threads' worth at a time, so no read waits for the whole plan
        # (nor, where the plan's chunks are cached already, for a walk through all of them)
        room = min(self.budget - len(self._ahead), self.cache.evictable() - 1, 4 * self.io.threads)
        for _ in range(4 * self.io.threads):
            if len(wanted) >= room:
                break
            key = next(self._next, None)
            if key is None:
                self.budget = 0  # the plan is spent
                break
            slot = self.cache.slot_of(*key)
            if slot >= 0 and not self.cache.is_partial(slot):
                self.cache.touch(np.array([slot]))
            else:
                wanted.append(key)
        if not wanted:
            return
        for (lane, chunk), slot in zip(wanted, self.cache.reserve(len(wanted)).tolist()):
            io = self.io
            work = [(io.key(name, lane, chunk), io.codecs[name], self.cache.chunk_rows_of(name, slot))
                    for name in self.loader.all_fields]
            self._ahead[lane, chunk] = _Fill(lane, chunk, slot, [self.workers.submit(io.read_here, work)])
        self.loader.chunks_loaded += len(wanted)
        self.started += len(wanted)

    def before(self, lane: np.ndarray, step: np.ndarray) -> None:
        """Before a read of (lane, step): show the chunks it needs that were started ahead
        (waiting for those still in flight); they stop counting against the budget."""
        if not self._ahead:
            return
        chunk = self.layout.chunk_and_offset(step)[0]
        keys = np.unique(_runs(lane * self.cache.width + chunk))
        fills = [fill for key in zip((keys // self.cache.width).tolist(), (keys % self.cache.width).tolist())
                 if (fill := self._ahead.pop(key, None)) is not None]
        shown = [fill for fill in fills if self._finish(fill)]
        if not shown:
            return
        lanes, chunks = np.array([f.lane for f in shown]), np.array([f.chunk for f in shown])
        slots = self.cache.place(lanes, chunks, np.array([f.slot for f in shown]))
        self.cache.unpin(slots)
        asked = np.isin(lane * self.cache.width + chunk, lanes * self.cache.width + chunks)
        for ln, stale in self.retired.check(lane[asked], step[asked], lanes, chunks):
            self.cache.invalidate(ln, stale)

    def _finish(self, fill: _Fill) -> bool:
        """Wait for a chunk's jobs: whether it was read whole (else its slot is freed)."""
        failed = [job.exception() for job in fill.jobs]  # every job done with the slot first
        whole = all(error is None and job.result() for job, error in zip(fill.jobs, failed))
        if not whole:
            self.cache.release(np.array([fill.slot]))
        return whole

    def drop(self) -> None:
        """Forget the plan; chunks started and not read are freed once their jobs end."""
        self.budget, self._next = 0, iter(())
        for fill in self._ahead.values():
            for job in fill.jobs:
                job.cancel()
        for fill in self._ahead.values():
            for job in fill.jobs:
                if not job.cancelled():
                    job.exception()
            self.cache.release(np.array([fill.slot]))
        self._ahead = {}

    def close(self) -> None:
        self.drop()
        self.workers.shutdown()


def _runs(keys: np.ndarray) -> np.ndarray:
    """``keys`` with each run of equal neighbours kept once: rows read in order or in blocks
    name few chunks, which this finds in one pass before any sort or hash."""
    if len(keys) < 2:
        return keys
    keep = np.empty(len(keys), dtype=bool)
    keep[0] = True
    np.not_equal(keys[1:], keys[:-1], out=keep[1:])
    return keys[keep]
