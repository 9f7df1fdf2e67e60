"""Where gathered rows go: new arrays, or arrays the caller gave (checked)."""

from __future__ import annotations

import numpy as np

from ..format.schema import Field

Rows = dict[str, np.ndarray]
"""Rows of some fields: ``{name: array [count, *shape]}``."""


def check_output(name: str, field: Field, count: int, given: np.ndarray) -> None:
    """Raise ValueError unless ``given`` can take ``count`` rows of a field: a C-contiguous
    array of its dtype shaped ``(count, *shape)``; never for a ragged field (its rows come as a
    new `Ragged`)."""
    if field.ragged:
        raise ValueError(f"out[{name!r}]: field {name!r} is ragged: its rows come as a dr.Ragged, not into an array")
    if given.shape != (count, *field.shape) or given.dtype != field.dtype or not given.flags.c_contiguous:
        raise ValueError(f"out[{name!r}]: expected a C-contiguous {field.dtype} array shaped "
                         f"{(count, *field.shape)}, got {given.dtype} shaped {given.shape}")


def output_rows(field: Field, count: int, given: np.ndarray | None) -> np.ndarray:
    """Where ``count`` rows of a field are gathered: ``given`` (which `check_output` passed
    before anything was drawn) or a new array."""
    return np.empty((count, *field.shape), field.dtype) if given is None else given


def take_into(source: np.ndarray, index: np.ndarray, out: np.ndarray) -> None:
    """``source[index]`` written into ``out``. With ``out=``, numpy's default ``mode="raise"``
    gathers into a temporary first; our indices are always in range, so "clip" changes nothing.
    The method, not ``np.take``: its Python wrapper costs as much as a small gather."""
    source.take(index, axis=0, out=out, mode="clip")
