"""The iterable datasets `make_dataset` builds: endless sampled batches (`SampleDataset`) and
every committed row once per epoch (`EpochDataset`), each sharded over ranks and workers."""

from __future__ import annotations

import copy
import functools
import itertools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data as tud

from ..buffer import ReplayBuffer
from ..buffer.batches import BATCH_EXTRAS, TRANSFORMS, split_batches
from ..errors import EmptyBufferError
from ..format.lanes import LaneLayout, row_ids
from ..sampling import Uniform
from ..storage import READ_AHEAD_BYTES as CHUNKS_AHEAD_BYTES
from .batch_rng import BatchRngs, StridedRngs
from .epoch_order import PARTITIONS, EpochOrder, Shard, checked_history, remaining_rows
from .formats import Key
from .handoff import PassChannel, WorkerUse, reseed_worker
from .read_sizes import batches_per_read
from .reader import Reader, current_shard
from .shared_ring import WorkerRing
from .tensors import Block, Sink, TensorDictSink, by_name, ragged_as, sink_for, to_tensors


@dataclass(frozen=True)
class BlockPlan:
    """How the DataLoader workers of a `diskreplay.torch.loader.Loader` hand batches over: as
    `Block`s of up to ``size`` consecutive batches. Epoch mode: worker i serves shard ``(i +
    first) % num_workers`` from batch ``starts[shard]`` of the epoch (``starts`` empty: 0), and a
    block ends at each multiple of ``size``, so a shard resumed inside a block first finishes it."""

    size: int
    starts: tuple[int, ...] = ()
    first: int = 0


def ramped_blocks(first: int, size: int, worker: int, num_workers: int) -> Iterator[tuple[int, int]]:
    """``(first batch, batches)`` of worker ``worker``'s blocks of a sample-mode stream from batch
    ``first``: block m is worker ``m % num_workers``'s and holds ``min(2**m, size)`` batches, so a
    pass's first batch waits for one batch's read, not for a block of ``size`` (from a cold store
    that block reads nearly every chunk)."""
    b, m = first, 0
    while True:
        count = min(1 << min(m, size.bit_length()), size)
        if m % num_workers == worker:
            yield b, count
        b, m = b + count, m + 1


class _BufferDataset(tud.IterableDataset):
    """What sample and epoch mode share: the reader, the shard, plain-data state, the batch format
    (``as_tensordict``: TensorDicts laid out by `to_tensordict` instead of dicts of tensors)."""

    mode = ""

    def __init__(self, reader: Reader, layout: LaneLayout, batch_size: int, seed: int, rank: int,
                 world_size: int, ring: WorkerRing | None = None, as_tensordict: bool = False,
                 block_batches: int = 1, ragged: str = "nested"):
        self.reader = reader
        self.ragged = ragged
        """How ragged fields come: ``"nested"`` (jagged nested tensors) or ``"packed"`` (`pack_ragged`)."""
        self.layout = layout
        self.batch_size = batch_size
        self.seed = seed
        self.rank, self.world_size = rank, world_size
        self._shard = Shard(rank, world_size)  # shard of the saved/current position
        self._batch = 0
        self._ring = ring
        self.as_tensordict = as_tensordict
        self.block_batches = block_batches
        """Batches a `Loader`'s worker hands over at once (`read_sizes.batches_per_block`)."""
        self._blocks: BlockPlan | None = None
        self._relay: tuple[PassChannel, Callable[[int], None] | None] | None = None  # persistent workers' passes
        self._passes = 0  # passes this copy began in this process (a persistent worker's)
        self._workers: WorkerUse | None = WorkerUse()  # None in copies: workers' and a Loader's

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (spawn/forkserver workers, copies): without the worker ring (fork-only) and
        the worker-use flag (a pickle for a spawned process sets it)."""
        if self._workers is not None:
            self._workers.mark_if_spawning()
        return {**self.__dict__, "_ring": None, "_workers": None, "_relay": None}

    @property
    def worker_ring(self) -> WorkerRing | None:
        """The shared-memory slots fork workers hand batches over in (None: not used); see
        `diskreplay.torch.shared_ring`. ``worker_ring.stats()`` counts hand-overs and fallbacks."""
        return self._ring

    @property
    def url(self) -> str:
        """The URL of the buffer the dataset reads."""
        return self.reader.url

    def io_stats(self) -> dict[str, int]:
        """Chunk fetches by this process's reader since it opened (and the decoded bytes)."""
        if not self.reader.opened:
            return {"chunk_fetches": 0, "bytes_decoded": 0}
        n = self.reader.chunk_fetches
        return {"chunk_fetches": n, "bytes_decoded": n * self.reader.chunk_bytes()}

    def iter_into(self, destination: Callable[[], Mapping[Key, np.ndarray] | None]) -> Iterator[Any]:
        """Iterate in this process, gathering each batch into the arrays ``destination()``
        returns just before it (``[>= B, *shape]`` per name, or per TensorDict key for an
        ``as_tensordict`` dataset; None: new arrays): how `to_device` fills its pinned host slots
        without a copy. Yields what `__iter__` yields, its tensors sharing those arrays' memory."""
        return self._iterate(self._formatted(Sink(functools.partial(by_name, destination), to_tensors)))

    def __iter__(self) -> Iterator[Any]:
        """Batches as dicts of tensors ``{name: [B, *shape]}`` (``as_tensordict``: TensorDicts of
        batch size ``[B]``, see `to_tensordict`); in a fork DataLoader worker, `SlotBatch` handles
        that become such batches when the DataLoader's process receives them."""
        if self._workers is not None and tud.get_worker_info() is not None:
            self._workers.mark()
        if self._relay is not None and tud.get_worker_info() is not None:
            self._take_pass(*self._relay)
        if tud.get_worker_info() is not None:  # torch makes the iterator before it starts the other
            self.reader.get()  # workers and sends the first index: open the store meanwhile
        sink = sink_for(self._ring)
        return ragged_as(self.ragged, self._iterate(sink if self._worker_blocks() else self._formatted(sink)))

    def blocked(self, plan: BlockPlan) -> Any:
        """A copy whose DataLoader workers yield `Block`s as ``plan`` says (what a `Loader`
        iterates; in this process the copy yields batches as this dataset does)."""
        twin = copy.copy(self)  # a copy pickles: without the ring, which the copy shares
        twin._ring, twin._blocks = self._ring, plan
        return twin

    def relayed(self, channel: PassChannel, worker_init_fn: Callable[[int], None] | None) -> Any:
        """A copy for the persistent fork workers of a `Loader`: each time a worker starts iterating
        it, it takes the pass last posted in ``channel`` (a rank-global dataset state, a
        `BlockPlan`, a base seed) and, from its second pass on, is seeded as a new worker would
        be (``worker_init_fn`` runs again)."""
        twin = self.blocked(BlockPlan(self.block_batches))
        twin._relay = (channel, worker_init_fn)
        return twin

    def _take_pass(self, channel: PassChannel, worker_init_fn: Callable[[int], None] | None) -> None:
        state, plan, base_seed = channel.read()
        if self._passes:  # as a new worker would: its seeds, and the newest commit
            reseed_worker(base_seed, worker_init_fn)
            if self.reader.opened:
                self.reader.get().refresh()
        self._passes += 1
        self.load_state_dict(state)
        self._blocks = plan

    def _worker_blocks(self) -> BlockPlan | None:
        """The block plan, if this copy runs in a DataLoader worker and has one."""
        return self._blocks if self._blocks is not None and tud.get_worker_info() is not None else None

    def _formatted(self, sink: Sink) -> Sink:
        return TensorDictSink(sink) if self.as_tensordict else sink

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (each mode defines it)."""
        raise NotImplementedError

    def _iterate(self, sink: Sink) -> Iterator[Any]:
        """This copy's batches, each gathered as ``sink`` says and yielded as ``sink.emit`` makes it
        (each mode defines it)."""
        raise NotImplementedError

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

    def _check_position_moves(self) -> None:
        """Raise RuntimeError when DataLoader workers iterate copies of this dataset (this copy's
        position then never moves)."""
        if self._workers and tud.get_worker_info() is None:
            raise RuntimeError(
                f"{type(self).__name__}.state_dict(): this dataset is iterated by DataLoader worker processes, "
                f"each on its own copy; the copy in this process never moves, so its state would say batch "
                f"{self._batch} forever and a resume would replay every batch since. Take the position from "
                f"the loader: iterate with diskreplay.torch.Loader(ds, num_workers=...) (dr.Loader) and save "
                f"loader.state_dict(), or with torchdata's StatefulDataLoader(ds, batch_size=None, "
                f"num_workers=...) and save its state_dict()")

    def _check_state(self, state: Mapping[str, Any]) -> None:
        if state.get("mode") != self.mode:
            raise ValueError(f"state is for a {state.get('mode')!r}-mode dataset, this one is {self.mode!r}")
        if int(state["seed"]) != self.seed:
            raise ValueError(f"state was saved with seed {state['seed']}, this dataset has seed {self.seed}")


class SampleDataset(_BufferDataset):
    """Endless sampled batches: ``{field: [B, *shape], "index": [B] int64 (+ "weight")}`` tensors
    (``as_tensordict``: a TensorDict of them, batch size ``[B]``, keys as `to_tensordict` makes them).

    Batch ``b`` of rank ``r`` draws from ``numpy.random.default_rng([seed, r, b])``, and worker ``w``
    of ``W`` produces batches ``b = w, w + W, ...``; the DataLoader interleaves workers round-robin,
    so the stream is the same for any ``num_workers`` (given the same buffer contents), ranks get
    independent streams, and a position is one int. Resuming *across a change of num_workers* is
    supported: convert a StatefulDataLoader state with `dataset_state_from_loader` (or save from
    ``num_workers=0``) and load it into the dataset before building the new loader.

    Small batches going to new tensors are drawn one by one and gathered several at a time
    (`batches_per_read`; one by one with options only ``sample`` takes): the same batches, for
    less per batch.

    Live buffers: each reader adopts new commits every ``refresh_every`` batches and/or every
    ``refresh_seconds``, checked between reads (window changes make the stream timing-dependent).
    Stateful samplers (``WithoutReplacement``) keep independent state per worker; prioritized
    samplers use the priorities of the last commit: for live priorities use `IndexBatchSampler`.
    """

    mode = "sample"

    def __init__(self, reader: Reader, layout: LaneLayout, batch_size: int, seed: int, rank: int,
                 world_size: int, refresh_every: int | None, refresh_seconds: float | None,
                 sample_options: dict[str, Any] | None = None, ring: WorkerRing | None = None,
                 as_tensordict: bool = False, block_batches: int = 1, ragged: str = "nested"):
        super().__init__(reader, layout, batch_size, seed, rank, world_size, ring, as_tensordict, block_batches, ragged)
        self.refresh_every = refresh_every
        self.refresh_seconds = refresh_seconds
        self.sample_options = dict(sample_options or {})

    def __repr__(self) -> str:
        return (f"SampleDataset({self.url!r}, batch_size={self.batch_size}, batch={self._batch}, seed={self.seed}, "
                f"rank={self.rank}/{self.world_size}, sample_options={self.sample_options})")

    def state_dict(self) -> dict[str, Any]:
        """``{"mode", "seed", "batch": next batch index of this copy, shard}``: plain ints.

        Raises RuntimeError when DataLoader workers iterate this dataset (see `Loader`)."""
        self._check_position_moves()
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

    def _iterate(self, sink: Sink) -> Iterator[Any]:
        shard = current_shard(self.rank, self.world_size)
        blocks = self._worker_blocks()
        if blocks is not None:  # the position is rank-global: a Loader loaded it
            return self._generate_blocks(shard, self._batch, blocks.size, sink)
        try:
            start = self._start(shard)
        except ValueError as exc:
            return _raising(exc)  # raised on first next(): a worker then reports it cleanly
        self._shard, self._batch = shard, start
        return self._generate(shard, start, sink)

    def _generate(self, shard: Shard, b: int, sink: Sink) -> Iterator[Any]:
        """Batches ``b, b + W, ...`` (W: the shard's workers), drawn up to `_reads_ahead` at a time;
        what varies per batch is the generator, the destination arrays and the refresh clock, the
        rest is decided here. A refresh falls between reads, never inside one."""
        buf = self.reader.get()
        into, emit, stride = self._destination(buf, sink), sink.emit, shard.num_workers
        read = functools.partial(_read, buf, self.batch_size, BatchRngs(self.seed, self.rank, stride), stride,
                                 self.sample_options)
        ahead = 1 if into is not None else self._reads_ahead(buf)
        clock = _RefreshClock(buf, self.refresh_every, self.refresh_seconds)
        pending: list[dict[str, np.ndarray]] = []
        try:
            while True:
                if not pending:
                    clock.since += 1
                    clock.before_read()
                    count = ahead if clock.every is None else min(ahead, clock.every - clock.since)
                    pending = clock.read(read, b, count, None if into is None else into())
                    clock.since += count - 1
                b += stride
                self._batch = b
                yield emit(pending.pop())
        finally:
            sink.close()

    def _generate_blocks(self, shard: Shard, first: int, size: int, sink: Sink) -> Iterator[Block]:
        """`Block`s of consecutive batches from ``first`` (`ramped_blocks`: block m is worker ``m %
        num_workers``'s, of up to ``size`` batches): taken from the workers in turn, the batches one
        process yields (each drawn with its own generator; blocks of one batch with options only
        ``sample`` takes). Refreshes are checked before each block."""
        buf = self.reader.get()
        size = size if self._reads_ahead(buf) > 1 else 1
        read = functools.partial(_read, buf, self.batch_size, BatchRngs(self.seed, self.rank, 1), 1,
                                 self.sample_options)
        names, clock = _out_names(buf), _RefreshClock(buf, self.refresh_every, self.refresh_seconds)
        try:
            for b, count in ramped_blocks(first, size, shard.worker, shard.num_workers):
                clock.before_read()
                batches = clock.read(read, b, count, None)[::-1]
                clock.since += count
                rows = _joined(batches, _out(names, sink.destination(), count * self.batch_size))
                self._batch = b + count
                yield Block(sink.emit(rows), [self.batch_size] * count, 0, b + count)
        finally:
            sink.close()

    def _reads_ahead(self, buf: ReplayBuffer) -> int:
        """Batches drawn and gathered in one read (`ReplayBuffer.sample_batches`) when they are
        gathered into new arrays: `batches_per_read`, or 1 with sample options that only
        ``sample`` takes (trajectories, n-step, stacks, HER)."""
        return batches_per_read(self.batch_size, buf) if TRANSFORMS.isdisjoint(self.sample_options) else 1

    def _destination(self, buf: ReplayBuffer, sink: Sink) -> Callable[[], dict[str, np.ndarray] | None] | None:
        """What gives each batch's ``out`` arrays (`_out` of ``sink.destination()``), or None
        when batches are never gathered into given arrays: a sink that gives none, or sample
        options that transform batches (``out`` is for plain transitions only)."""
        transformed = any(self.sample_options.get(k) is not None for k in ("seq_len", "n_step", "stack", "her"))
        if transformed or not sink.gathers:
            return None
        names, size, destination = _out_names(buf), self.batch_size, sink.destination
        return lambda: _out(names, destination(), size)


class EpochDataset(_BufferDataset):
    """Every committed row once per epoch (see `make_dataset` for the options), as batches
    ``{field: [<=B, *shape], "index": [<=B] int64}`` of tensors (``as_tensordict``: a TensorDict
    of them, batch size ``[<=B]``, keys as `to_tensordict` makes them).

    Small batches going to new tensors are gathered several at a time (`batches_per_read`), within
    the rows of a shuffle window.

    Rows of an epoch are the window saved in the state (taken at `make_dataset` or `set_epoch(...,
    refresh=True)`); their order is a pure function of (seed, epoch, those rows, the number of
    canonical partitions), and ranks and workers split it (`diskreplay.torch.epoch_order`). They
    must stay readable for the epoch (a ring must not overwrite them).

    Epochs advance by themselves when the same dataset object iterates again (``num_workers=0``,
    or ``persistent_workers=True``); non-persistent workers restart from the main process's copy,
    so call ``ds.set_epoch(e)`` before each epoch then (like ``DistributedSampler``).

    Resume: exact anywhere. A rank-global state (this dataset iterated in one process, or a
    `Loader`'s) saved on one rank is loaded on every rank, on the same or another ``world_size``
    and ``num_workers``: ranks are taken to advance in lockstep (a rank with fewer batches has
    finished), and the rows the saved run had not reached are split over the new ranks and workers
    (the state then lists the earlier runs in ``"history"``). A single DataLoader worker's state
    resumes with the same ``world_size`` and ``num_workers`` only.
    """

    mode = "epoch"

    def __init__(self, reader: Reader, layout: LaneLayout, batch_size: int, seed: int, rank: int,
                 world_size: int, lo: np.ndarray, hi: np.ndarray, shuffle: str, shuffle_window: int,
                 pad: bool, drop_last: bool, ring: WorkerRing | None = None, as_tensordict: bool = False,
                 block_batches: int = 1, partitions: int = PARTITIONS, ragged: str = "nested"):
        super().__init__(reader, layout, batch_size, seed, rank, world_size, ring, as_tensordict, block_batches, ragged)
        self.lo, self.hi = [int(x) for x in lo], [int(x) for x in hi]
        self.shuffle, self.shuffle_window = shuffle, shuffle_window
        self.pad, self.drop_last = pad, drop_last
        self.partitions = partitions
        """Canonical partitions of the epoch order (`epoch_order.PARTITIONS` by default)."""
        self._history: list[dict[str, Any]] = []  # earlier runs of this epoch on other layouts
        self._epoch = 0
        self._done = False  # this copy produced every batch of its shard's epoch
        self._resuming = False  # loaded inside a worker: keep a finished epoch finished once
        self.read_ahead_bytes = CHUNKS_AHEAD_BYTES
        """Decoded bytes of chunks fetched ahead of the batches, not yet read (at most half the cache;
        with block shuffle at least two shuffle windows' chunks: a window's reads need all of its
        chunks at once, and the window after next is fetched while one is read)."""

    @property
    def epoch(self) -> int:
        """The epoch the next iteration yields (advances after each full pass)."""
        return self._epoch

    def order(self, epoch: int, shard: Shard) -> EpochOrder:
        """The row order of ``epoch`` for one shard (rank and worker): a pure function of the seed,
        of the rows and of the runs of this epoch on other layouts (the state's history)."""
        lo, hi = np.asarray(self.lo, np.int64), np.asarray(self.hi, np.int64)
        return EpochOrder(self.layout, lo, hi, seed=self.seed, epoch=epoch, shuffle=self.shuffle,
                          window=self.shuffle_window, shard=shard, pad=self.pad, drop_last=self.drop_last,
                          batch_size=self.batch_size, partitions=self.partitions,
                          remaining=remaining_rows(int((hi - lo).clip(0).sum()), self._history, self.partitions,
                                                   self.pad, self.drop_last, self.batch_size))

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
            buf = ReplayBuffer.open(self.url, "r", storage_options=self.reader.storage_options,
                                    sampler=Uniform(), at_commit=self.reader.at_commit)
            lo, hi = buf.window()
            buf.close()
            self.lo, self.hi = [int(x) for x in lo], [int(x) for x in hi]
        self._epoch, self._batch, self._done, self._history = int(epoch), 0, False, []
        self._shard, self._resuming = Shard(self.rank, self.world_size), False

    def state_dict(self) -> dict[str, Any]:
        """``{"mode", "seed", "epoch", "batch", "done", "lo", "hi", "partitions", "history",
        shard}``: plain ints/lists (``history``: this epoch's earlier runs on other layouts, each
        ``{"world_size", "num_workers", "positions"}``; empty unless resumed on another layout).

        Raises RuntimeError when DataLoader workers iterate this dataset (see `Loader`)."""
        self._check_position_moves()
        return {"mode": self.mode, "seed": self.seed, "epoch": self._epoch, "batch": self._batch,
                "done": self._done, "lo": list(self.lo), "hi": list(self.hi), "partitions": self.partitions,
                "history": [dict(run, positions=list(run["positions"])) for run in self._history],
                **self._shard.as_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``. Inside a worker (StatefulDataLoader) a finished shard stays
        finished for the rest of that epoch; in the main process a finished state means "next epoch".

        Raises:
            ValueError: another mode, seed or number of canonical partitions, a malformed history;
                a single worker's mid-epoch state used with another world size or number of workers
                (raised when iteration starts).
        """
        self._check_state(state)
        self._history = checked_history(state, self.partitions)
        self.lo, self.hi = [int(x) for x in state["lo"]], [int(x) for x in state["hi"]]
        self._epoch, self._batch, self._done = int(state["epoch"]), int(state["batch"]), bool(state["done"])
        self._shard = Shard(self.rank, int(state["world_size"]), int(state["worker"]), int(state["num_workers"]))
        in_worker = tud.get_worker_info() is not None
        self._resuming = in_worker
        if self._done and not in_worker and self._shard.num_workers == 1:
            self._next_epoch()

    def _next_epoch(self) -> None:
        self._epoch, self._batch, self._done, self._history = self._epoch + 1, 0, False, []

    def _adopt(self, shard: Shard) -> None:
        """Continue the saved position as ``shard``: on another layout, a rank-global position
        becomes a run of the history and ``shard`` reads what it left. Raises ValueError for a
        single worker's position inside an epoch."""
        saved = self._shard
        same = (saved.world_size, saved.worker, saved.num_workers) == (
            shard.world_size, shard.worker, shard.num_workers)
        if not same and self._batch > 0 and not self._done:
            if saved.num_workers != 1:
                raise ValueError(f"epoch {self._epoch} was stopped inside by worker {saved.worker} of "
                                 f"{saved.num_workers} (world_size={saved.world_size}); one worker's position resumes "
                                 f"only with the same settings (now world_size={shard.world_size}, num_workers="
                                 f"{shard.num_workers}): save a rank's position (a dr.Loader's state) to change them")
            self._history.append({"world_size": saved.world_size, "num_workers": 1, "positions": [self._batch]})
            self._batch = 0
        if self._done and not self._resuming:
            self._next_epoch()
        self._shard, self._resuming = shard, False

    def _iterate(self, sink: Sink) -> Iterator[Any]:
        shard = current_shard(self.rank, self.world_size)
        blocks = self._worker_blocks()
        if blocks is not None:  # a Loader's worker: its shard and position come from the plan
            shard = Shard(shard.rank, shard.world_size, (shard.worker + blocks.first) % shard.num_workers,
                          shard.num_workers)
            first = blocks.starts[shard.worker] if blocks.starts else 0
            return self._generate(self.order(self._epoch, shard), first, sink, blocks.size)
        try:
            self._adopt(shard)
        except ValueError as exc:
            return _raising(exc)  # raised on first next(): a worker then reports it cleanly
        order = self.order(self._epoch, shard)
        if self._batch >= order.num_batches:
            self._done = True
        return self._generate(order, self._batch, sink)

    def _generate(self, order: EpochOrder, first: int, sink: Sink, block: int = 0) -> Iterator[Any]:
        """Batches ``first, first + 1, ...`` of ``order``, read ``batches_per_read`` at a time when
        they go to new arrays; ``block`` > 0: as `Block`s ending at multiples of ``block``."""
        if first >= order.num_batches:
            return
        buf = self.reader.get()
        names, last, batches = _out_names(buf), order.num_batches, order.batches(first)
        # a read within a shuffle window's rows needs the chunks of two windows at most: the cache holds them
        window_rows = self.shuffle_window * buf.layout.chunk_rows
        ahead = block or (1 if sink.gathers else batches_per_read(self.batch_size, buf, window_rows))
        k = first
        window_bytes = window_rows * buf.storage.schema.row_bytes  # a block-shuffled read needs its whole window
        budget = max(self.read_ahead_bytes, 2 * window_bytes) if self.shuffle == "block" else self.read_ahead_bytes
        buf.storage.read_ahead(order.announced(first), budget)
        try:
            while group := list(itertools.islice(batches, ahead - k % ahead if block else ahead)):
                lane, step = group[0] if len(group) == 1 else (np.concatenate(parts) for parts in zip(*group))
                rows = self._gather(buf, names, lane, step, sink.destination() if ahead == 1 or block else None)
                if block:
                    k += len(group)
                    self._batch, self._done = k, k == last
                    yield Block(sink.emit(rows), [len(s) for _, s in group], order.shard.worker, k)
                    continue
                for batch in split_batches(rows, [len(s) for _, s in group]):
                    k += 1
                    self._batch, self._done = k, k == last
                    yield sink.emit(batch)
        finally:
            buf.storage.read_ahead(None)
            sink.close()


def _read(buf: ReplayBuffer, size: int, rngs: BatchRngs, stride: int, options: Mapping[str, Any], b: int,
          count: int, out: dict[str, np.ndarray] | None) -> list[dict[str, np.ndarray]]:
    """Batches ``b, b + stride, ...`` (``count`` of them), each drawn with its generator, in one
    read, last first; one batch is gathered into ``out`` if given."""
    if count == 1:
        return [buf.sample(size, rng=rngs(b), out=out, **options)]
    generators = StridedRngs(rngs, b, stride, count)
    return buf.sample_batches(size, count, rngs=generators, **options)[::-1]


def _joined(batches: Sequence[Mapping[str, np.ndarray]], into: Mapping[str, np.ndarray] | None
            ) -> dict[str, np.ndarray]:
    """The batches' rows one after another, in ``into``'s arrays where one has the name, dtype and
    row shape (its first rows), else in new arrays."""
    rows = sum(len(next(iter(batch.values()))) for batch in batches)
    out = {}
    for name, first in batches[0].items():
        parts = [batch[name] for batch in batches]
        given = None if into is None else into.get(name)
        if given is not None and given.dtype == first.dtype and given.shape[1:] == first.shape[1:] \
                and len(given) >= rows:
            out[name] = np.concatenate(parts, out=given[:rows])
        else:
            out[name] = np.concatenate(parts)
    return out


class _RefreshClock:
    """When a sample-mode copy adopts new commits: before a read, once ``every`` batches were read
    since the last refresh or ``seconds`` passed (None: never by that rule); and when a read finds
    nothing committed (when this reader opened or last refreshed)."""

    def __init__(self, buf: ReplayBuffer, every: int | None, seconds: float | None):
        self.buf, self.every, self.seconds = buf, every, seconds
        self.since, self._last = 0, time.monotonic()

    def before_read(self) -> None:
        """Refresh if one is due."""
        if (self.every is not None and self.since >= self.every) or (
                self.seconds is not None and time.monotonic() - self._last >= self.seconds):
            self.refresh()

    def refresh(self) -> None:
        self.buf.refresh()
        self.since, self._last = 0, time.monotonic()

    def read(self, read: Callable[..., list[dict[str, np.ndarray]]], *args: Any) -> list[dict[str, np.ndarray]]:
        """``read(*args)``, once more after a refresh if it finds nothing committed."""
        try:
            return read(*args)
        except EmptyBufferError:
            self.refresh()
            return read(*args)


def _out_names(buf: ReplayBuffer) -> frozenset[str]:
    """The names a batch of ``buf`` can be gathered into (its fields and the batch extras)."""
    return frozenset(buf.fields) | frozenset(BATCH_EXTRAS)


def _out(names: frozenset[str], into: dict[str, np.ndarray] | None, rows: int) -> dict[str, np.ndarray] | None:
    """The first ``rows`` of the destination arrays (of ``names``) a batch can be gathered into."""
    if into is None:
        return None
    return {k: v[:rows] for k, v in into.items() if k in names}



def _raising(exc: Exception) -> Iterator[Any]:
    raise exc
    yield  # a generator: raises on first next()
