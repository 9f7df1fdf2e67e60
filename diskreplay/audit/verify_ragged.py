"""`verify` of ragged and text fields: every visible row's ends add up (a row starts where the
previous row of its row chunk ends, at or before its own end) and stay within the values array,
and every value chunk a visible row reaches exists and decodes (docs/format.md, section 12)."""

from __future__ import annotations

import json
from typing import Protocol

import numpy as np

from ..format.codecs import Codec
from ..format.config import BufferConfig
from ..format.keys import array_key, chunk_key
from ..format.layout import values_codec, values_problems
from ..format.ragged import ends_name, value_chunk_for, values_key
from ..format.schema import Field
from ..io import ChunkStore


class Report(Protocol):
    chunks_checked: int

    def problem(self, text: str) -> None: ...


def check_ragged(store: ChunkStore, config: BufferConfig, codecs: dict[str, Codec], lo: np.ndarray,
                 hi: np.ndarray, report: Report) -> None:
    """Report every problem of the ragged fields' ends and values over the visible rows."""
    for name, f in config.user_schema.ragged.items():
        blob = store.get(array_key(name))
        meta = json.loads(blob) if blob is not None else None
        problems = (values_problems(name, f, meta, config) if isinstance(meta, dict)
                    else [f"{array_key(name)}: the values array of ragged field {name!r} is missing or not JSON"])
        for text in problems:
            report.problem(text)
        if problems or meta is None:
            continue
        owner = ends_name(f.length_of or name)
        for lane in range(config.num_envs):
            for chunk in config.layout.chunks_between(int(lo[lane]), int(hi[lane])).tolist():
                _check_row_chunk(store, config, name, f, owner, codecs[owner], int(meta["shape"][2]), lane, chunk,
                                 (int(lo[lane]), int(hi[lane])), report)


def _check_row_chunk(store: ChunkStore, config: BufferConfig, name: str, f: Field, owner: str, codec: Codec,
                     n_values: int, lane: int, chunk: int, window: tuple[int, int], report: Report) -> None:
    layout = config.layout
    ends = np.zeros(layout.chunk_rows, np.int64)
    blob = store.get(chunk_key(owner, Field((), "int64"), lane, chunk, config.chunk_key_separator))
    try:
        codec.decode_into(blob or b"", ends)
    except Exception:
        return  # the fixed-field check reports this chunk
    rows = _visible_rows(config, chunk, window)
    starts = np.concatenate([[0], ends[:-1]])[rows]
    where = f"ragged field {name!r}: row chunk {chunk} of lane {lane}"
    bad = (starts > ends[rows]) | (ends[rows] > n_values) | (starts < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        r = int(rows[i])
        report.problem(f"{where}: row {r} has values [{int(starts[i])}, {int(ends[r])}) in {owner}: ends "
                       f"that do not add up (a start after its end) or pass the {n_values} values of {array_key(name)}")
        return
    vc = value_chunk_for(f.shape, f.dtype)
    full = ends[rows] > starts
    spans = [np.arange(a // vc, (b - 1) // vc + 1) for a, b in zip(starts[full].tolist(), ends[rows][full].tolist())]
    ks = np.unique(np.concatenate(spans)) if spans else np.zeros(0, np.int64)
    keys = [values_key(name, f.shape, lane, chunk, int(k), config.chunk_key_separator) for k in ks.tolist()]
    out = np.empty((vc, *f.shape), f.dtype)
    for key, value in zip(keys, store.get_many(keys)):
        report.chunks_checked += 1
        if value is None:
            report.problem(f"{where}: value chunk {key!r} is missing, but visible rows reach it")
            continue
        try:
            values_codec(config).decode_into(value, out)
        except Exception as exc:
            report.problem(f"{where}: value chunk {key!r} does not decode to {out.nbytes} bytes ({exc})")


def _visible_rows(config: BufferConfig, chunk: int, window: tuple[int, int]) -> np.ndarray:
    """The rows of a row chunk that hold visible steps of the window ``[lo, hi)``."""
    layout, (lo, hi) = config.layout, window
    slots = np.arange(chunk * layout.chunk_rows, (chunk + 1) * layout.chunk_rows)
    cap = layout.lane_capacity
    if cap is None:
        steps = slots
    else:
        slots = slots[slots < cap]
        steps = hi - 1 - (hi - 1 - slots) % cap
    rows: np.ndarray = (slots - chunk * layout.chunk_rows)[(steps >= lo) & (steps < hi)]
    return rows
