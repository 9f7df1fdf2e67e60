"""Tests of torch outputs (``sample``/``rows`` with ``format=``: tensors sharing memory, TensorDicts
in TorchRL's layout) and of `dr.torchrl.ZarrStorage` inside TorchRL's own replay buffers, compared
row for row with TorchRL's ``LazyTensorStorage`` given the same data and seeds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import diskreplay as dr

torch = pytest.importorskip("torch", reason="torch outputs need torch")
tensordict = pytest.importorskip("tensordict", reason="TensorDict outputs need the tensordict package")
torchrl_data = pytest.importorskip("torchrl.data", reason="ZarrStorage needs torchrl")

from tensordict import TensorDict  # noqa: E402
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import (  # noqa: E402
    PrioritizedSampler,
    PrioritizedSliceSampler,
    SliceSampler,
)
from torchrl.data.replay_buffers.writers import RoundRobinWriter  # noqa: E402

from diskreplay.torch.formats import as_tensor, key_to_name, name_to_key, to_tensordict  # noqa: E402

FIELDS = {"obs": dr.Field((2,), "float32"), "next_obs": dr.Field((2,), "float32"),
          "done": dr.Field((), "bool"), "img": dr.Field((2,), "uint8")}


def rows(n: int) -> dict[str, np.ndarray]:
    i = np.arange(n)
    return {"obs": np.stack([i, -i], 1).astype(np.float32), "next_obs": np.stack([i + 1, -i - 1], 1).astype(np.float32),
            "done": i % 3 == 2, "img": np.stack([i, 2 * i], 1).astype(np.uint8)}


@pytest.fixture
def buf(tmp_path):
    b = dr.ReplayBuffer.create(tmp_path / "b", FIELDS, capacity=16, chunk_rows=4, seed=3)
    b.extend(rows(10))
    yield b
    b.close()


# ---- format= on sample and rows ----------------------------------------------------------------

def test_sample_torch_has_the_numpy_values_and_dtypes(buf):
    ref = buf.sample(5, seed=7)
    got = buf.sample(5, seed=7, format="torch")
    assert set(got) == set(ref) == {"obs", "next_obs", "done", "img", "index"}
    for name, array in ref.items():
        assert isinstance(got[name], torch.Tensor) and got[name].device.type == "cpu"
        np.testing.assert_array_equal(got[name].numpy(), array)
    assert got["done"].dtype == torch.bool and got["img"].dtype == torch.uint8 and got["index"].dtype == torch.int64
    np.testing.assert_array_equal(got["obs"][:, 0].numpy(), got["index"].numpy())  # row i holds obs (i, -i)


def test_torch_tensors_share_the_gathered_arrays_memory():
    array = np.arange(6, dtype=np.float32).reshape(3, 2)
    tensor = as_tensor(array)
    tensor[1, 1] = 42.0
    assert array[1, 1] == 42.0
    flags = np.array([True, False])
    assert as_tensor(flags).dtype == torch.bool and np.shares_memory(as_tensor(flags).numpy(), flags)


def test_arrays_torch_cannot_view_are_copied_and_strings_refused():
    frozen = np.arange(4, dtype=np.int32)
    frozen.flags.writeable = False
    swapped = np.arange(4, dtype=">i4")
    backwards = np.arange(4, dtype=np.int64)[::-1]
    for array in (frozen, swapped, backwards):
        assert as_tensor(array).tolist() == array.tolist()
    assert as_tensor(swapped).dtype == torch.int32
    with pytest.raises(TypeError, match="no torch tensor type"):
        as_tensor(np.array(["a", "b"]))


def test_sample_as_tensordict_nests_next_fields(buf):
    ref = buf.sample(4, seed=1)
    td = buf.sample(4, seed=1, as_tensordict=True)
    assert isinstance(td, TensorDict) and td.batch_size == torch.Size([4])
    assert set(td.keys(include_nested=True, leaves_only=True)) == {"obs", ("next", "obs"), "done", "img", "index"}
    np.testing.assert_array_equal(td["next", "obs"].numpy(), ref["next_obs"])
    np.testing.assert_array_equal(td["index"].numpy(), ref["index"])
    same = buf.sample(4, seed=1, format="tensordict")
    assert (same == td).all()


def test_rows_in_every_format(buf):
    ids = np.array([2, 9, 0])
    assert buf.rows(ids, format="torch")["obs"].tolist() == [[2, -2], [9, -9], [0, 0]]
    td = buf.rows(ids, format="tensordict")
    assert td.batch_size == torch.Size([3]) and td["next", "obs"].tolist() == [[3, -3], [10, -10], [1, -1]]
    assert td["done"].tolist() == [True, False, False]
    assert isinstance(buf[ids]["obs"], np.ndarray)
    square = buf.rows(np.array([[1, 2], [3, 4]]), format="tensordict")
    assert square.batch_size == torch.Size([2]) and square["img"].shape == (2, 2, 2)


def test_a_bad_format_raises_before_anything_is_drawn(buf):
    state = buf.rng.bit_generator.state
    with pytest.raises(ValueError, match="format must be one of"):
        buf.sample(4, format="jax")
    with pytest.raises(ValueError, match="as_tensordict=True"):
        buf.sample(4, format="torch", as_tensordict=True)
    with pytest.raises(ValueError, match="format must be one of"):
        buf.rows([1], format="pandas")
    assert buf.rng.bit_generator.state == state


def test_dataset_batches_convert_to_tensordicts(buf):
    buf.flush()
    batch = next(iter(buf.as_dataset(4, seed=0)))
    td = to_tensordict(batch)
    assert td.batch_size == torch.Size([4]) and td["next", "obs"] is batch["next_obs"]
    np.testing.assert_array_equal(td["obs"][:, 0].numpy(), td["index"].numpy())


def test_field_names_and_tensordict_keys_map_both_ways():
    pairs = {"obs": "obs", "next_obs": ("next", "obs"), "a__b": ("a", "b"), "next_a__b": ("next", "a", "b"),
             "next": "next", "nextobs": "nextobs", "next_": "next_", "__next_value": "next_value",
             "__next_a__b": ("next_a", "b"), "a__next_b": ("a", "next_b"), "next_next_b": ("next", "next_b")}
    for name, key in pairs.items():
        assert name_to_key(name) == key and key_to_name(key) == name
    for bad in (("a__b", "c"), ("", "x")):
        with pytest.raises(ValueError, match="cannot be a field name"):
            key_to_name(bad)
    with pytest.raises(ValueError, match="both a tensor and a nested TensorDict"):
        to_tensordict({"next": np.zeros(2), "next_obs": np.zeros(2)})
    with pytest.raises(ValueError, match=r"\[\('a', 'b'\)\] would be both a tensor and a nested TensorDict"):
        to_tensordict({"a__b": np.zeros(2), "a__b__c": np.zeros(2)})


def test_importing_diskreplay_imports_neither_torchrl_nor_tensordict():
    assert dr.torchrl.ZarrStorage.__module__ == "diskreplay.integrations.torchrl"
    code = "import sys, diskreplay; assert 'torchrl' not in sys.modules and 'tensordict' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- dr.torchrl.ZarrStorage inside TorchRL's replay buffers ------------------------------------

def transitions(n: int, start: int = 0) -> TensorDict:
    """``n`` transitions numbered ``start...``: five-step episodes, nested next keys."""
    i = torch.arange(start, start + n)
    obs = torch.stack([i, -i], 1).float()
    return TensorDict({"obs": obs, "action": i % 4, "episode": i // 5,
                       ("next", "obs"): obs + 1, ("next", "done"): (i % 5 == 4)[:, None]}, batch_size=[n])


def pair(tmp_path, size: int = 10, **kwargs):
    """A ZarrStorage buffer and a LazyTensorStorage one, made alike (``kwargs``: one sampler each),
    both with TorchRL's default collate_fn."""
    make = {k: v() for k, v in kwargs.items()}
    ours = TensorDictReplayBuffer(storage=dr.torchrl.ZarrStorage(size, tmp_path / "z"), batch_size=4, **make)
    make = {k: v() for k, v in kwargs.items()}
    return ours, TensorDictReplayBuffer(storage=LazyTensorStorage(size), batch_size=4, **make)


def same_draws(ours, ref, seed: int, times: int = 3) -> list:
    draws = []
    for k in range(times):
        torch.manual_seed(seed + k)
        np.random.seed(seed + k)  # TorchRL's PrioritizedSampler draws with numpy's global generator
        a = ours.sample()
        torch.manual_seed(seed + k)
        np.random.seed(seed + k)
        b = ref.sample()
        assert a["index"].tolist() == b["index"].tolist()
        for key in b.keys(include_nested=True, leaves_only=True):
            assert torch.equal(a[key], b[key]), key
        draws.append(a)
    return draws


def test_random_sampler_draws_what_lazy_tensor_storage_draws(tmp_path):
    ours, ref = pair(tmp_path)
    for rb in (ours, ref):
        rb.extend(transitions(7))
        rb.extend(transitions(6, 7))  # wraps: slots 0-2 now hold rows 10-12
        rb.add(transitions(1, 13)[0])
    assert len(ours) == len(ref) == 10
    assert ours.storage[:]["obs"][:, 0].tolist() == [10, 11, 12, 13, 4, 5, 6, 7, 8, 9]
    batch = same_draws(ours, ref, seed=0)[0]
    assert batch.batch_size == torch.Size([4]) and batch["next", "done"].dtype == torch.bool
    assert ours.storage.next_slot == 4 and ours.storage.buffer.fields["next_obs"].shape == (2,)


class NumpyTree:
    """A stand-in for TorchRL's C++ segment trees (absent from some builds): the same API, O(n)."""

    neutral = 0.0

    def __init__(self, size: int):
        self.values = np.full(size, self.neutral)

    def __getitem__(self, index):
        return self.values[np.asarray(index)]

    def __setitem__(self, index, value):
        self.values[np.asarray(index)] = np.asarray(value)


class NumpySumTree(NumpyTree):
    def query(self, start, end):
        return float(self.values[start:end].sum())

    def scan_lower_bound(self, mass):
        return np.searchsorted(np.cumsum(self.values), np.asarray(mass), side="right")


class NumpyMinTree(NumpyTree):
    neutral = np.inf

    def query(self, start, end):
        return float(self.values[start:end].min())


@pytest.fixture
def segment_trees(monkeypatch):
    """TorchRL's segment trees, or numpy stand-ins where this torchrl was built without them."""
    from torchrl.data.replay_buffers.samplers import prioritized

    for bits in ("32", "64"):
        if getattr(prioritized, f"SumSegmentTreeFp{bits}", None) is None:
            monkeypatch.setattr(prioritized, f"SumSegmentTreeFp{bits}", NumpySumTree)
            monkeypatch.setattr(prioritized, f"MinSegmentTreeFp{bits}", NumpyMinTree)


def test_prioritized_sampler_updates_and_draws_as_with_lazy_tensor_storage(tmp_path, segment_trees):
    ours, ref = pair(tmp_path, sampler=lambda: PrioritizedSampler(10, alpha=0.8, beta=0.6))
    for rb in (ours, ref):
        rb.extend(transitions(12))
        rb.update_priority(torch.tensor([0, 3, 7]), torch.tensor([5.0, 0.01, 20.0]))
    draws = same_draws(ours, ref, seed=11, times=4)
    drawn = torch.cat([d["index"] for d in draws]).tolist()
    assert drawn.count(7) > drawn.count(3)
    ours.update_tensordict_priority(draws[0].set("td_error", torch.ones(4)))
    ref.update_tensordict_priority(draws[0].clone().set("td_error", torch.ones(4)))
    same_draws(ours, ref, seed=5)


def test_slice_sampler_cuts_the_same_trajectories(tmp_path):
    ours, ref = pair(tmp_path, size=20, sampler=lambda: SliceSampler(num_slices=2, traj_key="episode"))
    for rb in (ours, ref):
        rb.extend(transitions(20))
    batch = same_draws(ours, ref, seed=2)[0]
    episodes = batch["episode"].reshape(2, 2)
    assert (episodes[:, 0] == episodes[:, 1]).all()


def assert_slices_of_one_episode(batch, slices: int) -> None:
    """Each of the batch's ``slices`` slices is consecutive steps of one episode."""
    steps, episodes = batch["obs"][:, 0].reshape(slices, -1), batch["episode"].reshape(slices, -1)
    assert (steps.diff(dim=1) == 1).all() and (episodes == episodes[:, :1]).all()


SLICE_SAMPLERS = {
    "slice": lambda: SliceSampler(num_slices=2, traj_key="episode"),
    "prioritized_slice": lambda: PrioritizedSliceSampler(20, alpha=0.7, beta=0.5, num_slices=2, traj_key="episode"),
    "slice_by_end": lambda: SliceSampler(num_slices=2, end_key=("next", "done")),
}


@pytest.mark.parametrize("sampler", sorted(SLICE_SAMPLERS))
@pytest.mark.parametrize("added", [13, 20, 27])  # not full, full, full and wrapped (slots 0-6 overwritten)
def test_slice_samplers_cut_what_they_cut_from_lazy_tensor_storage(tmp_path, segment_trees, sampler, added):
    ours, ref = pair(tmp_path, size=20, sampler=SLICE_SAMPLERS[sampler])
    assert ours.storage.shape == torch.Size([0]) and ours.storage._total_shape == torch.Size([20])
    for rb in (ours, ref):
        rb.extend(transitions(added))
    assert ours.storage.shape == ref.storage.shape == torch.Size([min(added, 20)])
    assert ours.storage._len_along_dim0 == ref.storage._len_along_dim0 == min(added, 20)
    assert ours.storage._total_shape == ref.storage._total_shape == torch.Size([20])
    for batch in same_draws(ours, ref, seed=2, times=4):
        assert_slices_of_one_episode(batch, 2)
        assert batch["obs"][:, 0].min() >= added - 20
    ours.storage.close()


def test_keys_come_back_with_the_nesting_written_and_the_default_collate_samples(tmp_path):
    storage = dr.torchrl.ZarrStorage(8, tmp_path / "k")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=3)  # no collate_fn: TorchRL's default
    i = torch.arange(6)
    data = TensorDict({"next_value": i * 1.0, ("next", "value"): i * 2.0, ("next_a", "b"): i * 3,
                       ("a", "next_b"): i * 4, "obs": i[:, None] * 5.0}, batch_size=[6])
    rb.extend(data)
    keys = set(data.keys(include_nested=True, leaves_only=True))
    assert set(storage[:].keys(include_nested=True, leaves_only=True)) == keys
    assert set(storage.buffer.fields) == {"__next_value", "next_value", "__next_a__b", "a__next_b", "obs"}
    for key in keys:
        assert torch.equal(storage[:][key], data[key]), key
    torch.manual_seed(0)
    batch = rb.sample()
    assert batch.batch_size == torch.Size([3])
    for key in keys:
        assert torch.equal(batch[key], data[key][batch["index"]]), key
    storage.close()
    reopened = dr.torchrl.ZarrStorage(8, tmp_path / "k")
    assert torch.equal(reopened[:]["next_value"], i * 1.0) and torch.equal(reopened[:]["next", "value"], i * 2.0)
    reopened.close()

def test_plain_torchrl_replay_buffer_with_round_robin_writer(tmp_path):
    storage = dr.torchrl.ZarrStorage(6, tmp_path / "p")
    rb = torchrl_data.ReplayBuffer(storage=storage, writer=RoundRobinWriter(), batch_size=3,
                                   collate_fn=dr.torchrl.collate)
    rb.extend(transitions(8))
    assert len(rb) == 6 and storage.get(torch.tensor([0, 1]))["obs"][:, 0].tolist() == [6, 7]
    assert storage.get(-1)["obs"].tolist() == [5, -5] and storage.get(2).batch_size == torch.Size([])
    torch.manual_seed(0)
    assert rb.sample().batch_size == torch.Size([3])
    assert storage.contains(5) and not storage.contains(6)


def test_state_dict_round_trip_and_reopening_gives_the_rows_back(tmp_path):
    ours, _ = pair(tmp_path, size=10)
    ours.extend(transitions(13))
    state = ours.state_dict()
    assert state["_storage"] == {"url": str(tmp_path / "z"), "max_size": 10, "rows_added": 13, "offset": 0}
    ours.storage.close()
    storage = dr.torchrl.ZarrStorage(10, tmp_path / "z")
    again = TensorDictReplayBuffer(storage=storage, batch_size=4, collate_fn=dr.torchrl.collate)
    again.load_state_dict(state)
    assert storage[:]["obs"][:, 0].tolist() == [10, 11, 12, 3, 4, 5, 6, 7, 8, 9]
    again.extend(transitions(2, 13))
    assert storage[:]["obs"][:, 0].tolist() == [10, 11, 12, 13, 14, 5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="its rows_added is 13, the storage's 15"):
        again.load_state_dict(state)
    storage.close()


def test_a_full_ring_lines_up_with_a_fresh_writer(tmp_path):
    storage = dr.torchrl.ZarrStorage(4, tmp_path / "f")
    TensorDictReplayBuffer(storage=storage, collate_fn=dr.torchrl.collate).extend(transitions(6))
    storage.close()
    reopened = dr.torchrl.ZarrStorage(4, tmp_path / "f")
    assert reopened.next_slot == 0 and reopened[:]["obs"][:, 0].tolist() == [2, 3, 4, 5]
    TensorDictReplayBuffer(storage=reopened, collate_fn=dr.torchrl.collate).extend(transitions(1, 6))
    assert reopened[:]["obs"][:, 0].tolist() == [6, 3, 4, 5]
    reopened.close()


def test_what_the_storage_refuses(tmp_path):
    storage = dr.torchrl.ZarrStorage(4, tmp_path / "r")
    rb = TensorDictReplayBuffer(storage=storage, collate_fn=dr.torchrl.collate)
    with pytest.raises(RuntimeError, match="holds no rows"):
        storage.get(0)
    rb.extend(transitions(2))
    with pytest.raises(ValueError, match="next write must go to slot 2, got slots starting at 0"):
        storage.set(torch.tensor([0]), transitions(1))
    with pytest.raises(NotImplementedError, match="only appends"):
        storage[1] = transitions(1)[0]
    with pytest.raises(TypeError, match="stores TensorDicts"):
        storage.set(2, torch.zeros(3))
    with pytest.raises(IndexError, match="holds 2 rows"):
        storage.get(3)
    storage.close()
    with pytest.raises(ValueError, match="ZarrStorage.max_size=5. needs one lane of 5 rows"):
        dr.torchrl.ZarrStorage(5, tmp_path / "r")
    with pytest.raises(ValueError, match="max_size must be an int >= 1"):
        dr.torchrl.ZarrStorage(0, tmp_path / "x")


def test_empty_forgets_every_row_and_writing_starts_at_slot_zero(tmp_path):
    ours, _ = pair(tmp_path, size=4)
    ours.extend(transitions(3))
    ours.empty()
    assert len(ours) == 0 and ours.storage.next_slot == 0
    ours.extend(transitions(2, 100))
    assert ours.storage[:]["obs"][:, 0].tolist() == [100, 101]
    ours.storage.close()
