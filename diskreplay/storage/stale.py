"""`RetiredCheck`: a ring reader's defence against rows its writer overwrote since its commit.

A reader keeps the window of the commit it last adopted while the writer goes on. Cached chunks
stay right for that window: a row of a step never changes, and a cached copy predates any
overwrite of it. A chunk *fetched* later may already hold the writer's next round in a ring; but
the writer commits a raised ``lower`` before overwriting. So after a ring reader fetches (or maps)
chunks, it re-reads ``commit.json`` (one small GET; a union: that of each shard whose lanes it
fetched, `Log.read_newest_of`) and, if the newest commit's first visible step
has passed any row it asked for from those chunks, it drops them and raises `StaleReadError`
naming the rows: the buffer then adopts the newest commit with all its in-RAM state and the
caller draws again. If only rows it did not ask for were retired, it returns the rows asked for
but does not keep those chunks (their other slots may hold the next round). Every cached chunk is
thus right for every step of the reader's window that maps to it, so cache hits need no check;
nor do dataset-mode buffers (they never overwrite a row).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import StaleReadError
from .cache import ChunkCache
from .log import Log

Window = Callable[[], tuple[np.ndarray, np.ndarray]]
Retired = list[tuple[int, np.ndarray]]
"""``(lane, chunks)`` pairs of fetched chunks that hold steps the writer retired."""


class RetiredCheck:
    """Checks chunks a ring reader fetched against the newest commit."""

    def __init__(self, log: Log, cache: ChunkCache, window: Window):
        self.log = log
        self.cache = cache
        self.window = window
        self.layout = log.cursors.layout
        self.active = log.mode == "r" and self.layout.lane_capacity is not None
        self.stale_reads = 0
        """Reads refused so far because the writer had overwritten rows they asked for."""

    def check(self, lane: np.ndarray, step: np.ndarray, loaded_lanes: np.ndarray,
              loaded_chunks: np.ndarray) -> Retired:
        """After fetching chunks: raise `StaleReadError` if the writer had retired any of the
        requested (lane, step)s by then. Otherwise return the fetched chunks holding other retired
        steps of this reader's window: their rows asked for are right, but they must not stay."""
        if not self.active or not len(loaded_chunks):
            return []
        record = self.log.read_newest_of(loaded_lanes)
        if record.same_as(self.log.record):
            return []
        first = np.maximum(record.lower, self.layout.oldest(record.committed))
        tainted = self._tainted(first, loaded_lanes, loaded_chunks)
        gone = step < first[lane]
        if not gone.any():
            return tainted
        for ln in np.unique(loaded_lanes).tolist():
            self.cache.invalidate(ln, loaded_chunks[loaded_lanes == ln])
        ids = (step[gone] * self.layout.num_envs + lane[gone])[:5].tolist()
        self.stale_reads += 1
        raise StaleReadError(
            f"{self.log.url!r}: rows {ids}{'...' if gone.sum() > 5 else ''} were overwritten by the writer "
            f"after this reader's commit {self.log.record.sequence}; the newest is commit "
            f"{record.sequence} (first readable steps per lane {first.tolist()}): refresh and sample again")

    def _tainted(self, first: np.ndarray, loaded_lanes: np.ndarray, loaded_chunks: np.ndarray) -> Retired:
        lo, hi = self.window()
        tainted = []
        for ln in np.unique(loaded_lanes).tolist():
            retired_end = min(int(first[ln]), int(hi[ln]))
            if retired_end > lo[ln]:
                risky = np.intersect1d(loaded_chunks[loaded_lanes == ln],
                                       self.layout.chunks_between(int(lo[ln]), retired_end))
                if risky.size:
                    tainted.append((ln, risky))
        return tainted
