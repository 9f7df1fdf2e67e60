"""Field specs and the validation/casting of incoming rows.

A buffer's schema is a mapping ``name -> Field``. Every write goes through `Schema.rows`, which
checks the whole batch before anything is written: that is what keeps bad input out of the store.
"""

from __future__ import annotations

import math
import operator
from collections.abc import ItemsView, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, SupportsIndex

import numpy as np
from numpy.typing import DTypeLike

from ..errors import SchemaError
from .ragged import Ragged, column, ends_name

MAX_ROW_BYTES = 1 << 30
"""The most one step of one field may hold (1 GiB)."""

ALLOWED_DTYPES = tuple(
    np.dtype(d)
    for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "float32", "float64")
)


@dataclass(frozen=True, init=False)
class Field:
    """One per-step quantity: its shape (without the step axis) and dtype.

    ``Field((17,), "float32")`` is a 17-vector per step; ``Field((), "bool")`` a scalar flag.
    The dtype is stored little-endian (``">f4"`` is float32 too).
    """

    shape: tuple[int, ...]
    """The step's shape; of a ragged field, the trailing shape (the axes after the varying one)."""
    dtype: np.dtype
    ragged: bool = False
    """The step's first axis varies (declared ``None``); text fields are ragged too."""
    length_of: str | None = None
    """A ragged field whose rows have the lengths of ragged field ``length_of`` (stored once)."""
    text: bool = False
    """UTF-8 text (``Field((), "str")``), stored as ragged uint8."""

    def __init__(self, shape: Iterable[SupportsIndex | None], dtype: DTypeLike | str,
                 length_of: str | None = None):
        """Raises SchemaError for a shape that is not non-negative ints (its first may be None: a
        ragged field), a dtype diskreplay does not store (`ALLOWED_DTYPES`, or ``"str"`` with
        shape ``()``), a step of more than 1 GiB, or ``length_of`` on a field that is not ragged."""
        try:
            given = tuple(shape)
            ragged = bool(given) and given[0] is None
            dims = tuple(operator.index(s) for s in given[int(ragged):])  # type: ignore[arg-type]
        except TypeError:
            raise SchemaError(f"Field shape must be a tuple of ints (the first may be None), got {shape!r}") from None
        if any(s < 0 for s in dims):
            raise SchemaError(f"Field shape must be non-negative, got {dims}")
        text = isinstance(dtype, str) and dtype == "str" or dtype is str
        if text and (given != () or length_of is not None):
            raise SchemaError(f"a text field is declared Field((), 'str'), got shape {given} "
                              f"and length_of={length_of!r}")
        if length_of is not None and not ragged:
            raise SchemaError(f"length_of={length_of!r} needs a ragged field (shape (None, ...)), got shape {given}")
        object.__setattr__(self, "ragged", ragged or text)
        object.__setattr__(self, "length_of", length_of)
        object.__setattr__(self, "text", text)
        self._store(dims, np.dtype(np.uint8) if text else np.dtype(dtype))

    @property
    def declared_shape(self) -> tuple[int | None, ...]:
        """The shape as declared: ``(None, *shape)`` for a ragged field (``()`` for text)."""
        return () if self.text else (None, *self.shape) if self.ragged else self.shape

    def _store(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
        if dtype.newbyteorder("=") not in ALLOWED_DTYPES:  # ">f4" is float32 too (stored "<f4")
            raise SchemaError(
                f"Field dtype must be one of {[d.name for d in ALLOWED_DTYPES]}, got {dtype}")
        size = math.prod(shape) * dtype.itemsize
        if size > MAX_ROW_BYTES:
            raise SchemaError(f"Field shape {shape} of {dtype} holds {size:,} bytes per step; at most "
                              f"{MAX_ROW_BYTES:,} (1 GiB) fit one step of one field")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes one step of this field takes."""
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        """This field as JSON-ready data: ``{"shape": [...], "dtype": "<name>"}``; a ragged
        field's shape starts with null (and may carry ``"length_of"``), text is ``"dtype": "str"``."""
        spec: dict[str, Any] = {"shape": list(self.declared_shape), "dtype": "str" if self.text else self.dtype.str}
        if self.length_of is not None:
            spec["length_of"] = self.length_of
        return spec

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Field:
        """The field `to_json` gave. Raises SchemaError for a bad shape or dtype."""
        length_of = spec.get("length_of")
        if length_of is not None and not isinstance(length_of, str):
            raise SchemaError(f"length_of: expected a field name, got {length_of!r:.60}")
        return cls(tuple(spec["shape"]), spec["dtype"], length_of=length_of)

    def __repr__(self) -> str:
        if not self.ragged:
            return f"Field(shape={self.shape!r}, dtype={self.dtype!r})"
        extra = f", length_of={self.length_of!r}" if self.length_of else ""
        return f"Field(shape={self.declared_shape!r}, dtype={'str' if self.text else repr(self.dtype)}{extra})"


class Schema:
    """An ordered mapping of field names to `Field`s, and the gatekeeper of incoming rows."""

    def __init__(self, fields: Mapping[str, Field]):
        if not isinstance(fields, Mapping):
            raise SchemaError(f"fields: expected a mapping of name to dr.Field, got {type(fields).__name__}")
        if not fields:
            raise SchemaError("a buffer needs at least one field, got none")
        for name, field in fields.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise SchemaError(f"field names must be Python identifiers, got {name!r}")
            if len(name.encode()) > MAX_NAME_BYTES:
                raise SchemaError(f"field name {name!r} has {len(name.encode())} bytes (UTF-8); at most "
                                  f"{MAX_NAME_BYTES} fit a file or object name (a field's array is a directory "
                                  f"named after it)")
            if name in RESERVED_NAMES:
                raise SchemaError(f"field name {name!r} is reserved (reserved: {sorted(RESERVED_NAMES)})")
            if not isinstance(field, Field):
                raise SchemaError(f"field {name!r}: expected a dr.Field, got {type(field).__name__}")
        _check_lengths(fields)
        self.fields: dict[str, Field] = dict(fields)
        self.row_bytes = sum(f.row_bytes for f in self.fields.values())
        """Bytes one step of all fields takes."""

    def __iter__(self) -> Iterator[str]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __getitem__(self, name: str) -> Field:
        return self.fields[name]

    def items(self) -> ItemsView[str, Field]:
        return self.fields.items()

    @property
    def ragged(self) -> dict[str, Field]:
        """The ragged (and text) fields."""
        return {name: f for name, f in self.fields.items() if f.ragged}

    def storage(self) -> Schema:
        """The fixed-shape arrays that store this schema: every fixed field, and for each ragged
        field that has its own lengths, its int64 ends (``<name>.ends``). Ragged values are
        stored beside them (`format.ragged`). Itself when no field is ragged."""
        if not self.ragged:
            return self
        stored: dict[str, Field] = {}
        for name, f in self.fields.items():
            if not f.ragged:
                stored[name] = f
            elif f.length_of is None:
                stored[ends_name(name)] = Field((), "int64")
        schema = object.__new__(Schema)
        schema.fields = stored
        schema.row_bytes = sum(f.row_bytes for f in stored.values())
        return schema

    def to_json(self) -> dict[str, Any]:
        return {name: f.to_json() for name, f in self.fields.items()}

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Schema:
        return cls({name: Field.from_json(s) for name, s in spec.items()})

    def rows(self, data: Mapping[str, Any], lead: tuple[int, ...] | None = None) -> dict[str, Any]:
        """Validate a batch and cast it to the stored dtypes.

        ``data`` maps every field name to an array shaped ``lead + field.shape``. ``lead`` is the
        expected leading shape (e.g. ``(num_envs,)``); ``None`` means "one leading axis, any length,
        the same for every field". A ragged field takes a list of arrays (one per row, nested
        like ``lead``), ``(values, lengths)`` or a `Ragged`; text takes ``str`` per row. Each
        comes back as a `RaggedColumn`.

        Raises SchemaError naming the field with the expected and actual value for: a missing or
        unknown field, a wrong shape, mismatched leading axes, or a dtype that cannot be cast safely
        (same kind: an int64 array may be stored as int32 if every value fits; floats may narrow
        float64 -> float32; nothing may go float -> int or to bool from non-bool).
        """
        if not isinstance(data, (dict, Mapping)):  # dict first: add(**step) passes one, checked fast
            raise SchemaError(f"expected a mapping of field name to array (fields {list(self.fields)}), "
                              f"got {type(data).__name__}")
        missing = [n for n in self.fields if n not in data]
        unknown = [n for n in data if n not in self.fields]
        if missing or unknown:
            raise SchemaError(
                f"fields do not match the buffer: missing {missing}, unknown {unknown}; "
                f"expected exactly {list(self.fields)}")
        out: dict[str, Any] = {}
        if lead is None and self.ragged:
            lead = self.lead_of(data)
        for name, field in self.fields.items():
            if field.ragged:
                packed = column(name, data[name], tuple(lead or ()), field.shape, field.text)
                packed.values = (_cast(name, packed.values, field.dtype) if packed.values.size
                                 else packed.values.astype(field.dtype))
                out[name] = packed
                continue
            value = np.asarray(data[name])
            if lead is None:
                lead = value.shape[: value.ndim - len(field.shape)] if value.ndim > len(field.shape) else ()
                if len(lead) != 1:
                    raise SchemaError(
                        f"field {name!r}: expected shape (N, *{field.shape}) with a leading step axis, "
                        f"got {value.shape}")
            expected = tuple(lead) + field.shape
            if value.shape != expected:
                raise SchemaError(f"field {name!r}: expected shape {expected}, got {value.shape}")
            out[name] = _cast(name, value, field.dtype)
        for name, field in self.fields.items():
            if field.length_of is not None and not np.array_equal(out[name].lengths, out[field.length_of].lengths):
                raise SchemaError(f"field {name!r} (length_of={field.length_of!r}): row lengths "
                                  f"{out[name].lengths.reshape(-1)[:8].tolist()} differ from those of "
                                  f"{field.length_of!r}: {out[field.length_of].lengths.reshape(-1)[:8].tolist()}")
        return out

    def lead_of(self, data: Mapping[str, Any]) -> tuple[int, ...]:
        """The leading shape of a batch (one step axis), from a fixed field if there is one."""
        for name, field in self.fields.items():
            if not field.ragged and name in data:
                shape = np.shape(data[name])
                return tuple(shape[:1]) if len(shape) > len(field.shape) else ()
        value = next((data[name] for name in self.ragged if name in data), None)
        if isinstance(value, tuple) and len(value) == 2:
            return tuple(np.shape(value[1]))
        if isinstance(value, Ragged):
            return (len(value),)
        return (len(value),) if isinstance(value, (list, np.ndarray)) else ()


MAX_NAME_BYTES = 255
"""The longest field name, in UTF-8 bytes: the longest file name of common filesystems."""
RESERVED_NAMES = frozenset({"index", "weight", "lane", "mask", "discount", "start", "step"})


def _check_lengths(fields: Mapping[str, Field]) -> None:
    """``length_of`` names a ragged field with lengths of its own (not text)."""
    for name, f in fields.items():
        owner = fields.get(f.length_of) if f.length_of is not None else None
        if f.length_of is not None and (owner is None or not owner.ragged or owner.text or owner.length_of):
            raise SchemaError(f"field {name!r}: length_of={f.length_of!r} must name a ragged, non-text field with "
                              f"lengths of its own, got {owner}")


def _cast(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if value.dtype == dtype:
        return value
    if np.can_cast(value.dtype, dtype, casting="safe"):
        return value.astype(dtype)
    src, dst = value.dtype.kind, dtype.kind
    if src in "iu" and dst in "iu":
        if value.size == 0:
            return value.astype(dtype)
        info = np.iinfo(dtype)
        lo, hi = value.min(), value.max()
        if info.min <= lo and hi <= info.max:
            return value.astype(dtype)
        raise SchemaError(
            f"field {name!r}: values in [{lo}, {hi}] do not fit the stored dtype {dtype.name} "
            f"(range [{info.min}, {info.max}])")
    if src in "iubf" and dst == "f":
        return _narrowed(name, value, dtype)
    raise SchemaError(
        f"field {name!r}: expected dtype {dtype.name} (or one that casts to it safely), got {value.dtype.name}")


def _narrowed(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` cast to a narrower float type; a finite value that would become infinite is refused."""
    with np.errstate(over="ignore"):  # an overflow is refused below, with the field's name
        out = value.astype(dtype)
    if value.size and not np.isfinite(out).all():
        lost = np.isfinite(value) & ~np.isfinite(out) if value.dtype.kind == "f" else ~np.isfinite(out)
        if lost.any():
            bad = value[lost].reshape(-1)[0]
            raise SchemaError(f"field {name!r}: value {bad} overflows the stored dtype {dtype.name} "
                              f"(largest finite value {np.finfo(dtype).max})")
    return out
