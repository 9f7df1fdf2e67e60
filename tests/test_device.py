"""Tests of diskreplay.torch.device.to_device: ordering, slot ring reuse, batch lifetime, event waits,
state lag. The ring logic runs on CPU; CUDA tests are marked ``cuda`` and skipped without a GPU."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

import diskreplay as dr
from diskreplay.torch.data import make_dataset
from diskreplay.torch.device import DevicePrefetcher, to_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def batches(n: int, size: int = 8, last: int | None = None):
    """Distinct batches: x[i] rows hold i*1000 + row; a shorter last batch if ``last``."""
    out = []
    for i in range(n):
        rows = last if (last and i == n - 1) else size
        x = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 1000 * i
        out.append({"x": x, "i": np.full(rows, i, dtype=np.int64), "tag": f"b{i}"})
    return out


class Counting:
    """An iterable that counts how many batches were pulled from it."""

    def __init__(self, items):
        self.items, self.pulled = items, 0

    def __iter__(self):
        for item in self.items:
            self.pulled += 1
            yield item


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_order_values_and_round_robin_slots(prefetch):
    src = batches(11, last=5)
    ring = prefetch + 2
    pre = to_device(src, "cpu", prefetch=prefetch)
    held, ptrs = [], []
    for k, out in enumerate(pre):
        torch.testing.assert_close(out["x"], src[k]["x"])
        assert out["i"].dtype == torch.int64 and int(out["i"][0]) == k and out["tag"] == f"b{k}"
        ptrs.append(out["x"].data_ptr())
        held.append(out)
        if k >= 1:  # documented lifetime: the previous batch is intact while you work on this one
            torch.testing.assert_close(held[k - 1]["x"], src[k - 1]["x"])
    assert len(held) == 11 and held[-1]["x"].shape == (5, 3)
    assert all(ptrs[k] == ptrs[k % ring] for k in range(11))  # slots reused round-robin
    assert len(set(ptrs[:ring])) == ring
    assert [s.copies for s in pre.slots] == [len(range(j, 11, ring)) for j in range(ring)]


def test_prefetch_depth_pulls_ahead():
    src = Counting(batches(10))
    pre = to_device(src, "cpu", prefetch=3)
    next(pre)
    assert src.pulled == 4  # the batch handed out plus 3 in flight
    next(pre)
    assert src.pulled == 5


def test_slot_waits_for_its_last_copy_before_refill():
    log = []

    class Event:
        def __init__(self, n):
            self.n = n

    class RecordingCopier:
        pin = False

        def __init__(self):
            self.made = 0

        def new_event(self):
            self.made += 1
            return Event(self.made)

        def wait(self, event):
            log.append(("wait", event.n))

        def copy(self, views, event):
            log.append(("copy", event.n))
            return {k: v.clone() for k, v in views.items()}

        def hand_over(self, out, event):
            log.append(("hand", event.n))
            return out

    pre = DevicePrefetcher(batches(7), "cpu", prefetch=1)
    pre.copier = RecordingCopier()
    assert len(list(pre)) == 7
    # 3 slots, 3 events (allocated once); every refill of a slot waits on that slot's event first
    assert pre.copier.made == 3
    copies = [n for kind, n in log if kind == "copy"]
    assert copies == [1, 2, 3, 1, 2, 3, 1]
    copy_at = [i for i, (kind, _) in enumerate(log) if kind == "copy"]
    for j, i in enumerate(copy_at[3:], start=3):
        n = log[i][1]
        assert log[i - 1] == ("wait", n)  # a refill waits on the event of the slot's last copy
        previous = copy_at[j - 3]
        assert ("hand", n) in log[previous:i]  # ... whose batch was handed out before


def test_batch_shape_change_reallocates_slot_once():
    src = batches(3) + [{"x": torch.zeros(20, 3), "i": np.zeros(20, np.int64), "tag": "big"}] + batches(2)
    got = list(to_device(src, "cpu", prefetch=0))
    assert got[3]["x"].shape == (20, 3)
    torch.testing.assert_close(got[-1]["x"], src[-1]["x"])


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        to_device([], "cpu", prefetch=-1)
    with pytest.raises(TypeError):
        next(to_device([torch.zeros(3)], "cpu"))
    with pytest.raises(ValueError, match="leading batch axis"):
        next(to_device([{"x": torch.tensor(1.0)}], "cpu"))
    assert list(to_device([], "cpu")) == []
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA"):
            to_device([], "cuda")


def test_state_dict_lags_prefetch(tmp_path):
    buf = dr.ReplayBuffer.create(os.fspath(tmp_path / "b"), {"x": dr.Field((2,), "float32")}, None,
                                 chunk_rows=64, compression=None, cache_bytes=2**20)
    buf.extend({"x": np.zeros((1000, 2), np.float32)})
    buf.flush()
    ds = make_dataset(buf, 50, "epoch", cache_bytes=2**20)
    pre = to_device(ds, "cpu", prefetch=2)
    assert pre.state_dict()["batch"] == 0
    for _ in range(5):
        next(pre)
    assert pre.state_dict()["batch"] == 5 and ds.state_dict()["batch"] == 7
    with pytest.raises(TypeError):
        to_device([{"x": torch.zeros(1)}], "cpu").state_dict()
    buf.close()


@pytest.mark.cuda
@cuda
def test_cuda_values_streams_and_pinned_slots():
    src = batches(9, size=64, last=10)
    pre = to_device(src, "cuda", prefetch=2)
    out = []
    for batch in pre:
        assert batch["x"].is_cuda and batch["i"].is_cuda
        out.append(batch)
        torch.cuda.current_stream().synchronize()
    for k, batch in enumerate(out):  # device batches stay valid after the ring wrapped
        torch.testing.assert_close(batch["x"].cpu(), src[k]["x"])
    assert all(t.is_pinned() for s in pre.slots for t in s.host.values())
    hosts = [s.host["x"].data_ptr() for s in pre.slots]
    assert len(set(hosts)) == len(pre.slots) == 4


@pytest.mark.cuda
@cuda
def test_cuda_consumer_stream_waits_for_copy():
    big = [{"x": torch.randn(4096, 1024)} for _ in range(4)]
    for k, batch in enumerate(to_device(big, "cuda", prefetch=2)):
        torch.testing.assert_close((batch["x"] * 2).cpu(), big[k]["x"] * 2)  # on the consumer stream


def test_resume_through_prefetcher_with_stateful_loader(tmp_path):
    from torchdata.stateful_dataloader import StatefulDataLoader
    buf = dr.ReplayBuffer.create(os.fspath(tmp_path / "b"), {"x": dr.Field((2,), "float32")}, None,
                                 chunk_rows=64, compression=None, cache_bytes=2**20)
    buf.extend({"x": np.arange(2000, dtype=np.float32).reshape(1000, 2)})
    buf.flush()

    def loader():
        ds = make_dataset(buf, 16, "sample", seed=2, cache_bytes=2**20)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")

    reference = [b["index"].clone() for b, _ in zip(loader(), range(12))]
    pre = to_device(loader(), "cpu", prefetch=2)
    head = [next(pre)["index"].clone() for _ in range(5)]
    state = pre.state_dict()  # as of batch 5, although the loader already produced 8
    del pre
    resumed = loader()
    resumed.load_state_dict(state)
    tail = [b["index"].clone() for b, _ in zip(to_device(resumed, "cpu", prefetch=2), range(7))]
    for got, want in zip(head + tail, reference):
        assert torch.equal(got, want)
    buf.close()


# ---- sources that gather straight into the slots ------------------------------------------------

GATHER_FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int16"), "done": dr.Field((), "bool")}


def _episodes_buffer(path, compression, derive_next=()):
    rng = np.random.default_rng(7)
    fields = {**GATHER_FIELDS, "next_obs": dr.Field((3,), "float32")}
    buf = dr.ReplayBuffer.create(os.fspath(path), fields, None, chunk_rows=32, compression=compression,
                                 cache_bytes=2**20, derive_next=derive_next)
    obs = rng.standard_normal((301, 3)).astype(np.float32)
    data = {"obs": obs[:-1], "act": rng.integers(-50, 50, 300).astype(np.int16), "done": rng.random(300) < 0.05}
    data["next_obs"] = obs[1:]
    buf.extend(data)
    buf.flush()
    return buf


@pytest.mark.parametrize("mode", ["sample", "epoch"])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("reads", ["cached", "mapped", "zstd-misses", "derived-next"])
def test_dataset_gathers_straight_into_the_slots(tmp_path, mode, prefetch, reads):
    """A diskreplay dataset handed to to_device directly fills the ring's slots itself: after the
    first batch (which sizes the ring) no host copy is made, the yielded CPU tensors are the slots,
    and the batches equal a plain iteration of the same dataset."""
    buf = _episodes_buffer(tmp_path / "b", "zstd" if reads == "zstd-misses" else None,
                           derive_next=("obs",) if reads == "derived-next" else ())
    cache = {"cached": 2**20, "mapped": 4096, "zstd-misses": 4096, "derived-next": 2**20}[reads]

    def dataset():
        return make_dataset(buf, 24, mode, seed=3, cache_bytes=cache, shuffle_window=2)
    count = 13  # epoch mode: 300 rows = 12 batches of 24 and a short one of 12
    want = [{k: v.clone() for k, v in b.items()} for b in itertools.islice(dataset(), count)]
    pre = to_device(dataset(), "cpu", prefetch=prefetch)
    got = [{k: v.clone() for k, v in b.items()} for b in itertools.islice(pre, count)]
    assert [sorted(b) for b in got] == [sorted(b) for b in want]
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=0, atol=0)
    pulled = count + (prefetch if mode == "sample" else 0)  # epoch mode ends after `count`
    assert sum(s.copies for s in pre.slots) == 1 and sum(s.gathers for s in pre.slots) == pulled - 1
    if reads == "mapped":
        assert pre.iterable.reader.get().stats().mapped
    buf.close()


def test_dataset_batches_are_the_slot_memory(tmp_path):
    buf = _episodes_buffer(tmp_path / "b", None)
    pre = to_device(make_dataset(buf, 16, "sample", seed=1, cache_bytes=2**20), "cpu", prefetch=1)
    for k, batch in zip(range(8), pre):
        slot = pre.slots[k % len(pre.slots)]
        assert all(batch[name].data_ptr() == slot.host[name].data_ptr() for name in batch)
    buf.close()


@pytest.mark.cuda
@cuda
def test_cuda_dataset_gathers_into_pinned_slots(tmp_path):
    buf = _episodes_buffer(tmp_path / "b", None)

    def dataset():
        return make_dataset(buf, 64, "epoch", seed=5, cache_bytes=2**20)
    want = list(dataset())  # 300 rows: 4 batches of 64 and one of 44
    pre = to_device(dataset(), "cuda", prefetch=2)
    got = [{k: v.cpu() for k, v in b.items() if v.is_cuda} for b in pre]
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(g[k], w[k], rtol=0, atol=0)
    assert all(t.is_pinned() for s in pre.slots for t in s.host.values())
    assert sum(s.copies for s in pre.slots) == 1 and sum(s.gathers for s in pre.slots) == 4
    buf.close()
