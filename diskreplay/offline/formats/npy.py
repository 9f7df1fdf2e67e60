"""A folder of ``.npy`` files: one field per file, named by `d4rl_field_name`, memory-mapped."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from ...io import local_path
from ..npyfile import npy_header
from ..source import Batch, ColumnsSource, as_bool_flags


class NpyFolderSource(ColumnsSource):
    """Every ``*.npy`` file of a folder (headers checked before mapping), read in row slices."""

    def __init__(self, src: str, batch_rows: int):
        self.batch_rows = batch_rows
        path = local_path(src)
        self.arrays = {}
        for entry in sorted(os.listdir(path)):
            if entry.endswith(".npy"):
                file = os.path.join(path, entry)
                with open(file, "rb") as f:
                    npy_header(f, os.fstat(f.fileno()).st_size, f"{src!r}: {entry}")
                self.arrays[entry[:-4]] = np.load(file, mmap_mode="r", allow_pickle=False)
        names = self._setup(src, {k: (a.shape, a.dtype) for k, a in self.arrays.items()})
        self.arrays = {names[k]: a for k, a in self.arrays.items()}

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        for start in range(0, self.rows, self.batch_rows):
            yield 0, as_bool_flags({name: np.array(self.arrays[name][start:start + self.batch_rows])
                                    for name in self.fields}, self.fields)

    def close(self) -> None:
        """Releases the files the source holds open."""
        self.arrays = {}


def is_npy_folder(path: str) -> bool:
    """``path`` is a folder holding at least one ``.npy`` file."""
    return os.path.isdir(path) and any(name.endswith(".npy") for name in os.listdir(path))
