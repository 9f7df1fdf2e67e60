"""`ShardTable`: the index of every shard of one sharded field at one commit, in one object.

A cold row of a sharded field (format section 3) costs its shard's index, then its inner chunk:
two rounds of requests, the first one per shard. A writer that closes a buffer writes, per
sharded field, one object with the indexes of every shard its last commit covers
(`table_keys`), stamped with that commit's sequence and time. A reader showing that commit takes
the indexes from it, one request per field; a table of another commit is not used (the
buffer moved on since). The object: a header (`HEADER`), a presence byte per ``(lane, chunk)``
(0: not in the table), the held shards' indexes as one zstd frame (`_columns`: 16 bytes an
inner chunk, nearly all of them predictable from its neighbours), then the CRC32C of all of it
(4 bytes, little-endian). Tables of an earlier version (`V1_DIR`, ``DRSHIDX1``: the indexes as
stored, uncompressed) are still read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zstandard

from ..errors import CorruptBufferError
from .codecs import CHECKSUM_BYTES, EMPTY_INNER, checksum

TABLES_DIR = "shard-index-tables"
V1_DIR = "shard-indexes"
"""Where an earlier version put its uncompressed tables (``DRSHIDX1``), which that version's
readers still look for: a new table under its key would be damage to them."""
MAGIC, V1_MAGIC = b"DRSHIDX2", b"DRSHIDX1"
HEADER = np.dtype([("magic", "S8"), ("sequence", "<u8"), ("time", "<f8"), ("lanes", "<u4"), ("chunks", "<u4"),
                   ("inner", "<u4"), ("reserved", "<u4")])
MAX_TABLE_BYTES = 32 << 20
"""The largest table a writer writes or a reader reads, uncompressed (`table_bytes`): past it
(about 32,000 shards of 64 inner chunks) the rows of a first batch touch a small part of it, and
shards' own indexes serve."""
MAX_STORED_BYTES = MAX_TABLE_BYTES + (MAX_TABLE_BYTES >> 7) + (1 << 16)
"""The most bytes a table's object may take (zstd's bound for incompressible input, and more)."""


def table_keys(name: str) -> tuple[str, str]:
    """The keys of field ``name``'s table among a buffer's own objects (format section 6): this
    version's, then an earlier one's."""
    return f"{TABLES_DIR}/{name}", f"{V1_DIR}/{name}"


def table_bytes(lanes: int, chunks: int, inner: int) -> int:
    """The size of a table of ``lanes`` x ``chunks`` shards of ``inner`` inner chunks, uncompressed."""
    return HEADER.itemsize + lanes * chunks * (1 + 16 * inner) + CHECKSUM_BYTES


@dataclass(frozen=True)
class ShardTable:
    """Shard indexes of one field at commit ``sequence`` (written at ``time``): ``present``
    ``[lanes, chunks]`` bool, ``columns`` ``[2, held, inner]`` uint64 (the held shards' indexes,
    lane-major, as `_columns` stores them). `indexes` gives some shards' indexes, `entries` all."""

    sequence: int
    time: float
    present: np.ndarray
    columns: np.ndarray

    @classmethod
    def of(cls, sequence: int, time: float, present: np.ndarray, entries: np.ndarray) -> ShardTable:
        """The table of the indexes ``entries`` ``[lanes, chunks, inner, 2]`` of the shards ``present``."""
        return cls(sequence, time, present, _columns(entries[present].astype("<u8")))

    @property
    def inner(self) -> int:
        return int(self.columns.shape[2])

    @functools.cached_property
    def _rows(self) -> np.ndarray:
        """Each shard's row in ``columns`` (-1: not held)."""
        rows = np.cumsum(self.present.ravel()).reshape(self.present.shape) - 1
        return np.where(self.present, rows, -1)

    def indexes(self, lanes: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """The indexes ``[n, inner, 2]`` uint64 ``(offset, nbytes)`` of held shards ``(lanes[i], chunks[i])``."""
        rows = self._rows[lanes, chunks]
        return _indexes(self.columns[:, rows])

    @functools.cached_property
    def entries(self) -> np.ndarray:
        """Every shard's index ``[lanes, chunks, inner, 2]`` uint64 (zeros where not held)."""
        entries = np.zeros((*self.present.shape, self.inner, 2), "<u8")
        entries[self.present] = _indexes(self.columns)
        return entries

    def to_bytes(self) -> bytes:
        lanes, chunks = self.present.shape
        head = np.array([(MAGIC, self.sequence, self.time, lanes, chunks, self.inner, 0)], HEADER)
        body = (head.tobytes() + self.present.astype(np.uint8).tobytes()
                + zstandard.ZstdCompressor(level=3).compress(self.columns.astype("<u8").tobytes()))
        return body + checksum(body)

    @classmethod
    def from_bytes(cls, blob: bytes | memoryview, key: str, url: str, lanes: int, inner: int) -> ShardTable:
        """The table stored as ``blob`` at ``key`` (this version's or an earlier one's), for a
        buffer of ``lanes`` lanes whose field has ``inner`` inner chunks per shard. Raises
        CorruptBufferError naming ``key`` if the object is short, fails its checksum, holds
        another shape or its indexes do not decode."""
        def bad(what: str) -> CorruptBufferError:
            return CorruptBufferError(f"{url!r}: shard index table {key!r} is damaged: {what}")

        if len(blob) < HEADER.itemsize + CHECKSUM_BYTES:
            raise bad(f"{len(blob)} bytes, expected at least {HEADER.itemsize + CHECKSUM_BYTES}")
        body = memoryview(blob)[:-CHECKSUM_BYTES]
        if checksum(body) != bytes(blob[-CHECKSUM_BYTES:]):
            raise bad("checksum mismatch")
        head = np.frombuffer(body[:HEADER.itemsize], HEADER)[0]
        magic, chunks = bytes(head["magic"]), int(head["chunks"])
        if magic not in (MAGIC, V1_MAGIC) or (int(head["lanes"]), int(head["inner"])) != (lanes, inner):
            raise bad(f"header (magic, lanes, inner) {(magic, int(head['lanes']), int(head['inner']))}, "
                      f"expected {(MAGIC, lanes, inner)}")
        if table_bytes(lanes, chunks, inner) > MAX_TABLE_BYTES:
            raise bad(f"{chunks} chunks per lane: its indexes would take {table_bytes(lanes, chunks, inner)} bytes, "
                      f"more than the {MAX_TABLE_BYTES} a table holds")
        if magic == V1_MAGIC and len(blob) != table_bytes(lanes, chunks, inner):
            raise bad(f"{len(blob)} bytes, expected {table_bytes(lanes, chunks, inner)} for {chunks} chunks per lane")
        if len(body) < HEADER.itemsize + lanes * chunks:
            raise bad(f"{len(blob)} bytes, too short for the presence bytes of {chunks} chunks per lane")
        present = np.frombuffer(body, np.uint8, lanes * chunks, HEADER.itemsize).reshape(lanes, chunks)
        if (present > 1).any():
            raise bad("a presence byte other than 0 or 1")
        rest, held = body[HEADER.itemsize + present.size:], present.astype(bool)
        if magic == V1_MAGIC:
            return cls.of(int(head["sequence"]), float(head["time"]), held,
                          np.frombuffer(rest, "<u8").reshape(lanes, chunks, inner, 2))
        columns = _payload(rest, int(held.sum()) * inner * 16, bad).reshape(2, -1, inner)
        return cls(int(head["sequence"]), float(head["time"]), held, columns)


def _payload(frame: memoryview, size: int, bad: Callable[[str], CorruptBufferError]) -> np.ndarray:
    """The zstd ``frame`` decoded, which must say it gives ``size`` bytes and give them, as
    little-endian uint64."""
    try:
        said = zstandard.frame_content_size(frame)
        if said != size:
            raise bad(f"its indexes would decode to {said} bytes (-1: unsaid), expected {size}")
        data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise bad(f"its indexes do not decode ({exc}), expected {size} bytes") from None
    if len(data) != size:
        raise bad(f"its indexes decode to {len(data)} bytes, expected {size}")
    return np.frombuffer(data, "<u8")


def _expected(nbytes: np.ndarray) -> np.ndarray:
    """Where each inner chunk of shards ``[held, inner]`` of these ``nbytes`` starts when each
    follows the one before it, the first the shard's index (stored empty ones take no bytes)."""
    sizes = np.where(nbytes == EMPTY_INNER, np.uint64(0), nbytes)
    return np.uint64(16 * nbytes.shape[1] + CHECKSUM_BYTES) + np.cumsum(sizes, axis=1, dtype=np.uint64) - sizes


def _columns(held: np.ndarray) -> np.ndarray:
    """The indexes ``[held, inner, 2]`` as a table stores them, ``[2, held, inner]``: every offset
    less where it would start after the inner chunk before it (modulo 2**64: 0 for a shard as a
    writer lays it out), then every ``nbytes``."""
    offset, nbytes = held[..., 0], held[..., 1]
    return np.stack([offset - _expected(nbytes), nbytes])


def _indexes(columns: np.ndarray) -> np.ndarray:
    """`_columns` undone: ``[held, inner, 2]`` uint64."""
    residual, nbytes = columns
    return np.stack([residual + _expected(nbytes), nbytes], axis=-1)
