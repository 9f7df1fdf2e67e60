"""Raw chunk files of a local store, memory-mapped side by side: reads without a copy or a cache.

On a local store without compression a chunk file is exactly its rows' bytes. For each field one
range of virtual memory is reserved (no memory is committed) with room for every chunk of every
lane, and each chunk file is mapped at its place in that range (``MAP_FIXED``) the first time a
read needs it. A field then looks like one big array: a batch is one ``take`` per field, however
many chunks it touches, and a cold read costs the pages of the rows read, not whole chunks. The
OS page cache is the cache.

Resident pages of mapped files count towards a process's RSS. While the mapped files fit in
``cache_bytes`` nothing is done; beyond that, once the process's resident file pages have grown by
``cache_bytes`` since the last trim, the page-table entries are dropped (``MADV_DONTNEED``: the data
stays in the OS page cache and the next access is a minor fault). The growth is read from
``/proc/self/statm`` (about 1.5 µs): one read fault may map far more than the page it needs (16
neighbouring pages, or a whole large folio of the page cache on recent kernels), so counting rows
read is no bound. Without ``/proc``, it is estimated from the rows read.

A chunk file rewritten by the writer is a new file (atomic rename): the old mapping keeps the old
bytes, so rewritten chunks are *forgotten* and mapped again on their next read. Reading an
unmapped page of the reservation would crash the process, so `take` is only called for chunks
`ensure` has mapped.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from typing import Callable

import numpy as np

from .chunkstore import LocalChunkStore
from .errors import CorruptBufferError
from .lanes import LaneLayout
from .schema import Field, Schema

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MADV_DONTNEED = 4
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

FAULT_AROUND = 16
"""Pages a read fault on a mapped file makes resident at least (Linux's default fault-around: 64 KiB);
for the estimate where ``/proc/self/statm`` is missing."""

DATASET_CHUNKS = 1 << 12
"""Chunks per lane reserved at first in dataset mode (the reservation doubles as lanes grow)."""


def supported() -> bool:
    return os.name == "posix" and hasattr(os, "O_RDONLY") and mmap.PAGESIZE > 0


def _check(result: int | None, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _open_statm() -> int | None:
    try:
        return os.open("/proc/self/statm", os.O_RDONLY)
    except OSError:
        return None


class _Region:
    """One field's reservation: slot ``s`` (a lane's chunk) starts at row ``s * stride``."""

    def __init__(self, field: Field, chunk_rows: int, slots: int, trailer: int):
        page = mmap.PAGESIZE
        self.field = field
        self.row_bytes = field.row_bytes
        unit = page // math.gcd(self.row_bytes, page)  # rows whose bytes fill whole pages
        self.stride = -(-chunk_rows // unit) * unit
        self.file_bytes = chunk_rows * self.row_bytes
        self.trailer = trailer
        self.size = slots * self.stride * self.row_bytes
        self.base = _check(_libc.mmap(None, self.size, _PROT_NONE,
                                      _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0), "reserve")
        raw = (ctypes.c_char * self.size).from_address(self.base)
        self.rows = np.frombuffer(raw, dtype=field.dtype).reshape(slots * self.stride, *field.shape)

    def map_file(self, slot: int, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.file_bytes + self.trailer:
                raise CorruptBufferError(f"chunk file {path!r} has {size} bytes, expected "
                                         f"{self.file_bytes + self.trailer}")
            address = self.base + slot * self.stride * self.row_bytes
            _check(_libc.mmap(address, self.file_bytes, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0), path)
        finally:
            os.close(fd)

    def trim(self) -> None:
        _libc.madvise(self.base, self.size, _MADV_DONTNEED)

    def close(self) -> None:
        self.rows = None
        _libc.munmap(self.base, self.size)


class MappedChunks:
    """Every field of a local raw store as one mapped array; see the module docstring."""

    def __init__(self, store: LocalChunkStore, chunk_key: Callable[[str, int, int], str], schema: Schema,
                 layout: LaneLayout, cache_bytes: int, chunks_per_lane: int = 0, trailer: int = 0):
        """``chunk_key(field, lane, chunk)`` names a chunk's file in ``store``; ``trailer``: bytes
        after the values in each file (a checksum, not mapped)."""
        self.trailer = trailer
        self.store, self.chunk_key, self.schema, self.layout = store, chunk_key, schema, layout
        self.page_budget = max(cache_bytes // mmap.PAGESIZE, 1)
        self.pages_touched = 0
        self.pages_mapped = 0
        self.statm = _open_statm()
        self.resident_after_trim = self._resident()
        self.pages_per_chunk = sum(-(-f.row_bytes * layout.chunk_rows // mmap.PAGESIZE) for f in schema.fields.values())
        self.chunks = layout.chunks_per_lane() if layout.lane_capacity else max(DATASET_CHUNKS, chunks_per_lane)
        self.mapped = np.zeros((layout.num_envs, self.chunks), dtype=bool)
        self.regions = {name: _Region(f, layout.chunk_rows, layout.num_envs * self.chunks, trailer)
                        for name, f in schema.items()}
        self.pages_per_row = {name: -(-f.row_bytes // mmap.PAGESIZE) + FAULT_AROUND for name, f in schema.items()}

    def ensure(self, lane: np.ndarray, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map every chunk not mapped yet; returns the (lanes, chunks) it had to map.

        Raises CorruptBufferError if a chunk file is missing or has the wrong size.
        """
        if len(chunk) and int(chunk.max()) >= self.chunks:
            self._grow(int(chunk.max()) + 1)
        missing = ~self.mapped[lane, chunk]
        if not missing.any():
            return lane[:0], chunk[:0]
        keys = np.unique(lane[missing] * self.chunks + chunk[missing])
        lanes, chunks = np.divmod(keys, self.chunks)
        for ln, ch in zip(lanes.tolist(), chunks.tolist()):
            for name, region in self.regions.items():
                key = self.chunk_key(name, ln, ch)
                try:
                    region.map_file(ln * self.chunks + ch, self.store.path(key))
                except FileNotFoundError:
                    raise CorruptBufferError(
                        f"{self.store.root!r}: chunk {key!r} is missing, but the last commit says it holds rows"
                    ) from None
            self.mapped[ln, ch] = True
        self.pages_mapped += len(keys) * self.pages_per_chunk
        return lanes, chunks

    def take(self, name: str, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray,
             out: np.ndarray | None = None) -> np.ndarray:
        """Rows of mapped chunks (`ensure` them first), copied out (into ``out`` if given)."""
        region = self.regions[name]
        self._count(name, len(offset))
        index = (lane * self.chunks + chunk) * region.stride + offset
        if out is None:
            return region.rows.take(index, axis=0)
        return np.take(region.rows, index, axis=0, out=out, mode="clip")  # "raise" would buffer

    def _count(self, name: str, rows: int) -> None:
        self.pages_touched += rows * self.pages_per_row[name]

    def bound_resident(self) -> None:
        """After a read: drop the maps' page-table entries if resident file pages grew by more
        than the budget since the last trim (see the module docstring)."""
        if self.pages_mapped <= self.page_budget or self._resident() - self.resident_after_trim <= self.page_budget:
            return
        for region in self.regions.values():
            region.trim()
        self.pages_touched = 0
        self.resident_after_trim = self._resident()

    def _resident(self) -> int:
        """Resident file-backed pages of this process (``statm``'s shared), else the estimate."""
        if self.statm is None:
            return self.pages_touched
        return int(os.pread(self.statm, 128, 0).split()[2])

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten: map them again before the next read."""
        chunks = chunks[chunks < self.chunks]
        self.mapped[lane, chunks] = False

    def _grow(self, chunks_needed: int) -> None:
        """Dataset mode: a wider reservation; chunks are mapped again as they are read."""
        self._unmap()
        self.chunks = max(2 * self.chunks, chunks_needed)
        self.mapped = np.zeros((self.layout.num_envs, self.chunks), dtype=bool)
        self.pages_mapped = 0
        self.regions = {name: _Region(f, self.layout.chunk_rows, self.layout.num_envs * self.chunks, self.trailer)
                        for name, f in self.schema.items()}

    def _unmap(self) -> None:
        for region in self.regions.values():
            region.close()
        self.regions = {}

    def close(self) -> None:
        self._unmap()
        if self.statm is not None:
            os.close(self.statm)
            self.statm = None
