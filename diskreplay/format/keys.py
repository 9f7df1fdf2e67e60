"""Names of the objects in a buffer's location, and bounded reads of its JSON documents."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..errors import CorruptBufferError
from .schema import Field

GROUP_KEY = "zarr.json"
COMMIT_KEY = "commit.json"
INCOMPLETE_IMPORT_KEY = "import-incomplete.json"
"""The commit record of an import in progress: an interrupted import never opens as a buffer."""
RESIZE_STAGING = "resize-staging/"
"""Where a capacity change writes the new chunks, metadata documents and state object, keyed as
in the buffer, before it makes them the buffer's (not a Python identifier: never a field's directory)."""
CHUNK_KEY_SEPARATOR = "."
"""New buffers name chunks ``<field>/c.<lane>.<chunk>.0``: one directory per field. With zarr's
default "/" every chunk file sits in a directory of its own, and creating those directories costs
more than writing the chunks. Buffers made with "/" still open and work."""
MAX_METADATA_BYTES = 16 << 20
"""The largest metadata document (``zarr.json``, ``commit.json``) diskreplay reads."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of objects and arrays in a JSON document diskreplay reads (its own nest
fewer than 10 levels): the code that walks a document recursively never meets a deeper one."""
STATE_DIR = "state"
FINALS_DIR = "final"
FORMAT_1 = "diskreplay/1"
FORMAT = "diskreplay/2"
"""The format new buffers are written in: `FORMAT_1` with diskreplay's own objects moved from the
buffer's root into `OBJECTS_DIR`. Buffers of both formats open, and keep their format."""
FORMATS = (FORMAT_1, FORMAT)
OWN_GROUP = "diskreplay"
OBJECTS_DIR = f"{OWN_GROUP}/objects"
"""Where a `FORMAT` buffer keeps its own objects (``commit.json``, ``state/``, ``writer.lock``,
``learner.json``), keyed as `FORMAT_1` keeps them at the root. ``diskreplay/`` is a Zarr group
and ``diskreplay/objects/`` an empty Zarr array (`layout.add_own_nodes`): Zarr tools never list inside
an array, so none of these objects is taken for a broken Zarr node."""


def objects_prefix(format_name: str) -> str:
    """The key prefix of diskreplay's own objects in a buffer of ``format_name`` (one of `FORMATS`)."""
    return "" if format_name == FORMAT_1 else f"{OBJECTS_DIR}/"


OWN_PREFIXES = tuple(objects_prefix(version) for version in reversed(FORMATS))
"""Where diskreplay's own objects may be in a location of any format, newest first: for questions
that come before the format is known (is there a commit record, a writer lock?)."""

FAILED_WRITE_KEY = f"{OBJECTS_DIR}/write-failed.json"
"""Left at a location by a distributed write that failed, before its shards are removed: a write
task that commits afterwards finds it and removes its own shard. A location holding it and no
buffer (`BUFFER_MARKERS`) is free: creating a buffer there replaces it without ``overwrite``."""

BUFFER_MARKERS = (GROUP_KEY, *(prefix + COMMIT_KEY for prefix in OWN_PREFIXES))
"""Keys whose presence marks a location as a buffer's: its Zarr group, or a commit record of any format."""


def side_stores(derive_next: bool) -> tuple[str, ...]:
    """Names inside a buffer's location that belong to diskreplay, not to a field's array."""
    return (OWN_GROUP, FINALS_DIR) if derive_next else (OWN_GROUP,)


def chunk_key(field_name: str, field: Field, lane: int, chunk: int, separator: str) -> str:
    """The store key of one chunk, in zarr v3's default chunk key encoding with ``separator``."""
    return f"{field_name}/c{separator}{lane}{separator}{chunk}" + f"{separator}0" * len(field.shape)


def array_key(name: str) -> str:
    return f"{name}/{GROUP_KEY}"


def failed_write_error(get: Callable[[str], bytes | None], url: str) -> str | None:
    """The error a failed distributed write noted at ``url`` (`FAILED_WRITE_KEY`; at most 300
    characters), None if there is no such note. Raises CorruptBufferError for a damaged note."""
    note = read_json(get, FAILED_WRITE_KEY, url)
    if note is None:
        return None
    error = note.get("error")
    if not isinstance(error, str):
        raise CorruptBufferError(f"{url!r}: {FAILED_WRITE_KEY} holds no error string, got {error!r:.60}")
    return error[:300]


def read_json(get: Callable[[str], bytes | None], key: str, url: str) -> dict[str, Any] | None:
    """The JSON object stored at ``key`` (None if missing); see `json_object`."""
    blob = get(key)
    return None if blob is None else json_object(blob, key, url)


def json_object(blob: bytes, key: str, url: str) -> dict[str, Any]:
    """``blob``, the metadata object ``key``, parsed. Raises CorruptBufferError if it is larger
    than `MAX_METADATA_BYTES`, not JSON, not a JSON object or nested deeper than `MAX_JSON_DEPTH`."""
    if len(blob) > MAX_METADATA_BYTES:
        raise CorruptBufferError(f"{url!r}: {key} has {len(blob)} bytes, expected at most {MAX_METADATA_BYTES}")
    try:
        data = json.loads(blob)
    except (ValueError, RecursionError) as exc:
        raise CorruptBufferError(f"{url!r}: {key} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CorruptBufferError(f"{url!r}: {key} is not a JSON object, got {type(data).__name__}")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise CorruptBufferError(f"{url!r}: {key} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep")
    return data


def json_depth(data: Any) -> int:
    """How deep objects and arrays nest in the parsed JSON ``data`` (0 for a number or a string);
    counted without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest

