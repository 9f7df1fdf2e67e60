"""What a Ray Data read of a buffer reads: its committed rows, pinned to the commit each shard
showed when the read was planned, cut into pieces (one lane's steps inside one stored chunk) and
the pieces dealt to read tasks. Plain data: no Ray here, so a plan pickles small."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer
from ..errors import SchemaError
from ..format.lanes import LaneLayout
from ..format.schema import Field
from ..format.shards import shard_url
from ..io import is_local, local_path

ROW_ID = "row_id"
"""The column of row ids: ``buf[row_id]`` returns the row."""

PLAN_CACHE_BYTES = 1 << 20
"""Chunk cache of the buffer opened to plan a read: it reads no chunk."""


@dataclass(frozen=True)
class Pieces:
    """Pieces of a buffer, each one lane's steps ``[first, end)`` inside one stored chunk; int64
    arrays ``[n]``. ``lane`` counts the lanes of every shard side by side (the row id's lane)."""

    lane: np.ndarray
    first: np.ndarray
    end: np.ndarray

    def __len__(self) -> int:
        return len(self.lane)

    @property
    def rows(self) -> int:
        return int((self.end - self.first).sum())

    def part(self, start: int, stop: int) -> Pieces:
        return Pieces(self.lane[start:stop], self.first[start:stop], self.end[start:stop])


@dataclass(frozen=True)
class ReadPlan:
    """A read of the buffer at ``url``: what every read task needs to read its pieces alone."""

    url: str
    storage_options: Mapping[str, Any] | None
    shard_urls: tuple[str, ...]
    """Each shard's location (a buffer that is not sharded: its own ``url``)."""
    sequences: tuple[int, ...]
    """The commit each shard showed when the read was planned: what the read is pinned to."""
    num_envs: int
    """Lanes of the whole buffer (every shard's side by side)."""
    layout: LaneLayout
    """One shard's lanes, ring and chunking."""
    fields: dict[str, Field]
    """The fields read (``fields=``), in column order."""
    pieces: Pieces

    @property
    def shard_envs(self) -> int:
        return self.layout.num_envs

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of the read: its fields and its int64 row id."""
        return sum(field.row_bytes for field in self.fields.values()) + 8

    def tasks(self, count: int) -> list[Pieces]:
        """The pieces dealt to about ``count`` tasks (fewer if there are fewer pieces; at least
        one), consecutive pieces together, balanced by piece count."""
        total = len(self.pieces)
        n = max(1, min(int(count), total))
        bounds = [i * total // n for i in range(n + 1)]
        return [self.pieces.part(a, b) for a, b in zip(bounds, bounds[1:])]


def absolute(url: str | os.PathLike[str]) -> str:
    """``url`` as every task reads it: a local path made absolute (a task's working directory
    is Ray's, not the driver's)."""
    url = os.fspath(url)
    return local_path(url) if is_local(url) else url


def chosen_fields(stored: Mapping[str, Field], fields: Iterable[str] | None, url: str) -> dict[str, Field]:
    """The stored fields ``fields`` names (None: all), in that order. Raises SchemaError naming
    a field that is not stored, or an empty or repeated choice."""
    if fields is None:
        return dict(stored)
    names = [fields] if isinstance(fields, str) else list(fields)
    unknown = [name for name in names if name not in stored]
    if unknown or not names or len(set(names)) != len(names):
        raise SchemaError(f"{url!r}: fields must name distinct stored fields of the buffer ({sorted(stored)}), "
                          f"got {names!r}" + (f" ({unknown[0]!r} is not one)" if unknown else ""))
    return {name: stored[name] for name in names}


def plan_read(url: str | os.PathLike[str], fields: Iterable[str] | None,
              storage_options: Mapping[str, Any] | None) -> ReadPlan:
    """The committed rows of the buffer at ``url`` (every shard's, as each shows them now).

    Raises NotABufferError, CorruptBufferError (as `ReplayBuffer.open`), SchemaError (``fields``)."""
    url = absolute(url)
    with ReplayBuffer.open(url, "r", storage_options=storage_options, cache_bytes=PLAN_CACHE_BYTES,
                           memory_map=False) as buf:
        storage = buf.storage
        if ROW_ID in storage.schema.fields:
            raise SchemaError(f"{url!r}: a field is named {ROW_ID!r}, the column read_buffer adds for row ids")
        chosen = chosen_fields(storage.schema.fields, fields, url)
        lo, hi = buf.window(committed=True)
        shards = buf.shards
        layout = LaneLayout(buf.num_envs // shards, storage.layout.lane_capacity, storage.layout.chunk_rows)
        urls = tuple(shard_url(url, s) for s in range(shards)) if storage.sharded else (url,)
        sequences = tuple(record.sequence for record in storage.shard_records())
        return ReadPlan(url, storage_options, urls, sequences, buf.num_envs, layout, chosen,
                        chunk_pieces(layout, lo, hi))


def chunk_pieces(layout: LaneLayout, lo: np.ndarray, hi: np.ndarray) -> Pieces:
    """Every lane's steps ``[lo, hi)`` cut at chunk (and ring) boundaries, lane by lane in time order."""
    lanes, firsts, ends = [], [], []
    for lane, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
        for first, end in _lane_pieces(layout, a, b):
            lanes.append(lane)
            firsts.append(first)
            ends.append(end)
    return Pieces(np.array(lanes, np.int64), np.array(firsts, np.int64), np.array(ends, np.int64))


def _lane_pieces(layout: LaneLayout, first: int, end: int) -> Iterator[tuple[int, int]]:
    while first < end:
        step = first + layout.piece_length(first, end - first)
        yield first, step
        first = step
