"""A Minari dataset in its ``arrow`` (or ``parquet``) data format: ``<dir>/data/metadata.json`` with
``"data_format": "arrow"``, one folder ``<dir>/data/<id>`` per episode holding ``part-*.arrow``
(Arrow IPC files) or ``*.parquet`` files of T + 1 rows.

Mapped as the HDF5 Minari layout is: ``observations[:-1]`` -> ``obs``, ``observations[1:]`` ->
``next_obs``, ``actions`` -> ``action``, ``rewards`` -> ``reward``, ``terminations`` ->
``terminated``, ``truncations`` -> ``truncated`` (their padded last row dropped), ``infos`` keys ->
``info_<key>`` (T + 1 entries: the reset's info first, so each step keeps the following one);
dict spaces (struct columns) flattened (``obs_<key>``, ``action_<key>``). String columns (gymnasium
``Text`` spaces) become text fields (``Field((), "str")``); binary columns (Minari's JPEG-encoded
image spaces, or PNG) ``codec="jpeg"`` / ``"png"`` frame fields of the first image's shape that
keep each image's bytes (`diskreplay.offline.images`). Other columns that hold no numbers
(variable-length lists) are skipped with a warning. Episodes are read one record batch (or row
group) at a time.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...format.schema import Field
from ...io import local_path
from ..images import image_field, image_rows
from ..naming import field_name
from ..source import Batch, ImportFormatError, PendingSlices, Source, concat_rows, field_for, json_file
from .parquet import _plain, _value_type, require_arrow, require_pyarrow

ARROW_FORMATS = ("arrow", "parquet")
ARROW_NAMES = {"observations": "obs", "actions": "action", "rewards": "reward", "terminations": "terminated",
               "truncations": "truncated", "infos": "info"}
SHIFTED = ("obs", "info")  # prefixes of columns whose step t is row t + 1 (next_obs and infos)


def arrow_metadata(path: str) -> dict | None:
    """The ``data/metadata.json`` of a Minari dataset folder in an arrow data format, or None.
    Raises ImportFormatError when ``data/metadata.json`` is too large or not a JSON object (a
    ``metadata.json`` in ``path`` itself, which other datasets may have, then just is no Minari's)."""
    for data in (os.path.join(path, "data"), path):
        meta = os.path.join(data, "metadata.json")
        if not os.path.isfile(meta):
            continue
        try:
            found = json_file(meta)
        except ImportFormatError:
            if data == path:
                continue
            raise
        if found.get("data_format") in ARROW_FORMATS:
            return {**found, "_data": data}
    return None


def box_shape(meta: dict, name: str, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The row shape of field ``name`` (``obs``, ``action`` or a flattened part of a Dict or Tuple
    space, ``obs_<key>``): its Box space's shape in the dataset's metadata when that holds as many
    values as the stored (flattened) rows, else ``stored``. Raises ImportFormatError (naming the file
    and the space) for a shape that is not a list of ints >= 0."""
    prefix = name.split("_", 1)[0]
    key = {"obs": "observation_space", "action": "action_space"}.get(prefix)
    try:
        space = _subspace(json.loads(meta[key]), prefix, name) if key else None
    except (KeyError, TypeError, ValueError, RecursionError):
        return stored
    if not isinstance(space, dict) or space.get("type") != "Box" or not isinstance(space.get("shape"), list):
        return stored
    shape = space["shape"]
    if not all(type(n) is int and 0 <= n for n in shape):
        raise ImportFormatError(f"{os.path.join(meta['_data'], 'metadata.json')!r}: {key} has shape {shape!r}, "
                                f"expected a list of ints >= 0")
    return tuple(shape) if math.prod(shape) == math.prod(stored) else stored


def _subspace(space: Any, prefix: str, name: str) -> Any:
    """The part of a serialized space that field ``name`` holds (``prefix`` names ``space`` itself;
    Dict and Tuple parts add ``_<key>`` or ``_<index>``), or None."""
    if name == prefix:
        return space
    parts = space.get("subspaces") if isinstance(space, dict) else None
    items = parts.items() if isinstance(parts, dict) else enumerate(parts) if isinstance(parts, list) else ()
    for key, part in items:
        sub = f"{prefix}_{field_name(str(key))}"
        if name == sub or name.startswith(sub + "_"):
            found = _subspace(part, sub, name)
            if found is not None:
                return found
    return None


class MinariArrowSource(Source):
    """The episodes of an arrow-format Minari dataset, concatenated in id order into one lane."""

    def __init__(self, src: str, batch_rows: int):
        self.pq, pa = require_pyarrow(), require_arrow()
        self.pa, self.src, self.batch_rows = pa, src, batch_rows
        meta = arrow_metadata(local_path(src))
        if meta is None:
            raise ImportFormatError(f"{src!r}: not a Minari dataset in the arrow data format")
        self.suffix = ".arrow" if meta["data_format"] == "arrow" else ".parquet"
        self.episodes = self._episode_files(meta["_data"])
        self.rows = sum(max(self._episode_rows(files) - 1, 0) for files in self.episodes)
        self.columns = self._leaves(self._schema(self.episodes[0]))
        self.fields, self.stored = {}, {}
        self.images: dict[str, Field] = {}  # field -> its image field, of binary (encoded image) columns
        for name, (_, typ) in self.columns.items():
            field = self._field(name, typ)
            if field is not None:
                self.stored[name] = field.shape
                if not field.text and name not in self.images:
                    field = Field(box_shape(meta, name, field.shape), field.dtype)
                self.fields[name] = field
                if name == "obs" or name.startswith("obs_"):
                    self.fields["next_" + name] = field

    def _episode_files(self, data: str) -> list[list[str]]:
        """Per episode, in id order, its data files."""
        ids = sorted(episode_id(data, d) for d in os.listdir(data)
                     if d.isdigit() and os.path.isdir(os.path.join(data, d)))
        if not ids:
            raise ImportFormatError(f"{self.src!r}: no episode folders in {data!r}")
        episodes = []
        for ep in ids:
            folder = os.path.join(data, str(ep))
            files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(self.suffix))
            if not files:
                raise ImportFormatError(f"{folder!r}: no {self.suffix} files")
            episodes.append(files)
        return episodes

    def _record_batches(self, file: str) -> Iterator[Any]:
        """The record batches of one data file, one at a time; ImportFormatError if unreadable."""
        try:
            if self.suffix == ".parquet":
                yield from self.pq.ParquetFile(file).iter_batches(batch_size=self.batch_rows)
                return
            reader = self.pa.ipc.open_file(self.pa.memory_map(file))
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
        except ImportFormatError:
            raise
        except Exception as e:
            raise ImportFormatError(f"{file!r}: unreadable ({e})") from e

    def _episode_rows(self, files: list[str]) -> int:
        """Rows (T + 1) of one episode, from the files' footers."""
        try:
            if self.suffix == ".parquet":
                return sum(self.pq.ParquetFile(f).metadata.num_rows for f in files)
            total = 0
            for f in files:
                reader = self.pa.ipc.open_file(self.pa.memory_map(f))
                total += sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
            return total
        except Exception as e:
            raise ImportFormatError(f"{files[0]!r}: unreadable ({e})") from e

    def _schema(self, files: list[str]) -> Any:
        try:
            if self.suffix == ".parquet":
                return self.pq.ParquetFile(files[0]).schema_arrow
            return self.pa.ipc.open_file(self.pa.memory_map(files[0])).schema
        except Exception as e:
            raise ImportFormatError(f"{files[0]!r}: unreadable ({e})") from e

    def _leaves(self, schema: Any) -> dict[str, tuple[tuple[str | int, ...], Any]]:
        """``{field name: (path, arrow type)}``: the known columns, struct children flattened."""
        found: dict[str, tuple[tuple[str | int, ...], Any]] = {}
        for column in schema.names:
            if column in ARROW_NAMES:
                self._flatten(ARROW_NAMES[column], (column,), schema.field(column).type, found)
        if "reward" not in found:
            raise ImportFormatError(f"{self.src!r}: no 'rewards' column")
        return found

    def _flatten(self, name: str, path: tuple[str | int, ...], typ: Any, found: dict) -> None:
        if not self.pa.types.is_struct(typ):
            found[name] = (path, typ)
            return
        for i in range(typ.num_fields):
            self._flatten(f"{name}_{field_name(typ.field(i).name)}", (*path, i), typ.field(i).type, found)

    def _field(self, name: str, typ: Any) -> Field | None:
        where = f"{self.src!r}: {name!r}"
        types = self.pa.types
        if types.is_string(typ) or types.is_large_string(typ):
            return Field((), "str")
        if types.is_binary(typ) or types.is_large_binary(typ):
            file = self.episodes[0][0]
            rb = next(self._record_batches(file), None)
            blob = None if rb is None or not rb.num_rows else self._column(file, rb, self.columns[name][0])[0].as_py()
            if blob is None:
                raise ImportFormatError(f"{file!r}: {name!r}: no first image to take the shape from")
            self.images[name] = image_field(blob, f"{file!r}: {name!r}")
            return self.images[name]
        try:
            base, shape = _value_type(typ, None)
        except TypeError as e:
            warnings.warn(f"{where}: skipped ({e})", stacklevel=4)
            return None
        dtype = np.dtype(bool) if name in ("terminated", "truncated") else np.dtype(base.to_pandas_dtype())
        return field_for(name, shape, dtype, where)

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        pending = PendingSlices(self.batch_rows)
        for files in self.episodes:
            held: Batch | None = None
            for piece in self._pieces(files):
                if held is not None:
                    yield from pending.add(_steps(held, piece))
                held = piece
            if held is not None and len(held["reward"]) > 1:
                yield from pending.add(_steps(held, None))
        yield from pending.drain()

    def _pieces(self, files: list[str]) -> Iterator[Batch]:
        """The raw rows (T + 1 per episode) of one episode's kept columns, at most batch_rows at a time."""
        for file in files:
            for rb in self._record_batches(file):
                for start in range(0, rb.num_rows, self.batch_rows):
                    yield self._decode(file, rb.slice(start, self.batch_rows))

    def _decode(self, file: str, rb: Any) -> Batch:
        batch: dict[str, Any] = {}
        for name, (path, _) in self.columns.items():
            if name not in self.fields:
                continue
            array = self._column(file, rb, path)
            if self.fields[name].text or name in self.images:
                batch[name] = self._decoded(file, name, array)
                continue
            values = _plain(file, ".".join(map(str, path)), array, self.stored[name])
            batch[name] = values.reshape(len(values), *self.fields[name].shape)
            if self.fields[name].dtype == np.bool_:
                batch[name] = batch[name] != 0
            elif batch[name].dtype != self.fields[name].dtype:
                raise ImportFormatError(f"{file!r}: {name!r} is {batch[name].dtype}, "
                                        f"expected {self.fields[name].dtype}")
        return batch

    def _column(self, file: str, rb: Any, path: tuple[str | int, ...]) -> Any:
        """The (struct child) column at ``path`` of a record batch."""
        try:
            array = rb.column(path[0])
        except KeyError as e:
            raise ImportFormatError(f"{file!r}: no column {path[0]!r}") from e
        for index in path[1:]:
            if not self.pa.types.is_struct(array.type):
                raise ImportFormatError(f"{file!r}: column {path[0]!r} has rows of another type than the "
                                        f"first file's: {array.type}, expected a struct")
            array = array.flatten()[int(index)]
        return array

    def _decoded(self, file: str, name: str, array: Any) -> Any:
        """Text as an object array of str, encoded images as `image_rows` gives them. Nulls are refused
        but in the padded last row of an episode's actions (which `_steps` drops)."""
        where = f"{file!r}: {name!r}"
        rows = array.to_pylist()
        kind = str if self.fields[name].text else bytes
        padded = not name.startswith(SHIFTED) and rows and rows[-1] is None
        if padded:
            rows[-1] = "" if kind is str else rows[0]
        if not all(isinstance(r, kind) for r in rows):
            raise ImportFormatError(f"{where}: holds {array.type} values that are not all "
                                    f"{'strings' if kind is str else 'images'} (nulls?)")
        if kind is str:
            return np.array(rows, dtype=object)
        return image_rows(rows, self.images[name], where)


def episode_id(data: str, folder: str) -> int:
    """The episode id an episode folder's name gives; ImportFormatError unless it is 1 to 18 ASCII digits."""
    if not re.fullmatch(r"[0-9]{1,18}", folder):
        raise ImportFormatError(f"{data!r}: episode folder {folder!r} is not an episode id, "
                                f"expected 1 to 18 ASCII digits")
    return int(folder)


def _steps(piece: Batch, following: Batch | None) -> Batch:
    """The steps of one piece of raw rows: all of them when more rows follow, else all but the
    last; ``obs*`` and ``info*`` take row t + 1 as ``next_obs*`` / the step's info."""
    out = {}
    end = len(piece["reward"]) - (following is None)
    for name, values in piece.items():
        if name.startswith(SHIFTED):
            shifted = values[1:] if following is None else concat_rows([values[1:], following[name][:1]])
            if name.startswith("obs"):
                out[name], out["next_" + name] = values[:end], shifted
            else:
                out[name] = shifted
        else:
            out[name] = values[:end]
    return out
