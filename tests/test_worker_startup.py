"""What a DataLoader worker does before its first batch: it opens the store while torch is still
starting the other workers (when torch makes the dataset's iterator, before the first index
arrives), once per worker process, and the main process opens and reads nothing for it. Real fork
workers, real stores."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.utils.data as tud
from test_worker_ring import CACHE, as_numpy, assert_same, buf, fork_loader  # buf: the fixture

from diskreplay.torch import reader as reader_module
from diskreplay.torch.data import make_dataset
from diskreplay.torch.loader import Loader


class OpenedAtIter(tud.IterableDataset):
    """Yields, per batch of ``inner`` (iterated in a worker), its rows' ids and whether the store
    was open right after ``iter(inner)`` returned, before its first batch was asked for."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        it = iter(self.inner)
        opened = self.inner.reader.opened
        for batch in it:
            yield {"index": batch["index"].clone(), "opened_at_iter": torch.tensor(opened)}


def _recording_opens(monkeypatch, path: str) -> None:
    """Each `Reader` open appends this process's pid to ``path`` (fork workers inherit the patch)."""
    original = reader_module.Reader._open

    def recorded(self):
        with open(path, "a") as f:
            f.write(f"{os.getpid()}\n")
        return original(self)
    monkeypatch.setattr(reader_module.Reader, "_open", recorded)


def _opens(path: str) -> list[int]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [int(line) for line in f.read().split()]


@pytest.mark.parametrize("mode", ["sample", "epoch"])
def test_a_worker_opens_the_store_when_torch_makes_its_iterator(buf, mode):
    """Torch makes a worker's iterator before it starts the next worker and sends the first index:
    the store is open by then, not at the first batch (was: opened by the first next())."""
    ds = make_dataset(buf, 8, mode, seed=5, cache_bytes=CACHE, worker_ring=False)
    batches = list(itertools.islice(fork_loader(OpenedAtIter(ds), workers=2), 6))
    assert [bool(b["opened_at_iter"]) for b in batches] == [True] * 6
    in_process = list(itertools.islice(OpenedAtIter(ds), 1))
    assert bool(in_process[0]["opened_at_iter"]) is False  # in the main process: opened by the first read


@pytest.mark.parametrize("persistent", [False, True])
def test_plain_dataloader_workers_open_once_each_and_the_main_process_never(buf, tmp_path, monkeypatch,
                                                                            persistent):
    """A plain DataLoader over ``buf.as_dataset``: each worker process opens the store once (a
    non-persistent DataLoader starts new workers each epoch); the main process opens nothing and
    reads no chunk; the epochs' batches are those of num_workers=0 epoch by epoch, as rows."""
    path = str(tmp_path / "opens.txt")
    _recording_opens(monkeypatch, path)
    ds = buf.as_dataset(8, mode="epoch", seed=5, cache_bytes=CACHE)
    dl = fork_loader(ds, workers=2, persistent_workers=persistent)
    epochs = []
    for epoch in range(2):
        if not persistent:
            ds.set_epoch(epoch)
        epochs.append(as_numpy(dl))
    opens = _opens(path)
    assert os.getpid() not in opens and len(opens) == len(set(opens)) == (2 if persistent else 4)
    assert ds.io_stats() == {"chunk_fetches": 0, "bytes_decoded": 0}
    for got in epochs:
        assert sorted(int(i) for b in got for i in b["index"]) == list(range(2000))


def test_loader_batches_equal_num_workers_0_and_workers_open_before_the_first_index(buf, tmp_path, monkeypatch):
    """`Loader` sample mode: the batches of num_workers=2 are num_workers=0's, exactly; its two
    workers opened the store once each, during their start (one open each over two passes)."""
    path = str(tmp_path / "opens.txt")
    _recording_opens(monkeypatch, path)
    want = as_numpy(itertools.islice(Loader(make_dataset(buf, 8, "sample", seed=5, cache_bytes=CACHE)), 80))
    in_process_opens = len(_opens(path))
    ld = Loader(make_dataset(buf, 8, "sample", seed=5, cache_bytes=CACHE), num_workers=2,
                multiprocessing_context="fork")
    got = as_numpy(itertools.islice(ld, 40)) + as_numpy(itertools.islice(ld, 40))
    assert_same(got, want)
    worker_opens = _opens(path)[in_process_opens:]
    assert len(worker_opens) == len(set(worker_opens)) == 2 and os.getpid() not in worker_opens
    ld.close()
