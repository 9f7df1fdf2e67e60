"""`RingReads`: a ring writer's reads of the stored rows of the chunks its lanes overwrite next.

A ring keeps the old rows of the chunk it is about to overwrite: they stay readable until then.
As a lane starts a chunk, the next `read_depth` are read on the read-ahead thread
(`WriteBehind.read_ahead`), and a lane reaching one takes its rows from there instead of
reading them in that add. A read the disk holds up longer (writing back other files, it can take
100s of ms) is not waited for either: the lane stages the chunk at once on zeros, and the rows it
has not overwritten yet are copied in when the read lands (`OldRows`). That is checked at each
append, and waited for by whatever else reads or writes the staged rows (`merge`).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from ..format.lanes import LaneLayout
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .cursors import Cursors
from .loading import ChunkLoader
from .stored_chunks import StoredChunks
from .write_behind import Rows, WriteBehind, read_rows

READ_AHEAD_BYTES = 32 << 20
"""What a ring's lanes read ahead together: each the next chunks it overwrites, 1 to
`READ_AHEAD_CHUNKS` of them."""
READ_AHEAD_CHUNKS = 16


def read_depth(layout: LaneLayout, row_bytes: int, cache_slots: int) -> int:
    """Chunks each lane of a ring reads ahead: its share of `READ_AHEAD_BYTES`, 1 to
    `READ_AHEAD_CHUNKS` and fewer than its ring's; none unless the ring's cache holds 8 chunks
    per lane (``cache_slots``: chunks it holds)."""
    if layout.lane_capacity is None or 8 * layout.num_envs > cache_slots:
        return 0
    chunk_bytes = layout.chunk_rows * row_bytes * layout.num_envs
    return min(max(READ_AHEAD_BYTES // chunk_bytes, 1), READ_AHEAD_CHUNKS, layout.chunks_per_lane() - 1)


@dataclass
class OldRows:
    """A chunk a lane staged from its first row before the read of its stored rows landed: the
    rows the lane has not overwritten yet are copied into ``slot`` when it does (`land`)."""

    chunk: int
    slot: int
    read: Future[Rows]
    reread: Callable[[], Rows]
    """Reads the stored rows again, in the calling thread (for a read ahead that failed)."""

    def land(self, cache: ChunkCache, position: int) -> None:
        """Copy the stored rows from ``position`` (the lane's offset in the chunk now) into the
        slot, waiting for the read. Raises as `ChunkIO.read` if reading again fails too."""
        rows = self.read.result() if self.read.exception() is None else self.reread()
        for name, values in rows.items():
            cache.chunk_rows_of(name, self.slot)[position:] = values[position:]


class RingReads:
    """The reads ahead of one ring writer's lanes, and its chunks staged before theirs landed."""

    def __init__(self, cursors: Cursors, io: ChunkIO, cache: ChunkCache, loader: ChunkLoader, stored: StoredChunks,
                 behind: WriteBehind):
        self.cursors, self.layout, self.io, self.cache = cursors, cursors.layout, io, cache
        self.loader, self.stored, self.behind = loader, stored, behind
        self.depth = read_depth(self.layout, io.schema.row_bytes, cache.full_slots)
        """Chunks a lane starting one reads ahead (`read_depth`)."""
        self.old: dict[int, OldRows] = {}
        """Per lane, its staged chunk whose stored rows have not landed yet."""

    def ahead(self, lane: int, first: int) -> None:
        """Read ahead the `depth` chunks after the one starting at step ``first``, those holding
        stored rows and not cached."""
        layout, chunks = self.layout, {}
        for _ in range(self.depth):
            first += layout.piece_length(first, layout.chunk_rows)
            chunk = int(layout.slot(first)) // layout.chunk_rows
            if self.stored.holds_data(lane, first) and self.cache.slot_of(lane, chunk) < 0:
                chunks[chunk] = self.stored.holds_visible(lane, first)
        self.behind.read_ahead(self.io, lane, chunks, self._like())

    def load(self, lane: int, chunk: int, chunk_first_step: int, offset: int) -> int:
        """A pinned slot for a chunk about to be staged from row ``offset``, holding its stored
        rows: read ahead; or, staged from its first row, zeros until the read lands (`OldRows`);
        or read now. Raises as `ChunkIO.read`."""
        must_exist = self.stored.holds_visible(lane, chunk_first_step)
        ahead = self.behind.take_read(lane, chunk)
        if ahead is not None and not ahead.done() and offset == 0:
            like = self._like()
            slot = self.cache.assign_zeroed(lane, chunk)
            self.old[lane] = OldRows(chunk, slot, ahead, lambda: read_rows(self.io, lane, chunk, like, must_exist))
            return slot
        if ahead is not None and ahead.exception() is None:
            return self.loader.place_read(lane, chunk, ahead.result())
        return self.loader.load_one(lane, chunk, must_exist=must_exist)

    def merge(self, lane: int | None = None, wait: bool = True) -> None:
        """Copy the stored rows of chunks staged before their read landed into their slots
        (`OldRows.land`): ``lane``'s or every lane's; without ``wait``, only reads that landed.
        Raises as `ChunkIO.read` for a chunk that cannot be read (it stays pending)."""
        for ln in [lane] if lane is not None else list(self.old):
            old = self.old.get(ln)
            if old is not None and (wait or old.read.done()):
                old.land(self.cache, int(self.layout.slot(self.cursors.total[ln])) - old.chunk * self.layout.chunk_rows)
                del self.old[ln]

    def forget_old(self, lane: int) -> None:
        """The lane's staged chunk was overwritten whole: its stored rows are not needed."""
        self.old.pop(lane, None)

    def _like(self) -> dict[str, np.ndarray]:
        return {name: self.cache.chunk_rows_of(name, 0) for name in self.io.schema.fields}
