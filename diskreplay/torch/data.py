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
(`diskreplay.torch.shared_ring.WorkerRing`, mapped by `make_dataset` before any worker starts) and
yield only a `SlotBatch` handle; the DataLoader's process unpickles it into tensors viewing the
slot, which is reused once they all died. Shared memory: up to ``32 * 8`` slots of one batch each
(virtual, ``MAP_NORESERVE``); touched, about ``num_workers * (prefetch_factor + 2)`` slots. Other
workers (spawn, no free slot, a batch bigger than a slot) send tensors through torch's shared
memory as before; the values are the same either way.

TensorDicts. ``make_dataset(..., as_tensordict=True)`` yields ``tensordict.TensorDict`` batches
(TorchRL's layout, `diskreplay.torch.formats.to_tensordict`), also through the ring (a slot handle
unpickles into a TensorDict of the slot's views). Pass ``collate_fn=keep_batch`` to the
DataLoader: its default collate cannot take a TensorDict.

Resume. ``state_dict()`` is plain data (a few ints). It follows torchdata's
``StatefulDataLoader`` protocol: each worker's dataset copy saves and restores its own position.
With ``num_workers=0`` call ``ds.state_dict()`` / ``ds.load_state_dict()`` directly (or wrap in
``to_device(ds_or_loader, ...)`` whose ``state_dict()`` lags its prefetch correctly). A plain
``DataLoader`` with workers cannot report positions (its workers iterate copies; the dataset's
``state_dict()`` then raises RuntimeError): use `Loader` or ``StatefulDataLoader``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ..buffer import ReplayBuffer
from ..buffer.batches import BATCH_EXTRAS
from ..checks import check_int
from ..sampling import Uniform
from ..storage import DEFAULT_CACHE_BYTES
from .datasets import EpochDataset, SampleDataset
from .epoch_order import PARTITIONS, SHUFFLES
from .formats import tensordict_class, tensordict_keys
from .read_sizes import batches_per_block
from .reader import Reader, committed_window, resolve_rank
from .shared_ring import WorkerRing

_B = TypeVar("_B")


def make_dataset(buf: ReplayBuffer | str | os.PathLike, batch_size: int, mode: str = "sample", *,
                 seed: int = 0, shuffle: bool | str = "block", shuffle_window: int = 16,
                 drop_last: bool = False, pad: bool = False, rank: int | None = None,
                 world_size: int | None = None, refresh_every: int | None = None,
                 refresh_seconds: float | None = 1.0, cache_bytes: int | None = None, io_threads: int | None = None,
                 storage_options: dict | None = None, sampler: Any = None,
                 sample_options: dict[str, Any] | None = None, worker_ring: bool = True,
                 as_tensordict: bool = False, canonical_partitions: int = PARTITIONS,
                 ragged: str = "nested") -> SampleDataset | EpochDataset:
    """A torch ``IterableDataset`` of collated batches over a buffer (use ``DataLoader(ds,
    batch_size=None, ...)``, or `diskreplay.torch.Loader` for workers that hand over several
    batches at once).

    Args:
        buf: a `ReplayBuffer` (writer or reader) or its URL. Only its URL and options are kept.
            Epoch mode from a URL: the handle opened here to read the layout is the one this
            process then reads with (one open: on object storage, its round trips once).
        batch_size: rows per batch (B).
        mode: ``"sample"`` (endless, the buffer's sampler; see `SampleDataset`) or ``"epoch"``
            (every committed row once per epoch; see `EpochDataset`).
        seed: int >= 0; with the rank (and epoch) it determines every batch.
        shuffle: epoch mode: ``"block"`` (= True; chunk order shuffled, rows shuffled within windows
            of ``shuffle_window`` chunks: each chunk read once per epoch), ``"global"`` (a full
            permutation; reads up to a chunk per row) or ``"none"`` (= False; lane/time order).
        drop_last: epoch mode, like ``DistributedSampler``: by default every row exactly once
            per epoch over all ranks and workers (ranks may differ by a row, so by a batch, and each
            worker's last batch may be short); ``drop_last=True`` cuts every rank to the smallest
            rank's rows (up to ``world_size - 1`` rows dropped when ``world_size`` divides
            ``canonical_partitions``) and then drops every short batch.
        pad: epoch mode, like ``DistributedSampler``: ``pad=True`` repeats each rank's first rows
            up to the largest rank's rows (up to ``world_size - 1`` rows in all when ``world_size``
            divides ``canonical_partitions``), so ranks get equal rows and batches (DDP collectives).
        canonical_partitions: epoch mode: the epoch's row sequence is cut into this many partitions
            and ranks take runs of whole ones (`epoch_order.rank_selection`); the order depends on
            no world size, so a position resumes on another one. Default `epoch_order.PARTITIONS`
            (46,126,080: a multiple of every world size up to 16 and of powers of two up to 1024).
        rank: the shard of this process; default torch.distributed's rank if initialised, else 0.
            Workers are detected per process.
        world_size: the number of ranks; default torch.distributed's if initialised, else 1.
        refresh_every: sample mode: adopt new commits every that many batches (None: never by that
            rule), checked between reads (`read_sizes.batches_per_read`).
        refresh_seconds: sample mode: adopt new commits every that many seconds (None: never by
            that rule), checked between reads.
        cache_bytes: each reader's chunk cache bound (default the buffer default, 512 MiB; pages
            are touched lazily).
        io_threads: each reader's IO threads.
        storage_options: for remote URLs (default: the buffer's).
        sampler: sample mode: a sampler for the readers (pickled to each worker: keep it small);
            default, the one saved with the buffer.
        sample_options: sample mode: keyword options for ``buf.sample`` (e.g. ``{"beta": 0.5}``).
        worker_ring: fork DataLoader workers gather batches into shared-memory slots made here and
            hand over slot numbers (`diskreplay.torch.shared_ring`), instead of torch sending every
            tensor through a new shared-memory segment. Virtual size ``32 workers * 8 slots *
            slot bytes`` (slot: a `Loader`'s block of every field, index and weight, up to
            `read_sizes.BLOCK_BATCHES` batches and `read_sizes.BLOCK_BYTES`, + ``max(4 KiB, 16 B *
            rows)``, in whole pages); only the pages in use are touched: about ``num_workers *
            (prefetch_factor + 2)`` slots, of a batch each with a plain DataLoader. Batches reach
            the loop the same way either way (use ``batch_size=None`` and the default ``collate_fn`` or `keep_batch`;
            another collate_fn sees a worker's `SlotBatch`: pass ``worker_ring=False``).
        as_tensordict: yield ``tensordict.TensorDict`` batches (batch size ``[B]``, keys as
            `diskreplay.torch.formats.to_tensordict` lays out the dict batch: ``next_obs`` ->
            ``("next", "obs")``; the same tensors, not copied) instead of dicts of tensors; the
            rows, their order and the resume states are the same. A DataLoader needs
            ``collate_fn=keep_batch`` for them: its default collate takes a TensorDict for a dict
            and fails (``TypeError: Multiple dispatch failed for 'torch.Tensor.__getitem__'``).
        ragged: how ragged fields come: ``"nested"`` (a jagged ``torch.nested`` tensor ``[B, j, *T]``,
            ``layout=torch.jagged``) or ``"packed"``: field ``f`` as its values end to end
            ``[total, *T]`` with ``f_cu_seqlens`` (int32 ``[B + 1]``, the layout variable-length
            attention kernels take) and ``f_max_seqlen`` (an int). Text fields come as numpy
            arrays of ``str``. Buffers with ragged fields hand batches over without the worker ring.

    Raises:
        ValueError: bad mode, batch_size, seed, shuffle, shuffle_window, canonical_partitions, rank or world size; epoch
            mode with a chunk cache smaller than 2 * shuffle_window chunks; ``as_tensordict`` with
            fields that do not make one TensorDict (`diskreplay.torch.formats.tensordict_keys`).
        ImportError: ``as_tensordict=True`` without the tensordict package.
        NotABufferError: ``buf`` is a URL that holds no buffer.
    """
    if mode not in ("sample", "epoch"):
        raise ValueError(f"mode must be 'sample' or 'epoch', got {mode!r}")
    if ragged not in ("nested", "packed"):
        raise ValueError(f"ragged must be 'nested' or 'packed', got {ragged!r}")
    check_int(batch_size, "batch_size", 1)
    check_int(seed, "seed", 0)
    rank, world_size = resolve_rank(rank, world_size)
    reader = None
    if mode == "epoch" and not isinstance(buf, ReplayBuffer):  # this process reads with the handle opened here
        reader = Reader(os.fspath(buf), storage_options, cache_bytes, io_threads, "uniform", None)
        buf, opened = reader.get(), False
    else:
        buf, opened = _as_buffer(buf, storage_options)
    try:
        options = storage_options if storage_options is not None else buf.storage_options
        layout, lo, hi = buf.layout, *committed_window(buf)
        warn_if_uncommitted(buf, lo, hi, mode)
        if as_tensordict:
            _check_tensordict(buf)
        varying = any(f.ragged for f in buf.fields.values())  # batches of varying size: no ring slots
        # an epoch's block within a shuffle window's rows: it needs the chunks of two windows at most
        window = None if mode == "sample" else check_int(shuffle_window, "shuffle_window", 1) * layout.chunk_rows
        block = 1 if varying else batches_per_block(int(batch_size), buf, window)
        ring = _worker_ring(buf, block * int(batch_size)) if worker_ring and not varying else None
        if mode == "sample":
            reader = Reader(buf.url, options, cache_bytes, io_threads, sampler, buf.at_commit)
            return SampleDataset(reader, layout, int(batch_size), int(seed), rank, world_size, refresh_every,
                                 refresh_seconds, sample_options, ring, bool(as_tensordict), block, ragged)
        shuffle = _shuffle_name(shuffle)
        if shuffle == "block":
            _check_cache(buf, cache_bytes, shuffle_window)
        reader = reader or Reader(buf.url, options, cache_bytes, io_threads, "uniform", buf.at_commit)
        return EpochDataset(reader, layout, int(batch_size), int(seed), rank, world_size, lo, hi,
                            shuffle, int(shuffle_window), bool(pad), bool(drop_last), ring, bool(as_tensordict),
                            block, check_int(canonical_partitions, "canonical_partitions", 1), ragged)
    except BaseException:
        if reader is not None and reader.opened:  # the handle opened here for the dataset's reads
            buf.close()
        raise
    finally:
        if opened:
            buf.close()


def warn_if_uncommitted(buf: ReplayBuffer, lo: np.ndarray, hi: np.ndarray, mode: str) -> None:
    """Datasets read committed rows only: say so when the writer given holds rows not yet
    committed, or when an epoch would be empty."""
    staged = len(buf) - int((hi - lo).sum()) if buf.mode != "r" else 0
    if staged > 0:
        warnings.warn(f"{buf.url!r}: {staged} rows are staged but not committed; a dataset reads committed "
                      f"rows only: call buf.flush() before making it", stacklevel=3)
    elif mode == "epoch" and not (hi - lo).any():
        warnings.warn(f"{buf.url!r} holds no committed rows: this epoch yields no batches (a writer's rows "
                      f"become readable when it calls flush())", stacklevel=3)


def keep_batch(batch: _B) -> _B:
    """A DataLoader ``collate_fn`` that hands each batch on unchanged: ``DataLoader(ds,
    batch_size=None, collate_fn=keep_batch, num_workers=...)``.

    Needed for TensorDict batches (``make_dataset(..., as_tensordict=True)``): torch's default
    (``default_convert``) takes a TensorDict for a dict of samples and fails with ``TypeError:
    Multiple dispatch failed for 'torch.Tensor.__getitem__'``. Works for dict batches and worker
    `SlotBatch` handles too; a module-level function, so spawn workers can unpickle it.
    """
    return batch


def _check_tensordict(buf: ReplayBuffer) -> None:
    """Check that tensordict imports and that the buffer's fields (+ batch extras) make one TensorDict.

    Raises:
        ImportError: no tensordict package. ValueError: see `tensordict_keys`.
    """
    tensordict_class("make_dataset(as_tensordict=True)")
    tensordict_keys([*buf.fields, *BATCH_EXTRAS])


def _worker_ring(buf: ReplayBuffer, rows: int) -> WorkerRing | None:
    """Slots of ``rows`` rows of every field, index and weight: a batch, or a `Loader`'s block
    of batches (None: the mapping could not be made; workers then send tensors as torch does)."""
    arrays = {name: (np.dtype(f.dtype), tuple(f.shape)) for name, f in {**buf.fields, **BATCH_EXTRAS}.items()}
    return WorkerRing.for_batches(arrays, rows)


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
    chunk = buf.layout.chunk_rows * sum(f.row_bytes for f in buf.fields.values())
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
