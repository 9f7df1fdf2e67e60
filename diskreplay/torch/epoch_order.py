"""The order in which one epoch reads a buffer: pure functions of (seed, epoch, rows at epoch
start, shard), so a position in an epoch is resumed from a few integers.

Rows are cut into chunk-aligned *pieces* (runs of steps stored in one chunk). Ranks and DataLoader
workers each take a contiguous range of the (shuffled) piece sequence, so a reader touches whole
chunks, and each reads its chunks once per epoch with block shuffling.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..format.lanes import LaneLayout

SHUFFLES = ("none", "block", "global")
_EPOCH_TAG, _WINDOW_TAG, _GLOBAL_TAG = 0, 1, 2


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


class EpochOrder:
    """The rows one shard reads in one epoch, in order, built window by window (lazily).

    ``shuffle="block"``: chunk-aligned pieces are permuted (one permutation per epoch, shared by all
    shards), the sequence is cut into shards, and each shard permutes its rows within windows of
    ``window`` consecutive pieces, so a shard reads each of its chunks once (given a cache of at
    least ``2 * window`` chunks). ``"global"``: one permutation of all rows (every shard touches
    every chunk). ``"none"``: lane/time order.
    """

    def __init__(self, layout: LaneLayout, lo: np.ndarray, hi: np.ndarray, *, seed: int, epoch: int,
                 shuffle: str, window: int, shard: Shard, pad: bool, drop_last: bool, batch_size: int):
        self.layout, self.seed, self.epoch, self.shard = layout, seed, epoch, shard
        self.window, self.batch_size, self.shuffle = window, batch_size, shuffle
        lane, start, length = chunk_pieces(layout, lo, hi)
        if shuffle != "none" and len(lane):
            perm = np.random.default_rng([seed, epoch, _EPOCH_TAG]).permutation(len(lane))
            lane, start, length = lane[perm], start[perm], length[perm]
        self.total = int(length.sum())
        a, b = shard_range(self.total, shard, pad, drop_last)
        self.rows = b - a
        self.num_batches = self.rows // batch_size if drop_last else -(-self.rows // batch_size)
        self.used_rows = min(self.rows, self.num_batches * batch_size)
        self._global: tuple[np.ndarray, np.ndarray] | None
        if shuffle == "global":
            self._global = self._global_rows(lane, start, length, a, b)
        else:
            self._global = None
            self.pieces = slice_pieces(lane, start, length, a, b)

    def _global_rows(self, lane: np.ndarray, start: np.ndarray, length: np.ndarray, a: int, b: int
                     ) -> tuple[np.ndarray, np.ndarray]:
        """This shard's rows of one permutation of all rows (8 bytes per row of the whole epoch
        while it is built, 16 per row of the shard after)."""
        if not self.total:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        perm = np.random.default_rng([self.seed, self.epoch, _GLOBAL_TAG]).permutation(self.total)
        take = perm[np.arange(a, b) % self.total]
        del perm
        ends = np.cumsum(length)
        piece = np.searchsorted(ends, take, side="right")
        return lane[piece], start[piece] + take - (ends[piece] - length[piece])

    def _window_rows(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        lane, start, length = (p[k * self.window:(k + 1) * self.window] for p in self.pieces)
        rows = expand_pieces(lane, start, length)
        if self.shuffle == "none":
            return rows
        s = self.shard
        perm = np.random.default_rng([self.seed, self.epoch, _WINDOW_TAG, s.rank, s.world_size,
                                      s.worker, s.num_workers, k]).permutation(len(rows[0]))
        return rows[0][perm], rows[1][perm]

    def _rows_from(self, first_row: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(lane, step) arrays covering rows ``[first_row, used_rows)`` of this shard's order."""
        end = self.used_rows
        if self._global is not None:
            yield self._global[0][first_row:end], self._global[1][first_row:end]
            return
        sizes = np.add.reduceat(self.pieces[2], np.arange(0, len(self.pieces[2]), self.window)) \
            if len(self.pieces[2]) else np.zeros(0, np.int64)
        stops = np.cumsum(sizes)
        for k in range(int(np.searchsorted(stops, first_row, side="right")), len(sizes)):
            w0 = int(stops[k] - sizes[k])
            if w0 >= end:
                return
            lane, step = self._window_rows(k)
            yield lane[max(first_row - w0, 0):end - w0], step[max(first_row - w0, 0):end - w0]

    def batches(self, first: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(lane, step) of batches ``first, first + 1, ...`` (the last one may be short)."""
        B = self.batch_size
        carry_l, carry_s = np.zeros(0, np.int64), np.zeros(0, np.int64)
        for lane, step in self._rows_from(first * B):
            if len(carry_l):
                lane, step = np.concatenate([carry_l, lane]), np.concatenate([carry_s, step])
            full = len(lane) // B
            for i in range(full):
                yield lane[i * B:(i + 1) * B], step[i * B:(i + 1) * B]
            carry_l, carry_s = lane[full * B:], step[full * B:]
        if len(carry_l):
            yield carry_l, carry_s
