"""`ChunkIO`: whole chunks of a buffer's fields in and out of its store, on a few I/O threads.

Writes encode each chunk (`Codec`) and put it: a chunk no commit ever covered is written in place
on a local store (no temp file or rename: a torn write is invisible to every commit), any other is
replaced atomically. Writes made without durability are remembered and made durable by `sync`.

Reads decode chunks straight into cache slots: raw local chunks are read into the slot with one
``readv`` (values, then the checksum beside them); every other chunk is fetched (concurrently on a
remote store), checksummed and decoded once. Nothing read sizes an allocation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import Codec, checksum
from ..format.config import BufferConfig
from ..format.keys import chunk_key
from ..format.shard_table import MAX_TABLE_BYTES
from ..io.store import Blob, ChunkStore, is_local
from ..io.threads import Threads

ChunkWrite = tuple[str, Codec, np.ndarray, bool]
"""``(key, codec, rows, fresh)``: a chunk to write; ``fresh``: no commit ever covered it."""
ChunkRead = tuple[str, Codec, np.ndarray]
"""``(key, codec, rows)``: a chunk to read into ``rows`` (its full shape)."""


def default_io_threads(url: str) -> int:
    """Local disk is bound by CPU and the filesystem: threads beyond the cores only contend.
    Object stores are bound by latency: many requests in flight."""
    return min(4, os.cpu_count() or 1) if is_local(url) else 16


def deal(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """The indices of ``sizes`` dealt into at most ``parts`` non-empty lists of about equal total
    size, each in order: the biggest first, each to the list holding the least so far (the frames
    of a batch spread over the threads, rather than every ``parts``-th chunk, which puts every
    chunk of one field on one thread when the fields divide by ``parts``)."""
    lists: list[list[int]] = [[] for _ in range(min(parts, len(sizes)))]
    loads = [0] * len(lists)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        lightest = loads.index(min(loads))
        lists[lightest].append(i)
        loads[lightest] += sizes[i]
    return [sorted(part) for part in lists]


def balanced(work: list[ChunkWrite], parts: int) -> list[list[ChunkWrite]]:
    """``work`` dealt into at most ``parts`` lists of about equal bytes (`deal`)."""
    return [[work[i] for i in part] for part in deal([rows.nbytes for _, _, rows, _ in work], parts)]


class ChunkIO:
    """Chunk keys, codecs and the I/O threads of one buffer's store."""

    def __init__(self, store: ChunkStore, config: BufferConfig, codecs: dict[str, Codec], threads: int,
                 prefixes: Sequence[str] = ("",)):
        """``prefixes``: where in ``store`` each equal group of lanes keeps its chunks (several:
        the shards of a sharded buffer, read from its root store as one buffer's lanes)."""
        self.store = store
        self.prefixes, self.prefix_lanes = tuple(prefixes), config.num_envs // len(prefixes)
        self.url = store.url
        self.schema = config.schema
        self.codecs = codecs
        self.separator = config.chunk_key_separator
        self.raw = all(codec.raw for codec in codecs.values())
        self.trailer = max((codec.trailer for codec in codecs.values()), default=0)
        self.threads = threads
        self.workers = Threads(threads, "diskreplay-io")
        self.behind_workers = Threads(threads, "diskreplay-io-behind")
        self.unsynced: set[str] = set()
        self.heads: dict[str, bytes | None] | None = {}
        """The index (checksum cut off) of each sharded chunk this store's writes put, by key, for
        the shard index tables; None where a put failed (the object may hold either). None: past
        `MAX_TABLE_BYTES` of them, no longer kept."""

    def key(self, name: str, lane: int, chunk: int) -> str:
        """The store key of a field's chunk."""
        if len(self.prefixes) == 1:
            return self.prefixes[0] + chunk_key(name, self.schema[name], lane, chunk, self.separator)
        group, lane = divmod(lane, self.prefix_lanes)
        return self.prefixes[group] + chunk_key(name, self.schema[name], lane, chunk, self.separator)

    # ---- writes ----------------------------------------------------------------------------

    def put(self, work: list[ChunkWrite], durable: bool, behind: bool = False) -> None:
        """Write chunks on the I/O threads, a few long jobs rather than one per chunk (queueing a
        job costs about as much as writing a small chunk). Every job ends before this returns or
        raises: none writes on behind a failure. ``behind``: writes behind the appends, on threads
        of their own, so that reads meanwhile do not queue behind their encoding."""
        workers = self.behind_workers if behind else self.workers
        jobs = [workers.submit(self._put_batch, batch, durable) for batch in balanced(work, self.threads)]
        for job in jobs:
            job.exception()
        for job in jobs:
            job.result()

    def _put_batch(self, work: list[ChunkWrite], durable: bool) -> None:
        for key, codec, rows, fresh in work:
            parts, heads = codec.encode(rows), self.heads if codec.inner_rows is not None else None
            if heads is not None:
                heads[key] = None  # until the put is done
            self._put_one(key, parts, durable, fresh)
            if heads is not None:
                heads[key] = bytes(parts[0])
                if len(heads) * len(parts[0]) > MAX_TABLE_BYTES:
                    self.heads = None

    def _put_one(self, key: str, data: tuple[bytes | memoryview, ...], durable: bool, fresh: bool) -> None:
        if fresh:
            self.store.put_in_place(key, data)
        else:
            self.store.put(key, data, durable)
        if (fresh or not durable) and self.store.needs_sync:
            self.unsynced.add(key)

    def sync(self) -> None:
        """Make every chunk written without durability since the last sync durable."""
        self.store.sync(self.unsynced, self.workers.map)
        self.unsynced = set()

    # ---- reads -----------------------------------------------------------------------------

    def read(self, work: Sequence[ChunkRead], must_exist: bool) -> None:
        """Read chunks into their rows; a missing chunk is an error if ``must_exist``, else zeros.

        Raises CorruptBufferError naming a chunk that is missing, short, fails its checksum or
        does not decode."""
        if self.store.supports_mmap and self.raw:
            found = [self._read_raw(key, rows) for key, _, rows in work]  # memcpy-bound: threads only add overhead
        else:
            blobs = self.store.get_many([key for key, _, _ in work])
            found = [False] * len(work)

            def decode(part: list[int]) -> None:  # a few jobs, not one per chunk: small ones cost less than a job
                for i in part:
                    found[i] = self._decode(work[i], blobs[i])
            for _ in self.workers.map(decode, deal([rows.nbytes for _, _, rows in work], self.threads)):
                pass
        for (key, _, rows), ok in zip(work, found):
            if not ok:
                if must_exist:
                    raise CorruptBufferError(
                        f"{self.url!r}: chunk {key!r} is missing, but the last commit says it holds rows")
                rows[...] = 0

    def read_here(self, work: Sequence[ChunkRead]) -> bool:
        """Read chunks into their rows, decoded on the calling thread (a read-ahead's job; one
        request each, all in flight at once): False if one is missing. Raises
        CorruptBufferError as `read`."""
        if self.store.supports_mmap and self.raw:
            return all(self._read_raw(key, rows) for key, _, rows in work)
        blobs = self.store.get_many([key for key, _, _ in work])
        return all(self._decode(one, blob) for one, blob in zip(work, blobs))

    def _read_raw(self, key: str, rows: np.ndarray) -> bool:
        """Read a raw chunk file straight into ``rows`` (no copy), its checksum beside it."""
        values = rows.reshape(-1).view(np.uint8).data
        trailer = bytearray(self.trailer + 1)  # one byte more: a longer file is found too
        got = self.store.read_into(key, [values, memoryview(trailer)])
        if got is None:
            return False
        if got != rows.nbytes + self.trailer:
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} has {got} bytes, expected "
                                     f"{rows.nbytes + self.trailer}")
        if self.trailer and checksum(values) != bytes(trailer[:-1]):
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} fails its checksum (the file is damaged)")
        return True

    def _decode(self, work: ChunkRead, blob: Blob | None) -> bool:
        key, codec, rows = work
        if blob is None:
            return False
        try:
            codec.decode_into(blob, rows)
        except Exception as exc:
            raise CorruptBufferError(f"{self.url!r}: chunk {key!r} does not decode ({exc})") from None
        return True

    def close(self) -> None:
        self.workers.shutdown()
        self.behind_workers.shutdown()
