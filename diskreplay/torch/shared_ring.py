"""Shared-memory batch slots for fork DataLoader workers: workers hand over slot numbers, not data.

A `WorkerRing` is one shared anonymous mapping (``MAP_SHARED | MAP_NORESERVE``: only touched pages
cost memory, no file in /dev/shm) made by a dataset in the main process, so fork workers inherit
it. It holds ``workers * slots_per_worker`` slots of ``slot_bytes`` each (a batch, or a
`Loader`'s block of batches: every field ``[rows, *shape]``, ``index``, ``weight``, plus spare
room for extra arrays) after a one-page header of per-slot flags, claimant pids and hand-over
counters.

Worker ``w`` gathers a batch straight into the lowest free slot of its own ``slots_per_worker``
and yields a `SlotBatch`: a tiny object that pickles to (ring token, slot, array layout). The main
process unpickles it (through the DataLoader's result queue) into a ``dict[str, torch.Tensor]`` of
zero-copy views of its own mapping (a TensorDict of them for ``as_tensordict`` datasets), marks the
slot held, and frees it when the last of those tensors dies (a `weakref.finalize` on the one
ndarray every view shares). A worker never waits and never overwrites a held slot: with none of
its slots free it yields a plain dict (or TensorDict) of tensors (torch's per-tensor shared-memory
path), as it does for spawn/forkserver workers (the ring is not pickled), worker ids beyond the
ring and batches that do not fit a slot.

Slot states: FREE -> SENT (a worker claimed it, under a fork-shared lock: two loaders over one
dataset have workers with the same id) -> HELD (the main process received it) -> FREE (its
tensors died). A SENT slot whose claimant process is gone (its loader was shut down with batches
in flight) is reclaimed by the next worker that finds no free slot.

Memory: the touched pages are those of the rows written, per slot ever in use at once (about
``prefetch_factor + 2`` per worker for a consumer that keeps the current and previous batch): a
batch of a slot planned for a block touches the first rows of each array. At most ``workers *
slots_per_worker * slot_bytes``, shared between the main process and workers.
"""

from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
import platform
import sys
import weakref
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from ..io.lock import pid_alive
from .formats import to_tensordict

FREE, SENT, HELD = 0, 1, 2
ALIGN = 64
PAGE = mmap.PAGESIZE
DEFAULT_WORKERS = 32
DEFAULT_SLOTS_PER_WORKER = 8
MAX_RING_BYTES = 64 << 30
"""Virtual size cap of one ring (the pages are reserved lazily): fewer worker ids get slots above it."""
LOCK_TIMEOUT_S = 1.0
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") and
                         platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64") else 0)
"""Linux's flag (Python has it from 3.12; 0x4000 on these architectures): without it, only
untouched pages are spared, not the commit charge."""

_RINGS: weakref.WeakValueDictionary[str, WorkerRing] = weakref.WeakValueDictionary()
_TOKENS = itertools.count()


class ArraySpec(NamedTuple):
    """Where one array of a batch lies in a slot: byte offset and size, numpy dtype string, shape."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


_SpecFields = tuple[str, int, int, str, tuple[int, ...]]
"""An `ArraySpec`'s fields as a plain tuple (how a `SlotBatch` pickles them)."""


def _align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def plan_slot(arrays: Mapping[str, tuple[np.dtype, tuple[int, ...]]], rows: int,
              spare_bytes: int) -> tuple[tuple[ArraySpec, ...], int]:
    """Slot layout for ``rows`` rows of each ``name: (dtype, row shape)``: the specs (64-byte aligned
    offsets) and the slot size in bytes (``spare_bytes`` more, rounded up to whole pages)."""
    specs, end = [], 0
    for name, (dtype, shape) in arrays.items():
        dtype = np.dtype(dtype)
        full = (rows, *shape)
        nbytes = int(np.prod(full, dtype=np.int64)) * dtype.itemsize
        specs.append(ArraySpec(name, end, nbytes, dtype.str, full))
        end = _align(end + nbytes)
    return tuple(specs), _align(end + spare_bytes, PAGE)


class WorkerRing:
    """Slots in a shared anonymous mapping; see the module docstring.

    Args:
        specs, slot_bytes: from `plan_slot`.
        workers: worker ids that get slots (0 .. workers - 1).
        slots_per_worker: slots of each worker id.

    Raises:
        OSError: the mapping could not be made.
    """

    def __init__(self, specs: tuple[ArraySpec, ...], slot_bytes: int, workers: int = DEFAULT_WORKERS,
                 slots_per_worker: int = DEFAULT_SLOTS_PER_WORKER):
        self.specs, self.slot_bytes = specs, int(slot_bytes)
        self.workers, self.slots_per_worker = int(workers), int(slots_per_worker)
        n = self.workers * self.slots_per_worker
        self._pids_at = _align(n)
        self._handed_at = _align(self._pids_at + 4 * n)
        self._fallbacks_at = self._handed_at + 8 * n
        self.header_bytes = _align(self._fallbacks_at + 8 * self.workers, PAGE)
        self.nbytes = self.header_bytes + n * self.slot_bytes
        self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_SHARED | _MAP_NORESERVE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._lock = multiprocessing.get_context("fork").Lock()
        self.owner = os.getpid()
        self.token = f"{self.owner}-{next(_TOKENS)}-{id(self):x}"
        self.received = 0  # slot batches unpickled by the owner process
        self._local: dict[str, Any] = {}
        _RINGS[self.token] = self

    @classmethod
    def for_batches(cls, arrays: Mapping[str, tuple[np.dtype, tuple[int, ...]]], rows: int,
                    workers: int | None = None, slots_per_worker: int | None = None) -> WorkerRing | None:
        """A ring whose slots hold ``rows`` rows of ``arrays`` (+ spare room for extras), or None
        when not even one worker's slots fit `MAX_RING_BYTES` or the mapping fails. Defaults:
        `DEFAULT_WORKERS` worker ids, `DEFAULT_SLOTS_PER_WORKER` slots each."""
        workers = DEFAULT_WORKERS if workers is None else workers
        slots_per_worker = DEFAULT_SLOTS_PER_WORKER if slots_per_worker is None else slots_per_worker
        specs, slot_bytes = plan_slot(arrays, rows, spare_bytes=max(PAGE, 16 * rows))
        workers = min(workers, MAX_RING_BYTES // (slot_bytes * slots_per_worker))
        if workers < 1:
            return None
        try:
            return cls(specs, slot_bytes, workers, slots_per_worker)
        except OSError:
            return None

    def __reduce__(self) -> Any:
        raise TypeError("a WorkerRing lives in one process tree (fork workers); datasets drop it when pickled")

    # ---- views of the header, per process ----------------------------------------------------

    def _view(self, key: str, dtype: str, offset: int, count: int) -> np.ndarray:
        local = self._local
        if local.get("pid") != os.getpid():
            local.clear()
            local["pid"] = os.getpid()
        if key not in local:
            local[key] = np.frombuffer(self._mm, dtype, count=count, offset=offset)
        view: np.ndarray = local[key]
        return view

    def _pids(self) -> np.ndarray:
        return self._view("pids", "<i4", self._pids_at, self.workers * self.slots_per_worker)

    def _handed(self) -> np.ndarray:
        return self._view("handed", "<i8", self._handed_at, self.workers * self.slots_per_worker)

    def _fallback_counts(self) -> np.ndarray:
        return self._view("fallbacks", "<i8", self._fallbacks_at, self.workers)

    def _start(self, slot: int) -> int:
        return self.header_bytes + slot * self.slot_bytes

    def stats(self) -> dict[str, Any]:
        """``handed_over``: slot batches workers yielded; ``fallbacks``: batches workers yielded as
        plain tensors instead (no free slot or no fit; per worker id, best effort when two loaders
        share the dataset); ``received``: slot batches this process unpickled; ``states``: slot
        counts per state (``free``, ``sent``, ``held``)."""
        flags = bytes(self._mm[:self.workers * self.slots_per_worker])
        return {"handed_over": int(self._handed().sum()), "fallbacks": int(self._fallback_counts().sum()),
                "received": self.received,
                "states": {name: flags.count(code) for name, code in (("free", FREE), ("sent", SENT), ("held", HELD))}}

    # ---- worker side ---------------------------------------------------------------------------

    def usable_in(self, worker: int) -> bool:
        """Whether worker ``worker`` of a DataLoader in this process may use the ring: it is a
        direct fork child of the ring's owner and has slots."""
        return os.getppid() == self.owner and 0 <= worker < self.workers and os.getpid() != self.owner

    def claim(self, worker: int) -> int | None:
        """The lowest free slot of ``worker`` (or one whose claimant died), now SENT by this
        process; None if there is none (never waits longer than `LOCK_TIMEOUT_S`)."""
        lo = worker * self.slots_per_worker
        hi = lo + self.slots_per_worker
        if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            return None
        try:
            slot = self._mm.find(bytes([FREE]), lo, hi)
            if slot < 0:
                slot = self._stale(lo, hi)
            if slot >= 0:
                self._mm[slot] = SENT
                self._pids()[slot] = os.getpid()
            return slot if slot >= 0 else None
        finally:
            self._lock.release()

    def _stale(self, lo: int, hi: int) -> int:
        """A SENT slot whose claimant process is gone (its batch will never be received), or -1."""
        pids, me = self._pids(), os.getpid()
        for slot in range(lo, hi):
            if self._mm[slot] == SENT and int(pids[slot]) != me and not pid_alive(int(pids[slot])):
                return slot
        return -1

    def release(self, slot: int) -> None:
        """Give back a claimed slot that was not handed over."""
        self._mm[slot] = FREE

    def count_fallback(self, worker: int) -> None:
        """Count one batch that worker ``worker`` yielded as plain tensors instead of in a slot."""
        self._fallback_counts()[worker] += 1

    def arrays(self, slot: int) -> dict[str, np.ndarray]:
        """The slot's planned arrays (``[B, *shape]`` per name), to gather a batch into."""
        key = f"slot{slot}"
        local = self._local
        if local.get("pid") != os.getpid() or key not in local:
            base = self._view(f"base{slot}", "u1", self._start(slot), self.slot_bytes)
            local[key] = {s.name: base[s.offset:s.offset + s.nbytes].view(s.dtype).reshape(s.shape)
                          for s in self.specs}
        arrays: dict[str, np.ndarray] = local[key]
        return arrays

    def hand_over(self, slot: int, batch: Mapping[str, Any]) -> SlotBatch | None:
        """A `SlotBatch` for ``batch`` in ``slot``: arrays gathered into the slot stay, others are
        copied after them. None (nothing counted) if a value is not a plain numeric ndarray or
        the batch does not fit."""
        base = self._view(f"base{slot}", "u1", self._start(slot), self.slot_bytes)
        origin = _address(base)
        placed, outside, end = [], [], 0
        for name, value in batch.items():
            if type(value) is not np.ndarray or value.dtype.hasobject:
                return None
            offset = _address(value) - origin
            if value.flags.c_contiguous and 0 <= offset and offset + value.nbytes <= self.slot_bytes:
                placed.append(ArraySpec(name, offset, value.nbytes, value.dtype.str, value.shape))
                end = max(end, offset + value.nbytes)
            else:
                outside.append((name, value))
        for name, value in outside:
            offset = _align(end)
            if offset + value.nbytes > self.slot_bytes:
                return None
            base[offset:offset + value.nbytes].view(value.dtype).reshape(value.shape)[...] = value
            placed.append(ArraySpec(name, offset, value.nbytes, value.dtype.str, value.shape))
            end = offset + value.nbytes
        self._handed()[slot] += 1
        return SlotBatch(self.token, slot, tuple(placed))

    # ---- main side -----------------------------------------------------------------------------

    def receive(self, slot: int, specs: tuple[_SpecFields, ...]) -> dict[str, torch.Tensor]:
        """The slot's arrays as tensors viewing this process's mapping; the slot is HELD until
        the last of them dies. ``specs``: `ArraySpec`s, or their plain tuples (as pickled)."""
        self._mm[slot] = HELD
        base = np.frombuffer(self._mm, np.uint8, count=self.slot_bytes, offset=self._start(slot))
        out = {name: torch.from_numpy(base[offset:offset + nbytes].view(dtype).reshape(shape))
               for name, offset, nbytes, dtype, shape in specs}
        weakref.finalize(base, self._free, slot).atexit = False
        self.received += 1
        return out

    def _free(self, slot: int) -> None:
        if os.getpid() == self.owner:  # a fork child dropping inherited views frees nothing
            self._mm[slot] = FREE


class SlotBatch:
    """What a worker yields instead of a batch: pickles to (ring token, slot, layout, format) and
    unpickles, in the ring's owner process, to ``dict[str, torch.Tensor]`` views of the slot (a
    ``tensordict.TensorDict`` of them when ``tensordict``: `to_tensordict`'s layout). Not a
    Mapping, so the DataLoader's ``default_convert`` passes it through unchanged."""

    __slots__ = ("token", "slot", "specs", "tensordict")

    def __init__(self, token: str, slot: int, specs: tuple[ArraySpec, ...], tensordict: bool = False):
        self.token, self.slot, self.specs, self.tensordict = token, slot, specs, tensordict

    def received_as_tensordict(self) -> SlotBatch:
        """This handle, made to unpickle into a TensorDict of the slot's views instead of a dict."""
        return SlotBatch(self.token, self.slot, self.specs, tensordict=True)

    def __reduce__(self) -> Any:
        return _receive, (self.token, self.slot, tuple(tuple(s) for s in self.specs), self.tensordict)

    def __repr__(self) -> str:
        kind = ", tensordict" if self.tensordict else ""
        return f"SlotBatch(slot={self.slot}, arrays={[s.name for s in self.specs]}{kind})"


def _receive(token: str, slot: int, specs: tuple[_SpecFields, ...], tensordict: bool = False) -> Any:
    ring = _RINGS.get(token)
    if ring is None or ring.owner != os.getpid():
        raise RuntimeError(f"a diskreplay worker batch (ring {token}, slot {slot}) reached a process that "
                           f"does not own its ring: slot batches go only from fork workers to their "
                           f"DataLoader's process")
    batch = ring.receive(slot, specs)
    return to_tensordict(batch) if tensordict else batch


def _address(array: np.ndarray) -> int:
    address: int = array.__array_interface__["data"][0]
    return address

