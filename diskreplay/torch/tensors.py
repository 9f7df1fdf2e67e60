"""Batches as tensors: the collated `Batch` type, numpy -> tensor conversion, and the sinks a
dataset copy hands its batches to (zero-copy tensors, packed tensors, or worker-ring slots)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud
from torch.utils.data._utils.collate import default_collate_fn_map  # torch's documented extension point

from ..format.ragged import Ragged
from .formats import Key, key_to_name, to_tensordict
from .shared_ring import SlotBatch, WorkerRing


class Batch(dict):
    """A batch as the datasets yield it: ``{name: tensor [B, *shape]}``, already collated. Its
    own type lets a DataLoader left at ``batch_size=1`` pass it through unchanged (with a
    warning) instead of stacking it into ``[1, B, *shape]``."""

    def __copy__(self) -> Batch:
        """A shallow copy, as fast as a dict's (the DataLoader's ``default_convert`` copies each
        batch; a dict subclass would otherwise be copied through ``__reduce_ex__``)."""
        return Batch(self)


class Block:
    """Consecutive batches of one DataLoader worker's stream, handed over as one item (what the
    workers of a `diskreplay.torch.loader.Loader` yield): ``rows`` holds them one after another
    (``{name: [sum(sizes), *shape]}`` tensors, or a `SlotBatch` that becomes them when the
    DataLoader's process receives it); ``sizes`` their row counts; ``end`` the next batch after
    them in the stream of ``shard`` (epoch mode: the worker's shard, ``Shard.worker``; sample
    mode: 0, the rank's one stream). Neither a Mapping nor a Sequence, so ``default_convert``
    passes it through."""

    __slots__ = ("rows", "sizes", "shard", "end")

    def __init__(self, rows: Any, sizes: list[int], shard: int, end: int):
        self.rows, self.sizes, self.shard, self.end = rows, sizes, shard, end

    def __reduce__(self) -> Any:
        return Block, (self.rows, self.sizes, self.shard, self.end)

    def batches(self) -> list[Batch]:
        """The batches, each a `Batch` of views of ``rows`` (tensors)."""
        names = list(self.rows)
        return [Batch(zip(names, views)) for views in zip(*(rows.split(self.sizes) for rows in self.rows.values()))]


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
    """numpy batch -> dict of CPU tensors (zero-copy where the array is contiguous). A ragged
    field (`Ragged`) becomes a jagged nested tensor; text stays a numpy array of ``str``."""
    return Batch((name, _tensor(value)) for name, value in batch.items())


def _tensor(value: Any) -> Any:
    if isinstance(value, Ragged):
        return torch.nested.nested_tensor_from_jagged(torch.from_numpy(np.ascontiguousarray(value.values)),
                                                      torch.from_numpy(value.offsets))
    if isinstance(value, np.ndarray) and value.dtype == object:
        return value
    return torch.from_numpy(np.ascontiguousarray(value))


def ragged_as(form: str, batches: Iterator[Any]) -> Iterator[Any]:
    """``batches`` with their ragged fields as nested tensors (``form="nested"``: as they are) or
    packed (``"packed"``: `pack_ragged`)."""
    return map(pack_ragged, batches) if form == "packed" else batches


def pack_ragged(batch: Any) -> Any:
    """A batch with each jagged nested tensor ``f`` packed as variable-length attention kernels
    take it: ``f`` its values end to end ``[total, *T]``, ``f_cu_seqlens`` the int32 row offsets
    ``[B + 1]``, ``f_max_seqlen`` the longest row (an int)."""
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            offsets = value.offsets()  # type: ignore[attr-defined]
            out[name] = value.values()
            out[f"{name}_cu_seqlens"] = offsets.to(torch.int32)
            out[f"{name}_max_seqlen"] = int((offsets[1:] - offsets[:-1]).max()) if len(offsets) > 1 else 0
        else:
            out[name] = value
    return type(batch)(out) if isinstance(batch, Batch) else out


def packed_tensors(batch: Mapping[str, np.ndarray], align: int = 64) -> Batch:
    """numpy batch -> dict of tensors that are views of one uint8 storage (``align``-byte offsets).

    A DataLoader worker sends each tensor storage through its own shared-memory segment; one
    storage per batch instead of one per field makes that transfer several times cheaper.
    """
    apart = {k: _tensor(v) for k, v in batch.items()
             if isinstance(v, Ragged) or getattr(v, "dtype", None) is np.dtype(object)}
    arrays = {k: np.asarray(v) for k, v in batch.items() if k not in apart}
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
    out.update(apart)
    return Batch((k, out[k]) for k in batch)


def emit_tensors(batch: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Tensors for the consumer: packed in a DataLoader worker, zero-copy in the main process."""
    return packed_tensors(batch) if tud.get_worker_info() is not None else to_tensors(batch)


class Sink:
    """Where this process's batches go: ``destination()`` gives the arrays the next batch is
    gathered into (None: new arrays), ``emit(batch)`` what is yielded for it, ``close()`` gives
    back what an unfinished batch held. ``gathers``: False when ``destination()`` is always None
    (a dataset then skips asking)."""

    gathers = True

    def __init__(self, destination: Callable[[], dict[str, np.ndarray] | None],
                 emit: Callable[[Mapping[str, np.ndarray]], Any]):
        self.destination = destination
        self.emit = emit
        self.gathers = destination is not _nowhere

    def close(self) -> None:
        """Nothing to give back: a plain sink holds no slot."""


class RingSink(Sink):
    """A fork worker's sink: batches are gathered into (or copied to) a slot of the dataset's
    `WorkerRing` and yielded as `SlotBatch` handles; with no free slot or no fit, as packed tensors."""

    def __init__(self, ring: WorkerRing, worker: int):
        self.ring, self.worker = ring, worker
        self._slot: int | None = None  # claimed for the batch being gathered

    def destination(self) -> dict[str, np.ndarray] | None:
        """The arrays of a slot claimed for the next batch (``[B, *shape]`` per name), or None
        when the worker has no free slot (the batch is gathered into new arrays)."""
        if self._slot is None:
            self._slot = self.ring.claim(self.worker)
        return None if self._slot is None else self.ring.arrays(self._slot)

    def emit(self, batch: Mapping[str, np.ndarray]) -> SlotBatch | dict[str, torch.Tensor]:
        """What the worker yields for ``batch``: a `SlotBatch` handle of its slot, or packed
        tensors when no slot is free or the batch does not fit (counted as a fallback)."""
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
        """Give back the slot claimed for an unfinished batch, if any."""
        if self._slot is not None:
            self.ring.release(self._slot)
            self._slot = None


def sink_for(ring: WorkerRing | None) -> Sink:
    """The sink of a plain iteration in this process: zero-copy tensors in the main process; in a
    DataLoader worker, ring slots when the ring is usable, else packed tensors."""
    info = tud.get_worker_info()
    if info is not None and ring is not None and ring.usable_in(info.id):
        return RingSink(ring, info.id)
    return Sink(_nowhere, to_tensors if info is None else packed_tensors)


class TensorDictSink(Sink):
    """Another sink's batches as TensorDicts (`to_tensordict`; slot handles flagged to unpickle
    into one)."""

    def __init__(self, inner: Sink):
        self.inner = inner
        self.gathers = inner.gathers

    def destination(self) -> dict[str, np.ndarray] | None:
        return self.inner.destination()

    def emit(self, batch: Mapping[str, np.ndarray]) -> Any:
        out = self.inner.emit(batch)
        return out.received_as_tensordict() if isinstance(out, SlotBatch) else to_tensordict(out)

    def close(self) -> None:
        self.inner.close()


def by_name(destination: Callable[[], Mapping[Key, np.ndarray] | None]) -> dict[str, np.ndarray] | None:
    """``destination()`` keyed by field names (a TensorDict key becomes its name, `key_to_name`)."""
    into = destination()
    return None if into is None else {k if isinstance(k, str) else key_to_name(k): v for k, v in into.items()}


def _nowhere() -> None:
    """The destination of batches iterated plainly: new arrays."""
    return None
