"""Tests of diskreplay.torch.data: sharding, exact resume, determinism, pickling, workers, live
buffers and the main-process index sampler. Buffers are small (a few thousand rows, 64-row chunks)
and caches a few MB, so the whole file runs in well under a minute on two cores."""

from __future__ import annotations

import copy
import itertools
import os
import pickle
import select
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as tmp_mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import diskreplay as dr
from diskreplay.format.lanes import LaneLayout, row_ids
from diskreplay.torch import datasets, read_sizes
from diskreplay.torch.batch_rng import BatchRngs, StridedRngs
from diskreplay.torch.data import dataset_state_from_loader, make_dataset, merge_worker_states
from diskreplay.torch.epoch_order import EpochOrder, EpochRows, Shard, chunk_pieces, shard_range
from diskreplay.torch.rows import IndexBatch, IndexBatchSampler, RowDataset
from diskreplay.torch.tensors import Batch

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64")}
CACHE = 4 * 2**20
CHUNK = 64


def fill(buf: dr.ReplayBuffer, steps: int, start: int = 0) -> None:
    """Add ``steps`` steps to every lane; ``act`` is the row id, ``obs`` derived from it."""
    n = buf.num_envs
    ids = (np.arange(start, start + steps)[:, None] * n + np.arange(n)[None, :]).astype(np.int64)
    obs = np.stack([ids, -ids, ids % 7], axis=-1).astype(np.float32)
    if n == 1:
        ids, obs = ids[:, 0], obs[:, 0]
    buf.extend({"obs": obs, "act": ids})
    buf.flush(durable=False)


def make_buf(path, steps: int = 1000, num_envs: int = 2, capacity: int | None = None, **kw) -> dr.ReplayBuffer:
    buf = dr.ReplayBuffer.create(os.fspath(path), FIELDS, capacity, num_envs=num_envs, chunk_rows=CHUNK,
                                 compression=kw.pop("compression", None), cache_bytes=CACHE, **kw)
    fill(buf, steps)
    return buf


def check_rows(batch: dict) -> None:
    idx = batch["index"].numpy()
    np.testing.assert_array_equal(batch["act"].numpy(), idx)
    np.testing.assert_array_equal(batch["obs"].numpy()[:, 1], -idx.astype(np.float32))


def indices(batches) -> list[np.ndarray]:
    return [b["index"].numpy().copy() for b in batches]


def concat(batches) -> np.ndarray:
    return np.concatenate(indices(batches)) if batches else np.zeros(0, np.int64)


@pytest.fixture
def buf(tmp_path):
    b = make_buf(tmp_path / "buf", steps=1000)  # 2000 rows, 2 lanes x 16 chunks (last one partial)
    yield b
    b.close()


def epoch_ds(buf, **kw):
    kw.setdefault("batch_size", 50)
    return make_dataset(buf, mode="epoch", seed=kw.pop("seed", 3), cache_bytes=CACHE, **kw)


def sample_ds(buf, **kw):
    kw.setdefault("batch_size", 32)
    return make_dataset(buf, mode="sample", seed=kw.pop("seed", 5), cache_bytes=CACHE, **kw)


# ---- epoch order --------------------------------------------------------------------------


@pytest.mark.parametrize("capacity,steps", [(None, 1000), (2 * 300, 1000)])
def test_chunk_pieces_cover_window_within_chunks(tmp_path, capacity, steps):
    b = make_buf(tmp_path / "b", steps=steps, capacity=capacity)
    lo, hi = b.storage.window()
    lane, start, length = chunk_pieces(b.storage.layout, lo, hi)
    layout = b.storage.layout
    for _e, s, n in zip(lane, start, length):
        chunks = {int(c) for c in layout.chunk_and_offset(np.arange(s, s + n))[0]}
        assert len(chunks) == 1 and n >= 1
    got = np.sort(row_ids(np.repeat(lane, length),
                                   np.concatenate([np.arange(s, s + n) for s, n in zip(start, length)]), 2))
    np.testing.assert_array_equal(got, np.sort(b.row_ids()))
    b.close()


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.sampled_from([None, 24, 40]), st.integers(1, 9), st.data())
def test_runs_of_the_sequence_are_its_rows_position_by_position(num_envs, capacity, chunk_rows, data):
    """`run_rows` (slices of pieces and windows) against `rows` of each position, for every
    shuffle; and batches handed over several at a time are the same rows as one by one."""
    layout = LaneLayout(num_envs, capacity, chunk_rows)
    lo = np.array(data.draw(st.lists(st.integers(0, 30), min_size=num_envs, max_size=num_envs)), np.int64)
    sizes = data.draw(st.lists(st.integers(0, capacity or 60), min_size=num_envs, max_size=num_envs))
    hi = lo + np.array(sizes, np.int64)
    shuffle = data.draw(st.sampled_from(["none", "block", "global"]))
    rows = EpochRows(layout, lo, hi, seed=3, epoch=1, shuffle=shuffle, window=2)
    total = int((hi - lo).sum())
    a = data.draw(st.integers(0, total))
    b = data.draw(st.integers(a, total))
    lane, step = rows.run_rows(a, b)
    want_lane, want_step = rows.rows(np.arange(a, b, dtype=np.int64))
    np.testing.assert_array_equal(lane, want_lane)
    np.testing.assert_array_equal(step, want_step)
    batch, per_item = data.draw(st.integers(1, 20)), data.draw(st.integers(2, 5))
    order = EpochOrder(layout, lo, hi, seed=3, epoch=1, shuffle=shuffle, window=2, shard=Shard(0, 1, 0, 1),
                       pad=False, drop_last=data.draw(st.booleans()), batch_size=batch)
    first = data.draw(st.integers(0, order.num_batches))
    one, runs = list(order.batches(first)), list(order.batches(first, per_item))
    assert len(runs) == -(-len(one) // per_item)
    for got, want in zip(zip(*runs), zip(*one)):
        np.testing.assert_array_equal(np.concatenate(got or [np.zeros(0, np.int64)]),
                                      np.concatenate(want or [np.zeros(0, np.int64)]))


def _block_rows() -> EpochRows:
    """Two lanes of chunks of 8 rows, windows of 3 chunks: 16 windows."""
    return EpochRows(LaneLayout(2, None, 8), np.zeros(2, np.int64), np.array([200, 170]), seed=3, epoch=1,
                     shuffle="block", window=3)


def _window_sequence() -> np.ndarray:
    rows = _block_rows()
    return np.stack(rows.run_rows(0, rows.total))


def test_the_next_window_is_shuffled_on_a_thread_also_in_a_forked_child():
    """A block-shuffled epoch permutes its next window on a thread while the current one is read;
    the windows are those one computed after the other, and a forked child (whose parent's thread
    it does not inherit) gets them too."""
    with_thread = _window_sequence()
    rows = _block_rows()
    alone = [rows._permuted(k) for k in range(len(rows._window_ends))]  # each window here, on its own
    np.testing.assert_array_equal(with_thread, np.concatenate([np.stack(w) for w in alone], axis=1))
    rows._window_rows(0)
    assert list(rows._ahead) == [1]
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, _window_sequence().tobytes())
        os._exit(0)
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    got = b""
    while ready and (part := os.read(read, 1 << 20)):
        got += part
    os.close(read)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    np.testing.assert_array_equal(np.frombuffer(got, np.int64).reshape(2, -1), with_thread)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.sampled_from([None, 24, 40]), st.integers(1, 9), st.data())
def test_announced_rows_need_the_chunks_of_the_batches_window_by_window(num_envs, capacity, chunk_rows, data):
    """What the read-ahead is told (`EpochOrder.announced`) needs exactly the chunks the batches
    from ``first`` on need; a run of the sequence: a window at a time (each chunk first in the
    window where a batch first needs it), else the batches' rows in order."""
    layout = LaneLayout(num_envs, capacity, chunk_rows)
    lo = np.array(data.draw(st.lists(st.integers(0, 30), min_size=num_envs, max_size=num_envs)), np.int64)
    sizes = data.draw(st.lists(st.integers(0, capacity or 60), min_size=num_envs, max_size=num_envs))
    shuffle, window = data.draw(st.sampled_from(["none", "block", "global"])), data.draw(st.integers(1, 3))
    workers = data.draw(st.integers(1, 3))
    shard = Shard(0, data.draw(st.sampled_from([1, 2])), data.draw(st.integers(0, workers - 1)), workers)
    order = EpochOrder(layout, lo, lo + np.array(sizes, np.int64), seed=3, epoch=1, shuffle=shuffle, window=window,
                       shard=shard, pad=False, drop_last=False, batch_size=data.draw(st.integers(1, 20)))
    first = data.draw(st.integers(0, order.num_batches))

    def chunks(lane: np.ndarray, step: np.ndarray) -> list[tuple[int, int]]:
        return list(zip(lane.tolist(), layout.chunk_and_offset(step)[0].tolist()))

    needed: dict[tuple[int, int], int] = {}  # chunk -> the position that first needs it
    rows = [chunks(*one) for one in order.batches(first)]
    positions = order.positions(first * order.batch_size, order.used_rows).tolist()
    for key, position in zip(itertools.chain.from_iterable(rows), positions):
        needed.setdefault(key, position)
    items = [chunks(*item) for item in order.announced(first)]
    told = [key for item in items for key in item]
    assert set(told) == set(needed)
    sequence = order._rows()
    if shuffle == "global" or not order._run:  # the batches' rows themselves
        assert list(dict.fromkeys(told)) == list(needed)
        return
    windows = np.searchsorted(sequence._window_ends, list(needed.values()), side="right").tolist()
    first_window = windows[0] if windows else 0
    announced_in: dict[tuple[int, int], int] = {}
    for k, item in enumerate(items):
        assert len(set(item)) <= window  # one window's chunks
        for key in item:
            announced_in.setdefault(key, first_window + k)
    assert announced_in == dict(zip(needed, windows))


def test_shards_get_whole_chunks(buf):
    """Each shard reads a contiguous run of the epoch sequence: only the windows (4 chunks) cut by
    its 3 inner cut points are read by two shards, every other chunk by one."""
    lo, hi = buf.storage.window()
    layout = buf.storage.layout
    owners: dict[tuple[int, int], set] = {}
    for rank, worker in itertools.product(range(2), range(2)):
        order = EpochOrder(layout, lo, hi, seed=0, epoch=0, shuffle="block", window=4,
                           shard=Shard(rank, 2, worker, 2), pad=False, drop_last=False, batch_size=50)
        for lane, step in order.batches():
            for e, s in zip(lane.tolist(), step.tolist()):
                owners.setdefault((e, s // CHUNK), set()).add((rank, worker))
    assert len(owners) == 32 and max(len(o) for o in owners.values()) == 2
    assert sum(len(o) > 1 for o in owners.values()) <= 3 * 4


def test_epoch_order_is_pure_function_of_seed_epoch_rows(buf):
    a = concat(list(epoch_ds(buf)))
    assert np.array_equal(a, concat(list(epoch_ds(buf))))
    assert not np.array_equal(a, concat(list(epoch_ds(buf, seed=4))))
    ds = epoch_ds(buf)
    list(ds)
    second = concat(list(ds))
    assert ds.epoch == 1 and not np.array_equal(a, second)
    fresh = epoch_ds(buf)
    fresh.set_epoch(1)
    assert np.array_equal(concat(list(fresh)), second)
    assert np.array_equal(concat(list(epoch_ds(buf, shuffle=False))), buf.row_ids())


def test_shard_range_pad_and_drop_last():
    for total, world, workers in [(10, 3, 1), (1001, 4, 3), (5, 8, 1)]:
        for pad, drop in [(False, False), (True, False), (False, True)]:
            ranges = [shard_range(total, Shard(r, world, w, workers), pad, drop)
                      for r in range(world) for w in range(workers)]
            per_rank = [sum(b - a for a, b in ranges[r * workers:(r + 1) * workers]) for r in range(world)]
            if pad:
                assert len(set(per_rank)) == 1 and sum(per_rank) - total < world
            elif drop:
                assert len(set(per_rank)) == 1 and total - sum(per_rank) < world
            else:
                assert sum(per_rank) == total and max(per_rank) - min(per_rank) <= 1
            assert all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))


# ---- exactly once per epoch -----------------------------------------------------------------


@pytest.mark.parametrize("shuffle", ["block", "global"])
def test_epoch_exactly_once_2_ranks_2_workers(buf, shuffle):
    seen, counts = [], []
    for rank in range(2):
        ds = epoch_ds(buf, shuffle=shuffle, rank=rank, world_size=2)
        batches = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork"))
        for b in batches:
            check_rows(b)
        seen.append(concat(batches))
        counts.append(len(batches))
        assert len(batches) == ds.batches_per_epoch(num_workers=2)
    union = np.concatenate(seen)
    assert len(union) == len(buf) and np.array_equal(np.sort(union), np.sort(buf.row_ids()))
    assert not set(seen[0].tolist()) & set(seen[1].tolist())


def test_epoch_pad_and_drop_last_like_distributed_sampler(buf):
    world = 3
    padded = [concat(list(epoch_ds(buf, pad=True, rank=r, world_size=world, batch_size=64))) for r in range(world)]
    assert len({len(p) for p in padded}) == 1
    union = np.concatenate(padded)
    assert set(union.tolist()) == set(buf.row_ids().tolist()) and len(union) - len(buf) < world
    dropped = [list(epoch_ds(buf, drop_last=True, rank=r, world_size=world, batch_size=64)) for r in range(world)]
    assert len({len(d) for d in dropped}) == 1
    assert all(len(b["index"]) == 64 for d in dropped for b in d)
    flat = np.concatenate([concat(d) for d in dropped])
    assert len(set(flat.tolist())) == len(flat)


def test_block_shuffle_reads_each_chunk_once_global_does_not(tmp_path):
    # compressed: chunks go through the cache (raw local chunks larger than the cache are mapped)
    b = make_buf(tmp_path / "b", steps=2000, compression="zstd")  # 4000 rows, 64 chunks of 64 rows x 20 bytes
    chunk_bytes = CHUNK * 20
    stats = {}
    for shuffle in ("block", "global"):
        ds = make_dataset(b, 64, "epoch", shuffle=shuffle, shuffle_window=4, cache_bytes=8 * chunk_bytes)
        ids = concat(list(ds))
        assert np.array_equal(np.sort(ids), np.sort(b.row_ids()))
        stats[shuffle] = ds.io_stats()
    assert stats["block"]["chunk_fetches"] == 64
    assert stats["block"]["bytes_decoded"] == 64 * chunk_bytes
    assert stats["global"]["chunk_fetches"] > 5 * 64  # each read of 4 batches (a window: 256 rows) fetches most again
    with pytest.raises(ValueError, match="shuffle_window"):
        make_dataset(b, 64, "epoch", shuffle_window=8, cache_bytes=8 * chunk_bytes)
    b.close()


def test_block_shuffle_reads_each_chunk_once_with_a_cache_of_two_windows_at_any_batch_size(tmp_path):
    # before: up to 122 fetches (reads of 8 batches, more rows than two windows hold; and the chunks
    # of one read all of one age in the cache, evicted in slot order)
    b = make_buf(tmp_path / "b", steps=2000, compression="zstd")  # 4000 rows, 64 chunks of 64 rows x 20 bytes

    @settings(max_examples=25, deadline=None)
    @given(window=st.integers(1, 8), rows=st.floats(0.0, 1.0), seed=st.integers(0, 3))
    def check(window: int, rows: float, seed: int) -> None:
        batch_size = max(1, round(rows * window * CHUNK))  # a batch spans two windows at most
        ds = make_dataset(b, batch_size, "epoch", seed=seed, shuffle="block", shuffle_window=window,
                          cache_bytes=2 * window * CHUNK * 20)
        ids = concat(list(ds))
        assert np.array_equal(np.sort(ids), np.sort(b.row_ids()))
        assert ds.io_stats()["chunk_fetches"] == 64

    check()
    # a Loader worker's blocks too stay within a window's rows (sample mode has no windows)
    assert make_dataset(b, 16, "epoch", shuffle_window=1).block_batches == CHUNK // 16
    assert make_dataset(b, 16, "epoch", shuffle_window=3).block_batches == 3 * CHUNK // 16
    assert make_dataset(b, 16, "sample").block_batches == 32
    b.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, world: int, port: int, url: str, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ds = make_dataset(url, 50, "epoch", seed=9, cache_bytes=CACHE)  # rank/world from the group
        assert (ds.rank, ds.world_size) == (rank, world)
        mine = concat(list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")))
        expected = concat(list(make_dataset(url, 50, "epoch", seed=9, rank=rank, world_size=world,
                                            cache_bytes=CACHE)))
        assert np.array_equal(np.sort(mine), np.sort(expected))
        gathered = [None] * world
        dist.all_gather_object(gathered, mine.tolist())
        if rank == 0:
            np.save(out, np.array(sorted(itertools.chain.from_iterable(gathered)), dtype=np.int64))
    finally:
        dist.destroy_process_group()


def test_epoch_exactly_once_torch_distributed_gloo(buf, tmp_path):
    out = os.fspath(tmp_path / "union.npy")
    tmp_mp.spawn(_gloo_rank, args=(2, _free_port(), buf.url, out), nprocs=2, join=True)
    np.testing.assert_array_equal(np.load(out), np.sort(buf.row_ids()))


# ---- resume -------------------------------------------------------------------------------


def _stateful(ds, workers: int, **kw):
    extra = {"persistent_workers": True, "multiprocessing_context": "fork"} if workers else {}
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers, **extra, **kw)


def _two_epochs(loader) -> list[np.ndarray]:
    return indices(list(loader)) + indices(list(loader))


@pytest.mark.parametrize("workers", [0, 2])
def test_epoch_resume_equals_uninterrupted(buf, workers):
    reference = _two_epochs(_stateful(epoch_ds(buf, batch_size=64), workers))
    per_epoch = len(reference) // 2
    for stop in (5, per_epoch - 1):  # mid-epoch; and where one worker has already finished
        loader = _stateful(epoch_ds(buf, batch_size=64), workers)
        it = iter(loader)
        head = indices([next(it) for _ in range(stop)])
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        del it, loader
        resumed = _stateful(epoch_ds(buf, batch_size=64), workers)
        resumed.load_state_dict(state)
        tail = _two_epochs(resumed)[: 2 * per_epoch - stop]
        assert len(head) + len(tail) == len(reference)
        for got, want in zip(head + tail, reference):
            np.testing.assert_array_equal(got, want)


def test_epoch_resume_plain_dataset_state(buf):
    reference = concat(list(epoch_ds(buf)))
    ds = epoch_ds(buf)
    it = iter(DataLoader(ds, batch_size=None))
    head = [next(it) for _ in range(7)]
    state = ds.state_dict()
    assert state["batch"] == 7 and state["epoch"] == 0
    fresh = epoch_ds(buf)
    fresh.load_state_dict(state)
    tail = list(DataLoader(fresh, batch_size=None))
    assert np.array_equal(concat(head + tail), reference)
    # a finished epoch, loaded in the main process, continues with the next epoch
    fresh2 = epoch_ds(buf)
    fresh2.load_state_dict(fresh.state_dict())
    following = epoch_ds(buf)
    following.set_epoch(1)
    assert np.array_equal(concat(list(fresh2)), concat(list(following)))


def test_epoch_mid_epoch_state_refuses_other_num_workers(buf):
    ds = epoch_ds(buf)
    it = iter(ds)
    next(it)
    worker_state = {**ds.state_dict(), "worker": 1, "num_workers": 2}  # as saved by worker 1 of 2
    fresh = epoch_ds(buf)
    fresh.load_state_dict(worker_state)
    with pytest.raises(ValueError, match="same settings"):
        list(fresh)  # iterated with num_workers=0 (in a worker the error surfaces the same way)
    with pytest.raises(ValueError, match="middle of an epoch"):
        merge_worker_states([{**ds.state_dict(), "worker": w, "num_workers": 2} for w in range(2)])
    boundary = epoch_ds(buf)
    list(boundary)  # a finished epoch: portable to any number of workers
    moved = epoch_ds(buf)
    moved.load_state_dict(boundary.state_dict())
    ids = concat(list(DataLoader(moved, batch_size=None, num_workers=2, multiprocessing_context="fork")))
    assert np.array_equal(np.sort(ids), np.sort(buf.row_ids())) and moved.epoch == 1


def test_sample_resume_across_num_workers(buf):
    reference = indices(itertools.islice(sample_ds(buf), 30))
    loader = _stateful(sample_ds(buf), 2)
    it = iter(loader)
    head = indices([next(it) for _ in range(9)])
    state = dataset_state_from_loader(loader.state_dict())
    del it, loader
    assert state["batch"] == 9
    for workers in (0, 1):
        ds = sample_ds(buf)
        ds.load_state_dict(state)
        kw = {"multiprocessing_context": "fork"} if workers else {}
        tail = indices(itertools.islice(DataLoader(ds, batch_size=None, num_workers=workers, **kw), 21))
        for got, want in zip(head + tail, reference):
            np.testing.assert_array_equal(got, want)
    single = _stateful(sample_ds(buf), 0)
    it = iter(single)
    [next(it) for _ in range(3)]
    assert dataset_state_from_loader(single.state_dict())["batch"] == 3
    # and with the same number of workers, straight from the StatefulDataLoader state
    loader = _stateful(sample_ds(buf), 2)
    it = iter(loader)
    [next(it) for _ in range(4)]
    state = loader.state_dict()
    del it, loader
    resumed = _stateful(sample_ds(buf), 2)
    resumed.load_state_dict(state)
    tail = indices(itertools.islice(resumed, 6))
    for got, want in zip(tail, reference[4:10]):
        np.testing.assert_array_equal(got, want)


# ---- sample mode ----------------------------------------------------------------------------


def test_sample_mode_deterministic_streams(buf):
    a = indices(itertools.islice(sample_ds(buf), 5))
    assert all(np.array_equal(x, y) for x, y in zip(a, indices(itertools.islice(sample_ds(buf), 5))))
    assert not np.array_equal(a[0], indices(itertools.islice(sample_ds(buf, seed=6), 1))[0])
    r1 = indices(itertools.islice(sample_ds(buf, rank=1, world_size=2), 5))
    assert not any(np.array_equal(x, y) for x, y in zip(a, r1))
    for batch in itertools.islice(sample_ds(buf), 3):
        check_rows(batch)
        assert batch["obs"].shape == (32, 3) and batch["index"].dtype == torch.int64


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_fork_and_spawn(buf, context):
    reference = indices(itertools.islice(sample_ds(buf), 8))
    loader = DataLoader(sample_ds(buf), batch_size=None, num_workers=2, multiprocessing_context=context)
    got = list(itertools.islice(loader, 8))
    ring = loader.dataset.worker_ring.stats()
    for batch in got:
        check_rows(batch)
        ptrs = {t.untyped_storage().data_ptr() for t in batch.values()}
        if context == "spawn":  # no ring in a pickled dataset: a worker packs a batch into one storage
            assert len(ptrs) == 1
    assert (ring["received"] >= 8) if context == "fork" else (ring["received"] == 0)  # fork: ring slots
    assert all(np.array_equal(x, y) for x, y in zip(indices(got), reference))


def test_pickle_is_small(tmp_path):
    big = dr.ReplayBuffer.create(os.fspath(tmp_path / "big"), {"x": dr.Field((64,), "float32")}, None,
                                 chunk_rows=256, compression=None)
    big.extend({"x": np.random.default_rng(0).random((20000, 64), dtype=np.float32)})
    big.flush()
    assert sum(f.stat().st_size for f in (tmp_path / "big").rglob("*") if f.is_file()) > 5e6
    for ds in (make_dataset(big, 256, "sample"), make_dataset(big, 256, "epoch"), RowDataset(big)):
        assert len(pickle.dumps(ds)) < 10_000
        if isinstance(ds, RowDataset):
            ds[np.arange(10)]
        else:
            next(iter(ds))
        assert len(pickle.dumps(ds)) < 10_000  # also after it opened the buffer itself
    big.close()


def _counting(ds) -> tuple[list[int], list[int]]:
    """Open ``ds``'s reader in this process and record its gathers (rows each) and refreshes (the
    dataset's batch position at each)."""
    reader_buf = ds.reader.get()
    gathers, refreshes = [], []
    gather, refresh = reader_buf.view.gather, reader_buf.refresh
    reader_buf.view.gather = lambda *a, **kw: gathers.append(len(a[0])) or gather(*a, **kw)
    reader_buf.refresh = lambda: refreshes.append(ds.state_dict()["batch"]) or refresh()
    return gathers, refreshes


def _drawn(buf, batch_size: int, seed: int, batches: range, **options) -> list[np.ndarray]:
    """Row ids of batches ``b`` as a dataset draws them: ``buf.sample`` with ``default_rng([seed, 0, b])``."""
    return [buf.sample(batch_size, rng=np.random.default_rng([seed, 0, b]), **options)["index"] for b in batches]


def test_small_batches_are_drawn_one_by_one_and_gathered_eight_at_a_time(buf):
    ds = sample_ds(buf)
    gathers, _ = _counting(ds)
    got = list(itertools.islice(ds, 20))
    assert gathers == [8 * 32] * 3  # batches 0-7, 8-15 and 16-23 (4 of them not yet taken)
    for batch, want in zip(got, _drawn(buf, 32, 5, range(20)), strict=True):
        check_rows(batch)
        np.testing.assert_array_equal(batch["index"].numpy(), want)
    assert ds.state_dict()["batch"] == 20  # the batches taken, not those read ahead
    resumed = sample_ds(buf)
    resumed.load_state_dict(ds.state_dict())
    tail = indices(itertools.islice(resumed, 6))
    for got_ids, want in zip(tail, _drawn(buf, 32, 5, range(20, 26)), strict=True):
        np.testing.assert_array_equal(got_ids, want)


def test_large_batches_and_transformed_ones_are_read_one_by_one(buf):
    big = sample_ds(buf, batch_size=40_000)  # 40,000 rows of 28 bytes: more than a read's 1 MiB
    gathers, _ = _counting(big)
    for batch, want in zip(itertools.islice(big, 3), _drawn(buf, 40_000, 5, range(3)), strict=True):
        np.testing.assert_array_equal(batch["index"].numpy(), want)
    assert gathers == [40_000] * 3
    per_batch = sample_ds(buf, sample_options={"recent_rows": 100, "gamma": 0.5})  # gamma: for sample() only
    gathers, _ = _counting(per_batch)
    for batch, want in zip(itertools.islice(per_batch, 3), _drawn(buf, 32, 5, range(3), recent_rows=100),
                           strict=True):
        np.testing.assert_array_equal(batch["index"].numpy(), want)
    assert gathers == [32] * 3


@pytest.mark.parametrize("every", [1, 3, 5, 20])
def test_refreshes_fall_before_the_same_batches_when_reading_ahead(buf, monkeypatch, every):
    def refreshed_at() -> list[int]:
        ds = sample_ds(buf, refresh_every=every, refresh_seconds=None)
        _, refreshes = _counting(ds)
        list(itertools.islice(ds, 40))
        return refreshes

    ahead = refreshed_at()
    monkeypatch.setattr(read_sizes, "READ_BATCHES", 1)
    assert ahead == refreshed_at() == list(range(every - 1, 40, every))


def test_epoch_batches_are_gathered_eight_at_a_time_and_stay_the_same(buf, monkeypatch):
    ds = epoch_ds(buf, batch_size=48)  # 2000 rows: 41 batches of 48, then one of 32
    gathers, _ = _counting(ds)
    it = iter(ds)
    head = indices(itertools.islice(it, 11))
    assert ds.state_dict()["batch"] == 11  # the batches taken, not those read ahead
    ahead = head + indices(it)
    assert gathers == [8 * 48] * 5 + [48 + 32]
    monkeypatch.setattr(read_sizes, "READ_BATCHES", 1)
    one_by_one = epoch_ds(buf, batch_size=48)
    single, _ = _counting(one_by_one)
    for got, want in zip(ahead, indices(one_by_one), strict=True):
        np.testing.assert_array_equal(got, want)
    assert single == [48] * 41 + [32]


def test_a_loader_passes_batches_on_as_batches(buf):
    got = next(iter(DataLoader(sample_ds(buf), batch_size=None)))  # default_convert copies each batch
    assert type(got) is Batch
    clone = copy.copy(got)
    assert type(clone) is Batch and clone is not got and all(clone[k] is got[k] for k in got)


def test_the_generators_of_a_read_are_each_batch_s_own_every_time():
    rngs = BatchRngs(5, 0, stride=2)
    gens = StridedRngs(rngs, 4, 2, 3)
    want = [np.random.default_rng([5, 0, b]).integers(1 << 62, size=4) for b in (4, 6, 8)]
    for _ in range(2):  # a retried read asks again: the same states, not the generators' later ones
        for gen, w in zip(gens, want, strict=True):
            np.testing.assert_array_equal(gen.integers(1 << 62, size=4), w)
    with pytest.raises(IndexError):
        gens[3]


# ---- live buffers ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 1])
def test_live_buffer_picks_up_new_commits(tmp_path, workers):
    writer = make_buf(tmp_path / "live", steps=200)
    ds = sample_ds(writer, refresh_every=1)
    kw = {"multiprocessing_context": "fork", "prefetch_factor": 1} if workers else {}
    it = iter(DataLoader(ds, batch_size=None, num_workers=workers, **kw))
    first = concat([next(it) for _ in range(3)])
    assert first.max() < 400
    fill(writer, 2000, start=200)  # committed: rows 400.. are new
    later = concat([next(it) for _ in range(6)])
    assert later.max() >= 400 and (later >= 400).mean() > 0.5
    del it
    # epoch mode adopts new rows at set_epoch(refresh=True)
    eds = epoch_ds(writer)
    fill(writer, 100, start=2200)
    assert len(concat(list(eds))) == 4400
    eds.set_epoch(1, refresh=True)
    assert len(concat(list(eds))) == 4600
    writer.close()


# ---- prioritized sampling through the main process ----------------------------------------------


@pytest.mark.parametrize("workers,prefetch", [(0, None), (2, 2)])
def test_index_sampler_priorities_staleness_bound(tmp_path, workers, prefetch):
    writer = make_buf(tmp_path / "per", steps=1000, sampler=dr.Prioritized(alpha=1.0, eps=1e-9))
    sampler = IndexBatchSampler(writer, 32, seed=1)
    kw = {"multiprocessing_context": "fork", "prefetch_factor": prefetch} if workers else {}
    loader = DataLoader(RowDataset(writer), sampler=sampler, batch_size=None, num_workers=workers, **kw)
    depth = workers * (prefetch or 0)
    it = iter(loader)
    before = [next(it) for _ in range(3)]
    for b in before:
        check_rows(b)
        assert b["weight"].shape == (32,)
    target = 777
    ids = writer.row_ids()
    writer.update_priorities(ids, np.where(ids == target, 1e6, 0.0))
    after = [next(it) for _ in range(depth + 2)]
    for b in after:
        check_rows(b)
    stale = [bool((b["index"] != target).any()) for b in after]
    assert not any(stale[depth:])  # reflected at most `depth` batches later
    assert all(stale[:depth])  # and (here) exactly then: those were drawn before the update
    del it


def test_index_sampler_state_round_trip(buf):
    sampler = IndexBatchSampler(buf, 16, seed=3, num_batches=5)
    it = iter(sampler)
    next(it)
    state = pickle.loads(pickle.dumps(sampler.state_dict()))
    rest = [b.index for b in it]
    again = IndexBatchSampler(buf, 16, seed=99, num_batches=5)
    again.load_state_dict(state)
    assert len(rest) == 4 and all(np.array_equal(x, y.index) for x, y in zip(rest, again))
    assert len(sampler) == 5 and len(list(sampler)) == 5  # a finished iteration starts over


def test_row_dataset_refreshes_and_explains_missing_rows(tmp_path):
    writer = make_buf(tmp_path / "rows", steps=100)
    rows = RowDataset(writer.url, refresh_seconds=None)
    got = rows[IndexBatch(np.array([0, 5, 199]), np.ones(3, np.float32))]
    np.testing.assert_array_equal(got["act"].numpy(), [0, 5, 199])
    assert got["weight"].dtype == torch.float32
    fill(writer, 50, start=100)
    np.testing.assert_array_equal(rows[np.array([250, 299])]["act"].numpy(), [250, 299])
    writer.extend({"obs": np.zeros((1, 2, 3), np.float32), "act": np.zeros((1, 2), np.int64)})  # staged only
    with pytest.raises(IndexError, match="flush the writer"):
        rows[np.array([300])]
    sampler = IndexBatchSampler(writer, 64, seed=0)
    assert sampler.draw().index.max() < 300  # draws committed rows only
    writer.close()


# ---- the main process's copy of a dataset that DataLoader workers iterate -------------------------


@pytest.mark.parametrize("mode", ["sample", "epoch"])
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_state_of_the_copy_workers_iterate_refuses(buf, mode, context):
    """Workers iterate their own copies: the main process's never moves, its state would say
    batch 0 forever and a resume would replay every batch since."""
    ds = sample_ds(buf) if mode == "sample" else epoch_ds(buf)
    fresh = ds.state_dict()  # not yet handed to workers: its position is the real one
    assert fresh["batch"] == 0
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    assert len(list(itertools.islice(loader, 6))) == 6
    with pytest.raises(RuntimeError, match=r"iterated by DataLoader worker processes.*"
                                           r"diskreplay\.torch\.Loader.*StatefulDataLoader"):
        ds.state_dict()


def test_state_of_workers_copies_and_loaders_still_work(buf):
    """StatefulDataLoader asks the workers' copies; a Loader keeps its own state."""
    ds = sample_ds(buf)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
    got = list(itertools.islice(loader, 6))
    state = dataset_state_from_loader(loader.state_dict())
    assert state["batch"] == 6 and len(got) == 6
    ds2 = sample_ds(buf)
    dr_loader = dr.Loader(ds2, num_workers=2)
    assert len(list(itertools.islice(dr_loader, 6))) == 6
    assert dr_loader.state_dict()["dataset"]["batch"] == 6
    assert ds2.state_dict()["batch"] == 0  # the Loader's workers iterate a copy of their own
