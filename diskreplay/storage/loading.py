"""`ChunkLoader`: stored chunks read into cache slots, pinned while they are filled."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .cache import ChunkCache
from .chunk_io import ChunkIO


class ChunkLoader:
    """Loads chunks into the cache: every field (``whole``), or only ``cached_fields`` (the
    fields not read row by row). Counts the chunks it loaded."""

    def __init__(self, cache: ChunkCache, io: ChunkIO, cached_fields: tuple[str, ...]):
        self.cache = cache
        self.io = io
        self.all_fields = tuple(io.schema.fields)
        self.cached_fields = cached_fields
        self.chunks_loaded = 0
        """Chunks read from the store into the cache so far: what reads cost."""

    def load(self, lanes: np.ndarray, chunks: np.ndarray, slots: np.ndarray | None = None,
             whole: bool = True) -> None:
        """Load these stored chunks (into ``slots``, free ones, if given; else the least
        recently used). Raises CorruptBufferError for a missing or damaged chunk."""
        self.cache.unpin(self.load_pinned(lanes, chunks, must_exist=True, slots=slots, whole=whole))

    def load_one(self, lane: int, chunk: int, must_exist: bool) -> int:
        """A slot holding one stored chunk, pinned (see `load_pinned`)."""
        return int(self.load_pinned(np.array([lane]), np.array([chunk]), must_exist)[0])

    def place_read(self, lane: int, chunk: int, rows: Mapping[str, np.ndarray]) -> int:
        """A pinned slot holding one chunk's ``rows`` of every field, read elsewhere."""
        slot = int(self.cache.assign(np.array([lane]), np.array([chunk]))[0])
        for name, values in rows.items():
            self.cache.chunk_rows_of(name, slot)[...] = values
        self.chunks_loaded += 1
        return slot

    def load_pinned(self, lanes: np.ndarray, chunks: np.ndarray, must_exist: bool,
                    slots: np.ndarray | None = None, whole: bool = True) -> np.ndarray:
        """Slots holding these stored chunks, pinned; a missing chunk is zeros unless
        ``must_exist``. On a failed read the slots are freed again."""
        cache = self.cache
        slots = cache.assign(lanes, chunks, whole) if slots is None else cache.place(lanes, chunks, slots)
        names = self.all_fields if whole else self.cached_fields
        work = [(self.io.key(name, lane, chunk), self.io.codecs[name], cache.chunk_rows_of(name, slot))
                for lane, chunk, slot in zip(lanes.tolist(), chunks.tolist(), slots.tolist()) for name in names]
        self.chunks_loaded += len(slots)
        try:
            self.io.read(work, must_exist)
        except BaseException:
            cache.release(slots)
            raise
        if len(names) < len(self.all_fields):
            cache.mark_partial(slots)
        return slots
