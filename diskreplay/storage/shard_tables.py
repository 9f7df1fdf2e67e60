"""Shard index tables (`diskreplay.format.shard_table`): written by a writer as it closes, read
by a reader before its first point read of a sharded field (`PointReads`).

A table describes the shards as they are in the store after the writer's last commit: the
indexes the writer's own writes put (`ChunkIO.heads`), the others taken from the tables of the
commit the writer opened at, else read from their shards in one round of requests. A reader
takes a table only if it is stamped with the commit the reader shows; the indexes it holds are
then kept as if read from each shard, and forgotten as those are when a refresh finds the chunk
rewritten. Each inner chunk read through one is still checked against its own checksum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from ..format.codecs import CHECKSUM_BYTES
from ..format.commit import CommitRecord
from ..format.lanes import LaneLayout
from ..format.shard_table import MAX_STORED_BYTES, MAX_TABLE_BYTES, ShardTable, table_bytes, table_keys
from ..io.store import ChunkStore
from .chunk_io import ChunkIO

Tables = Callable[[tuple[str, ...]], dict[str, ShardTable]]
"""The shard index tables of these fields that describe the shards as this reader's commit has
them (`read_tables`)."""


def sharded_fields(io: ChunkIO) -> tuple[str, ...]:
    """The fields stored as shards of inner chunks."""
    return tuple(name for name, codec in io.codecs.items() if codec.inner_rows is not None)


def write_tables(io: ChunkIO, objects: ChunkStore, layout: LaneLayout, record: CommitRecord,
                 opened: Mapping[str, ShardTable]) -> None:
    """Each sharded field's table of the shards holding rows of ``record`` (the writer's last
    commit), put to ``objects``: the indexes this writer put, else those of ``opened`` (the
    tables of the commit it opened at), else read from the shards. None for a buffer stored
    under several prefixes, nor past `MAX_TABLE_BYTES`."""
    names = sharded_fields(io)
    rows = np.minimum(record.committed, layout.lane_capacity or np.iinfo(np.int64).max)
    chunks = -(-rows // layout.chunk_rows)
    width = int(chunks.max(initial=0))
    if not names or len(io.prefixes) != 1 or not width or sum(
            table_bytes(layout.num_envs, width, _inner(io, name, layout)) for name in names) > MAX_TABLE_BYTES:
        return
    heads = _heads(io, layout, [(name, lane, chunk) for name in names for lane, count in enumerate(chunks.tolist())
                                for chunk in range(count)], opened)
    for name in names:
        inner = _inner(io, name, layout)
        present = np.zeros((layout.num_envs, width), bool)
        entries = np.zeros((layout.num_envs, width, inner, 2), "<u8")
        for (field, lane, chunk), head in heads.items():
            if field == name and head is not None and len(head) == 16 * inner:
                present[lane, chunk] = True
                entries[lane, chunk] = np.frombuffer(head, "<u8").reshape(inner, 2)
        new, earlier = table_keys(name)
        objects.put(new, ShardTable.of(record.sequence, record.time, present, entries).to_bytes(), True)
        objects.delete(earlier)  # else each cold reader would fetch it too, to find it stale


def _inner(io: ChunkIO, name: str, layout: LaneLayout) -> int:
    return layout.chunk_rows // int(io.codecs[name].inner_rows or 1)


def inner_chunks(io: ChunkIO, layout: LaneLayout) -> dict[str, int]:
    """Inner chunks per shard of each sharded field."""
    return {name: _inner(io, name, layout) for name in sharded_fields(io)}


Shard = tuple[str, int, int]
"""``(field, lane, chunk)``."""


def _heads(io: ChunkIO, layout: LaneLayout, shards: list[Shard],
           opened: Mapping[str, ShardTable]) -> dict[Shard, bytes | None]:
    """The index of each shard: as this writer put it, else as ``opened`` holds it, else read
    from the store (None: missing or failing its checksum; its shard then serves its own index)."""
    kept = io.heads or {}
    found = {one: kept[io.key(*one)] if io.key(*one) in kept else _held(opened, *one) for one in shards}
    missing = [one for one, head in found.items() if head is None]
    ranges = [(io.key(*one), 0, io.codecs[one[0]].index_bytes(layout.chunk_rows)) for one in missing]
    for one, got in zip(missing, io.store.get_ranges(ranges) if ranges else []):
        if got is not None and len(got[0]) > CHECKSUM_BYTES:
            try:
                found[one] = bytes(io.codecs[one[0]].verified_body(got[0]))
            except ValueError:
                pass
    return found


def _held(tables: Mapping[str, ShardTable], name: str, lane: int, chunk: int) -> bytes | None:
    """The index ``name``'s table holds for chunk ``(lane, chunk)``, if it does."""
    table = tables.get(name)
    if table is None or lane >= table.present.shape[0] or chunk >= table.present.shape[1]:
        return None
    return table.entries[lane, chunk].tobytes() if table.present[lane, chunk] else None


def read_tables(objects: ChunkStore, url: str, record: CommitRecord, names: tuple[str, ...],
                inner: Mapping[str, int], lanes: int) -> dict[str, ShardTable]:
    """The tables of ``names`` stamped with ``record``, read in one round, then an earlier
    version's where a field has none (a field whose table is missing or of another commit is
    left out). Raises CorruptBufferError naming a damaged table."""
    found: dict[str, ShardTable] = {}
    absent = list(names)
    for version in range(2):
        keys = [table_keys(name)[version] for name in absent]
        blobs = objects.get_many(keys, MAX_STORED_BYTES + 1) if keys else []
        for name, key, blob in zip(absent, keys, blobs):
            table = None if blob is None else ShardTable.from_bytes(blob, key, url, lanes, inner[name])
            if table is not None and (table.sequence, table.time) == (record.sequence, record.time):
                found[name] = table
        absent = [name for name, blob in zip(absent, blobs) if blob is None]
    return found


class TabledIndexes:
    """The shard indexes a reader's tables hold, the tables read at the first lookup; a shard
    forgotten since (rewritten after the tables' commit) is left out."""

    def __init__(self, tables: Tables | None, names: tuple[str, ...]):
        """``tables``: of the sharded fields ``names`` (None: no table)."""
        self._tables, self.names = tables, tuple(sorted(names))
        self._held: dict[str, tuple[np.ndarray, ShardTable]] = {}
        """Each table's shards not forgotten since (``[lanes, chunks]`` bool), and the table."""

    def lookup(self, name: str, lanes: np.ndarray, chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Which shards ``(lanes[i], chunks[i])`` of field ``name`` its table holds, and their
        indexes as stored (``[held, inner, 2]`` uint64 ``(offset, nbytes)``, unchecked). Raises
        CorruptBufferError naming a damaged table."""
        if self._tables is not None:
            tables, self._tables = self._tables(self.names), None
            self._held = {field: (table.present.copy(), table) for field, table in tables.items()}
        if name not in self._held:
            return np.zeros(len(lanes), bool), np.empty((0, 0, 2), "<u8")
        present, table = self._held[name]
        held = (lanes < present.shape[0]) & (chunks < present.shape[1])
        held[held] = present[lanes[held], chunks[held]]
        return held, table.indexes(lanes[held], chunks[held])

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunks were rewritten: their indexes are no longer the table's."""
        for present, _ in self._held.values():
            if lane < len(present):
                present[lane, chunks[chunks < present.shape[1]]] = False
