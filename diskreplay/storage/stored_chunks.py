"""`StoredChunks`: what a writer's chunk files hold, from its cursors and the last commit.

Questions a writer asks before it stages, reads or overwrites a chunk of a lane: are there rows to
keep, might a reader see them, which old steps does rewriting the file destroy. Pure queries; the
writer acts on the answers.
"""

from __future__ import annotations

import numpy as np

from .commit_log import CommitLog
from .cursors import Cursors


class StoredChunks:
    """Queries over one writer's lanes (`Cursors`) and its newest commit (`CommitLog.record`)."""

    def __init__(self, cursors: Cursors, log: CommitLog):
        self.cursors, self.log, self.layout = cursors, log, cursors.layout

    def holds_data(self, lane: int, chunk_first_step: int) -> bool:
        """Whether the chunk starting at this step already has stored rows (to keep on rewrite)."""
        cap = self.layout.lane_capacity
        earlier_round = cap is not None and chunk_first_step >= cap
        return earlier_round or bool(self.cursors.total[lane] > chunk_first_step)

    def holds_visible(self, lane: int, chunk_first_step: int) -> bool:
        """Whether the chunk starting at this step holds rows the last commit shows (its file
        must then exist)."""
        cap = self.layout.lane_capacity or 0
        committed = int(self.log.record.committed[lane])
        lo = max(int(self.cursors.lower[lane]), int(self.layout.oldest(committed)))
        spans = [(chunk_first_step, chunk_first_step + self.layout.chunk_rows)]
        if cap:
            spans.append((chunk_first_step - cap, chunk_first_step - cap + self.layout.chunk_rows))
        return any(a < committed and b > lo for a, b in spans)

    def never_committed(self, lane: int, chunk: int) -> bool:
        """No commit ever covered a row of this chunk (its first-round steps are all newer)."""
        return int(self.log.record.committed[lane]) <= chunk * self.layout.chunk_rows

    def first_kept_after(self, chunks: list[tuple[int, int]]) -> np.ndarray:
        """Per lane, the first step that rewriting these ``(lane, chunk)`` files keeps: they may
        hold older steps of a ring's previous round, which a retire commit before must cover."""
        kept = np.zeros(self.layout.num_envs, dtype=np.int64)
        for lane, chunk in chunks:
            newest = self.layout.newest_in_chunk(int(self.cursors.total[lane]), chunk)
            kept[lane] = max(kept[lane], self.layout.oldest(newest + 1))
        return kept
