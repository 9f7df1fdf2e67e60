"""Tests of `diskreplay.torch.loader.Loader` (issue #13): DataLoader workers hand over blocks of
several batches in one item, the Loader cuts them apart. The batches must equal the in-process
stream (sample mode, any num_workers) or cover the epoch exactly once; one hand-over per block,
not per batch; resume exact after any batch. Real fork (and spawn) DataLoader workers."""

from __future__ import annotations

import functools
import gc
import itertools
import math
import os
import pickle
import time

import numpy as np
import pytest
import torch
from test_worker_ring import CACHE, as_numpy, assert_same, buf, make_buf  # buf: the fixture

from diskreplay.torch.data import make_dataset
from diskreplay.torch.datasets import BlockPlan, ramped_blocks
from diskreplay.torch.loader import Loader
from diskreplay.torch.read_sizes import BLOCK_BATCHES
from diskreplay.torch.tensors import Block

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 2 cores here


def dataset(buf, mode: str = "sample", batch_size: int | None = None, **kw):
    """Batches of 32 rows (sample mode), of 8 (epoch mode: 250 per epoch, several blocks per shard)."""
    size = batch_size or (32 if mode == "sample" else 8)
    return make_dataset(buf, size, mode, seed=5, cache_bytes=CACHE, **kw)


def loader(buf, workers: int, mode: str = "sample", **kw) -> Loader:
    context = kw.pop("context", "fork")
    return Loader(dataset(buf, mode, **kw), num_workers=workers, multiprocessing_context=context if workers else None)


def in_process(buf, n: int | None = None, mode: str = "sample", **kw) -> list[dict[str, np.ndarray]]:
    return as_numpy(itertools.islice(dataset(buf, mode, **kw), n))


@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_sample_batches_equal_the_in_process_stream(buf, workers):
    n = 2 * BLOCK_BATCHES + 11  # two blocks and part of a third
    want = in_process(buf, n)
    ld = loader(buf, workers)
    assert ld.dataset.block_batches == BLOCK_BATCHES
    got = as_numpy(itertools.islice(ld, n))
    assert_same(got, want)
    assert ld.state_dict()["dataset"]["batch"] == n
    stats = ld.dataset.worker_ring.stats()
    blocks = next(m + 1 for m, (b, count) in enumerate(ramped_blocks(0, BLOCK_BATCHES, 0, 1)) if b + count >= n)
    assert stats["fallbacks"] == 0
    if workers:  # one DataLoader item per block of batches, not one per batch
        assert blocks <= stats["received"] <= blocks + 2 * workers  # 2: the DataLoader's prefetch_factor
        assert stats["handed_over"] >= blocks
    else:
        assert stats["received"] == 0


def test_kept_batches_are_never_overwritten(buf):
    """A block's slot is reused only after the last tensor of its batches dies: batches kept for
    the whole run (more blocks than the workers have slots) still hold their values; slots run
    out, so later blocks come as tensors."""
    n = 20 * BLOCK_BATCHES  # 20 blocks: 10 per worker, against 8 slots each
    want = in_process(buf, n)
    ld = loader(buf, 2)
    kept = list(itertools.islice(ld, n))
    assert_same(as_numpy(kept), want)
    stats = ld.dataset.worker_ring.stats()
    assert stats["fallbacks"] > 0 and stats["states"]["held"] == 16
    del kept
    gc.collect()
    assert ld.dataset.worker_ring.stats()["states"]["held"] == 0


def test_sample_resume_across_num_workers(buf):
    want = in_process(buf, 100)
    first = loader(buf, 2)
    head = as_numpy(itertools.islice(first, 41))  # inside the second block
    state = pickle.loads(pickle.dumps(first.state_dict()))
    assert state == {"dataset": {"mode": "sample", "seed": 5, "batch": 41, "rank": 0, "world_size": 1,
                                 "worker": 0, "num_workers": 1}}
    for workers in (0, 1, 3):
        again = loader(buf, workers)
        again.load_state_dict(state)
        assert_same(head + as_numpy(itertools.islice(again, 59)), want)


def test_a_dataset_position_starts_the_loader(buf):
    want = in_process(buf, 90)
    ds = dataset(buf)
    ds.load_state_dict({**ds.state_dict(), "batch": 13})
    assert_same(as_numpy(itertools.islice(Loader(ds, num_workers=2), 77)), want[13:])


def _rows(batches) -> dict[str, np.ndarray]:
    order = np.argsort(np.concatenate([b["index"] for b in batches]))
    return {k: np.concatenate([b[k] for b in batches])[order] for k in batches[0]}


@pytest.mark.parametrize("shuffle", ["block", "global"])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_epoch_covers_every_row_once_and_advances(buf, workers, shuffle):
    ld = loader(buf, workers, "epoch", shuffle=shuffle)
    first, second = as_numpy(ld), as_numpy(ld)
    rows = _rows(first)
    np.testing.assert_array_equal(rows["index"], np.arange(2000))
    assert len(first) == len(second) == len(ld)
    assert ld.state_dict()["dataset"]["epoch"] == 2
    if workers <= 1:  # one shard: the order of the dataset iterated in this process
        ds = dataset(buf, "epoch", shuffle=shuffle)
        assert_same(first, as_numpy(ds))
        assert_same(second, as_numpy(ds))
    else:
        assert_same([_rows(first)], [_rows(in_process(buf, None, "epoch", shuffle=shuffle))])
        assert not np.array_equal(np.concatenate([b["index"] for b in first]),
                                  np.concatenate([b["index"] for b in second]))


@pytest.mark.parametrize("workers,stop", [(2, 64), (2, 75), (3, 96), (3, 101), (3, 190), (1, 40), (0, 30)])
def test_epoch_resume_inside_an_epoch_is_exact(buf, workers, stop):
    """Stopped at a block boundary or inside a block: the rest of the epoch, then the next one."""
    uninterrupted = loader(buf, workers, "epoch")
    whole, whole_next = as_numpy(uninterrupted), as_numpy(uninterrupted)
    ld = loader(buf, workers, "epoch")
    it = iter(ld)
    head = as_numpy(itertools.islice(it, stop))
    state = ld.state_dict()
    del it
    again = loader(buf, workers, "epoch")
    again.load_state_dict(state)
    assert_same(head + as_numpy(again), whole)
    assert_same(as_numpy(again), whole_next)


@pytest.mark.parametrize("mode", ["sample", "epoch"])
def test_workers_leave_torchs_global_generator_alone(buf, mode):
    """A training loop that saves torch's generator with the loader's state resumes it exactly:
    the DataLoader under the Loader draws its worker seeds from a generator of its own, not
    from torch's global one (a resumed run starts one more iter than an uninterrupted one)."""
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    for _ in range(2):  # two passes: two DataLoader iterators
        list(itertools.islice(loader(buf, 2, mode), 40))
    assert torch.equal(torch.rand(3), want)


def _record_worker_seed(path: str, worker_id: int) -> None:
    with open(path, "a") as f:
        f.write(f"{worker_id} {torch.initial_seed()}\n")


def test_resumed_workers_get_the_torch_seeds_of_uninterrupted_ones(buf, tmp_path):
    """Workers' torch seeds are a function of the dataset's seed and the loader's position."""
    path = str(tmp_path / "seeds.txt")

    def recording() -> Loader:
        return Loader(dataset(buf, "epoch"), num_workers=2, multiprocessing_context="fork",
                      worker_init_fn=functools.partial(_record_worker_seed, path))

    def seeds(ld: Loader) -> list[str]:
        if os.path.exists(path):
            os.unlink(path)
        list(itertools.islice(iter(ld), 8))  # may all come from one worker's blocks: wait for both to start
        deadline = time.monotonic() + 60
        while (not os.path.exists(path) or len(open(path).read().splitlines()) < 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        with open(path) as f:
            return sorted(f.read().splitlines())

    uninterrupted = recording()
    list(itertools.islice(iter(uninterrupted), 40))
    state = uninterrupted.state_dict()
    after_40 = seeds(uninterrupted)
    resumed = recording()
    resumed.load_state_dict(state)
    assert seeds(resumed) == after_40
    assert seeds(recording()) != after_40  # at batch 0: other seeds
    assert len(after_40) == 2 and after_40[0].split()[1] != after_40[1].split()[1]


def test_epoch_state_says_each_shard_position(buf):
    ld = loader(buf, 3, "epoch")
    it = iter(ld)
    list(itertools.islice(it, 70))  # blocks of 32 in turn: 32 of shard 0, 32 of shard 1, 6 of shard 2
    state = ld.state_dict()
    assert (state["num_workers"], state["positions"], state["next_shard"]) == (3, [32, 32, 6], 2)
    list(itertools.islice(it, 26))
    assert (ld.state_dict()["positions"], ld.state_dict()["next_shard"]) == ([32, 32, 32], 0)


def test_epoch_inside_resumes_with_other_workers(buf):
    """Stopped inside an epoch on 2 workers, continued on 3: the rows the 2 had not reached, once
    (the run on 2 joins the state's history); the next epoch is the 3-worker loader's own."""
    ld = loader(buf, 2, "epoch")
    head = as_numpy(itertools.islice(ld, 40))
    state = ld.state_dict()
    other = loader(buf, 3, "epoch")
    other.load_state_dict(state)
    assert other.state_dict()["dataset"]["history"] == [{"world_size": 1, "num_workers": 2, "positions": [32, 8]}]
    assert other.state_dict()["positions"] == [0, 0, 0]
    tail = as_numpy(other)
    np.testing.assert_array_equal(_rows(head + tail)["index"], np.arange(2000))
    assert other.state_dict()["dataset"]["history"] == [] and other.state_dict()["dataset"]["epoch"] == 1
    fresh = loader(buf, 3, "epoch")
    fresh.set_epoch(1)
    assert_same(as_numpy(other), as_numpy(fresh))
    boundary = loader(buf, 2, "epoch")
    all_rows = as_numpy(boundary)
    other.load_state_dict(boundary.state_dict())  # at an epoch boundary: any num_workers
    assert other.state_dict()["dataset"]["epoch"] == 1
    assert len(_rows(as_numpy(other))["index"]) == len(_rows(all_rows)["index"]) == 2000


def test_set_epoch_chooses_the_epoch(buf):
    ld = loader(buf, 2, "epoch")
    ld.set_epoch(3)
    third = as_numpy(ld)
    ds = dataset(buf, "epoch")
    ds.set_epoch(3)
    assert_same([_rows(third)], [_rows(as_numpy(ds))])
    assert ld.state_dict()["dataset"]["epoch"] == 4


def test_sample_blocks_grow_from_one_batch():
    """A pass's first block is one batch (its first batch waits for one batch's read), then 2,
    4, ... up to the block size; block m is worker m % num_workers's."""
    assert list(itertools.islice(ramped_blocks(5, 8, 0, 2), 4)) == [(5, 1), (8, 4), (20, 8), (36, 8)]
    assert list(itertools.islice(ramped_blocks(5, 8, 1, 2), 3)) == [(6, 2), (12, 8), (28, 8)]
    assert list(itertools.islice(ramped_blocks(0, 1, 0, 1), 3)) == [(0, 1), (1, 1), (2, 1)]
    assert list(itertools.islice(ramped_blocks(0, 32, 0, 1), 7)) == [
        (0, 1), (1, 2), (3, 4), (7, 8), (15, 16), (31, 32), (63, 32)]


def test_workers_hand_over_blocks_growing_from_one_batch(buf):
    ds = dataset(buf)
    items = torch.utils.data.DataLoader(ds.blocked(BlockPlan(8)), batch_size=None, num_workers=2,
                                        multiprocessing_context="fork")
    blocks = list(itertools.islice(items, 6))
    assert [(len(block.sizes), block.end) for block in blocks] == [(1, 1), (2, 3), (4, 7), (8, 15), (8, 23), (8, 31)]
    got = [batch for block in blocks for batch in block.batches()]
    assert_same(as_numpy(got), in_process(buf, 31))


def test_spawn_workers_send_blocks_as_tensors(buf):
    want = in_process(buf, 12)
    ld = loader(buf, 1, context="spawn")
    assert_same(as_numpy(itertools.islice(ld, 12)), want)
    assert ld.dataset.worker_ring.stats()["received"] == 0


def test_options_only_sample_takes_go_one_batch_per_block(buf):
    want = in_process(buf, 5, sample_options={"n_step": 3, "gamma": 0.9})
    ld = loader(buf, 2, sample_options={"n_step": 3, "gamma": 0.9})
    assert_same(as_numpy(itertools.islice(ld, 5)), want)
    assert 5 <= ld.dataset.worker_ring.stats()["handed_over"]


def test_tensordict_batches(buf):
    pytest.importorskip("tensordict")
    from tensordict import TensorDict

    want = in_process(buf, 10)
    ld = loader(buf, 2, as_tensordict=True)
    got = list(itertools.islice(ld, 10))
    assert all(isinstance(td, TensorDict) and td.batch_size == torch.Size([32]) for td in got)
    np.testing.assert_array_equal(np.concatenate([td["index"].numpy() for td in got]),
                                  np.concatenate([w["index"] for w in want]))


def test_live_buffer_workers_refresh_between_blocks(tmp_path):
    writer = make_buf(tmp_path / "live", steps=100)
    try:
        ld = Loader(make_dataset(writer, 16, seed=1, refresh_every=8, refresh_seconds=None, cache_bytes=CACHE),
                    num_workers=2, multiprocessing_context="fork")
        it = iter(ld)
        assert max(int(next(it)["index"].max()) for _ in range(16)) < 200
        ids = np.arange(100, 400)[:, None] * 2 + np.arange(2)[None, :]
        writer.extend({"obs": np.zeros((300, 2, 3), np.float32), "act": ids, "reward": np.zeros((300, 2), np.float32),
                       "done": np.zeros((300, 2), bool)})
        writer.flush(durable=False)
        # blocks the workers gathered before the commit come first: 2 workers x prefetch 2 x 32 batches
        assert any(int(next(it)["index"].max()) >= 200 for _ in range(6 * BLOCK_BATCHES))
    finally:
        writer.close()


def test_block_cuts_into_its_batches_and_pickles():
    rows = {"a": torch.arange(10), "b": torch.arange(20).reshape(10, 2)}
    block = pickle.loads(pickle.dumps(Block(rows, [4, 4, 2], 1, 7)))
    assert (block.sizes, block.shard, block.end) == ([4, 4, 2], 1, 7)
    batches = block.batches()
    assert [len(b["a"]) for b in batches] == [4, 4, 2]
    assert batches[2]["b"].tolist() == [[16, 17], [18, 19]]


def test_refusals(buf):
    with pytest.raises(TypeError, match="dataset: expected a SampleDataset or EpochDataset .*got list"):
        Loader([1, 2])
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=f"num_workers must be an int >= 0, got {bad!r}"):
            Loader(dataset(buf), num_workers=bad)
    with pytest.raises(ValueError, match="prefetch_factor must be an int >= 1, got 0"):
        Loader(dataset(buf), prefetch_factor=0)
    sample = Loader(dataset(buf))
    with pytest.raises(TypeError, match="a sample-mode Loader is endless: it has no len"):
        len(sample)
    with pytest.raises(TypeError, match="set_epoch: a sample-mode Loader has no epochs"):
        sample.set_epoch(1)
    with pytest.raises(ValueError, match="expected a mapping whose 'dataset' is a rank-global dataset state"):
        sample.load_state_dict({"batch": 3})
    with pytest.raises(ValueError, match="state is for a 'epoch'-mode dataset, this one is 'sample'"):
        sample.load_state_dict(loader(buf, 0, "epoch").state_dict())
    epoch = loader(buf, 2, "epoch")
    good = epoch.state_dict()
    for bad in ({"positions": [1, -1]}, {"positions": [1]}, {"next_shard": 2}, {"num_workers": "2"}):
        with pytest.raises(ValueError, match="expected 'num_workers' .int., 'positions'"):
            epoch.load_state_dict({**good, **bad})
    worker_position = dataset(buf)
    worker_position.load_state_dict({**worker_position.state_dict(), "batch": 7, "worker": 1, "num_workers": 2})
    with pytest.raises(ValueError, match="the dataset holds the position of worker 1 of 2: load a rank-global"):
        Loader(worker_position)
    past = epoch.state_dict()
    past["positions"] = [200, 0]  # worker 0 of 2 has 125 batches of 8 rows
    with pytest.raises(ValueError, match="a run on world_size=1 with num_workers=2 says worker 0 read 200 "
                                         "batches; it has at most 125 on any rank"):
        loader(buf, 3, "epoch").load_state_dict(past)


def test_a_dataset_stopped_in_one_process_continues_on_workers(buf):
    """An epoch begun in one process continues on 2 workers: the rows the first run had not reached."""
    ds = dataset(buf, "epoch")
    head = as_numpy(itertools.islice(ds, 40))
    tail = as_numpy(Loader(ds, num_workers=2, multiprocessing_context="fork"))
    assert sorted(np.concatenate([b["index"] for b in head + tail]).tolist()) == list(range(2000))


# ---- persistent workers (issue 41): one start and one store open per Loader, not per pass ------


def _recording_opens(monkeypatch, path: str) -> None:
    """Every `Reader` open, in any process forked from here, appends its pid to ``path``."""
    from diskreplay.torch.reader import Reader
    opening = Reader._open

    def recorded(self):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return opening(self)
    monkeypatch.setattr(Reader, "_open", recorded)


def _opens(path: str) -> list[int]:
    with open(path) as f:
        return [int(line) for line in f.read().split()]


@pytest.mark.parametrize("mode", ["sample", "epoch"])
def test_workers_persist_across_passes_and_open_the_store_once(buf, tmp_path, monkeypatch, mode):
    """Two passes (epochs) over one Loader run in the same two worker processes, each opening the
    store once; the main process reads no chunk; the second epoch is the one a new Loader set to
    it yields."""
    path = str(tmp_path / "opens.txt")
    _recording_opens(monkeypatch, path)
    ld = loader(buf, 2, mode)
    first = as_numpy(itertools.islice(ld, 70))
    second = as_numpy(itertools.islice(ld, 70))
    opens = _opens(path)
    assert len(opens) == 2 and len(set(opens)) == 2 and os.getpid() not in opens
    assert ld.dataset.io_stats() == {"chunk_fetches": 0, "bytes_decoded": 0}
    fresh = loader(buf, 2, mode)
    if mode == "epoch":
        assert len(first) == 70  # a part of epoch 0; the next iter continues it
        fresh.set_epoch(0)
    assert_same(as_numpy(itertools.islice(fresh, 140)), first + second)


def test_a_second_epoch_on_persistent_workers_is_a_new_loaders(buf, tmp_path, monkeypatch):
    path = str(tmp_path / "opens.txt")
    _recording_opens(monkeypatch, path)
    ld = loader(buf, 2, "epoch")
    list(ld)
    second = as_numpy(ld)
    assert len(_opens(path)) == 2
    fresh = loader(buf, 2, "epoch")
    fresh.set_epoch(1)
    assert_same(as_numpy(fresh), second)


def test_resume_across_an_epoch_boundary_with_persistent_workers(buf):
    """Stopped inside epoch 1 of a Loader whose workers ran epoch 0, then shut down: a new Loader
    loading its state yields the rest of epoch 1 and epoch 2 as the uninterrupted one does."""
    ld = loader(buf, 2, "epoch")
    list(ld)
    it = iter(ld)
    head = as_numpy(itertools.islice(it, 45))
    state = ld.state_dict()
    rest, after = as_numpy(it), as_numpy(ld)
    del it
    ld.close()
    resumed = loader(buf, 2, "epoch")
    resumed.load_state_dict(state)
    assert_same(as_numpy(resumed), rest)
    assert_same(as_numpy(resumed), after)
    whole = loader(buf, 2, "epoch")
    whole.set_epoch(1)
    assert_same(as_numpy(whole), head + rest)


def test_two_passes_at_once_each_get_their_batches(buf):
    """A pass started while another still iterates the persistent workers gets workers of its
    own; both yield what they would alone."""
    ld = loader(buf, 2)
    one = iter(ld)
    head = as_numpy(itertools.islice(one, 5))
    two = as_numpy(itertools.islice(iter(ld), 40))
    assert_same(head + as_numpy(itertools.islice(one, 35)), in_process(buf, 40))
    assert_same(two, in_process(buf, 45)[5:])


def test_persistent_workers_read_the_rows_a_refreshed_epoch_adopts(tmp_path):
    """Rows committed after the workers' first epoch are read in the next one, once the Loader's
    dataset adopts them (``set_epoch(e, refresh=True)``): the live workers refresh their store."""
    writer = make_buf(tmp_path / "live", steps=100)
    try:
        ld = Loader(make_dataset(writer, 16, "epoch", seed=1, cache_bytes=CACHE), num_workers=2,
                    multiprocessing_context="fork")
        assert sorted(np.concatenate([b["index"].numpy() for b in ld]).tolist()) == list(range(200))
        ids = np.arange(100, 400)[:, None] * 2 + np.arange(2)[None, :]
        writer.extend({"obs": np.zeros((300, 2, 3), np.float32), "act": ids, "reward": np.zeros((300, 2), np.float32),
                       "done": np.zeros((300, 2), bool)})
        writer.flush(durable=False)
        ld.set_epoch(1, refresh=True)
        batches = list(ld)
        assert sorted(np.concatenate([b["index"].numpy() for b in batches]).tolist()) == list(range(800))
        np.testing.assert_array_equal(np.concatenate([b["act"].numpy() for b in batches]),
                                      np.concatenate([b["index"].numpy() for b in batches]))
    finally:
        writer.close()
