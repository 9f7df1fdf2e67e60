"""What every import source shares: the `Source` interface, its error, and the row-slice helpers
(bool flags, the streaming ``next_obs`` derivation, the dtype check, slice batching)."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import CorruptBufferError, DiskReplayError
from ..format.keys import MAX_METADATA_BYTES, json_object
from ..format.ragged import EncodedFrames, Ragged
from ..format.schema import ALLOWED_DTYPES, Field
from ..io import is_local, local_path
from .naming import D4RL_FLAGS, END_FIELDS, d4rl_field_name

Batch = dict[str, np.ndarray]
MAX_IMPORT_ROW_BYTES = 64 << 20
"""The largest row of one field a source may hold (a 4096 x 4096 RGBA frame); larger ones are
refused before anything is allocated for them."""


class ImportFormatError(DiskReplayError, ValueError):
    """The source is not in the format asked for (or in none that can be detected)."""


class Source:
    """A dataset being read: its fields, lanes, total rows and a stream of row slices.

    Subclasses set ``fields``, ``rows`` (all lanes together) and ``batch_rows`` (rows per slice,
    which the importer may lower before the first `batches`) when opened.
    """

    fields: dict[str, Field]
    batch_rows: int
    num_envs: int = 1
    rows: int
    chunk_rows: int | None = None
    """The new buffer's rows per chunk, set by the importer before `batches`: a source of encoded
    video rows slices them by chunk (a chunk's frames are one group of pictures)."""

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases the files the source holds open."""

    def __enter__(self) -> Source:
        """The source itself, closed when the ``with`` block ends."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Closes the source (exceptions propagate)."""
        self.close()


class ColumnsSource(Source):
    """One field per named column (named by `d4rl_field_name`); every column has the same number of rows."""

    def _setup(self, src: str, columns: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, str]:
        """Sets ``rows`` and ``fields`` from ``{column: (shape, dtype)}``; returns ``{column: field name}``."""
        if not columns:
            raise ImportFormatError(f"{src!r}: no arrays found")
        lengths = {name: shape[0] for name, (shape, _) in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ImportFormatError(f"{src!r}: arrays must share their leading (step) length, got {lengths}")
        self.rows = next(iter(lengths.values()))
        names: dict[str, str] = {}
        for column in columns:
            name = d4rl_field_name(column)
            other = next((c for c, n in names.items() if n == name), None)
            if other is not None:
                raise ImportFormatError(f"{src!r}: arrays {other!r} and {column!r} both map to field {name!r}")
            names[column] = name
        self.fields = {}
        for column, (shape, dtype) in columns.items():
            field = field_for(names[column], shape[1:], np.dtype(bool) if column in D4RL_FLAGS else dtype,
                              f"{src!r}: array {column!r}")
            if field is not None:
                self.fields[names[column]] = field
        return names


class PendingSlices:
    """Collects small slices (short episodes) into slices of about batch_rows rows."""

    def __init__(self, batch_rows: int):
        self.batch_rows = batch_rows
        self.parts: list[Batch] = []
        self.count = 0

    def add(self, batch: Batch) -> Iterator[tuple[int, Batch]]:
        """Holds ``batch``; yields the held rows as one lane-0 slice once they reach batch_rows."""
        self.parts.append(batch)
        self.count += len(next(iter(batch.values())))
        if self.count >= self.batch_rows:
            yield from self.drain()

    def drain(self) -> Iterator[tuple[int, Batch]]:
        """Yields the rows held (if any) as one lane-0 slice."""
        if not self.parts:
            return
        parts, self.parts, self.count = self.parts, [], 0
        if len(parts) == 1:
            yield 0, parts[0]
        else:
            yield 0, {k: concat_rows([p[k] for p in parts]) for k in parts[0]}


def concat_rows(parts: list) -> Any:
    """Rows of one field one after the other: arrays, `Ragged` rows, or `EncodedFrames` (encoded images)."""
    if isinstance(parts[0], Ragged):
        ends = np.cumsum([0] + [int(p.offsets[-1] - p.offsets[0]) for p in parts[:-1]])
        offsets = [p.offsets[1:] - p.offsets[0] + end for p, end in zip(parts, ends, strict=True)]
        return Ragged(np.concatenate([p.values[p.offsets[0]:p.offsets[-1]] for p in parts]),
                      np.concatenate([[0], *offsets]).astype(np.int64))
    if isinstance(parts[0], EncodedFrames):
        return EncodedFrames(np.concatenate([p.values for p in parts]), np.concatenate([p.lengths for p in parts]))
    return np.concatenate(parts)


def require_source(src: str) -> None:
    """Raises FileNotFoundError if ``src`` is a local path that does not exist."""
    if is_local(src) and not os.path.exists(local_path(src)):
        raise FileNotFoundError(f"source {src!r} does not exist")


def file_magic(path: str) -> bytes:
    """The first 8 bytes of the file ``path`` (fewer if it is shorter)."""
    with open(path, "rb") as f:
        return f.read(8)


def json_file(path: str) -> dict:
    """The JSON object in the file ``path``, read whole only when it holds at most
    `MAX_METADATA_BYTES`. Raises ImportFormatError naming the file for a larger one, one that is
    not UTF-8 JSON, or not an object."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA_BYTES:
            raise ImportFormatError(f"{path!r} has {size:,} bytes, expected a JSON document of at most "
                                    f"{MAX_METADATA_BYTES:,}")
        blob = f.read(MAX_METADATA_BYTES + 1)
    try:
        return json_object(blob, os.path.basename(path), os.path.dirname(path))
    except CorruptBufferError as e:
        raise ImportFormatError(str(e)) from None


def field_for(name: str, shape: tuple[int, ...], dtype: np.dtype, where: str) -> Field | None:
    """The field storing rows of ``shape`` and ``dtype``, or None (with a warning naming ``where``)
    when the dtype cannot be stored or the rows hold no values. Raises ImportFormatError (naming
    ``where``) for a negative size or rows of more than `MAX_IMPORT_ROW_BYTES`."""
    dtype = np.dtype(dtype)
    if not all(isinstance(n, int) and 0 <= n for n in shape):
        raise ImportFormatError(f"{where}: rows of shape {shape}, expected sizes that are ints >= 0")
    if math.prod(shape) * dtype.itemsize > MAX_IMPORT_ROW_BYTES:
        raise ImportFormatError(f"{where}: rows of shape {shape} of {dtype} hold {math.prod(shape) * dtype.itemsize:,} "
                                f"bytes, expected at most {MAX_IMPORT_ROW_BYTES:,} (64 MiB) per row")
    if dtype.newbyteorder("<") not in ALLOWED_DTYPES and dtype not in ALLOWED_DTYPES:
        warnings.warn(f"{where}: skipped (dtype {dtype} cannot be stored; supported: "
                      f"{[d.name for d in ALLOWED_DTYPES]})", stacklevel=3)
        return None
    if math.prod(shape) == 0:
        warnings.warn(f"{where}: skipped (zero-sized rows, shape {shape})", stacklevel=3)
        return None
    return Field(shape, dtype)


def as_bool_flags(batch: Batch, fields: dict[str, Field]) -> Batch:
    """``batch`` with the values of bool fields that the source stores otherwise (D4RL
    ``terminals`` / ``timeouts`` are often float) made bool: nonzero is True."""
    for name, values in batch.items():
        if fields[name].dtype == np.bool_ and values.dtype != np.bool_:
            batch[name] = values != 0
    return batch


def derives_next_obs(fields: dict[str, Field], exported: bool) -> bool:
    """D4RL layout: ``next_obs`` is derived from ``obs`` unless given, or written by `diskreplay export`."""
    return "obs" in fields and "next_obs" not in fields and not exported


def with_next_obs(slices: Iterator[Batch]) -> Iterator[Batch]:
    """Slices in row order, each given ``next_obs``: the next row's ``obs`` inside an episode, the
    row's own ``obs`` at an episode's last step (an `END_FIELDS` flag set) and at the last row.

    Holds one slice back (to see the next slice's first ``obs``), so memory stays two slices."""
    held: Batch | None = None
    for batch in slices:
        if held is not None:
            yield _next_obs_filled(held, batch["obs"][:1])
        held = batch
    if held is not None:
        yield _next_obs_filled(held, None)


def _next_obs_filled(batch: Batch, following: np.ndarray | None) -> Batch:
    obs = batch["obs"]
    nxt = np.concatenate([obs[1:], obs[-1:] if following is None else following])
    ends = np.zeros(len(obs), bool)
    for flag in END_FIELDS:
        if flag in batch:
            ends |= batch[flag].astype(bool)
    ends[-1] |= following is None
    nxt[ends] = obs[ends]
    return {**batch, "next_obs": nxt}
