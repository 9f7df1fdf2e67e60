"""Bodies at raw addresses, a batch at a time: CRC32C checks (`first_bad_checksum`) and blosc
frames of one LZ4 block decoded straight into their rows (`LZ4Frames`, `lz4_spans_into`), both by
the optional C extension `_batch` without the GIL where it was built, else one call per body.

The caller keeps the bodies' bytes alive and mapped while they are read, and vouches for their
spans (`diskreplay.format.codecs.Codec` checks a shard's index first).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import NamedTuple

import google_crc32c
import lz4.block
import numpy as np

from ..build import disable, load_extension

_batch = load_extension("diskreplay.format._batch")  # built from _batch.c where a C compiler was found

CHECKSUM_BYTES = 4
"""A CRC32C after each body, as zarr's ``crc32c`` codec stores it (little-endian)."""

BLOSC_HEADER_BYTES = 16
BLOSC_LZ4 = 1
"""The compressor code blosc writes in the top three bits of its flags byte for LZ4 and LZ4-HC alike."""
BLOSC_FILTERS = 0x0E
"""Blosc flags bits for memcpyed, bit-shuffled or reserved: a frame the LZ4 fast path leaves to blosc."""
LZ4_HEAD = BLOSC_HEADER_BYTES + 8
"""A one-block blosc frame's bytes before its LZ4 block: the header, the block's start, its size."""


def lz4_spans_into(blob: bytes | memoryview, data: np.ndarray, begin: np.ndarray, length: np.ndarray,
                   flat: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Decode the bodies ``blob[begin[i]:begin[i] + length[i]]`` (checksums cut off; ``data``:
    ``blob`` as uint8, int64 offsets and lengths) that are blosc frames of one LZ4 block
    (`_lz4_blocks`) straight into ``flat[rows[i]]`` (uint8 rows). Returns the indices of the
    other bodies, left to blosc. Raises ValueError."""
    blocks = _lz4_blocks(data, begin, length, flat.shape[1])
    fast = blocks >= 0
    if _LZ4_DECODE is not None and flat.flags.c_contiguous:
        decode_lz4_at(data.ctypes.data + blocks[fast], length[fast] - LZ4_HEAD, flat, rows[fast])
    else:
        _lz4_blocks_copied(blob, blocks[fast].tolist(), (length[fast] - LZ4_HEAD).tolist(), rows[fast].tolist(), flat)
    return np.flatnonzero(~fast)


def direct_blocks(data: np.ndarray, begin: np.ndarray, length: np.ndarray, size: int) -> np.ndarray:
    """For bodies ``data[begin[i]:begin[i] + length[i]]`` (uint8, checksums cut off) that decode to
    ``size`` bytes: where `decode_lz4_at` decodes one (a blosc frame of one LZ4 block), the
    block's start in ``data``, else -1 (all -1 where python-lz4 exports no decoder)."""
    if _LZ4_DECODE is None:
        return np.full(len(begin), -1, np.int64)
    return _lz4_blocks(data, begin, length, size)


def _lz4_blocks(data: np.ndarray, begin: np.ndarray, length: np.ndarray, size: int) -> np.ndarray:
    """Where the bodies ``data[begin[i]:begin[i] + length[i]]`` are blosc frames holding one LZ4
    block of ``size`` bytes (type size 1, not memcpyed, no bit shuffle: an image row), the
    block's start in ``data``, else -1; the headers checked together."""
    if not len(data):
        return np.full(len(begin), -1, np.int64)
    heads = data[np.minimum(begin[:, None] + np.arange(LZ4_HEAD), len(data) - 1)]
    version, flags, typesize = heads[:, 0], heads[:, 2], heads[:, 3]
    nbytes, block, cbytes, first = np.ascontiguousarray(heads[:, 4:20]).view("<u4").T
    stream = np.ascontiguousarray(heads[:, 20:24]).view("<i4")[:, 0]
    fast = ((length >= LZ4_HEAD) & (version == 2) & (flags & BLOSC_FILTERS == 0) & (flags >> 5 == BLOSC_LZ4)
            & (typesize == 1) & (nbytes == size) & (block == size) & (cbytes == length) & (first == 20)
            & (stream == length - LZ4_HEAD))
    return np.where(fast, begin + LZ4_HEAD, -1)


TAKE_BLOCKS = 8
"""Blocks a thread decoding `LZ4Frames` takes at a time: ~40 µs of decoding, so that the threads
sharing a batch end within about that of each other."""


class LZ4Failure(NamedTuple):
    """The LZ4 block that stopped an `LZ4Frames` decode: its index, and why (its checksum, or
    the decoder's result)."""

    block: int
    bad_checksum: bool
    why: str


class LZ4Frames:
    """LZ4 blocks of ``sizes[i]`` bytes at addresses ``sources[i]``, to decode straight into
    ``flat[rows[i]]`` (C-contiguous uint8 rows; a block as long as a row is the row's bytes) by
    `_LZ4_DECODE`, which never reads or writes past the spans it is given. Any number of threads
    may call `decode` at once: each takes the next few blocks until none is left (with the
    `_batch` extension, in one call without the GIL). Where ``check[i]``, the block's body is
    first checked against its CRC32C: a blosc frame of one LZ4 block (`Codec.direct_blocks`), the
    body is its `LZ4_HEAD` bytes of header and the block, the checksum the 4 bytes after it. The
    caller keeps the sources mapped and vouches for them.

    Raises:
        IndexError: rows outside ``flat``.
    """

    def __init__(self, sources: np.ndarray, sizes: np.ndarray, flat: np.ndarray, rows: np.ndarray,
                 check: np.ndarray | None = None):
        assert _LZ4_DECODE is not None and flat.flags.c_contiguous
        if len(rows) and not 0 <= rows.min() <= rows.max() < len(flat):  # raw addresses below: no index checks
            raise IndexError(f"rows {rows.min()}..{rows.max()} outside the {len(flat)} rows decoded into")
        self.width = flat.shape[1]
        self.sources, self.sizes = np.asarray(sources, np.int64), np.asarray(sizes, np.int64)
        self.targets = flat.ctypes.data + np.asarray(rows, np.int64) * self.width
        self.check = np.zeros(len(rows), np.uint8) if check is None else np.asarray(check, bool).view(np.uint8)
        self.failure: LZ4Failure | None = None
        """The first block found failing (its checksum, or not decoding to a row), once `decode` returned."""
        self._next = np.zeros(1, np.int64)  # the first block no thread took yet
        self._lock = threading.Lock()
        self._flat = flat  # the rows stay alive while threads decode into them

    def __len__(self) -> int:
        return len(self.sources)

    def decode(self) -> int:
        """Take and decode blocks until none is left or one fails (`failure`: every thread
        then stops at its next take). Returns how many blocks this call took."""
        if _batch is not None and (_CRC32C_ADDRESS is not None or not self.check.any()):
            taken, failed, bad_checksum, code = _batch.decode_lz4(
                _LZ4_ADDRESS, _CRC32C_ADDRESS or 0, self.sources, self.sizes, self.targets, self.width, self.check,
                LZ4_HEAD, self._next, TAKE_BLOCKS)
            if failed >= 0:
                self._fail(failed, bool(bad_checksum), code)
            return int(taken)
        count = 0
        while (part := self._take()) is not None:
            count += part.stop - part.start
            self._decode_one_by_one(part)
        return count

    def _take(self) -> slice | None:
        with self._lock:
            first = int(self._next[0])
            self._next[0] = first + TAKE_BLOCKS
        return slice(first, min(first + TAKE_BLOCKS, len(self))) if first < len(self) else None

    def _decode_one_by_one(self, part: slice) -> None:
        """The blocks of ``part`` in Python, one call of `_LZ4_DECODE` each."""
        assert _LZ4_DECODE is not None
        for i in range(part.start, part.stop):
            source, size, target = int(self.sources[i]), int(self.sizes[i]), int(self.targets[i])
            if self.check[i] and first_bad_checksum(np.array([source - LZ4_HEAD]), np.array([size + LZ4_HEAD])) == 0:
                return self._fail(i, True, 0)
            if size == self.width:
                ctypes.memmove(target, source, size)
            elif (decoded := _LZ4_DECODE(source, target, size, self.width) if size > 0 else -1) != self.width:
                return self._fail(i, False, decoded)
        return None

    def _fail(self, index: int, bad_checksum: bool, code: int) -> None:
        with self._lock:
            self._next[0] = len(self)
            if self.failure is None:
                why = ("checksum mismatch" if bad_checksum
                       else f"LZ4 block: malformed, or decodes to other than {self.width} bytes (code {code})")
                self.failure = LZ4Failure(index, bad_checksum, why)


def decode_lz4_at(sources: np.ndarray, sizes: np.ndarray, flat: np.ndarray, rows: np.ndarray) -> None:
    """The LZ4 blocks of ``sizes[i]`` bytes at addresses ``sources[i]`` decoded straight into
    ``flat[rows[i]]`` on this thread (see `LZ4Frames`). Raises ValueError for a block that does
    not decode to a row, IndexError for rows outside ``flat``."""
    frames = LZ4Frames(sources, sizes, flat, rows)
    frames.decode()
    if frames.failure is not None:
        raise ValueError(frames.failure.why)


def first_bad_checksum(sources: np.ndarray, sizes: np.ndarray) -> int:
    """The first of the bodies of ``sizes[i]`` bytes at addresses ``sources[i]`` whose CRC32C is
    not the 4 bytes that follow it (as zarr's ``crc32c`` codec stores it), or -1 when all match.
    In one call that releases the GIL where the `_batch` extension was built, else one call per
    body. The caller keeps the spans mapped and vouches for them."""
    if _batch is not None and _CRC32C_ADDRESS is not None:
        found: int = _batch.first_bad_checksum(_CRC32C_ADDRESS, sources.astype(np.int64), sizes.astype(np.int64))
        return found
    for i, (source, size) in enumerate(zip(sources.tolist(), sizes.tolist())):
        blob = ctypes.string_at(source, size + CHECKSUM_BYTES)
        if int(google_crc32c.value(blob[:size])).to_bytes(CHECKSUM_BYTES, "little") != blob[size:]:
            return i
    return -1


def _crc32c_address() -> int | None:
    """The address of google-crc32c's ``crc32c_value(data, count)`` (for `_batch`), or None
    where its C extension is not there."""
    try:
        from google_crc32c import _crc32c
        address: int | None = ctypes.cast(ctypes.CDLL(_crc32c.__file__).crc32c_value, ctypes.c_void_p).value
    except (ImportError, AttributeError, OSError):
        return None
    return address


_CRC32C_ADDRESS = _crc32c_address()
if _batch is not None and _CRC32C_ADDRESS is None:
    disable("diskreplay.format._batch", "google-crc32c has no C library here (crc32c_value)", "first_bad_checksum")


def _lz4_blocks_copied(blob: bytes | memoryview, begins: list[int], sizes: list[int], rows: list[int],
                       flat: np.ndarray) -> None:
    """As `decode_lz4_at` for the blocks ``blob[begins[i]:begins[i] + sizes[i]]``, through
    python-lz4's own decompress (a bytes object per block, then copied into its row). Raises ValueError."""
    view, width = memoryview(blob), flat.shape[1]
    for begin, size, row in zip(begins, sizes, rows):
        block = view[begin:begin + size]
        try:
            data = block if size == width else lz4.block.decompress(block, uncompressed_size=width)
        except lz4.block.LZ4BlockError as exc:
            raise ValueError(f"LZ4 block: {exc}") from None
        if len(data) != width:
            raise ValueError(f"LZ4 block decodes to {len(data)} bytes, expected {width}")
        flat[row] = np.frombuffer(data, dtype=np.uint8)


def _lz4_decoder() -> tuple[Callable[[int, int, int, int], int] | None, int | None]:
    """``LZ4_decompress_safe(source, target, source_size, target_capacity)`` from python-lz4's own
    extension, through ctypes (it decodes into the batch: no bytes object, no copy), and its
    address (for `_batch`); or Nones where the extension does not export it."""
    try:
        function = ctypes.CDLL(lz4.block._block.__file__).LZ4_decompress_safe
    except (AttributeError, OSError):
        return None, None
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    function.restype = ctypes.c_int
    decode: Callable[[int, int, int, int], int] = function
    return decode, ctypes.cast(function, ctypes.c_void_p).value


_LZ4_DECODE, _LZ4_ADDRESS = _lz4_decoder()
if _batch is not None and _LZ4_ADDRESS is None:
    disable("diskreplay.format._batch", "python-lz4's extension does not export LZ4_decompress_safe", "decode_lz4")

