"""`read_buffer`: a buffer's committed rows as a Ray Dataset, through `BufferDatasource`."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np
import ray.data
from ray.data.block import Block, BlockAccessor, BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from .plan import ROW_ID, Pieces, ReadPlan, plan_read
from .reading import read_pieces


class BufferDatasource(Datasource):
    """The committed rows of a diskreplay buffer (sharded or not, local or remote), for
    ``ray.data.read_datasource``.

    The read is planned when the datasource is made: it reads exactly the rows each shard had
    committed then (rows committed later are not read), however often the dataset runs. One read
    task per run of chunks of one lane of one shard (several runs per task when Ray asks for
    fewer tasks than there are runs): each task opens the shards it reads read-only and reads
    whole chunks of the chosen fields only, concurrently, into blocks of at most 64 MiB.

    Blocks hold a column per chosen field (``[n]`` for scalar fields, Ray tensor columns
    ``[n, *shape]`` for the others, the field's dtype) and ``row_id`` (int64): ``buf[row_id]``
    returns the row. Rows come lane by lane in time order (shard by shard). The fields are the
    stored ones: a ``derive_next`` twin (``next_obs`` read from ``obs``) is not among them.

    Reading rows a ring overwrote after the plan (or a buffer cleared or replaced meanwhile)
    raises `StaleReadError` in the task, never other rows' values.
    """

    def __init__(self, url: str | os.PathLike[str], *, fields: Iterable[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None):
        """Plan the read of the buffer at ``url``: the stored fields ``fields`` (None: every one,
        in the buffer's order); ``storage_options`` as in `ReplayBuffer.open` (every task uses them).

        Raises NotABufferError, CorruptBufferError (as `ReplayBuffer.open`), SchemaError (a
        ``fields`` entry that is not a stored field, or a field named ``row_id``)."""
        super().__init__()  # type: ignore[no-untyped-call]
        self.plan: ReadPlan = plan_read(url, fields, storage_options)

    def get_name(self) -> str:
        return "ReadBuffer"

    @property
    def num_rows(self) -> int:
        """Rows the read returns."""
        return self.plan.pieces.rows

    def estimate_inmemory_data_size(self) -> int:
        """Bytes of the blocks, exactly: rows x (the chosen fields' row bytes + 8 for the row id)."""
        return self.num_rows * self.plan.row_bytes

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """About ``parallelism`` tasks (fewer for a buffer of fewer chunk runs; one for an
        empty buffer, which reads nothing)."""
        schema = BlockAccessor.batch_to_block(one_row(self.plan)).schema
        tasks = []
        for pieces in self.plan.tasks(parallelism):
            metadata = BlockMetadata(num_rows=pieces.rows, size_bytes=pieces.rows * self.plan.row_bytes,
                                     input_files=None, exec_stats=None)
            tasks.append(ReadTask(_TaskRead(self.plan, pieces), metadata, schema=schema,
                                  per_task_row_limit=per_task_row_limit))
        return tasks


class _TaskRead:
    """A read task's function: its pieces of the plan, as blocks."""

    def __init__(self, plan: ReadPlan, pieces: Pieces):
        self.plan, self.pieces = plan, pieces

    def __call__(self) -> Iterator[Block]:
        for columns in read_pieces(self.plan, self.pieces):
            yield BlockAccessor.batch_to_block(columns)


def one_row(plan: ReadPlan) -> dict[str, np.ndarray]:
    """A row of every column of a read: what gives its schema (zero rows of a field of several
    dimensions would not make a tensor column)."""
    columns = {name: np.zeros((1, *field.shape), field.dtype) for name, field in plan.fields.items()}
    return {**columns, ROW_ID: np.zeros(1, np.int64)}


def read_buffer(url: str | os.PathLike[str], *, fields: Iterable[str] | None = None,
                storage_options: Mapping[str, Any] | None = None, **ray_kwargs: Any) -> ray.data.Dataset:
    """The committed rows of the buffer at ``url`` as a ``ray.data.Dataset`` (`BufferDatasource`).

    Args:
        url: a buffer or a sharded buffer: a local path every node of the cluster reaches (a
            shared file system), or an fsspec URL (``s3://``...).
        fields: the stored fields to read (the others are not read at all); None: every one.
        storage_options: as in `ReplayBuffer.open`, for the planning and for every read task.
        ray_kwargs: passed to ``ray.data.read_datasource`` (``override_num_blocks``,
            ``concurrency``, ``ray_remote_args``...).

    Returns:
        A dataset of columns ``{field: [n, *shape], "row_id": [n] int64}``: every row the buffer
        had committed when this was called, once.

    Raises:
        NotABufferError: nothing (or something else) is stored at ``url``, as `ReplayBuffer.open`.
        CorruptBufferError: the buffer's metadata is damaged; while the dataset runs: a chunk
            missing or damaged.
        SchemaError: ``fields`` names a field that is not stored.
        StaleReadError: while the dataset runs: a ring overwrote rows not yet read (or the
            buffer was cleared or replaced).
    """
    source = BufferDatasource(url, fields=fields, storage_options=storage_options)
    return cast(ray.data.Dataset, ray.data.read_datasource(source, **ray_kwargs))
