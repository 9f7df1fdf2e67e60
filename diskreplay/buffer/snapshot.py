"""Snapshots of a buffer's state in a local directory, each replaced whole.

A snapshot is ``state.json`` (the buffer's URL, the JSON part of its state, and ``arrays``: the
name of the file holding its arrays) and that file, ``state-<16 hex>.safetensors``. A save writes
the arrays under a new name, fsynced, then replaces ``state.json`` atomically (temp file, fsync,
rename, fsync of the directory), and only then deletes the arrays files no ``state.json`` names.
A save killed at any moment leaves the previous snapshot or the new one, whole. Snapshots from
before tokens name no ``arrays`` and keep theirs in ``state.safetensors``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any

from ..errors import CorruptBufferError
from ..format import state as state_files
from ..format.keys import MAX_JSON_DEPTH, json_depth
from ..io import LocalChunkStore

META = "state.json"
LEGACY_ARRAYS = "state.safetensors"
ARRAYS = re.compile(r"state-[0-9a-f]{16}\.safetensors")
LEFTOVER = re.compile(rf"({re.escape(META)}|{ARRAYS.pattern})\.[0-9a-f]{{32}}\.partial")
MAX_META_BYTES = 16 << 20


def save(directory: str, url: str, state: Any) -> None:
    """Write a snapshot of ``state`` (of the buffer at ``url``) to ``directory``, replacing the
    one there only once the new one is durable."""
    meta, arrays = state_files.split(state)
    store = LocalChunkStore(directory)
    name = f"state-{secrets.token_hex(8)}.safetensors"
    store.put(name, state_files.arrays_to_bytes(arrays), durable=True)
    store.put(META, json.dumps({"url": url, "state": meta, "arrays": name}).encode(), durable=True)
    for entry in os.listdir(directory):
        if entry != name and (entry == LEGACY_ARRAYS or ARRAYS.fullmatch(entry) or LEFTOVER.fullmatch(entry)):
            store.delete(entry)


def load(directory: str) -> tuple[dict[str, Any], str, str]:
    """The state and buffer URL saved in ``directory``, and the name of its arrays file.

    Raises FileNotFoundError (no snapshot there) or CorruptBufferError naming the damaged file
    and field."""
    meta_path = os.path.join(directory, META)
    saved = _read_meta(meta_path)
    name = saved.get("arrays", LEGACY_ARRAYS)
    if name != LEGACY_ARRAYS and not (isinstance(name, str) and ARRAYS.fullmatch(name)):
        raise CorruptBufferError(f"snapshot file {meta_path!r} field 'arrays': expected a file name like "
                                 f"'state-<16 hex>.safetensors', got {name!r:.100}")
    arrays_path = os.path.join(directory, name)
    try:
        with open(arrays_path, "rb") as f:
            blob = f.read()
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise CorruptBufferError(f"snapshot file {arrays_path!r}, which {META} field 'arrays' names, is missing "
                                 f"({type(exc).__name__})") from None
    try:
        return state_files.join(saved["state"], state_files.arrays_from_bytes(blob)), saved["url"], name
    except (ValueError, KeyError) as exc:
        raise CorruptBufferError(f"snapshot file {arrays_path!r} is unreadable ({exc})") from None


def _read_meta(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        raw = f.read(min(MAX_META_BYTES + 1, os.fstat(f.fileno()).st_size))  # read(n) would allocate n
    try:
        if len(raw) > MAX_META_BYTES:
            raise ValueError(f"larger than {MAX_META_BYTES} bytes")
        saved = json.loads(raw)
        if json_depth(saved) > MAX_JSON_DEPTH:
            raise ValueError(f"objects and arrays nest more than {MAX_JSON_DEPTH} levels deep")
        if (not isinstance(saved, dict) or not isinstance(saved.get("url"), str)
                or not isinstance(saved.get("state"), dict)):
            raise ValueError("expected an object with 'url' (a string) and 'state' (an object)")
    except (ValueError, RecursionError) as exc:
        raise CorruptBufferError(f"snapshot file {path!r} is unreadable ({exc})") from None
    return saved
