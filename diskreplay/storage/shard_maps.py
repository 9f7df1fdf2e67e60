"""Sharded chunk files of a local store, memory-mapped, their indexes checked once.

A compressed image field is stored as Zarr shards (`diskreplay.format.codecs.Codec.inner_rows`):
an index of ``(offset, nbytes)`` pairs, then inner chunks of a few rows, each with its CRC32C.
A reader missing its cache reads single inner chunks. `ShardMaps` maps each shard file the
first time a read needs it and takes its index from the reader's shard index tables where they
have it, else from the file; every span is checked to lie inside the file and be no longer than
an inner chunk may take. The spans of every mapped shard's inner chunks go into one table per
field (`_Spans`), so a batch finds its frames with a few array lookups. An inner chunk's
checksum is checked the first time it is read, by the thread that decodes it; one that fails
where a table gave the index has its shard's own index read (a live writer may have rewritten
the shard since the table's commit). LZ4 frames of bytes are then decoded straight from the map
into the batch (`Codec.direct_blocks`); others are copied out of the map and decoded by their
codec.

Cold reads go in flight together: a page fault reads one page (``MADV_RANDOM``), and a batch
asks the OS for all the pages it will read first (``MADV_WILLNEED``: the indexes it needs, then
the inner chunks of every field, `ask`), where a page fault at a time would wait for each read
in turn. Files in the page cache when mapped are not asked for (asking costs a system call per
inner chunk).

Maps are file-backed pages: the page cache, shared and reclaimable, never private memory. Each
costs one of the process's ``vm.max_map_count`` maps, so at most `budget` are held; past that
the least recently used are closed, never one the batch being decoded reads. Which slot holds a
chunk's map is one table lookup per field for a whole batch (`_Spans.slot_at`). A shard file the
writer rewrites is a new file (atomic rename) or one no commit covered yet: `forget` drops its
map (and its table's index) before the next read.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import CHECKSUM_BYTES, EMPTY_INNER, LZ4_BLOCKS, Codec
from ..format.lz4_blocks import LZ4_HEAD, LZ4Frames, first_bad_checksum
from ..io.local import open_for_reading
from ..io.mmap import resident, will_need
from ..io.store import ChunkStore
from ..io.threads import Threads
from .shard_tables import TabledIndexes

PART_FRAMES = 64
"""Frames a decoding thread takes at least: fewer cost more to hand over than they save."""


def _bad_spans(inner_bytes: int, index: np.ndarray, head: int, sizes: np.ndarray) -> np.ndarray:
    """Of shards' indexes ``[shards, inner, 2]`` in files of ``sizes`` bytes, which inner chunks'
    spans are bad: outside the file's data, or longer than an inner chunk of ``inner_bytes``
    decoded bytes may take."""
    empty = (index == EMPTY_INNER).all(axis=2)
    limit = 2 * inner_bytes + 1024  # what any codec needs for incompressible rows, and more
    offset, nbytes, size = index[..., 0], index[..., 1], sizes.astype(np.uint64)[:, None]
    bad: np.ndarray = ~empty & ((offset < head) | (nbytes <= CHECKSUM_BYTES) | (nbytes > limit)
                                | (offset > size - np.minimum(nbytes, size)))
    return bad


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
    `Codec.direct_blocks`), whether its checksum passed; each slot's map, address, last use,
    whether its index is a table's and whether its file was in the page cache when mapped; and
    which slot maps each chunk (``slot_at[lane, chunk]``, -1: none)."""

    def __init__(self, inners: int):
        self.offset = np.empty((0, inners), np.int64)
        self.nbytes = np.empty((0, inners), np.int64)
        self.block = np.empty((0, inners), np.int64)
        self.verified = np.empty((0, inners), bool)
        self.tabled = np.empty(0, bool)
        self.resident = np.empty(0, bool)
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
            for name in ("offset", "nbytes", "block", "verified", "tabled", "resident", "address", "used", "holding"):
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
                 codecs: dict[str, Codec], inner_bytes: dict[str, int], budget: int, threads: int,
                 tabled: TabledIndexes):
        """``chunk_key(field, lane, chunk)`` names a chunk's file in ``store``; ``codecs`` and
        ``inner_bytes`` (decoded bytes of one inner chunk): of each sharded field; ``budget``:
        shard files held mapped at most; ``threads``: decoding a batch's frames side by side;
        ``tabled``: shard indexes known without reading them from their files (a reader's
        tables; a writer's has none)."""
        self.store, self.chunk_key, self.chunk_rows, self.tabled = store, chunk_key, chunk_rows, tabled
        self.codecs, self.inner_bytes, self.threads = codecs, inner_bytes, threads
        self.budget = max(budget, 1)
        self.workers = Threads(threads - 1, "diskreplay-decode")
        self.maps = 0  # shard files held mapped, over all fields
        self.uses = 0  # decode calls so far: the last one that read a slot is its `_Spans.used`
        self.spans = {name: _Spans(chunk_rows // int(codec.inner_rows or 1)) for name, codec in codecs.items()}
        self.asked: set[str] = set()  # fields whose next decode was asked for (`ask`)

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
            return self._decode_checked(name, slots, inners, lanes, chunks, out, rows)
        _, which = np.unique(lanes.astype(np.int64) << 32 | chunks, return_inverse=True)
        for lo in range(0, int(which.max()) + 1, self.budget):  # a group's maps stay open while it decodes
            part = np.flatnonzero((which >= lo) & (which < lo + self.budget))
            slots = self._held(name, lanes[part], chunks[part])
            self._decode_checked(name, slots, inners[part], lanes[part], chunks[part], out, rows[part])
        return None

    def _decode_checked(self, name: str, slots: np.ndarray, inners: np.ndarray, lanes: np.ndarray,
                        chunks: np.ndarray, out: np.ndarray, rows: np.ndarray) -> None:
        """`_decode_held`; where it finds damage in a shard whose index a table gave, those
        shards' own indexes are read and the frames decoded again: a live writer may have
        rewritten a shard since the table's commit (the rows that commit covers are the same)."""
        try:
            self._decode_held(name, slots, inners, lanes, chunks, out, rows)
        except CorruptBufferError:
            spans = self.spans[name]
            tabled = np.unique(slots[spans.tabled[slots]])
            if not len(tabled):
                raise
            for slot in tabled.tolist():
                shard = spans.shards[slot]
                assert shard is not None
                index = self._file_index(name, shard.lane, shard.chunk, shard.data)
                self._set_spans(name, np.array([slot]), index[None], [shard])
            self._decode_held(name, slots, inners, lanes, chunks, out, rows)

    def _decode_held(self, name: str, slots: np.ndarray, inners: np.ndarray, lanes: np.ndarray, chunks: np.ndarray,
                     out: np.ndarray, rows: np.ndarray) -> None:
        spans, asked = self.spans[name], name in self.asked
        self.asked.discard(name)
        at = slots.astype(np.int64) * spans.offset.shape[1] + inners  # in the tables, raveled
        block, nbytes, verified = (table.ravel().take(at) for table in (spans.block, spans.nbytes, spans.verified))
        flat = out.reshape(len(out), -1).view(np.uint8)
        if block.min() >= 0:  # every one an LZ4 block (frames of bytes): none stored empty, none left to blosc
            frames = LZ4Frames(spans.address[slots] + block, nbytes - LZ4_HEAD, flat, rows, ~verified)
            return self._decode_blocks(name, frames, slots, inners, lanes, chunks)
        offset = spans.offset.ravel().take(at)
        stored = offset >= 0
        unchecked = stored & ~verified
        if not asked:
            self._will_need(name, slots, inners)
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

    def ask(self, name: str, lanes: np.ndarray, chunks: np.ndarray, inners: np.ndarray) -> None:
        """Map the shard files of chunks ``(lanes[i], chunks[i])`` and ask the OS for the pages of
        their inner chunks ``inners[i]`` not read yet, without waiting: a batch asks for every
        field's before it decodes the first, so that their reads are in flight together (the
        next `decode` of ``name`` does not ask again). Nothing past the budget of maps."""
        if len(np.unique(lanes.astype(np.int64) << 32 | chunks)) <= self.budget:
            self._will_need(name, self._held(name, lanes, chunks), inners)
            self.asked.add(name)

    def _will_need(self, name: str, slots: np.ndarray, inners: np.ndarray) -> None:
        """Ask the OS for these inner chunks of held shards, all at once, where they are read for
        the first time from a file that was not in the page cache when mapped (LZ4 shards were
        asked for whole)."""
        spans = self.spans[name]
        offset, nbytes = spans.offset[slots, inners], spans.nbytes[slots, inners]
        cold = np.flatnonzero((offset >= 0) & ~spans.verified[slots, inners] & ~spans.resident[slots])
        will_need(spans.address[slots[cold]] + offset[cold], nbytes[cold] + CHECKSUM_BYTES)

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
        if len(first):
            self._make_room(len(first))
            self._map_all(name, lanes[missing[first]], chunks[missing[first]])
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

    def _map_all(self, name: str, lanes: np.ndarray, chunks: np.ndarray) -> None:
        """Map the shard files of these chunks (none held yet) and hold them, their indexes
        checked: a table's where it has the shard and the span fits the file, else the file's.
        Every file is opened and every index read from a file asked of the OS before the first
        is read. Raises CorruptBufferError naming a chunk whose file is missing or bad."""
        head = self.codecs[name].index_bytes(self.chunk_rows)
        known, tabled = self.tabled.lookup(name, lanes, chunks)
        maps: list[mmap.mmap] = []
        try:
            for lane, chunk, needed in zip(lanes.tolist(), chunks.tolist(), (~known).tolist()):
                maps.append(self._open(name, lane, chunk, head, needed))
            index = np.zeros((len(maps), self.spans[name].offset.shape[1], 2), "<u8")
            if known.any():
                index[known] = tabled
            sizes = np.array([len(data) for data in maps], np.int64)
            # where the table has none, or a span of its that does not fit the file: the file's index
            from_file = ~known | _bad_spans(self.inner_bytes[name], index, head, sizes).any(axis=1)
            for k in np.flatnonzero(from_file).tolist():
                index[k] = self._file_index(name, int(lanes[k]), int(chunks[k]), maps[k])
        except BaseException:
            for data in maps:
                data.close()
            raise
        self._hold_all(name, lanes, chunks, maps, index, ~from_file)

    def _open(self, name: str, lane: int, chunk: int, head: int, index_needed: bool) -> mmap.mmap:
        """Chunk ``(lane, chunk)``'s shard file mapped, its pages read one at a time as touched,
        its index (``head`` bytes) asked of the OS if ``index_needed``. Raises
        CorruptBufferError if it is missing or too short."""
        key = self.chunk_key(name, lane, chunk)
        try:
            fd = open_for_reading(self.store.path(key))
        except FileNotFoundError:
            raise CorruptBufferError(f"{self.store.url!r}: chunk {key!r} is missing, "
                                     f"but the last commit says it holds rows") from None
        try:
            size = os.fstat(fd).st_size
            if size < head:
                raise self._corrupt(name, lane, chunk, f"{size} bytes: too short to hold an index of {head} bytes")
            data = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        data.madvise(mmap.MADV_RANDOM)
        if self.codecs[name].compression in LZ4_BLOCKS:  # `direct_blocks` reads every body's head
            data.madvise(mmap.MADV_WILLNEED)
        elif index_needed:
            data.madvise(mmap.MADV_WILLNEED, 0, head)
        return data

    def _file_index(self, name: str, lane: int, chunk: int, data: mmap.mmap) -> np.ndarray:
        """The index a shard file holds (``[inner, 2]`` uint64), checked: its checksum, and every
        span inside the file. Raises CorruptBufferError."""
        head = self.codecs[name].index_bytes(self.chunk_rows)
        try:
            index = np.frombuffer(Codec.verified_body(data[:head]), dtype="<u8").reshape(-1, 2)
        except ValueError as exc:
            raise self._corrupt(name, lane, chunk, exc) from None
        bad = _bad_spans(self.inner_bytes[name], index[None], head, np.array([len(data)]))[0]
        if bad.any():
            inner = int(np.argmax(bad))
            raise self._corrupt(name, lane, chunk, f"inner chunk {inner}: span ({index[inner, 0]}, "
                                                   f"{index[inner, 1]}) outside the shard's data ({len(data)} bytes)")
        return index

    def _hold_all(self, name: str, lanes: np.ndarray, chunks: np.ndarray, maps: list[mmap.mmap],
                  index: np.ndarray, tabled: np.ndarray) -> None:
        """Hold the mapped shards, their spans from their checked indexes (``tabled``: a table's)."""
        spans = self.spans[name]
        slots = np.array([spans.take() for _ in maps], np.int64)
        shards = [_Shard(data, slot, lane, chunk)
                  for data, slot, lane, chunk in zip(maps, slots.tolist(), lanes.tolist(), chunks.tolist())]
        for shard in shards:
            spans.hold(shard)
        spans.used[slots] = self.uses
        self.maps += len(maps)
        self._set_spans(name, slots, index, shards)
        spans.tabled[slots] = tabled
        spans.resident[slots] = [resident(shard.address, len(shard.data)) for shard in shards]

    def _set_spans(self, name: str, slots: np.ndarray, index: np.ndarray, shards: list[_Shard]) -> None:
        """The spans of the shards held at ``slots`` from their checked indexes ``[shards, inner, 2]``,
        none verified yet (none from a table)."""
        spans = self.spans[name]
        empty = (index == EMPTY_INNER).all(axis=2)
        spans.offset[slots] = np.where(empty, -1, index[..., 0].astype(np.int64))
        spans.nbytes[slots] = index[..., 1].astype(np.int64) - CHECKSUM_BYTES
        spans.verified[slots], spans.block[slots], spans.tabled[slots] = False, -1, False
        if self.codecs[name].compression in LZ4_BLOCKS:
            for shard in shards:
                offset, nbytes = spans.offset[shard.slot], spans.nbytes[shard.slot]
                stored = offset >= 0
                assert shard.view is not None
                spans.block[shard.slot, stored] = self.codecs[name].direct_blocks(
                    shard.view, offset[stored], nbytes[stored], self.inner_bytes[name])

    def _corrupt(self, name: str, lane: int, chunk: int, why: object) -> CorruptBufferError:
        key = self.chunk_key(name, lane, chunk)
        return CorruptBufferError(f"{self.store.url!r}: chunk {key!r} does not decode ({why})")

    def _close(self, name: str, slot: int) -> None:
        self.spans[name].release(slot).close()
        self.maps -= 1

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten: map them again at their next read."""
        chunks = np.asarray(chunks, dtype=np.int64)
        self.tabled.forget(lane, chunks)
        for name, spans in self.spans.items():
            slots = spans.slots(np.full(len(chunks), lane), chunks)
            for slot in np.unique(slots[slots >= 0]).tolist():
                self._close(name, slot)

    def close(self) -> None:
        for name, spans in self.spans.items():
            for slot in spans.held().tolist():
                self._close(name, slot)
        self.workers.shutdown()
