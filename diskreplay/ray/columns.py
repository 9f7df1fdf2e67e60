"""Ray Data columns as buffer fields: a dataset's Arrow schema read as `Field`s, and a block's
columns as the arrays `ReplayBuffer.extend` takes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from ray.data.block import Block, BlockAccessor

from ..errors import SchemaError
from ..format.schema import Field
from .plan import ROW_ID

TENSOR_TYPES = ("ray.data.arrow_tensor", "ray.data.arrow_tensor_v2")
"""Ray's fixed-shape tensor columns (a shape per row: variable-shaped ones are not a field)."""

EXPECTED = ("a bool, integer or float column, a fixed-shape Ray tensor column (numpy arrays of one shape) "
            "or a fixed-size list of those")


def fields_of_schema(schema: pa.Schema, url: str) -> dict[str, Field]:
    """A field per column of ``schema`` (but ``row_id``: `fields_of_columns`), in its order.

    Raises SchemaError naming the column, its type and what a field can be: a column of another
    type (strings, variable-length lists, variable-shaped tensors, nested structs...)."""
    return fields_of_columns(schema.names, schema.types, url)


def fields_of_columns(names: Sequence[str], types: Sequence[Any], url: str) -> dict[str, Field]:
    """A field per column ``names[i]`` of type ``types[i]`` (Arrow types, or numpy dtypes of
    pandas blocks) but ``row_id`` (the row ids `read_buffer` adds: they name rows of the buffer
    read, not data); SchemaError as `fields_of_schema`."""
    return {name: field_of(name, pa.from_numpy_dtype(kind) if isinstance(kind, np.dtype) else kind, url)
            for name, kind in zip(names, types) if name != ROW_ID}


def field_of(name: str, kind: pa.DataType, url: str) -> Field:
    """The field of column ``name`` of Arrow type ``kind``; SchemaError as `fields_of_schema`."""
    shape: tuple[int, ...] = ()
    while True:
        if isinstance(kind, pa.ExtensionType) and kind.extension_name in TENSOR_TYPES:
            shape, kind = shape + tuple(int(n) for n in kind.shape), kind.storage_type.value_type
        elif pa.types.is_fixed_size_list(kind):
            shape, kind = shape + (kind.list_size,), kind.value_type
        else:
            break
    if not (pa.types.is_boolean(kind) or pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise SchemaError(f"{url!r}: column {name!r} cannot be a buffer field: expected {EXPECTED}, "
                          f"got Arrow type {kind if not shape else f'{kind} of shape {shape}'}")
    try:
        return Field(shape, np.dtype(kind.to_pandas_dtype()))
    except SchemaError as exc:
        raise SchemaError(f"{url!r}: column {name!r}: {exc}") from None


def block_columns(block: Block, fields: Mapping[str, Field], url: str) -> dict[str, np.ndarray]:
    """The columns of ``block`` that ``fields`` names, as arrays ``[n, *shape]`` (cast by
    `ReplayBuffer.extend`, which checks them).

    Raises SchemaError naming the column: one missing, one with null values, or rows whose
    shape is not the field's."""
    table = BlockAccessor.for_block(block).to_arrow()
    missing = [name for name in fields if name not in table.column_names]
    if missing:
        raise SchemaError(f"{url!r}: a block has no column {missing[0]!r} (expected the columns "
                          f"{list(fields)}, got {table.column_names})")
    columns = {}
    for name, field in fields.items():
        column = table.column(name)
        if column.null_count:
            raise SchemaError(f"{url!r}: column {name!r} has {column.null_count} null values; a field "
                              f"holds a {field.dtype} value of shape {field.shape} in every row")
        columns[name] = _stacked(name, BlockAccessor.for_block(table.select([name])).to_numpy()[name], field, url)
    return columns


def _stacked(name: str, values: Any, field: Field, url: str) -> np.ndarray:
    """``values`` as one array; an object array of per-row arrays (fixed-size lists) stacked."""
    array = np.asarray(values)
    if array.dtype == object:
        array = np.stack([np.asarray(row) for row in array]) if len(array) else np.zeros((0, *field.shape))
    if array.shape[1:] != field.shape:
        raise SchemaError(f"{url!r}: column {name!r} has rows of shape {array.shape[1:]}, expected {field.shape}")
    return array
