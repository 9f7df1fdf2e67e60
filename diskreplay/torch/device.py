"""Device prefetch: batches copied to a device through a fixed ring of page-locked host slots.

``for batch in to_device(loader, "cuda", prefetch=2): ...``. Each incoming batch (a dict of
tensors or numpy arrays with a leading batch axis, or a TensorDict: its leaves, by nested key)
lands in the next of ``prefetch + 2`` host slots, allocated once at the size of the first batch
(pinned on CUDA; never pinned per batch). A source with ``iter_into`` (a diskreplay dataset
iterated in this process) gathers its rows straight into the slot; batches from anything else (a
DataLoader, whose workers hand batches over in shared memory) are copied into it. Each slot is
then copied to the device with ``non_blocking=True`` on a side CUDA stream, and an event is
recorded. The consumer's current stream waits on that event when the batch is handed out, and a
slot is refilled only after the event of its previous copy has fired. ``prefetch=k`` keeps the
next ``k`` batches copying while the consumer works on one. A TensorDict batch is handed out as a
TensorDict of the same keys and batch size, holding the device tensors.

Without CUDA (device "cpu", or CUDA unavailable) the same code runs with pinning off and a plain
``.to(device)``; for device "cpu" that returns the slot's own tensors.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..checks import check_int
from .formats import Key, from_leaves, is_tensordict, leaves_of


@dataclass
class _Slot:
    """One host buffer per field, its capacity (rows) and the event of its last device copy."""

    host: dict[Key, torch.Tensor] = field(default_factory=dict)
    event: Any = None
    copies: int = 0  # times a batch was copied into this slot (tests and diagnostics)
    gathers: int = 0  # times a source gathered a batch straight into it

    def arrays(self) -> dict[Key, np.ndarray] | None:
        """The slot's memory as numpy arrays, for a source to gather into (None before allocation)."""
        return {k: t.numpy() for k, t in self.host.items()} if self.host else None

    def fits(self, batch: Mapping[Key, torch.Tensor]) -> bool:
        if set(batch) != set(self.host):
            return False
        return all(self.host[k].dtype == t.dtype and self.host[k].shape[1:] == t.shape[1:]
                   and self.host[k].shape[0] >= t.shape[0] for k, t in batch.items())


class _HostCopier:
    """No streams, no events: a plain ``.to(device)`` (for "cpu" the slot tensors themselves)."""

    pin = False

    def __init__(self, device: torch.device):
        self.device = device

    def new_event(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def copy(self, views: dict[Key, torch.Tensor], event: Any) -> dict[Key, torch.Tensor]:
        return {k: v.to(self.device) for k, v in views.items()}

    def hand_over(self, out: dict[Key, Any], event: Any) -> dict[Key, Any]:
        return out


class _CudaCopier:
    """Copies on a side stream; the consumer's stream waits on the copy's event."""

    def __init__(self, device: torch.device, pin: bool):
        self.device = device
        self.pin = pin
        # torch.cuda.Stream.__new__ has no annotations in torch's sources
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def new_event(self) -> Any:
        # torch.cuda.Event.__new__ has no annotations in torch's sources
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def wait(self, event: Any) -> None:
        event.synchronize()

    def copy(self, views: dict[Key, torch.Tensor], event: Any) -> dict[Key, torch.Tensor]:
        with torch.cuda.stream(self.stream):
            out = {k: v.to(self.device, non_blocking=True) for k, v in views.items()}
            event.record(self.stream)
        return out

    def hand_over(self, out: dict[Key, Any], event: Any) -> dict[Key, Any]:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in out.values():
            if isinstance(t, torch.Tensor):  # other values of a batch pass through untouched
                t.record_stream(consumer)  # the allocator must not reuse it before the consumer is done
        return out


class DevicePrefetcher:
    """Iterator of batches on ``device``; see `to_device`."""

    def __init__(self, iterable: Iterable[Any], device: str | torch.device = "cuda",
                 prefetch: int = 2, pin_memory: bool | None = None, state_source: Any = None):
        check_int(prefetch, "prefetch", 0)
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise RuntimeError(f"device {self.device} requested but CUDA is not available")
        pin = cuda if pin_memory is None else bool(pin_memory)
        self.prefetch = int(prefetch)
        self.copier = _CudaCopier(self.device, pin) if cuda else _HostCopier(self.device)
        self._pin = pin
        self._slots = [_Slot() for _ in range(self.prefetch + 2)]
        self.iterable = iterable
        self._filling: _Slot | None = None  # the slot the batch being produced goes to
        self._source: Any = state_source if state_source is not None else (
            iterable if callable(getattr(iterable, "state_dict", None)) else None)
        self._it: Iterator | None = None
        self._queue: deque = deque()
        self._staged = 0
        self._exhausted = False
        self._state: Any = None

    @property
    def slots(self) -> list[_Slot]:
        """The ring (``prefetch + 2`` slots)."""
        return self._slots

    def __iter__(self) -> DevicePrefetcher:
        """Itself: batches come from `__next__`, already on the device."""
        return self

    def __next__(self) -> Any:
        """The next batch on the device, a dict or TensorDict as the source yielded it (non-array
        values passed through); the first call starts the source and stages ``prefetch + 1``
        batches. Raises StopIteration when the source ends."""
        if self._it is None:
            gathers_into = getattr(self.iterable, "iter_into", None)
            self._it = gathers_into(self._destination) if callable(gathers_into) else iter(self.iterable)
            self._state = self._source_state()
            self._stage(self.prefetch + 1)
        else:
            self._stage(1)
        if not self._queue:
            raise StopIteration
        out, event, batch_size, state = self._queue.popleft()
        self._state = state
        out = self.copier.hand_over(out, event)
        return out if batch_size is None else from_leaves(out, batch_size)

    def state_dict(self) -> Any:
        """The source's state as of the last batch handed out (prefetched batches not counted).

        Raises:
            TypeError: neither the iterable nor ``state_source`` has ``state_dict``.
        """
        if self._source is None:
            raise TypeError("to_device: the source has no state_dict; pass state_source=")
        return self._source_state() if self._it is None else copy.deepcopy(self._state)

    def _source_state(self) -> Any:
        return copy.deepcopy(self._source.state_dict()) if self._source is not None else None

    def _stage(self, count: int) -> None:
        assert self._it is not None  # __next__ starts the iteration before staging
        for _ in range(count):
            if self._exhausted:
                return
            slot = self._slots[self._staged % len(self._slots)]
            if slot.event is not None:
                self.copier.wait(slot.event)  # its previous device copy has read the slot
            self._filling = slot
            try:
                batch = next(self._it)
            except StopIteration:
                self._exhausted = True
                return
            self._staged += 1
            self._queue.append((*self._fill(slot, batch), self._source_state()))

    def _destination(self) -> dict[Key, np.ndarray] | None:
        """For sources with ``iter_into``: the host slot the next batch should be gathered into."""
        assert self._filling is not None  # the source asks while `_stage` draws a batch into a slot
        return self._filling.arrays()

    def _fill(self, slot: _Slot, batch: Any) -> tuple[dict[Key, Any], Any, torch.Size | None]:
        """Put the batch in ``slot`` (arrays already gathered there stay), start its device copy;
        with the event and, for a TensorDict, its batch size."""
        batch_size = batch.batch_size if is_tensordict(batch) else None
        if batch_size is not None:
            batch = leaves_of(batch)
        elif not isinstance(batch, Mapping):
            raise TypeError(f"to_device expects dict or TensorDict batches, got {type(batch).__name__}")
        arrays = {k: torch.as_tensor(v) for k, v in batch.items() if isinstance(v, (torch.Tensor, np.ndarray))}
        others = {k: v for k, v in batch.items() if k not in arrays}
        if any(t.dim() == 0 for t in arrays.values()):
            raise ValueError("to_device: every array in a batch needs a leading batch axis")
        if not slot.fits(arrays):  # the first batch sizes the whole ring; a misfit later resizes one slot
            for fresh in [s for s in self._slots if not s.host] if not slot.host else [slot]:
                fresh.host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin) for k, t in arrays.items()}
                fresh.event = self.copier.new_event()
        views = {k: slot.host[k][:t.shape[0]] for k, t in arrays.items()}
        gathered = all(views[k].data_ptr() == t.data_ptr() for k, t in arrays.items())
        for k, t in arrays.items():
            if views[k].data_ptr() != t.data_ptr():
                views[k].copy_(t)
        slot.gathers += gathered
        slot.copies += not gathered
        out = self.copier.copy(views, slot.event)
        out.update(others)
        return out, slot.event, batch_size


def to_device(iterable: Iterable[Any], device: str | torch.device = "cuda", prefetch: int = 2,
              pin_memory: bool | None = None, state_source: Any = None) -> DevicePrefetcher:
    """Iterate ``iterable``'s dict or TensorDict batches on ``device``, ``prefetch`` batches ahead.

    Args:
        iterable: yields dicts of tensors / numpy arrays with a leading batch axis (other values
            pass through untouched), or TensorDicts (handed out as TensorDicts with the same keys
            and batch size, e.g. from ``make_dataset(..., as_tensordict=True)``). Host slots take
            the shapes of the first batch; a later shorter batch uses the front of a slot, a
            larger or differently shaped one reallocates that slot (once). A diskreplay dataset
            passed directly (not through a DataLoader) gathers its batches into the slots
            (``iter_into``): no copy on the host.
        device: target device ("cuda", "cuda:1", "cpu", ...).
        prefetch: batches kept in flight beyond the one handed out (>= 0); the ring has
            ``prefetch + 2`` slots.
        pin_memory: page-lock the host slots (default: when the device is CUDA).
        state_source: object whose ``state_dict()`` gives the position (default: ``iterable`` if it
            has one, e.g. a StatefulDataLoader or a diskreplay dataset); `DevicePrefetcher.state_dict`
            then returns it as of the last batch handed out, not counting prefetched ones.

    Batch lifetime: on CUDA each yielded batch is a fresh device allocation, valid as long as you
    keep it (its tensors are recorded on the consumer's stream). On other devices (e.g. "cpu") the
    yielded tensors may be the ring slot itself: a batch stays valid while you work on it and on
    the next one; asking for the batch after that (``prefetch + 2`` slots later) may overwrite it.
    Clone what you keep longer.

    Raises:
        ValueError: prefetch < 0; TypeError: a batch that is neither a dict nor a TensorDict;
        RuntimeError: CUDA asked for but unavailable.
    """
    return DevicePrefetcher(iterable, device, prefetch, pin_memory, state_source)
