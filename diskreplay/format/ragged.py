"""Variable-length (ragged) and text fields: the `Ragged` batch type, incoming rows checked and
packed (`RaggedColumn`), and the names of the arrays that store them (see docs/format.md).

A ragged field ``f`` of trailing shape ``T`` is stored as two Zarr arrays: ``f`` (the values,
``[num_envs, lane_chunks, n_values, *T]``, chunked ``[1, 1, value_chunk, *T]``: row chunk ``c`` of
lane ``e`` keeps its rows' values end to end at ``f[e, c, :end]``) and ``f.ends`` (int64,
``[num_envs, lane_rows]``, chunked with the rows: the end of each row's values inside its row
chunk; a row starts where the previous row of its chunk ends, the first at 0). A field declared
``length_of=`` another has no ends array of its own. Text is ragged uint8 (UTF-8).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from ..build import load_extension
from ..errors import SchemaError

_COPY_RUNS = getattr(load_extension("diskreplay.format._batch"), "copy_runs", None)
"""`_batch.copy_runs` where the extension was built with it (else a numpy gather)."""

ENDS_SUFFIX = ".ends"
"""The ends array of ragged field ``f`` is ``f.ends``: a field name is an identifier, so no field's
array can have this name."""
VALUE_CHUNK_BYTES = 256 << 10
"""About how many bytes one value chunk holds (the unit of reads and of the cache)."""
MAX_VALUES = 1 << 36
"""The most values one row chunk of one lane may hold."""


def ends_name(name: str) -> str:
    """The name of the ends array of ragged field ``name``."""
    return name + ENDS_SUFFIX


def value_chunk_for(trailing: tuple[int, ...], dtype: np.dtype) -> int:
    """Values per value chunk of a ragged field: the power of two nearest below
    `VALUE_CHUNK_BYTES` worth of values (at least 1)."""
    per_value = max(math.prod(trailing) * dtype.itemsize, 1)
    count = max(VALUE_CHUNK_BYTES // per_value, 1)
    return int(1 << (count.bit_length() - 1))


def values_key(name: str, trailing: tuple[int, ...], lane: int, chunk: int, k: int, separator: str) -> str:
    """The store key of value chunk ``k`` of row chunk ``chunk`` of ``lane`` (zarr v3's default
    chunk key encoding)."""
    return f"{name}/c{separator}{lane}{separator}{chunk}{separator}{k}" + f"{separator}0" * len(trailing)


def gather_runs(source: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows ``source[starts[i]:starts[i] + lengths[i]]`` (along axis 0), end to end: one
    memcpy per run in the `_batch` extension, else one numpy ``take``."""
    total = int(lengths.sum())
    if _COPY_RUNS is not None and source.flags.c_contiguous:
        out = np.empty((total, *source.shape[1:]), source.dtype)
        row = source.itemsize * math.prod(source.shape[1:])
        _COPY_RUNS(source, out, np.ascontiguousarray(starts * row, np.int64),
                   np.ascontiguousarray(lengths * row, np.int64))
        return out
    index = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    index += np.arange(total)
    return source.take(index, axis=0)


class Ragged:
    """A batch of variable-length rows: ``values`` (every row's values end to end, shaped
    ``[total, *T]``) and ``offsets`` (int64, ``[len + 1]``: row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``)."""

    __slots__ = ("values", "offsets")

    def __init__(self, values: np.ndarray, offsets: np.ndarray):
        self.values = values
        self.offsets = offsets

    @classmethod
    def from_rows(cls, rows: Sequence[Any], dtype: Any = None) -> Ragged:
        """A `Ragged` of a list of arrays (one per row, each ``[n_i, *T]``)."""
        arrays = [np.asarray(row, dtype=dtype) for row in rows]
        lengths = np.array([len(a) for a in arrays], dtype=np.int64)
        values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
        return cls(values, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))

    @property
    def lengths(self) -> np.ndarray:
        """Each row's length (int64)."""
        lengths: np.ndarray = np.diff(self.offsets)
        return lengths

    def __len__(self) -> int:
        """Rows: ``len(offsets) - 1``."""
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice | np.ndarray) -> Ragged: ...

    def __getitem__(self, i: int | slice | np.ndarray) -> np.ndarray | Ragged:
        """Row ``i``'s values (a view); a slice (of step 1, a view) or an array of row indices: a `Ragged`."""
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                return self[np.arange(a, b, step)]
            b = max(a, b)
            return Ragged(self.values[self.offsets[a]:self.offsets[b]], self.offsets[a:b + 1] - self.offsets[a])
        if isinstance(i, np.ndarray):
            rows = np.arange(len(self))[i]
            lengths = self.lengths[rows]
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            index = np.repeat(self.offsets[rows] - offsets[:-1], lengths) + np.arange(int(offsets[-1]))
            return Ragged(self.values[index], offsets)
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of a Ragged of {n} rows")
        i %= n
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        """Each row's values in turn (views)."""
        return (self[i] for i in range(len(self)))

    def to_padded(self, pad_value: Any = 0) -> tuple[np.ndarray, np.ndarray]:
        """``(array [B, max_len, *T], lengths)``: each row's values, then ``pad_value``."""
        lengths = self.lengths
        width = int(lengths.max(initial=0))
        out = np.full((len(self), width, *self.values.shape[1:]), pad_value, dtype=self.values.dtype)
        row = np.repeat(np.arange(len(self)), lengths)
        col = np.arange(len(self.values)) - np.repeat(self.offsets[:-1], lengths)
        out[row, col] = self.values
        return out, lengths

    def __repr__(self) -> str:
        return f"Ragged({len(self)} rows, values {self.values.dtype} shaped {self.values.shape})"


class RaggedColumn:
    """Incoming rows of one ragged field, checked and packed: ``values`` end to end and
    ``lengths`` shaped like the rows' leading axes (``(N,)``, ``(N, lanes)``...)."""

    def __init__(self, values: np.ndarray, lengths: np.ndarray):
        self.values, self.lengths = values, lengths

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.lengths.shape)

    def __getitem__(self, key: Any) -> RaggedColumn:
        """The rows ``key`` picks from the leading axes (numpy indexing of ``lengths``)."""
        flat = self.lengths.reshape(-1)
        starts = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)
        picked = np.arange(flat.size).reshape(self.lengths.shape)[key]
        rows = np.asarray(picked).reshape(-1)
        lengths = flat[rows]
        index = np.repeat(starts[rows] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
        index += np.arange(int(lengths.sum()))
        return RaggedColumn(self.values[index], lengths.reshape(np.shape(picked)))


class EncodedFrames(RaggedColumn):
    """Rows of an encoded frame field (``Field(..., codec=...)``) given already encoded by the
    field's codec: ``values`` (uint8, each frame's bytes end to end) and ``lengths`` (each
    frame's byte count, shaped like the rows' leading axes), stored as they are, not encoded
    again. For a video codec, the frame of each row chunk's first step must be a keyframe that
    starts a stream decodable alone, and the chunk's rows one packet per frame in display order
    (`format.frame_codecs`): the caller vouches for it (`import_dataset` decodes each chunk to check)."""

    def __len__(self) -> int:
        """Rows along the first axis."""
        return int(self.lengths.shape[0])

    def __getitem__(self, key: Any) -> EncodedFrames:
        """The rows ``key`` picks, still encoded frames."""
        picked = super().__getitem__(key)
        return EncodedFrames(picked.values, picked.lengths)


def column(name: str, value: Any, lead: tuple[int, ...], trailing: tuple[int, ...], text: bool) -> RaggedColumn:
    """``value``, the rows of ragged field ``name`` with leading shape ``lead``, packed (values not
    cast yet). Text: ``str`` (or UTF-8 ``bytes``) per row. Ragged: a list of arrays (one per row,
    nested like ``lead``), ``(values, lengths)``, or a `Ragged`. Raises SchemaError."""
    if text:
        return _text_column(name, value, lead)
    if isinstance(value, Ragged):
        value = (value.values, value.lengths)
    if isinstance(value, tuple):
        if len(value) != 2:
            raise SchemaError(f"field {name!r}: expected (values, lengths), got a tuple of {len(value)}")
        values, lengths = np.asarray(value[0]), np.asarray(value[1])
        if lengths.shape != lead or (lengths.size and (lengths.dtype.kind not in "iu" or lengths.min() < 0)):
            raise SchemaError(f"field {name!r}: expected lengths of non-negative ints shaped {lead}, got "
                              f"{lengths.dtype} shaped {lengths.shape}")
        _check_values(name, values, trailing, int(lengths.sum()))
        return RaggedColumn(values, lengths.astype(np.int64))
    rows = _rows(name, value, lead)
    arrays = [np.asarray(row) for row in rows]
    for i, row in enumerate(arrays):
        if row.ndim != 1 + len(trailing) or row.shape[1:] != trailing:
            raise SchemaError(f"field {name!r}: expected each row shaped (n, *{trailing}), got row {i} shaped "
                              f"{row.shape}")
    lengths = np.array([len(a) for a in arrays], dtype=np.int64).reshape(lead)
    values = np.concatenate(arrays) if arrays else np.zeros((0, *trailing))
    return RaggedColumn(values, lengths)


def _check_values(name: str, values: np.ndarray, trailing: tuple[int, ...], total: int) -> None:
    if values.shape != (total, *trailing):
        raise SchemaError(f"field {name!r}: expected values shaped {(total, *trailing)} (the sum of the lengths, "
                          f"then the trailing shape), got {values.shape}")


def _rows(name: str, value: Any, lead: tuple[int, ...]) -> list[Any]:
    """The rows of ``value`` nested ``len(lead)`` lists deep, row-major. One row when ``lead`` is ()."""
    if not lead:
        return [value]
    if not isinstance(value, (list, np.ndarray)) or len(value) != lead[0]:
        got = f"{len(value)} rows" if isinstance(value, (list, np.ndarray)) else type(value).__name__
        raise SchemaError(f"field {name!r}: expected a list of {lead[0]} rows (arrays), got {got}")
    return [row for part in value for row in _rows(name, part, lead[1:])]


def _text_column(name: str, value: Any, lead: tuple[int, ...]) -> RaggedColumn:
    strings = np.empty(lead, dtype=object)
    if isinstance(value, (str, bytes)) and lead == ():
        strings[()] = value
    else:
        array = np.asarray(value, dtype=object) if not isinstance(value, np.ndarray) else value.astype(object)
        if array.shape != lead:
            raise SchemaError(f"field {name!r}: expected text shaped {lead} (str per row), got shape {array.shape}")
        strings[...] = array
    encoded = [_utf8(name, s) for s in strings.reshape(-1).tolist()]
    lengths = np.array([len(b) for b in encoded], dtype=np.int64).reshape(lead)
    return RaggedColumn(np.frombuffer(b"".join(encoded), dtype=np.uint8), lengths)


def _utf8(name: str, text: Any) -> bytes:
    if isinstance(text, str):
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SchemaError(f"field {name!r}: text {text[:40]!r} cannot be encoded as UTF-8 ({exc.reason})") from None
    if isinstance(text, (bytes, np.bytes_)):
        try:
            bytes(text).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SchemaError(f"field {name!r}: bytes {bytes(text)[:40]!r} are not valid UTF-8 "
                              f"({exc.reason} at byte {exc.start})") from None
        return bytes(text)
    raise SchemaError(f"field {name!r}: expected str (or UTF-8 bytes), got {type(text).__name__}")


def decode_text(ragged: Ragged) -> np.ndarray:
    """The rows of a ragged uint8 batch as a numpy object array of ``str``."""
    raw = ragged.values.tobytes()
    bounds = ragged.offsets.tolist()
    out = np.empty(len(ragged), dtype=object)
    out[:] = [raw[a:b].decode("utf-8", errors="replace") for a, b in zip(bounds[:-1], bounds[1:])]
    return out
