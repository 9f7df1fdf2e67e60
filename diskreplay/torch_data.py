"""torch data pipelines over a `ReplayBuffer`: iterable datasets, worker/rank sharding, exact resume.

Three ways to feed a trainer, all with ``DataLoader(..., batch_size=None)`` (batches come out
already collated: one gather per batch, a dict of tensors with leading axis ``batch_size``):

* ``make_dataset(buf, B, mode="sample")`` - an endless stream of sampled batches (any sampler the
  buffer was saved with; priorities as of the last commit).
* ``make_dataset(buf, B, mode="epoch")`` - every committed row once per epoch, sharded over ranks
  and DataLoader workers by whole chunks, shuffled chunk-aware (``shuffle="block"``).
* ``IndexBatchSampler`` + ``RowDataset`` - prioritized sampling with workers: the main process
  draws row ids from the live buffer's sampler (priorities stay there), workers only gather rows.

A dataset pickles to its URL and a few settings (never data); every process opens the store
read-only itself, lazily, on first use (fsspec/zarr event loops and IO threads do not survive a
fork). ``memory://`` buffers work with ``num_workers=0`` or fork workers only (the memory
filesystem is per process). Datasets read *committed* rows only: flush the writer.

Fork workers gather each batch straight into a slot of the dataset's shared-memory ring
(`diskreplay.shared_ring.WorkerRing`, mapped by `make_dataset` before any worker starts) and
yield only a `SlotBatch` handle; the DataLoader's process unpickles it into tensors viewing the
slot, which is reused once they all died. Shared memory: up to ``32 * 8`` slots of one batch each
(virtual, ``MAP_NORESERVE``); touched, about ``num_workers * (prefetch_factor + 2)`` slots. Other
workers (spawn, no free slot, a batch bigger than a slot) send tensors through torch's shared
memory as before; the values are the same either way.

Resume. ``state_dict()`` is plain data (a few ints). It follows torchdata's
``StatefulDataLoader`` protocol: each worker's dataset copy saves and restores its own position.
With ``num_workers=0`` call ``ds.state_dict()`` / ``ds.load_state_dict()`` directly (or wrap in
``to_device(ds_or_loader, ...)`` whose ``state_dict()`` lags its prefetch correctly). A plain
``DataLoader`` with workers cannot report positions: use ``StatefulDataLoader``.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data._utils.collate import default_collate_fn_map  # torch's documented extension point

from .batch_rng import BatchRngs
from .buffer import BATCH_EXTRAS, ReplayBuffer
from .epoch_order import SHUFFLES, EpochOrder, Shard
from .errors import EmptyBufferError
from .lanes import LaneLayout, is_empty, row_ids, split_row_ids
from .sampling import Uniform
from .shared_ring import SlotBatch, WorkerRing
from .storage import DEFAULT_CACHE_BYTES

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
    if not (isinstance(world_size, (int, np.integer)) and world_size >= 1):
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
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


class _Reader:
    """Opens the buffer read-only on first use in each process; counts chunk fetches.

    Pickles to its URL and options only. A copy inherited through fork reopens (it never touches
    the parent's IO threads).
    """

    def __init__(self, url: str, storage_options: dict | None, cache_bytes: int | None, io_threads: int,
                 sampler: Any = None):
        self.url = url
        self.storage_options = storage_options
        self.cache_bytes = cache_bytes
        self.io_threads = io_threads
        self.sampler = sampler  # None: the sampler saved with the buffer (sample mode) ...
        self._buf: ReplayBuffer | None = None
        self._pid = -1
        self.chunk_fetches = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_buf=None, _pid=-1, chunk_fetches=0)
        return state

    def get(self) -> ReplayBuffer:
        if self._buf is None or self._pid != os.getpid():
            self._buf = self._open()
            self._pid = os.getpid()
            self.chunk_fetches = 0
        return self._buf

    def _open(self) -> ReplayBuffer:
        options: dict[str, Any] = {"storage_options": self.storage_options, "io_threads": self.io_threads}
        if self.cache_bytes is not None:
            options["cache_bytes"] = self.cache_bytes
        sampler = Uniform() if self.sampler == "uniform" else self.sampler
        buf = ReplayBuffer.open(self.url, "r", sampler=sampler, **options)
        storage = buf.storage
        fetch = storage._fetch_into

        def counting_fetch(targets, must_exist, names=None):
            self.chunk_fetches += len(targets)
            return fetch(targets, must_exist, names)

        storage._fetch_into = counting_fetch  # instance-level wrapper: counts, changes nothing
        return buf

    def chunk_bytes(self) -> int:
        """Decoded bytes of one chunk (all fields)."""
        storage = self.get().storage
        return storage.layout.chunk_rows * sum(f.row_bytes for f in storage.schema.fields.values())


def committed_window(buf: ReplayBuffer) -> tuple[np.ndarray, np.ndarray]:
    """Per lane, the committed readable steps ``[lo, hi)`` (a writer's staged rows excluded)."""
    return buf.storage.committed_window()


class Batch(dict):
    """A batch as the datasets yield it: ``{name: tensor [B, *shape]}``, already collated. Its
    own type lets a DataLoader left at ``batch_size=1`` pass it through unchanged (with a
    warning) instead of stacking it into ``[1, B, *shape]``."""


def _collate_whole(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    """The DataLoader's default collate, for items that are whole batches already."""
    if len(batch) == 1:
        warnings.warn("DataLoader(dataset) with its default batch_size=1: diskreplay datasets yield whole "
                      "batches, passed on as they are; use DataLoader(dataset, batch_size=None)", stacklevel=2)
        return batch[0]
    raise TypeError(f"DataLoader(dataset, batch_size={len(batch)}): diskreplay datasets yield whole batches "
                    f"(their size is make_dataset's batch_size); use DataLoader(dataset, batch_size=None)")


default_collate_fn_map.update({Batch: _collate_whole, SlotBatch: _collate_whole})


def to_tensors(batch: Mapping[str, np.ndarray]) -> Batch:
    """numpy batch -> dict of CPU tensors (zero-copy where the array is contiguous)."""
    return Batch({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()})


def packed_tensors(batch: Mapping[str, np.ndarray], align: int = 64) -> Batch:
    """numpy batch -> dict of tensors that are views of one uint8 storage (``align``-byte offsets).

    A DataLoader worker sends each tensor storage through its own shared-memory segment; one
    storage per batch instead of one per field makes that transfer several times cheaper.
    """
    arrays = {k: np.asarray(v) for k, v in batch.items()}
    offsets, total = {}, 0
    for k, a in arrays.items():
        offsets[k] = total
        total += -(-a.nbytes // align) * align
    flat = torch.empty(max(total, 1), dtype=torch.uint8)
    out = Batch()
    for k, a in arrays.items():
        dtype = torch.from_numpy(np.empty(0, a.dtype)).dtype
        view = flat[offsets[k]:offsets[k] + a.nbytes].view(dtype).view(a.shape)
        view.numpy()[...] = a
        out[k] = view
    return out


def _emit(batch: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Tensors for the consumer: packed in a DataLoader worker, zero-copy in the main process."""
    return packed_tensors(batch) if tud.get_worker_info() is not None else to_tensors(batch)


class _Sink:
    """Where this process's batches go: ``destination()`` gives the arrays the next batch is
    gathered into (None: new arrays), ``emit(batch)`` what is yielded for it, ``close()`` gives
    back what an unfinished batch held."""

    def __init__(self, destination: Callable[[], dict[str, np.ndarray] | None],
                 emit: Callable[[Mapping[str, np.ndarray]], Any]):
        self.destination = destination
        self.emit = emit

    def close(self) -> None:
        pass


class _RingSink(_Sink):
    """A fork worker's sink: batches are gathered into (or copied to) a slot of the dataset's
    `WorkerRing` and yielded as `SlotBatch` handles; with no free slot or no fit, as packed tensors."""

    def __init__(self, ring: WorkerRing, worker: int):
        self.ring, self.worker = ring, worker
        self._slot: int | None = None  # claimed for the batch being gathered

    def destination(self) -> dict[str, np.ndarray] | None:
        if self._slot is None:
            self._slot = self.ring.claim(self.worker)
        return None if self._slot is None else self.ring.arrays(self._slot)

    def emit(self, batch: Mapping[str, np.ndarray]) -> SlotBatch | dict[str, torch.Tensor]:
        if self._slot is None:  # not gathered into a slot (e.g. n-step batches): copied into one
            self._slot = self.ring.claim(self.worker)
        slot, self._slot = self._slot, None
        handle = None if slot is None else self.ring.hand_over(slot, batch)
        if handle is not None:
            return handle
        if slot is not None:
            self.ring.release(slot)
        self.ring.count_fallback(self.worker)
        return packed_tensors(batch)

    def close(self) -> None:
        if self._slot is not None:
            self.ring.release(self._slot)
            self._slot = None


def _sink(ring: WorkerRing | None) -> _Sink:
    """The sink of a plain iteration in this process: zero-copy tensors in the main process; in a
    DataLoader worker, ring slots when the ring is usable, else packed tensors."""
    info = tud.get_worker_info()
    if info is not None and ring is not None and ring.usable_in(info.id):
        return _RingSink(ring, info.id)
    return _Sink(_nowhere, _emit)


# ---- the datasets ---------------------------------------------------------------------------


class _BufferDataset(tud.IterableDataset):
    """What sample and epoch mode share: the reader, the shard, plain-data state."""

    mode = ""

    def __init__(self, reader: _Reader, layout: LaneLayout, batch_size: int, seed: int, rank: int,
                 world_size: int, ring: WorkerRing | None = None):
        self._reader = reader
        self.layout = layout
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self._shard = Shard(rank, world_size)  # shard of the saved/current position
        self._batch = 0
        self._ring = ring

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (spawn/forkserver workers, copies): without the worker ring (fork-only)."""
        return {**self.__dict__, "_ring": None}

    @property
    def worker_ring(self) -> WorkerRing | None:
        """The shared-memory slots fork workers hand batches over in (None: not used); see
        `diskreplay.shared_ring`. ``worker_ring.stats()`` counts hand-overs and fallbacks."""
        return self._ring

    @property
    def url(self) -> str:
        return self._reader.url

    def io_stats(self) -> dict[str, int]:
        """Chunk fetches by this process's reader since it opened (and the decoded bytes)."""
        if self._reader._buf is None:
            return {"chunk_fetches": 0, "bytes_decoded": 0}
        n = self._reader.chunk_fetches
        return {"chunk_fetches": n, "bytes_decoded": n * self._reader.chunk_bytes()}

    def iter_into(self, destination: Callable[[], dict[str, np.ndarray] | None]
                  ) -> Iterator[dict[str, torch.Tensor]]:
        """Iterate in this process, gathering each batch into the arrays ``destination()``
        returns just before it (``[>= B, *shape]`` per name; None: new arrays): how `to_device`
        fills its pinned host slots without a copy. The yielded tensors share their memory."""
        return self._iterate(_Sink(destination, to_tensors))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Batches as dicts of tensors; in a fork DataLoader worker, `SlotBatch` handles that
        become such dicts when the DataLoader's process receives them."""
        return self._iterate(_sink(self._ring))

    @staticmethod
    def _gather(buf: ReplayBuffer, names: frozenset[str], lane: np.ndarray, step: np.ndarray,
                into: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        ids = row_ids(lane, step, buf.num_envs)
        out = _out(names, into, len(ids))
        rows = buf.rows(ids, out=out and {k: v for k, v in out.items() if k != "index"})
        rows["index"] = ids
        if out and "index" in out:
            rows["index"] = out["index"]
            rows["index"][...] = ids
        return rows

    def _check_state(self, state: Mapping[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(f"state is for a {state.get('mode')!r}-mode dataset, this one is {self.mode!r}")
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this dataset has seed {self.seed}")


class SampleDataset(_BufferDataset):
    """Endless sampled batches: ``{field: [B, *shape], "index": [B] int64 (+ "weight")}`` tensors.

    Batch ``b`` of rank ``r`` draws from ``numpy.random.default_rng([seed, r, b])``, and worker ``w``
    of ``W`` produces batches ``b = w, w + W, ...``; the DataLoader interleaves workers round-robin,
    so the stream is the same for any ``num_workers`` (given the same buffer contents), ranks get
    independent streams, and a position is one int. Resuming *across a change of num_workers* is
    supported: convert a StatefulDataLoader state with `dataset_state_from_loader` (or save from
    ``num_workers=0``) and load it into the dataset before building the new loader.

    Live buffers: each reader adopts new commits every ``refresh_every`` batches and/or every
    ``refresh_seconds`` (window changes make the stream timing-dependent). Stateful samplers
    (``WithoutReplacement``) keep independent state per worker; prioritized samplers use the
    priorities of the last commit: for live priorities use `IndexBatchSampler`.
    """

    mode = "sample"

    def __init__(self, reader: _Reader, layout: LaneLayout, batch_size: int, seed: int, rank: int,
                 world_size: int, refresh_every: int | None, refresh_seconds: float | None,
                 sample_options: dict[str, Any] | None = None, ring: WorkerRing | None = None):
        super().__init__(reader, layout, batch_size, seed, rank, world_size, ring)
        self.refresh_every = refresh_every
        self.refresh_seconds = refresh_seconds
        self.sample_options = dict(sample_options or {})

    def __repr__(self) -> str:
        return (f"SampleDataset({self.url!r}, batch_size={self.batch_size}, batch={self._batch}, seed={self.seed}, "
                f"rank={self.rank}/{self.world_size}, sample_options={self.sample_options})")

    def state_dict(self) -> dict[str, Any]:
        """``{"mode", "seed", "batch": next batch index of this copy, shard}``: plain ints."""
        return {"mode": self.mode, "seed": self.seed, "batch": self._batch, **self._shard.as_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from `state_dict`, `merge_worker_states` or
        `dataset_state_from_loader`). Raises ValueError for another mode, seed or world size."""
        self._check_state(state)
        if int(state["world_size"]) != self.world_size:
            raise ValueError(f"state has world_size {state['world_size']}, this dataset {self.world_size}")
        self._batch = int(state["batch"])
        self._shard = Shard(self.rank, self.world_size, int(state["worker"]), int(state["num_workers"]))

    def _start(self, shard: Shard) -> int:
        saved = self._shard
        if (saved.worker, saved.num_workers) == (shard.worker, shard.num_workers):
            return self._batch
        if saved.num_workers == 1:  # a rank-global position: the first batch >= it that is ours
            b = self._batch
            return b + (shard.worker - b) % shard.num_workers
        raise ValueError(f"sample-mode state of worker {saved.worker}/{saved.num_workers} cannot be "
                         f"loaded into worker {shard.worker}/{shard.num_workers}: merge the workers' "
                         f"states with merge_worker_states / dataset_state_from_loader first")

    def _iterate(self, sink: _Sink) -> Iterator[Any]:
        shard = current_shard(self.rank, self.world_size)
        try:
            start = self._start(shard)
        except ValueError as exc:
            return _raising(exc)  # raised on first next(): a worker then reports it cleanly
        self._shard, self._batch = shard, start
        return self._generate(shard, start, sink)

    def _generate(self, shard: Shard, b: int, sink: _Sink) -> Iterator[Any]:
        buf = self._reader.get()
        plain = all(self.sample_options.get(k) is None for k in ("seq_len", "n_step", "stack", "her"))
        names, size, options = _out_names(buf), self.batch_size, self.sample_options
        rngs = BatchRngs(self.seed, self.rank, shard.num_workers)
        every, seconds = self.refresh_every, self.refresh_seconds
        last_refresh, since = time.monotonic(), 0
        try:
            while True:
                since += 1
                if (every is not None and since >= every) or (
                        seconds is not None and time.monotonic() - last_refresh >= seconds):
                    buf.refresh()
                    last_refresh, since = time.monotonic(), 0
                out = _out(names, sink.destination(), size) if plain else None
                try:
                    batch = buf.sample(size, rng=rngs(b), out=out, **options)
                except EmptyBufferError:  # nothing committed when this reader opened or refreshed
                    buf.refresh()
                    last_refresh, since = time.monotonic(), 0
                    batch = buf.sample(size, rng=rngs(b), out=out, **options)
                b += shard.num_workers
                self._batch = b
                yield sink.emit(batch)
        finally:
            sink.close()


class EpochDataset(_BufferDataset):
    """Every committed row once per epoch (see `make_dataset` for the options), as batches
    ``{field: [<=B, *shape], "index": [<=B] int64}`` of tensors.

    Rows of an epoch are the window saved in the state (taken at `make_dataset` or `set_epoch(...,
    refresh=True)`); its order is a pure function of (seed, epoch, those rows, shard layout). They
    must stay readable for the epoch (a ring must not overwrite them).

    Epochs advance by themselves when the same dataset object iterates again (``num_workers=0``,
    or ``persistent_workers=True``); non-persistent workers restart from the main process's copy,
    so call ``ds.set_epoch(e)`` before each epoch then (like ``DistributedSampler``).

    Resume: exact within an epoch for the same ``world_size`` and ``num_workers`` (positions are
    per worker); at an epoch boundary, for any. A state saved on one rank may be loaded on every
    rank when ranks advance in lockstep (``pad=True`` or ``drop_last=True``).
    """

    mode = "epoch"

    def __init__(self, reader: _Reader, layout: LaneLayout, batch_size: int, seed: int, rank: int,
                 world_size: int, lo: np.ndarray, hi: np.ndarray, shuffle: str, shuffle_window: int,
                 pad: bool, drop_last: bool, ring: WorkerRing | None = None):
        super().__init__(reader, layout, batch_size, seed, rank, world_size, ring)
        self.lo, self.hi = [int(x) for x in lo], [int(x) for x in hi]
        self.shuffle, self.shuffle_window = shuffle, shuffle_window
        self.pad, self.drop_last = pad, drop_last
        self._epoch = 0
        self._done = False  # this copy produced every batch of its shard's epoch
        self._resuming = False  # loaded inside a worker: keep a finished epoch finished once

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields (advances after each full pass)."""
        return self._epoch

    def order(self, epoch: int, shard: Shard) -> EpochOrder:
        """The row order of ``epoch`` for one shard (rank and worker): a pure function of the seed."""
        return EpochOrder(self.layout, np.asarray(self.lo, np.int64), np.asarray(self.hi, np.int64),
                          seed=self.seed, epoch=epoch, shuffle=self.shuffle, window=self.shuffle_window,
                          shard=shard, pad=self.pad, drop_last=self.drop_last, batch_size=self.batch_size)

    def __len__(self) -> int:
        """Batches this rank yields per epoch, iterated in this process or, inside a DataLoader
        worker, by all workers of its DataLoader (each worker's last batch may be short, so
        with N workers the count is `batches_per_epoch(N)`)."""
        info = tud.get_worker_info()
        return self.batches_per_epoch(0 if info is None else info.num_workers)

    def __repr__(self) -> str:
        rows = sum(h - lo for lo, h in zip(self.lo, self.hi))
        return (f"EpochDataset({self.url!r}, batch_size={self.batch_size}, rows={rows}, epoch={self._epoch}, "
                f"shuffle={self.shuffle!r}, seed={self.seed}, rank={self.rank}/{self.world_size})")

    def batches_per_epoch(self, num_workers: int = 0) -> int:
        """Batches this rank yields per epoch with ``num_workers`` DataLoader workers."""
        nw = max(num_workers, 1)
        return sum(self.order(self._epoch, Shard(self.rank, self.world_size, w, nw)).num_batches
                   for w in range(nw))

    def set_epoch(self, epoch: int, refresh: bool = False) -> None:
        """Start epoch ``epoch`` at its first batch; ``refresh``: first adopt the rows committed now."""
        if refresh:
            buf = ReplayBuffer.open(self.url, "r", storage_options=self._reader.storage_options,
                                    sampler=Uniform())
            lo, hi = buf.storage.window()
            buf.close()
            self.lo, self.hi = [int(x) for x in lo], [int(x) for x in hi]
        self._epoch, self._batch, self._done = int(epoch), 0, False
        self._shard, self._resuming = Shard(self.rank, self.world_size), False

    def state_dict(self) -> dict[str, Any]:
        """``{"mode", "seed", "epoch", "batch", "done", "lo", "hi", shard}``: plain ints/lists."""
        return {"mode": self.mode, "seed": self.seed, "epoch": self._epoch, "batch": self._batch,
                "done": self._done, "lo": list(self.lo), "hi": list(self.hi), **self._shard.as_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``. Inside a worker (StatefulDataLoader) a finished shard stays
        finished for the rest of that epoch; in the main process a finished state means "next epoch".

        Raises:
            ValueError: another mode or seed; a mid-epoch state used with another world size or
                number of workers (raised when iteration starts).
        """
        self._check_state(state)
        self.lo, self.hi = [int(x) for x in state["lo"]], [int(x) for x in state["hi"]]
        self._epoch, self._batch, self._done = int(state["epoch"]), int(state["batch"]), bool(state["done"])
        self._shard = Shard(self.rank, int(state["world_size"]), int(state["worker"]), int(state["num_workers"]))
        in_worker = tud.get_worker_info() is not None
        self._resuming = in_worker
        if self._done and not in_worker and self._shard.num_workers == 1:
            self._epoch, self._batch, self._done = self._epoch + 1, 0, False

    def _adopt(self, shard: Shard) -> None:
        saved = self._shard
        same = (saved.world_size, saved.worker, saved.num_workers) == (
            shard.world_size, shard.worker, shard.num_workers)
        if not same and (self._batch > 0 or self._done):
            raise ValueError(
                f"epoch {self._epoch} was stopped mid-epoch with world_size={saved.world_size}, "
                f"num_workers={saved.num_workers}; it can only resume with the same settings "
                f"(now world_size={shard.world_size}, num_workers={shard.num_workers}); resume at an "
                f"epoch boundary to change them")
        if self._done and not self._resuming:
            self._epoch, self._batch, self._done = self._epoch + 1, 0, False
        self._shard, self._resuming = shard, False

    def _iterate(self, sink: _Sink) -> Iterator[Any]:
        shard = current_shard(self.rank, self.world_size)
        try:
            self._adopt(shard)
        except ValueError as exc:
            return _raising(exc)  # raised on first next(): a worker then reports it cleanly
        order = self.order(self._epoch, shard)
        if self._batch >= order.num_batches:
            self._done = True
        return self._generate(order, self._batch, sink)

    def _generate(self, order: EpochOrder, first: int, sink: _Sink) -> Iterator[Any]:
        if first >= order.num_batches:
            return
        buf = self._reader.get()
        names, last = _out_names(buf), order.num_batches
        try:
            for k, (lane, step) in enumerate(order.batches(first), start=first):
                batch = self._gather(buf, names, lane, step, sink.destination())
                self._batch, self._done = k + 1, k + 1 == last
                yield sink.emit(batch)
        finally:
            sink.close()


def _out_names(buf: ReplayBuffer) -> frozenset[str]:
    """The names a batch of ``buf`` can be gathered into (its fields and the batch extras)."""
    return frozenset(buf.fields) | frozenset(BATCH_EXTRAS)


def _out(names: frozenset[str], into: dict[str, np.ndarray] | None, rows: int) -> dict[str, np.ndarray] | None:
    """The first ``rows`` of the destination arrays (of ``names``) a batch can be gathered into."""
    if into is None:
        return None
    return {k: v[:rows] for k, v in into.items() if k in names}


def _nowhere() -> None:
    """The destination of batches iterated plainly: new arrays."""
    return None


def _raising(exc: Exception) -> Iterator[Any]:
    raise exc
    yield  # a generator: raises on first next()


def make_dataset(buf: ReplayBuffer | str | os.PathLike, batch_size: int, mode: str = "sample", *,
                 seed: int = 0, shuffle: bool | str = "block", shuffle_window: int = 16,
                 drop_last: bool = False, pad: bool = False, rank: int | None = None,
                 world_size: int | None = None, refresh_every: int | None = None,
                 refresh_seconds: float | None = 1.0, cache_bytes: int | None = None, io_threads: int | None = None,
                 storage_options: dict | None = None, sampler: Any = None,
                 sample_options: dict[str, Any] | None = None, worker_ring: bool = True
                 ) -> SampleDataset | EpochDataset:
    """A torch ``IterableDataset`` of collated batches over a buffer (use ``DataLoader(ds,
    batch_size=None, ...)``).

    Args:
        buf: a `ReplayBuffer` (writer or reader) or its URL. Only its URL and options are kept.
        batch_size: rows per batch (B).
        mode: ``"sample"`` (endless, the buffer's sampler; see `SampleDataset`) or ``"epoch"``
            (every committed row once per epoch; see `EpochDataset`).
        seed: int >= 0; with the rank (and epoch) it determines every batch.
        shuffle: epoch mode: ``"block"`` (= True; chunk order shuffled, rows shuffled within windows
            of ``shuffle_window`` chunks: each chunk read once per epoch), ``"global"`` (a full
            permutation; reads up to a chunk per row) or ``"none"`` (= False; lane/time order).
        drop_last, pad: epoch mode, like ``DistributedSampler``: by default every row exactly once
            per epoch over all ranks and workers (ranks may differ by a row, so by a batch, and each
            worker's last batch may be short); ``pad=True`` repeats up to ``world_size - 1`` rows so
            ranks get equal rows and batches (needed by DDP collectives); ``drop_last=True`` drops up
            to ``world_size - 1`` rows for equal ranks and then every short batch.
        rank, world_size: the shard of this process; default torch.distributed's if initialised,
            else 0 and 1. Workers are detected per process.
        refresh_every, refresh_seconds: sample mode: adopt new commits every that many batches /
            seconds (None: never by that rule).
        cache_bytes, io_threads: each reader's chunk cache bound (default the buffer default,
            512 MiB; pages are touched lazily) and IO threads.
        storage_options: for remote URLs (default: the buffer's).
        sampler: sample mode: a sampler for the readers (pickled to each worker: keep it small);
            default, the one saved with the buffer.
        sample_options: sample mode: keyword options for ``buf.sample`` (e.g. ``{"beta": 0.5}``).
        worker_ring: fork DataLoader workers gather batches into shared-memory slots made here and
            hand over slot numbers (`diskreplay.shared_ring`), instead of torch sending every
            tensor through a new shared-memory segment. Virtual size ``32 workers * 8 slots *
            slot bytes`` (slot: one batch of every field, index and weight, + ``max(4 KiB, 16 B *
            batch_size)``, in whole pages); only slots in use are touched: about
            ``num_workers * (prefetch_factor + 2)`` of them. Batches reach the loop as dicts of
            tensors either way (use ``batch_size=None`` and the default ``collate_fn``; a custom
            collate_fn sees a worker's `SlotBatch`: pass ``worker_ring=False``).

    Raises:
        ValueError: bad mode, batch_size, seed, shuffle, shuffle_window, rank or world size; epoch
            mode with a chunk cache smaller than 2 * shuffle_window chunks.
        NotABufferError: ``buf`` is a URL that holds no buffer.
    """
    if mode not in ("sample", "epoch"):
        raise ValueError(f"mode must be 'sample' or 'epoch', got {mode!r}")
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    rank, world_size = resolve_rank(rank, world_size)
    buf, opened = _as_buffer(buf, storage_options)
    try:
        options = storage_options if storage_options is not None else buf.storage.storage_options
        layout, lo, hi = buf.storage.layout, *committed_window(buf)
        _warn_if_uncommitted(buf, lo, hi, mode)
        ring = _worker_ring(buf, int(batch_size)) if worker_ring else None
        if mode == "sample":
            reader = _Reader(buf.url, options, cache_bytes, io_threads, sampler)
            return SampleDataset(reader, layout, int(batch_size), int(seed), rank, world_size,
                                 refresh_every, refresh_seconds, sample_options, ring)
        shuffle = _shuffle_name(shuffle)
        if not isinstance(shuffle_window, (int, np.integer)) or shuffle_window < 1:
            raise ValueError(f"shuffle_window must be a positive int, got {shuffle_window!r}")
        if shuffle == "block":
            _check_cache(buf, cache_bytes, shuffle_window)
        reader = _Reader(buf.url, options, cache_bytes, io_threads, "uniform")
        return EpochDataset(reader, layout, int(batch_size), int(seed), rank, world_size, lo, hi,
                            shuffle, int(shuffle_window), bool(pad), bool(drop_last), ring)
    finally:
        if opened:
            buf.close()


def _warn_if_uncommitted(buf: ReplayBuffer, lo: np.ndarray, hi: np.ndarray, mode: str) -> None:
    """Datasets read committed rows only: say so when the writer given holds rows not yet
    committed, or when an epoch would be empty."""
    staged = len(buf) - int((hi - lo).sum()) if buf.mode != "r" else 0
    if staged > 0:
        warnings.warn(f"{buf.url!r}: {staged} rows are staged but not committed; a dataset reads committed "
                      f"rows only: call buf.flush() before making it", stacklevel=3)
    elif mode == "epoch" and not (hi - lo).any():
        warnings.warn(f"{buf.url!r} holds no committed rows: this epoch yields no batches (a writer's rows "
                      f"become readable when it calls flush())", stacklevel=3)


def _worker_ring(buf: ReplayBuffer, batch_size: int) -> WorkerRing | None:
    """Slots for batches of ``batch_size`` rows of every field, index and weight (None: the
    mapping could not be made; workers then send tensors as torch does)."""
    arrays = {name: (np.dtype(f.dtype), tuple(f.shape)) for name, f in {**buf.fields, **BATCH_EXTRAS}.items()}
    return WorkerRing.for_batches(arrays, batch_size)


def _as_buffer(buf: Any, storage_options: dict | None) -> tuple[ReplayBuffer, bool]:
    if isinstance(buf, ReplayBuffer):
        return buf, False
    return ReplayBuffer.open(os.fspath(buf), "r", storage_options=storage_options, sampler=Uniform()), True


def _shuffle_name(shuffle: bool | str) -> str:
    name = {True: "block", False: "none"}.get(shuffle, shuffle) if isinstance(shuffle, bool) else shuffle
    if name not in SHUFFLES:
        raise ValueError(f"shuffle must be True, False or one of {SHUFFLES}, got {shuffle!r}")
    return name


def _check_cache(buf: ReplayBuffer, cache_bytes: int | None, window: int) -> None:
    chunk = buf.storage.layout.chunk_rows * sum(f.row_bytes for f in buf.fields.values())
    if cache_bytes is None:
        if DEFAULT_CACHE_BYTES < 2 * window * chunk:
            warnings.warn(f"the default chunk cache ({DEFAULT_CACHE_BYTES} bytes) holds fewer than "
                          f"2 * shuffle_window={2 * window} chunks of {chunk} bytes: chunks will be "
                          f"read more than once per epoch; pass cache_bytes= or a smaller shuffle_window",
                          stacklevel=3)
        return
    if cache_bytes < 2 * window * chunk:
        raise ValueError(f"cache_bytes={cache_bytes} holds {cache_bytes // max(chunk, 1)} chunks of "
                         f"{chunk} bytes; block shuffling with shuffle_window={window} needs "
                         f"{2 * window} ({2 * window * chunk} bytes): raise cache_bytes or lower "
                         f"shuffle_window")


# ---- resume helpers -------------------------------------------------------------------------


def merge_worker_states(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One rank-global dataset state from the per-worker states of one loader position.

    Sample mode: the next batch is the smallest next index over the workers (workers are served
    round-robin), valid for any num_workers. Epoch mode: only at an epoch boundary (every worker
    finished, or none started).

    Raises:
        ValueError: no states, mixed modes, or an epoch-mode position in the middle of an epoch.
    """
    if not states:
        raise ValueError("merge_worker_states needs at least one worker state")
    first = dict(states[0])
    if any(s.get("mode") != first.get("mode") for s in states):
        raise ValueError("worker states of different modes")
    merged = {**first, "worker": 0, "num_workers": 1}
    if first["mode"] == "sample":
        merged["batch"] = min(int(s["batch"]) for s in states)
        return merged
    if all(s["done"] for s in states) and len({s["epoch"] for s in states}) == 1:
        return {**merged, "batch": 0, "done": False, "epoch": int(first["epoch"]) + 1}
    if all(int(s["batch"]) == 0 and not s["done"] for s in states) and len({s["epoch"] for s in states}) == 1:
        return {**merged, "batch": 0, "done": False}
    raise ValueError("epoch-mode workers are in the middle of an epoch: resume with the same "
                     "num_workers (load the StatefulDataLoader state) or at an epoch boundary")


def dataset_state_from_loader(loader_state: Mapping[str, Any]) -> dict[str, Any]:
    """The rank-global dataset state inside a torchdata ``StatefulDataLoader.state_dict()``.

    Load it with ``ds.load_state_dict(...)`` to resume with a different ``num_workers`` (sample
    mode anywhere; epoch mode at an epoch boundary). Needs ``snapshot_every_n_steps=1`` (default).

    Raises:
        ValueError: the loader state holds no dataset state, or its snapshot lags the position.
    """
    if "_snapshot" in loader_state:
        if loader_state.get("_steps_since_snapshot", 0):
            raise ValueError("the loader's worker snapshot lags its position; use snapshot_every_n_steps=1")
        workers = loader_state["_snapshot"]["_worker_snapshots"]
        states = [workers[key]["dataset_state"] for key in sorted(workers, key=lambda k: int(k.split("_")[-1]))]
    else:
        states = [loader_state.get("dataset_state")]
    if any(s is None for s in states):
        raise ValueError("the loader state holds no diskreplay dataset state")
    return merge_worker_states(states)


# ---- prioritized sampling with workers: draw in the main process, gather in workers -------


class IndexBatch(NamedTuple):
    """What `IndexBatchSampler` yields: row ids ``[B]`` int64, importance weights ``[B]`` or None,
    and any extra per-row arrays of the sampler."""

    index: np.ndarray
    weight: np.ndarray | None = None
    extra: dict[str, np.ndarray] | None = None


class IndexBatchSampler(tud.Sampler):
    """Draws batches of row ids from a live buffer's sampler in the main process.

    ``DataLoader(RowDataset(buf), sampler=IndexBatchSampler(buf, B), batch_size=None,
    num_workers=W, prefetch_factor=F)``: the priorities stay in the main process's buffer
    (``buf.update_priorities(batch["index"], td)``). The DataLoader draws an index batch when it
    hands one out, ``W * F`` ahead (0 without workers): an update made after receiving batch ``k``
    affects batch ``k + W * F + 1`` and later, never earlier ones (staleness bound: ``W * F``
    batches). Only committed rows are drawn (workers read committed rows): flush the writer.

    Args:
        buf: the buffer whose sampler and priorities to use (normally the writer).
        batch_size: rows per batch.
        seed: seed of this sampler's own generator (its state is saved in `state_dict`).
        num_batches: batches per iteration (None: endless).
        guard_rows: skip the oldest rows of each lane (a ring writer may overwrite them before a
            worker gathers them).
        sample_options: keyword options of the sampler (e.g. ``{"beta": 0.5}``).
    """

    def __init__(self, buf: ReplayBuffer, batch_size: int, *, seed: int = 0, num_batches: int | None = None,
                 guard_rows: int = 0, sample_options: dict[str, Any] | None = None):
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if num_batches is not None and num_batches < 1:
            raise ValueError(f"num_batches must be None or >= 1, got {num_batches!r}")
        self.buf = buf
        self.batch_size = int(batch_size)
        self.num_batches = num_batches
        self.guard_rows = int(guard_rows)
        self.sample_options = dict(sample_options or {})
        self.rng = np.random.default_rng(seed)
        self.drawn = 0

    def __len__(self) -> int:
        """Batches per iteration. Raises TypeError when endless (``num_batches=None``)."""
        if self.num_batches is None:
            raise TypeError("an endless IndexBatchSampler (num_batches=None) has no length")
        return self.num_batches

    def __iter__(self) -> Iterator[IndexBatch]:
        """`IndexBatch` draws (row ids, weights) from the sampler, ``num_batches`` of them or endless."""
        if self.num_batches is not None and self.drawn >= self.num_batches:
            self.drawn = 0
        while self.num_batches is None or self.drawn < self.num_batches:
            yield self.draw()

    def draw(self) -> IndexBatch:
        """One batch of row ids from the committed rows. Raises EmptyBufferError if there are none."""
        lo, hi = committed_window(self.buf)
        lo = np.minimum(lo + self.guard_rows, hi)
        if is_empty(lo, hi):
            raise EmptyBufferError(f"{self.buf.url!r} has no committed rows to sample (flush the writer)")
        draw = self.buf.sampler.sample(self.rng, self.batch_size, lo, hi, **self.sample_options)
        self.drawn += 1
        return IndexBatch(row_ids(draw.lane, draw.step, self.buf.num_envs), draw.weight, draw.extra or None)

    def state_dict(self) -> dict[str, Any]:
        """``{"rng": generator state, "drawn": batches drawn this iteration}`` (plain data)."""
        return {"rng": self.rng.bit_generator.state, "drawn": self.drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict`: the same batches follow."""
        self.rng.bit_generator.state = state["rng"]
        self.drawn = int(state["drawn"])


class RowDataset(tud.Dataset):
    """Map-style dataset whose item is a batch of row ids (an `IndexBatch` or an int array):
    returns ``{field: [B, *shape], "index": [B] int64 (+ "weight": [B])}`` tensors.

    Pickles to URL + options; each worker opens the buffer read-only. Rows newer than the
    worker's view trigger a refresh; rows still missing (never committed) or overwritten since
    they were drawn raise IndexError.
    """

    def __init__(self, buf: ReplayBuffer | str | os.PathLike, *, storage_options: dict | None = None,
                 cache_bytes: int | None = None, io_threads: int | None = None, refresh_seconds: float | None = 1.0):
        if isinstance(buf, ReplayBuffer):
            url, options = buf.url, storage_options if storage_options is not None else buf.storage.storage_options
        else:
            url, options = os.fspath(buf), storage_options
        self._reader = _Reader(url, options, cache_bytes, io_threads, "uniform")
        self.refresh_seconds = refresh_seconds
        self._last_refresh = 0.0

    def __getitem__(self, item: IndexBatch | np.ndarray | Sequence[int]) -> dict[str, torch.Tensor]:
        """The rows of an `IndexBatch` (or of row ids): ``{field: [B, *shape], "index": [B]}``
        tensors, and ``"weight"`` when the batch has weights."""
        batch = item if isinstance(item, IndexBatch) else IndexBatch(np.asarray(item, dtype=np.int64))
        ids = np.asarray(batch.index, dtype=np.int64)
        buf = self._reader.get()
        self._maybe_refresh(buf, ids)
        try:
            rows = buf[ids]
        except IndexError as exc:
            raise IndexError(f"{exc}. Rows drawn in the main process must be committed (flush the "
                             f"writer) and not overwritten before a worker gathers them (use "
                             f"guard_rows or a larger ring)") from None
        rows["index"] = ids
        if batch.weight is not None:
            rows["weight"] = np.asarray(batch.weight)
        rows.update(batch.extra or {})
        return _emit(rows)

    def _maybe_refresh(self, buf: ReplayBuffer, ids: np.ndarray) -> None:
        now = time.monotonic()
        lo, hi = buf.storage.window()
        lane, step = split_row_ids(ids, buf.num_envs)
        due = self.refresh_seconds is not None and now - self._last_refresh >= self.refresh_seconds
        if due or (len(ids) and (step >= hi[lane]).any()):
            buf.refresh()
            self._last_refresh = now

