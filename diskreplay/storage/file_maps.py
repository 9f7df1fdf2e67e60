"""`FileMaps`: the memory maps of a storage's chunk files, raw rows and shards alike, and the
shard indexes its point reads keep."""

from __future__ import annotations

import numpy as np

from .mapped import MappedChunks
from .point_reads import PointReads
from .row_reads import RowReads


class FileMaps:
    """The memory maps of a storage's chunk files (raw rows, shards) and the shard indexes its
    point reads keep, told when files are rewritten."""

    def __init__(self, mapped: MappedChunks | None, row_reads: RowReads | None, points: PointReads | None):
        self.mapped, self.row_reads, self.points = mapped, row_reads, points

    def forget(self, lane: int, chunks: np.ndarray) -> None:
        """These chunk files were rewritten (a new file, or bytes no commit covered): map them
        again when read."""
        if self.mapped is not None:
            self.mapped.forget(lane, chunks)
        if self.row_reads is not None:
            self.row_reads.forget(lane, chunks)
        if self.points is not None:
            self.points.forget(lane, chunks)

    def close(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None
        if self.row_reads is not None:
            self.row_reads.close()
