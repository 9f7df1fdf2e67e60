"""The chunk cache: decoded chunks in a preallocated slab, found by array arithmetic.

Each field owns one slab of ``slots * chunk_rows`` rows. A (lane, chunk) pair is resident in at
most one slot, the same slot for every field; ``table[lane, chunk]`` gives the slot (or -1). A
batch of steps therefore maps to slab rows with one table lookup and one multiply-add, and each
field is gathered with a single ``take`` however many chunks the batch touches.

Slots are recycled least-recently-used. Pinned slots (chunks being written) are never evicted.

Fields read row by row (``row_fields``: sharded images) have room in the first ``full_slots``
slots only; a ``partial`` slot holds the other fields of its chunk only.
"""

from __future__ import annotations

import numpy as np

from .schema import Schema


class ChunkCache:
    def __init__(self, schema: Schema, num_envs: int, chunk_rows: int, slots: int, chunks_per_lane: int,
                 full_slots: int | None = None, row_fields: tuple[str, ...] = ()):
        self.chunk_rows = chunk_rows
        self.slots = slots
        self.full_slots = slots if full_slots is None else full_slots
        self.slabs = {name: np.zeros(((self.full_slots if name in row_fields else slots) * chunk_rows, *f.shape),
                                     dtype=f.dtype)
                      for name, f in schema.items()}
        self.table = np.full((num_envs, max(chunks_per_lane, 1)), -1, dtype=np.int64)
        self.owner_lane = np.full(slots, -1, dtype=np.int64)
        self.owner_chunk = np.full(slots, -1, dtype=np.int64)
        self.last_used = np.zeros(slots, dtype=np.int64)
        self.pinned = np.zeros(slots, dtype=bool)
        self.partial = np.arange(slots) >= self.full_slots
        self.clock = 1

    # Bookkeeping and LRU choice cost O(slots) per miss; past this many slots (tiny chunks and a
    # big budget) the cache costs more than it saves.
    MAX_SLOTS = 1 << 16

    def ensure_chunks(self, chunks_per_lane: int) -> None:
        """Grow the table (dataset mode) so chunk indices below ``chunks_per_lane`` are valid."""
        have = self.table.shape[1]
        if chunks_per_lane > have:
            grown = np.full((self.table.shape[0], max(chunks_per_lane, 2 * have)), -1, dtype=np.int64)
            grown[:, :have] = self.table
            self.table = grown

    def touch(self, slots: np.ndarray) -> None:
        self.last_used[slots] = self.clock
        self.clock += 1

    def evictable(self, whole: bool = True) -> int:
        """Unpinned slots with room for every field (``whole``) or for the others."""
        return int((self.full_slots if whole else self.slots) - self.pinned[:self.full_slots if whole else None].sum())

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
        eligible = self.full_slots if whole else self.slots
        empty = np.flatnonzero((self.owner_lane[:eligible] < 0) & ~self.pinned[:eligible])
        if len(empty) >= n:  # unused slots first: no LRU scan
            victims = empty[:n] if whole else empty[::-1][:n]
        else:
            age = np.where(self.pinned[:eligible], np.iinfo(np.int64).max, self.last_used[:eligible])
            victims = np.argpartition(age, n - 1)[:n] if n < eligible else np.arange(n)
        self.evict(victims)
        return self.place(lanes, chunks, victims)

    def place(self, lanes: np.ndarray, chunks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Give each (lane, chunk) the slot named (the caller chose free ones); returns them, pinned."""
        self.table[lanes, chunks] = slots
        self.owner_lane[slots] = lanes
        self.owner_chunk[slots] = chunks
        self.pinned[slots] = True
        self.partial[slots] = slots >= self.full_slots
        self.last_used[slots] = self.clock
        return slots

    def free(self, slots: np.ndarray) -> bool:
        """None of these slots holds a chunk or is pinned."""
        return bool(((self.owner_lane[slots] < 0) & ~self.pinned[slots]).all())

    def evict(self, slots: np.ndarray) -> None:
        held = slots[self.owner_lane[slots] >= 0]
        self.table[self.owner_lane[held], self.owner_chunk[held]] = -1
        self.owner_lane[held] = -1
        self.owner_chunk[held] = -1

    def invalidate(self, lane: int, chunks: np.ndarray) -> None:
        """Forget cached copies of these chunks (they were rewritten elsewhere). Pinned ones stay."""
        chunks = chunks[chunks < self.table.shape[1]]
        slots = self.table[lane, chunks]
        slots = slots[(slots >= 0)]
        self.evict(slots[~self.pinned[slots]])

    def drop(self, lane: int, chunks: np.ndarray) -> None:
        """Forget these chunks of a lane, pinned (staged or sealed) ones included."""
        chunks = chunks[chunks < self.table.shape[1]]
        slots = self.table[lane, chunks]
        slots = slots[slots >= 0]
        self.pinned[slots] = False
        self.evict(slots)

    def chunk_rows_of(self, name: str, slot: int) -> np.ndarray:
        """The slab rows of one slot for one field (a view: writes go straight into the cache)."""
        start = slot * self.chunk_rows
        return self.slabs[name][start:start + self.chunk_rows]
