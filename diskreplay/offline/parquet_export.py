"""Export a buffer's rows as LeRobot / Hugging Face-style Parquet, which the ``"parquet"`` import reads back.

The output is a folder: ``<dest>/data/chunk-000/file-<n>.parquet``, a new file every
``rows_per_file`` rows, row groups of at most ``batch_rows`` rows. Columns: ``episode_index``,
``frame_index``, ``index`` (int64), then one column per field named by `parquet_name`
(``obs`` -> ``observation.state``, ``reward`` -> ``next.reward``, ``terminated`` -> ``next.done``,
``truncated`` -> ``next.truncated``, ``next_obs`` -> ``next.observation.state``; other fields keep
their names). Scalar fields are plain columns, vector fields fixed-size lists (nested for more
dimensions). A ragged field ``Field((None, *T), ...)`` is a ``large_list`` column (of fixed-size
lists for ``T``), a text field a ``string`` column (UTF-8), an encoded frame field (``codec=``) its
decoded pixels, like a fixed uint8 field: any Parquet reader sees the frames, and the import
encodes them again with the field's codec (PNG gives the same bytes back; JPEG and video encode
once more, with the loss that adds). The schema metadata holds ``diskreplay_export`` and
``diskreplay_fields`` (JSON: each column's field spec, `Field.to_json`: shape with null for the
varying axis, dtype ``"str"``, ``length_of``, ``codec``, ``quality``), which the import follows.

Lanes are written one after another, each in time order; an episode ends after a row whose end
flag is set, and at each lane's end, so a lane's unfinished episode is a separate episode
(imported back as truncated there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..audit.rows import episode_fields, iter_rows, readable
from ..episodes import end_flags
from .formats.parquet import PLACE_COLUMNS, parquet_field_name, require_arrow, require_pyarrow
from .formats.parquet_fields import FIELDS_KEY, fields_metadata

EXPORT_NAMES = {"obs": "observation.state", "next_obs": "next.observation.state", "reward": "next.reward",
                "terminated": "next.done", "truncated": "next.truncated", "action": "action"}
ROWS_PER_FILE = 1_000_000


def parquet_name(field: str) -> str:
    """The column field ``field`` is exported under (the inverse of the import's `PARQUET_NAMES`)."""
    return EXPORT_NAMES.get(field, field)


def check_parquet_names(fields: list[str]) -> None:
    """Refuses fields whose exported column would be read back as another field."""
    for field in fields:
        column = parquet_name(field)
        if column in PLACE_COLUMNS or parquet_field_name(column) != field:
            raise ValueError(f"field {field!r} cannot be exported to Parquet: its column {column!r} "
                             f"would be read back as another field; rename it first")


def write_parquet(buf: Any, path: str, batch_rows: int, compress: bool, bar: Any,
                  rows_per_file: int = ROWS_PER_FILE) -> None:
    """Writes every readable row of ``buf`` into the new folder ``path`` (see the module docstring)."""
    pq, pa = require_pyarrow(), require_arrow()

    check_parquet_names(list(buf.fields))
    schema = _schema(pa, buf.fields)
    folder = os.path.join(path, "data", "chunk-000")
    os.makedirs(folder)
    writer, in_file, files = None, 0, 0
    try:
        for part in _rows(buf, batch_rows):
            n = len(part["index"])
            if writer is None or in_file + n > rows_per_file and in_file:
                if writer is not None:
                    writer.close()
                writer = pq.ParquetWriter(os.path.join(folder, f"file-{files:06d}.parquet"), schema,
                                          compression="zstd" if compress else "none")
                files, in_file = files + 1, 0
            writer.write_batch(_record_batch(pa, schema, part, buf.fields), row_group_size=batch_rows)
            in_file += n
            bar.update(n)
        if writer is None:  # no rows: one empty file keeps the schema
            writer = pq.ParquetWriter(os.path.join(folder, "file-000000.parquet"), schema)
    finally:
        if writer is not None:
            writer.close()


def _schema(pa: Any, fields: dict) -> Any:
    """The arrow schema: the three placement columns, then one column per field."""
    columns = [pa.field(name, pa.int64(), nullable=False) for name in ("episode_index", "frame_index", "index")]
    for name, spec in fields.items():
        typ = pa.string() if spec.text else pa.from_numpy_dtype(spec.dtype)
        for size in reversed(spec.shape):
            typ = pa.list_(typ, size)
        if spec.varies and not spec.text:
            typ = pa.large_list(typ)
        columns.append(pa.field(parquet_name(name), typ, nullable=False))
    specs = fields_metadata({parquet_name(name): spec for name, spec in fields.items()})
    return pa.schema(columns, metadata={"diskreplay_export": "1", FIELDS_KEY: specs})


def _record_batch(pa: Any, schema: Any, part: dict[str, Any], fields: dict) -> Any:
    """One record batch of ``part`` (fields plus the placement columns) in ``schema``."""
    arrays = [pa.array(part[name]) for name in ("episode_index", "frame_index", "index")]
    for name, spec in fields.items():
        if spec.text:
            arrays.append(pa.array(part[name].tolist(), pa.string()))
            continue
        rows = part[name]
        values = np.ascontiguousarray(rows.values if spec.varies else rows)
        array = pa.array(values.reshape(-1))
        for size in reversed(spec.shape):
            array = pa.FixedSizeListArray.from_arrays(array, size)
        if spec.varies:  # the rows' values end to end, cut by their offsets
            array = pa.LargeListArray.from_arrays(pa.array(rows.offsets, pa.int64()), array)
        arrays.append(array)
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _rows(buf: Any, batch_rows: int) -> Iterator[dict[str, Any]]:
    """Row slices of every field, lane after lane, with ``episode_index``, ``frame_index`` and ``index``."""
    ends = episode_fields(buf)
    names = list(buf.fields)
    read = names + [k for k in ends if k not in names]
    episode, frame, index = 0, 0, 0
    for lane, lo, hi in readable(buf):
        if hi <= lo:
            continue
        for part in iter_rows(buf, read, lane, lo, hi, batch_rows):
            n = len(part[read[0]])
            done = end_flags(part, ends) if ends else np.zeros(n, bool)
            starts = np.concatenate([[0], np.cumsum(done[:-1])]).astype(np.int64)  # episodes begun before row
            episodes = episode + starts
            first = np.zeros(n, np.int64)
            first[1:] = np.where(done[:-1], np.arange(1, n), 0)
            first = np.maximum.accumulate(first)
            frames = np.where(starts == 0, frame + np.arange(n), np.arange(n) - first)
            out = {k: part[k] for k in names}
            out.update(episode_index=episodes, frame_index=frames.astype(np.int64),
                       index=index + np.arange(n, dtype=np.int64))
            episode, frame, index = int(episodes[-1]) + int(done[-1]), int(frames[-1]) + 1, index + n
            frame = 0 if done[-1] else frame
            yield out
        if frame:  # the lane's last episode did not end: the next lane starts another
            episode, frame = episode + 1, 0
