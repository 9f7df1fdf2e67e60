"""Chunk bytes: `Codec` turns one chunk's rows into exactly the bytes zarr stores, and back.

Codecs are ``bytes`` (little-endian), then ``zstd`` or blosc ``lz4`` / ``lz4hc`` or nothing, then
``crc32c``. A zstd frame that would save less than an eighth of its bytes is written as a stored
frame (`diskreplay.format.zstd_frames`: zstd's raw blocks, copied out when read).
Compressed fields with big rows (images) are Zarr shards (``sharding_indexed``, index first) of
small inner chunks, each compressed and checksummed alone (`Codec.inner_rows`); a whole shard's
index and checksums are checked at once and its inner chunks decoded straight from its bytes
(`diskreplay.format.lz4_blocks` for the LZ4 blocks and the checksums). Nothing read from a chunk
sizes an allocation: decoded sizes are checked against the expected ones first.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import google_crc32c
import numcodecs
import numpy as np
import zarr
import zarr.codecs
import zstandard
from numcodecs import blosc

from ..checks import check_int
from .lz4_blocks import BLOSC_HEADER_BYTES, direct_blocks, first_bad_checksum, lz4_spans_into
from .lz4_blocks import CHECKSUM_BYTES as CHECKSUM_BYTES  # the chunk format's, imported from here
from .schema import Field
from .zstd_frames import copy_stored, keeps_frame, stored_frame, stored_mask

COMPRESSIONS = (None, "zstd", "lz4", "lz4hc")
"""Chunk codecs: raw, zstd, blosc LZ4 (fast to write), blosc LZ4-HC (slower to write; smaller, and
the same LZ4 blocks decode faster: fewer, longer matches)."""
LEVELS = {None: (0, 22), "zstd": (0, 22), "lz4": (0, 9), "lz4hc": (0, 9)}
"""Each codec's ``compression_level`` range (blosc's clevel is 0-9; 0 stores the bytes as they are)."""
LZ4_BLOCKS = ("lz4", "lz4hc")
"""Codecs whose compressed bodies are blosc frames of LZ4 blocks (the decode fast path's)."""
ROW_ACCESS_BYTES = 1 << 10
INNER_CHUNK_BYTES = 1 << 13
"""Compressed fields whose rows take at least `ROW_ACCESS_BYTES` (images) are stored as Zarr
shards: each chunk file holds inner chunks of about `INNER_CHUNK_BYTES` (one 84x84 frame),
compressed one by one behind an index, so a sampled row costs one small read and decode, not
the decode of its whole chunk (`Codec.inner_rows`)."""
SMALL_ROWS_INNER = 4
"""Inner chunks a chunk of small rows must hold at least to be sharded (`inner_rows_for`)."""
EMPTY_INNER = (1 << 64) - 1


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
            content = data.reshape(-1).view(np.uint8)
            frame = _ZSTD.compressor(self.level).compress(content.data)
            return frame if not len(content) or keeps_frame(len(frame), len(content)) else stored_frame(content)
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

    def decode_inner(self, blob: bytes | memoryview, out: np.ndarray) -> None:
        """Decode one inner chunk (with its checksum) into ``out``. Raises ValueError."""
        self.decode_body(self.verified_body(blob), out)

    def decode_stored(self, blob: bytes, begin: np.ndarray, length: np.ndarray, out: np.ndarray,
                      rows: np.ndarray) -> None:
        """Decode the inner chunks ``blob[begin[i]:begin[i] + length[i]]`` (int64; each with its
        checksum, all checked first in one call) into ``out[rows[i]]`` (C-contiguous, one inner
        chunk's rows each). Raises ValueError naming the first that fails."""
        data = np.frombuffer(blob, np.uint8)
        _check_bodies(data, begin, length, rows)
        self._decode_spans(blob, data, begin, length - CHECKSUM_BYTES, out.reshape(len(out), -1).view(np.uint8), rows)

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
        given = [body for body in bodies if body is not None]
        if len(given) < len(bodies):
            flat[targets[[i for i, body in enumerate(bodies) if body is None]]] = 0
            targets = targets[[i for i, body in enumerate(bodies) if body is not None]]
        sizes = [len(body) for body in given]
        begin = np.fromiter(accumulate(sizes, initial=0), np.int64, len(sizes) + 1)
        joined = b"".join(given)
        self._decode_spans(joined, np.frombuffer(joined, np.uint8), begin[:-1], np.array(sizes, np.int64), flat,
                           targets)

    def _decode_spans(self, blob: bytes | memoryview, data: np.ndarray, begin: np.ndarray, length: np.ndarray,
                      flat: np.ndarray, rows: np.ndarray) -> None:
        """Decode the bodies ``blob[begin[i]:begin[i] + length[i]]`` (checksums checked and cut
        off; ``data``: ``blob`` as uint8; int64 offsets and lengths) into ``flat[rows[i]]``
        (uint8 rows of the decoded size), as `decode_bodies` says. Raises ValueError."""
        if self.compression == "zstd" and len(rows) > 1:
            _zstd_spans_into(blob, data, begin, length, flat, rows)
            return
        left = (lz4_spans_into(blob, data, begin, length, flat, rows) if self.compression in LZ4_BLOCKS
                else range(len(rows)))
        view = memoryview(blob)
        for i in left:
            self.decode_body(view[begin[i]:begin[i] + length[i]], flat[rows[i]])

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
        if self.compression not in LZ4_BLOCKS:
            return np.full(len(begin), -1, np.int64)
        return direct_blocks(data, begin, length, size)

    def decode_into(self, blob: bytes | memoryview, out: np.ndarray) -> None:
        """Decode ``blob`` into the preallocated C-contiguous ``out`` (shape and dtype of the chunk).

        Raises ValueError if the checksum does not match or the bytes do not decode to ``out``'s size.
        """
        if self.inner_rows is not None:
            return self._decode_shard(blob, out)
        body: bytes | memoryview = memoryview(blob)
        if self.checksum:
            body = self.verified_body(body)
        flat = out.reshape(-1).view(np.uint8)
        src = np.frombuffer(body if self.raw else self._decompress(body, flat.size), dtype=np.uint8)
        if src.size != flat.size:
            raise ValueError(f"decoded chunk has {src.size} bytes, expected {flat.size}")
        flat[:] = src

    def _decode_shard(self, blob: bytes | memoryview, out: np.ndarray) -> None:
        """Decode a whole shard into ``out``: its index and every stored inner chunk's span and
        checksum checked at once, first (`_stored_spans`), then the inner chunks decoded
        straight from ``blob``. Raises ValueError naming the first damage."""
        head = self.index_bytes(len(out))
        if len(blob) < head:
            raise ValueError(f"{len(blob)} bytes: too short to hold the shard's index of {head} bytes")
        index = np.frombuffer(self.verified_body(blob[:head]), "<u8").reshape(-1, 2)
        data = np.frombuffer(blob, np.uint8)
        flat = out.reshape(len(index), -1).view(np.uint8)
        if _all_stored_inside(index, head, len(data)):  # the common case, in a few reductions
            rows, spans = np.arange(len(index)), index.astype(np.int64)
            _check_bodies(data, spans[:, 0], spans[:, 1], rows)
        else:
            stored = _stored_spans(index, head, data)
            flat[~stored] = 0
            rows, spans = np.flatnonzero(stored), index[stored].astype(np.int64)
        self._decode_spans(blob, data, spans[:, 0], spans[:, 1] - CHECKSUM_BYTES, flat, rows)

    @staticmethod
    def verified_body(blob: bytes | memoryview) -> bytes | memoryview:
        """``blob`` without its trailing checksum, which must match. Raises ValueError."""
        if len(blob) < CHECKSUM_BYTES:
            raise ValueError(f"{len(blob)} bytes: too short to hold a checksum")
        body, stored = blob[:-CHECKSUM_BYTES], bytes(blob[-CHECKSUM_BYTES:])
        if len(body) >= GIL_FREE_CHECK_BYTES:  # a large chunk's check leaves the GIL to the reading thread
            data = np.frombuffer(blob, np.uint8)
            if first_bad_checksum(np.array([data.ctypes.data]), np.array([len(body)])) < 0:
                return body
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


def _all_stored_inside(index: np.ndarray, head: int, size: int) -> bool:
    """Whether every inner chunk of a shard's ``index`` ((inner chunks, 2) uint64 ``(offset,
    nbytes)`` pairs) is stored and lies in its ``size`` bytes past the ``head`` bytes of index."""
    offset, nbytes = index[:, 0], index[:, 1]  # uint64: an empty one's (2**64 - 1) pair fails the bounds
    return bool(len(index) and offset.min() >= head and offset.max() <= size and nbytes.min() > CHECKSUM_BYTES
                and nbytes.max() <= size and (offset + nbytes).max() <= size)


def _stored_spans(index: np.ndarray, head: int, data: np.ndarray) -> np.ndarray:
    """Which inner chunks a shard stores (bool, one per inner chunk; the others are marked
    empty), from its ``index`` ((inner chunks, 2) uint64 ``(offset, nbytes)`` pairs), each
    checked in the order of the inner chunks: its span inside the shard's bytes ``data`` (uint8)
    past its ``head`` bytes of index, then its checksum. Raises ValueError naming the first
    inner chunk that fails."""
    offset, nbytes, size = index[:, 0], index[:, 1], len(data)
    stored: np.ndarray = (offset != EMPTY_INNER) | (nbytes != EMPTY_INNER)
    outside = stored & ((offset < head) | (nbytes <= CHECKSUM_BYTES) | (nbytes > size))
    bad = outside | (stored & (offset > size - np.minimum(nbytes, size)))
    end = int(np.argmax(bad)) if bad.any() else len(index)
    inners = np.flatnonzero(stored[:end])
    _check_bodies(data, offset[inners].astype(np.int64), nbytes[inners].astype(np.int64), inners)
    if end < len(index):
        span = (int(offset[end]), int(nbytes[end]))
        raise ValueError(f"inner chunk {end}: span {span} "
                         + ("outside the shard's data" if outside[end] else f"past the shard's {size} bytes"))
    return stored


def _check_bodies(data: np.ndarray, offset: np.ndarray, nbytes: np.ndarray, inners: np.ndarray) -> None:
    """Check the inner chunks ``inners`` at ``data[offset[i]:offset[i] + nbytes[i]]`` (uint8;
    int64 spans inside it, each a body and its checksum) in one call. Raises ValueError naming
    the first that fails."""
    bad = first_bad_checksum(data.ctypes.data + offset, nbytes - CHECKSUM_BYTES)
    if bad < 0:
        return
    why = "checksum mismatch"
    try:
        Codec.verified_body(data.data[offset[bad]:offset[bad] + nbytes[bad]])
    except ValueError as exc:
        why = str(exc)  # with the stored and computed checksums
    raise ValueError(f"inner chunk {inners[bad]}: {why}")


def _zstd_spans_into(blob: bytes | memoryview, data: np.ndarray, begin: np.ndarray, length: np.ndarray,
                     flat: np.ndarray, rows: np.ndarray) -> None:
    """Decode the zstd frames ``blob[begin[i]:begin[i] + length[i]]`` (``data``: ``blob`` as
    uint8) into ``flat[rows[i]]`` (uint8 rows): stored frames copied, the others in one call,
    each into a buffer of exactly its row's size (a frame's header sizes nothing), then copied
    into its row. Raises ValueError."""
    stored = stored_mask(data, begin, length, flat.shape[1])
    if stored.any():
        copy_stored(data, begin[stored], flat, rows[stored])
        begin, length, rows = begin[~stored], length[~stored], rows[~stored]
        if not len(rows):
            return
    segments = np.empty((len(rows), 2), "<u8")
    segments[:, 0], segments[:, 1] = begin, length
    sizes = np.full(len(rows), flat.shape[1], np.uint64)
    try:
        frames = zstandard.BufferWithSegments(blob, segments.reshape(-1).data)
        decoded = _ZSTD.decompressor.multi_decompress_to_buffer(frames, decompressed_sizes=sizes.data)
    except zstandard.ZstdError as exc:
        raise ValueError(str(exc)) from None
    width = flat.shape[1]
    # a BufferSegment exports the buffer protocol; zstandard's stubs do not say so
    if flat.flags.c_contiguous:
        view = flat.data.cast("B")
        for i, row in enumerate(rows.tolist()):
            view[row * width:(row + 1) * width] = decoded[i]  # type: ignore[call-overload]
    else:
        for i, row in enumerate(rows.tolist()):
            flat[row] = np.frombuffer(decoded[i], np.uint8)  # type: ignore[call-overload]


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


GIL_FREE_CHECK_BYTES = 64 * 2**10
"""Bodies from this size are checked in one call without the GIL (`first_bad_checksum`)."""


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
