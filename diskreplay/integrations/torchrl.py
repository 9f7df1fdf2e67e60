"""`ZarrStorage`: a TorchRL ``Storage`` whose rows live in a diskreplay ring (``dr.torchrl``).

Use it as the storage of ``torchrl.data.ReplayBuffer`` / ``TensorDictReplayBuffer`` with TorchRL's
own samplers (``RandomSampler``, ``PrioritizedSampler``, ``SliceSampler``,
``PrioritizedSliceSampler``...) and round-robin writers; like TorchRL's tensor storages it has
``shape`` ``[len]`` (``_total_shape`` ``[max_size]``), and it gives a buffer built without a
``collate_fn`` its default, `collate` (TorchRL knows defaults only for its own storages)::

    storage = dr.torchrl.ZarrStorage(1_000_000, "runs/rb")
    rb = TensorDictReplayBuffer(storage=storage, sampler=PrioritizedSampler(1_000_000, 0.7, 0.5),
                                batch_size=256)

Importing this module imports torchrl and tensordict.

Slots and rows: TorchRL addresses ``max_size`` slots; the diskreplay buffer at ``url`` is a ring of
``max_size`` rows (one lane) that only appends. Slot ``s`` holds the newest row whose ring position
is ``(s + offset) % max_size``, where ``offset`` is the ring position of slot 0 (fixed when the
storage is opened or emptied). A write must therefore go to the next slots in round-robin order,
as TorchRL's round-robin writers do; a write elsewhere (``write_at``, ``storage[i] = x``) raises.

Fields are inferred from the first TensorDict written: each leaf becomes a field named by
`diskreplay.torch.formats.key_to_name` (``("next", "obs")`` -> ``next_obs``, ``("a", "b")`` ->
``a__b``, a root ``"next_x"`` -> ``__next_x``), so every key reads back as it was written; the
writer's ``"index"`` entry is not stored (samplers set it on every batch).

Resuming: ``ZarrStorage(max_size, url)`` on an existing buffer gives its rows back. A full ring
lines up with a fresh writer; otherwise restore the replay buffer's ``state_dict`` (which holds this
storage's, see `ZarrStorage.state_dict`) so that its writer continues at `ZarrStorage.next_slot`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import is_tensor_collection
from torchrl.data.replay_buffers.storages import Storage

from ..buffer import ReplayBuffer
from ..checks import check_int
from ..errors import NotABufferError
from ..format.schema import Field
from ..torch.formats import key_to_name, to_tensordict

WRITER_INDEX = "index"
"""The entry TorchRL's ``TensorDictRoundRobinWriter`` adds to what it writes (not stored)."""


class ZarrStorage(Storage):  # type: ignore[misc]  # torchrl is untyped
    """A TorchRL storage of ``max_size`` slots backed by a diskreplay ring buffer at ``url``.

    Args:
        max_size: slots (rows) kept; the ring's capacity.
        url: where the buffer lives (a local path or an fsspec URL). An existing buffer there is
            opened for writing (its capacity must be ``max_size``); otherwise one is created at
            the first write, with fields inferred from the data.
        overwrite: replace whatever is at ``url`` at the first write instead of opening it.
        create_options: passed to `ReplayBuffer.create` (``chunk_rows``, ``compression``,
            ``storage_options``, ``cache_bytes``...).

    Raises:
        ValueError: ``max_size`` < 1, or an existing buffer at ``url`` that is not a one-lane ring
            of ``max_size`` rows. LockedError: another writer holds the buffer.
    """

    def __init__(self, max_size: int, url: str | os.PathLike[str], *, overwrite: bool = False,
                 **create_options: Any):
        super().__init__(check_int(max_size, "max_size", 1))
        self.url = os.fspath(url)
        self.device = torch.device("cpu")
        self._overwrite = overwrite
        self._create_options = dict(create_options)
        self._buffer = None if overwrite else _open_existing(self.url, self.max_size)
        self._offset = self._window()[0] % self.max_size

    # ---- what TorchRL asks of a storage ----------------------------------------------------

    def __len__(self) -> int:
        """Slots that hold a row (the buffer's readable rows)."""
        lo, hi = self._window()
        return hi - lo

    @property
    def shape(self) -> torch.Size:
        """``[len(self)]``: the slots that hold rows, as TorchRL's tensor storages (samplers size
        their index spaces by it)."""
        return torch.Size([len(self)])

    @property
    def _total_shape(self) -> torch.Size:
        """``[max_size]``: every slot, held or not (TorchRL's tensor storages' ``_total_shape``)."""
        return torch.Size([self.max_size])

    @property
    def _len_along_dim0(self) -> int:
        """Slots that hold a row (one dimension: `__len__`)."""
        return len(self)

    def attach(self, buffer: Any) -> None:
        """TorchRL's hook for a replay buffer taking this storage: also gives a buffer built
        without a ``collate_fn`` `collate` (TorchRL picks defaults for its own storages only)."""
        super().attach(buffer)
        if getattr(buffer, "_init_collate_fn", collate) is None:
            buffer._init_collate_fn = collate

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append ``data`` (a TensorDict: batch size ``[]`` for an int ``cursor``, else ``[n]``)
        at slots ``cursor``, which must be the next ones (`next_slot`, round robin).

        Raises:
            NotImplementedError: ``set_cursor=False`` (writing at chosen slots).
            TypeError: ``data`` is not a TensorDict (or tensorclass).
            ValueError: slots out of round-robin order, or not one row per slot.
            SchemaError: data that does not fit the buffer's fields (or a field name diskreplay
                reserves, e.g. ``mask``).
        """
        if not set_cursor:
            raise NotImplementedError("ZarrStorage only appends (round robin): writing at chosen slots "
                                      "(write_at, storage[i] = data) is not supported")
        single = _is_int(cursor)
        slots = np.atleast_1d(_as_slots(cursor, self.max_size))
        rows = tensordict_rows(data, single)
        count = len(next(iter(rows.values())))
        if count != len(slots):
            raise ValueError(f"{len(slots)} slots for {count} rows")
        expected = (self.next_slot + np.arange(len(slots))) % self.max_size
        if not np.array_equal(slots, expected):
            raise ValueError(f"ZarrStorage at {self.url!r} appends in round-robin order: the next write must go to "
                             f"slot {self.next_slot}, got slots starting at {int(slots[0])}; resuming, restore the "
                             f"replay buffer's state_dict (its writer cursor) first")
        self._writable(rows).extend(rows)
        self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def get(self, index: Any) -> Any:
        """The rows at slots ``index`` (an int, a slice, a list or an int tensor / array) as a
        TensorDict of batch size ``index``'s shape (``[]`` for an int), tensors sharing memory
        with the gathered arrays.

        Raises:
            RuntimeError: nothing was written yet. IndexError: a slot that holds no row.
        """
        if self._buffer is None or len(self) == 0:
            raise RuntimeError(f"ZarrStorage at {self.url!r} holds no rows yet")
        slots = self._slots(index)
        rows = self._buffer.rows(self._row_ids(slots.ravel()))
        out = to_tensordict(rows)
        return out[0] if slots.ndim == 0 else out.reshape(slots.shape)

    def contains(self, item: Any) -> Any:
        """Whether slots ``item`` hold rows: a bool for an int, else a bool tensor."""
        slots = torch.as_tensor(item)
        inside = (slots >= 0) & (slots < len(self))
        return bool(inside) if slots.ndim == 0 else inside

    def state_dict(self) -> dict[str, Any]:
        """Commits every row (`ReplayBuffer.flush`), then returns what ties TorchRL's slots to
        the buffer's rows: ``{"url", "max_size", "rows_added", "offset"}`` (ints and a str)."""
        if self._buffer is not None:
            self._buffer.flush()
        return {"url": self.url, "max_size": self.max_size, "rows_added": self._window()[1], "offset": self._offset}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the slot layout of `state_dict` (taken of this same buffer, rows since unchanged).

        Raises:
            ValueError: a state of another buffer or size, or of the buffer with fewer or more rows.
        """
        mine = self.state_dict()
        for key in ("url", "max_size", "rows_added"):
            if state_dict.get(key) != mine[key]:
                raise ValueError(f"this state is not of ZarrStorage at {self.url!r} as it is now: its {key} is "
                                 f"{state_dict.get(key)!r}, the storage's {mine[key]!r}")
        self._offset = int(state_dict["offset"]) % self.max_size

    def _empty(self) -> None:
        """Forget every row (`ReplayBuffer.clear`); the next write goes to slot 0."""
        if self._buffer is not None:
            self._buffer.clear()
        self._offset = self._window()[1] % self.max_size

    # ---- diskreplay's side -----------------------------------------------------------------

    @property
    def buffer(self) -> ReplayBuffer | None:
        """The diskreplay buffer holding the rows (None until the first write creates it)."""
        return self._buffer

    @property
    def next_slot(self) -> int:
        """The slot the next write must go to: a round-robin writer's cursor."""
        return int((self._window()[1] - self._offset) % self.max_size)

    def flush(self) -> None:
        """Commit every row written so far (see `ReplayBuffer.flush`)."""
        if self._buffer is not None:
            self._buffer.flush()

    def close(self) -> None:
        """Commit and close the buffer (idempotent)."""
        if self._buffer is not None:
            self._buffer.close()

    def __repr__(self) -> str:
        return f"ZarrStorage({self.url!r}, max_size={self.max_size}, rows={len(self)})"

    def _window(self) -> tuple[int, int]:
        """Row ids ``[lo, hi)`` the ring holds (``(0, 0)`` before the first write)."""
        if self._buffer is None:
            return 0, 0
        lo, hi = self._buffer.window()
        return int(lo[0]), int(hi[0])

    def _slots(self, index: Any) -> np.ndarray:
        """``index`` as int64 slots (negative ones counted from `len`), checked to hold rows."""
        size = len(self)
        slots = _as_slots(index, size)
        slots = np.where(slots < 0, slots + size, slots)
        if slots.size and (slots.min() < 0 or slots.max() >= size):
            raise IndexError(f"slot index out of range: ZarrStorage at {self.url!r} holds {size} rows")
        return slots

    def _row_ids(self, slots: np.ndarray) -> np.ndarray:
        """The buffer's row id held by each slot (see the module docstring)."""
        lo = self._window()[0]
        return np.asarray(lo + (slots + self._offset - lo) % self.max_size, dtype=np.int64)

    def _writable(self, rows: Mapping[str, np.ndarray]) -> ReplayBuffer:
        """The buffer, created now (fields from ``rows``) if this is the first write."""
        if self._buffer is None:
            fields = {name: Field(tuple(array.shape[1:]), array.dtype.name) for name, array in rows.items()}
            options = {"episode_end": None, **self._create_options}
            self._buffer = ReplayBuffer.create(self.url, fields, self.max_size, overwrite=self._overwrite, **options)
            self._offset = 0
        return self._buffer


def collate(batch: Any) -> Any:
    """The ``collate_fn`` of a TorchRL replay buffer over a `ZarrStorage` (its default, see
    `ZarrStorage.attach`): the batch as the storage returned it (a TensorDict already), as for
    TorchRL's own tensor storages."""
    return batch


def tensordict_rows(data: Any, single: bool) -> dict[str, np.ndarray]:
    """``{field name: array [n, *shape]}`` of a TensorDict's leaves (``single``: one row, batch
    size ``[]``), without the writer's ``"index"``; arrays share the tensors' memory on CPU.

    Raises:
        TypeError: ``data`` is not a TensorDict, or a leaf is not a tensor.
        ValueError: a key that cannot be a field name (see `key_to_name`), or no leaves.
    """
    if not is_tensor_collection(data):
        raise TypeError(f"ZarrStorage stores TensorDicts, got {type(data).__name__}")
    rows = {}
    for key, value in data.items(include_nested=True, leaves_only=True):
        if key == WRITER_INDEX:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"ZarrStorage stores tensors; {key!r} is a {type(value).__name__}")
        array = value.detach().cpu().numpy()
        rows[key_to_name(key)] = array[None] if single else array
    if not rows:
        raise ValueError("ZarrStorage got a TensorDict without tensors to store")
    return rows


def _open_existing(url: str, max_size: int) -> ReplayBuffer | None:
    """The buffer at ``url`` opened for writing, or None if there is none.

    Raises ValueError for a buffer that is not a one-lane ring of ``max_size`` rows."""
    try:
        buf = ReplayBuffer.open(url, "r+")
    except NotABufferError:
        return None
    if buf.capacity != max_size or buf.num_envs != 1:
        buf.close()
        raise ValueError(f"the buffer at {url!r} is a ring of {buf.capacity} rows over {buf.num_envs} lane(s); "
                         f"ZarrStorage(max_size={max_size}) needs one lane of {max_size} rows")
    return buf


def _is_int(index: Any) -> bool:
    """Whether ``index`` names one slot (a Python / numpy int or a 0-d integer tensor)."""
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if isinstance(index, torch.Tensor):
        return index.ndim == 0
    return isinstance(index, (int, np.integer)) and not isinstance(index, bool)


def _as_slots(index: Any, size: int) -> np.ndarray:
    """Slots as an int64 array of ``index``'s shape (a slice: over ``range(size)``).

    Raises IndexError for an index that is not integral (bool masks included)."""
    if isinstance(index, tuple) and len(index) == 1:  # one index per storage dim, as samplers give it
        index = index[0]
    if isinstance(index, slice):
        return np.arange(size)[index]
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    slots = np.asarray(index)
    if slots.size and slots.dtype.kind not in "iu":
        raise IndexError(f"ZarrStorage indexes slots by integers, got {slots.dtype} {index!r}")
    return slots.astype(np.int64)
