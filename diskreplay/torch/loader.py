"""`Loader`: a dataset's batches from DataLoader workers, several batches per hand-over.

Torch's DataLoader passes one item per batch from a worker to the main process: an index message
and a result message, about 0.2-0.4 ms of Python and IPC on a busy 2-core machine, more than a
worker takes to gather a small batch. A `Loader`'s workers instead yield `Block`s of up to
``dataset.block_batches`` consecutive batches (gathered in one read into one shared-memory slot,
see `diskreplay.torch.shared_ring`), and the `Loader` cuts each into its batches in the main
process: the DataLoader's per-item cost is paid once per block.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.utils.data as tud

from ..checks import check_int
from .datasets import BlockPlan, EpochDataset, SampleDataset
from .epoch_order import check_earlier_order
from .formats import to_tensordict
from .handoff import PassChannel
from .tensors import Block


class Loader:
    """Iterate a `make_dataset` dataset like ``DataLoader(dataset, batch_size=None,
    num_workers=...)``, with workers that hand over several batches at once.

    Sample mode: the batches and their order are those ``iter(dataset)`` yields in one process,
    for any ``num_workers`` (block m, of ``min(2**m, block_batches)`` batches from where the pass
    starts, is worker ``m % num_workers``'s), and a position is one int. Epoch mode: each worker
    reads its shard of the epoch (as with a DataLoader), in blocks taken from the workers in turn;
    each ``iter(loader)`` is one epoch (the next one after a full pass; `set_epoch` to choose).
    ``num_workers=0`` iterates the dataset in this process.

    Resume: `state_dict` after any batch; `load_state_dict` continues with the batch after it.
    Sample mode with any ``num_workers``. Epoch mode with any ``num_workers`` and any
    ``world_size`` too: a state saved on one rank is loaded on every rank (ranks are taken to
    advance in lockstep), and on another layout the rows the saved run had not reached are split
    over the new ranks and workers, each row of the epoch once over the whole run
    (`diskreplay.torch.datasets.EpochDataset`).

    Workers: fork workers start with the first pass and persist (``persistent_workers``), keeping
    their open store and cache; each later pass is posted to them, and they are reseeded and run
    ``worker_init_fn`` again as new workers would be. `close` stops them. Other start methods,
    and a pass begun while another one iterates the workers, start workers for that pass.

    Args:
        dataset: from `make_dataset` (its own position and epoch are where the loader starts).
        num_workers: DataLoader worker processes (0: none).
        prefetch_factor: blocks each worker keeps ready (DataLoader's ``prefetch_factor``).
        timeout: passed to the DataLoader.
        worker_init_fn: passed to the DataLoader.
        multiprocessing_context: passed to the DataLoader. Fork workers hand blocks over in the
            dataset's shared-memory slots; others send tensors.

    Raises:
        TypeError: ``dataset`` is not a `SampleDataset` or `EpochDataset`.
        ValueError: ``num_workers`` or ``prefetch_factor`` not an int in range.
    """

    def __init__(self, dataset: SampleDataset | EpochDataset, num_workers: int = 0, *, prefetch_factor: int = 2,
                 timeout: float = 0.0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None):
        if not isinstance(dataset, (SampleDataset, EpochDataset)):
            raise TypeError(f"dataset: expected a SampleDataset or EpochDataset (make_dataset), "
                            f"got {type(dataset).__name__}")
        self.dataset, self.num_workers = dataset, check_int(num_workers, "num_workers", 0)
        self._options = {"prefetch_factor": check_int(prefetch_factor, "prefetch_factor", 1), "timeout": timeout,
                         "worker_init_fn": worker_init_fn, "multiprocessing_context": multiprocessing_context}
        state = dataset.state_dict()
        if state["num_workers"] != 1 and (isinstance(dataset, SampleDataset) or state["batch"]):
            raise ValueError(f"the dataset holds the position of worker {state['worker']} of {state['num_workers']}: "
                             f"load a rank-global state into it first (dataset_state_from_loader / "
                             f"merge_worker_states), or the Loader's own state")
        self._start = _pass_start(state)  # the dataset state of the pass: epoch, rows
        self._pool: tud.DataLoader | None = None  # persistent fork workers, made by the first pass
        self._channel = PassChannel()
        self._pool_busy = False  # a pass is iterating the pool
        self._positions = [0] * max(self.num_workers, 1)  # next batch: rank-global (sample), per shard (epoch)
        self._next_shard = 0  # epoch mode: the shard the next batch comes from
        if isinstance(dataset, SampleDataset):
            self._positions[0] = int(state["batch"])
        elif state["done"]:  # an epoch finished in one process: the next one
            self._start.update(epoch=int(state["epoch"]) + 1, history=[])
        elif state["batch"] and max(self.num_workers, 1) == 1 and state["world_size"] == dataset.world_size:
            self._positions = [int(state["batch"])]
        elif state["batch"]:  # stopped inside an epoch in one process, continued on another layout
            self._start = _pass_start(_moved(state, [int(state["batch"])], dataset.world_size))

    def __repr__(self) -> str:
        return f"Loader({self.dataset!r}, num_workers={self.num_workers})"

    def __len__(self) -> int:
        """Batches per epoch (epoch mode). Raises TypeError in sample mode (endless)."""
        if not isinstance(self.dataset, EpochDataset):
            raise TypeError("a sample-mode Loader is endless: it has no len()")
        return self.dataset.batches_per_epoch(self.num_workers)

    def __iter__(self) -> Iterator[Any]:
        """The batches (dicts of tensors, or TensorDicts for an ``as_tensordict`` dataset)."""
        ds = self.dataset
        ds.load_state_dict({**self._start, "batch": self._positions[0]})  # epoch mode with workers: the plan has them
        if isinstance(ds, SampleDataset):
            return self._unblocked(BlockPlan(ds.block_batches)) if self.num_workers else self._in_process()
        return self._epoch(BlockPlan(ds.block_batches, tuple(self._positions), self._next_shard))

    def set_epoch(self, epoch: int, refresh: bool = False) -> None:
        """Start epoch ``epoch`` at its first batch with the next ``iter(loader)`` (epoch mode);
        ``refresh``: first adopt the rows committed now (`EpochDataset.set_epoch`)."""
        if not isinstance(self.dataset, EpochDataset):
            raise TypeError("set_epoch: a sample-mode Loader has no epochs")
        self.dataset.set_epoch(epoch, refresh)
        self._start = _pass_start(self.dataset.state_dict())
        self._positions, self._next_shard = [0] * len(self._positions), 0

    # ---- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the next batch comes from: ``{"dataset": a rank-global dataset state}``, and in
        epoch mode ``"num_workers"``, ``"positions"`` (each worker shard's next batch of the
        epoch) and ``"next_shard"``. Plain ints, lists and strings."""
        if isinstance(self.dataset, SampleDataset):
            return {"dataset": {**self._start, "batch": self._positions[0]}}
        return {"dataset": dict(self._start), "num_workers": self.num_workers, "positions": list(self._positions),
                "next_shard": self._next_shard}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue after the batch ``state`` was taken at (from `state_dict`).

        An epoch stopped inside on another ``world_size`` or ``num_workers`` continues with the
        rows that run had not reached (its run joins the dataset state's ``history``).

        Raises:
            ValueError: a state of another mode or seed (or, in sample mode, world size), a
                malformed one, or one whose positions its layout cannot have reached.
        """
        dataset_state = state.get("dataset") if isinstance(state, Mapping) else None
        if not isinstance(dataset_state, Mapping) or dataset_state.get("num_workers") != 1:
            raise ValueError(f"Loader state: expected a mapping whose 'dataset' is a rank-global dataset state "
                             f"(num_workers 1), got {state!r:.300}")
        positions = None if isinstance(self.dataset, SampleDataset) else self._checked_positions(state)
        if positions is not None and "partitions" not in dataset_state:
            check_earlier_order(dataset_state, positions[0])
        moved = dataset_state.get("world_size") != self.dataset.world_size
        if positions is not None and any(positions[0]) and (moved or len(positions[0]) != len(self._positions)):
            dataset_state = _moved(dataset_state, positions[0], self.dataset.world_size)
            positions = [0] * len(self._positions), 0
        before = self.dataset.state_dict()
        self.dataset.load_state_dict(dataset_state)
        try:
            len(self) if positions is not None else None  # the rows the history left: ValueError if it cannot be
        except ValueError:
            self.dataset.load_state_dict(before)
            raise
        loaded = self.dataset.state_dict()
        self._start = _pass_start(loaded)
        if positions is None:
            self._positions[0] = int(loaded["batch"])
        else:
            self._positions, self._next_shard = positions

    def _checked_positions(self, state: Mapping[str, Any]) -> tuple[list[int], int]:
        """The epoch positions and next shard of a Loader state, checked. Raises ValueError."""
        positions, next_shard, workers = state.get("positions"), state.get("next_shard"), state.get("num_workers")
        if not (isinstance(positions, list) and all(type(p) is int and p >= 0 for p in positions)
                and type(workers) is int and len(positions) == max(workers, 1)
                and type(next_shard) is int and 0 <= next_shard < len(positions)):
            raise ValueError(f"Loader state: expected 'num_workers' (int), 'positions' (an int >= 0 per worker) "
                             f"and 'next_shard' (an int below their count), got {dict(state)!r:.300}")
        if not any(positions):
            return [0] * len(self._positions), 0
        return list(positions), next_shard

    def _worker_seeds(self) -> torch.Generator:
        """The generator the DataLoader draws its workers' torch seeds from: one of its own,
        seeded by the dataset's seed and the position, so that iterating never moves torch's
        global generator (a training loop that saves it with `state_dict` resumes it exactly,
        though a resumed run starts one iterator more) and resumed workers get the seeds
        uninterrupted ones would."""
        start = self._start
        entropy = [int(start.get("seed") or 0), int(start.get("epoch", 0)), *self._positions, self._next_shard]
        return torch.Generator().manual_seed(int(np.random.SeedSequence(entropy).generate_state(1)[0]))

    # ---- iteration --------------------------------------------------------------------------

    def _epoch(self, plan: BlockPlan) -> Iterator[Any]:
        yield from self._unblocked(plan) if self.num_workers else self._in_process()
        self._start.update(epoch=self._start["epoch"] + 1, history=[])
        self._positions, self._next_shard = [0] * len(self._positions), 0

    def _in_process(self) -> Iterator[Any]:
        for batch in self.dataset:
            self._positions[0] += 1
            yield batch

    def close(self) -> None:
        """Shut the worker processes down now (else when the Loader is garbage-collected); a
        later pass starts new ones."""
        self._pool = None

    def _unblocked(self, plan: BlockPlan) -> Iterator[Any]:
        """The batches of the blocks the workers yield, in turn; each taken batch moves the
        position of its shard."""
        tensordict = self.dataset.as_tensordict
        pooled = self._posted(plan)
        loader = self._pool if pooled else tud.DataLoader(
            self.dataset.blocked(plan), batch_size=None, num_workers=self.num_workers,
            generator=self._worker_seeds(), **self._options)
        assert loader is not None
        self._pool_busy |= pooled
        try:
            block: Block
            for block in loader:
                batches = block.batches()
                for left, batch in zip(range(len(batches) - 1, -1, -1), batches):
                    self._positions[block.shard] = block.end - left
                    self._next_shard = block.shard if left else (block.shard + 1) % len(self._positions)
                    yield to_tensordict(batch) if tensordict else batch
        finally:
            self._pool_busy &= not pooled

    def _posted(self, plan: BlockPlan) -> bool:
        """Whether this pass runs on the persistent workers (made now if need be), its position,
        plan and seed posted for them: with fork workers, unless another pass iterates them or
        the pass does not fit the channel."""
        if self._pool_busy or _start_method(self._options["multiprocessing_context"]) != "fork":
            return False
        seeds = self._worker_seeds()
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=seeds).item())  # as torch draws it
        if not self._channel.post(({**self._start, "batch": self._positions[0]}, plan, base_seed)):
            return False
        if self._pool is None:
            self._pool = tud.DataLoader(
                self.dataset.relayed(self._channel, self._options["worker_init_fn"]), batch_size=None,
                num_workers=self.num_workers, persistent_workers=True, generator=self._worker_seeds(),
                **self._options)
        return True


def _start_method(context: Any) -> str:
    """The start method of a DataLoader's ``multiprocessing_context`` (None: the default one)."""
    if context is None:  # without fixing the default, as get_start_method() would
        return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    return context if isinstance(context, str) else str(context.get_start_method())


def _moved(state: Mapping[str, Any], positions: list[int], world_size: int) -> dict[str, Any]:
    """A rank-global epoch state continuing on ``world_size`` ranks at the start of a new run:
    the run that reached ``positions`` (a batch per worker) joins its history."""
    run = {"world_size": int(state["world_size"]), "num_workers": len(positions), "positions": list(positions)}
    return {**state, "batch": 0, "done": False, "world_size": world_size,
            "history": [*state.get("history", []), run]}


def _pass_start(state: Mapping[str, Any]) -> dict[str, Any]:
    """A dataset state at the start of a pass in one process: the pass's epoch and rows."""
    start = {**state, "batch": 0, "worker": 0, "num_workers": 1}
    if "done" in start:
        start["done"] = False
    return start
