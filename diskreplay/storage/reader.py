"""`ChunkReader`: rows at (lane, step), gathered with one ``take`` per field.

The paths, chosen per read: a reader whose cache holds its whole window in lane-major order finds
slab rows from the steps alone (`Warmer`); raw chunk files of a buffer larger than its cache are
memory-mapped side by side (`MappedChunks`); sharded images are read row by row (`RowReads`);
everything else goes through the chunk cache, missing chunks loaded into it, as many at once as
it has room for. A ring reader checks what it fetched against the newest commit (`RetiredCheck`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..errors import StaleReadError
from ..format.schema import Schema
from .cache import ChunkCache
from .cursors import Cursors
from .loading import ChunkLoader
from .mapped import MappedChunks
from .outputs import Rows, output_rows, take_rows
from .point_reads import PointReads
from .read_ahead import READ_AHEAD_BYTES, ReadAhead, Steps
from .row_reads import RowReads
from .stale import RetiredCheck
from .warm import Warmer


class ChunkReader:
    """The read paths of one buffer (a reader's, or the writer's own reads of what it added)."""

    def __init__(self, schema: Schema, cursors: Cursors, cache: ChunkCache, loader: ChunkLoader,
                 mapped: MappedChunks | None, row_reads: RowReads | None, retired: RetiredCheck, warmer: Warmer,
                 reader: bool, ahead: ReadAhead, points: PointReads | None):
        self.schema = schema
        self.field_names = tuple(schema.fields)
        self.layout = cursors.layout
        self.cache, self.loader, self.mapped, self.row_reads = cache, loader, mapped, row_reads
        self.row_names = frozenset(row_reads.names if row_reads is not None else ())
        self.retired, self.warmer = retired, warmer
        self.reader = reader
        self.ahead = ahead
        self.points = points
        self.planned = False
        """Whether reads were announced (`read_ahead`): they need whole chunks, not rows of them."""

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: Mapping[str, np.ndarray] | None = None) -> Rows:
        """Rows at (lane, step) of every field (or of ``names``); ``out`` as in `Storage.gather`."""
        self.warmer.before_read()
        self.warmer.reads.start(waits=not self.planned)  # an epoch reads its files as the page-in does
        try:
            rows = self._gather(lane, step, names or self.field_names, out)
        finally:
            self.warmer.reads.end()
        self.warmer.after_read()
        return rows

    def _gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...],
                out: Mapping[str, np.ndarray] | None) -> Rows:
        if self.warmer.resident_span is not None:
            return self._gather_resident(lane, step, names, out)
        if self.mapped is not None:
            return self._gather_mapped(self.mapped, lane, step, names, out or {})
        ahead = self.ahead.active
        if ahead:
            self.ahead.before(lane, step)
        if self.row_reads is not None and not self.row_names.isdisjoint(names):
            rows = self._gather_by_rows(self.row_reads, lane, step, names, out or {})
        else:
            rows = self._gather_cached(lane, step, names, out)
        if ahead:
            self.ahead.top_up()
        return rows

    def read_ahead(self, steps: Steps | None, budget_bytes: int = READ_AHEAD_BYTES) -> None:
        """Fetch and decode the chunks of ``steps`` ahead of the reads that will ask for them
        (`ReadAhead`), within ``budget_bytes``; None: stop. For readers through the chunk cache:
        memory maps and a window resident in the cache need none."""
        self.planned = steps is not None
        if steps is None:
            self.ahead.plan(None)
            return
        if not self.reader or self.mapped is not None or self.warmer.resident_span is not None:
            return
        self.warmer.pending = False  # the announced reads bring the chunks in, each decoded when needed
        self.ahead.plan(steps, budget_bytes)

    def output(self, name: str, count: int, given: np.ndarray | None) -> np.ndarray:
        return output_rows(self.schema[name], count, given)

    def _outputs(self, names: tuple[str, ...], count: int, given: Mapping[str, np.ndarray]) -> Rows:
        return {name: self.output(name, count, given.get(name)) for name in names}

    def _gather_resident(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...],
                         out: Mapping[str, np.ndarray] | None) -> Rows:
        """A reader whose cache holds its whole window, chunk ``(lane, c)`` in slot
        ``lane * width + c``: slab rows follow from the steps alone."""
        slot = self.layout.slot(step)
        span = self.warmer.resident_span
        return self._take(slot if self.layout.num_envs == 1 else lane * span + slot, names, out)

    def _gather_cached(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...],
                       out: Mapping[str, np.ndarray] | None) -> Rows:
        """Rows through the chunk cache, missing chunks loaded into it (`_gather_with_misses`)."""
        chunk, offset = self.layout.chunk_and_offset(step)
        slots = self.cache.slots_of(lane, chunk)
        if (slots >= 0).all():
            return self._from_slots(slots, offset, names, out)
        rows = self._outputs(names, len(step), out or {})
        self._gather_with_misses(lane, chunk, offset, slots, step, rows)
        return rows

    def _from_slots(self, slots: np.ndarray, offset: np.ndarray, names: tuple[str, ...],
                    out: Mapping[str, np.ndarray] | None) -> Rows:
        """Rows at ``offset`` in the cache's ``slots``, which hold them."""
        self.cache.touch(slots)
        return self._take(self.cache.rows_at(slots, offset), names, out)

    def _take(self, index: np.ndarray, names: tuple[str, ...], out: Mapping[str, np.ndarray] | None) -> Rows:
        """The slabs' rows at ``index``, into ``out``'s arrays where given."""
        rows = self._outputs(names, len(index), out or {})
        take_rows([self.cache.slabs[name] for name in rows], [index] * len(rows), list(rows.values()))
        return rows

    def _gather_with_misses(self, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray, slots: np.ndarray,
                            step: np.ndarray, out: Rows) -> None:
        miss = slots < 0
        if self._reads_points(out, lane, chunk, miss):
            self._fill(out, ~miss, lane, chunk, offset)
            self._read_points(out, miss, lane, chunk, offset, step)
            return
        width = self.cache.width
        keys = np.unique(lane[miss] * width + chunk[miss])
        if self.warmer.fill is not None and self.cache.evictable(whole=False) < len(keys):
            self.warmer.settle()  # its reserved slots are the room these chunks need
            slots = self.cache.slots_of(lane, chunk)
            keys = np.unique(lane[slots < 0] * width + chunk[slots < 0])
        miss = slots < 0
        self._fill(out, ~miss, lane, chunk, offset)
        room = self.cache.evictable(whole=False)
        if room == 0:
            raise RuntimeError("chunk cache has no free slot: raise cache_bytes")
        for start in range(0, len(keys), room):
            group = keys[start:start + room]
            lanes, chunks = group // width, group % width
            self.loader.load(lanes, chunks, self.warmer.homes(lanes, chunks), whole=False)
            todo = miss & np.isin(lane * width + chunk, group)
            tainted = self.retired.check(lane[todo], step[todo], lanes, chunks)
            self._fill(out, todo, lane, chunk, offset)
            for ln, stale in tainted:  # right for the rows asked for, not for all their slots
                self.cache.invalidate(ln, stale)

    def _reads_points(self, out: Rows, lane: np.ndarray, chunk: np.ndarray, miss: np.ndarray) -> bool:
        """Whether a reader's misses (at (lane, chunk) where ``miss``) are read straight from the
        chunk objects (`PointReads`): fields it covers, rows sparse in their chunks, no reads
        announced, from an object store or while the first-read fill is due."""
        return (self.points is not None and not self.planned and self.points.covers(tuple(out))
                and (not self.warmer.local or self.warmer.filling) and not self.warmer.found_damage
                and self.points.sparse(tuple(out), lane[miss], chunk[miss]))

    def _read_points(self, out: Rows, miss: np.ndarray, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray,
                     step: np.ndarray) -> None:
        assert self.points is not None
        missed = {name: rows[miss] for name, rows in out.items()}
        self.points.read(lane[miss], chunk[miss], offset[miss], missed)
        self.retired.check(lane[miss], step[miss], lane[miss], chunk[miss])
        for name, rows in missed.items():
            out[name][miss] = rows

    def _fill(self, out: Rows, mask: np.ndarray, lane: np.ndarray, chunk: np.ndarray, offset: np.ndarray) -> None:
        if not mask.any():
            return
        slots = self.cache.slots_of(lane[mask], chunk[mask])
        self.cache.touch(slots)
        index = self.cache.rows_at(slots, offset[mask])
        for name, rows in out.items():
            rows[mask] = self.cache.slabs[name].take(index, axis=0)

    def _gather_by_rows(self, row_reads: RowReads, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...],
                        out: Mapping[str, np.ndarray]) -> Rows:
        """Sharded fields row by row, the others through the cache; all through the cache where
        it holds every row's chunk whole (an epoch reading ahead)."""
        placed = row_reads.placed(lane, step)
        if placed.whole.all():
            return self._from_slots(placed.slots, placed.offset, names, out or None)
        others = tuple(name for name in names if name not in row_reads.names)
        if not self.planned:  # random rows: every field's inner chunks asked for at once
            row_reads.ask(tuple(name for name in names if name in row_reads.names), lane, placed)
        rows = self._gather_cached(lane, step, others, out) if others else {}
        for name in names:
            if name in row_reads.names:
                rows[name] = row_reads.read(name, lane, step, out.get(name))
        return {name: rows[name] for name in names}

    def _gather_mapped(self, mapped: MappedChunks, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...],
                       out: Mapping[str, np.ndarray]) -> Rows:
        """Rows from the memory-mapped chunk files, except a writer's chunks held in the cache
        (staged, or not yet written): those come from the cache."""
        slot = self.layout.slot(step)
        if not self.reader:
            slots = self.cache.slots_of(lane, slot // self.layout.chunk_rows)
            if (slots >= 0).any():
                return self._gather_mixed(mapped, lane, step, slot, slots, self._outputs(names, len(step), out))
        if not self._map(mapped, lane, step, slot):  # more chunks than may be mapped at once
            return self._gather_unmapped(lane, step, self._outputs(names, len(step), out))
        if out:
            out = self._outputs(names, len(step), out)
        return mapped.gather(lane, slot, names, out)

    def _map(self, mapped: MappedChunks, lane: np.ndarray, step: np.ndarray, slot: np.ndarray) -> bool:
        """Map the chunks of these steps; False if they are more than may be mapped at once."""
        newly = mapped.ensure(lane, slot)
        if newly is None:
            return False
        lanes, chunks = newly
        if len(chunks):
            try:
                tainted = self.retired.check(lane, step, lanes, chunks)
            except StaleReadError:
                for ln in np.unique(lanes).tolist():
                    mapped.forget(ln, chunks[lanes == ln])
                raise
            for ln, stale in tainted:
                mapped.forget(ln, stale)
        return True

    def _gather_mixed(self, mapped: MappedChunks, lane: np.ndarray, step: np.ndarray, slot: np.ndarray,
                      slots: np.ndarray, out: Rows) -> Rows:
        cached = slots >= 0
        filed = ~cached
        if filed.any() and not self._map(mapped, lane[filed], step[filed], slot[filed]):
            return self._gather_unmapped(lane, step, out)
        from_files = mapped.gather(lane[filed], slot[filed], tuple(out), {})
        index = self.cache.rows_at(slots[cached], slot[cached] % self.layout.chunk_rows)
        for name, rows in out.items():
            rows[filed] = from_files[name]
            rows[cached] = self.cache.slabs[name].take(index, axis=0)
        return out

    def _gather_unmapped(self, lane: np.ndarray, step: np.ndarray, out: Rows) -> Rows:
        chunk, offset = self.layout.chunk_and_offset(step)
        self._gather_with_misses(lane, chunk, offset, self.cache.slots_of(lane, chunk), step, out)
        return out
