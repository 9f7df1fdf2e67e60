"""A torch dataset over a `Mixture`: the `SampleDataset` of a buffer, each batch drawn by a
mixture of the same sources that every process (DataLoader worker, rank) opens for itself."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..buffer import Mixture, ReplayBuffer
from ..buffer.batches import BATCH_EXTRAS
from ..buffer.mixture_fields import SOURCE
from ..checks import check_int
from .data import warn_if_uncommitted
from .datasets import SampleDataset
from .formats import tensordict_class, tensordict_keys
from .read_sizes import batches_per_block
from .reader import Reader, committed_window, resolve_rank
from .shared_ring import WorkerRing


@dataclass(frozen=True)
class SourceAddress:
    """Where a source of a mixture is and how a process opens it read-only."""

    url: str
    storage_options: Mapping[str, Any] | None
    sampler: Any


class MixtureReader(Reader):
    """Opens every source of a mixture read-only on first use in each process (and again after a
    fork) and mixes them as the mixture it was made from does. Pickles to the sources' URLs and
    the mixture's settings."""

    def __init__(self, mixture: Mixture, cache_bytes: int | None, io_threads: int | None, sampler: Any = None):
        samplers = sampler if isinstance(sampler, Mapping) else dict.fromkeys(mixture.sources, sampler)
        sources = {name: SourceAddress(buf.url, buf.storage_options, samplers.get(name))
                   for name, buf in mixture.sources.items()}
        super().__init__(", ".join(f"{name}={src.url}" for name, src in sources.items()), None, cache_bytes,
                         io_threads)
        self.sources = sources
        self.weights, self.renames, self.select = dict(mixture.weights), mixture.renames, mixture.select
        self._mixture: Mixture | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_mixture": None}

    @property
    def opened(self) -> bool:
        return self._mixture is not None and self._pid == os.getpid()

    @property
    def chunk_fetches(self) -> int:
        """Chunks this process's sources read from their stores since they opened."""
        if not self.opened:
            return 0
        assert self._mixture is not None
        return sum(buf.stats().chunks_loaded for buf in self._mixture.sources.values())

    def get(self) -> Mixture:  # type: ignore[override]  # a mixture is read as a buffer is
        """This process's mixture of read-only sources, opened on first use (and after a fork)."""
        if self._mixture is None or self._pid != os.getpid():
            self._mixture = Mixture({name: self._open_source(src) for name, src in self.sources.items()},
                                    self.weights, fields=self.renames, select=self.select)
            self._pid = os.getpid()
        return self._mixture

    def _open_source(self, source: SourceAddress) -> ReplayBuffer:
        options: dict[str, Any] = {"storage_options": source.storage_options, "io_threads": self.io_threads}
        if self.cache_bytes is not None:
            options["cache_bytes"] = self.cache_bytes
        return ReplayBuffer.open(source.url, "r", sampler=source.sampler, **options)

    def chunk_bytes(self) -> int:
        """Decoded bytes of one chunk (all fields) of the source with the largest chunks."""
        return max(buf.layout.chunk_rows * buf.storage.schema.row_bytes for buf in self.get().sources.values())


def mixture_dataset(mixture: Mixture, batch_size: int, *, seed: int = 0, rank: int | None = None,
                    world_size: int | None = None, refresh_every: int | None = None,
                    refresh_seconds: float | None = 1.0, cache_bytes: int | None = None,
                    io_threads: int | None = None, sampler: Any = None, sample_options: dict[str, Any] | None = None,
                    worker_ring: bool = True, as_tensordict: bool = False) -> SampleDataset:
    """An endless `SampleDataset` of mixed batches: ``{field: [B, ...], "index", "source" (+
    "weight")}`` tensors, batch ``b`` of rank ``r`` drawn as ``mixture.sample(B, rng=
    default_rng([seed, r, b]), **sample_options)`` draws it, by a mixture of the same sources,
    weights and fields that each process opens read-only for itself (committed rows only, as
    `diskreplay.torch.data.make_dataset` reads a buffer). So the stream is the same for any
    ``num_workers``, resumes from ``state_dict()`` as a buffer's does, and each source adopts its
    new commits every ``refresh_every`` batches and/or ``refresh_seconds``.

    The options are `make_dataset`'s for ``mode="sample"``: ``sampler`` (one for every source, or
    a mapping of source names to samplers; default, and for a source the mapping leaves out: the
    one saved with each source, so a learner's own sampler over a sharded buffer must be given),
    ``cache_bytes`` and ``io_threads`` (each source's reader), ``sample_options``,
    ``worker_ring``, ``as_tensordict``. The sources' storage options are theirs. Prioritized
    sources use the priorities of their last commit, as in `SampleDataset`.

    Raises:
        ValueError: bad batch_size, seed, rank or world size; as `make_dataset`.
        ImportError: ``as_tensordict=True`` without the tensordict package.
    """
    check_int(batch_size, "batch_size", 1)
    check_int(seed, "seed", 0)
    rank, world_size = resolve_rank(rank, world_size)
    for buf in mixture.sources.values():
        warn_if_uncommitted(buf, *committed_window(buf), "sample")
    arrays = {name: (np.dtype(f.dtype), tuple(f.shape)) for name, f in {**mixture.fields, **BATCH_EXTRAS}.items()}
    arrays[SOURCE] = (np.dtype(np.uint8), ())
    if as_tensordict:
        tensordict_class("Mixture.as_dataset(as_tensordict=True)")
        tensordict_keys(list(arrays))
    block = min(batches_per_block(int(batch_size), buf) for buf in mixture.sources.values())
    ring = WorkerRing.for_batches(arrays, block * int(batch_size)) if worker_ring else None
    reader = MixtureReader(mixture, cache_bytes, io_threads, sampler)
    first = next(iter(mixture.sources.values()))
    return SampleDataset(reader, first.layout, int(batch_size), int(seed), rank, world_size, refresh_every,
                         refresh_seconds, sample_options, ring, bool(as_tensordict), block)
