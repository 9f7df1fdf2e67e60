"""`ValueStaging`: the writer's ragged values, staged per lane and row chunk, written as whole
value chunks (see `format.ragged` for the layout).

Each lane stages the values of the row chunk it is filling from ``base`` (a multiple of the
value chunk: everything before it is written and final). A row chunk left for the next is
*pending* until written. `write` writes pending chunks and (at a flush) every lane's staged tail,
whose last, partial value chunk stays staged and is rewritten whole by later flushes. The ends
arrays ride the fixed-field machinery; this class computes them (`ends`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptBufferError
from ..format.config import BufferConfig
from ..format.keys import array_key
from ..format.layout import values_codec, values_problems, values_shape
from ..format.ragged import RaggedColumn, ends_name, value_chunk_for, values_key
from ..format.schema import Field
from .chunk_io import ChunkIO, ChunkWrite

HELD_BYTES = 64 << 20
"""Values held (pending and staged) past which an append writes them, the staged tails too:
the writer's memory stays bounded between flushes."""
PrevEnd = Callable[[str, int, int], int]
"""``(ends field, lane, step)`` -> the stored end of that step's values in its row chunk."""


@dataclass
class LaneValues:
    """One lane's staged values of one ragged field: those of row chunk ``chunk`` from ``base``."""

    chunk: int = -1
    base: int = 0
    fill: int = 0
    dirty: bool = False
    buf: np.ndarray = field(default_factory=lambda: np.zeros(0))


class ValueStaging:
    """The ragged values of one buffer's writer."""

    def __init__(self, config: BufferConfig, io: ChunkIO, read_chunk: Callable[[str, int, int, int], np.ndarray]):
        """``read_chunk(name, lane, chunk, k)``: a stored value chunk (for a tail staged again)."""
        self.config, self.io, self.read_chunk = config, io, read_chunk
        self.layout = config.layout
        self.fields: dict[str, Field] = config.user_schema.ragged
        self.owner = {name: f.length_of or name for name, f in self.fields.items()}
        self.vc = {name: value_chunk_for(f.shape, f.dtype) for name, f in self.fields.items()}
        self.lanes = {name: [LaneValues(buf=np.zeros((0, *f.shape), f.dtype)) for _ in range(config.num_envs)]
                      for name, f in self.fields.items()}
        self.pending: dict[tuple[str, int, int], tuple[int, np.ndarray]] = {}
        self.last: dict[tuple[str, int], tuple[int, int, int]] = {}
        """Per (owner, lane): (lane total, row chunk, end) after the last staged row."""
        self.meta: dict[str, dict] = {}
        self.written_end = dict.fromkeys(self.fields, 0)

    # ---- appends ---------------------------------------------------------------------------

    def stage(self, lane: int, start: int, columns: Mapping[str, RaggedColumn],
              prev_end: PrevEnd) -> dict[str, np.ndarray]:
        """Stage the values of steps ``[start, start + count)`` of ``lane``; returns each owner's
        ends (``{"<owner>.ends": int64 [count]}``) for the fixed-field rows. Python loops run per
        row chunk the steps touch, not per row."""
        out = {}
        for owner in dict.fromkeys(self.owner.values()):
            lengths = columns[owner].lengths.reshape(-1)
            chunk, offset = self.layout.chunk_and_offset(start + np.arange(len(lengths)))
            if not len(lengths):
                continue
            prev = self._prev_end(owner, lane, start, int(chunk[0]), prev_end) if offset[0] else 0
            new = offset == 0
            new[0] = True
            seg = np.cumsum(new) - 1
            firsts = np.flatnonzero(new)
            total = np.cumsum(lengths)
            before = total[firsts] - lengths[firsts]
            ends = total - before[seg]
            ends[seg == 0] += prev
            out[ends_name(owner)] = ends
            self.last[(owner, lane)] = (start + len(lengths), int(chunk[-1]), int(ends[-1]))
            bounds = np.append(firsts, len(lengths))
            for name in (n for n, o in self.owner.items() if o == owner):
                values = columns[name].values
                for i, first in enumerate(firsts.tolist()):
                    a, b = int(before[i]), int(total[bounds[i + 1] - 1])
                    self._append(name, lane, int(chunk[first]), prev if i == 0 else 0, values[a:b])
        return out

    def _prev_end(self, owner: str, lane: int, start: int, chunk: int, prev_end: PrevEnd) -> int:
        last = self.last.get((owner, lane))
        if last is not None and last[0] == start and last[1] == chunk:
            return last[2]
        return prev_end(owner + ".ends", lane, start - 1)

    def _append(self, name: str, lane: int, chunk: int, at: int, values: np.ndarray) -> None:
        """Values of one row chunk's rows, starting at value position ``at`` of that chunk."""
        lv = self.lanes[name][lane]
        vc = self.vc[name]
        if lv.chunk != chunk or at == 0:
            self._seal(name, lane)
            lv.chunk = chunk
            held = self.pending.pop((name, lane, chunk), None)
            if at == 0:
                lv.base, lv.fill = 0, 0
            elif held is not None and held[0] <= at <= held[0] + len(held[1]):
                lv.base, lv.buf = held
                lv.buf = lv.buf.copy()
            else:
                lv.base = at // vc * vc
                lv.buf = self.read_chunk(name, lane, chunk, at // vc).copy() if at % vc else lv.buf[:0]
        lv.fill = at - lv.base
        end = lv.fill + len(values)
        if end > len(lv.buf):
            grown = np.zeros((max(end, 2 * len(lv.buf), vc), *lv.buf.shape[1:]), lv.buf.dtype)
            grown[:lv.fill] = lv.buf[:lv.fill]
            lv.buf = grown
        lv.buf[lv.fill:end] = values
        lv.fill, lv.dirty = end, True

    def _seal(self, name: str, lane: int) -> None:
        lv = self.lanes[name][lane]
        if lv.chunk >= 0 and lv.dirty:
            self.pending[(name, lane, lv.chunk)] = (lv.base, lv.buf[:lv.fill].copy())
        lv.chunk, lv.dirty = -1, False

    @property
    def held_bytes(self) -> int:
        """Bytes of values held here: pending and staged."""
        staged = sum(lv.fill * lv.buf.itemsize * math.prod(lv.buf.shape[1:]) for lanes in self.lanes.values()
                     for lv in lanes if lv.dirty)
        return staged + sum(values.nbytes for _, values in self.pending.values())

    # ---- reads of staged values ------------------------------------------------------------

    def holds(self, name: str, lane: np.ndarray, chunk: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Which value chunks (lane, row chunk, k) are staged or pending here: read from `staged`."""
        lanes = self.lanes[name]
        staged = np.array([lv.chunk for lv in lanes], np.int64)
        base = np.array([lv.base for lv in lanes], np.int64)
        vc = self.vc[name]
        held: np.ndarray = (staged[lane] == chunk) & (k * vc >= base[lane])
        for (n, ln, c), (first, _) in self.pending.items():
            if n == name:
                held |= (lane == ln) & (chunk == c) & (k * vc >= first)
        return held

    def staged(self, name: str, lane: int, chunk: int, k: int) -> np.ndarray | None:
        """Value chunk ``k`` of a row chunk if it is staged or pending here (not final in the store)."""
        lv = self.lanes[name][lane]
        held = (lv.base, lv.buf[:lv.fill]) if lv.chunk == chunk else self.pending.get((name, lane, chunk))
        vc = self.vc[name]
        if held is None or k * vc < held[0]:
            return None
        return _padded(held[1][k * vc - held[0]:(k + 1) * vc - held[0]], vc)

    # ---- writes ----------------------------------------------------------------------------

    def work(self, tails: bool) -> tuple[list[ChunkWrite], list[tuple[str, int, int, int]]]:
        """The value chunks to write (pending ones, and the staged tails if ``tails``) and their
        (name, lane, chunk, k). Staging moves on as if they were written."""
        work: list[ChunkWrite] = []
        keys: list[tuple[str, int, int, int]] = []
        for (name, lane, chunk), (base, values) in self.pending.items():
            self._chunks(name, lane, chunk, base, values, work, keys)
        self.pending = {}
        for name, lanes in self.lanes.items() if tails else ():
            vc = self.vc[name]
            for lane, lv in enumerate(lanes):
                if lv.chunk >= 0 and lv.dirty:
                    self._chunks(name, lane, lv.chunk, lv.base, lv.buf[:lv.fill], work, keys)
                    keep = (lv.base + lv.fill) // vc * vc - lv.base
                    lv.buf = lv.buf[keep:].copy()
                    lv.base, lv.fill, lv.dirty = lv.base + keep, lv.fill - keep, False
        return work, keys

    def _chunks(self, name: str, lane: int, chunk: int, base: int, values: np.ndarray, work: list[ChunkWrite],
                keys: list[tuple[str, int, int, int]]) -> None:
        vc = self.vc[name]
        codec = values_codec(self.config)
        self.written_end[name] = max(self.written_end[name], base + len(values))
        for j in range(-(-len(values) // vc)):
            k = base // vc + j
            work.append((self.key(name, lane, chunk, k), codec, _padded(values[j * vc:(j + 1) * vc], vc), False))
            keys.append((name, lane, chunk, k))

    def key(self, name: str, lane: int, chunk: int, k: int) -> str:
        return values_key_of(self.io, self.fields[name], name, lane, chunk, k)

    def grown_documents(self, lane_rows: int) -> dict[str, bytes]:
        """The values arrays' ``zarr.json`` documents that must grow before the next commit (more
        row chunks in a dataset, or more values in a row chunk than their shape holds)."""
        out = {}
        for name, f in self.fields.items():
            meta = self.metadata(name)
            shape = list(meta["shape"])
            need = values_shape(self.config, f, lane_rows, 0)[1]
            values = self.written_end[name]
            if need > shape[1] or values > shape[2]:
                shape[1] = max(shape[1], need)
                if values > shape[2]:
                    shape[2] = max(1 << (values - 1).bit_length(), self.vc[name])
                meta["shape"] = shape
                out[array_key(name)] = json.dumps(meta, indent=2).encode()
        return out

    def metadata(self, name: str) -> dict:
        if name not in self.meta:
            self.meta[name] = read_values_meta(self.io, self.config, name)
        return self.meta[name]


def read_values_meta(io: ChunkIO, config: BufferConfig, name: str, prefix: str = "") -> dict:
    """A ragged field's values array metadata (of the shard at ``prefix`` of a union), checked.
    Raises CorruptBufferError."""
    blob = io.store.get(prefix + array_key(name))
    if blob is None:
        raise CorruptBufferError(f"{io.url!r}: array for ragged field {name!r} is missing ({prefix}{array_key(name)})")
    try:
        meta = json.loads(blob)
    except ValueError as exc:
        raise CorruptBufferError(f"{io.url!r}: {array_key(name)} is not valid JSON ({exc})") from None
    problems = values_problems(name, config.user_schema[name], meta, config, io.prefix_lanes) if isinstance(
        meta, dict) else [
        f"{array_key(name)}: not a JSON object"]
    if problems:
        raise CorruptBufferError(f"{io.url!r}: {problems[0]}")
    return dict(meta)


def values_key_of(io: ChunkIO, f: Field, name: str, lane: int, chunk: int, k: int) -> str:
    """The store key of a value chunk through ``io`` (a union's lanes live in their shards' directories)."""
    if len(io.prefixes) == 1:
        return io.prefixes[0] + values_key(name, f.shape, lane, chunk, k, io.separator)
    group, lane = divmod(lane, io.prefix_lanes)
    return io.prefixes[group] + values_key(name, f.shape, lane, chunk, k, io.separator)


def _padded(values: np.ndarray, size: int) -> np.ndarray:
    if len(values) == size:
        return values
    out = np.zeros((size, *values.shape[1:]), values.dtype)
    out[:len(values)] = values
    return out
