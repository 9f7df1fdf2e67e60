"""A diskreplay buffer (fields and env lanes kept, only the readable window of a ring) or a plain
Zarr group (one field per array, named by `d4rl_field_name`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import zarr

from ...audit.status import describe_incomplete, import_status
from ...buffer import ReplayBuffer
from ...errors import NotABufferError
from ...format.keys import BUFFER_MARKERS, COMMIT_KEY, GROUP_KEY, MAX_METADATA_BYTES
from ...format.schema import Field
from ...io import is_local, local_path
from ...sampling import Uniform
from ...storage import own_stores
from ..source import Batch, ColumnsSource, ImportFormatError, as_bool_flags, field_for


class ZarrSource(ColumnsSource):
    """A diskreplay buffer (its lanes and fields) or a plain Zarr group (one field per array)."""

    def __init__(self, src: str, batch_rows: int):
        self.batch_rows = batch_rows
        self.buffer: ReplayBuffer | None = None
        if any(store.exists(COMMIT_KEY) for store in own_stores(src)):
            self.buffer = ReplayBuffer.open(src, "r", sampler=Uniform(), cache_bytes=8 * 2**20)
            try:
                self.fields = {name: checked_field(f"{src!r}: field {name!r}", field)
                               for name, field in self.buffer.fields.items()}
            except BaseException:
                self.buffer.close()
                raise
            self.num_envs = self.buffer.num_envs
            self.rows = len(self.buffer)
            return
        marker = import_status(src)
        if marker is not None:
            raise NotABufferError(describe_incomplete(src, marker))
        self.src = src
        check_metadata_sizes(src)
        try:
            group = zarr.open_group(src, mode="r")
            self.arrays: dict[str, Any] = {name: arr for name, arr in group.arrays() if arr.ndim >= 1}
        except Exception as exc:
            raise ImportFormatError(f"{src!r} is neither a diskreplay buffer nor a Zarr group ({exc})") from None
        names = self._setup(src, {k: (a.shape, a.dtype) for k, a in self.arrays.items()})
        self.arrays = {names[k]: a for k, a in self.arrays.items()}

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        if self.buffer is None:
            for start in range(0, self.rows, self.batch_rows):
                yield 0, as_bool_flags({name: self._rows(name, start) for name in self.fields}, self.fields)
            return
        lo, hi = self.buffer.window()
        n = self.num_envs
        for lane in range(n):
            for start in range(int(lo[lane]), int(hi[lane]), self.batch_rows):
                steps = np.arange(start, min(start + self.batch_rows, int(hi[lane])))
                yield lane, self.buffer[steps * n + lane]

    def _rows(self, name: str, start: int) -> np.ndarray:
        """Rows ``start`` to ``start + batch_rows`` of a plain group's array; ImportFormatError
        naming it when they do not decode (I/O errors propagate)."""
        try:
            return np.asarray(self.arrays[name][start:start + self.batch_rows])
        except OSError:
            raise
        except Exception as e:
            raise ImportFormatError(f"{self.src!r}: array {self.arrays[name].path!r}: rows from {start} "
                                    f"do not decode ({e})") from None

    def close(self) -> None:
        """Releases the files the source holds open."""
        if self.buffer is not None:
            self.buffer.close()


def check_metadata_sizes(src: str) -> None:
    """Refuses (ImportFormatError) a local plain group whose ``zarr.json``, or one of its members',
    holds more than `MAX_METADATA_BYTES`: zarr would read it whole."""
    if not is_local(src) or not os.path.isdir(local_path(src)):
        return
    root = local_path(src)
    for key in (GROUP_KEY, *(f"{name}/{GROUP_KEY}" for name in sorted(os.listdir(root)))):
        path = os.path.join(root, key)
        if os.path.isfile(path) and os.path.getsize(path) > MAX_METADATA_BYTES:
            raise ImportFormatError(f"{src!r}: {key} has {os.path.getsize(path):,} bytes, expected at most "
                                    f"{MAX_METADATA_BYTES:,}")


def checked_field(where: str, field: Field) -> Field:
    """A buffer's ``field``, after the checks every imported field passes (`field_for`)."""
    checked = field_for(where, field.shape, field.dtype, where)
    return field if checked is None else checked


def is_zarr(path: str) -> bool:
    """``path`` is a folder holding a Zarr group (``zarr.json``) or a diskreplay commit record."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, key)) for key in BUFFER_MARKERS)
