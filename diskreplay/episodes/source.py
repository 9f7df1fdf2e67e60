"""What the episode layer reads rows from and writes rows to: small protocols that the storage
below satisfies (and `RowView`, which adds derived fields), so episodes never import storage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

from ..format.lanes import LaneLayout
from ..format.schema import Schema

Rows = dict[str, np.ndarray]


class RowSource(Protocol):
    """Rows at (lane, step) of named fields, inside a per-lane window of readable steps."""

    @property
    def schema(self) -> Schema:
        """The fields rows have."""
        ...

    @property
    def layout(self) -> LaneLayout:
        """The lanes and chunking of the rows."""
        ...

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the readable steps ``[lo, hi)``."""
        ...

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: Mapping[str, np.ndarray] | None = None) -> Rows:
        """Rows of ``names`` (all fields by default), ``[len(step), *shape]`` each; rows of
        fields in ``out`` are gathered into those arrays."""
        ...


class RowStore(RowSource, Protocol):
    """A `RowSource` that also takes new rows and patches rows already added."""

    def append(self, lane: int, rows: Mapping[str, np.ndarray], count: int) -> tuple[int, int]:
        """Add ``count`` steps to a lane; the steps stored ``[first, end)``."""
        ...

    def update_rows(self, lane: int, first: int, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite fields of steps ``[first, first + n)`` of a lane, already added."""
        ...
