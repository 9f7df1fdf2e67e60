"""Epochs that survive a change of world size (issue 42): the epoch order is a pure function of
(seed, epoch, rows, canonical partitions), so a position saved on W ranks (x DataLoader workers)
resumes on W' ranks with every row of the epoch exactly once over the whole run. Real stores,
real DataLoader workers, real gloo process groups whose ranks are killed mid-epoch."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from test_worker_ring import CACHE, as_numpy, make_buf

from diskreplay.torch.data import make_dataset
from diskreplay.torch.loader import Loader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")


@pytest.fixture
def buf(tmp_path):
    b = make_buf(tmp_path / "buf", steps=1000)  # 2000 rows in 64-row chunks
    yield b
    b.close()


def loader(url: str, rank: int, world: int, workers: int, **kw) -> Loader:
    ds = make_dataset(url, kw.pop("batch_size", 8), "epoch", seed=5, cache_bytes=CACHE, rank=rank,
                      world_size=world, **kw)
    return Loader(ds, num_workers=workers, multiprocessing_context="fork" if workers else None)


def ids(batches) -> list[int]:
    return [int(i) for b in as_numpy(batches) for i in b["index"]]


def run_ranks(url: str, world: int, workers: int, stop: int | None, state=None, **kw):
    """Each rank's batches (its first ``stop``, or all) and its Loader state after them."""
    seen, states = [], []
    for rank in range(world):
        ld = loader(url, rank, world, workers, **kw)
        if state is not None:
            ld.load_state_dict(state)
        seen.append(ids(itertools.islice(iter(ld), stop)))
        states.append(ld.state_dict())
        ld.close()
    return seen, states


def assert_exactly_once(parts, rows: int) -> None:
    flat = sorted(itertools.chain.from_iterable(parts))
    assert flat == list(range(rows)), (len(flat), len(set(flat)), rows)


@pytest.mark.parametrize("workers,new_workers", [(2, 2), (0, 0), (2, 0)])
def test_a_loader_state_of_2_ranks_resumes_on_1_rank_exactly(buf, workers, new_workers):
    """Regression: the state of a 2-rank Loader loaded into a 1-rank Loader was accepted and
    resumed 2 ranks' rows as if they were one (rows twice and rows never)."""
    head, states = run_ranks(buf.url, 2, workers, 60)
    tail, _ = run_ranks(buf.url, 1, new_workers, None, state=states[0])
    assert_exactly_once(head + tail, 2000)
