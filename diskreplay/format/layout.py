"""The Zarr v3 layout of a buffer: its metadata documents, written at create and checked at open.

A buffer is a Zarr v3 group with one array per field, shaped ``(num_envs, lane_rows, *field.shape)``
and chunked ``(1, chunk_rows, *field.shape)``: one chunk holds ``chunk_rows`` consecutive steps of
one env lane. Its axes are named by `dimension_names` (so that xarray opens the group); arrays
of older buffers have no names and still open. diskreplay writes and reads the chunks itself
(`Codec`, `chunk_key`) and reads and writes the metadata documents (``zarr.json``) through its
own byte store, with its retries; no zarr-python call is made at run time. zarr-python is used
only to produce the metadata documents at create (`metadata_documents`), so that they are
exactly what zarr writes, and by any other tool that reads the buffer. Apart from the importer
of plain Zarr groups, the `format` package is the only place that imports zarr.

Everything read from a store is validated here before use (`read_layout`, `array_problems`):
numbers are bounded, names and codecs checked against the buffer's own config, so a damaged or
crafted document is a `CorruptBufferError` naming the object and the field, never a wrong read
or an allocation sized by the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import zarr
import zarr.storage

from ..errors import CorruptBufferError, NotABufferError, SchemaError
from .codecs import Codec, inner_rows_for
from .config import MAX_CHUNKS, MAX_STEPS, BufferConfig
from .keys import FINALS_DIR, FORMAT_1, GROUP_KEY, OWN_GROUP, array_key, read_json, side_stores
from .ragged import MAX_VALUES, value_chunk_for
from .schema import Field, Schema

ArrayMeta = dict[str, Any]
"""One field's array ``zarr.json``, checked by `array_problems`."""


def metadata_documents(config: BufferConfig, lane_rows: int) -> dict[str, bytes]:
    """``{key: bytes}`` of the group's and every array's ``zarr.json``, as zarr writes them, for
    arrays of ``lane_rows`` steps per lane."""
    documents: dict[str, Any] = {}
    group = zarr.open_group(store=zarr.storage.MemoryStore(store_dict=documents), mode="w")
    for name, field in config.schema.items():
        group.create_array(name, shape=(config.num_envs, lane_rows, *field.shape),
                           chunks=(1, config.chunk_rows, *field.shape), dtype=field.dtype,
                           **field_codec(Codec(config.compression, config.level), config, field).zarr_codecs(field),
                           chunk_key_encoding={"name": "default", "separator": config.chunk_key_separator},
                           dimension_names=dimension_names(name, field, config.lane_capacity is not None),
                           fill_value=0)
    for name, field in config.user_schema.ragged.items():
        vc = value_chunk_for(field.shape, field.dtype)
        group.create_array(name, shape=values_shape(config, field, lane_rows, vc), chunks=(1, 1, vc, *field.shape),
                           dtype=field.dtype, **values_codec(config).zarr_codecs(field),
                           chunk_key_encoding={"name": "default", "separator": config.chunk_key_separator},
                           dimension_names=values_dimension_names(name, field), fill_value=0)
    group.attrs.update({"diskreplay": config.to_json()})
    if config.format != FORMAT_1:
        add_own_nodes(group)
    return {key: value.to_bytes() for key, value in documents.items()}


def values_shape(config: BufferConfig, field: Field, lane_rows: int, n_values: int) -> tuple[int, ...]:
    """The shape of a ragged field's values array for ``lane_rows`` steps per lane."""
    return (config.num_envs, -(-max(lane_rows, 1) // config.chunk_rows), n_values, *field.shape)


def values_dimension_names(name: str, field: Field) -> tuple[str, ...]:
    """``lane``, ``<name>_chunk`` (the row chunk), ``<name>_value`` (the position in the row
    chunk's values; per field: their sizes differ between fields), then ``<name>_dim<i>`` for
    each trailing axis."""
    return ("lane", f"{name}_chunk", f"{name}_value", *(f"{name}_dim{i}" for i in range(len(field.shape))))


def values_codec(config: BufferConfig) -> Codec:
    """The codec of ragged values chunks: the buffer's, never sharded."""
    return Codec(config.compression, config.level)


def values_problems(name: str, field: Field, meta: ArrayMeta, config: BufferConfig,
                    lanes: int | None = None) -> list[str]:
    """What is wrong with a ragged field's values array metadata (empty: fine); ``lanes``: those
    of its buffer (a shard of a union's), default the config's."""
    lanes = config.num_envs if lanes is None else lanes
    key = array_key(name)
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return [f"{key}: not a Zarr v3 array"]
    grid = meta.get("chunk_grid")
    chunks = (grid.get("configuration") or {}).get("chunk_shape") if isinstance(grid, dict) else None
    expected = [1, 1, value_chunk_for(field.shape, field.dtype), *field.shape]
    shape = meta.get("shape")
    problems = []
    if chunks != expected:
        problems.append(f"{key}: chunk shape {chunks!r:.200}, expected {expected} (values of ragged field {name!r})")
    if (not isinstance(shape, list) or len(shape) != 3 + len(field.shape) or shape[0] != lanes
            or shape[3:] != list(field.shape) or not all(isinstance(s, int) and 0 <= s <= MAX_VALUES for s in shape)):
        problems.append(f"{key}: shape {shape!r:.200}, expected [{lanes}, chunks, values, *{field.shape}]")
    if meta.get("data_type") != str(field.dtype.newbyteorder("=")):
        problems.append(f"{key}: data_type {meta.get('data_type')!r}, expected {field.dtype.name}")
    return problems


def add_own_nodes(group: zarr.Group) -> None:
    """Add to ``group`` the Zarr nodes around diskreplay's own objects (`OBJECTS_DIR`): the group
    ``diskreplay`` and in it the empty array ``objects``, under which Zarr tools never list."""
    own = group.create_group(OWN_GROUP, attributes={
        "description": "diskreplay's own objects (commit record, state, writer lock) under objects/; not data"})
    own.create_array("objects", shape=(0,), dtype="uint8", dimension_names=("object",), fill_value=0)


def dimension_names(name: str, field: Field, ring: bool) -> tuple[str, ...]:
    """The ``dimension_names`` of field ``name``'s array: ``lane`` (the env lane), then ``slot`` in
    a ring (a step's slot is ``step % lane_capacity``) or ``step`` in a dataset, then
    ``<name>_dim<i>`` for each axis of the field. ``lane`` and ``step`` are reserved field names."""
    return ("lane", "slot" if ring else "step", *(f"{name}_dim{i}" for i in range(len(field.shape))))


def field_codec(codec: Codec, config: BufferConfig, field: Field) -> Codec:
    """The codec of one field's chunks in a buffer whose chunks use ``codec``: sharded when the
    buffer has ``row_access`` and the field's rows are big, or small in a ``row_shards`` buffer
    (`inner_rows_for`)."""
    inner = inner_rows_for(codec.compression, config.row_access, field.row_bytes, config.chunk_rows,
                           config.row_shards)
    return Codec(codec.compression, codec.level, codec.checksum, inner)


def field_codecs(codec: Codec, config: BufferConfig) -> dict[str, Codec]:
    """`field_codec` of every stored field."""
    return {name: field_codec(codec, config, field) for name, field in config.schema.items()}


def resized_document(meta: dict[str, Any], lane_rows: int) -> bytes:
    """An array's ``zarr.json`` with its step axis grown to ``lane_rows`` (metadata only)."""
    shape = list(meta["shape"])
    shape[1] = lane_rows
    return json.dumps({**meta, "shape": shape}, indent=2).encode()


def check_schema_compatible(schema: Schema, derive_next: tuple[str, ...] = ()) -> None:
    """Raises SchemaError for fields that cannot be stored or whose name a side store uses."""
    for name, field in schema.items():
        if field.row_bytes == 0:
            raise SchemaError(f"field {name!r}: zero-sized fields cannot be stored, got shape {field.shape}")
        if name in side_stores(bool(derive_next)):
            why = ("with derive_next, each episode's final observation" if name == FINALS_DIR
                   else "diskreplay's own objects")
            raise SchemaError(f"field name {name!r} is taken: {why} are kept under {name}/ in the buffer; "
                              f"rename the field")


def read_layout(get: Callable[[str], bytes | None], url: str) -> tuple[BufferConfig, dict[str, ArrayMeta]]:
    """The buffer's validated config and each field's array metadata, read with ``get(key)``.

    Raises:
        NotABufferError: no group metadata, or a group that is not a diskreplay buffer.
        CorruptBufferError: a document that is unreadable or contradicts the buffer's config,
            naming the document and the field.
    """
    config = read_config(get, url)
    return config, checked_arrays(get, url, config)


def read_config(get: Callable[[str], bytes | None], url: str) -> BufferConfig:
    """The buffer's validated config, from its group's ``zarr.json``. Raises NotABufferError or
    CorruptBufferError (see `read_layout`)."""
    group = read_json(get, GROUP_KEY, url)
    if group is None:
        raise NotABufferError(f"{url!r} is not a diskreplay buffer (no {GROUP_KEY})")
    return BufferConfig.from_group(group, url)


def checked_arrays(get: Callable[[str], bytes | None], url: str, config: BufferConfig) -> dict[str, ArrayMeta]:
    """Each field's array metadata; raises CorruptBufferError naming the first problem."""
    arrays, problems = read_arrays(get, url, config)
    if problems:
        raise CorruptBufferError(f"{url!r}: {problems[0]}")
    return arrays


def read_arrays(get: Callable[[str], bytes | None], url: str,
                config: BufferConfig) -> tuple[dict[str, ArrayMeta], list[str]]:
    """Each field's array metadata that fits ``config``, and every problem found in the others."""
    arrays: dict[str, ArrayMeta] = {}
    problems: list[str] = []
    for name, field in config.schema.items():
        try:
            meta = read_json(get, array_key(name), url)
        except CorruptBufferError as exc:
            problems.append(str(exc).removeprefix(f"{url!r}: "))
            continue
        if meta is None:
            problems.append(f"array for field {name!r} is missing ({array_key(name)})")
            continue
        found = array_problems(name, field, meta, config)
        problems += found
        if not found:
            arrays[name] = meta
    return arrays, problems


def lane_rows(arrays: dict[str, ArrayMeta]) -> int:
    """Steps per lane every array holds (the smallest: a writer killed while growing them leaves
    some grown, some not)."""
    return min(int(meta["shape"][1]) for meta in arrays.values())


def array_problems(name: str, field: Field, meta: ArrayMeta, config: BufferConfig) -> list[str]:
    """Everything wrong with one field's array metadata against the buffer's config (empty: fine)."""
    key = array_key(name)
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return [f"{key}: not a Zarr v3 array"]
    problems = []
    try:
        stored = np.dtype(meta.get("data_type"))
    except (TypeError, ValueError):
        stored = None
    if stored != field.dtype.newbyteorder("="):
        problems.append(f"{key}: data_type {meta.get('data_type')!r}, the buffer records {field.dtype.name} "
                        f"for field {name!r}")
    shape = meta.get("shape")
    lanes, cap = config.num_envs, config.lane_capacity
    if (not isinstance(shape, list) or len(shape) != 2 + len(field.shape) or shape[0] != lanes
            or shape[2:] != list(field.shape) or not isinstance(shape[1], int) or isinstance(shape[1], bool)
            or not 0 <= shape[1] <= MAX_STEPS):
        problems.append(f"{key}: shape {shape!r:.200}, expected {[lanes, cap if cap else 'steps', *field.shape]}")
    elif cap is not None and shape[1] != cap:
        problems.append(f"{key}: {shape[1]} steps per lane, the ring holds {cap}")
    elif lanes * -(-shape[1] // config.chunk_rows) > MAX_CHUNKS:
        problems.append(f"{key}: {shape[1]} steps per lane need more than {MAX_CHUNKS} chunks")
    grid = meta.get("chunk_grid")
    chunks = (grid.get("configuration") or {}).get("chunk_shape") if isinstance(grid, dict) else None
    expected = [1, config.chunk_rows, *field.shape]
    if not isinstance(grid, dict) or grid.get("name") != "regular":
        problems.append(f"{key}: chunk grid {grid!r:.200}, expected a 'regular' grid")
    elif chunks != expected:
        problems.append(f"{key}: chunk shape {chunks!r:.200}, expected {expected}")
    encoding, separator = meta.get("chunk_key_encoding"), config.chunk_key_separator
    if (not isinstance(encoding, dict) or encoding.get("name") != "default"
            or (encoding.get("configuration") or {}).get("separator", "/") != separator):
        problems.append(f"{key}: chunk key encoding {encoding!r:.200}, expected default with {separator!r}")
    problems += _dimension_problems(name, field, meta, config)
    try:
        codec = Codec.from_zarr_codecs(meta.get("codecs"), field.dtype)
        if codec.compression != config.compression or (codec.compression and codec.level != config.level):
            problems.append(f"{key}: codecs {[c.get('name') for c in meta['codecs']]} differ from the buffer's "
                            f"(compression {config.compression!r}, level {config.level})")
        elif codec.inner_rows != field_codec(codec, config, field).inner_rows:
            problems.append(f"{key}: inner chunks of {codec.inner_rows} rows, expected "
                            f"{field_codec(codec, config, field).inner_rows} (rows of {field.row_bytes} bytes)")
        elif codec.inner_rows is not None:
            inner = list(meta["codecs"][0]["configuration"]["chunk_shape"])
            expected_inner = [1, codec.inner_rows, *field.shape]
            if inner != expected_inner:
                problems.append(f"{key}: inner chunk shape {inner!r:.200}, expected {expected_inner}")
    except ValueError as exc:
        problems.append(f"{key}: {exc}")
    return problems


def _dimension_problems(name: str, field: Field, meta: ArrayMeta, config: BufferConfig) -> list[str]:
    """What is wrong with an array's ``dimension_names`` (empty: fine). Arrays written before
    diskreplay wrote them have none (absent or null); present, they must be `dimension_names`."""
    names = meta.get("dimension_names")
    expected = list(dimension_names(name, field, config.lane_capacity is not None))
    if names is None or names == expected:
        return []
    return [f"{array_key(name)}: dimension_names {names!r:.200}, expected {expected} (or none) for field {name!r}"]


def buffer_codec(arrays: dict[str, ArrayMeta], url: str) -> Codec:
    """The codec of a buffer's chunks (checked by `array_problems`). Buffers from before checksums
    have none; every array of one buffer is written with the same codec, so arrays that disagree
    are corrupt (raises CorruptBufferError naming them)."""
    codecs = {name: Codec.from_zarr_codecs(meta["codecs"], np.dtype(meta["data_type"]))
              for name, meta in arrays.items()}
    first, codec = next(iter(codecs.items()))
    for name, other in codecs.items():
        if other.checksum != codec.checksum:
            with_, without = (first, name) if codec.checksum else (name, first)
            raise CorruptBufferError(f"{url!r}: {array_key(with_)} has a crc32c checksum codec and "
                                     f"{array_key(without)} has none; every array of a buffer has the same codecs")
    return Codec(codec.compression, codec.level, codec.checksum)
