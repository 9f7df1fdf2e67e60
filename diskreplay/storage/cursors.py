"""`Cursors`: per lane, the steps added and the first step not retired; the windows they give."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..format.lanes import LaneLayout

Window = tuple[np.ndarray, np.ndarray]
"""Per lane, steps ``[lo, hi)``."""


@dataclass
class Cursors:
    """Per lane: ``total`` steps added (staged or committed) and ``lower``, the first step the
    writer has not retired. Steps are never renumbered: both only grow.

    A reader's cursors are ``frozen``: they change only when it follows a commit (`follow`),
    so its window is computed once per commit."""

    layout: LaneLayout
    total: np.ndarray
    lower: np.ndarray
    frozen: bool = False
    _window: Window | None = field(default=None, repr=False)

    def window(self) -> Window:
        """Per lane, the steps ``[lo, hi)`` added and not retired or overwritten."""
        if not self.frozen:
            return self.window_of(self.total, copy=False)
        if self._window is None:
            self._window = self.window_of(self.total, copy=False)
        return self._window

    def window_of(self, committed: np.ndarray, copy: bool = True) -> Window:
        """Per lane, the steps ``[lo, hi)`` of ``committed`` not retired or overwritten."""
        return self.layout.visible(self.lower, committed.copy() if copy else committed)

    def first_kept(self) -> np.ndarray:
        """Per lane, the first step a commit of everything added would show."""
        first: np.ndarray = np.maximum(self.lower, self.layout.oldest(self.total))
        return first

    def follow(self, committed: np.ndarray, lower: np.ndarray) -> None:
        """A reader adopts a commit's cursors."""
        self.total, self.lower, self._window = committed.copy(), lower.copy(), None
