"""`Warmer`: the first read from local disk brings the whole window close.

Afterwards reads never wait for the disk (remote stores fetch what reads need). Rows that fit the
cache are loaded into it, every file asked of the OS at once (`fill_cache`); a reader places chunk
``(lane, c)`` in slot ``lane * width + c``, so that later reads find rows from their steps alone
(``resident_span``). Rows that do not fit, but fit in half this machine's RAM, are mapped with
their pages read (`MappedChunks.warm`); bigger ones are read page by page as sampled, each batch's
pages asked for at once (`MappedChunks.read_randomly`). Best effort: a damaged chunk is reported by
the read that needs it. A ring reader whose writer retired rows meanwhile forgets what it filled.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import numpy as np

from ..errors import CorruptBufferError
from .loading import ChunkLoader
from .mapped import MappedChunks
from .stale import RetiredCheck, Window


@functools.cache
def physical_memory() -> int:
    """Bytes of RAM of this machine (2**40 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


class Warmer:
    """The first-read fill of a local reader or writer, and the lane-major layout it leaves."""

    def __init__(self, loader: ChunkLoader, mapped: MappedChunks | None, retired: RetiredCheck, window: Window,
                 forget_files: Callable[[int, np.ndarray], None], stored_bytes: int, reader: bool, local: bool):
        self.loader, self.cache, self.mapped, self.retired = loader, loader.cache, mapped, retired
        self.forget_files = forget_files
        self.window = window
        self.layout = retired.layout
        self.stored_bytes = stored_bytes
        self.reader = reader
        self.local = local
        self.pending = local
        """Whether the next read fills first."""
        self.resident_span: int | None = None
        """Set while a reader's cache holds its window in lane-major order: slab rows per lane."""
        self.home_width: int | None = None

    def reset(self) -> None:
        """The window moved: fill again at the next read (readers), forget the resident layout."""
        self.resident_span = None
        self.pending = self.reader and self.local

    def warm(self) -> None:
        self.pending = False
        lo, hi = self.window()
        spans = [self.layout.chunks_between(int(lo[ln]), int(hi[ln])) for ln in range(self.layout.num_envs)]
        lanes = np.concatenate([np.full(len(c), ln, dtype=np.int64) for ln, c in enumerate(spans)])
        chunks = np.concatenate(spans)
        if self.mapped is None:
            self.fill_cache(lanes, chunks, self.layout.chunks_per_lane(int(hi.max(initial=0))))
        elif self.stored_bytes <= physical_memory() // 2:
            self.drop_if_moved(*self.mapped.warm(lanes, chunks))
        else:
            self.mapped.read_randomly()

    def fill_cache(self, lanes: np.ndarray, chunks: np.ndarray, chunks_per_lane: int) -> None:
        """Load every chunk not cached, all files asked of the OS at once (many requests in
        flight), if they fit; a reader's in lane-major slots."""
        cache = self.cache
        width = self._home_width(chunks_per_lane)
        home = lanes * width + chunks
        at = cache.slots_of(lanes, chunks)
        missing = at < 0
        in_place = (self.reader and len(home) > 0 and home.max() < cache.full_slots
                    and (at[~missing] == home[~missing]).all() and cache.free(home[missing]))
        staging = 0 if self.reader else 2 * self.layout.num_envs + 2
        if not in_place and missing.sum() > cache.evictable() - staging:
            return
        lanes, chunks, home = lanes[missing], chunks[missing], home[missing]
        io = self.loader.io
        io.store.prefetch([io.key(name, ln, ch) for ln, ch in zip(lanes.tolist(), chunks.tolist())
                           for name in io.schema.fields])
        try:
            self.loader.load(lanes, chunks, home if in_place else None)
        except CorruptBufferError:
            return
        if not self.drop_if_moved(lanes, chunks) and in_place:
            self.resident_span = width * self.layout.chunk_rows

    def _home_width(self, needed: int) -> int:
        """Slots per lane of a reader's lane-major cache: the ring's chunks; in dataset mode
        room to grow (a power of two, while the cache has the slots), kept while it suffices."""
        if self.layout.lane_capacity is None and (self.home_width or 0) < needed:
            roomy = 1 << (needed - 1).bit_length()
            self.home_width = roomy if self.layout.num_envs * roomy <= self.cache.full_slots else needed
        return self.home_width or needed

    def drop_if_moved(self, lanes: np.ndarray, chunks: np.ndarray) -> bool:
        """A ring reader that loaded or mapped chunks ahead of any read: forget those holding
        steps of its window the writer retired meanwhile. Returns whether it forgot any."""
        tainted = self.retired.check(lanes[:0], lanes[:0], lanes, chunks)
        for ln, stale in tainted:
            self.cache.invalidate(ln, stale)
            self.forget_files(ln, stale)
        return bool(tainted)
