"""`PointReads`: rows of raw fields read straight from their chunk objects, never whole chunks.

A raw chunk object holds its rows' values one row after another (then a checksum). A reader
that misses rows its cache does not hold (a cold read from an object store, or from local disk
while the first-read fill runs behind it, `Warmer`) reads just their bytes: one byte range per
run of nearby rows of one chunk object, every range of a read at once (`ChunkStore.get_ranges`:
ranged GETs in flight on an object store, ``pread`` locally, each range asked of the OS first).
Nothing is cached. Each object must have its chunk's size and each range must come back whole;
a run over half its chunk or more reads the chunk whole and checks its checksum. The checksum of
a chunk read in part is checked where the chunk is read whole (the fill, an epoch, `verify`), as
with memory-mapped reads.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import checksum
from .chunk_io import ChunkIO
from .outputs import Rows

GAP_BYTES = 4096
"""Rows of one chunk object at most this many bytes apart are read in one range: a request
costs more than that many bytes (a page locally, a round trip remotely)."""


class PointReads:
    """Targeted reads of the raw fields of one buffer; counts what they read."""

    def __init__(self, io: ChunkIO, chunk_rows: int):
        self.io, self.chunk_rows = io, chunk_rows
        self.names = frozenset(name for name, codec in io.codecs.items() if codec.raw and codec.inner_rows is None)
        self.rows_read = 0
        """Rows (of every field asked) read this way so far."""
        self.ranges_read = 0
        """Byte ranges read so far (one request each on an object store)."""

    def covers(self, names: tuple[str, ...]) -> bool:
        """Whether every field of ``names`` can be read row by row."""
        return self.names.issuperset(names)

    def read(self, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray, out: Rows) -> None:
        """The rows at (lane, chunk, offset) of every field of ``out`` (raw: `covers`) into it.

        Raises CorruptBufferError naming a chunk object that is missing or ends before the rows."""
        order = np.lexsort((offset, chunk, lane))
        lane, chunk, offset = lane[order], chunk[order], offset[order]
        plans = {name: self._plan(name, lane, chunk, offset) for name in out}
        ranges = [(self.io.key(name, ln, ch), start, stop) for name, (_, firsts, starts, stops) in plans.items()
                  for ln, ch, start, stop in zip(lane[firsts].tolist(), chunk[firsts].tolist(), starts.tolist(),
                                                 stops.tolist())]
        found = self.io.store.get_ranges(ranges)
        self.rows_read += len(order)
        self.ranges_read += len(ranges)
        done = 0
        for name, (run_of, firsts, starts, stops) in plans.items():
            row_bytes = self.io.schema[name].row_bytes
            got = [self._checked(one, ranged, self.chunk_rows * row_bytes, self.io.codecs[name].trailer)
                   for one, ranged in zip(ranges[done:done + len(firsts)], found[done:done + len(firsts)])]
            done += len(firsts)
            data = np.frombuffer(b"".join(got), np.uint8)
            base = np.concatenate([[0], np.cumsum(stops - starts)[:-1]])
            at = base[run_of] + offset * row_bytes - starts[run_of]
            rows = out[name].reshape(len(order), -1).view(np.uint8)
            rows[order] = data[at[:, None] + np.arange(row_bytes)]

    def _plan(self, name: str, lane: np.ndarray, chunk: np.ndarray,
              offset: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A field's runs (`_runs`); a run over half its chunk or more reads the chunk whole, its
        checksum with it."""
        run_of, firsts, starts, stops = _runs(lane, chunk, offset, self.io.schema[name].row_bytes)
        values = self.chunk_rows * self.io.schema[name].row_bytes
        whole = 2 * (stops - starts) >= values
        starts[whole], stops[whole] = 0, values + self.io.codecs[name].trailer
        return run_of, firsts, starts, stops

    def _checked(self, asked: tuple[str, int, int], ranged: tuple[bytes, int] | None, values: int,
                 trailer: int) -> bytes:
        """A range's bytes, once the object exists, has the size of its chunk and gave them all
        (and a whole chunk matches its checksum)."""
        key, start, stop = asked
        if ranged is None:
            raise CorruptBufferError(
                f"{self.io.url!r}: chunk {key!r} is missing, but the last commit says it holds rows")
        data, stored = ranged
        if stored not in (values + trailer, -1):
            raise CorruptBufferError(f"{self.io.url!r}: chunk {key!r} has {stored} bytes, expected {values + trailer}")
        if len(data) != stop - start:
            raise CorruptBufferError(f"{self.io.url!r}: chunk {key!r} ends at byte {start + len(data)}, "
                                     f"before the rows read from it (bytes {start} to {stop})")
        if trailer and stop == values + trailer and checksum(data[:values]) != data[values:]:
            raise CorruptBufferError(f"{self.io.url!r}: chunk {key!r} fails its checksum (the file is damaged)")
        return data


def _runs(lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray,
          row_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows sorted by (lane, chunk, offset) cut into runs, one byte range each: each row's run,
    each run's first row, and its bytes ``[start, stop)`` in its chunk object."""
    gap = (offset[1:] - offset[:-1] - 1) * row_bytes
    new = np.ones(len(offset), bool)
    new[1:] = (lane[1:] != lane[:-1]) | (chunk[1:] != chunk[:-1]) | (gap > GAP_BYTES)
    firsts = np.flatnonzero(new)
    lasts = np.append(firsts[1:], len(offset)) - 1
    return np.cumsum(new) - 1, firsts, offset[firsts] * row_bytes, (offset[lasts] + 1) * row_bytes
