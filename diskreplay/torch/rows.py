"""Prioritized sampling with workers: `IndexBatchSampler` draws row ids in the main process,
`RowDataset` gathers their rows in the workers."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch.utils.data as tud

from ..buffer import ReplayBuffer
from ..checks import check_int
from ..errors import EmptyBufferError
from ..format.lanes import is_empty, row_ids, split_row_ids
from .formats import tensordict_class, to_tensordict
from .reader import Reader, committed_window
from .tensors import emit_tensors


class IndexBatch(NamedTuple):
    """What `IndexBatchSampler` yields: row ids ``[B]`` int64, importance weights ``[B]`` or None,
    and any extra per-row arrays of the sampler."""

    # The public field ``index`` shadows ``tuple.index`` on purpose (``batch.index``); mypy rejects
    # any NamedTuple field that overrides a tuple method.
    index: np.ndarray  # type: ignore[assignment]
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
        check_int(batch_size, "batch_size", 1)
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
    returns ``{field: [B, *shape], "index": [B] int64 (+ "weight": [B])}`` tensors
    (``as_tensordict``: a TensorDict of them, laid out by `to_tensordict`; give the DataLoader
    ``collate_fn=keep_batch``).

    Pickles to URL + options; each worker opens the buffer read-only. Rows newer than the
    worker's view trigger a refresh; rows still missing (never committed) or overwritten since
    they were drawn raise IndexError.
    """

    def __init__(self, buf: ReplayBuffer | str | os.PathLike, *, storage_options: dict | None = None,
                 cache_bytes: int | None = None, io_threads: int | None = None, refresh_seconds: float | None = 1.0,
                 as_tensordict: bool = False):
        """Raises ImportError: ``as_tensordict`` without the tensordict package."""
        if as_tensordict:
            tensordict_class("RowDataset(as_tensordict=True)")
        self.as_tensordict = as_tensordict
        at_commit = None
        if isinstance(buf, ReplayBuffer):
            url, options = buf.url, storage_options if storage_options is not None else buf.storage_options
            at_commit = buf.at_commit
        else:
            url, options = os.fspath(buf), storage_options
        self.reader = Reader(url, options, cache_bytes, io_threads, "uniform", at_commit)
        self.refresh_seconds = refresh_seconds
        self._last_refresh = 0.0

    def __getitem__(self, item: IndexBatch | np.ndarray | Sequence[int]) -> Any:
        """The rows of an `IndexBatch` (or of row ids): ``{field: [B, *shape], "index": [B]}``
        tensors, and ``"weight"`` when the batch has weights (``as_tensordict``: a TensorDict)."""
        batch = item if isinstance(item, IndexBatch) else IndexBatch(np.asarray(item, dtype=np.int64))
        ids = np.asarray(batch.index, dtype=np.int64)
        buf = self.reader.get()
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
        tensors = emit_tensors(rows)
        return to_tensordict(tensors) if self.as_tensordict else tensors

    def _maybe_refresh(self, buf: ReplayBuffer, ids: np.ndarray) -> None:
        now = time.monotonic()
        lo, hi = buf.window()
        lane, step = split_row_ids(ids, buf.num_envs)
        due = self.refresh_seconds is not None and now - self._last_refresh >= self.refresh_seconds
        if due or (len(ids) and (step >= hi[lane]).any()):
            buf.refresh()
            self._last_refresh = now

