"""Chunk bytes: `Codec` turns one chunk's rows into exactly the bytes zarr stores, and back.

Codecs are ``bytes`` (little-endian), then ``zstd`` or blosc ``lz4`` / ``lz4hc`` or nothing, then
``crc32c``.
Compressed fields with big rows (images) are Zarr shards (``sharding_indexed``, index first) of
small inner chunks, each compressed and checksummed alone (`Codec.inner_rows`). Nothing read from
a chunk sizes an allocation: decoded sizes are checked against the expected ones first.
"""

from __future__ import annotations

import ctypes
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import google_crc32c
import lz4.block
import numcodecs
import numpy as np
import zarr
import zarr.codecs
import zstandard
from numcodecs import blosc

from ..build import disable, load_extension
from ..checks import check_int
from .schema import Field

_batch = load_extension("diskreplay.format._batch")  # built from _batch.c where a C compiler was found

COMPRESSIONS = (None, "zstd", "lz4", "lz4hc")
"""Chunk codecs: raw, zstd, blosc LZ4 (fast to write), blosc LZ4-HC (slower to write; smaller, and
the same LZ4 blocks decode faster: fewer, longer matches)."""
LEVELS = {None: (0, 22), "zstd": (0, 22), "lz4": (0, 9), "lz4hc": (0, 9)}
"""Each codec's ``compression_level`` range (blosc's clevel is 0-9; 0 stores the bytes as they are)."""
LZ4_BLOCKS = ("lz4", "lz4hc")
"""Codecs whose compressed bodies are blosc frames of LZ4 blocks (the decode fast path's)."""
CHECKSUM_BYTES = 4
ROW_ACCESS_BYTES = 1 << 10
INNER_CHUNK_BYTES = 1 << 13
"""Compressed fields whose rows take at least `ROW_ACCESS_BYTES` (images) are stored as Zarr
shards: each chunk file holds inner chunks of about `INNER_CHUNK_BYTES` (one 84x84 frame),
compressed one by one behind an index, so a sampled row costs one small read and decode, not
the decode of its whole chunk (`Codec.inner_rows`)."""
SMALL_ROWS_INNER = 4
"""Inner chunks a chunk of small rows must hold at least to be sharded (`inner_rows_for`)."""
EMPTY_INNER = (1 << 64) - 1
BLOSC_HEADER_BYTES = 16
BLOSC_LZ4 = 1
"""The compressor code blosc writes in the top three bits of its flags byte for LZ4 and LZ4-HC alike."""
BLOSC_FILTERS = 0x0E
"""Blosc flags bits for memcpyed, bit-shuffled or reserved: a frame the LZ4 fast path leaves to blosc."""
LZ4_HEAD = BLOSC_HEADER_BYTES + 8
"""A one-block blosc frame's bytes before its LZ4 block: the header, the block's start, its size."""


def default_level(compression: str | None) -> int:
    """The ``compression_level`` a codec gets when none is given: 6 for ``lz4hc`` (most of its
    decode speed-up, a sixth of level 9's encode time), else 3."""
    return 6 if compression == "lz4hc" else 3


def inner_rows_for(compression: str | None, row_access: bool, row_bytes: int, chunk_rows: int,
                   row_shards: bool = False) -> int | None:
    """Rows per inner chunk of a field with rows of ``row_bytes`` (None: chunks are not sharded):
    a power of two near `INNER_CHUNK_BYTES` dividing ``chunk_rows``, for compressed fields of a
    ``row_access`` buffer whose rows take at least `ROW_ACCESS_BYTES`; with ``row_shards``, also
    for smaller rows whose chunk holds `SMALL_ROWS_INNER` inner chunks or more (a smaller chunk is
    read whole as cheaply as its index)."""
    if compression is None or not row_access:
        return None
    inner = math.gcd(1 << (max(INNER_CHUNK_BYTES // row_bytes, 1).bit_length() - 1), chunk_rows)
    if row_bytes >= ROW_ACCESS_BYTES or (row_shards and SMALL_ROWS_INNER * inner <= chunk_rows):
        return inner
    return None


@dataclass(frozen=True)
class Codec:
    """Turns one chunk's ndarray into the exact bytes zarr would store, and back.

    ``checksum``: a CRC32C of the encoded bytes follows them (zarr's ``crc32c`` codec), so torn,
    zeroed or garbage chunks are found on every whole-chunk read and by `verify`. Raw chunks
    with a checksum are still memory-mappable: the values come first.

    ``inner_rows``: the chunk is a Zarr shard (``sharding_indexed``, index first) of inner
    chunks of that many rows, each compressed and checksummed on its own; the index holds one
    little-endian ``(offset, nbytes)`` uint64 pair per inner chunk, then its CRC32C. One inner
    chunk is read with `index_bytes` and `decode_bodies` (see `diskreplay.shard_maps`).
    """

    compression: str | None
    level: int = 3
    checksum: bool = True
    inner_rows: int | None = None

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        least, most = LEVELS[self.compression]
        check_int(self.level, "compression_level" + (f" for {self.compression}" if self.compression else ""), least,
                  most)
        if self.inner_rows is not None and (self.compression is None or not self.checksum):
            raise ValueError("sharded chunks are written compressed and checksummed")

    @property
    def raw(self) -> bool:
        """True when a chunk's bytes start with its raw little-endian C-order values (memory-mappable)."""
        return self.compression is None

    @property
    def trailer(self) -> int:
        """Bytes after the values in a raw chunk (its checksum)."""
        return CHECKSUM_BYTES if self.checksum else 0

    def _compress(self, data: np.ndarray) -> bytes:
        if self.compression == "zstd":
            return _ZSTD.compressor(self.level).compress(data.reshape(-1).view(np.uint8).data)
        blosc_ = numcodecs.Blosc(cname=self.compression, clevel=self.level, shuffle=numcodecs.Blosc.SHUFFLE)
        return bytes(blosc_.encode(data))

    def _decompress(self, body: bytes | bytearray | memoryview, nbytes: int) -> bytes | memoryview | np.ndarray:
        """``body`` decompressed, which must give ``nbytes`` bytes: checked before a zstd frame's
        header can size an allocation. Raises ValueError, also for bytes the codec rejects."""
        try:
            return self._decompress_checked(body, nbytes)
        except (zstandard.ZstdError, RuntimeError) as exc:  # blosc raises RuntimeError
            raise ValueError(f"{self.compression} frame does not decode: {exc}") from None

    def _decompress_checked(self, body: bytes | bytearray | memoryview, nbytes: int) -> bytes | memoryview | np.ndarray:
        if self.compression == "zstd":
            size = zstandard.frame_content_size(body)
            if size not in (nbytes, zstandard.CONTENTSIZE_UNKNOWN):
                raise ValueError(f"zstd frame of {size} bytes, expected {nbytes}")
            return _ZSTD.decompressor.decompress(body, max_output_size=nbytes)
        claimed = int.from_bytes(body[4:8], "little") if len(body) >= BLOSC_HEADER_BYTES else None
        if claimed != nbytes:  # blosc would fill less than all of ``out`` without a word
            raise ValueError(f"blosc frame of {claimed} bytes, expected {nbytes}")
        out = np.empty(nbytes, np.uint8)
        blosc.decompress(body, out)
        return out

    def encode(self, chunk: np.ndarray) -> tuple[bytes | memoryview, ...]:
        """The chunk's stored bytes, in parts to be written one after the other. Raw values are a
        view of ``chunk`` itself (no copy): write them out before ``chunk`` changes."""
        data = np.ascontiguousarray(chunk)
        if self.inner_rows is not None:
            return self._encode_shard(data)
        body: bytes | memoryview = data.reshape(-1).view(np.uint8).data if self.raw else self._compress(data)
        return (body, checksum(body)) if self.checksum else (body,)

    def _encode_shard(self, data: np.ndarray) -> tuple[bytes, ...]:
        rows = self._inner_rows
        bodies = [self._compress(data[i:i + rows]) for i in range(0, len(data), rows)]
        sizes = np.array([len(b) + CHECKSUM_BYTES for b in bodies], dtype="<u8")
        index = np.empty((len(bodies), 2), dtype="<u8")
        index[:, 1] = sizes
        index[:, 0] = self.index_bytes(len(data)) + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        head = index.tobytes()
        return (head, checksum(head), *(part for b in bodies for part in (b, checksum(b))))

    def index_bytes(self, chunk_rows: int) -> int:
        """Bytes of a shard's index (with its checksum) for a chunk of ``chunk_rows`` rows."""
        return 16 * (chunk_rows // self._inner_rows) + CHECKSUM_BYTES

    @property
    def _inner_rows(self) -> int:
        """Rows per inner chunk of a sharded codec."""
        assert self.inner_rows is not None, "not a sharded codec"
        return self.inner_rows

    @staticmethod
    def _span(entries: bytes | memoryview, inner: int, index_bytes: int, limit: int) -> tuple[int, int] | None:
        entry = entries[16 * inner:16 * inner + 16]
        offset, nbytes = int.from_bytes(entry[:8], "little"), int.from_bytes(entry[8:], "little")
        if offset == nbytes == EMPTY_INNER:
            return None
        if offset < index_bytes or not CHECKSUM_BYTES < nbytes <= limit:
            raise ValueError(f"inner chunk {inner}: span ({offset}, {nbytes}) outside the shard's data")
        return offset, nbytes

    def decode_inner(self, blob: bytes | memoryview, out: np.ndarray) -> None:
        """Decode one inner chunk (with its checksum) into ``out``. Raises ValueError."""
        self.decode_body(self.verified_body(blob), out)

    def decode_bodies(self, bodies: Sequence[bytes | memoryview | None], out: np.ndarray,
                      rows: np.ndarray | None = None) -> None:
        """Decode inner chunks (checksums already checked and cut off) into ``out[rows[i]]``, one
        per body (``rows`` None: ``out[i]``); None: stored empty, zeros. zstd frames are decoded in
        one call, blosc frames of one LZ4 block by python-lz4 (their headers
        checked together), other blosc frames by blosc; each into exactly the bytes of its row.
        Raises ValueError."""
        self._decode_bodies(bodies, out, rows)

    def _decode_bodies(self, bodies: Sequence[bytes | memoryview | None], out: np.ndarray,
                       rows: np.ndarray | None = None) -> None:
        flat = out.reshape(len(out), -1).view(np.uint8)
        targets = np.arange(len(bodies)) if rows is None else rows
        present = [i for i, body in enumerate(bodies) if body is not None]
        if len(present) < len(bodies):
            flat[targets[[i for i, body in enumerate(bodies) if body is None]]] = 0
        given: list[bytes | bytearray | memoryview] = [body for body in bodies if body is not None]
        at = targets[present]
        if self.compression == "zstd" and len(given) > 1:
            _zstd_frames_into(given, flat, at)
            return
        left = _lz4_frames_into(given, flat, at) if self.compression in LZ4_BLOCKS else range(len(given))
        for i in left:
            self.decode_body(given[i], flat[at[i]])

    def decode_body(self, body: bytes | bytearray | memoryview, out: np.ndarray) -> None:
        """Decode one compressed body (no checksum) into ``out``. Raises ValueError."""
        flat = out.reshape(-1).view(np.uint8)
        src = np.frombuffer(self._decompress(body, flat.size), dtype=np.uint8)
        if src.size != flat.size:
            raise ValueError(f"decoded inner chunk has {src.size} bytes, expected {flat.size}")
        flat[:] = src

    def direct_blocks(self, data: np.ndarray, begin: np.ndarray, length: np.ndarray, size: int) -> np.ndarray:
        """For inner chunk bodies ``data[begin[i]:begin[i] + length[i]]`` (uint8, checksums cut
        off) that decode to ``size`` bytes: where `decode_lz4_at` decodes one (an LZ4 block), the
        block's start in ``data``, else -1."""
        if self.compression not in LZ4_BLOCKS or _LZ4_DECODE is None:
            return np.full(len(begin), -1, np.int64)
        return _lz4_blocks(data, begin, length, size)

    def decode_into(self, blob: bytes, out: np.ndarray) -> None:
        """Decode ``blob`` into the preallocated C-contiguous ``out`` (shape and dtype of the chunk).

        Raises ValueError if the checksum does not match or the bytes do not decode to ``out``'s size.
        """
        if self.inner_rows is not None:
            return self._decode_shard(memoryview(blob), out)
        body: bytes | memoryview = memoryview(blob)
        if self.checksum:
            body = self.verified_body(body)
        flat = out.reshape(-1).view(np.uint8)
        src = np.frombuffer(body if self.raw else self._decompress(body, flat.size), dtype=np.uint8)
        if src.size != flat.size:
            raise ValueError(f"decoded chunk has {src.size} bytes, expected {flat.size}")
        flat[:] = src

    def _decode_shard(self, blob: memoryview, out: np.ndarray) -> None:
        head = self.index_bytes(len(out))
        if len(blob) < head:
            raise ValueError(f"{len(blob)} bytes: too short to hold the shard's index of {head} bytes")
        entries = self.verified_body(blob[:head])
        bodies: list[memoryview | None] = []
        for inner in range(len(out) // self._inner_rows):
            span = self._span(entries, inner, head, len(blob))
            if span is not None and span[0] + span[1] > len(blob):
                raise ValueError(f"inner chunk {inner}: span {span} past the shard's {len(blob)} bytes")
            bodies.append(None if span is None else memoryview(self.verified_body(blob[span[0]:span[0] + span[1]])))
        self._decode_bodies(bodies, out.reshape(len(bodies), -1))

    @staticmethod
    def verified_body(blob: bytes | memoryview) -> bytes | memoryview:
        """``blob`` without its trailing checksum, which must match. Raises ValueError."""
        if len(blob) < CHECKSUM_BYTES:
            raise ValueError(f"{len(blob)} bytes: too short to hold a checksum")
        body, stored = blob[:-CHECKSUM_BYTES], bytes(blob[-CHECKSUM_BYTES:])
        if checksum(body) != stored:
            raise ValueError(f"checksum mismatch (stored {stored.hex()}, computed {checksum(body).hex()})")
        return body

    def zarr_codecs(self, field: Field) -> dict[str, Any]:
        """``create_array`` arguments (``compressors``, ``serializer``) that make zarr describe these chunks."""
        compressors: list[Any] = []
        if self.compression == "zstd":
            compressors.append(zarr.codecs.ZstdCodec(level=self.level))
        elif self.compression in LZ4_BLOCKS:
            compressors.append(zarr.codecs.BloscCodec(cname=zarr.codecs.BloscCname(self.compression), clevel=self.level,
                                                      shuffle="shuffle"))
        if self.checksum:
            compressors.append(zarr.codecs.Crc32cCodec())
        if self.inner_rows is None:
            return {"compressors": compressors}
        inner = zarr.codecs.ShardingCodec(chunk_shape=(1, self.inner_rows, *field.shape), index_location="start",
                                          codecs=[zarr.codecs.BytesCodec(), *compressors])
        return {"compressors": None, "serializer": inner}

    @classmethod
    def from_zarr_codecs(cls, codecs: Any, dtype: np.dtype) -> Codec:
        """The codec of an array's ``codecs`` metadata. Raises ValueError for anything else."""
        if not isinstance(codecs, list) or not all(isinstance(c, dict) for c in codecs):
            raise ValueError(f"codecs: expected a list of objects, got {codecs!r}")
        names = [c.get("name") for c in codecs]
        if names == ["sharding_indexed"]:
            return cls._from_sharding(codecs[0].get("configuration"), dtype)
        if not names or names[0] != "bytes":
            raise ValueError(f"unsupported zarr codecs {names}")
        endian = (codecs[0].get("configuration") or {}).get("endian", "little")
        if dtype.itemsize > 1 and endian != "little":
            raise ValueError(f"{endian}-endian chunks, diskreplay writes little-endian")
        checksum_ = names[-1] == "crc32c"
        middle = codecs[1:len(codecs) - checksum_]
        if not middle:
            return cls(None, checksum=checksum_)
        config = middle[0].get("configuration") or {}
        if len(middle) == 1 and middle[0]["name"] == "zstd" and not config.get("checksum"):
            return cls("zstd", _level(config.get("level")), checksum_)
        if len(middle) == 1 and middle[0]["name"] == "blosc" and config.get("cname") in LZ4_BLOCKS:
            return cls(config["cname"], _level(config.get("clevel")), checksum_)
        if len(middle) == 1 and middle[0]["name"] == "zstd":
            raise ValueError("zstd with its own checksum (configuration.checksum true) is not a codec "
                             "diskreplay writes")
        raise ValueError(f"unsupported zarr codecs {names}")

    @classmethod
    def _from_sharding(cls, config: Any, dtype: np.dtype) -> Codec:
        config = config if isinstance(config, dict) else {}
        shape, index = config.get("chunk_shape"), config.get("index_codecs")
        index_names = [c.get("name") if isinstance(c, dict) else None for c in index or []]
        if (not isinstance(shape, list) or len(shape) < 2 or not all(type(v) is int and v >= 1 for v in shape)
                or config.get("index_location") != "start" or index_names != ["bytes", "crc32c"]
                or (index[0].get("configuration") or {}).get("endian", "little") != "little"):
            raise ValueError(f"sharding_indexed configuration {config!r:.300} is not one diskreplay writes "
                             f"(index first, little-endian, with a crc32c)")
        inner = cls.from_zarr_codecs(config.get("codecs"), dtype)
        if inner.inner_rows is not None or inner.compression is None or not inner.checksum:
            raise ValueError("sharding_indexed: inner chunks must be compressed and checksummed, not sharded again")
        return cls(inner.compression, inner.level, True, shape[1])


def _zstd_frames_into(frames: list[bytes | bytearray | memoryview], flat: np.ndarray, at: np.ndarray) -> None:
    """Decode zstd frames into ``flat[at[i]]`` in one call. Raises ValueError."""
    sizes = np.full(len(frames), flat.shape[1], dtype=np.uint64)
    try:
        decoded = _ZSTD.decompressor.multi_decompress_to_buffer(frames, decompressed_sizes=sizes.data)
    except zstandard.ZstdError as exc:
        raise ValueError(str(exc)) from None
    # a BufferSegment exports the buffer protocol; zstandard's stubs do not say so
    joined = b"".join(decoded[i] for i in range(len(frames)))  # type: ignore[misc]
    flat[at] = np.frombuffer(joined, dtype=np.uint8).reshape(len(frames), -1)


def _lz4_frames_into(frames: list[bytes | bytearray | memoryview], flat: np.ndarray, at: np.ndarray) -> np.ndarray:
    """Decode the blosc frames that hold one LZ4 block (`_lz4_blocks`) into ``flat[at[i]]``.
    Returns the indices of the other frames, left to blosc. Raises ValueError."""
    lengths = np.fromiter(map(len, frames), dtype=np.int64, count=len(frames))
    joined = b"".join(frames)
    data = np.frombuffer(joined, np.uint8)
    blocks = _lz4_blocks(data, np.cumsum(lengths) - lengths, lengths, flat.shape[1])
    fast = blocks >= 0
    if _LZ4_DECODE is not None and flat.flags.c_contiguous:
        decode_lz4_at(data.ctypes.data + blocks[fast], lengths[fast] - LZ4_HEAD, flat, at[fast])
    else:
        _lz4_blocks_copied(joined, blocks[fast].tolist(), (lengths[fast] - LZ4_HEAD).tolist(), at[fast].tolist(), flat)
    return np.flatnonzero(~fast)


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
        if checksum(blob[:size]) != blob[size:]:
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


def _lz4_blocks_copied(joined: bytes, begins: list[int], sizes: list[int], rows: list[int], flat: np.ndarray) -> None:
    """As `decode_lz4_at`, through python-lz4's own decompress (a bytes object per block,
    then copied into its row). Raises ValueError."""
    view, width = memoryview(joined), flat.shape[1]
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


class _Zstd(threading.local):
    """This thread's zstd contexts, kept: making one costs more than coding a frame."""

    def __init__(self) -> None:
        self.decompressor = zstandard.ZstdDecompressor()
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        if level not in self.compressors:
            self.compressors[level] = zstandard.ZstdCompressor(level=level)
        return self.compressors[level]


_ZSTD = _Zstd()


def checksum(data: bytes | memoryview) -> bytes:
    """CRC32C of ``data`` as zarr's ``crc32c`` codec stores it (4 bytes, little-endian)."""
    if isinstance(data, bytes):
        return int(google_crc32c.value(data)).to_bytes(4, "little")
    view = np.frombuffer(data, dtype=np.uint8)
    view.flags.writeable = False  # google_crc32c takes bytes and read-only buffers only
    return int(google_crc32c.value(view)).to_bytes(4, "little")


def _level(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"compression level: expected an int, got {value!r}")
    return value
