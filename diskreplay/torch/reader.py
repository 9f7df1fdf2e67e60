"""Where a dataset copy runs (rank, DataLoader worker) and the read-only buffer handle each
process opens for itself."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from ..buffer import ReplayBuffer
from ..checks import check_int
from ..sampling import Uniform
from .epoch_order import Shard

# ---- where this copy runs ------------------------------------------------------------------


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): explicit values win, else torch.distributed if initialised, else (0, 1).

    Raises:
        ValueError: world_size < 1 or rank outside [0, world_size).
    """
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    check_int(world_size, "world_size", 1)
    if not (isinstance(rank, (int, np.integer)) and 0 <= rank < world_size):
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    return int(rank), int(world_size)


def current_shard(rank: int, world_size: int) -> Shard:
    """This process's shard: the DataLoader worker it runs in (or worker 0 of 1 in the main process)."""
    info = tud.get_worker_info()
    if info is None:
        return Shard(rank, world_size)
    return Shard(rank, world_size, info.id, info.num_workers)


# ---- the read-only handle each process opens for itself ----------------------------------


class Reader:
    """Opens the buffer read-only on first use in each process; counts chunk fetches.

    Pickles to its URL and options only. A copy inherited through fork reopens (it never touches
    the parent's IO threads).
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None, cache_bytes: int | None,
                 io_threads: int | None, sampler: Any = None, at_commit: int | None = None):
        self.url = url
        self.at_commit = at_commit  # a reader held at that commit: each process opens it there
        self.storage_options = storage_options
        self.cache_bytes = cache_bytes
        self.io_threads = io_threads
        self.sampler = sampler  # None: the sampler saved with the buffer (sample mode) ...
        self._buf: ReplayBuffer | None = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_buf=None, _pid=-1)
        return state

    @property
    def opened(self) -> bool:
        """Whether this process holds an open handle."""
        return self._buf is not None and self._pid == os.getpid()

    @property
    def chunk_fetches(self) -> int:
        """Chunks this process's handle read from the store since it opened."""
        return self._buf.stats().chunks_loaded if self._buf is not None and self._pid == os.getpid() else 0

    def get(self) -> ReplayBuffer:
        """This process's read-only handle, opened on first use (and again after a fork)."""
        if self._buf is None or self._pid != os.getpid():
            self._buf = self._open()
            self._pid = os.getpid()
        return self._buf

    def _open(self) -> ReplayBuffer:
        options: dict[str, Any] = {"storage_options": self.storage_options, "io_threads": self.io_threads,
                                   "at_commit": self.at_commit}
        if self.cache_bytes is not None:
            options["cache_bytes"] = self.cache_bytes
        sampler = Uniform() if self.sampler == "uniform" else self.sampler
        return ReplayBuffer.open(self.url, "r", sampler=sampler, **options)

    def chunk_bytes(self) -> int:
        """Decoded bytes of one chunk (all fields)."""
        buf = self.get()
        return buf.layout.chunk_rows * buf.storage.schema.row_bytes


def committed_window(buf: ReplayBuffer) -> tuple[np.ndarray, np.ndarray]:
    """Per lane, the committed readable steps ``[lo, hi)`` (a writer's staged rows excluded)."""
    return buf.window(committed=True)
