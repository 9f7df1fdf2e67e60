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
    dtype: np.dtype

    def __init__(self, shape: Iterable[SupportsIndex], dtype: DTypeLike):
        """Raises SchemaError for a shape that is not non-negative ints, a dtype diskreplay does
        not store (`ALLOWED_DTYPES`), or a step of more than 1 GiB."""
        try:
            dims = tuple(operator.index(s) for s in shape)
        except TypeError:
            raise SchemaError(f"Field shape must be a tuple of ints, got {shape!r}") from None
        if any(s < 0 for s in dims):
            raise SchemaError(f"Field shape must be non-negative, got {dims}")
        self._store(dims, np.dtype(dtype))

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
        """This field as JSON-ready data: ``{"shape": [...], "dtype": "<name>"}``."""
        return {"shape": list(self.shape), "dtype": self.dtype.str}

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Field:
        """The field `to_json` gave. Raises SchemaError for a bad shape or dtype."""
        return cls(tuple(spec["shape"]), spec["dtype"])


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

    def to_json(self) -> dict[str, Any]:
        return {name: f.to_json() for name, f in self.fields.items()}

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> Schema:
        return cls({name: Field.from_json(s) for name, s in spec.items()})

    def rows(self, data: Mapping[str, Any], lead: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
        """Validate a batch and cast it to the stored dtypes.

        ``data`` maps every field name to an array shaped ``lead + field.shape``. ``lead`` is the
        expected leading shape (e.g. ``(num_envs,)``); ``None`` means "one leading axis, any length,
        the same for every field".

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
        out = {}
        for name, field in self.fields.items():
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
        return out


MAX_NAME_BYTES = 255
"""The longest field name, in UTF-8 bytes: the longest file name of common filesystems."""
RESERVED_NAMES = frozenset({"index", "weight", "lane", "mask", "discount", "start", "step"})


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
