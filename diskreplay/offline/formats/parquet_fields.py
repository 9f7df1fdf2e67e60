"""The Parquet columns of ragged, text and encoded frame fields: the specs a diskreplay export
records in the schema metadata (`FIELDS_KEY`), and the decoding of such columns.

A ragged field of trailing shape ``T`` is a ``large_list`` (or ``list``) column whose items are
lists of ``T`` (fixed-size lists, or variable-length lists whose lengths must be ``T``); a text
field a ``string`` (or ``large_string``) column; an encoded frame field its decoded pixels (as a
fixed field's column), encoded again by the field's codec on import.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from ...errors import SchemaError
from ...format.ragged import Ragged
from ...format.schema import Field
from ..source import ImportFormatError

FIELDS_KEY = b"diskreplay_fields"
"""Schema metadata key: JSON ``{column: Field.to_json()}`` of every exported field."""


def fields_metadata(columns: dict[str, Field]) -> str:
    """The `FIELDS_KEY` value of ``{column: field}``."""
    return json.dumps({column: spec.to_json() for column, spec in columns.items()})


def declared_fields(file: str, metadata: dict[bytes, bytes] | None) -> dict[str, Field]:
    """``{column: Field}`` of the `FIELDS_KEY` metadata of ``file`` (empty when it has none).
    Raises ImportFormatError naming the file (and the column) for metadata that is not JSON
    field specs."""
    raw = (metadata or {}).get(FIELDS_KEY)
    if raw is None:
        return {}
    try:
        specs = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ImportFormatError(f"{file!r}: schema metadata {FIELDS_KEY.decode()!r} is not JSON ({e})") from None
    if not isinstance(specs, dict):
        raise ImportFormatError(f"{file!r}: schema metadata {FIELDS_KEY.decode()!r} must be a JSON object "
                                f"of column -> field spec, got {type(specs).__name__}")
    found = {}
    for column, spec in specs.items():
        try:
            if not isinstance(spec, dict):
                raise SchemaError(f"expected a JSON object, got {spec!r:.60}")
            found[column] = Field.from_json(spec)
        except (SchemaError, KeyError, TypeError) as e:
            raise ImportFormatError(f"{file!r}: column {column!r}: schema metadata {FIELDS_KEY.decode()!r} "
                                    f"is not a valid field spec ({e})") from None
    return found


def check_column_type(where: str, field: Field, typ: Any, pa: Any) -> None:
    """Raises ImportFormatError (naming ``where``) when a column of arrow type ``typ`` cannot hold
    the ragged or text field ``field``."""
    if field.text:
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise ImportFormatError(f"{where}: declared a text field, the column is {typ}, expected strings")
        return
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
        raise ImportFormatError(f"{where}: declared ragged {field.declared_shape}, the column is {typ}, "
                                f"expected a list column")
    typ = typ.value_type
    for size in field.shape:
        if pa.types.is_fixed_size_list(typ) and typ.list_size != size:
            raise ImportFormatError(f"{where}: declared ragged {field.declared_shape}, the column holds "
                                    f"lists of {typ.list_size} where {size} are expected")
        if not (pa.types.is_fixed_size_list(typ) or pa.types.is_list(typ) or pa.types.is_large_list(typ)):
            raise ImportFormatError(f"{where}: declared ragged {field.declared_shape}, the column holds {typ} "
                                    f"where lists of {size} are expected")
        typ = typ.value_type
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)) \
            or np.dtype(typ.to_pandas_dtype()) != field.dtype:
        raise ImportFormatError(f"{where}: declared ragged {field.dtype}, the column holds {typ}")


def text_rows(where: str, values: Any) -> np.ndarray:
    """A string column as an object array of ``str``; ImportFormatError for nulls."""
    if values.null_count:
        raise ImportFormatError(f"{where}: holds null values")
    texts = np.empty(len(values), dtype=object)
    texts[:] = values.to_pylist()
    return texts


def ragged_rows(where: str, values: Any, trailing: tuple[int, ...], first_row: int) -> Ragged:
    """A (large) list column as a `Ragged` of rows ``[n, *trailing]``, without a loop per row;
    ImportFormatError naming ``where`` and the row (``first_row`` is the first's row number) for
    nulls or items that are not lists of ``trailing``."""
    if values.null_count:
        raise ImportFormatError(f"{where}: holds null values (row {first_row + _first_null(values)})")
    offsets = np.asarray(values.offsets, dtype=np.int64)
    flat = values.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = offsets - offsets[0]
    per_item = 1  # values of the outer list per item of the current level
    for size in trailing:
        bad = _bad_items(flat, size)
        if bad is not None:
            row = int(np.searchsorted(offsets, bad // per_item, side="right")) - 1
            raise ImportFormatError(f"{where}: row {first_row + row} does not hold lists of {size} "
                                    f"(declared rows of shape {(None, *trailing)})")
        flat, per_item = flat.flatten(), per_item * size
    if flat.null_count:
        row = int(np.searchsorted(offsets, _first_null(flat) // per_item, side="right")) - 1
        raise ImportFormatError(f"{where}: holds null values (row {first_row + row})")
    array = flat.to_numpy(zero_copy_only=False).reshape(-1, *trailing)
    return Ragged(array, offsets)


def _bad_items(items: Any, size: int) -> int | None:
    """The index of the first item of ``items`` (a list array) that is null or not of length
    ``size``; None when every item is."""
    if not hasattr(items, "value_lengths"):
        return 0 if len(items) else None
    lengths = items.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(lengths != size)
    return int(bad[0]) if len(bad) else None


def _first_null(values: Any) -> int:
    return int(np.argmin(values.is_valid().to_numpy(zero_copy_only=False)))


def check_lengths(file: str, batch: dict[str, Any], fields: dict[str, Field], columns: dict[str, str],
                  first_row: int) -> None:
    """Raises ImportFormatError when a ``length_of`` field's rows differ in length from its
    field's (naming the file, the columns and the first row that differs)."""
    for name, field in fields.items():
        if field.length_of is None or field.length_of not in batch:
            continue
        mine, theirs = batch[name].lengths, batch[field.length_of].lengths
        bad = np.flatnonzero(mine != theirs)
        if len(bad):
            row = int(bad[0])
            raise ImportFormatError(f"{file!r}: column {columns[name]!r} row {first_row + row} has "
                                    f"{int(mine[row])} values, column {columns[field.length_of]!r} (its "
                                    f"length_of) {int(theirs[row])}")
