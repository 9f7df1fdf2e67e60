"""Memory maps of local files, through libc: reserved address ranges, files mapped into them,
and the kernel's paging advice. Linux and other POSIX systems (`supported`).

Each mapped file is one kernel memory map (and may split its reservation in two), and Linux
allows a process ``vm.max_map_count`` of them (65,530 by default): `map_budget` gives a caller a
share of what is left.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os

import numpy as np

from .local import open_for_reading

_PROT_NONE, _PROT_READ = 0, 1
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MADV_RANDOM, _MADV_WILLNEED, _MADV_POPULATE_READ = 1, 3, 22
_RESIDENT_BIT = bytes(value & 1 for value in range(256))
"""``mincore``'s byte per page, its other bits cleared (only the lowest says the page is resident)."""

DEFAULT_MAX_MAP_COUNT = 65530
"""Linux's default ``vm.max_map_count``: memory maps one process may hold."""



def supported() -> bool:
    return os.name == "posix" and hasattr(os, "O_RDONLY") and mmap.PAGESIZE > 0


def map_budget(fields: int) -> int:
    """Chunks one buffer may keep mapped: half the maps this process has left, a mapped chunk
    costing one per field (two while its neighbours are not mapped: it splits the reservation)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            in_use = sum(1 for _ in f)
    except (OSError, ValueError):
        limit, in_use = DEFAULT_MAX_MAP_COUNT, 0
    return max((limit - in_use) // 2 // fields, 1)


def cached(path: str) -> bool:
    """Whether every page of the file at ``path`` is in the page cache (``mincore`` of a map of
    it; False where there is no such file or it cannot be mapped)."""
    try:
        fd = open_for_reading(path)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return True
        address = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    if address is None or address == _MAP_FAILED:
        return False
    try:
        return resident(address, size)
    finally:
        _libc.munmap(address, size)


def resident(address: int, size: int) -> bool:
    """Whether every page of the ``size`` mapped bytes at ``address`` (page-aligned) is in the
    page cache (``mincore``; False where it cannot tell)."""
    pages = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
    return size == 0 or (_libc.mincore(address, size, pages) == 0 and 0 not in pages.raw.translate(_RESIDENT_BIT))


def will_need(addresses: np.ndarray, sizes: np.ndarray) -> None:
    """Ask the OS to read the mapped pages of ``sizes[i]`` bytes at ``addresses[i]``, all at once
    (``MADV_WILLNEED`` returns at once: the reads are in flight together, where page faults
    would wait for one at a time)."""
    start = addresses - addresses % mmap.PAGESIZE
    for address, size in zip(start.tolist(), (addresses + sizes - start).tolist()):
        _libc.madvise(address, size, _MADV_WILLNEED)


def _check(result: int | None, what: str) -> int:
    if result is None or result == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class Reservation:
    """Virtual memory reserved for ``slots`` files of ``chunk_rows`` rows each (no memory is
    committed), seen as one array of rows: slot ``s`` starts at row ``s * stride``. Files are
    mapped read-only at their slot (``MAP_FIXED``); reading a slot no file is mapped at crashes
    the process, so callers read only slots they mapped."""

    def __init__(self, dtype: np.dtype, shape: tuple[int, ...], chunk_rows: int, slots: int):
        page = mmap.PAGESIZE
        self.row_bytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        unit = page // math.gcd(self.row_bytes, page)  # rows whose bytes fill whole pages
        self.stride = -(-chunk_rows // unit) * unit
        self.file_bytes = chunk_rows * self.row_bytes
        self.size = slots * self.stride * self.row_bytes
        self.base = self._reserve(None)
        raw = (ctypes.c_char * self.size).from_address(self.base)
        self.rows = np.frombuffer(memoryview(raw), dtype=dtype).reshape(slots * self.stride, *shape)

    def _reserve(self, address: int | None) -> int:
        fixed = _MAP_FIXED if address is not None else 0
        return _check(_libc.mmap(address, self.size, _PROT_NONE,
                                 _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | fixed, -1, 0), "reserve")

    def map_file(self, slot: int, fd: int, random: bool) -> None:
        """Map a chunk file at its slot; ``random``: a page fault reads that page only (no
        read-ahead around it: `prefetch` asks for the pages a read needs)."""
        address = self.base + slot * self.stride * self.row_bytes
        _check(_libc.mmap(address, self.file_bytes, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0), "map a chunk file")
        if random:
            _libc.madvise(address, self.file_bytes, _MADV_RANDOM)

    def prefetch(self, rows: np.ndarray) -> None:
        """Ask the OS to read the pages of these rows, all at once (``MADV_WILLNEED`` returns at
        once: the reads are in flight together, where page faults would wait for one at a time)."""
        first = rows * self.row_bytes
        pages = np.unique(np.concatenate([first, first + self.row_bytes - 1]) // mmap.PAGESIZE)
        breaks = np.flatnonzero(np.diff(pages) > 1)  # one call per run of consecutive pages
        starts, ends = pages[np.r_[0, breaks + 1]], pages[np.r_[breaks, len(pages) - 1]] + 1
        addresses, sizes = self.base + starts * mmap.PAGESIZE, (ends - starts) * mmap.PAGESIZE
        for address, size in zip(addresses.tolist(), sizes.tolist()):
            _libc.madvise(address, size, _MADV_WILLNEED)

    def populate(self, slot: int) -> None:
        """Read a mapped slot's pages into the page tables now (errors ignored: it only saves faults)."""
        _libc.madvise(self.base + slot * self.stride * self.row_bytes, self.file_bytes, _MADV_POPULATE_READ)

    def unmap_files(self) -> None:
        """Every file map replaced by the bare reservation again (one map)."""
        self._reserve(self.base)

    def close(self) -> None:
        """Unmap everything (the rows must not be read after)."""
        del self.rows
        _libc.munmap(self.base, self.size)
