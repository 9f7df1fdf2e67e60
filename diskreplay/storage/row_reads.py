"""`RowReads`: sharded fields (compressed images) read row by row, never whole chunks.

A compressed field whose rows take 1 KiB or more is stored as Zarr shards of small inner chunks
(`Codec.inner_rows`). A reader whose rows do not fit its cache reads such a field by decoding
only the inner chunks a batch needs (`InnerChunks`: from shard files mapped once each locally,
`ShardMaps`; from byte ranges of the shard objects on an object store, `PointReads`): an inner
chunk of one row (a frame) straight into the output row that asks for it, a larger one once.
The chunk cache then holds the other fields.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from ..format.schema import Schema
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .outputs import output_rows
from .stale import RetiredCheck


class InnerChunks(Protocol):
    """Where `RowReads` decodes inner chunks from: `ShardMaps` or `PointReads`."""

    def decode(self, name: str, lanes: np.ndarray, chunks: np.ndarray, inners: np.ndarray, out: np.ndarray,
               rows: np.ndarray) -> None:
        """Inner chunk ``inners[i]`` of chunk ``(lanes[i], chunks[i])`` decoded into ``out[rows[i]]``."""
        ...

    def ask(self, name: str, lanes: np.ndarray, chunks: np.ndarray, inners: np.ndarray) -> None:
        """Inner chunk ``inners[i]`` of chunk ``(lanes[i], chunks[i])`` is decoded next: start
        reading it, without waiting (or do nothing)."""
        ...

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten."""
        ...

    def close(self) -> None:
        ...


class Placed(NamedTuple):
    """Where rows lie: each one's chunk and offset in it, the cache slot holding that chunk (-1:
    none), and whether the slot holds it whole (with the row-by-row fields)."""

    chunk: np.ndarray
    offset: np.ndarray
    slots: np.ndarray
    whole: np.ndarray


class RowReads:
    """Row-by-row reads of the sharded fields ``names``."""

    def __init__(self, names: tuple[str, ...], schema: Schema, cache: ChunkCache, io: ChunkIO, maps: InnerChunks,
                 retired: RetiredCheck):
        self.names = names
        self.schema, self.cache, self.io, self.maps, self.retired = schema, cache, io, maps, retired
        self.chunk_rows = cache.chunk_rows

    def ask(self, names: tuple[str, ...], lane: np.ndarray, placed: Placed) -> None:
        """These fields' rows (at ``placed``) are read next: start reading the inner chunks of
        those the cache does not hold whole, all fields' at once (locally: their pages asked of
        the OS)."""
        read = ~placed.whole
        if not read.any():
            return
        for name in names:
            inner = placed.offset[read] // int(self.io.codecs[name].inner_rows or 1)
            self.maps.ask(name, lane[read], placed.chunk[read], inner)

    def placed(self, lane: np.ndarray, step: np.ndarray) -> Placed:
        """Where the rows at (lane, step) lie, in their chunks and in the cache, as of now."""
        chunk, offset = self.retired.layout.chunk_and_offset(step)
        width = self.cache.width
        slots = np.where(chunk < width, self.cache.slots_of(lane, np.minimum(chunk, width - 1)), -1)
        whole = slots >= 0
        whole[whole] = ~self.cache.is_partial(slots[whole])
        return Placed(chunk, offset, slots, whole)

    def read(self, name: str, lane: np.ndarray, step: np.ndarray, given: np.ndarray | None) -> np.ndarray:
        """One sharded field's rows: from chunks the cache holds whole (a writer's staged ones
        among them), else decoded from their inner chunks (`_decode_frames`, `_decode`), not cached."""
        rows = output_rows(self.schema[name], len(step), given)
        chunk, offset, slots, cached = self.placed(lane, step)  # anew: reading the other fields may have evicted
        if cached.any():
            self.cache.touch(slots[cached])  # an epoch's chunks read ahead stay while it reads them
            rows[cached] = self.cache.slabs[name].take(self.cache.rows_at(slots[cached], offset[cached]), axis=0)
        read = np.flatnonzero(~cached)
        if len(read):
            if self.io.codecs[name].inner_rows == 1:
                self._decode_frames(name, rows, lane, step, chunk, offset, read)
            else:
                self._decode(name, rows, lane, chunk, offset, read)
            self.retired.check(lane[read], step[read], lane[read], chunk[read])
        return rows

    def _decode_frames(self, name: str, rows: np.ndarray, lane: np.ndarray, step: np.ndarray, chunk: np.ndarray,
                       offset: np.ndarray, read: np.ndarray) -> None:
        """Decode rows ``read`` of a field whose inner chunks hold one row (frames) straight into
        ``rows``. A row that repeats the one read before it (a padded slice's end, a stack
        clamped to its episode's start) is copied from it; other repeats, the one or two a
        batch of a large ring draws, are decoded again: cheaper than finding them."""
        again = _repeats_previous(lane[read], step[read])
        first = read if not again.any() else read[~again]
        self.maps.decode(name, lane[first], chunk[first], offset[first], rows, first)
        if len(first) < len(read):
            rows[read[again]] = rows[first[np.cumsum(~again)[again] - 1]]

    def _decode(self, name: str, rows: np.ndarray, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray,
                read: np.ndarray) -> None:
        """Decode the inner chunks (of several rows each) holding rows ``read``, each once, into ``rows``."""
        inner_rows = self.io.codecs[name].inner_rows
        assert inner_rows is not None
        per_chunk = self.chunk_rows // inner_rows
        block = (lane[read] * (chunk.max() + 1) + chunk[read]) * per_chunk + offset[read] // inner_rows
        unique, where = np.unique(block, return_inverse=True)
        chosen = np.zeros(len(unique), dtype=np.int64)
        chosen[where] = read  # the row of ``read`` each inner chunk is decoded for
        source = chosen[where]
        first = np.sort(chosen)  # bodies in output order
        inner = offset[first] // inner_rows
        blocks = np.empty((len(first), inner_rows, *self.schema[name].shape), rows.dtype)
        self.maps.decode(name, lane[first], chunk[first], inner, blocks, np.arange(len(first)))
        rows[read] = blocks.reshape(len(first), inner_rows, *rows.shape[1:])[
            np.searchsorted(first, source), offset[read] % inner_rows]

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These shard files were rewritten: map them again when read."""
        self.maps.forget(lane, chunks)

    def close(self) -> None:
        self.maps.close()


def _repeats_previous(lane: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Whether each (lane, step) is the one before it."""
    again = np.zeros(len(step), bool)
    np.equal(step[1:], step[:-1], out=again[1:])
    again[1:] &= lane[1:] == lane[:-1]
    return again
