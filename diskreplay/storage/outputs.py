"""Where gathered rows go: new arrays, or arrays the caller gave (checked)."""

from __future__ import annotations

import numpy as np

from ..format.schema import Field

Rows = dict[str, np.ndarray]
"""Rows of some fields: ``{name: array [count, *shape]}``."""


def output_rows(name: str, field: Field, count: int, given: np.ndarray | None) -> np.ndarray:
    """Where ``count`` rows of a field are gathered: ``given`` (checked) or a new array.

    Raises:
        ValueError: ``given`` is not a C-contiguous array of the field's dtype shaped ``(count, *shape)``.
    """
    if given is None:
        return np.empty((count, *field.shape), field.dtype)
    if given.shape != (count, *field.shape) or given.dtype != field.dtype or not given.flags.c_contiguous:
        raise ValueError(f"out[{name!r}]: expected a C-contiguous {field.dtype} array shaped "
                         f"{(count, *field.shape)}, got {given.dtype} shaped {given.shape}")
    return given


def take_into(source: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """``source[index]`` written into ``out``. With ``out=``, numpy's default ``mode="raise"``
    gathers into a temporary first; our indices are always in range, so "clip" changes nothing.
    The method, not ``np.take``: its Python wrapper costs as much as a small gather."""
    source.take(index, axis=0, out=out, mode="clip")
