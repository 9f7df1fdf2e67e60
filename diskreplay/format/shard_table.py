"""`ShardTable`: the index of every shard of one sharded field at one commit, in one object.

A cold row of a sharded field (format section 3) costs its shard's index, then its inner chunk:
two rounds of requests, the first one per shard. A writer that closes a buffer writes, per
sharded field, one object with the indexes of every shard its last commit covers
(`table_key`), stamped with that commit's sequence and time. A reader showing that commit takes
the indexes from it, one request per field; a table of another commit is not used (the
buffer moved on since). The object: a header (`HEADER`), a presence byte per ``(lane, chunk)``
(0: not in the table), each shard's index as stored (``[lanes, chunks, inner, 2]`` little-endian
uint64 ``(offset, nbytes)``), then the CRC32C of all of it (4 bytes, little-endian).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import CorruptBufferError
from .codecs import CHECKSUM_BYTES, checksum

TABLES_DIR = "shard-indexes"
MAGIC = b"DRSHIDX1"
HEADER = np.dtype([("magic", "S8"), ("sequence", "<u8"), ("time", "<f8"), ("lanes", "<u4"), ("chunks", "<u4"),
                   ("inner", "<u4"), ("reserved", "<u4")])
MAX_TABLE_BYTES = 32 << 20
"""The largest table a writer writes or a reader reads: past it (about 32,000 shards of 64 inner
chunks) the rows of a first batch touch a small part of it, and shards' own indexes serve."""


def table_key(name: str) -> str:
    """The key of field ``name``'s table among a buffer's own objects (format section 6)."""
    return f"{TABLES_DIR}/{name}"


def table_bytes(lanes: int, chunks: int, inner: int) -> int:
    """The size of a table of ``lanes`` x ``chunks`` shards of ``inner`` inner chunks."""
    return HEADER.itemsize + lanes * chunks * (1 + 16 * inner) + CHECKSUM_BYTES


@dataclass(frozen=True)
class ShardTable:
    """Shard indexes of one field at commit ``sequence`` (written at ``time``): ``present``
    ``[lanes, chunks]`` bool, ``entries`` ``[lanes, chunks, inner, 2]`` uint64."""

    sequence: int
    time: float
    present: np.ndarray
    entries: np.ndarray

    def to_bytes(self) -> bytes:
        lanes, chunks, inner, _ = self.entries.shape
        head = np.array([(MAGIC, self.sequence, self.time, lanes, chunks, inner, 0)], HEADER)
        body = head.tobytes() + self.present.astype(np.uint8).tobytes() + self.entries.astype("<u8").tobytes()
        return body + checksum(body)

    @classmethod
    def from_bytes(cls, blob: bytes | memoryview, key: str, url: str, lanes: int, inner: int) -> ShardTable:
        """The table stored as ``blob`` at ``key``, for a buffer of ``lanes`` lanes whose field
        has ``inner`` inner chunks per shard. Raises CorruptBufferError naming ``key`` if the
        object is short, fails its checksum or holds another shape."""
        def bad(what: str) -> CorruptBufferError:
            return CorruptBufferError(f"{url!r}: shard index table {key!r} is damaged: {what}")

        if len(blob) < HEADER.itemsize + CHECKSUM_BYTES:
            raise bad(f"{len(blob)} bytes, expected at least {HEADER.itemsize + CHECKSUM_BYTES}")
        body = memoryview(blob)[:-CHECKSUM_BYTES]
        if checksum(body) != bytes(blob[-CHECKSUM_BYTES:]):
            raise bad("checksum mismatch")
        head = np.frombuffer(body[:HEADER.itemsize], HEADER)[0]
        if head["magic"] != MAGIC or (int(head["lanes"]), int(head["inner"])) != (lanes, inner):
            raise bad(f"header (magic, lanes, inner) {(bytes(head['magic']), int(head['lanes']), int(head['inner']))}, "
                      f"expected {(MAGIC, lanes, inner)}")
        chunks = int(head["chunks"])
        if len(blob) != table_bytes(lanes, chunks, inner):
            raise bad(f"{len(blob)} bytes, expected {table_bytes(lanes, chunks, inner)} for {chunks} chunks per lane")
        present = np.frombuffer(body, np.uint8, lanes * chunks, HEADER.itemsize).reshape(lanes, chunks)
        if (present > 1).any():
            raise bad("a presence byte other than 0 or 1")
        entries = np.frombuffer(body, "<u8", offset=HEADER.itemsize + present.size).reshape(lanes, chunks, inner, 2)
        return cls(int(head["sequence"]), float(head["time"]), present.astype(bool), entries)
