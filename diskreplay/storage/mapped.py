"""Raw chunk files of a local store, memory-mapped side by side: reads without a copy or a cache.

On a local store without compression a chunk file is exactly its rows' bytes. For each field one
range of virtual memory is reserved (no memory is committed) with room for every chunk of every
lane, and each chunk file is mapped at its place in that range (``MAP_FIXED``) the first time a
read needs it (or all at once: `MappedChunks.warm`). A field then looks like one big array: a
batch is one ``take`` per field, however many chunks it touches, and a cold read costs the pages
of the rows read, not whole chunks. For files much larger than the page cache, faults read their
page only and each batch asks for all its pages at once (`MappedChunks.read_randomly`).

The OS page cache is the cache. Resident pages of these read-only maps count towards the
process's RSS as file-backed pages (``RssFile``), not private memory: they are shared with every
other process reading the files and the kernel reclaims them under memory pressure. So they are
left alone: dropping them would only turn every later read into a page fault.

Each mapped file is one kernel memory map (and may split its reservation in two), and Linux
allows a process ``vm.max_map_count`` of them (65,530 by default). `map_budget` gives a buffer a
share of what is left; when a read would pass it (or the kernel refuses a map), every map is
dropped at once (one ``mmap`` per field) and chunks are mapped again as they are read; a batch
touching more chunks than the budget is read through the chunk cache instead. Buffers created
with the default ``chunk_rows`` stay inside the budget (see `diskreplay.storage.default_chunk_rows`).

A chunk file rewritten by the writer is a new file (atomic rename): the old mapping keeps the old
bytes, so rewritten chunks are *forgotten* and mapped again on their next read. Reading an
unmapped page of the reservation would crash the process, so `take` is only called for chunks
`ensure` has mapped.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np

from ..errors import CorruptBufferError
from ..format.lanes import LaneLayout
from ..format.schema import Schema
from ..io.local import open_for_reading
from ..io.mmap import Reservation, map_budget
from ..io.store import ChunkStore
from .outputs import output_rows, take_rows

_NONE = np.zeros(0, dtype=np.int64)

DATASET_CHUNKS = 1 << 12
"""Chunks per lane reserved at first in dataset mode (the reservation doubles as lanes grow)."""


class _ReadPlan(NamedTuple):
    """How `MappedChunks.gather` finds the rows of some fields, one row of positions per distinct
    chunk stride ``[k, 1]``."""

    rows: tuple[int, ...]
    """Per field, its row of the positions."""
    extra: np.ndarray
    """Per stride, the rows each chunk before a slot's adds to it: ``stride - chunk_rows`` (int64)."""
    chunked: bool
    """Whether any stride differs from ``chunk_rows`` (else a position is the slot)."""
    lane_rows: np.ndarray
    """Per stride, the rows of each lane before the next: ``chunks * stride`` (int64)."""


class MappedChunks:
    """Every field of a local raw store as one mapped array; see the module docstring."""

    def __init__(self, store: ChunkStore, chunk_key: Callable[[str, int, int], str], schema: Schema,
                 layout: LaneLayout, chunks_per_lane: int = 0, trailer: int = 0):
        """``chunk_key(field, lane, chunk)`` names a chunk's file in ``store``; ``trailer``: bytes
        after the values in each file (a checksum, not mapped)."""
        self.trailer = trailer
        self.store, self.chunk_key, self.schema, self.layout = store, chunk_key, schema, layout
        self.budget = map_budget(len(schema.fields))
        self.random_reads = False  # see `read_randomly`
        self.prefetch_pages = False
        """Whether `gather` asks for a batch's pages first (the files are being read in meanwhile)."""
        self.chunks = layout.chunks_per_lane() if layout.lane_capacity else max(DATASET_CHUNKS, chunks_per_lane)
        self.regions: dict[str, Reservation] = {}
        self._reserve()

    def _reserve(self) -> None:
        self.mapped = np.zeros((self.layout.num_envs, self.chunks), dtype=bool)  # maps the current file
        self.held = np.zeros((self.layout.num_envs, self.chunks), dtype=bool)  # maps some file
        self.maps = 0  # chunks held
        self.unmapped = self.mapped.size  # chunks not mapped to their current file
        self._read_plans: dict[tuple[str, ...], _ReadPlan] = {}
        self.regions = {name: Reservation(f.dtype, f.shape, self.layout.chunk_rows, self.layout.num_envs * self.chunks)
                        for name, f in self.schema.items()}

    def ensure(self, lane: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """Map the chunks of these (lane, slot)s not mapped yet; returns the (lanes, chunks) it
        had to map, or None when they are more than the map budget allows at once (nothing is
        mapped then).

        Raises CorruptBufferError if a chunk file is missing or has the wrong size.
        """
        ring = self.layout.lane_capacity is not None
        if ring and not self.unmapped:
            return _NONE, _NONE
        chunk = slot // self.layout.chunk_rows
        if not ring and len(chunk) and int(chunk.max()) >= self.chunks:
            self._grow(int(chunk.max()) + 1)
        here = self.mapped[0].take(chunk) if self.layout.num_envs == 1 else self.mapped[lane, chunk]
        if here.all():
            return _NONE, _NONE
        missing = ~here
        keys = np.unique(lane[missing] * self.chunks + chunk[missing])
        lanes, chunks = np.divmod(keys, self.chunks)
        if self.maps + int((~self.held[lanes, chunks]).sum()) <= self.budget and self._map_all(lanes, chunks):
            return lanes, chunks
        keys = np.unique(lane * self.chunks + chunk)  # start afresh with this batch's chunks
        self.unmap_all()
        lanes, chunks = np.divmod(keys, self.chunks)
        if len(keys) <= self.budget and self._map_all(lanes, chunks):
            return lanes, chunks
        self.unmap_all()
        return None

    def _map_all(self, lanes: np.ndarray, chunks: np.ndarray) -> bool:
        """Map these chunks; False if the process ran out of maps (``ENOMEM``) on the way."""
        try:
            for ln, ch in zip(lanes.tolist(), chunks.tolist()):
                self._map(ln, ch)
        except OSError as exc:
            if exc.errno != errno.ENOMEM:
                raise
            return False
        return True

    def _map(self, lane: int, chunk: int) -> None:
        for name, region in self.regions.items():
            key = self.chunk_key(name, lane, chunk)
            try:
                fd = open_for_reading(self.store.path(key))
            except FileNotFoundError:
                raise CorruptBufferError(
                    f"{self.store.url!r}: chunk {key!r} is missing, but the last commit says it holds rows"
                ) from None
            try:
                size = os.fstat(fd).st_size
                if size != region.file_bytes + self.trailer:
                    raise CorruptBufferError(f"{self.store.url!r}: chunk {key!r} has {size} bytes, "
                                             f"expected {region.file_bytes + self.trailer}")
                region.map_file(lane * self.chunks + chunk, fd, self.random_reads)
            finally:
                os.close(fd)
        self.maps += not self.held[lane, chunk]
        self.unmapped -= not self.mapped[lane, chunk]
        self.held[lane, chunk] = self.mapped[lane, chunk] = True

    def warm(self, lanes: np.ndarray, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map these chunks (as many as the budget allows) with every page of them read and
        in the page tables: the OS reads all files at once (``POSIX_FADV_WILLNEED``, in the
        background), then each map is populated (``MADV_POPULATE_READ``, Linux >= 5.14; on older
        kernels pages are faulted in as read). A damaged chunk is skipped (its read reports it).
        Returns the chunks it mapped."""
        if len(chunks) and int(chunks.max()) >= self.chunks:
            self._grow(int(chunks.max()) + 1)
        keep = ~self.mapped[lanes, chunks]
        room = max(self.budget - self.maps, 0)
        lanes, chunks = lanes[keep][:room], chunks[keep][:room]
        self.store.prefetch([self.chunk_key(name, ln, ch) for ln, ch in zip(lanes.tolist(), chunks.tolist())
                             for name in self.schema.fields])
        done = np.zeros(len(chunks), dtype=bool)
        for i, (ln, ch) in enumerate(zip(lanes.tolist(), chunks.tolist())):
            try:
                self._map(ln, ch)
            except CorruptBufferError:
                continue
            except OSError as exc:
                if exc.errno != errno.ENOMEM:
                    raise
                self.unmap_all()
                return _NONE, _NONE
            done[i] = True
            for region in self.regions.values():
                region.populate(ln * self.chunks + ch)
        return lanes[done], chunks[done]

    def read_randomly(self) -> None:
        """For files much larger than the page cache: from now on a page fault reads its page
        only, and `gather` asks for all the pages of a batch at once first."""
        if not self.random_reads:
            self.random_reads = True
            self.unmap_all()  # mapped again, with the advice, as they are read

    def gather(self, lane: np.ndarray, slot: np.ndarray, names: tuple[str, ...],
               out: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows at (lane, slot) of mapped chunks (`ensure` them first), copied out: into
        ``out[name]`` where given (C-contiguous, right shape and dtype)."""
        plan = self._read_plan(names)
        positions = self._positions(plan, lane, slot)
        if self.random_reads or self.prefetch_pages:
            for name, row in zip(names, plan.rows):
                self.regions[name].prefetch(positions[row])
        rows = {name: output_rows(self.schema[name], len(slot), out.get(name)) for name in names}
        take_rows([self.regions[name].rows for name in names], [positions[row] for row in plan.rows],
                  list(rows.values()))
        return rows

    def _read_plan(self, names: tuple[str, ...]) -> _ReadPlan:
        """The `_ReadPlan` of these fields (made once per reservation)."""
        names = names if isinstance(names, tuple) else tuple(names)
        plan = self._read_plans.get(names)
        if plan is None:
            strides = sorted({self.regions[name].stride for name in names})
            column = np.array(strides, dtype=np.int64)[:, None]
            plan = self._read_plans[names] = _ReadPlan(
                tuple(strides.index(self.regions[name].stride) for name in names),
                column - self.layout.chunk_rows, strides != [self.layout.chunk_rows], self.chunks * column)
        return plan

    def _positions(self, plan: _ReadPlan, lane: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Rows ``[strides, len(slot)]`` of the regions of each chunk stride of ``plan`` holding
        (lane, slot): ``(lane * chunks + chunk) * stride + offset`` with ``chunk, offset =
        divmod(slot, chunk_rows)``, i.e. ``slot + chunk * (stride - chunk_rows)`` plus the lane's
        start ``lane * chunks * stride``."""
        at: np.ndarray = slot + (slot // self.layout.chunk_rows) * plan.extra if plan.chunked else slot[None]
        return at if self.layout.num_envs == 1 else at + lane * plan.lane_rows

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten: map them again before the next read."""
        chunks = np.unique(chunks[chunks < self.chunks])
        self.unmapped += int(self.mapped[lane, chunks].sum())
        self.mapped[lane, chunks] = False

    def unmap_all(self) -> None:
        """Drop every map (the map budget is spent); chunks are mapped again as they are read."""
        for region in self.regions.values():
            region.unmap_files()
        self.mapped[...] = False
        self.held[...] = False
        self.maps = 0
        self.unmapped = self.mapped.size

    def _grow(self, chunks_needed: int) -> None:
        """Dataset mode: a wider reservation; chunks are mapped again as they are read."""
        self._unmap()
        self.chunks = max(2 * self.chunks, chunks_needed)
        self._reserve()

    def _unmap(self) -> None:
        for region in self.regions.values():
            region.close()
        self.regions = {}

    def close(self) -> None:
        self._unmap()

