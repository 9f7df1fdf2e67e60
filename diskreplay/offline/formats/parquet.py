"""LeRobot- and Hugging Face datasets-style Parquet: a ``.parquet`` file, or a folder of them.

Files: a single file, else every ``*.parquet`` under ``<dir>/data`` (LeRobot v2
``data/chunk-*/episode_*.parquet``, HF ``data/*.parquet``) or, without a ``data`` folder, under
``<dir>``; read in path order. Rows must be stored ordered by ``(episode_index, frame_index)``, as
LeRobot and HF write them (checked while streaming: ImportFormatError otherwise).

Columns: ``episode_index`` (integer, required) and ``frame_index`` / ``index`` (optional) only
place rows: they become no field. Numeric and bool columns become scalar fields; list,
large-list and fixed-size-list columns (nested for several dimensions) of numbers become vector
fields of the first row's shape (every row must have it); string and large-string columns become
text fields (``Field((), "str")``). Other columns (binary images, structs, dates) are skipped with
a warning. Names: `PARQUET_NAMES` (``observation.state`` ->
``obs``, ``next.reward`` -> ``reward``, ``next.done`` -> ``terminated``, ``next.truncated`` ->
``truncated``, ...), else `d4rl_field_name` (dots become ``_``: ``observation.environment_state``
-> ``observation_environment_state``).

Field specs: a file written by ``diskreplay export --format parquet`` names every field's spec in
its schema metadata (``diskreplay_fields``, `parquet_fields`); the ragged (``large_list``
columns, with their ``length_of``), text and encoded frame fields (pixel columns, encoded again by
the codec) declared there are imported as declared. Without it a variable-length list column is
a fixed field of its first row's shape.

Episode ends: every episode's last frame ends it. ``truncated`` (bool) is always a field: at a
last frame where no end flag is set (no ``next.done``, or ``next.done`` false), it is set; so an
episode ends terminated where LeRobot's ``next.done`` says so, else truncated.

Streaming: record batches of about ``batch_rows`` rows, one row group decoded at a time; row
counts come from the footers (progress, chunk sizing) and every file must hold exactly the rows
its footer claims. Null values, unreadable files and wrong column types are ImportFormatErrors
naming the file and column.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import SchemaError
from ...format.schema import Field, Schema
from ...io import local_path
from ..naming import d4rl_field_name
from ..source import Batch, ImportFormatError, PendingSlices, Source, as_bool_flags, field_for
from .parquet_fields import check_column_type, check_lengths, declared_fields, ragged_rows, text_rows

PARQUET_NAMES = {"observation.state": "obs", "observation": "obs", "next.observation.state": "next_obs",
                 "next.reward": "reward", "next.done": "terminated", "next.terminated": "terminated",
                 "next.truncated": "truncated", "action": "action"}
PLACE_COLUMNS = ("episode_index", "frame_index", "index")  # row placement only: no field
FLAG_FIELDS = ("terminated", "truncated")
MAGIC = b"PAR1"


def require_pyarrow() -> Any:
    """The ``pyarrow.parquet`` module, or ImportError saying how to install it."""
    require_arrow()
    import pyarrow.parquet as pq  # type: ignore[import-untyped, unused-ignore]

    return pq


def require_arrow() -> Any:
    """The ``pyarrow`` module (imported at call time: an optional dependency), or ImportError."""
    try:
        import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("Parquet / Arrow import and export need pyarrow: pip install pyarrow") from e
    return pa


def parquet_field_name(column: str) -> str:
    """The field a Parquet column is imported as (`PARQUET_NAMES`, else `d4rl_field_name`)."""
    return PARQUET_NAMES.get(column) or d4rl_field_name(column)


def parquet_files(path: str) -> list[str]:
    """The Parquet files of ``path``: itself, or every ``*.parquet`` under its ``data`` folder
    (or under it when it has none), in path order."""
    if not os.path.isdir(path):
        return [path]
    root = Path(path) / "data" if os.path.isdir(os.path.join(path, "data")) else Path(path)
    return [str(p) for p in sorted(root.rglob("*.parquet")) if p.is_file()]


def is_parquet(path: str) -> bool:
    """``path`` is a Parquet file (by magic) or a folder holding ``*.parquet`` files."""
    if os.path.isdir(path):
        return bool(parquet_files(path))
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


class ParquetSource(Source):
    """The rows of one or more Parquet files, in file order, as one lane."""

    def __init__(self, src: str, batch_rows: int):
        self.pq = require_pyarrow()
        self.src, self.batch_rows = src, batch_rows
        self.files = parquet_files(local_path(src))
        if not self.files:
            raise ImportFormatError(f"{src!r}: no .parquet files found")
        self.counts = [self._open(f).metadata.num_rows for f in self.files]
        self.rows = sum(self.counts)
        self.columns = self._columns(self.files[0])
        self.fields = {name: field for name, (_, field) in self.columns.items()}
        self.fields.setdefault("truncated", Field((), np.dtype(bool)))

    def _open(self, file: str) -> Any:
        """The ``ParquetFile`` of ``file``; ImportFormatError if its footer cannot be read."""
        try:
            return self.pq.ParquetFile(file)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-Parquet data
            raise ImportFormatError(f"{file!r}: not a readable Parquet file ({e})") from e

    def _columns(self, file: str) -> dict[str, tuple[str, Field]]:
        """``{field: (column, Field)}`` from the schema (and first row, for list lengths) of ``file``."""
        schema = self._open(file).schema_arrow
        declared = declared_fields(file, schema.metadata)
        if "episode_index" not in schema.names:
            raise ImportFormatError(f"{file!r}: no 'episode_index' column (columns: {schema.names})")
        for name in ("episode_index", "frame_index", "index"):
            if name in schema.names and not _is_integer(schema.field(name).type):
                raise ImportFormatError(f"{file!r}: column {name!r} must be integers, "
                                        f"got {schema.field(name).type}")
        first = self._first_row(file, [n for n in schema.names if _has_variable_list(schema.field(n).type)
                                       and not (n in declared and declared[n].varies)])
        found: dict[str, tuple[str, Field]] = {}
        for column in schema.names:
            if column in PLACE_COLUMNS:
                continue
            field = self._column_field(file, column, schema.field(column).type, first, declared.get(column))
            if field is None:
                continue
            name = parquet_field_name(column)
            if name in found:
                raise ImportFormatError(f"{file!r}: columns {found[name][0]!r} and {column!r} both map "
                                        f"to field {name!r}")
            found[name] = (column, field)
        if not found:
            raise ImportFormatError(f"{file!r}: no numeric or text columns to import")
        try:
            Schema({name: field for name, (_, field) in found.items()})
        except SchemaError as e:  # a length_of naming no ragged field imported
            raise ImportFormatError(f"{file!r}: the fields declared in its schema metadata do not fit ({e})") from None
        return found

    def _first_row(self, file: str, columns: list[str]) -> Any:
        """The first row of ``columns`` of ``file`` (a one-row record batch), or None when it has no
        rows or no columns are asked for."""
        if not columns:
            return None
        try:
            return next(self._open(file).iter_batches(batch_size=1, columns=columns), None)
        except Exception as e:
            raise ImportFormatError(f"{file!r}: unreadable ({e})") from e

    def _column_field(self, file: str, column: str, typ: Any, first: Any, declared: Field | None) -> Field | None:
        """The field of one column (``declared``: its spec in the file's metadata, if any), or None
        (with a warning) when it holds neither numbers nor text."""
        where = f"{file!r}: column {column!r}"
        pa = require_arrow()
        if declared is not None and declared.varies:
            check_column_type(where, declared, typ, pa)
            return declared
        if pa.types.is_string(typ) or pa.types.is_large_string(typ):
            return Field((), "str")
        try:
            listed = first is not None and column in first.schema.names
            base, shape = _value_type(typ, first.column(column) if listed else None)
        except TypeError as e:
            warnings.warn(f"{where}: skipped ({e})", stacklevel=4)
            return None
        dtype = np.dtype(bool) if parquet_field_name(column) in FLAG_FIELDS else np.dtype(base.to_pandas_dtype())
        field = field_for(parquet_field_name(column), shape, dtype, where)
        if field is not None and declared is not None and declared.codec is not None:
            if (shape, dtype) != (declared.shape, declared.dtype):
                raise ImportFormatError(f"{where}: declared {declared}, the column holds rows of {shape} {dtype}")
            return declared
        return field

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        pending = PendingSlices(self.batch_rows)
        for batch in _with_ends(self._checked(self._raw())):
            yield from pending.add(batch)
        yield from pending.drain()

    def _raw(self) -> Iterator[tuple[str, np.ndarray, np.ndarray | None, Batch]]:
        """``(file, episode_index, frame_index or None, fields)`` per record batch, file after file."""
        wanted = [column for column, _ in self.columns.values()]
        for file, count in zip(self.files, self.counts, strict=True):
            pf = self._open(file)
            names = pf.schema_arrow.names
            read = ["episode_index", *(["frame_index"] if "frame_index" in names else []), *wanted]
            seen = 0
            try:
                for rb in pf.iter_batches(batch_size=self.batch_rows, columns=read):
                    seen += rb.num_rows
                    if seen > count:
                        break
                    yield file, *self._decode(file, rb, "frame_index" in names, seen - rb.num_rows)
            except ImportFormatError:
                raise
            except Exception as e:
                raise ImportFormatError(f"{file!r}: unreadable ({e})") from e
            if seen != count:
                raise ImportFormatError(f"{file!r}: footer claims {count} rows, the data holds {seen}")

    def _decode(self, file: str, rb: Any, has_frames: bool, first_row: int
                ) -> tuple[np.ndarray, np.ndarray | None, Batch]:
        """The placement columns and the fields of one record batch (rows from ``first_row`` of
        ``file`` on), as numpy arrays (`Ragged` rows for ragged fields, ``str`` for text)."""
        episodes = _plain(file, "episode_index", rb.column("episode_index"), ())
        frames = _plain(file, "frame_index", rb.column("frame_index"), ()) if has_frames else None
        batch: dict[str, Any] = {}
        for name, (column, field) in self.columns.items():
            values, where = rb.column(column), f"{file!r}: column {column!r}"
            if field.varies:
                check_column_type(where, field, values.type, require_arrow())
                batch[name] = text_rows(where, values) if field.text else \
                    ragged_rows(where, values, field.shape, first_row)
                continue
            batch[name] = _plain(file, column, values, field.shape)
            if batch[name].dtype != field.dtype and not field.dtype == np.bool_:
                raise ImportFormatError(f"{where} is {batch[name].dtype}, the first file's is {field.dtype}")
        check_lengths(file, batch, self.fields, {name: column for name, (column, _) in self.columns.items()},
                      first_row)
        return episodes, frames, as_bool_flags(batch, self.fields)

    def _checked(self, raw: Iterator[tuple[str, np.ndarray, np.ndarray | None, Batch]]
                 ) -> Iterator[tuple[np.ndarray, Batch]]:
        """``(episode_index, fields)`` per batch, after checking the (episode, frame) order."""
        last: tuple[int, int] | None = None
        for file, episodes, frames, batch in raw:
            if not len(episodes):
                continue
            keys = np.stack([episodes, frames if frames is not None else np.arange(len(episodes))], 1)
            if last is not None:
                keys = np.concatenate([np.asarray([last]), keys])
            step = np.diff(keys, axis=0)
            bad = (step[:, 0] < 0) | ((step[:, 0] == 0) & (step[:, 1] <= 0) & (frames is not None))
            if bad.any():
                raise ImportFormatError(f"{file!r}: rows are not ordered by (episode_index, frame_index) "
                                        f"near episode {int(keys[int(np.argmax(bad)) + 1, 0])}")
            last = (int(keys[-1, 0]), int(keys[-1, 1]) if frames is not None else -1)
            yield episodes, batch


def _has_variable_list(typ: Any) -> bool:
    """Whether an arrow type holds a (large) list of variable length somewhere in its nesting."""
    types = require_arrow().types
    while types.is_fixed_size_list(typ) or types.is_list(typ) or types.is_large_list(typ):
        if not types.is_fixed_size_list(typ):
            return True
        typ = typ.value_type
    return False


def _is_integer(typ: Any) -> bool:
    return bool(require_arrow().types.is_integer(typ))


def _value_type(typ: Any, first: Any) -> tuple[Any, tuple[int, ...]]:
    """(numeric arrow type, row shape) of a column type; lists take their length from ``first``
    (a one-row array or None). TypeError for types that hold no numbers."""
    pa = require_arrow()

    shape: list[int] = []
    while pa.types.is_fixed_size_list(typ) or pa.types.is_list(typ) or pa.types.is_large_list(typ):
        if pa.types.is_fixed_size_list(typ):
            shape.append(typ.list_size)
        else:
            if first is None or len(first) == 0 or not first.is_valid()[0].as_py():
                raise TypeError("a variable-length list column needs a first row to give its length")
            shape.append(len(first[0].values))
        first = None if first is None else first.flatten()
        typ = typ.value_type
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)):
        raise TypeError(f"type {typ} holds no numbers")
    return typ, tuple(shape)


def _plain(file: str, column: str, values: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A numeric arrow column as a numpy array ``[rows, *shape]``; lists must have ``shape``."""
    rows = len(values)
    if values.null_count:
        raise ImportFormatError(f"{file!r}: column {column!r} holds null values")
    for size in shape:
        if not hasattr(values, "value_lengths"):
            raise ImportFormatError(f"{file!r}: column {column!r} has rows of another type than the first "
                                    f"file's: {values.type}, expected lists of {size}")
        flat = values.flatten()
        if len(flat) != rows * size or (rows and values.value_lengths().to_numpy(zero_copy_only=False).min() != size):
            raise ImportFormatError(f"{file!r}: column {column!r} has rows of another length than {size}")
        if flat.null_count:
            raise ImportFormatError(f"{file!r}: column {column!r} holds null values")
        values, rows = flat, rows * size
    try:
        array = values.to_numpy(zero_copy_only=False)
    except Exception as e:
        raise ImportFormatError(f"{file!r}: column {column!r} is not numeric ({values.type})") from e
    if array.dtype == object:
        raise ImportFormatError(f"{file!r}: column {column!r} is not numeric ({values.type})")
    result: np.ndarray = array.reshape(-1, *shape)
    return result


def _with_ends(batches: Iterator[tuple[np.ndarray, Batch]]) -> Iterator[Batch]:
    """Each batch with ``truncated`` set at every episode's last row where no end flag is set;
    holds one batch back to see where the last episode of a batch ends."""
    held: tuple[np.ndarray, Batch] | None = None
    for episodes, batch in batches:
        if held is not None:
            yield _ended(*held, int(episodes[0]))
        held = (episodes, batch)
    if held is not None:
        yield _ended(*held, None)


def _ended(episodes: np.ndarray, batch: Batch, following: int | None) -> Batch:
    """``batch`` with its episode-ending rows flagged (``following``: the next row's episode, None at the end)."""
    last = np.ones(len(episodes), bool)
    last[:-1] = episodes[1:] != episodes[:-1]
    last[-1] = following is None or following != episodes[-1]
    flagged = np.zeros(len(episodes), bool)
    for flag in FLAG_FIELDS:
        if flag in batch:
            flagged |= batch[flag]
    truncated = batch["truncated"].copy() if "truncated" in batch else np.zeros(len(episodes), bool)
    truncated |= last & ~flagged
    return {**batch, "truncated": truncated}
