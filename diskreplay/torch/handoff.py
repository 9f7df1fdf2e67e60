"""What passes between a dataset's process and its DataLoader workers besides batches: whether
workers iterate it (then the copy in the process that made it never moves, and its
``state_dict()`` would save the start position forever), and each pass of a `Loader`'s
persistent workers."""

from __future__ import annotations

import mmap
import pickle
import random
import struct
from collections.abc import Callable
from multiprocessing import context
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data._utils.worker import _generate_state  # how torch seeds numpy in a new worker

_LENGTH = struct.Struct("<Q")


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


class PassChannel:
    """Where a `diskreplay.torch.loader.Loader` posts each pass (position, block plan, worker
    seed) for its persistent fork workers: an anonymous shared mapping they inherit, read when a
    worker starts iterating a pass (after the post: torch sends the resume message after it).
    Holds one pickled object of up to ``capacity`` bytes."""

    def __init__(self, capacity: int = 1 << 20):
        self.capacity = capacity
        self._map = mmap.mmap(-1, _LENGTH.size + capacity)

    def post(self, message: Any) -> bool:
        """Make ``message`` the current pass; False (nothing posted) if it does not fit."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self.capacity:
            return False
        self._map[_LENGTH.size:_LENGTH.size + len(data)] = data
        self._map[:_LENGTH.size] = _LENGTH.pack(len(data))
        return True

    def read(self) -> Any:
        """The current pass (as posted)."""
        (n,) = _LENGTH.unpack(self._map[:_LENGTH.size])
        return pickle.loads(self._map[_LENGTH.size:_LENGTH.size + n])


def reseed_worker(base_seed: int, worker_init_fn: Callable[[int], None] | None) -> None:
    """Seed this DataLoader worker as torch seeds a new one from ``base_seed`` (``random``,
    torch and numpy's global generators; ``get_worker_info().seed``) and run ``worker_init_fn``:
    a persistent worker starting another pass is then in the state a new worker would be."""
    info = tud.get_worker_info()
    assert info is not None
    seed = base_seed + info.id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(_generate_state(base_seed, info.id))  # type: ignore[no-untyped-call]
    object.__setattr__(info, "seed", seed)  # WorkerInfo is frozen after torch makes it
    if worker_init_fn is not None:
        worker_init_fn(info.id)
