"""Tests of TensorDict batches from the torch datasets (``make_dataset(..., as_tensordict=True)``):
each batch must be the dict dataset's batch of the same seed laid out by ``dr.to_tensordict``, in
the same order, with the same resume states, through real DataLoaders with worker processes
(fork: through the shared-memory worker ring, slots freed when the TensorDicts die; spawn: sent
by torch), ``keep_batch`` as collate_fn, and through ``to_device`` (CPU path)."""

from __future__ import annotations

import gc
import itertools
import os
import pickle
import sys
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import diskreplay as dr
from diskreplay.torch import keep_batch
from diskreplay.torch.data import make_dataset
from diskreplay.torch.formats import name_to_key
from diskreplay.torch.shared_ring import FREE, HELD, SlotBatch, WorkerRing

tensordict = pytest.importorskip("tensordict", reason="TensorDict batches need the tensordict package")
from tensordict import TensorDict  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

FIELDS = {"obs": dr.Field((3,), "float32"), "next_obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"),
          "done": dr.Field((), "bool"), "info__cost": dr.Field((2,), "float32")}
CACHE = 4 * 2**20
LEAVES = ["obs", ("next", "obs"), "act", "done", ("info", "cost"), "index"]


def make_buf(path, steps: int = 600, num_envs: int = 2) -> dr.ReplayBuffer:
    """Rows whose ``act`` is the row id and every other field derived from it."""
    buf = dr.ReplayBuffer.create(os.fspath(path), FIELDS, None, num_envs=num_envs, chunk_rows=64,
                                 compression=None, cache_bytes=CACHE)
    ids = np.arange(steps)[:, None] * num_envs + np.arange(num_envs)[None, :]
    obs = np.stack([ids, -ids, ids % 7], axis=-1).astype(np.float32)
    buf.extend({"obs": obs, "next_obs": obs + 1, "act": ids, "done": ids % 9 == 8,
                "info__cost": np.stack([ids % 3, ids % 5], axis=-1).astype(np.float32)})
    buf.flush(durable=False)
    return buf


@pytest.fixture
def buf(tmp_path):
    b = make_buf(tmp_path / "buf")
    yield b
    b.close()


def dataset(buf, mode: str = "sample", **kw):
    extra = {"shuffle": "global"} if mode == "epoch" else {}
    return make_dataset(buf, kw.pop("batch_size", 32), mode, seed=5, cache_bytes=CACHE, **extra, **kw)


def loader(ds, workers: int, cls=DataLoader, context: str = "fork", **kw) -> DataLoader:
    return cls(ds, batch_size=None, num_workers=workers, collate_fn=keep_batch,
               multiprocessing_context=context if workers else None, **kw)


def copied(batches) -> list:
    """Copies of the batches, made as they come (so that their ring slots are free again at once)."""
    return [b.clone() if isinstance(b, TensorDict) else {k: v.clone() for k, v in b.items()} for b in batches]


def assert_tensordicts_of(got: list, dict_batches: list) -> None:
    """Each of ``got`` is the TensorDict ``dr.to_tensordict`` makes of the dict batch: same keys in
    the same order, batch size, dtypes and values."""
    assert len(got) == len(dict_batches) > 0
    for td, batch in zip(got, dict_batches):
        want = dr.to_tensordict(batch)
        assert type(td) is TensorDict and td.batch_size == want.batch_size == torch.Size([len(batch["index"])])
        keys = list(td.keys(include_nested=True, leaves_only=True))
        assert keys == list(want.keys(include_nested=True, leaves_only=True))
        for key in keys:
            assert td[key].dtype == want[key].dtype and torch.equal(td[key], want[key]), key


def ring_span(ring: WorkerRing) -> tuple[int, int]:
    start = np.frombuffer(ring._mm, np.uint8).__array_interface__["data"][0]
    return start + ring.header_bytes, start + ring.nbytes


def in_ring(td, ring: WorkerRing) -> bool:
    lo, hi = ring_span(ring)
    return all(lo <= t.data_ptr() < hi for t in td.values(include_nested=True, leaves_only=True))


# ---- same batches as the dict datasets -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["sample", "epoch"])
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_the_dict_batches_as_tensordicts(buf, mode, workers):
    n = 25 if mode == "sample" else None
    want = copied(itertools.islice(loader(dataset(buf, mode), workers), n))
    ds = dataset(buf, mode, as_tensordict=True)
    got = copied(itertools.islice(loader(ds, workers), n))
    assert_tensordicts_of(got, want)
    assert LEAVES == list(got[0].keys(include_nested=True, leaves_only=True))
    if mode == "epoch":
        ids = np.sort(np.concatenate([td["index"].numpy() for td in got]))
        np.testing.assert_array_equal(ids, np.sort(buf.row_ids()))
    np.testing.assert_array_equal(got[0]["next", "obs"].numpy(), got[0]["obs"].numpy() + 1)


def test_iter_into_gathers_into_arrays_keyed_by_tensordict_keys(buf):
    into = {name_to_key(name): np.full((32, *f.shape), -1, f.dtype) for name, f in FIELDS.items()}
    into["index"] = np.full(32, -1, np.int64)
    td = next(dataset(buf, as_tensordict=True).iter_into(lambda: into))
    assert_tensordicts_of([td], [next(iter(dataset(buf)))])
    for key, array in into.items():  # gathered straight into the given arrays: views, no copy
        assert td[key].data_ptr() == array.ctypes.data, key


@pytest.mark.parametrize("mode", ["sample", "epoch"])
def test_state_dicts_and_resume_match_the_dict_dataset(buf, mode):
    plain, tds = dataset(buf, mode), dataset(buf, mode, as_tensordict=True)
    it_plain, it_td = iter(plain), iter(tds)
    head = [next(it_plain) for _ in range(7)]
    head_td = [next(it_td) for _ in range(7)]
    assert_tensordicts_of(head_td, head)
    state = tds.state_dict()
    assert state == plain.state_dict() and state["batch"] == 7
    resumed = dataset(buf, mode, as_tensordict=True)
    resumed.load_state_dict(pickle.loads(pickle.dumps(state)))
    assert_tensordicts_of(list(itertools.islice(resumed, 6)), list(itertools.islice(it_plain, 6)))


def test_stateful_loader_resume_through_the_ring(buf):
    want = copied(itertools.islice(dataset(buf), 30))
    ds = dataset(buf, as_tensordict=True)
    first = loader(ds, 2, cls=StatefulDataLoader)
    it = iter(first)
    head = copied(next(it) for _ in range(12))
    state = first.state_dict()
    del it
    resumed = loader(dataset(buf, as_tensordict=True), 2, cls=StatefulDataLoader)
    resumed.load_state_dict(state)
    rest = copied(itertools.islice(resumed, 18))
    assert_tensordicts_of(head + rest, want)
    assert resumed.dataset.worker_ring.stats()["received"] >= 18


# ---- fork workers: TensorDicts of ring slots --------------------------------------------------------


def test_fork_workers_hand_over_slots_that_unpickle_into_tensordicts(buf):
    want = copied(itertools.islice(dataset(buf), 40))
    ds = dataset(buf, as_tensordict=True)
    got, inside = [], 0
    for td in itertools.islice(loader(ds, 2), 40):
        inside += in_ring(td, ds.worker_ring)
        got.append(td.clone())
    assert_tensordicts_of(got, want)
    stats = ds.worker_ring.stats()
    assert inside == 40 and stats["received"] >= 40 and stats["fallbacks"] == 0


def test_slots_are_reused_as_the_tensordicts_die(buf):
    ds = dataset(buf, as_tensordict=True)
    for td in itertools.islice(loader(ds, 2, prefetch_factor=2), 300):  # no gc.collect: freed as they die
        assert in_ring(td, ds.worker_ring)
    ring = ds.worker_ring
    assert int((ring._handed() > 0).sum()) <= 2 * (2 + 3) and ring.stats()["fallbacks"] == 0


def test_held_tensordicts_keep_their_slots_until_they_die(buf):
    want = copied(itertools.islice(dataset(buf), 60))
    ds = dataset(buf, as_tensordict=True)
    held = list(itertools.islice(loader(ds, 2), 60))  # more than the ring's slots per worker
    stats = ds.worker_ring.stats()
    assert stats["fallbacks"] > 0 and stats["states"]["held"] == sum(in_ring(td, ds.worker_ring) for td in held) > 0
    assert_tensordicts_of(held, want)
    leaf = held[0]["next", "obs"]
    del held
    gc.collect()
    assert ds.worker_ring.stats()["states"]["held"] == 1  # one leaf keeps its slot
    del leaf
    gc.collect()
    assert ds.worker_ring.stats()["states"]["held"] == 0


def test_a_flagged_handle_unpickles_into_a_tensordict_of_slot_views():
    ring = WorkerRing.for_batches({"obs": (np.float32, (2,)), "next_obs": (np.float32, (2,)),
                                   "index": (np.int64, ())}, rows=3, workers=1)
    slot = ring.claim(0)
    arrays = ring.arrays(slot)
    for k, v in {"obs": np.arange(6).reshape(3, 2), "next_obs": np.arange(6).reshape(3, 2) + 1,
                 "index": [4, 5, 6]}.items():
        arrays[k][...] = v
    handle = ring.hand_over(slot, arrays).received_as_tensordict()
    assert isinstance(handle, SlotBatch) and handle.tensordict and "tensordict" in repr(handle)
    td = pickle.loads(pickle.dumps(handle))
    assert type(td) is TensorDict and td.batch_size == torch.Size([3]) and ring._mm[slot] == HELD
    assert td["next", "obs"].tolist() == [[1, 2], [3, 4], [5, 6]] and td["index"].tolist() == [4, 5, 6]
    assert in_ring(td, ring)
    survivor = td["next", "obs"][1:]
    del td
    assert ring._mm[slot] == HELD  # without gc: nothing but refcounts
    del survivor
    assert ring._mm[slot] == FREE


# ---- without the ring: the dataset yields the TensorDict itself ------------------------------------------


def test_spawn_workers_and_no_ring_send_tensordicts(buf):
    want = copied(itertools.islice(dataset(buf), 6))
    ds = dataset(buf, as_tensordict=True)
    spawned = list(itertools.islice(loader(ds, 1, context="spawn"), 6))
    assert_tensordicts_of(spawned, want)
    assert ds.worker_ring.stats()["received"] == 0
    unringed = dataset(buf, as_tensordict=True, worker_ring=False)
    assert unringed.worker_ring is None
    forked = list(itertools.islice(loader(unringed, 2), 6))
    assert_tensordicts_of(forked, want)
    for td in spawned + forked:  # packed in the worker: one shared-memory storage per batch
        assert len({t.untyped_storage().data_ptr() for t in td.values(True, True)}) == 1
    assert all(type(td) is TensorDict for td in itertools.islice(unringed, 2))


def test_pin_memory_loader_passes_tensordicts(buf):
    want = copied(itertools.islice(dataset(buf), 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator: torch warns, does not pin
        got = copied(itertools.islice(loader(dataset(buf, as_tensordict=True), 2, pin_memory=True), 8))
    assert_tensordicts_of(got, want)


def test_keep_batch_hands_on_its_argument():
    td = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
    assert keep_batch(td) is td and pickle.loads(pickle.dumps(keep_batch)) is keep_batch


# ---- to_device ------------------------------------------------------------------------------------------


def test_to_device_gathers_a_tensordict_dataset_into_its_slots(buf):
    want = copied(itertools.islice(dataset(buf), 9))
    ds = dataset(buf, as_tensordict=True)
    pre = dr.to_device(ds, "cpu", prefetch=1)
    got = []
    for td in itertools.islice(pre, 9):
        slots = [t.data_ptr() for s in pre.slots for t in s.host.values()]
        assert all(t.data_ptr() in slots for t in td.values(include_nested=True, leaves_only=True))
        got.append(td.clone())
    assert_tensordicts_of(got, want)
    assert sum(s.copies for s in pre.slots) == 1 and sum(s.gathers for s in pre.slots) >= 9  # only the first copied
    assert set(pre.slots[0].host) == set(LEAVES)
    assert pre.state_dict() == {**ds.state_dict(), "batch": 9}


def test_to_device_keeps_any_tensordict_layout():
    src = [TensorDict({"next_x": torch.full((4, 2), float(i)), ("a", "b"): torch.arange(4) + i,
                       "next": {"r": torch.ones(4, 1) * i}}, batch_size=[4]) for i in range(5)]
    out = copied(dr.to_device(src, "cpu", prefetch=2))
    for td, ref in zip(out, src, strict=True):
        assert type(td) is TensorDict and td.batch_size == ref.batch_size
        assert list(td.keys(include_nested=True, leaves_only=True)) == list(ref.keys(True, True))
        assert (td == ref).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_device_cuda_hands_out_tensordicts_on_the_device(buf):
    want = copied(itertools.islice(dataset(buf), 6))
    got = list(itertools.islice(dr.to_device(dataset(buf, as_tensordict=True), "cuda", prefetch=2), 6))
    assert all(t.is_cuda for td in got for t in td.values(True, True))
    assert_tensordicts_of([td.cpu() for td in got], want)


def test_to_device_from_a_worker_loader_of_tensordicts(buf):
    want = copied(itertools.islice(dataset(buf), 10))
    got = copied(itertools.islice(dr.to_device(loader(dataset(buf, as_tensordict=True), 2), "cpu"), 10))
    assert_tensordicts_of(got, want)


# ---- refusals ------------------------------------------------------------------------------------------


def test_without_tensordict_the_package_is_named(buf, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensordict", None)  # `import tensordict` now raises ImportError
    with pytest.raises(ImportError, match=r"as_tensordict=True. needs the tensordict package: pip install tensordict"):
        dataset(buf, as_tensordict=True)
    assert set(next(iter(dataset(buf)))) == {*FIELDS, "index"}  # dict batches need no tensordict


def test_fields_that_make_no_tensordict_are_refused_at_once(tmp_path):
    fields = {"next": dr.Field((), "float32"), "next_obs": dr.Field((), "float32")}
    buf = dr.ReplayBuffer.create(os.fspath(tmp_path / "clash"), fields, None, chunk_rows=8)
    buf.extend({"next": np.zeros(4, np.float32), "next_obs": np.zeros(4, np.float32)})
    buf.flush()
    with pytest.raises(ValueError, match="both a tensor and a nested TensorDict"):
        make_dataset(buf, 2, as_tensordict=True)
    assert len(next(iter(make_dataset(buf, 2)))["next"]) == 2
    buf.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_row_dataset_gathers_prioritized_batches_as_tensordicts(tmp_path, workers):
    """`RowDataset(as_tensordict=True)` behind an `IndexBatchSampler`: the rows of each drawn
    index batch, with its weights, laid out by ``dr.to_tensordict``."""
    buf = dr.ReplayBuffer.create(os.fspath(tmp_path / "per"), FIELDS, capacity=400, chunk_rows=64,
                                 sampler=dr.Prioritized())
    ids = np.arange(300)
    obs = np.stack([ids, -ids, ids % 7], axis=-1).astype(np.float32)
    buf.extend({"obs": obs, "next_obs": obs + 1, "act": ids, "done": ids % 9 == 8,
                "info__cost": np.zeros((300, 2), np.float32)})
    buf.update_priorities(ids, 1.0 + ids % 4)
    buf.flush(durable=False)
    sampler = dr.IndexBatchSampler(buf, 16, seed=2, num_batches=5)
    got = copied(loader(dr.RowDataset(buf, as_tensordict=True), workers, sampler=sampler))
    want = [dr.RowDataset(buf)[b] for b in dr.IndexBatchSampler(buf, 16, seed=2, num_batches=5)]
    assert_tensordicts_of(got, want)
    assert all(("weight" in td.keys()) and td["act"].tolist() == td["index"].tolist() for td in got)
    buf.close()
