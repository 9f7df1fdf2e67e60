"""Where gathered rows go: new arrays, or arrays the caller gave (checked)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..build import load_extension
from ..format.schema import Field

_TAKE_ROWS = getattr(load_extension("diskreplay.format._batch"), "take_rows", None)
"""`_batch.take_rows` where the extension was built with it (else a numpy take per field)."""
_TAKE_FIELDS = 64
"""The most fields `_TAKE_ROWS` copies in one call."""

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


def take_rows(sources: Sequence[np.ndarray], indexes: Sequence[np.ndarray], outs: Sequence[np.ndarray]) -> None:
    """``outs[f][:] = sources[f][indexes[f]]`` for each field f: ``indexes[f]`` rows (int64, in
    range of the source, as many for every field) into ``outs[f]``, C-contiguous arrays of that
    many rows of their source's dtype and row shape. Where the `_batch` extension is built, the
    rows are copied one after another, all fields of a row together, the memory of the rows
    ahead asked for first: random rows of a large cache come about 1.5 times as fast as by
    numpy's take per field, which does the work otherwise."""
    if _TAKE_ROWS is not None and all(
            i.dtype == np.int64 and i.flags.c_contiguous and s.flags.c_contiguous and s.dtype == o.dtype
            for s, i, o in zip(sources, indexes, outs)):
        for first in range(0, len(sources), _TAKE_FIELDS):
            end = first + _TAKE_FIELDS
            _TAKE_ROWS(tuple(sources[first:end]), tuple(outs[first:end]), tuple(indexes[first:end]))
        return
    for source, index, out in zip(sources, indexes, outs):
        take_into(source, index, out)
