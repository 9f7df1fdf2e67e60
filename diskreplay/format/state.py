"""Saved state: plain-data state <-> (JSON, safetensors) bytes and snapshot files.

A state is a nested dict of JSON values and numpy arrays. `split` moves the arrays out into a flat
``{path: array}`` mapping (saved with safetensors) and leaves ``{"__array__": path}`` markers in
the JSON part; `join` reverses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ..errors import CorruptBufferError
from .journal import JOURNAL_MARK, JournalChange

ARRAY_MARK = "__array__"
MAX_SNAPSHOT_JSON = 16 << 20


def split(state: Any, journal: Callable[[str, JournalChange], Any] | None = None
          ) -> tuple[Any, dict[str, np.ndarray]]:
    """``journal(path, change)``: the JSON that stands for a `JournalChange` at ``path`` (none
    allowed without it)."""
    arrays: dict[str, np.ndarray] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, JournalChange):
            if journal is None:
                raise TypeError(f"state at {path!r}: a journal change is only saved with a commit")
            return journal(path, value)
        if isinstance(value, np.ndarray):
            arrays[path] = np.ascontiguousarray(value)
            return {ARRAY_MARK: path}
        if isinstance(value, dict):
            return {str(k): walk(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, np.generic):
            return value.item()
        return value

    return walk(state, ""), arrays


def join(meta: Any, arrays: dict[str, np.ndarray], journal: Callable[[str, Any], Any] | None = None,
         path: str = "") -> Any:
    """``journal(path, value)``: what a journal reference at ``path`` stands for.

    Raises KeyError for a marker naming no array, ValueError for a journal reference where none is
    expected."""
    if isinstance(meta, dict):
        if set(meta) == {ARRAY_MARK}:
            if not isinstance(meta[ARRAY_MARK], str) or meta[ARRAY_MARK] not in arrays:
                raise KeyError(f"the state names array {meta[ARRAY_MARK]!r}, which its array file lacks")
            return arrays[meta[ARRAY_MARK]]
        if set(meta) == {JOURNAL_MARK}:
            if journal is None:
                raise ValueError(f"state at {path!r}: a journal reference outside a commit")
            return journal(path, meta[JOURNAL_MARK])
        return {k: join(v, arrays, journal, f"{path}.{k}" if path else k) for k, v in meta.items()}
    if isinstance(meta, list):
        return [join(v, arrays, journal, f"{path}.{i}") for i, v in enumerate(meta)]
    return meta


def arrays_to_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    return st_save(arrays)


def arrays_from_bytes(blob: bytes) -> dict[str, np.ndarray]:
    """Raises ValueError for bytes that are not a safetensors file."""
    try:
        return st_load(blob)
    except Exception as exc:  # safetensors raises its own error type (and others) for damaged headers
        raise ValueError(f"not a safetensors file ({type(exc).__name__}: {exc})") from None


def save_directory(directory: str, url: str, state: Any) -> None:
    """Write a snapshot of ``state`` (of the buffer at ``url``) to ``directory``: ``state.json``
    (its JSON part and the URL) and ``state.safetensors`` (its arrays)."""
    os.makedirs(directory, exist_ok=True)
    meta, arrays = split(state)
    with open(os.path.join(directory, "state.safetensors"), "wb") as f:
        f.write(arrays_to_bytes(arrays))
    with open(os.path.join(directory, "state.json"), "w") as f:
        json.dump({"url": url, "state": meta}, f)


def load_directory(directory: str) -> tuple[dict[str, Any], str]:
    """The state and buffer URL saved by `ReplayBuffer.save_snapshot` in ``directory``.

    Raises FileNotFoundError (no snapshot there) or CorruptBufferError naming the damaged file."""
    meta_path, arrays_path = os.path.join(directory, "state.json"), os.path.join(directory, "state.safetensors")
    with open(meta_path, "rb") as f:
        raw = f.read(min(MAX_SNAPSHOT_JSON + 1, os.fstat(f.fileno()).st_size))  # read(n) would allocate n
    try:
        if len(raw) > MAX_SNAPSHOT_JSON:
            raise ValueError(f"larger than {MAX_SNAPSHOT_JSON} bytes")
        saved = json.loads(raw)
        if (not isinstance(saved, dict) or not isinstance(saved.get("url"), str)
                or not isinstance(saved.get("state"), dict)):
            raise ValueError("expected an object with 'url' (a string) and 'state' (an object)")
    except (ValueError, RecursionError) as exc:
        raise CorruptBufferError(f"snapshot file {meta_path!r} is unreadable ({exc})") from None
    with open(arrays_path, "rb") as f:
        blob = f.read()
    try:
        return join(saved["state"], arrays_from_bytes(blob)), saved["url"]
    except (ValueError, KeyError) as exc:
        raise CorruptBufferError(f"snapshot file {arrays_path!r} is unreadable ({exc})") from None
