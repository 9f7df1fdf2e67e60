"""The chunk cache: decoded chunks in a preallocated slab, found by array arithmetic.

Each field owns one slab of ``slots * chunk_rows`` rows. A (lane, chunk) pair is resident in at
most one slot, the same slot for every field; a table gives the slot of each (lane, chunk) (or
-1). A batch of steps therefore maps to slab rows with one table lookup and one multiply-add, and
each field is gathered with a single ``take`` however many chunks the batch touches.

Slots are recycled least-recently-used. Pinned slots (chunks being written, or being filled) are
never evicted.

Fields read row by row (``row_fields``: sharded images) have room in the first ``full_slots``
slots only; a *partial* slot holds the other fields of its chunk only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import overload

import numpy as np

from ..format.schema import Schema


class ChunkCache:
    """Slabs of chunk slots per field, a ``(lane, chunk) -> slot`` table and LRU bookkeeping."""

    MAX_SLOTS = 1 << 16
    """Bookkeeping and LRU choice cost O(slots) per miss; past this many slots (tiny chunks and a
    big budget) the cache costs more than it saves."""

    def __init__(self, schema: Schema, num_envs: int, chunk_rows: int, slots: int, chunks_per_lane: int,
                 full_slots: int | None = None, row_fields: tuple[str, ...] = ()):
        self.chunk_rows = chunk_rows
        self.slots = slots
        self.full_slots = slots if full_slots is None else full_slots
        self.row_fields = row_fields
        """Fields read row by row: only the first ``full_slots`` slots have room for them."""
        self.slabs = {name: np.zeros(((self.full_slots if name in row_fields else slots) * chunk_rows, *f.shape),
                                     dtype=f.dtype)
                      for name, f in schema.items()}
        self._table = np.full((num_envs, max(chunks_per_lane, 1)), -1, dtype=np.int64)
        self._owner_lane = np.full(slots, -1, dtype=np.int64)
        self._owner_chunk = np.full(slots, -1, dtype=np.int64)
        self._last_used = np.zeros(slots, dtype=np.int64)
        self._pinned = np.zeros(slots, dtype=bool)
        self._partial = np.arange(slots) >= self.full_slots
        self._clock = 1

    # ---- queries ---------------------------------------------------------------------------

    @property
    def width(self) -> int:
        """Chunks per lane the table has room for."""
        return int(self._table.shape[1])

    @property
    def lanes(self) -> int:
        return int(self._table.shape[0])

    def slots_of(self, lanes: np.ndarray, chunks: np.ndarray) -> np.ndarray:
        """The slot of each (lane, chunk), -1 where not cached (chunks must be below `width`)."""
        slots: np.ndarray = self._table[0].take(chunks) if self._table.shape[0] == 1 else self._table[lanes, chunks]
        return slots

    def slot_of(self, lane: int, chunk: int) -> int:
        """The slot holding this chunk, or -1 (also for a chunk past the table)."""
        return int(self._table[lane, chunk]) if 0 <= chunk < self.width else -1

    def cached_chunks(self) -> int:
        """How many chunks the cache holds."""
        return int((self._table >= 0).sum())

    def owners(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The (lanes, chunks) held in these slots (-1: none)."""
        lanes: np.ndarray = self._owner_lane[slots]
        chunks: np.ndarray = self._owner_chunk[slots]
        return lanes, chunks

    @overload
    def is_pinned(self, slots: int) -> bool: ...
    @overload
    def is_pinned(self, slots: np.ndarray) -> np.ndarray: ...

    def is_pinned(self, slots: np.ndarray | int) -> np.ndarray | bool:
        """Whether each slot is pinned (held by the writer or a fill: never evicted)."""
        return _flags(self._pinned, slots)

    @overload
    def is_partial(self, slots: int) -> bool: ...
    @overload
    def is_partial(self, slots: np.ndarray) -> np.ndarray: ...

    def is_partial(self, slots: np.ndarray | int) -> np.ndarray | bool:
        """Whether each slot lacks room for the fields read row by row."""
        return _flags(self._partial, slots)

    def evictable(self, whole: bool = True) -> int:
        """Unpinned slots with room for every field (``whole``) or for the others."""
        eligible = self.full_slots if whole else self.slots
        return int(eligible - self._pinned[:eligible].sum())

    def free(self, slots: np.ndarray) -> bool:
        """None of these slots holds a chunk or is pinned."""
        return bool(((self._owner_lane[slots] < 0) & ~self._pinned[slots]).all())

    def chunk_rows_of(self, name: str, slot: int) -> np.ndarray:
        """The slab rows of one slot for one field (a view: writes go straight into the cache)."""
        start = slot * self.chunk_rows
        rows: np.ndarray = self.slabs[name][start:start + self.chunk_rows]
        return rows

    def rows_at(self, slots: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Slab rows of these offsets into these slots."""
        rows: np.ndarray = slots * self.chunk_rows + offsets
        return rows

    # ---- changes ---------------------------------------------------------------------------

    def ensure_chunks(self, chunks_per_lane: int) -> None:
        """Grow the table (dataset mode) so chunk indices below ``chunks_per_lane`` are valid."""
        have = self._table.shape[1]
        if chunks_per_lane > have:
            grown = np.full((self._table.shape[0], max(chunks_per_lane, 2 * have)), -1, dtype=np.int64)
            grown[:, :have] = self._table
            self._table = grown

    def touch(self, slots: np.ndarray) -> None:
        """Mark ``slots`` used, in their order: of the chunks of one read, the one whose last row
        comes first is the least recently used (a read across two shuffle windows thus frees the
        first window's chunks before the second's)."""
        self._last_used[slots] = np.arange(self._clock, self._clock + len(slots))
        self._clock += len(slots)

    def pin(self, slots: np.ndarray | int) -> None:
        self._pinned[slots] = True

    def unpin(self, slots: np.ndarray | int) -> None:
        self._pinned[slots] = False

    def mark_partial(self, slots: np.ndarray) -> None:
        """These slots were filled without the fields read row by row."""
        self._partial[slots] = True

    def assign(self, lanes: np.ndarray, chunks: np.ndarray, whole: bool = True) -> np.ndarray:
        """Give each (lane, chunk) a slot, evicting the least recently used unpinned chunks;
        unless ``whole``, a slot without room for the row fields (those first).

        The returned slots are pinned; the caller fills them and unpins. Raises RuntimeError if
        there are fewer evictable slots than chunks asked for.
        """
        n = len(lanes)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        if n > self.evictable(whole):
            raise RuntimeError(f"chunk cache has {self.evictable(whole)} free slots, {n} needed")
        return self.place(lanes, chunks, self._victims(n, whole))

    def reserve(self, n: int) -> np.ndarray:
        """``n`` slots with room for every field, emptied and pinned but holding no chunk: a fill
        that reads find only once it is `place`d. Raises RuntimeError as `assign`."""
        if n > self.evictable():
            raise RuntimeError(f"chunk cache has {self.evictable()} free slots, {n} needed")
        slots = self._victims(n, whole=True)
        self._pinned[slots] = True
        return slots

    def reserve_partial(self, n: int) -> np.ndarray | None:
        """``n`` free slots without room for the row fields, pinned but holding no chunk (a fill
        of the other fields, as `reserve`), or None where fewer are free."""
        rest = slice(self.full_slots, None)
        free = self.full_slots + np.flatnonzero((self._owner_lane[rest] < 0) & ~self._pinned[rest])
        if len(free) < n:
            return None
        self._pinned[free[:n]] = True
        return free[:n]

    def _victims(self, n: int, whole: bool) -> np.ndarray:
        """``n`` unpinned slots, emptied: unused ones first, else the least recently used."""
        eligible = self.full_slots if whole else self.slots
        empty = np.flatnonzero((self._owner_lane[:eligible] < 0) & ~self._pinned[:eligible])
        if len(empty) >= n:  # unused slots first: no LRU scan
            victims = empty[:n] if whole else empty[::-1][:n]
        else:
            age = np.where(self._pinned[:eligible], np.iinfo(np.int64).max, self._last_used[:eligible])
            victims = np.argpartition(age, n - 1)[:n] if n < eligible else np.arange(n)
        self.evict(victims)
        return victims

    def assign_zeroed(self, lane: int, chunk: int) -> int:
        """A pinned slot for a chunk with no stored rows yet, every field zero (a recycled slot
        holds another chunk's rows: those must never be written into this chunk)."""
        slot = int(self.assign(np.array([lane]), np.array([chunk]))[0])
        for name in self.slabs:
            self.chunk_rows_of(name, slot)[...] = 0
        return slot

    def place(self, lanes: np.ndarray, chunks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Give each (lane, chunk) the slot named (the caller chose free ones); returns them, pinned.
        A copy of a chunk held in another slot (some of its fields, or an older read) is forgotten:
        a chunk is resident in one slot at most."""
        held = self._table[lanes, chunks]
        self.evict(held[(held >= 0) & (held != slots)])
        self._table[lanes, chunks] = slots
        self._owner_lane[slots] = lanes
        self._owner_chunk[slots] = chunks
        self._pinned[slots] = True
        self._partial[slots] = slots >= self.full_slots
        self._last_used[slots] = self._clock
        return slots

    def evict(self, slots: np.ndarray) -> None:
        held = slots[self._owner_lane[slots] >= 0]
        self._table[self._owner_lane[held], self._owner_chunk[held]] = -1
        self._owner_lane[held] = -1
        self._owner_chunk[held] = -1

    def release(self, slots: np.ndarray) -> None:
        """Unpin and forget these slots (a failed fill)."""
        self._pinned[slots] = False
        self.evict(slots)

    def invalidate(self, lane: int, chunks: np.ndarray) -> None:
        """Forget cached copies of these chunks (they were rewritten elsewhere). Pinned ones stay."""
        chunks = chunks[chunks < self.width]
        slots = self._table[lane, chunks]
        slots = slots[(slots >= 0)]
        self.evict(slots[~self._pinned[slots]])

    def drop(self, lane: int, chunks: np.ndarray) -> None:
        """Forget these chunks of a lane, pinned (staged or sealed) ones included."""
        chunks = chunks[chunks < self.width]
        slots = self._table[lane, chunks]
        self.release(slots[slots >= 0])

    def write_rows(self, slot: int, offset: int, rows: Mapping[str, np.ndarray], start: int, count: int) -> None:
        """Copy ``rows[name][start:start + count]`` of every field (``rows`` may hold only some)
        into a slot, from row ``offset`` of its chunk."""
        base = slot * self.chunk_rows + offset
        for name, values in rows.items():
            self.slabs[name][base:base + count] = values[start:start + count]


def _flags(flags: np.ndarray, slots: np.ndarray | int) -> np.ndarray | bool:
    """``flags[slots]``: a bool for one slot, an array for several."""
    return bool(flags[slots]) if isinstance(slots, int) else np.asarray(flags[slots])
