"""The order in which one epoch reads a buffer: pure functions of (seed, epoch, rows at epoch
start, canonical partitions), so a position in an epoch is resumed from a few integers, on the
same or on another number of ranks and DataLoader workers.

Rows are cut into chunk-aligned *pieces* (runs of steps stored in one chunk), the pieces are
shuffled and the rows within windows of consecutive pieces (`EpochRows`): one sequence of the
epoch's rows that depends on no world size. The sequence is cut into `PARTITIONS` canonical
partitions; ranks take runs of whole partitions (`rank_selection`) and DataLoader workers split
their rank's rows (`Span`), so a reader touches whole chunks and reads each once per epoch. A run
stopped inside an epoch leaves the rows its readers had not reached (`remaining_rows`); a resumed
run splits those the same way over its own ranks and workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..format.lanes import LaneLayout
from ..io.threads import Threads

SHUFFLES = ("none", "block", "global")
PARTITIONS = 2**10 * 3**2 * 5 * 7 * 11 * 13
"""Canonical partitions of an epoch by default (46,126,080): a multiple of every world size up to
16, of every power of two up to 1024 and of most products of small primes, so ranks get equal
rows (+-1) and an epoch resumes exactly on any of them. Partitions may hold no row."""
ANNOUNCED_ROWS = 2**16
"""Rows an epoch hands its read-ahead at a time, in whole batches (`EpochOrder.batches`'s
``per_item``): one item per small batch would cost the announcement its own per-batch overhead."""
_EPOCH_TAG, _WINDOW_TAG, _GLOBAL_TAG = 0, 1, 2
_PERMUTING = Threads(1, "diskreplay-epoch-order")
_ONE_SHARD = (0, 1, 0, 1)  # the seeds of one reader's windows before canonical partitions: the same order


@dataclass(frozen=True)
class Shard:
    """One reader's slice: DataLoader worker ``worker`` of ``num_workers`` on rank ``rank``."""

    rank: int
    world_size: int
    worker: int = 0
    num_workers: int = 1

    def as_dict(self) -> dict[str, int]:
        """``{"rank", "world_size", "worker", "num_workers"}`` as plain ints."""
        return {"rank": self.rank, "world_size": self.world_size, "worker": self.worker,
                "num_workers": self.num_workers}



def chunk_pieces(layout: LaneLayout, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, ...]:
    """Split every lane's window ``[lo, hi)`` at chunk (and ring) boundaries.

    Returns ``(lane, start, length)`` int64 arrays, lane by lane in time order: each piece is a run
    of steps stored in one chunk.
    """
    lanes, starts, lengths = [], [], []
    cr, cap = layout.chunk_rows, layout.lane_capacity
    for lane, (a, b) in enumerate(zip(np.asarray(lo).tolist(), np.asarray(hi).tolist())):
        if b <= a:
            continue
        if cap is None:
            marks = np.arange((a // cr + 1) * cr, b, cr, dtype=np.int64)
        else:
            periods = np.arange(a // cap, (b - 1) // cap + 1, dtype=np.int64)
            marks = (periods[:, None] * cap + np.arange(0, cap, cr)[None, :]).reshape(-1)
            marks = marks[(marks > a) & (marks < b)]
        first = np.concatenate([[a], marks]).astype(np.int64)
        lanes.append(np.full(len(first), lane, np.int64))
        starts.append(first)
        lengths.append(np.diff(np.concatenate([first, [b]])))
    if not lanes:
        return tuple(np.zeros(0, np.int64) for _ in range(3))
    return np.concatenate(lanes), np.concatenate(starts), np.concatenate(lengths)


def expand_pieces(lane: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (lane, step) of the pieces, in piece order."""
    total = int(length.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
    return np.repeat(lane, length), np.repeat(start, length) + offsets


def slice_pieces(lane: np.ndarray, start: np.ndarray, length: np.ndarray, a: int, b: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces covering rows ``[a, b)`` of the pieces' concatenation, repeated cyclically past its end
    (padding)."""
    total = int(length.sum())
    out: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    ends = np.cumsum(length)
    while a < b and total:
        base = (a // total) * total
        lo_row, hi_row = a - base, min(b - base, total)
        first = int(np.searchsorted(ends, lo_row, side="right"))
        last = int(np.searchsorted(ends, hi_row, side="left"))
        piece_lane = lane[first:last + 1].copy()
        piece_start, piece_length = start[first:last + 1].copy(), length[first:last + 1].copy()
        cut_front = lo_row - (ends[first] - length[first])
        piece_start[0] += cut_front
        piece_length[0] -= cut_front
        piece_length[-1] -= ends[last] - hi_row
        out.append((piece_lane, piece_start, piece_length))
        a = base + hi_row
    if not out:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    lanes, starts, lengths = zip(*out)
    return np.concatenate(lanes), np.concatenate(starts), np.concatenate(lengths)


def shard_range(total: int, shard: Shard, pad: bool, drop_last: bool) -> tuple[int, int]:
    """Rows ``[a, b)`` of the epoch sequence that one shard reads.

    Ranks split the sequence like ``DistributedSampler``: ``pad`` repeats its first rows so every
    rank gets ``ceil(total / world_size)``; ``drop_last`` cuts it to ``floor(total / world_size)``
    each; neither gives ranks ``total // world_size`` or one more, every row exactly once. Each
    rank's range is then split evenly (+-1 row) over its workers.
    """
    world = shard.world_size
    if pad:
        per = -(-total // world)
        r0, r1 = shard.rank * per, (shard.rank + 1) * per
    elif drop_last:
        per = total // world
        r0, r1 = shard.rank * per, (shard.rank + 1) * per
    else:
        r0, r1 = shard.rank * total // world, (shard.rank + 1) * total // world
    n = r1 - r0
    w, nw = shard.worker, shard.num_workers
    return r0 + w * n // nw, r0 + (w + 1) * n // nw




def rank_selection(n: int, rank: int, world: int, partitions: int) -> tuple[int, int, int]:
    """``(first, stride, count)``: the rows ``first + stride * i`` (``i < count``) of a run's
    sequence of ``n`` rows that rank ``rank`` of ``world`` takes.

    Canonical partition p holds rows ``[p * n // P, (p + 1) * n // P)``. With ``world <= P`` a rank
    takes partitions ``[rank * P // world, (rank + 1) * P // world)``, a contiguous run of rows; with
    more ranks than partitions, the ranks of partition ``rank * P // world`` take every k-th of its
    rows in turn (k: how many share it).
    """
    if world <= partitions:
        a, b = rank * partitions // world * n // partitions, (rank + 1) * partitions // world * n // partitions
        return a, 1, b - a
    p = rank * partitions // world
    first_rank = -(-p * world // partitions)
    sharing = -(-(p + 1) * world // partitions) - first_rank
    a, b = p * n // partitions, (p + 1) * n // partitions
    first = a + rank - first_rank
    return first, sharing, max(0, -(-(b - first) // sharing))


def rank_sizes(n: int, world: int, partitions: int) -> list[int]:
    """Rows each rank takes of a sequence of ``n`` rows."""
    return [rank_selection(n, r, world, partitions)[2] for r in range(world)]


@dataclass(frozen=True)
class Span:
    """The rows of a run's sequence one reader (rank and worker) takes: rows ``[lo, hi)`` of its
    rank's list, whose row i is sequence row ``first + stride * (i % count)``.

    A rank's list is its `rank_selection`; ``pad`` repeats its first rows cyclically up to the
    largest rank's count (a rank without rows repeats the sequence's first rows), ``drop_last``
    cuts it to the smallest; its workers split it evenly (+-1 row).
    """

    first: int
    stride: int
    count: int
    lo: int
    hi: int

    @classmethod
    def of(cls, n: int, shard: Shard, partitions: int, pad: bool, drop_last: bool,
           sizes: Sequence[int] | None = None) -> Span:
        """The span of ``shard`` in a sequence of ``n`` rows (``sizes``: `rank_sizes`, if known)."""
        first, stride, count = rank_selection(n, shard.rank, shard.world_size, partitions)
        size = count
        if pad or drop_last:
            sizes = rank_sizes(n, shard.world_size, partitions) if sizes is None else sizes
            size = max(sizes) if pad else min(sizes)
        if count == 0 and size:
            first, stride, count = 0, 1, n
        w, nw = shard.worker, shard.num_workers
        return cls(first, stride, count, w * size // nw, (w + 1) * size // nw)

    @property
    def rows(self) -> int:
        return self.hi - self.lo

    def indexes(self, a: int, b: int) -> np.ndarray:
        """Sequence rows of this reader's rows ``[a, b)``."""
        i = np.arange(self.lo + a, self.lo + b, dtype=np.int64)
        if self.count:
            i %= self.count
        return self.first + self.stride * i


def count_batches(rows: int, batch_size: int, drop_last: bool) -> int:
    """Batches of ``rows`` rows (``drop_last``: full ones only)."""
    return rows // batch_size if drop_last else -(-rows // batch_size)


def remaining_rows(total: int, history: Sequence[Mapping[str, Any]], partitions: int, pad: bool,
                   drop_last: bool, batch_size: int) -> np.ndarray | None:
    """The positions in the epoch sequence (of ``total`` rows) of the rows that the runs in
    ``history`` left unread, in sequence order (None: all of them, no history).

    Each run is ``{"world_size", "num_workers", "positions"}``: every rank read its workers'
    first ``positions[w]`` batches (ranks advance in lockstep; a rank with fewer batches finished).

    Raises:
        ValueError: a position past the batches of that worker on every rank.
    """
    if not history:
        return None
    key = (total, repr(history), partitions, pad, drop_last, batch_size)
    if key not in _REMAINING:
        _REMAINING.clear()  # the last one only: a dataset asks again for every shard and every pass
        _REMAINING[key] = _replayed(total, history, partitions, pad, drop_last, batch_size)
    return _REMAINING[key]


_REMAINING: dict[tuple[Any, ...], np.ndarray | None] = {}


def _replayed(total: int, history: Sequence[Mapping[str, Any]], partitions: int, pad: bool, drop_last: bool,
              batch_size: int) -> np.ndarray | None:
    rest: np.ndarray | None = None
    for run in history:
        n = total if rest is None else len(rest)
        world, workers = int(run["world_size"]), int(run["num_workers"])
        sizes, taken = rank_sizes(n, world, partitions), np.zeros(n, bool)
        for w, batch in enumerate(run["positions"]):
            spans = [Span.of(n, Shard(r, world, w, workers), partitions, pad, drop_last, sizes) for r in range(world)]
            counts = [count_batches(s.rows, batch_size, drop_last) for s in spans]
            if batch > max(counts):
                raise ValueError(f"a run on world_size={world} with num_workers={workers} says worker {w} "
                                 f"read {batch} batches; it has at most {max(counts)} on any rank")
            for span, count in zip(spans, counts):
                taken[span.indexes(0, min(min(batch, count) * batch_size, span.rows))] = True
        kept = np.flatnonzero(~taken)
        rest = kept if rest is None else rest[kept]
    return rest


def checked_history(state: Mapping[str, Any], partitions: int) -> list[dict[str, Any]]:
    """The runs of an epoch-mode state's ``history``, checked, for a dataset of ``partitions``
    canonical partitions. Raises ValueError: a malformed history, or a state of other partitions."""
    if "partitions" not in state:  # saved before canonical partitions: one reader's order is the same
        check_earlier_order(state, [int(state.get("batch", 0))] if not state.get("done") else [0])
    saved = state.get("partitions", partitions)
    if saved != partitions:
        raise ValueError(f"state was saved with {saved} canonical partitions, this dataset has {partitions}: "
                         f"make it with canonical_partitions={saved}")
    history, runs = state.get("history", []), []
    for run in history if isinstance(history, list) else [{}]:
        ok = isinstance(run, Mapping) and all(type(run.get(k)) is int and run[k] >= 1
                                              for k in ("world_size", "num_workers"))
        positions = run.get("positions") if ok else None
        if not (isinstance(positions, list) and len(positions) == run["num_workers"]
                and all(type(p) is int and p >= 0 for p in positions)):
            raise ValueError(f"epoch state 'history': expected a list of {{'world_size': int >= 1, 'num_workers': "
                             f"int >= 1, 'positions': an int >= 0 per worker}}, got {history!r:.300}")
        runs.append({"world_size": run["world_size"], "num_workers": run["num_workers"], "positions": list(positions)})
    return runs


def check_earlier_order(state: Mapping[str, Any], positions: Sequence[int]) -> None:
    """Raise ValueError if ``state``, saved before canonical partitions (no ``"partitions"``), is
    inside an epoch (a worker's ``positions``) on several ranks or workers: their order differed."""
    world, workers = int(state.get("world_size", 1)), max(int(state.get("num_workers", 1)), len(positions))
    if any(positions) and world * workers > 1:
        raise ValueError(f"the state was saved inside epoch {state.get('epoch')} on world_size={world}, "
                         f"num_workers={workers} by a diskreplay without canonical partitions, whose order "
                         f"on more than one rank or worker differs from this one's: resume at an epoch boundary")


class EpochRows:
    """The rows of one epoch in sequence order, a pure function of (seed, epoch, rows).

    ``shuffle="block"``: chunk-aligned pieces are permuted (one permutation per epoch), and the rows
    within each window of ``window`` consecutive pieces are permuted, so a reader of a contiguous run
    of the sequence reads each of its chunks once (given a cache of at least ``2 * window``
    chunks). ``"global"``: one permutation of all rows (every reader touches every chunk; 8 bytes
    per row of the epoch). ``"none"``: lane/time order.
    """

    def __init__(self, layout: LaneLayout, lo: np.ndarray, hi: np.ndarray, *, seed: int, epoch: int,
                 shuffle: str, window: int):
        lane, start, length = chunk_pieces(layout, lo, hi)
        if shuffle != "none" and len(lane):
            perm = np.random.default_rng([seed, epoch, _EPOCH_TAG]).permutation(len(lane))
            lane, start, length = lane[perm], start[perm], length[perm]
        self.seed, self.epoch, self.shuffle, self.window = seed, epoch, shuffle, window
        self._pieces, self._ends = (lane, start, length), np.cumsum(length)
        self.total = int(length.sum())
        self._perm = None
        if shuffle == "global" and self.total:
            self._perm = np.random.default_rng([seed, epoch, _GLOBAL_TAG]).permutation(self.total)
        self._window_ends = np.cumsum(np.add.reduceat(length, np.arange(0, len(length), window))) \
            if len(length) else np.zeros(0, np.int64)
        self._windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # the 4 read last (two iterators at once)
        self._ahead: dict[int, Future[tuple[np.ndarray, np.ndarray]]] = {}  # the next window, being computed

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(lane, step) of the rows at ``positions`` of the sequence."""
        if self._perm is not None:
            return self._piece_rows(self._perm[positions])
        if self.shuffle != "block":
            return self._piece_rows(positions)
        which = np.searchsorted(self._window_ends, positions, side="right")
        lane, step = np.empty(len(positions), np.int64), np.empty(len(positions), np.int64)
        for k in np.unique(which).tolist():
            here = which == k
            window_lane, window_step = self._window_rows(k)
            offsets = positions[here] - (self._window_ends[k] - len(window_lane))
            lane[here], step[here] = window_lane[offsets], window_step[offsets]
        return lane, step

    def run_rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(lane, step) of the rows at positions ``[a, b)``: slices of the windows they cross."""
        if self.shuffle == "none":
            return self._run_piece_rows(a, b)
        if self.shuffle != "block":
            return self.rows(np.arange(a, b, dtype=np.int64))
        lanes, steps = [], []
        while a < b:
            k = int(np.searchsorted(self._window_ends, a, side="right"))
            lane, step = self._window_rows(k)
            start, end = int(self._window_ends[k]) - len(lane), min(b, int(self._window_ends[k]))
            lanes.append(lane[a - start:end - start])
            steps.append(step[a - start:end - start])
            a = end
        if len(lanes) == 1:
            return lanes[0], steps[0]
        return (np.concatenate(lanes), np.concatenate(steps)) if lanes else (np.zeros(0, np.int64),) * 2

    def window_needs(self, a: int, b: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """For each window the positions ``[a, b)`` cross, in order: (lane, step) of rows that need
        the same chunks as the rows of the window they hold (block or no shuffle; a piece lies in
        one chunk): a whole window's pieces by their first rows, a part of one by its rows."""
        lane, start, _ = self._pieces
        while a < b:
            k = int(np.searchsorted(self._window_ends, a, side="right"))
            begin, end = int(self._window_ends[k - 1]) if k else 0, int(self._window_ends[k])
            if a == begin and b >= end:
                yield lane[k * self.window:(k + 1) * self.window], start[k * self.window:(k + 1) * self.window]
            else:
                yield self.run_rows(a, min(b, end))
            a = min(b, end)

    def _piece_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lane, start, length = self._pieces
        piece = np.searchsorted(self._ends, positions, side="right")
        return lane[piece], start[piece] + positions - (self._ends[piece] - length[piece])

    def _run_piece_rows(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """`_piece_rows` of the positions ``[a, b)``, from the few pieces they cross."""
        lane, start, length = self._pieces
        first, last = np.searchsorted(self._ends, [a, max(b - 1, a)], side="right").tolist()
        if first == last and b > a:  # inside one piece: one lane, consecutive steps
            shift = int(start[first] - self._ends[first] + length[first])
            return np.full(b - a, lane[first], np.int64), np.arange(a + shift, b + shift, dtype=np.int64)
        pieces = slice(first, last + 1)
        begin = self._ends[pieces] - length[pieces]
        counts = np.minimum(b, self._ends[pieces]) - np.maximum(a, begin)
        positions = np.arange(a, b, dtype=np.int64)
        return np.repeat(lane[pieces], counts), positions + np.repeat(start[pieces] - begin, counts)

    def _window_rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Window k's rows in their order; window k + 1's are computed meanwhile on a thread (a
        window of 16 chunks of 32,768 rows takes about 15 ms, much of it outside the GIL)."""
        rows = self._windows.pop(k, None)
        if rows is None:
            ahead = self._ahead.pop(k, None)
            rows = ahead.result() if ahead is not None else self._permuted(k)
        self._windows[k] = rows
        if len(self._windows) > 4:
            del self._windows[next(iter(self._windows))]
        if k + 1 < len(self._window_ends) and k + 1 not in self._windows and k + 1 not in self._ahead:
            self._ahead = {k + 1: _PERMUTING.submit(self._permuted, k + 1)}
        return rows

    def _permuted(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        lane, start, length = (p[k * self.window:(k + 1) * self.window] for p in self._pieces)
        lanes, steps = expand_pieces(lane, start, length)
        perm = np.random.default_rng([self.seed, self.epoch, _WINDOW_TAG, *_ONE_SHARD, k]).permutation(len(lanes))
        return lanes[perm], steps[perm]


class EpochOrder:
    """The rows one shard (rank and worker) reads in one epoch, in order: its `Span` of the rows
    of the epoch sequence (`EpochRows`) that earlier runs left (``remaining``, None: all).

    Lazy: the sequence is built when the first batch is asked for, and batches one by one.
    """

    def __init__(self, layout: LaneLayout, lo: np.ndarray, hi: np.ndarray, *, seed: int, epoch: int,
                 shuffle: str, window: int, shard: Shard, pad: bool, drop_last: bool, batch_size: int,
                 partitions: int = PARTITIONS, remaining: np.ndarray | None = None):
        self.shard, self.batch_size, self.remaining = shard, batch_size, remaining
        self.total = int(np.maximum(np.asarray(hi) - np.asarray(lo), 0).sum())
        n = self.total if remaining is None else len(remaining)
        self.span = Span.of(n, shard, partitions, pad, drop_last)
        self.rows = self.span.rows
        self.num_batches = count_batches(self.rows, batch_size, drop_last)
        self.used_rows = min(self.rows, self.num_batches * batch_size)
        self._make = (layout, lo, hi, seed, epoch, shuffle, window)
        self._sequence: EpochRows | None = None

    def positions(self, a: int, b: int) -> np.ndarray:
        """Positions in the epoch sequence of this shard's rows ``[a, b)``."""
        i = self.span.indexes(a, b)
        return i if self.remaining is None else self.remaining[i]

    def batches(self, first: int = 0, per_item: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(lane, step) of batches ``first, first + 1, ...`` (the last one may be short);
        ``per_item`` > 1: the rows of that many batches at a time."""
        sequence, size = self._rows(), self.batch_size
        for k in range(first, self.num_batches, per_item):
            a, b = k * size, min((k + per_item) * size, self.used_rows)
            if self._run:
                yield sequence.run_rows(self.span.first + self.span.lo + a, self.span.first + self.span.lo + b)
            else:
                yield sequence.rows(self.positions(a, b))

    def announced(self, first: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """What a read-ahead is told of batches ``first, first + 1, ...``: (lane, step) of rows
        needing their chunks, in order of need: a window at a time where the shard's rows are a
        run of the sequence (the rows of a whole window as its pieces: no permutation to compute),
        else `ANNOUNCED_ROWS` rows at a time."""
        sequence = self._rows()
        if not self._run or sequence.shuffle == "global":
            yield from self.batches(first, max(1, ANNOUNCED_ROWS // self.batch_size))
            return
        offset = self.span.first + self.span.lo
        yield from sequence.window_needs(offset + min(first * self.batch_size, self.used_rows),
                                         offset + self.used_rows)

    @property
    def _run(self) -> bool:
        """Whether this shard's rows are contiguous positions of the sequence."""
        return self.remaining is None and self.span.stride == 1 and self.span.hi <= self.span.count

    def _rows(self) -> EpochRows:
        if self._sequence is None:
            layout, lo, hi, seed, epoch, shuffle, window = self._make
            self._sequence = EpochRows(layout, lo, hi, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
        return self._sequence
