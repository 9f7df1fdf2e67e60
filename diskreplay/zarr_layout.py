"""Everything diskreplay knows about Zarr, in one place.

A buffer is a Zarr v3 group with one array per field, shaped ``(num_envs, lane_rows, *field.shape)``
and chunked ``(1, chunk_rows, *field.shape)``: one chunk holds ``chunk_rows`` consecutive steps of
one env lane. diskreplay writes and reads those chunks itself (`Codec`, `chunk_key`) so that the
hot path makes no zarr-python calls; zarr-python is used only to create the group and arrays, to
resize them in dataset mode, and by any other tool that reads the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numcodecs
import numpy as np
import zarr
import zarr.codecs

from .errors import CorruptBufferError, NotABufferError, SchemaError
from .schema import Field, Schema

FORMAT = "diskreplay/1"
COMPRESSIONS = (None, "zstd", "lz4")
CHUNK_KEY_SEPARATOR = "."
"""New buffers name chunks ``<field>/c.<lane>.<chunk>.0``: one directory per field. With zarr's
default "/" every chunk file sits in a directory of its own, and creating those directories costs
more than writing the chunks. Buffers made with "/" still open and work."""


@dataclass(frozen=True)
class Codec:
    """Turns one chunk's ndarray into the exact bytes zarr would store, and back."""

    compression: str | None
    level: int = 3

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")

    @property
    def raw(self) -> bool:
        """True when a chunk's bytes are its raw little-endian C-order values (memory-mappable)."""
        return self.compression is None

    def _numcodec(self):
        if self.compression == "zstd":
            return numcodecs.Zstd(level=self.level)
        return numcodecs.Blosc(cname="lz4", clevel=self.level, shuffle=numcodecs.Blosc.SHUFFLE)

    def encode(self, chunk: np.ndarray) -> bytes | memoryview:
        """The chunk's stored bytes. Raw chunks are a view of ``chunk`` itself (no copy): write
        them out before ``chunk`` changes."""
        data = np.ascontiguousarray(chunk)
        if self.raw:
            return memoryview(data.reshape(-1).view(np.uint8))
        return bytes(self._numcodec().encode(data))

    def decode_into(self, blob: bytes, out: np.ndarray) -> None:
        """Decode ``blob`` into the preallocated C-contiguous ``out`` (shape and dtype of the chunk)."""
        flat = out.reshape(-1).view(np.uint8)
        if self.raw:
            src = np.frombuffer(blob, dtype=np.uint8)
        else:
            src = np.frombuffer(self._numcodec().decode(blob), dtype=np.uint8)
        if src.size != flat.size:
            raise ValueError(f"decoded chunk has {src.size} bytes, expected {flat.size}")
        flat[:] = src

    def zarr_compressors(self) -> Any:
        if self.compression is None:
            return None
        if self.compression == "zstd":
            return zarr.codecs.ZstdCodec(level=self.level)
        return zarr.codecs.BloscCodec(cname="lz4", clevel=self.level, shuffle="shuffle")

    @classmethod
    def from_zarr_codecs(cls, field_name: str, codecs: list[dict[str, Any]]) -> "Codec":
        names = [c["name"] for c in codecs]
        if names == ["bytes"]:
            return cls(None)
        if names == ["bytes", "zstd"] and not codecs[1].get("configuration", {}).get("checksum"):
            return cls("zstd", codecs[1]["configuration"]["level"])
        if names == ["bytes", "blosc"] and codecs[1]["configuration"].get("cname") == "lz4":
            return cls("lz4", codecs[1]["configuration"]["clevel"])
        raise CorruptBufferError(f"array {field_name!r}: unsupported zarr codecs {names}")


def chunk_key(field_name: str, field: Field, lane: int, chunk: int, separator: str) -> str:
    """The store key of one chunk, in zarr v3's default chunk key encoding with ``separator``."""
    return f"{field_name}/c{separator}{lane}{separator}{chunk}" + f"{separator}0" * len(field.shape)


def open_group(url: str, mode: str, storage_options: dict | None) -> zarr.Group:
    return zarr.open_group(url, mode=mode, storage_options=storage_options or None)


def create_arrays(group: zarr.Group, schema: Schema, num_envs: int, lane_rows: int,
                  chunk_rows: int, codec: Codec, attrs: dict[str, Any]) -> None:
    """Create one array per field and record ``attrs`` (static buffer config) on the group."""
    for name, field in schema.items():
        group.create_array(
            name,
            shape=(num_envs, lane_rows, *field.shape),
            chunks=(1, chunk_rows, *field.shape),
            dtype=field.dtype,
            compressors=codec.zarr_compressors(),
            chunk_key_encoding={"name": "default", "separator": attrs["chunk_key_separator"]},
            fill_value=0,
        )
    group.attrs.update({"diskreplay": {"format": FORMAT, **attrs}})


def read_config(group: zarr.Group, url: str) -> dict[str, Any]:
    """The static config saved at create, checked against the arrays actually in the group."""
    config = group.attrs.get("diskreplay")
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise NotABufferError(f"{url!r} is a zarr group but not a diskreplay buffer (no {FORMAT} attributes)")
    schema = Schema.from_json(config["fields"])
    config.setdefault("chunk_key_separator", "/")  # buffers from before the "." keys
    for name, field in schema.items():
        try:
            arr = group[name]
        except KeyError:
            raise CorruptBufferError(f"{url!r}: array for field {name!r} is missing") from None
        meta = arr.metadata
        if np.dtype(arr.dtype) != field.dtype.newbyteorder("=") and np.dtype(arr.dtype) != field.dtype:
            raise CorruptBufferError(
                f"{url!r}: array {name!r} has dtype {arr.dtype}, the buffer records {field.dtype}")
        expected_chunks = (1, config["chunk_rows"], *field.shape)
        if tuple(meta.chunk_grid.chunk_shape) != expected_chunks:
            raise CorruptBufferError(
                f"{url!r}: array {name!r} has chunks {tuple(meta.chunk_grid.chunk_shape)}, "
                f"expected {expected_chunks}")
        encoding = meta.chunk_key_encoding.to_dict()
        expected_encoding = {"name": "default", "configuration": {"separator": config["chunk_key_separator"]}}
        if encoding != expected_encoding:
            raise CorruptBufferError(
                f"{url!r}: array {name!r} has chunk key encoding {encoding}, expected {expected_encoding}")
        codecs = [c.to_dict() for c in meta.codecs]
        if Codec.from_zarr_codecs(name, codecs) != Codec(config["compression"], config["level"]):
            raise CorruptBufferError(f"{url!r}: array {name!r} codecs {codecs} differ from the buffer's")
    return config


def resize_lanes(group: zarr.Group, schema: Schema, num_envs: int, lane_rows: int) -> None:
    """Grow every array's step axis to ``lane_rows`` (dataset mode). Only metadata is rewritten."""
    for name, field in schema.items():
        arr = group[name]
        if arr.shape[1] != lane_rows:
            arr.resize((num_envs, lane_rows, *field.shape))


def check_schema_compatible(schema: Schema) -> None:
    for name, field in schema.items():
        if field.row_bytes == 0:
            raise SchemaError(f"field {name!r}: zero-sized fields cannot be stored, got shape {field.shape}")
