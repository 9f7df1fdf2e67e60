"""Plain-data state <-> (JSON, safetensors) files.

A state is a nested dict of JSON values and numpy arrays. `split` moves the arrays out into a flat
``{path: array}`` mapping (saved with safetensors) and leaves ``{"__array__": path}`` markers in
the JSON part; `join` reverses it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

ARRAY_MARK = "__array__"


def split(state: Any, prefix: str = "") -> tuple[Any, dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}

    def walk(value: Any, path: str) -> Any:
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

    return walk(state, prefix), arrays


def join(meta: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(meta, dict):
        if set(meta) == {ARRAY_MARK}:
            return arrays[meta[ARRAY_MARK]]
        return {k: join(v, arrays) for k, v in meta.items()}
    if isinstance(meta, list):
        return [join(v, arrays) for v in meta]
    return meta


def arrays_to_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    return st_save(arrays)


def arrays_from_bytes(blob: bytes) -> dict[str, np.ndarray]:
    return st_load(blob)
