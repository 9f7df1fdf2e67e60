"""`RaggedReads`: rows of ragged fields, read as the value chunks their ``[start, end)`` touch.

A batch's rows map to (lane, row chunk, value chunk) codes with array arithmetic; the decoded
value chunks sit in a slab of slots (`ValueCache`, a sorted code table), fetched together when
missing, and the rows' values are gathered with one ``take``. A cached value chunk is right for
the steps below the lane's total when it was read (`ValueCache.valid`): later rows of its row
chunk may have been appended to it since. A writer reads its staged values from its
`ValueStaging` and drops the cached copies of the value chunks it rewrites.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import CorruptBufferError
from ..format.config import MAX_CHUNKS, BufferConfig
from ..format.layout import values_codec
from ..format.ragged import MAX_VALUES, Ragged, gather_runs, value_chunk_for
from ..format.schema import Field
from .chunk_io import ChunkIO
from .ragged_values import ValueStaging, read_values_meta, values_key_of

MIN_CACHE_BYTES = 16 << 20
"""The least a ragged field caches of value chunks. Each ragged field caches up to half the
buffer's chunk cache bytes more (at least this; more for a batch that touches more)."""
K_BITS = 37
"""A value chunk's code: ``(lane * width + row chunk) << K_BITS | k`` (below 2**63: at most
`MAX_CHUNKS` row chunks, `MAX_VALUES` values per row chunk)."""
Staged = Callable[[str, int, int, int], "np.ndarray | None"]
Check = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], object]


class ValueCache:
    """Decoded value chunks of one ragged field: a slab of slots and a sorted code -> slot table."""

    def __init__(self, f: Field, vc: int, slots: int):
        self.vc = vc
        self.slab = np.empty((slots, vc, *f.shape), f.dtype)
        self.codes = np.zeros(0, np.int64)
        self.slots = np.zeros(0, np.int64)
        self.valid = np.zeros(slots, np.int64)
        self.used = np.zeros(slots, np.int64)
        self.code_of = np.full(slots, -1, np.int64)
        self.tick = 0

    def lookup(self, codes: np.ndarray) -> np.ndarray:
        i = np.minimum(np.searchsorted(self.codes, codes), max(len(self.codes) - 1, 0))
        found = (self.codes[i] == codes) if len(self.codes) else np.zeros(len(codes), bool)
        return np.where(found, self.slots[i] if len(self.codes) else -1, -1)

    def assign(self, codes: np.ndarray, keep: np.ndarray) -> np.ndarray:
        """Slots for ``codes`` (missing), evicting the least recently used but ``keep``."""
        self.drop(codes)
        free = np.ones(len(self.slab), bool)
        free[keep] = False
        candidates = np.flatnonzero(free)
        if len(candidates) < len(codes):
            self._grow(len(self.slab) + len(codes) - len(candidates))
            return self.assign(codes, keep)
        chosen = candidates[np.argsort(self.used[candidates], kind="stable")[:len(codes)]]
        self.drop(self.code_of[chosen][self.code_of[chosen] >= 0])
        self.code_of[chosen] = codes
        order = np.argsort(np.concatenate([self.codes, codes]), kind="stable")
        self.codes = np.concatenate([self.codes, codes])[order]
        self.slots = np.concatenate([self.slots, chosen])[order]
        return chosen

    def drop(self, codes: np.ndarray) -> None:
        gone = np.isin(self.codes, codes)
        if gone.any():
            self.code_of[self.slots[gone]] = -1
            self.valid[self.slots[gone]] = 0
            self.codes, self.slots = self.codes[~gone], self.slots[~gone]

    def _grow(self, slots: int) -> None:
        old = len(self.slab)
        slab = np.empty((slots, *self.slab.shape[1:]), self.slab.dtype)
        slab[:old] = self.slab
        self.slab = slab
        self.valid = np.concatenate([self.valid, np.zeros(slots - old, np.int64)])
        self.used = np.concatenate([self.used, np.zeros(slots - old, np.int64)])
        self.code_of = np.concatenate([self.code_of, np.full(slots - old, -1, np.int64)])


class RaggedReads:
    """Reads of the ragged fields of one storage."""

    def __init__(self, config: BufferConfig, io: ChunkIO, writer: bool, cache_bytes: int):
        self.config, self.io = config, io
        self.fields = config.user_schema.ragged
        self.vc = {name: value_chunk_for(f.shape, f.dtype) for name, f in self.fields.items()}
        budget = max(MIN_CACHE_BYTES, cache_bytes // 2)
        self.caches = {name: ValueCache(f, self.vc[name], max(budget // (self.vc[name] * max(f.row_bytes, 1)), 1))
                       for name, f in self.fields.items()}
        self.width = MAX_CHUNKS // config.num_envs
        self.writer = writer
        self.staging: ValueStaging | None = None
        self.n_values = dict.fromkeys(self.fields, -1)

    def code(self, lane: np.ndarray, chunk: np.ndarray, k: np.ndarray) -> np.ndarray:
        code: np.ndarray = ((lane * self.width + chunk) << K_BITS) | k
        return code

    def read(self, name: str, lane: np.ndarray, step: np.ndarray, chunk: np.ndarray, start: np.ndarray,
             end: np.ndarray, valid: np.ndarray, check: Check) -> Ragged:
        """Rows (lane, step) of ragged field ``name``, their values ``[start, end)`` of row chunk
        ``chunk`` (read from its ends); ``valid[lane]``: a value chunk read now is right for the
        steps below it. ``check(lane, step, lanes, chunks)``: the ring reader's stale-read check
        of rows whose values were fetched."""
        self._check_ends(name, lane, chunk, start, end)
        vc, cache = self.vc[name], self.caches[name]
        lengths = end - start
        k0 = start // vc
        nk = np.where(lengths > 0, (end - 1) // vc - k0 + 1, 0)
        pair_first = np.cumsum(nk) - nk
        row = np.repeat(np.arange(len(step)), nk)
        k = k0[row] + np.arange(len(row)) - pair_first[row]
        codes = self.code(lane[row], chunk[row], k)
        slots = cache.lookup(codes)
        bad = (slots < 0) | (cache.valid[np.maximum(slots, 0)] <= step[row])
        if self.staging is not None:
            bad |= self.staging.holds(name, lane[row], chunk[row], k)
        if bad.any():
            slots[bad] = self._load(name, codes[bad], step[row[bad]], lane[row[bad]], valid, slots[~bad], check)
        cache.tick += 1
        cache.used[slots] = cache.tick
        # each (row, value chunk) pair is one run of the slab; the runs end to end are the values
        first = np.maximum(start[row], k * vc)
        runs = np.minimum(end[row], (k + 1) * vc) - first
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = cache.slab.reshape(-1, *cache.slab.shape[2:])
        return Ragged(gather_runs(flat, slots * vc + first - k * vc, runs), offsets)

    def _load(self, name: str, codes: np.ndarray, steps: np.ndarray, lanes: np.ndarray, valid: np.ndarray,
              keep: np.ndarray, check: Check) -> np.ndarray:
        """Slots of value chunks ``codes`` (with repeats), fetched from staging or the store."""
        cache, f = self.caches[name], self.fields[name]
        unique, inverse = np.unique(codes, return_inverse=True)
        slots = cache.assign(unique, keep)
        rc = unique >> K_BITS
        ulanes, uchunks, uk = rc // self.width, rc % self.width, unique & ((1 << K_BITS) - 1)
        fetch = []
        bound = np.full(len(unique), np.iinfo(np.int64).max if self.writer else 0, np.int64)
        for i, (ln, c, kk) in enumerate(zip(ulanes.tolist(), uchunks.tolist(), uk.tolist())):
            staged = self.staging.staged(name, ln, c, kk) if self.staging is not None else None
            if staged is not None:
                cache.slab[slots[i]] = staged
                bound[i] = 0  # staged values change: not kept past this read
            else:
                key = values_key_of(self.io, f, name, ln, c, kk)
                fetch.append((key, values_codec(self.config), cache.slab[slots[i]]))
                if not self.writer:
                    bound[i] = int(valid[ln])
        try:
            if fetch:
                self.io.read(fetch, must_exist=True)
                check(lanes, steps, ulanes, uchunks)
        except BaseException:
            cache.drop(unique)
            raise
        cache.valid[slots] = bound
        cache.valid[slots[bound == 0]] = 0
        result: np.ndarray = slots[inverse]
        return result

    def lengths(self, name: str, lane: np.ndarray, chunk: np.ndarray, start: np.ndarray,
                end: np.ndarray) -> np.ndarray:
        """The lengths ``end - start`` of rows of ``name`` in row chunks ``chunk`` of ``lane``,
        their ends checked first (no values read). Raises CorruptBufferError."""
        self._check_ends(name, lane, chunk, start, end)
        lengths: np.ndarray = end - start
        return lengths

    def _check_ends(self, name: str, lane: np.ndarray, chunk: np.ndarray, start: np.ndarray, end: np.ndarray) -> None:
        """Ends read from the store are checked before use: a row ends at or after its start and
        within the values array (its ``zarr.json``, read again when a row passes it)."""
        bad = (end < start) | (start < 0) | (end > MAX_VALUES)
        if not bad.any() and self.staging is None and len(end) and int(end.max()) > self.n_values[name]:
            self.n_values[name] = max(int(read_values_meta(self.io, self.config, name, prefix)["shape"][2])
                                      for prefix in self.io.prefixes)
            bad = end > self.n_values[name]
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            why = (f"values [{int(start[i])}, {int(end[i])}): ends that do not add up (a row starts after its end)"
                   if end[i] < start[i] or start[i] < 0 else
                   f"a row ending at value {int(end[i])}, beyond the {self.n_values[name]} values its array holds")
            raise CorruptBufferError(f"{self.io.url!r}: ragged field {name!r}: row chunk {int(chunk[i])} of lane "
                                     f"{int(lane[i])} has {why}")

    def forget(self, name: str, keys: list[tuple[int, int, int]]) -> None:
        """The writer rewrote these value chunks: cached copies go."""
        if keys:
            lane, chunk, k = (np.array(x, dtype=np.int64) for x in zip(*keys))
            self.caches[name].drop(self.code(lane, chunk, k))
