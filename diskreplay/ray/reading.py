"""A read task's work: its pieces of a `ReadPlan` read as whole chunks, field by field, from the
shards opened read-only in the task; each run of one lane's pieces becomes a batch of columns.
No Ray here.

Pinning. A task reads only steps its plan's commits held. A ring's writer commits a raised
first readable step before it overwrites a row (`diskreplay.storage.stale`), so once a run's
chunks are read, the newest commit of its shard tells whether they still held the run's rows:
if that commit's first readable step of the lane passed the run's first step, the rows may be
the writer's next round, and the read raises `StaleReadError` instead of returning them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import StaleReadError
from ..format.commit import CommitRecord
from ..format.lanes import row_ids
from ..storage import BufferStorage, Options, open_storage
from .plan import ROW_ID, Pieces, ReadPlan

BATCH_BYTES = 64 << 20
"""Bytes of the chosen fields a task reads, and hands to Ray as one block, at most (at least one chunk)."""

TASK_CACHE_BYTES = 1 << 20
"""Chunk cache of the shards a task opens: its reads bypass it."""

Columns = dict[str, np.ndarray]


def read_pieces(plan: ReadPlan, pieces: Pieces) -> Iterator[Columns]:
    """The rows of ``pieces``: batches ``{field: [n, *shape], "row_id": [n] int64}``, in order.

    Raises StaleReadError (rows a ring overwrote since the plan's commit), CorruptBufferError (a
    chunk missing or damaged), NotABufferError (the buffer is gone)."""
    storages: dict[int, BufferStorage] = {}
    try:
        for start, stop in runs(plan, pieces):
            lane = int(pieces.lane[start])
            shard, shard_lane = divmod(lane, plan.shard_envs)
            if shard not in storages:
                storages[shard] = open_storage(plan.shard_urls[shard], "r", Options(
                    plan.storage_options, TASK_CACHE_BYTES, memory_map=False))
            yield read_run(plan, storages[shard], shard, shard_lane, pieces.part(start, stop))
    finally:
        for storage in storages.values():
            storage.close()


def runs(plan: ReadPlan, pieces: Pieces) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` of consecutive pieces of one lane holding at most `BATCH_BYTES` (at
    least one piece)."""
    most = max(1, BATCH_BYTES // max(plan.row_bytes * plan.layout.chunk_rows, 1))
    start = 0
    for stop in range(1, len(pieces) + 1):
        if stop == len(pieces) or pieces.lane[stop] != pieces.lane[start] or stop - start == most:
            yield start, stop
            start = stop


def read_run(plan: ReadPlan, storage: BufferStorage, shard: int, lane: int, run: Pieces) -> Columns:
    """One lane's pieces ``run`` (consecutive steps), their chunks read at once."""
    first, end = int(run.first[0]), int(run.end[-1])
    check_pinned(plan, shard, lane, first, end, storage.record)
    steps = np.arange(first, end, dtype=np.int64)
    chunk, offset = plan.layout.chunk_and_offset(steps)
    chunks, where = np.unique(chunk, return_inverse=True)
    stored = storage.read_chunks(tuple(plan.fields), lane, chunks)
    if plan.layout.lane_capacity is not None:
        check_pinned(plan, shard, lane, first, end, storage.read_newest())
    index = where * plan.layout.chunk_rows + offset
    start = int(index[0])
    if int(index[-1]) - start == len(index) - 1 and bool((np.diff(index) == 1).all()):
        columns = {name: values[start:start + len(index)] for name, values in stored.items()}
    else:  # the run wraps around the ring
        columns = {name: values.take(index, axis=0) for name, values in stored.items()}
    columns[ROW_ID] = row_ids(shard * plan.shard_envs + lane, steps, plan.num_envs)
    return columns


def check_pinned(plan: ReadPlan, shard: int, lane: int, first: int, end: int, record: CommitRecord) -> None:
    """Raises StaleReadError unless ``record`` (the shard's newest commit) still holds steps
    ``[first, end)`` of ``lane``: not retired, and committed (a buffer replaced since holds fewer)."""
    committed = int(record.committed[lane])
    readable = min(max(int(record.lower[lane]), plan.layout.oldest(committed)), committed)
    if first >= readable and end <= committed:
        return
    ids = row_ids(shard * plan.shard_envs + lane, np.arange(first, min(end, first + 3)), plan.num_envs).tolist()
    where = plan.shard_urls[shard]
    raise StaleReadError(
        f"{where!r}: rows {ids}... (lane {lane}, steps {first} to {end - 1}) are no longer in the buffer: the read "
        f"was planned at commit {plan.sequences[shard]}, and commit {record.sequence} holds steps {readable} to "
        f"{committed - 1} of that lane (a ring overwrote them, or the buffer was cleared or replaced); "
        f"read the buffer again (read_buffer) to read what it holds now")
