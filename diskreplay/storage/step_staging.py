"""`StepStaging`: the short way of a single-step ``add``: one step of every lane copied into each
lane's staged chunk with one assignment per field.

It takes a step while the lanes are in step (the same number of steps each) and each lane's next
row lies inside its staged chunk, before that chunk's last row, with no failed background write to
raise and no read ahead to land, and no sealed chunk waiting that the long way would start
writing or slow the appends down for (chunks sealed while a batch is in flight, no more than
`StagingWriter.paced_past`, wait for it either way): then only the rows and the cursors change.
Anything else goes the long way (`StagingWriter.append`), which stages and seals chunks. The writer
resets the plan of the short way whenever its staging changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .writer import StagingWriter

StepPlan = tuple[int, int, dict[str, np.ndarray]]
"""(The first step left to the long way, -1 for all; the step at row 0 of the views; per field,
a view of the lanes' next rows in their staged chunks, shaped ``(steps, num_envs, *shape)``, or
``(steps, *shape)`` with one lane.)"""


class StepStaging:
    """Single steps of every lane staged in place, for one `StagingWriter`."""

    def __init__(self, writer: StagingWriter):
        self.writer = writer
        self.plan: StepPlan | None = None
        """How the next steps are staged; None: not made since staging last changed."""

    def reset(self) -> None:
        """Staging changed: make the plan again at the next step."""
        self.plan = None

    def append(self, rows: Mapping[str, np.ndarray]) -> int:
        """Stage one step of every lane (``rows``: every field, shaped ``(num_envs, *shape)``, or
        ``shape`` with one lane; checked and cast already). Returns the step stored, or -1:
        nothing was done and `StagingWriter.append` must do it."""
        writer = self.writer
        if writer.behind.busy:
            writer.reap(wait=False)
        stop, first, views = self.plan if self.plan is not None else self._make_plan()
        total = writer.cursors.total
        step: int = total.item(0)
        if step >= stop or writer.reads.old or writer.failure is not None:
            return -1
        if writer.sealed and not (writer.behind.busy and len(writer.sealed) <= writer.paced_past):
            return -1
        row = step - first
        for name, value in rows.items():
            views[name][row] = value
        total.fill(step + 1)  # the lanes are in step
        return step

    def _make_plan(self) -> StepPlan:
        writer = self.writer
        layout, total = writer.layout, writer.cursors.total
        step = int(total[0])
        slot = int(layout.slot(step))
        chunk, offset = divmod(slot, layout.chunk_rows)
        self.plan = (-1, step, {})
        if (chunk < writer.cache.width and (total == step).all() and (writer.staging == chunk).all()
                and writer.dirty.all()):
            room = layout.chunk_rows - offset
            if layout.lane_capacity is not None:
                room = min(room, layout.lane_capacity - slot)
            slots = writer.cache.slots_of(np.arange(layout.num_envs), np.full(layout.num_envs, chunk))
            views = self._views(slots, offset, room)
            if views is not None:
                self.plan = (step + room - 1, step, views)
        return self.plan

    def _views(self, slots: np.ndarray, offset: int, room: int) -> dict[str, np.ndarray] | None:
        """Per field, rows ``offset .. offset + room - 1`` of the lanes' slots as one view shaped
        ``(room, num_envs, *shape)`` (``(room, *shape)`` with one lane); None unless every slot
        is cached and they are evenly spaced."""
        cache = self.writer.cache
        gap = int(slots[1] - slots[0]) if len(slots) > 1 else 1
        if slots.min() < 0 or gap <= 0 or (np.diff(slots) != gap).any():
            return None
        n, first = cache.chunk_rows, int(slots[0]) * cache.chunk_rows + offset
        if len(slots) == 1:
            return {name: slab[first:first + room] for name, slab in cache.slabs.items()}
        lanes, steps = slice(int(slots[0]), int(slots[-1]) + 1, gap), slice(offset, offset + room)
        return {name: slab.reshape(-1, n, *slab.shape[1:])[lanes, steps].swapaxes(0, 1)
                for name, slab in cache.slabs.items()}
