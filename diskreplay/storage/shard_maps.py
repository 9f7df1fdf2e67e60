"""Sharded chunk files of a local store, memory-mapped with their index read and checked once.

A compressed image field is stored as Zarr shards (`diskreplay.format.codecs.Codec.inner_rows`):
an index of ``(offset, nbytes)`` pairs, then inner chunks of a few rows, each with its CRC32C.
A reader missing its cache reads single inner chunks. `ShardMaps` maps each shard file the
first time a read needs it, checks its whole index at once (checksum, every span inside the
file and no longer than an inner chunk may take), and keeps the map: an inner chunk is then a
slice of the map, with no system call, and its checksum is checked the first time it is read.

Maps are file-backed pages: the page cache, shared and reclaimable, never private memory. Each
costs one of the process's ``vm.max_map_count`` maps, so at most `budget` are held; past that
the least recently used are closed. A shard file the writer rewrites is a new file (atomic
rename) or one no commit covered yet: `forget` drops its map before the next read.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import CHECKSUM_BYTES, EMPTY_INNER, Codec, checksum
from ..io.store import ChunkStore


class _Shard:
    """One mapped shard file: its inner chunks' spans (``-1``: stored empty) and which of them
    passed their checksum."""

    def __init__(self, data: mmap.mmap, spans: list[tuple[int, int]]):
        self.data, self.spans = data, spans
        self.verified = [False] * len(spans)

    def check(self, inner: int) -> None:
        """Check inner chunk ``inner``'s checksum, once. Raises ValueError."""
        offset, nbytes = self.spans[inner]
        blob = self.data[offset:offset + nbytes]
        if checksum(blob[:-CHECKSUM_BYTES]) != blob[-CHECKSUM_BYTES:]:
            raise ValueError(f"inner chunk {inner}: checksum mismatch")
        self.verified[inner] = True


class ShardMaps:
    """The shard files of a store's row-read fields, mapped; see the module docstring."""

    def __init__(self, store: ChunkStore, chunk_key: Callable[[str, int, int], str], chunk_rows: int,
                 codecs: dict[str, Codec], inner_bytes: dict[str, int], budget: int):
        """``chunk_key(field, lane, chunk)`` names a chunk's file in ``store``; ``codecs`` and
        ``inner_bytes`` (decoded bytes of one inner chunk): of each sharded field; ``budget``:
        shard files held mapped at most."""
        self.store, self.chunk_key, self.chunk_rows = store, chunk_key, chunk_rows
        self.codecs, self.inner_bytes = codecs, inner_bytes
        self.budget = max(budget, 1)
        self.open: OrderedDict[tuple[str, int, int], _Shard] = OrderedDict()

    def bodies(self, name: str, lanes: np.ndarray, chunks: np.ndarray, inners: np.ndarray) -> list[bytes | None]:
        """The checked bodies of inner chunks ``inners[i]`` of chunks ``(lanes[i], chunks[i])``
        of field ``name`` (None: stored empty), copied out of the maps.

        Raises:
            CorruptBufferError: a shard file is missing, its index or a span is bad, or an inner
                chunk fails its checksum; the message names the chunk.
        """
        out: list[bytes | None] = []
        held = self.open
        for lane, chunk, inner in zip(lanes.tolist(), chunks.tolist(), inners.tolist()):
            key = (name, lane, chunk)
            shard = held.get(key)
            if shard is None:
                shard = self._shard(name, lane, chunk)
            else:
                held.move_to_end(key)
            offset, nbytes = shard.spans[inner]
            if offset < 0:
                out.append(None)
                continue
            if not shard.verified[inner]:
                try:
                    shard.check(inner)
                except ValueError as exc:
                    raise self._corrupt(name, lane, chunk, exc) from None
            out.append(shard.data[offset:offset + nbytes - CHECKSUM_BYTES])
        return out

    def _shard(self, name: str, lane: int, chunk: int) -> _Shard:
        """A chunk's shard file mapped, the least recently used maps closed past the budget."""
        while len(self.open) >= self.budget:
            self.open.popitem(last=False)[1].data.close()
        shard = self.open[(name, lane, chunk)] = self._map(name, lane, chunk)
        return shard

    def _map(self, name: str, lane: int, chunk: int) -> _Shard:
        key = self.chunk_key(name, lane, chunk)
        head = self.codecs[name].index_bytes(self.chunk_rows)
        try:
            with open(self.store.path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < head:
                    raise self._corrupt(name, lane, chunk, f"{size} bytes: too short to hold an index "
                                                           f"of {head} bytes")
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise CorruptBufferError(f"{self.store.url!r}: chunk {key!r} is missing, "
                                     f"but the last commit says it holds rows") from None
        try:
            return _Shard(data, self._spans(name, data, head))
        except ValueError as exc:
            data.close()
            raise self._corrupt(name, lane, chunk, exc) from None

    def _spans(self, name: str, data: mmap.mmap, head: int) -> list[tuple[int, int]]:
        """Every inner chunk's ``(offset, nbytes)`` from the index, checked. Raises ValueError."""
        size = len(data)
        index = np.frombuffer(Codec.verified_body(data[:head]), dtype="<u8").reshape(-1, 2)
        empty = (index == EMPTY_INNER).all(axis=1)
        offset, nbytes = index[:, 0].astype(np.int64), index[:, 1].astype(np.int64)
        limit = 2 * self.inner_bytes[name] + 1024  # what any codec needs for incompressible rows, and more
        bad = ~empty & ((index[:, 0] < head) | (index[:, 1] <= CHECKSUM_BYTES) | (index[:, 1] > limit)
                        | (index[:, 0] > size - np.minimum(index[:, 1], size)))
        if bad.any():
            inner = int(np.flatnonzero(bad)[0])
            raise ValueError(f"inner chunk {inner}: span ({index[inner, 0]}, {index[inner, 1]}) "
                             f"outside the shard's data ({size} bytes)")
        offset[empty] = -1
        return list(zip(offset.tolist(), nbytes.tolist()))

    def _corrupt(self, name: str, lane: int, chunk: int, why: object) -> CorruptBufferError:
        key = self.chunk_key(name, lane, chunk)
        return CorruptBufferError(f"{self.store.url!r}: chunk {key!r} does not decode ({why})")

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten: map them again at their next read."""
        chunks = np.asarray(chunks).tolist()
        if len(chunks) * len(self.codecs) > len(self.open):
            gone = set(chunks)
            keys = [key for key in self.open if key[1] == lane and key[2] in gone]
        else:
            keys = [key for c in chunks for name in self.codecs if (key := (name, lane, c)) in self.open]
        for key in keys:
            self.open.pop(key).data.close()

    def close(self) -> None:
        while self.open:
            self.open.popitem()[1].data.close()
