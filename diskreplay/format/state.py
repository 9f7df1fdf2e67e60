"""Saved state: plain-data state <-> (JSON, safetensors) bytes.

A state is a nested dict of JSON values and numpy arrays. `split` moves the arrays out into a flat
``{path: array}`` mapping (saved with safetensors) and leaves ``{"__array__": path}`` markers in
the JSON part; `join` reverses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from .journal import JOURNAL_MARK, JournalChange

ARRAY_MARK = "__array__"


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


def journal_values(meta: Any, path: str = "") -> dict[str, Any]:
    """Every journal reference in a state's JSON part: ``{path: value}`` (what `join` hands its
    ``journal``), found without its arrays."""
    if isinstance(meta, dict):
        if set(meta) == {JOURNAL_MARK}:
            return {path: meta[JOURNAL_MARK]}
        if set(meta) == {ARRAY_MARK}:
            return {}
        return {k: v for key, value in meta.items()
                for k, v in journal_values(value, f"{path}.{key}" if path else key).items()}
    if isinstance(meta, list):
        return {k: v for i, value in enumerate(meta) for k, v in journal_values(value, f"{path}.{i}").items()}
    return {}


def arrays_to_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    return st_save(arrays)


def arrays_from_bytes(blob: bytes) -> dict[str, np.ndarray]:
    """Raises ValueError for bytes that are not a safetensors file."""
    try:
        return st_load(blob)
    except Exception as exc:  # safetensors raises its own error type (and others) for damaged headers
        raise ValueError(f"not a safetensors file ({type(exc).__name__}: {exc})") from None
