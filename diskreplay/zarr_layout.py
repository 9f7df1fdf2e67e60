"""Everything diskreplay knows about Zarr, in one place: the on-disk metadata and chunk bytes.

A buffer is a Zarr v3 group with one array per field, shaped ``(num_envs, lane_rows, *field.shape)``
and chunked ``(1, chunk_rows, *field.shape)``: one chunk holds ``chunk_rows`` consecutive steps of
one env lane. diskreplay writes and reads the chunks itself (`Codec`, `chunk_key`) and reads and
writes the metadata documents (``zarr.json``) through its own byte store, with its retries; no
zarr-python call is made at run time. zarr-python is used only to produce the metadata documents
at create (`metadata_documents`), so that they are exactly what zarr writes, and by any other
tool that reads the buffer.

Everything read from a store is validated here before use (`read_layout`, `array_problems`):
numbers are bounded, names and codecs checked against the buffer's own config, so a damaged or
crafted document is a `CorruptBufferError` naming the object and the field, never a wrong read
or an allocation sized by the file.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable

import google_crc32c
import numcodecs
from numcodecs import blosc
import numpy as np
import zarr
import zarr.codecs
import zarr.storage
import zstandard

from .errors import CorruptBufferError, NotABufferError, SchemaError
from .schema import Field, Schema

FORMAT = "diskreplay/1"
GROUP_KEY = "zarr.json"
COMPRESSIONS = (None, "zstd", "lz4")
CHUNK_KEY_SEPARATOR = "."
"""New buffers name chunks ``<field>/c.<lane>.<chunk>.0``: one directory per field. With zarr's
default "/" every chunk file sits in a directory of its own, and creating those directories costs
more than writing the chunks. Buffers made with "/" still open and work."""
CHECKSUM_BYTES = 4
ROW_ACCESS_BYTES = 1 << 10
INNER_CHUNK_BYTES = 1 << 13
"""Compressed fields whose rows take at least `ROW_ACCESS_BYTES` (images) are stored as Zarr
shards: each chunk file holds inner chunks of about `INNER_CHUNK_BYTES` (one 84x84 frame),
compressed one by one behind an index, so a sampled row costs one small read and decode, not
the decode of its whole chunk (`Codec.inner_rows`)."""
EMPTY_INNER = (1 << 64) - 1
BLOSC_HEADER_BYTES = 16

MAX_LANES = 1 << 16
MAX_STEPS = 1 << 46
"""Bounds on lanes and on the steps a lane may ever count: a row id ``step * num_envs + lane``
stays below 2**62."""
MAX_CHUNK_ROWS = 1 << 24
MAX_CHUNKS = 1 << 26
"""Chunks a buffer may have over all lanes: the chunk table (8 bytes per chunk) stays below 512 MiB."""
MAX_METADATA_BYTES = 16 << 20
"""The largest metadata document (``zarr.json``, ``commit.json``) diskreplay reads."""
STATE_DIR = "state"
FINALS_DIR = "final"


def side_stores(derive_next: bool) -> tuple[str, ...]:
    """Names inside a buffer's location that belong to diskreplay, not to a field's array."""
    return (STATE_DIR, FINALS_DIR) if derive_next else (STATE_DIR,)


def inner_rows_for(compression: str | None, row_access: bool, row_bytes: int, chunk_rows: int) -> int | None:
    """Rows per inner chunk of a field with rows of ``row_bytes`` (None: chunks are not sharded):
    a power of two near `INNER_CHUNK_BYTES` dividing ``chunk_rows``, for compressed fields of a
    ``row_access`` buffer whose rows take at least `ROW_ACCESS_BYTES`."""
    if compression is None or not row_access or row_bytes < ROW_ACCESS_BYTES:
        return None
    return math.gcd(1 << (max(INNER_CHUNK_BYTES // row_bytes, 1).bit_length() - 1), chunk_rows)


@dataclass(frozen=True)
class Codec:
    """Turns one chunk's ndarray into the exact bytes zarr would store, and back.

    ``checksum``: a CRC32C of the encoded bytes follows them (zarr's ``crc32c`` codec), so torn,
    zeroed or garbage chunks are found on every whole-chunk read and by `verify`. Raw chunks
    with a checksum are still memory-mappable: the values come first.

    ``inner_rows``: the chunk is a Zarr shard (``sharding_indexed``, index first) of inner
    chunks of that many rows, each compressed and checksummed on its own; the index holds one
    little-endian ``(offset, nbytes)`` uint64 pair per inner chunk, then its CRC32C. One inner
    chunk is read with `index_bytes` and `decode_bodies` (see `diskreplay.shard_maps`).
    """

    compression: str | None
    level: int = 3
    checksum: bool = True
    inner_rows: int | None = None

    def __post_init__(self) -> None:
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {COMPRESSIONS}, got {self.compression!r}")
        if isinstance(self.level, bool) or not isinstance(self.level, (int, np.integer)) or not 0 <= self.level <= 22:
            raise ValueError(f"compression_level must be an int in [0, 22], got {self.level!r}")
        if self.inner_rows is not None and (self.compression is None or not self.checksum):
            raise ValueError("sharded chunks are written compressed and checksummed")

    @property
    def raw(self) -> bool:
        """True when a chunk's bytes start with its raw little-endian C-order values (memory-mappable)."""
        return self.compression is None

    @property
    def trailer(self) -> int:
        """Bytes after the values in a raw chunk (its checksum)."""
        return CHECKSUM_BYTES if self.checksum else 0

    def _compress(self, data: np.ndarray) -> bytes:
        if self.compression == "zstd":
            return _ZSTD.compressor(self.level).compress(memoryview(data.reshape(-1).view(np.uint8)))
        return bytes(numcodecs.Blosc(cname="lz4", clevel=self.level, shuffle=numcodecs.Blosc.SHUFFLE).encode(data))

    def _decompress(self, body: bytes | memoryview, nbytes: int) -> bytes | memoryview:
        """``body`` decompressed, which must give ``nbytes`` bytes: checked before a zstd frame's
        header can size an allocation. Raises ValueError."""
        if self.compression == "zstd":
            size = zstandard.frame_content_size(body)
            if size not in (nbytes, zstandard.CONTENTSIZE_UNKNOWN):
                raise ValueError(f"zstd frame of {size} bytes, expected {nbytes}")
            return _ZSTD.decompressor.decompress(body, max_output_size=nbytes)
        claimed = int.from_bytes(body[4:8], "little") if len(body) >= BLOSC_HEADER_BYTES else None
        if claimed != nbytes:  # blosc would fill less than all of ``out`` without a word
            raise ValueError(f"blosc frame of {claimed} bytes, expected {nbytes}")
        out = np.empty(nbytes, np.uint8)
        blosc.decompress(body, out)
        return out

    def encode(self, chunk: np.ndarray) -> tuple[bytes | memoryview, ...]:
        """The chunk's stored bytes, in parts to be written one after the other. Raw values are a
        view of ``chunk`` itself (no copy): write them out before ``chunk`` changes."""
        data = np.ascontiguousarray(chunk)
        if self.inner_rows is not None:
            return self._encode_shard(data)
        body: bytes | memoryview = memoryview(data.reshape(-1).view(np.uint8)) if self.raw else self._compress(data)
        return (body, checksum(body)) if self.checksum else (body,)

    def _encode_shard(self, data: np.ndarray) -> tuple[bytes, ...]:
        rows = self.inner_rows
        bodies = [self._compress(data[i:i + rows]) for i in range(0, len(data), rows)]
        sizes = np.array([len(b) + CHECKSUM_BYTES for b in bodies], dtype="<u8")
        index = np.empty((len(bodies), 2), dtype="<u8")
        index[:, 1] = sizes
        index[:, 0] = self.index_bytes(len(data)) + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        head = index.tobytes()
        return (head, checksum(head), *(part for b in bodies for part in (b, checksum(b))))

    def index_bytes(self, chunk_rows: int) -> int:
        """Bytes of a shard's index (with its checksum) for a chunk of ``chunk_rows`` rows."""
        return 16 * (chunk_rows // self.inner_rows) + CHECKSUM_BYTES

    @staticmethod
    def _span(entries: bytes | memoryview, inner: int, index_bytes: int, limit: int) -> tuple[int, int] | None:
        entry = entries[16 * inner:16 * inner + 16]
        offset, nbytes = int.from_bytes(entry[:8], "little"), int.from_bytes(entry[8:], "little")
        if offset == nbytes == EMPTY_INNER:
            return None
        if offset < index_bytes or not CHECKSUM_BYTES < nbytes <= limit:
            raise ValueError(f"inner chunk {inner}: span ({offset}, {nbytes}) outside the shard's data")
        return offset, nbytes

    def decode_inner(self, blob: bytes | memoryview, out: np.ndarray) -> None:
        """Decode one inner chunk (with its checksum) into ``out``. Raises ValueError."""
        self.decode_body(self.verified_body(blob), out)

    def decode_bodies(self, bodies: list[memoryview | None], out: np.ndarray, threads: int = 1) -> None:
        """Decode inner chunks (checksums already checked and cut off) into ``out[i]``, one per
        body; None: stored empty, zeros. zstd frames are decoded in one call on ``threads``
        threads, each into exactly the bytes of its ``out[i]``. Raises ValueError."""
        flat = out.reshape(len(bodies), -1).view(np.uint8)
        present = [i for i, body in enumerate(bodies) if body is not None]
        if len(present) < len(bodies):
            flat[[i for i, body in enumerate(bodies) if body is None]] = 0
        if self.compression != "zstd" or len(present) < 2:
            for i in present:
                self.decode_body(bodies[i], flat[i])
            return
        sizes = np.full(len(present), flat.shape[1], dtype=np.uint64)
        try:
            frames = _ZSTD.decompressor.multi_decompress_to_buffer(
                [bodies[i] for i in present], decompressed_sizes=sizes, threads=threads)
        except zstandard.ZstdError as exc:
            raise ValueError(str(exc)) from None
        decoded = np.frombuffer(b"".join(frames[i] for i in range(len(present))), dtype=np.uint8)
        if len(present) == len(bodies):
            flat[:] = decoded.reshape(flat.shape)
        else:
            flat[present] = decoded.reshape(len(present), -1)

    def decode_body(self, body: bytes | memoryview, out: np.ndarray) -> None:
        """Decode one compressed body (no checksum) into ``out``. Raises ValueError."""
        flat = out.reshape(-1).view(np.uint8)
        src = np.frombuffer(self._decompress(body, flat.size), dtype=np.uint8)
        if src.size != flat.size:
            raise ValueError(f"decoded inner chunk has {src.size} bytes, expected {flat.size}")
        flat[:] = src

    def decode_into(self, blob: bytes, out: np.ndarray) -> None:
        """Decode ``blob`` into the preallocated C-contiguous ``out`` (shape and dtype of the chunk).

        Raises ValueError if the checksum does not match or the bytes do not decode to ``out``'s size.
        """
        if self.inner_rows is not None:
            return self._decode_shard(memoryview(blob), out)
        body = memoryview(blob)
        if self.checksum:
            body = self.verified_body(body)
        flat = out.reshape(-1).view(np.uint8)
        src = np.frombuffer(body if self.raw else self._decompress(body, flat.size), dtype=np.uint8)
        if src.size != flat.size:
            raise ValueError(f"decoded chunk has {src.size} bytes, expected {flat.size}")
        flat[:] = src

    def _decode_shard(self, blob: memoryview, out: np.ndarray) -> None:
        head = self.index_bytes(len(out))
        if len(blob) < head:
            raise ValueError(f"{len(blob)} bytes: too short to hold the shard's index of {head} bytes")
        rows, entries = self.inner_rows, self.verified_body(blob[:head])
        for inner in range(len(out) // rows):
            span = self._span(entries, inner, head, len(blob))
            if span is None:
                out[inner * rows:(inner + 1) * rows] = 0
            elif span[0] + span[1] > len(blob):
                raise ValueError(f"inner chunk {inner}: span {span} past the shard's {len(blob)} bytes")
            else:
                self.decode_inner(blob[span[0]:span[0] + span[1]], out[inner * rows:(inner + 1) * rows])

    @staticmethod
    def verified_body(blob: bytes | memoryview) -> bytes | memoryview:
        """``blob`` without its trailing checksum, which must match. Raises ValueError."""
        if len(blob) < CHECKSUM_BYTES:
            raise ValueError(f"{len(blob)} bytes: too short to hold a checksum")
        body, stored = blob[:-CHECKSUM_BYTES], bytes(blob[-CHECKSUM_BYTES:])
        if checksum(body) != stored:
            raise ValueError(f"checksum mismatch (stored {stored.hex()}, computed {checksum(body).hex()})")
        return body

    def zarr_codecs(self, field: Field) -> dict[str, Any]:
        """``create_array`` arguments (``compressors``, ``serializer``) that make zarr describe these chunks."""
        compressors: list[Any] = []
        if self.compression == "zstd":
            compressors.append(zarr.codecs.ZstdCodec(level=self.level))
        elif self.compression == "lz4":
            compressors.append(zarr.codecs.BloscCodec(cname="lz4", clevel=self.level, shuffle="shuffle"))
        if self.checksum:
            compressors.append(zarr.codecs.Crc32cCodec())
        if self.inner_rows is None:
            return {"compressors": compressors}
        inner = zarr.codecs.ShardingCodec(chunk_shape=(1, self.inner_rows, *field.shape), index_location="start",
                                          codecs=[zarr.codecs.BytesCodec(), *compressors])
        return {"compressors": None, "serializer": inner}

    @classmethod
    def from_zarr_codecs(cls, codecs: Any, dtype: np.dtype) -> "Codec":
        """The codec of an array's ``codecs`` metadata. Raises ValueError for anything else."""
        if not isinstance(codecs, list) or not all(isinstance(c, dict) for c in codecs):
            raise ValueError(f"codecs: expected a list of objects, got {codecs!r}")
        names = [c.get("name") for c in codecs]
        if names == ["sharding_indexed"]:
            return cls._from_sharding(codecs[0].get("configuration"), dtype)
        if not names or names[0] != "bytes":
            raise ValueError(f"unsupported zarr codecs {names}")
        endian = (codecs[0].get("configuration") or {}).get("endian", "little")
        if dtype.itemsize > 1 and endian != "little":
            raise ValueError(f"{endian}-endian chunks, diskreplay writes little-endian")
        checksum_ = names[-1] == "crc32c"
        middle = codecs[1:len(codecs) - checksum_]
        if not middle:
            return cls(None, checksum=checksum_)
        config = middle[0].get("configuration") or {}
        if len(middle) == 1 and middle[0]["name"] == "zstd" and not config.get("checksum"):
            return cls("zstd", _level(config.get("level")), checksum_)
        if len(middle) == 1 and middle[0]["name"] == "blosc" and config.get("cname") == "lz4":
            return cls("lz4", _level(config.get("clevel")), checksum_)
        if len(middle) == 1 and middle[0]["name"] == "zstd":
            raise ValueError("zstd with its own checksum (configuration.checksum true) is not a codec diskreplay writes")
        raise ValueError(f"unsupported zarr codecs {names}")

    @classmethod
    def _from_sharding(cls, config: Any, dtype: np.dtype) -> "Codec":
        config = config if isinstance(config, dict) else {}
        shape, index = config.get("chunk_shape"), config.get("index_codecs")
        index_names = [c.get("name") if isinstance(c, dict) else None for c in index or []]
        if (not isinstance(shape, list) or len(shape) < 2 or not all(type(v) is int and v >= 1 for v in shape)
                or config.get("index_location") != "start" or index_names != ["bytes", "crc32c"]
                or (index[0].get("configuration") or {}).get("endian", "little") != "little"):
            raise ValueError(f"sharding_indexed configuration {config!r:.300} is not one diskreplay writes "
                             f"(index first, little-endian, with a crc32c)")
        inner = cls.from_zarr_codecs(config.get("codecs"), dtype)
        if inner.inner_rows is not None or inner.compression is None or not inner.checksum:
            raise ValueError("sharding_indexed: inner chunks must be compressed and checksummed, not sharded again")
        return cls(inner.compression, inner.level, True, shape[1])


class _Zstd(threading.local):
    """This thread's zstd contexts, kept: making one costs more than coding a frame."""

    def __init__(self) -> None:
        self.decompressor = zstandard.ZstdDecompressor()
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        if level not in self.compressors:
            self.compressors[level] = zstandard.ZstdCompressor(level=level)
        return self.compressors[level]


_ZSTD = _Zstd()


def checksum(data: bytes | memoryview) -> bytes:
    """CRC32C of ``data`` as zarr's ``crc32c`` codec stores it (4 bytes, little-endian)."""
    if not isinstance(data, bytes):
        data = np.frombuffer(data, dtype=np.uint8)
        data.flags.writeable = False  # google_crc32c takes bytes and read-only buffers only
    return int(google_crc32c.value(data)).to_bytes(4, "little")


def _level(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"compression level: expected an int, got {value!r}")
    return value


def chunk_key(field_name: str, field: Field, lane: int, chunk: int, separator: str) -> str:
    """The store key of one chunk, in zarr v3's default chunk key encoding with ``separator``."""
    return f"{field_name}/c{separator}{lane}{separator}{chunk}" + f"{separator}0" * len(field.shape)


def array_key(name: str) -> str:
    return f"{name}/{GROUP_KEY}"


# ---- writing metadata ------------------------------------------------------------------------


def metadata_documents(schema: Schema, num_envs: int, lane_rows: int, chunk_rows: int, codec: Codec,
                       config: dict[str, Any]) -> dict[str, bytes]:
    """``{key: bytes}`` of the group's and every array's ``zarr.json``, as zarr writes them."""
    documents: dict[str, Any] = {}
    group = zarr.open_group(store=zarr.storage.MemoryStore(store_dict=documents), mode="w")
    for name, field in schema.items():
        group.create_array(name, shape=(num_envs, lane_rows, *field.shape), chunks=(1, chunk_rows, *field.shape),
                           dtype=field.dtype, **field_codec(codec, config, field).zarr_codecs(field),
                           chunk_key_encoding={"name": "default", "separator": config["chunk_key_separator"]},
                           fill_value=0)
    group.attrs.update({"diskreplay": {"format": FORMAT, **config}})
    return {key: value.to_bytes() for key, value in documents.items()}


def field_codec(codec: Codec, config: dict[str, Any], field: Field) -> Codec:
    """The codec of one field's chunks in a buffer whose chunks use ``codec``: sharded when the
    buffer has ``row_access`` and the field's rows are big (`inner_rows_for`)."""
    inner = inner_rows_for(codec.compression, config.get("row_access", False), field.row_bytes, config["chunk_rows"])
    return Codec(codec.compression, codec.level, codec.checksum, inner)


def field_codecs(codec: Codec, config: dict[str, Any], schema: Schema) -> dict[str, Codec]:
    """`field_codec` of every field."""
    return {name: field_codec(codec, config, field) for name, field in schema.items()}


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
            why = "with derive_next, each episode's final observation" if name == FINALS_DIR else "saved state objects"
            raise SchemaError(f"field name {name!r} is taken: {why} are kept under {name}/ in the buffer; "
                              f"rename the field")


# ---- reading metadata ------------------------------------------------------------------------


def read_json(get: Callable[[str], bytes | None], key: str, url: str) -> dict[str, Any] | None:
    """The JSON object stored at ``key`` (None if missing); see `json_object`."""
    blob = get(key)
    return None if blob is None else json_object(blob, key, url)


def json_object(blob: bytes, key: str, url: str) -> dict[str, Any]:
    """``blob``, the metadata object ``key``, parsed. Raises CorruptBufferError if it is larger
    than `MAX_METADATA_BYTES`, not JSON or not a JSON object."""
    if len(blob) > MAX_METADATA_BYTES:
        raise CorruptBufferError(f"{url!r}: {key} has {len(blob)} bytes, expected at most {MAX_METADATA_BYTES}")
    try:
        data = json.loads(blob)
    except (ValueError, RecursionError) as exc:
        raise CorruptBufferError(f"{url!r}: {key} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CorruptBufferError(f"{url!r}: {key} is not a JSON object, got {type(data).__name__}")
    return data


def read_layout(get: Callable[[str], bytes | None], url: str) -> tuple[dict[str, Any], dict[str, dict]]:
    """The buffer's validated config and each field's array metadata, read with ``get(key)``.

    Raises:
        NotABufferError: no group metadata, or a group that is not a diskreplay buffer.
        CorruptBufferError: a document that is unreadable or contradicts the buffer's config,
            naming the document and the field.
    """
    group = read_json(get, GROUP_KEY, url)
    if group is None:
        raise NotABufferError(f"{url!r} is not a diskreplay buffer (no {GROUP_KEY})")
    config = parse_config(group, url)
    arrays, problems = read_arrays(get, url, config)
    if problems:
        raise CorruptBufferError(f"{url!r}: {problems[0]}")
    return config, arrays


def read_arrays(get: Callable[[str], bytes | None], url: str,
                config: dict[str, Any]) -> tuple[dict[str, dict], list[str]]:
    """Each field's array metadata that fits ``config``, and every problem found in the others."""
    arrays, problems = {}, []
    for name, field in Schema.from_json(config["fields"]).items():
        try:
            meta = read_json(get, array_key(name), url)
        except CorruptBufferError as exc:
            problems.append(str(exc).removeprefix(f"{url!r}: "))
            continue
        found = ([f"array for field {name!r} is missing ({array_key(name)})"] if meta is None
                 else array_problems(name, field, meta, config))
        problems += found
        if not found:
            arrays[name] = meta
    return arrays, problems


def lane_rows(arrays: dict[str, dict]) -> int:
    """Steps per lane every array holds (the smallest: a writer killed while growing them leaves
    some grown, some not)."""
    return min(int(meta["shape"][1]) for meta in arrays.values())


def parse_config(group: dict[str, Any], url: str) -> dict[str, Any]:
    """The diskreplay config in a group's ``zarr.json``, every value checked.

    Raises NotABufferError (not a diskreplay group) or CorruptBufferError naming the field.
    """
    if group.get("zarr_format") != 3 or group.get("node_type") != "group":
        raise NotABufferError(f"{url!r} is not a diskreplay buffer ({GROUP_KEY} is not a Zarr v3 group)")
    attrs = group.get("attributes")
    config = attrs.get("diskreplay") if isinstance(attrs, dict) else None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise NotABufferError(f"{url!r} is a zarr group but not a diskreplay buffer (no {FORMAT} attributes)")
    check = _ConfigCheck(config, url)
    try:
        schema = Schema.from_json(check.get("fields", dict))
    except (SchemaError, KeyError, TypeError, ValueError) as exc:
        raise check.bad("fields", f"a valid field table ({exc})") from None
    out = dict(config)
    out["fields"] = schema.to_json()
    out["num_envs"] = check.integer("num_envs", 1, MAX_LANES)
    out["lane_capacity"] = check.integer("lane_capacity", 1, MAX_STEPS, optional=True)
    out["chunk_rows"] = check.integer("chunk_rows", 1, min(MAX_CHUNK_ROWS, out["lane_capacity"] or MAX_CHUNK_ROWS))
    if out["lane_capacity"] and out["num_envs"] * -(-out["lane_capacity"] // out["chunk_rows"]) > MAX_CHUNKS:
        raise check.bad("lane_capacity", f"at most {MAX_CHUNKS} chunks of chunk_rows={out['chunk_rows']} over "
                                         f"{out['num_envs']} lanes")
    out["chunk_key_separator"] = check.choice("chunk_key_separator", ("/", "."), default="/")
    out["compression"] = check.choice("compression", COMPRESSIONS)
    out["level"] = check.integer("level", 0, 22)
    out["row_access"] = check.choice("row_access", (False, True), default=False)
    out["episode_end"] = check.names("episode_end", schema, lambda f: f.shape == () and f.dtype == np.bool_)
    out["derive_next"] = check.names("derive_next", schema, lambda f: True)
    out["episodic_return"] = _episodic_return_spec(check, schema)
    if (out["derive_next"] or out["episodic_return"]) and not out["episode_end"]:
        raise check.bad("episode_end", "end fields when derive_next or episodic_return is set")
    return out


class _ConfigCheck:
    """Typed reads of the config's values; every failure names the field."""

    def __init__(self, config: dict[str, Any], url: str):
        self.config, self.url = config, url

    def bad(self, key: str, expected: str) -> CorruptBufferError:
        return CorruptBufferError(f"{self.url!r}: {GROUP_KEY} field diskreplay.{key}: expected {expected}, "
                                  f"got {self.config.get(key, '<missing>')!r:.200}")

    def get(self, key: str, kind: type) -> Any:
        value = self.config.get(key)
        if not isinstance(value, kind):
            raise self.bad(key, kind.__name__)
        return value

    def integer(self, key: str, lo: int, hi: int, optional: bool = False) -> int | None:
        value = self.config.get(key)
        if optional and value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.bad(key, f"an int in [{lo}, {hi}]" + (" or null" if optional else ""))
        return value

    def choice(self, key: str, options: tuple, default: Any = ...) -> Any:
        value = self.config.get(key, default)
        if value not in options:
            raise self.bad(key, f"one of {list(options)}")
        return value

    def names(self, key: str, schema: Schema, ok: Callable[[Field], bool]) -> list[str]:
        value = self.config.get(key) or []
        if (not isinstance(value, list) or not all(isinstance(n, str) and n in schema.fields and ok(schema[n])
                                                   for n in value) or len(set(value)) != len(value)):
            raise self.bad(key, "a list of distinct names of suitable fields")
        return value


def _episodic_return_spec(check: _ConfigCheck, schema: Schema) -> dict[str, Any] | None:
    spec = check.config.get("episodic_return")
    if spec is None:
        return None
    expected = "null or {gamma in [0, 1], scalar reward field, float32 return field, finite default_return, clip}"
    try:
        gamma, default, clip = float(spec["gamma"]), float(spec["default_return"]), spec["clip"]
        ok = (0.0 <= gamma <= 1.0 and math.isfinite(default)
              and schema[spec["reward"]].shape == () and schema[spec["name"]] == Field((), "float32")
              and (clip is None or (isinstance(clip, list) and len(clip) == 2
                                    and all(isinstance(c, (int, float)) and math.isfinite(c) for c in clip))))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise check.bad("episodic_return", expected)
    return spec


def array_problems(name: str, field: Field, meta: dict[str, Any], config: dict[str, Any]) -> list[str]:
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
    lanes, cap = config["num_envs"], config["lane_capacity"]
    if (not isinstance(shape, list) or len(shape) != 2 + len(field.shape) or shape[0] != lanes
            or shape[2:] != list(field.shape) or not isinstance(shape[1], int) or isinstance(shape[1], bool)
            or not 0 <= shape[1] <= MAX_STEPS):
        problems.append(f"{key}: shape {shape!r:.200}, expected {[lanes, cap if cap else 'steps', *field.shape]}")
    elif cap is not None and shape[1] != cap:
        problems.append(f"{key}: {shape[1]} steps per lane, the ring holds {cap}")
    elif lanes * -(-shape[1] // config["chunk_rows"]) > MAX_CHUNKS:
        problems.append(f"{key}: {shape[1]} steps per lane need more than {MAX_CHUNKS} chunks")
    grid = meta.get("chunk_grid")
    chunks = (grid.get("configuration") or {}).get("chunk_shape") if isinstance(grid, dict) else None
    expected = [1, config["chunk_rows"], *field.shape]
    if not isinstance(grid, dict) or grid.get("name") != "regular":
        problems.append(f"{key}: chunk grid {grid!r:.200}, expected a 'regular' grid")
    elif chunks != expected:
        problems.append(f"{key}: chunk shape {chunks!r:.200}, expected {expected}")
    encoding = meta.get("chunk_key_encoding")
    separator = config["chunk_key_separator"]
    if (not isinstance(encoding, dict) or encoding.get("name") != "default"
            or (encoding.get("configuration") or {}).get("separator", "/") != separator):
        problems.append(f"{key}: chunk key encoding {encoding!r:.200}, expected default with {separator!r}")
    try:
        codec = Codec.from_zarr_codecs(meta.get("codecs"), field.dtype)
        if codec.compression != config["compression"] or (codec.compression and codec.level != config["level"]):
            problems.append(f"{key}: codecs {[c.get('name') for c in meta['codecs']]} differ from the buffer's "
                            f"(compression {config['compression']!r}, level {config['level']})")
        elif codec.inner_rows != field_codec(codec, config, field).inner_rows:
            problems.append(f"{key}: inner chunks of {codec.inner_rows} rows, expected "
                            f"{field_codec(codec, config, field).inner_rows} (rows of {field.row_bytes} bytes)")
        elif codec.inner_rows is not None:
            inner = list(meta["codecs"][0]["configuration"]["chunk_shape"])
            if inner != [1, codec.inner_rows, *field.shape]:
                problems.append(f"{key}: inner chunk shape {inner!r:.200}, expected {[1, codec.inner_rows, *field.shape]}")
    except ValueError as exc:
        problems.append(f"{key}: {exc}")
    return problems


def buffer_codec(arrays: dict[str, dict], url: str) -> Codec:
    """The codec of a buffer's chunks (checked by `array_problems`). Buffers from before checksums
    have none; every array of one buffer is written with the same codec, so arrays that disagree
    are corrupt (raises CorruptBufferError naming them)."""
    codecs = {name: Codec.from_zarr_codecs(meta["codecs"], np.dtype(meta["data_type"])) for name, meta in arrays.items()}
    first, codec = next(iter(codecs.items()))
    for name, other in codecs.items():
        if other.checksum != codec.checksum:
            with_, without = (first, name) if codec.checksum else (name, first)
            raise CorruptBufferError(f"{url!r}: {array_key(with_)} has a crc32c checksum codec and "
                                     f"{array_key(without)} has none; every array of a buffer has the same codecs")
    return Codec(codec.compression, codec.level, codec.checksum)
