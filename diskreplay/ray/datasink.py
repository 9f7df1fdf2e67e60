"""`write_buffer`: a Ray Dataset written into a new sharded buffer, through `BufferDatasink`."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import ray.data
from ray.data.block import Block
from ray.data.datasource import Datasink, WriteResult

from ..buffer import ReplayBuffer
from ..buffer.setup import plan_buffer, prepare_location
from ..buffer.sharding import declare_shards
from ..format.keys import FAILED_WRITE_KEY, OWN_GROUP
from ..format.schema import Field
from ..format.shards import check_shards, shard_url
from ..io import ChunkStore, open_chunkstore
from ..storage import DEFAULT_CACHE_BYTES
from .columns import block_columns, fields_of_columns, fields_of_schema
from .plan import absolute

log = logging.getLogger(__name__)
WRITE_CACHE_BYTES = 64 << 20
"""A write task's chunk cache beside its staging (8 chunks): what it holds of a block's rows."""


@dataclass(frozen=True)
class NewShards:
    """How every shard of the new buffer is made (all alike, as a sharded buffer's must be)."""

    url: str
    capacity: int | None
    chunk_rows: int | None
    compression: str | None
    episode_end: str | tuple[str, ...] | None
    storage_options: Mapping[str, Any] | None

    def create(self, shard: int, fields: Mapping[str, Field], commit: bool) -> ReplayBuffer:
        """Shard ``shard``, new and empty (replacing what a failed try of its task left)."""
        plan = plan_buffer(shard_url(self.url, shard), fields, self.capacity, 1, self.chunk_rows, self.compression,
                           None, DEFAULT_CACHE_BYTES, self.episode_end, (), None)[0]
        chunk_bytes = plan.config.layout.chunk_rows * plan.config.schema.row_bytes
        return ReplayBuffer.create(shard_url(self.url, shard), fields, self.capacity, chunk_rows=self.chunk_rows,
                                   compression=self.compression, episode_end=self.episode_end,
                                   storage_options=self.storage_options, overwrite=True, break_lock=True,
                                   commit=commit, cache_bytes=WRITE_CACHE_BYTES + 8 * chunk_bytes)


class BufferDatasink(Datasink[dict[str, int]]):
    """Writes a dataset into a new sharded buffer at ``url`` (for ``Dataset.write_datasink``).

    Each write task writes one shard, its own (shard ``i`` for task ``i``): a buffer of one lane
    holding the task's rows in order, committed once they are all written (a task retried
    after a failure starts its shard again). `on_write_complete` then declares the sharded
    root, last: until then nothing at ``url`` opens as a buffer, and a failed write
    (`on_write_failed`) removes what it wrote. The result is an ordinary sharded buffer.

    Episode ends come from the end fields (``done``, or ``terminated`` and ``truncated``; or
    ``episode_end=``) as in `ReplayBuffer.create`. An episode cut by the boundary between two
    tasks' rows is two episodes, the first left open (repartition by episode to avoid it).
    """

    def __init__(self, url: str | os.PathLike[str], fields: Mapping[str, Field] | None = None, *,
                 capacity: int | None = None, chunk_rows: int | None = None, compression: str | None = "zstd",
                 episode_end: str | tuple[str, ...] | None = "auto", overwrite: bool = False,
                 storage_options: Mapping[str, Any] | None = None):
        """``fields``: the buffer's fields (None: one per column of the dataset's schema, see
        `write_buffer`); the other arguments as in `write_buffer`. Raises ValueError /
        SchemaError for ``fields`` and the buffer's arguments, before anything is written."""
        self.shards = NewShards(absolute(url), capacity, chunk_rows, compression, episode_end, storage_options)
        self.fields = None if fields is None else dict(fields)
        self.overwrite = overwrite
        self._started = False
        if self.fields is not None:
            self._check()

    def _check(self) -> None:
        assert self.fields is not None
        plan_buffer(shard_url(self.shards.url, 0), self.fields, self.shards.capacity, 1, self.shards.chunk_rows,
                    self.shards.compression, None, DEFAULT_CACHE_BYTES, self.shards.episode_end, (), None)

    def get_name(self) -> str:
        return "WriteBuffer"

    @property
    def supports_distributed_writes(self) -> bool:
        return True

    def on_write_start(self, schema: pa.Schema | None = None) -> None:
        """Driver: the fields (from ``schema`` if none were given) checked, and ``url`` made
        ready: BufferExistsError if something is there (unless ``overwrite``: then it is removed)."""
        if self.fields is None and schema is not None:
            self.fields = fields_of_schema(schema, self.shards.url)
            self._check()
        prepare_location(self.shards.url, self.shards.storage_options, self.overwrite, False, None)
        self._started = True

    def write(self, blocks: Iterable[Block], ctx: Any) -> dict[str, int]:
        """A write task: shard ``ctx.task_idx`` holding ``blocks``' rows, committed; returns
        ``{"shard": i, "rows": n}``. Raises SchemaError naming a column that does not fit. A task
        that fails or is cancelled (Ray cancels the running tasks of a failed write, which the
        driver has cleared meanwhile) removes its shard before it raises; so does a task that
        commits after the driver cleared a failed write, raising RuntimeError."""
        shard = int(ctx.task_idx)
        rows = 0
        try:
            with self.shards.create(shard, self._fields(), commit=False) as buf:
                for block in blocks:
                    columns = block_columns(block, buf.fields, self.shards.url)
                    buf.extend(columns)
                    rows += len(next(iter(columns.values()))) if columns else 0
                buf.flush()
        except BaseException:
            self._discard(shard)
            raise
        if self._root().exists(FAILED_WRITE_KEY):
            self._discard(shard)
            raise RuntimeError(f"{self.shards.url!r}: the write failed while task {shard} ran; its shard is removed")
        return {"shard": shard, "rows": rows}

    def _root(self) -> ChunkStore:
        return open_chunkstore(self.shards.url, self.shards.storage_options)

    def _discard(self, shard: int) -> None:
        """Remove what this task wrote of shard ``shard`` (a failure to do so is logged: the
        task's own error is the one to raise)."""
        try:
            open_chunkstore(shard_url(self.shards.url, shard), self.shards.storage_options).clear()
        except Exception as exc:
            log.warning("%r: shard %d of a failed write was not removed (%s: %s)", self.shards.url, shard,
                        type(exc).__name__, exc)

    def _fields(self) -> dict[str, Field]:
        if self.fields is None:
            raise ValueError(f"{self.shards.url!r}: the dataset has no schema to make fields from: pass fields=")
        return self.fields

    def on_write_complete(self, write_result: WriteResult[dict[str, int]]) -> None:
        """Driver: shards no task wrote made empty, then the root declared (the buffer opens)."""
        written = {result["shard"] for result in write_result.write_returns}
        count = check_shards(max(written, default=0) + 1)
        for shard in sorted(set(range(count)) - written):
            self.shards.create(shard, self._fields(), commit=True).close()
        declare_shards(self._root(), count)

    def on_write_failed(self, error: Exception) -> None:
        """Driver: what the write wrote at ``url`` removed (nothing there opens). A note of the
        failure stays (`FAILED_WRITE_KEY`, written first): a task that commits later finds it and
        removes its own shard. The next buffer made at ``url`` replaces the note."""
        if not self._started:
            return
        root = self._root()
        root.put(FAILED_WRITE_KEY, json.dumps({"error": _first_cause(error)}).encode())
        shards = {key.split("/", 1)[0] for key in root.sizes() if "/" in key} - {OWN_GROUP}
        for name in sorted(shards):
            open_chunkstore(f"{self.shards.url}/{name}", self.shards.storage_options).clear()


def _first_cause(error: BaseException) -> str:
    """The error that started ``error``'s chain of causes (``__cause__``, or a Ray task error's
    ``cause``): its type and the first line of its message."""
    for _ in range(32):  # a chain of causes ends; a cycle is cut here
        cause = error.__cause__ or getattr(error, "cause", None)
        if not isinstance(cause, BaseException):
            break
        error = cause
    message = str(error).strip()
    return f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"[:300]


def write_buffer(ds: ray.data.Dataset, url: str | os.PathLike[str], fields: Mapping[str, Field] | None = None, *,
                 capacity: int | None = None, shards: int | None = None, chunk_rows: int | None = None,
                 compression: str | None = "zstd", episode_end: str | tuple[str, ...] | None = "auto",
                 overwrite: bool = False, storage_options: Mapping[str, Any] | None = None,
                 **ray_kwargs: Any) -> None:
    """Write ``ds`` into a new sharded buffer at ``url``, one shard per write task (`BufferDatasink`).

    Args:
        ds: the rows; a column per field, in order (episodes' rows consecutive).
        url: where the buffer is made: a local path every node reaches, or an fsspec URL.
        fields: name -> `Field` of the columns to write; None: every column of ``ds.schema()``
            (bool, integer and float columns, fixed-shape tensor columns, fixed-size lists) but
            ``row_id``, the row ids `read_buffer` adds (a buffer copied keeps its data, not them).
        capacity: rows each shard keeps (a ring); None: every row (dataset mode).
        shards: the number of shards (``ds`` repartitioned into that many blocks, in order);
            None: one shard per block of ``ds`` as it is.
        chunk_rows: as in `ReplayBuffer.create`.
        compression: as in `ReplayBuffer.create`.
        episode_end: as in `ReplayBuffer.create`.
        overwrite: replace a buffer at ``url`` (removed when the write starts).
        storage_options: as in `ReplayBuffer.create`, for the driver and every write task.
        ray_kwargs: passed to ``Dataset.write_datasink`` (``concurrency``, ``ray_remote_args``).

    Raises:
        SchemaError: a column that cannot be a field (naming it, its type and what was expected),
            or a block whose column does not fit its field. ValueError: a bad argument.
        BufferExistsError: something is at ``url`` (without ``overwrite``; what a failed write left
            is nothing). Ray's errors of a failed task (with the error above as cause); the write
            then leaves only a note of the failure at ``url`` (`FAILED_WRITE_KEY`).
    """
    url = os.fspath(url)
    if fields is None:
        schema = ds.schema()
        if schema is None:
            raise ValueError(f"{url!r}: the dataset has no schema to make fields from (no rows?): pass fields=")
        fields = fields_of_columns(schema.names, schema.types, url)
    sink = BufferDatasink(url, fields, capacity=capacity, chunk_rows=chunk_rows, compression=compression,
                          episode_end=episode_end, overwrite=overwrite, storage_options=storage_options)
    if shards is not None:
        ds = ds.repartition(check_shards(shards))
    ds.write_datasink(sink, **ray_kwargs)
