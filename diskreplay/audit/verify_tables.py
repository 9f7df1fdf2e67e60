"""`verify`'s check of the shard index tables (`diskreplay.format.shard_table`): each one whole
(a damaged one is a problem: readers refuse it), and each one stamped with the commit checked
compared with the index each of its shards starts with (a difference is a note: a live writer
may have rewritten a shard since its last commit, and readers then read that shard's index)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..errors import CorruptBufferError
from ..format.codecs import CHECKSUM_BYTES, Codec
from ..format.commit import CommitRecord
from ..format.lanes import LaneLayout
from ..format.shard_table import MAX_STORED_BYTES, ShardTable, table_keys
from ..io import ChunkStore


def table_findings(objects: ChunkStore, chunks: ChunkStore, url: str, commit: CommitRecord, layout: LaneLayout,
                   codecs: dict[str, Codec], key_of: Callable[[str, int, int], str]) -> tuple[list[str], list[str]]:
    """``(problems, notes)`` of the tables of the sharded fields of ``codecs`` in ``objects``
    (``key_of(field, lane, chunk)``: a chunk's key in ``chunks``)."""
    problems, notes = [], []
    tabled = [(name, codec, layout.chunk_rows // codec.inner_rows, key) for name, codec in codecs.items()
              if codec.inner_rows is not None for key in table_keys(name)]
    for name, codec, inner, key in tabled:
        if (blob := objects.get(key, MAX_STORED_BYTES + 1)) is None:
            continue
        try:
            table = ShardTable.from_bytes(blob, key, url, layout.num_envs, inner)
        except CorruptBufferError as exc:
            problems.append(str(exc).removeprefix(f"{url!r}: "))
            continue
        if (table.sequence, table.time) != (commit.sequence, commit.time):
            notes.append(f"shard index table {key!r} is of commit {table.sequence}, not {commit.sequence}: "
                         f"readers do not use it")
            continue
        shards = list(zip(*(part.tolist() for part in np.nonzero(table.present))))
        heads = chunks.get_ranges([(key_of(name, lane, chunk), 0, codec.index_bytes(layout.chunk_rows))
                                   for lane, chunk in shards])
        differ = [(lane, chunk) for (lane, chunk), got in zip(shards, heads)
                  if got is None or bytes(got[0][:-CHECKSUM_BYTES]) != table.entries[lane, chunk].tobytes()]
        if differ:
            notes.append(f"shard index table {key!r} differs from the index of {len(differ)} shard(s), first "
                         f"{key_of(name, *differ[0])!r} (a writer rewrote them since its last commit): "
                         f"readers read those shards' own indexes")
    return problems, notes
