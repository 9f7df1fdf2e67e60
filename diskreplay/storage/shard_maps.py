"""Sharded chunk files of a local store, memory-mapped with their index read and checked once.

A compressed image field is stored as Zarr shards (`diskreplay.format.codecs.Codec.inner_rows`):
an index of ``(offset, nbytes)`` pairs, then inner chunks of a few rows, each with its CRC32C.
A reader missing its cache reads single inner chunks. `ShardMaps` maps each shard file the
first time a read needs it and checks its whole index at once (checksum, every span inside the
file and no longer than an inner chunk may take); the spans of every mapped shard's inner chunks
go into one table per field (`_Spans`), so a batch finds its frames with a few array lookups.
An inner chunk's checksum is checked the first time it is read, by the thread that decodes it.
LZ4 frames of bytes are then decoded straight from the map into the batch
(`Codec.direct_blocks`); others are copied out of the map and decoded by their codec.

Maps are file-backed pages: the page cache, shared and reclaimable, never private memory. Each
costs one of the process's ``vm.max_map_count`` maps, so at most `budget` are held; past that
the least recently used are closed, never one the batch being decoded reads. Which slot holds a
chunk's map is one table lookup per field for a whole batch (`_Spans.slot_at`). A shard file the
writer rewrites is a new file (atomic rename) or one no commit covered yet: `forget` drops its
map before the next read.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import CHECKSUM_BYTES, EMPTY_INNER, Codec
from ..format.lz4_blocks import LZ4_HEAD, LZ4Frames, first_bad_checksum
from ..io.local import open_for_reading
from ..io.store import ChunkStore
from ..io.threads import Threads

PART_FRAMES = 64
"""Frames a decoding thread takes at least: fewer cost more to hand over than they save."""


class _Shard:
    """One mapped shard file, of chunk ``(lane, chunk)``, and its row (``slot``) in its field's `_Spans`."""

    def __init__(self, data: mmap.mmap, slot: int, lane: int, chunk: int):
        self.data, self.slot, self.lane, self.chunk = data, slot, lane, chunk
        self.view: np.ndarray | None = np.frombuffer(data, np.uint8)
        self.address = int(self.view.ctypes.data)

    def close(self) -> None:
        self.view = None  # a map cannot close while an array holds it
        self.data.close()


class _Spans:
    """The inner chunks of one field's mapped shards, a row per slot: each body's offset in its
    file (-1: stored empty) and bytes (checksum cut off), its LZ4 block's offset (-1: none, see
    `Codec.direct_blocks`), whether its checksum passed; each slot's map, address and last use;
    and which slot maps each chunk (``slot_at[lane, chunk]``, -1: none)."""

    def __init__(self, inners: int):
        self.offset = np.empty((0, inners), np.int64)
        self.nbytes = np.empty((0, inners), np.int64)
        self.block = np.empty((0, inners), np.int64)
        self.verified = np.empty((0, inners), bool)
        self.address = np.empty(0, np.int64)
        self.used = np.empty(0, np.int64)
        self.holding = np.empty(0, bool)
        self.shards: list[_Shard | None] = []
        self.free: list[int] = []
        self.slot_at = np.full((0, 0), -1, np.int32)

    def slots(self, lanes: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """The slot mapping each chunk ``(lanes[i], chunks[i])``, -1 where none does."""
        rows, cols = self.slot_at.shape
        inside = (lanes < rows) & (chunks < cols)
        if inside.all():
            found: np.ndarray = self.slot_at[lanes, chunks]
            return found
        slots = np.full(len(lanes), -1, np.int64)
        slots[inside] = self.slot_at[lanes[inside], chunks[inside]]
        return slots

    def hold(self, shard: _Shard) -> None:
        rows, cols = self.slot_at.shape
        if shard.lane >= rows or shard.chunk >= cols:
            grown = np.full((max(rows, shard.lane + 1), max(2 * cols, shard.chunk + 1, 64)), -1, np.int32)
            grown[:rows, :cols] = self.slot_at
            self.slot_at = grown
        self.slot_at[shard.lane, shard.chunk] = shard.slot
        self.shards[shard.slot], self.address[shard.slot], self.holding[shard.slot] = shard, shard.address, True

    def take(self) -> int:
        """A free slot, the tables grown when none is left."""
        if not self.free:
            size, grown = len(self.address), max(2 * len(self.address), 8)
            for name in ("offset", "nbytes", "block", "verified", "address", "used", "holding"):
                old = getattr(self, name)
                new = np.zeros((grown, *old.shape[1:]), old.dtype)
                new[:size] = old
                setattr(self, name, new)
            self.shards += [None] * (grown - size)
            self.free = list(range(grown - 1, size - 1, -1))
        return self.free.pop()

    def map(self, slot: int) -> mmap.mmap:
        shard = self.shards[slot]
        assert shard is not None, f"slot {slot} holds no map"
        return shard.data

    def release(self, slot: int) -> _Shard:
        """Give a slot back; returns the shard it held (to close)."""
        shard = self.shards[slot]
        assert shard is not None, f"slot {slot} holds no map"
        self.slot_at[shard.lane, shard.chunk] = -1
        self.shards[slot], self.holding[slot] = None, False
        self.free.append(slot)
        return shard

    def held(self) -> np.ndarray:
        """The slots holding a map."""
        return np.flatnonzero(self.holding)


class ShardMaps:
    """The shard files of a store's row-read fields, mapped; see the module docstring."""

    def __init__(self, store: ChunkStore, chunk_key: Callable[[str, int, int], str], chunk_rows: int,
                 codecs: dict[str, Codec], inner_bytes: dict[str, int], budget: int, threads: int = 1):
        """``chunk_key(field, lane, chunk)`` names a chunk's file in ``store``; ``codecs`` and
        ``inner_bytes`` (decoded bytes of one inner chunk): of each sharded field; ``budget``:
        shard files held mapped at most; ``threads``: decoding a batch's frames side by side."""
        self.store, self.chunk_key, self.chunk_rows = store, chunk_key, chunk_rows
        self.codecs, self.inner_bytes, self.threads = codecs, inner_bytes, threads
        self.budget = max(budget, 1)
        self.workers = Threads(threads - 1, "diskreplay-decode")
        self.maps = 0  # shard files held mapped, over all fields
        self.uses = 0  # decode calls so far: the last one that read a slot is its `_Spans.used`
        self.spans = {name: _Spans(chunk_rows // int(codec.inner_rows or 1)) for name, codec in codecs.items()}

    def decode(self, name: str, lanes: np.ndarray, chunks: np.ndarray, inners: np.ndarray, out: np.ndarray,
               rows: np.ndarray) -> None:
        """Decode inner chunks ``inners[i]`` of chunks ``(lanes[i], chunks[i])`` of field ``name``
        into ``out[rows[i]]`` (C-contiguous; one inner chunk's rows each; stored empty: zeros).

        Raises:
            CorruptBufferError: a shard file is missing, its index or a span is bad, or an inner
                chunk fails its checksum or does not decode; the message names the chunk.
        """
        spans = self.spans[name]
        slots = spans.slots(lanes, chunks)
        if (slots >= 0).all():
            self.uses += 1
            spans.used[slots] = self.uses
            return self._decode_held(name, slots, inners, lanes, chunks, out, rows)
        _, which = np.unique(lanes.astype(np.int64) << 32 | chunks, return_inverse=True)
        for lo in range(0, int(which.max()) + 1, self.budget):  # a group's maps stay open while it decodes
            part = np.flatnonzero((which >= lo) & (which < lo + self.budget))
            slots = self._held(name, lanes[part], chunks[part])
            self._decode_held(name, slots, inners[part], lanes[part], chunks[part], out, rows[part])
        return None

    def _decode_held(self, name: str, slots: np.ndarray, inners: np.ndarray, lanes: np.ndarray, chunks: np.ndarray,
                     out: np.ndarray, rows: np.ndarray) -> None:
        spans = self.spans[name]
        at = slots.astype(np.int64) * spans.offset.shape[1] + inners  # in the tables, raveled
        block, nbytes, verified = (table.ravel().take(at) for table in (spans.block, spans.nbytes, spans.verified))
        flat = out.reshape(len(out), -1).view(np.uint8)
        if block.min() >= 0:  # every one an LZ4 block (frames of bytes): none stored empty, none left to blosc
            frames = LZ4Frames(spans.address[slots] + block, nbytes - LZ4_HEAD, flat, rows, ~verified)
            return self._decode_blocks(name, frames, slots, inners, lanes, chunks)
        offset = spans.offset.ravel().take(at)
        stored = offset >= 0
        unchecked = stored & ~verified
        flat[rows[~stored]] = 0
        direct = np.flatnonzero(block >= 0)
        if len(direct):
            frames = LZ4Frames(spans.address[slots[direct]] + block[direct], nbytes[direct] - LZ4_HEAD, flat,
                               rows[direct], unchecked[direct])
            self._decode_blocks(name, frames, slots[direct], inners[direct], lanes[direct], chunks[direct])
        rest = np.flatnonzero(stored & (block < 0)) if len(direct) < len(block) else direct[:0]
        if len(rest):
            bodies = [spans.map(slot)[a:a + n] for slot, a, n in
                      zip(slots[rest].tolist(), offset[rest].tolist(), nbytes[rest].tolist())]
            codec = self.codecs[name]

            def decode_rest(s: slice) -> None:  # each part checks the frames it decodes, side by side
                frames = rest[s][unchecked[rest[s]]]
                if len(frames):
                    self._verify(name, slots[frames], inners[frames], lanes[frames], chunks[frames])
                codec.decode_bodies(bodies[s], out, rows[rest][s])
            self._named(name, lanes[rest], chunks[rest], decode_rest)

    def _decode_blocks(self, name: str, frames: LZ4Frames, slots: np.ndarray, inners: np.ndarray,
                       lanes: np.ndarray, chunks: np.ndarray) -> None:
        """Check and decode the LZ4 blocks of these inner chunks, the threads taking them a few
        at a time; mark the checked ones verified. Raises CorruptBufferError naming a chunk
        whose block fails."""
        self._together(len(frames), lambda _: frames.decode())
        if frames.failure is not None:
            i = frames.failure.block
            if frames.failure.bad_checksum:  # named with both checksums
                self._verify(name, slots[i:i + 1], inners[i:i + 1], lanes[i:i + 1], chunks[i:i + 1])
            raise self._corrupt(name, int(lanes[i]), int(chunks[i]), frames.failure.why)
        self.spans[name].verified[slots, inners] = True  # each passed its check now, or before

    def _named(self, name: str, lanes: np.ndarray, chunks: np.ndarray, decode: Callable[[slice], None]) -> None:
        """``decode(slice(lo, hi))`` decodes frames lo..hi-1: all of them in `_side_by_side` parts;
        when one does not decode, it is found and named."""
        try:
            self._side_by_side(len(lanes), decode)
        except ValueError:
            for i in range(len(lanes)):
                try:
                    decode(slice(i, i + 1))
                except ValueError as exc:
                    raise self._corrupt(name, int(lanes[i]), int(chunks[i]), exc) from None
            raise

    def _side_by_side(self, count: int, decode: Callable[[slice], None]) -> None:
        """``decode`` over ``count`` frames in up to ``threads`` parts of at least `PART_FRAMES`,
        run side by side (the codecs release the GIL); returns once every part has."""
        parts = max(self._runners(count), 1)
        cuts = [count * k // parts for k in range(parts + 1)]
        self._together(count, lambda k: decode(slice(cuts[k], cuts[k + 1])))

    def _together(self, count: int, work: Callable[[int], object]) -> None:
        """``work(0)`` on this thread and, at the same time, ``work(k)`` on decode threads, ``k``
        from 1 to `_runners` - 1; returns once every call has, raising the first error one raised."""
        helpers = [self.workers.submit(work, k) for k in range(1, self._runners(count))]
        try:
            work(0)
        finally:
            failed = [error for helper in helpers if (error := helper.exception()) is not None]  # waits for each
        if failed:
            raise failed[0]

    def _runners(self, count: int) -> int:
        """Threads that decode ``count`` frames: one per `PART_FRAMES`, up to ``threads``."""
        return min(self.threads, count // PART_FRAMES)

    def _verify(self, name: str, slots: np.ndarray, inners: np.ndarray, lanes: np.ndarray, chunks: np.ndarray) -> None:
        """Check these inner chunks' checksums, once. Raises CorruptBufferError naming the first
        that fails."""
        spans = self.spans[name]
        offset, nbytes = spans.offset[slots, inners], spans.nbytes[slots, inners]
        bad = first_bad_checksum(spans.address[slots] + offset, nbytes)
        if bad >= 0:
            at, size = int(offset[bad]), int(nbytes[bad])
            why = f"inner chunk {inners[bad]}: checksum mismatch"
            try:
                Codec.verified_body(spans.map(int(slots[bad]))[at:at + size + CHECKSUM_BYTES])
            except ValueError as exc:
                why = f"inner chunk {inners[bad]}: {exc}"  # with the stored and computed checksums
            raise self._corrupt(name, int(lanes[bad]), int(chunks[bad]), why)
        spans.verified[slots, inners] = True

    def _held(self, name: str, lanes: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """The slot of each chunk's shard file, mapped (at most `budget` distinct chunks): the
        least recently used maps of any field are closed first, past the budget."""
        spans = self.spans[name]
        self.uses += 1
        slots = spans.slots(lanes, chunks)
        spans.used[slots[slots >= 0]] = self.uses
        missing = np.flatnonzero(slots < 0)
        _, first = np.unique(lanes[missing].astype(np.int64) << 32 | chunks[missing], return_index=True)
        self._make_room(len(first))
        for i in missing[first].tolist():
            shard = self._map(name, int(lanes[i]), int(chunks[i]))
            spans.used[shard.slot] = self.uses
            self.maps += 1
        slots[missing] = spans.slots(lanes[missing], chunks[missing])
        return slots

    def _make_room(self, count: int) -> None:
        """Close the least recently used maps until ``count`` more fit the budget."""
        over = self.maps + count - self.budget
        if over <= 0:
            return
        held = {name: spans.held() for name, spans in self.spans.items()}
        names = np.concatenate([np.full(len(slots), i) for i, slots in enumerate(held.values())])
        slots = np.concatenate(list(held.values()))
        used = np.concatenate([spans.used[held[name]] for name, spans in self.spans.items()])
        oldest = np.argpartition(used, over - 1)[:over] if over < len(used) else np.arange(len(used))
        fields = list(held)
        for i in oldest.tolist():
            self._close(fields[int(names[i])], int(slots[i]))

    def _map(self, name: str, lane: int, chunk: int) -> _Shard:
        key = self.chunk_key(name, lane, chunk)
        head = self.codecs[name].index_bytes(self.chunk_rows)
        try:
            with os.fdopen(open_for_reading(self.store.path(key)), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < head:
                    raise self._corrupt(name, lane, chunk, f"{size} bytes: too short to hold an index "
                                                           f"of {head} bytes")
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise CorruptBufferError(f"{self.store.url!r}: chunk {key!r} is missing, "
                                     f"but the last commit says it holds rows") from None
        try:
            offset, nbytes = self._spans(name, data, head)
        except ValueError as exc:
            data.close()
            raise self._corrupt(name, lane, chunk, exc) from None
        spans = self.spans[name]
        shard = _Shard(data, spans.take(), lane, chunk)
        assert shard.view is not None
        slot, stored = shard.slot, offset >= 0
        spans.hold(shard)
        spans.offset[slot], spans.nbytes[slot], spans.verified[slot] = offset, nbytes, False
        blocks = self.codecs[name].direct_blocks(shard.view, offset[stored], nbytes[stored], self.inner_bytes[name])
        spans.block[slot] = -1
        spans.block[slot, stored] = blocks
        return shard

    def _spans(self, name: str, data: mmap.mmap, head: int) -> tuple[np.ndarray, np.ndarray]:
        """Every inner chunk's offset (-1: stored empty) and bytes without its checksum, from the
        index, checked. Raises ValueError."""
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
        return offset, nbytes - CHECKSUM_BYTES

    def _corrupt(self, name: str, lane: int, chunk: int, why: object) -> CorruptBufferError:
        key = self.chunk_key(name, lane, chunk)
        return CorruptBufferError(f"{self.store.url!r}: chunk {key!r} does not decode ({why})")

    def _close(self, name: str, slot: int) -> None:
        self.spans[name].release(slot).close()
        self.maps -= 1

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten: map them again at their next read."""
        chunks = np.asarray(chunks, dtype=np.int64)
        for name, spans in self.spans.items():
            slots = spans.slots(np.full(len(chunks), lane), chunks)
            for slot in np.unique(slots[slots >= 0]).tolist():
                self._close(name, slot)

    def close(self) -> None:
        for name, spans in self.spans.items():
            for slot in spans.held().tolist():
                self._close(name, slot)
        self.workers.shutdown()
