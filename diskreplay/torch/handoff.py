"""Whether DataLoader worker processes iterate a dataset: then the copy in the process that made it
never moves, and its ``state_dict()`` would save the start position forever."""

from __future__ import annotations

import mmap
from multiprocessing import context


class WorkerUse:
    """A flag shared with forked processes (an anonymous shared page), set when a copy of the
    dataset starts iterating in a DataLoader worker (fork) or is pickled for a process being
    spawned (spawn, forkserver). Pickles to nothing: each process's own `WorkerUse` is None."""

    def __init__(self) -> None:
        self._page = mmap.mmap(-1, mmap.PAGESIZE)

    def __bool__(self) -> bool:
        """Whether worker processes iterate (or were handed) the dataset."""
        return self._page[0] == 1

    def mark(self) -> None:
        """Record that worker processes iterate the dataset."""
        self._page[0] = 1

    def mark_if_spawning(self) -> None:
        """Mark when called while a process is being spawned (pickling its arguments)."""
        if context.get_spawning_popen() is not None:
            self.mark()
