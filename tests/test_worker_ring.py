"""Tests of the worker ring (diskreplay.torch.shared_ring, issue #13): fork DataLoader workers gather
batches into shared-memory slots and hand over slot numbers; the DataLoader's process sees dicts
of tensors viewing the slots, freed when the last view dies. Values must equal the in-process
stream exactly, every fallback must give the same values, and nothing may overwrite a batch in use.
Real DataLoaders with fork (and spawn) worker processes; buffers of a few thousand rows."""

from __future__ import annotations

import copy
import gc
import itertools
import os
import pickle
import subprocess
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

import diskreplay as dr
from diskreplay.sampling import draws
from diskreplay.torch import batch_rng, shared_ring
from diskreplay.torch.batch_rng import BatchRngs
from diskreplay.torch.data import make_dataset
from diskreplay.torch.shared_ring import FREE, HELD, SENT, SlotBatch, WorkerRing

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "done": dr.Field((), "bool")}
CACHE = 4 * 2**20


def make_buf(path, steps: int = 1000, num_envs: int = 2) -> dr.ReplayBuffer:
    """Rows whose ``act`` is the row id and ``obs`` derived from it; an episode ends every 50 steps."""
    buf = dr.ReplayBuffer.create(os.fspath(path), FIELDS, None, num_envs=num_envs, chunk_rows=64,
                                 compression=None, cache_bytes=CACHE)
    ids = np.arange(steps)[:, None] * num_envs + np.arange(num_envs)[None, :]
    obs = np.stack([ids, -ids, ids % 7], axis=-1).astype(np.float32)
    done = np.broadcast_to((np.arange(steps) % 50 == 49)[:, None], ids.shape)
    buf.extend({"obs": obs, "act": ids, "reward": (ids % 5).astype(np.float32), "done": done})
    buf.flush(durable=False)
    return buf


@pytest.fixture
def buf(tmp_path):
    b = make_buf(tmp_path / "buf")
    yield b
    b.close()


def fork_loader(ds, workers: int = 2, cls=DataLoader, **kw) -> DataLoader:
    return cls(ds, batch_size=None, num_workers=workers, multiprocessing_context=kw.pop("context", "fork"), **kw)


def as_numpy(batches) -> list[dict[str, np.ndarray]]:
    """Copies, made as the batches come (so their slots are free again at once)."""
    return [{k: v.numpy().copy() for k, v in b.items()} for b in batches]


def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for k in w:
            np.testing.assert_array_equal(np.asarray(g[k]), np.asarray(w[k]), err_msg=k)


def ring_pointers(ring: WorkerRing) -> tuple[int, int]:
    start = np.frombuffer(ring._mm, np.uint8).__array_interface__["data"][0]
    return start + ring.header_bytes, start + ring.nbytes


def in_ring(batch: dict[str, torch.Tensor], ring: WorkerRing) -> bool:
    lo, hi = ring_pointers(ring)
    return all(lo <= t.data_ptr() < hi for t in batch.values())


def reference(buf, n: int, **kw) -> list[dict[str, np.ndarray]]:
    """The first ``n`` batches of the same dataset iterated in this process."""
    return as_numpy(itertools.islice(make_dataset(buf, kw.pop("batch_size", 32), seed=5, cache_bytes=CACHE, **kw), n))


def sample_ds(buf, **kw):
    return make_dataset(buf, kw.pop("batch_size", 32), seed=5, cache_bytes=CACHE, **kw)


# ---- the per-batch generators --------------------------------------------------------------


@pytest.mark.parametrize("pool", [32, 1, 5])
@pytest.mark.parametrize("seed,rank,stride", [(0, 0, 1), (5, 1, 2), (2**40 + 3, 3, 3), (123456789, 0, 7)])
@pytest.mark.parametrize("compiled", [True, False])
def test_batch_rngs_equal_default_rng(seed, rank, stride, pool, compiled, monkeypatch):
    if not compiled:
        monkeypatch.setattr(draws, "_set_pcg64", None)
    rngs = BatchRngs(seed, rank, stride, pool=pool)
    for b in [*range(rank, 3000, stride), rank + 40 * stride, 2**32 - 5, 2**33, 7, 3000 + stride * 4090]:
        want = np.random.default_rng([seed, rank, b])
        got = rngs(b)
        assert got.bit_generator.state == want.bit_generator.state
        np.testing.assert_array_equal(got.integers(0, 10**9, 8), want.integers(0, 10**9, 8))


def test_batch_rngs_asked_again_start_afresh():
    """Asking for a batch's generator again (a retried draw) gives it in its initial state again."""
    rngs = BatchRngs(4, 0, 1, pool=8)
    for b in (0, 0, 1, 5, 5, 3, 3, 9):
        want = np.random.default_rng([4, 0, b]).integers(0, 10**9, 8)
        np.testing.assert_array_equal(rngs(b).integers(0, 10**9, 8), want)


def test_batch_rngs_pickle_and_copy_to_working_copies():
    """A copy has its own generators (a copy shares none of them with the original)."""
    rngs = BatchRngs(3, 1, 2)
    rngs(1)
    for twin in (pickle.loads(pickle.dumps(rngs)), copy.deepcopy(rngs), copy.copy(rngs)):
        for b in (1, 5, 99):
            want = np.random.default_rng([3, 1, b]).integers(0, 10**9, 8)
            assert twin(b) is not rngs(b)
            np.testing.assert_array_equal(twin(b).integers(0, 10**9, 8), want)


class _GivenWords(np.random.bit_generator.ISeedSequence):
    """A seed sequence that hands PCG64 the words it was given (to seed numpy's PCG64 directly)."""

    def __init__(self, words):
        self.words = np.asarray(words, np.uint64)

    def generate_state(self, n_words, dtype=np.uint32):
        return self.words[:n_words].astype(dtype)


def test_pcg64_states_equal_numpy_seeding_with_carries():
    """The vectorised 128-bit seeding equals numpy's for words that carry through every limb."""
    rng = np.random.default_rng(0)
    words = [[0, 0, 0, 0], [2**64 - 1] * 4, [2**64 - 1, 0, 2**63, 2**32 - 1], [2**32, 2**32 - 1, 1, 2**64 - 2],
             *rng.integers(0, 2**64, size=(200, 4), dtype=np.uint64, endpoint=False).tolist()]
    got = batch_rng._pcg64_states(np.array(words, np.uint64).T)
    for w, (state_hi, state_lo, inc_hi, inc_lo) in zip(words, got.tolist()):
        want = np.random.PCG64(_GivenWords(w)).state["state"]
        assert (state_hi << 64 | state_lo, inc_hi << 64 | inc_lo) == (want["state"], want["inc"])


# ---- fork workers use the ring, values exact -----------------------------------------------


@pytest.mark.parametrize("mode", ["sample", "epoch"])
def test_fork_workers_hand_over_slots_with_exact_values(buf, mode):
    kw = {"mode": mode, **({"shuffle": "global"} if mode == "epoch" else {})}
    n = 40 if mode == "sample" else None
    want = reference(buf, n, **kw)
    ds = sample_ds(buf, **kw)
    got, inside = [], 0
    for batch in itertools.islice(fork_loader(ds), n):
        inside += in_ring(batch, ds.worker_ring)
        got.append({k: v.numpy().copy() for k, v in batch.items()})
    if mode == "epoch":  # workers interleave differently in epoch mode: compare the rows
        def order(bs):
            return np.argsort(np.concatenate([b["index"] for b in bs]))

        def cat(bs, k):
            return np.concatenate([b[k] for b in bs])[order(bs)]

        for k in want[0]:
            np.testing.assert_array_equal(cat(got, k), cat(want, k))
    else:
        assert_same(got, want)
    stats = ds.worker_ring.stats()
    assert inside == len(got) and stats["received"] >= len(got) and stats["fallbacks"] == 0
    assert stats["handed_over"] >= len(got)


def test_slots_are_reused_when_batches_die(buf):
    ds = sample_ds(buf)
    loader = fork_loader(ds, prefetch_factor=2)
    for batch in itertools.islice(loader, 300):
        assert in_ring(batch, ds.worker_ring)
    used = int((ds.worker_ring._handed() > 0).sum())
    assert used <= 2 * (2 + 3)  # per worker: prefetch_factor in flight + the few being consumed
    assert ds.worker_ring.stats()["fallbacks"] == 0


def test_held_batches_are_never_overwritten(buf):
    want = reference(buf, 100)
    ds = sample_ds(buf)
    held = list(itertools.islice(fork_loader(ds), 100))  # many more than the ring's slots
    stats = ds.worker_ring.stats()
    assert stats["fallbacks"] > 0 and stats["received"] >= 2 * shared_ring.DEFAULT_SLOTS_PER_WORKER - 4
    assert stats["states"]["held"] == sum(in_ring(b, ds.worker_ring) for b in held)
    assert_same(held, want)
    del held
    gc.collect()
    assert ds.worker_ring.stats()["states"]["held"] == 0


def test_views_keep_the_slot_until_the_last_one_dies():
    ring = WorkerRing.for_batches({"obs": (np.float32, (3,)), "index": (np.int64, ())}, rows=4, workers=1)
    slot = ring.claim(0)
    arrays = ring.arrays(slot)
    arrays["obs"][...] = np.arange(12).reshape(4, 3)
    arrays["index"][...] = [7, 8, 9, 10]
    extra = np.array([1.5, 2.5], np.float32)  # not in the slot: copied after the planned arrays
    handle = ring.hand_over(slot, {"obs": arrays["obs"], "index": arrays["index"], "w": extra})
    assert isinstance(handle, SlotBatch) and ring._mm[slot] == SENT
    batch = pickle.loads(pickle.dumps(handle))
    assert ring._mm[slot] == HELD and ring.received == 1
    np.testing.assert_array_equal(batch["w"].numpy(), extra)
    np.testing.assert_array_equal(batch["index"].numpy(), [7, 8, 9, 10])
    survivor = batch["obs"][1:].numpy()  # a view of a view (numpy base collapsing, tensor storage)
    del batch
    gc.collect()
    assert ring._mm[slot] == HELD
    np.testing.assert_array_equal(survivor[0], [3, 4, 5])
    del survivor
    gc.collect()
    assert ring._mm[slot] == FREE


def test_handle_outside_its_process_is_refused():
    ring = WorkerRing.for_batches({"x": (np.float32, ())}, rows=2, workers=1)
    slot = ring.claim(0)
    data = pickle.dumps(ring.hand_over(slot, {"x": ring.arrays(slot)["x"]}))
    ring.owner = -1  # as if unpickled in a process that does not own the ring
    with pytest.raises(RuntimeError, match="does not own its ring"):
        pickle.loads(data)
    with pytest.raises(TypeError):
        pickle.dumps(ring)


# ---- fallbacks: same values --------------------------------------------------------------------


def test_spawn_workers_fall_back_to_tensors(buf):
    want = reference(buf, 6)
    ds = sample_ds(buf)
    got = list(itertools.islice(fork_loader(ds, context="spawn"), 6))
    assert_same(as_numpy(got), want)
    assert ds.worker_ring.stats()["received"] == 0
    assert all(len({t.untyped_storage().data_ptr() for t in b.values()}) == 1 for b in got)  # packed


def test_worker_ids_beyond_the_ring_fall_back(buf, monkeypatch):
    monkeypatch.setattr(shared_ring, "DEFAULT_WORKERS", 1)
    want = reference(buf, 20)
    ds = sample_ds(buf)
    got, inside = [], []
    for batch in itertools.islice(fork_loader(ds), 20):  # not kept: worker 0 always has a free slot
        inside.append(in_ring(batch, ds.worker_ring))
        got.append({k: v.numpy().copy() for k, v in batch.items()})
    assert_same(got, want)
    assert inside == [True, False] * 10  # batches alternate between workers; worker 1 has no slots


# a slot holds 32 batches of plain rows: a sequence batch of 32 x 160 steps does not fit
@pytest.mark.parametrize("options,fits", [({"n_step": 3, "gamma": 0.9}, True), ({"seq_len": 160, "pad": True}, False)])
def test_transformed_batches_are_copied_into_slots_or_fall_back(buf, options, fits):
    want = reference(buf, 10, sample_options=options)
    ds = sample_ds(buf, sample_options=options)
    got = list(itertools.islice(fork_loader(ds), 10))
    assert_same(as_numpy(got), want)
    stats = ds.worker_ring.stats()
    assert (stats["received"] >= 10 and stats["fallbacks"] == 0) if fits else (
        stats["received"] == 0 and stats["fallbacks"] >= 10)


def test_slots_of_a_dead_loader_are_reclaimed(buf, monkeypatch):
    monkeypatch.setattr(shared_ring, "DEFAULT_SLOTS_PER_WORKER", 3)
    ds = sample_ds(buf)
    for _ in range(3):  # each loader is shut down with batches in flight: their slots stay SENT
        it = iter(fork_loader(ds, workers=1, prefetch_factor=2))
        for _ in range(5):
            next(it)
        del it
        gc.collect()
    gone = subprocess.Popen(["true"])
    gone.wait()
    ring = ds.worker_ring
    for slot in range(3):  # and, for certain, every slot of worker 0 claimed by a process now gone
        ring._mm[slot] = SENT
        ring._pids()[slot] = gone.pid
    before = ring.stats()
    want = reference(buf, 30)
    assert_same(as_numpy(itertools.islice(fork_loader(ds, workers=1), 30)), want)
    # the dead claimant's slots were taken back and used; how many batches fit the 3 slots rather
    # than falling back depends on how fast this process frees them (prefetch 2 + the batch held)
    assert all(ring._pids()[slot] != gone.pid for slot in range(3))
    assert ring.stats()["received"] - before["received"] >= 10


# ---- the rest of the DataLoader feature set ---------------------------------------------------


def test_persistent_workers_two_epochs_exactly_once(buf):
    ds = make_dataset(buf, 50, "epoch", seed=3, cache_bytes=CACHE)
    loader = fork_loader(ds, persistent_workers=True)
    for _ in range(2):
        ids = np.sort(np.concatenate([b["index"].numpy().copy() for b in loader]))
        np.testing.assert_array_equal(ids, np.sort(buf.row_ids()))
    assert ds.worker_ring.stats()["received"] >= 2 * 40 and ds.worker_ring.stats()["fallbacks"] == 0


def test_stateful_loader_resume_is_exact_through_the_ring(buf):
    want = reference(buf, 30)
    ds = sample_ds(buf)
    loader = fork_loader(ds, cls=StatefulDataLoader)
    it = iter(loader)
    first = as_numpy(next(it) for _ in range(12))
    state = loader.state_dict()
    del it
    resumed = fork_loader(sample_ds(buf), cls=StatefulDataLoader)
    resumed.load_state_dict(state)
    rest = as_numpy(itertools.islice(resumed, 18))
    assert_same(first + rest, want)
    assert resumed.dataset.worker_ring.stats()["received"] >= 18


def test_pin_memory_and_to_device_keep_working(buf):
    want = reference(buf, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator: torch warns, does not pin
        pinned = list(itertools.islice(fork_loader(sample_ds(buf), pin_memory=True), 12))
    assert_same(as_numpy(pinned), want)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    moved = [{k: v.cpu().numpy().copy() for k, v in b.items()}
             for b in itertools.islice(dr.to_device(fork_loader(sample_ds(buf)), device, prefetch=2), 12)]
    assert_same(moved, want)


def test_no_shared_memory_files_left(buf):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    ds = sample_ds(buf)
    for batch in itertools.islice(fork_loader(ds), 50):
        assert in_ring(batch, ds.worker_ring)
    del ds, batch
    gc.collect()
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # sem.*: multiprocessing's named semaphores, unlinked as soon as made (other tests' loaders run alongside)
    assert {name for name in after - before if not name.startswith("sem.")} == set()
