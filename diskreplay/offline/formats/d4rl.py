"""D4RL layout as an HDF5 file (or, with format "d4rl", an ``.npz`` file): one column per step.

Columns are named by `d4rl_field_name`; ``terminals`` / ``timeouts`` become bool. A missing
``next_observations`` is derived (`with_next_obs`) unless the file was written by `diskreplay export`.
"""

from __future__ import annotations

import os
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...io import local_path
from ..hdf5 import (
    has_episode_groups,
    hdf5_datasets,
    looks_like_hdf5,
    open_hdf5,
    require_h5py,
)
from ..naming import D4RL_FLAGS, EXPORT_ATTR, d4rl_field_name
from ..source import (
    Batch,
    ImportFormatError,
    Source,
    as_bool_flags,
    derives_next_obs,
    field_for,
    with_next_obs,
)
from .npz import NpzSource


class D4RLSource(Source):
    """A D4RL-layout HDF5 file: every dataset with the anchor column's step count is a field."""

    def __init__(self, src: str, batch_rows: int):
        h5py = require_h5py()
        self.batch_rows = batch_rows
        self.file = open_hdf5(h5py, local_path(src), src, "a D4RL-layout .hdf5/.h5 or .npz file")
        datasets = hdf5_datasets(h5py, self.file, repr(src), follows_soft=False)
        self.rows = _step_count(src, datasets)
        self.columns: dict[str, Any] = {}
        self.fields = {}
        for path, ds in datasets.items():
            if ds.ndim == 0 or ds.shape[0] != self.rows:
                warnings.warn(f"{src!r}: dataset {path!r} skipped (shape {ds.shape}, not {self.rows} steps)",
                              stacklevel=2)
                continue
            name = d4rl_field_name(path)
            if name in self.fields:
                raise ImportFormatError(f"{src!r}: datasets {path!r} and another both map to field {name!r}")
            dtype = np.dtype(bool) if path in D4RL_FLAGS else ds.dtype
            field = field_for(name, ds.shape[1:], dtype, f"{src!r}: dataset {path!r}")
            if field is not None:
                self.fields[name] = field
                self.columns[name] = ds
        self.derive_next = derives_next_obs(self.fields, bool(self.file.attrs.get(EXPORT_ATTR, False)))
        if self.derive_next:
            self.fields["next_obs"] = self.fields["obs"]

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        slices = (as_bool_flags({name: ds[start:start + self.batch_rows] for name, ds in self.columns.items()},
                                self.fields) for start in range(0, self.rows, self.batch_rows))
        for batch in with_next_obs(slices) if self.derive_next else slices:
            yield 0, batch

    def close(self) -> None:
        """Releases the files the source holds open."""
        self.file.close()


def _step_count(src: str, datasets: dict[str, Any]) -> int:
    """The rows of the file: the length of observations, rewards or actions, else the most common one."""
    lengths = [d.shape[0] for d in datasets.values() if d.ndim >= 1]
    if not lengths:
        raise ImportFormatError(f"{src!r}: no datasets with a step axis found")
    anchor = next((datasets[k] for k in ("observations", "rewards", "actions") if k in datasets), None)
    return int(anchor.shape[0] if anchor is not None else max(set(lengths), key=lengths.count))


def open_d4rl(src: str, batch_rows: int) -> Source:
    """An HDF5 file as `D4RLSource`; a zip (``.npz``) as `NpzSource` deriving a missing ``next_obs``."""
    if zipfile.is_zipfile(local_path(src)):
        return NpzSource(src, batch_rows, d4rl=True)
    return D4RLSource(src, batch_rows)


def is_d4rl(path: str) -> bool:
    """``path`` is an HDF5 file without Minari's ``episode_*`` groups."""
    return os.path.isfile(path) and looks_like_hdf5(path) and not has_episode_groups(path)
