"""Epochs that survive a change of world size (issue 42): the epoch order is a pure function of
(seed, epoch, rows, canonical partitions), so a position saved on W ranks (x DataLoader workers)
resumes on W' ranks with every row of the epoch exactly once over the whole run. Real stores,
real DataLoader workers, real gloo process groups whose ranks are killed mid-epoch."""

from __future__ import annotations

import itertools
import json
import multiprocessing as mp
import os
import signal
import socket
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_worker_ring import CACHE, as_numpy, make_buf

from diskreplay.torch.data import make_dataset
from diskreplay.torch.epoch_order import (
    PARTITIONS,
    Shard,
    Span,
    count_batches,
    rank_selection,
    rank_sizes,
    remaining_rows,
)
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


# ---- the pure order functions: any stop, any new layout ---------------------------------------


def _read_by(n: int, history: list[dict], run: dict, partitions: int, pad: bool, drop_last: bool,
             batch_size: int) -> list[int]:
    """Sequence positions the run ``run`` (ranks in lockstep) read after ``history``; its positions
    are cut to what its workers have (a worker of no rank gets further)."""
    left = remaining_rows(n, history, partitions, pad, drop_last, batch_size)
    rest = n if left is None else len(left)
    world, workers, out = run["world_size"], run["num_workers"], []
    spans = [[Span.of(rest, Shard(r, world, w, workers), partitions, pad, drop_last) for w in range(workers)]
             for r in range(world)]
    run["positions"] = [min(b, max(count_batches(spans[r][w].rows, batch_size, drop_last) for r in range(world)))
                        for w, b in enumerate(run["positions"])]
    for rank_spans in spans:
        for span, batch in zip(rank_spans, run["positions"]):
            rows = min(min(batch, count_batches(span.rows, batch_size, drop_last)) * batch_size, span.rows)
            idx = span.indexes(0, rows)
            out += (idx if left is None else left[idx]).tolist()
    return out


@st.composite
def layouts(draw):
    return draw(st.integers(1, 6)), draw(st.integers(1, 3))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 300), partitions=st.sampled_from([1, 2, 3, 4, 6, 8, 64, PARTITIONS]),
       batch_size=st.integers(1, 9), runs=st.lists(st.tuples(layouts(), st.integers(0, 40)), min_size=1, max_size=3),
       last=layouts())
def test_runs_on_any_layouts_read_the_epoch_exactly_once(n, partitions, batch_size, runs, last):
    """Runs stopped anywhere on any (world_size, num_workers), then one to the end on another:
    every row of the epoch once (drop_last=False, pad=False)."""
    history, seen = [], []
    for (world, workers), stop in runs:
        run = {"world_size": world, "num_workers": workers, "positions": [stop - w for w in range(workers)]}
        run["positions"] = [max(p, 0) for p in run["positions"]]  # workers at different positions
        seen += _read_by(n, history, run, partitions, False, False, batch_size)
        history.append(run)
    world, workers = last
    seen += _read_by(n, history, {"world_size": world, "num_workers": workers, "positions": [n] * workers},
                     partitions, False, False, batch_size)
    assert sorted(seen) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), partitions=st.sampled_from([1, 4, 8, PARTITIONS]), batch_size=st.integers(1, 9),
       first=layouts(), stop=st.integers(0, 40), last=layouts(), drop_last=st.booleans())
def test_pad_repeats_and_drop_last_drops_only(n, partitions, batch_size, first, stop, last, drop_last):
    """pad=True: every row at least once; drop_last=True: no row twice; both give every rank of a
    run the same batches."""
    pad = not drop_last
    run = {"world_size": first[0], "num_workers": first[1], "positions": [stop] * first[1]}
    seen = _read_by(n, [], run, partitions, pad, drop_last, batch_size)
    world, workers = last
    seen += _read_by(n, [run], {"world_size": world, "num_workers": workers, "positions": [n] * workers},
                     partitions, pad, drop_last, batch_size)
    if drop_last:
        assert len(seen) == len(set(seen))
    else:
        assert set(seen) == set(range(n))
    left = remaining_rows(n, [run], partitions, pad, drop_last, batch_size)
    rest = n if left is None else len(left)
    per_rank = {sum(count_batches(Span.of(rest, Shard(r, world, w, workers), partitions, pad, drop_last).rows,
                                  batch_size, drop_last) for w in range(workers)) for r in range(world)}
    assert len(per_rank) == 1 or workers > 1  # workers' short last batches may differ between ranks


def test_rank_selection_takes_whole_partitions_or_strides_them():
    assert [rank_selection(100, r, 4, 8) for r in range(4)] == [(0, 1, 25), (25, 1, 25), (50, 1, 25), (75, 1, 25)]
    assert [rank_selection(10, r, 3, 3) for r in range(3)] == [(0, 1, 3), (3, 1, 3), (6, 1, 4)]
    # 4 ranks, 2 partitions: two ranks share each, taking every other row of it
    assert [rank_selection(10, r, 4, 2) for r in range(4)] == [(0, 2, 3), (1, 2, 2), (5, 2, 3), (6, 2, 2)]
    assert rank_sizes(1000, 7, PARTITIONS) == [142, 143, 143, 143, 143, 143, 143]


def test_a_position_its_layout_cannot_reach_raises():
    with pytest.raises(ValueError, match="a run on world_size=2 with num_workers=1 says worker 0 read 9 batches; "
                                         "it has at most 5 on any rank"):
        remaining_rows(100, [{"world_size": 2, "num_workers": 1, "positions": [9]}], PARTITIONS, False, False, 10)


def test_states_of_other_partitions_or_malformed_history_raise(buf):
    ds = make_dataset(buf.url, 8, "epoch", seed=5, cache_bytes=CACHE, canonical_partitions=4)
    state = ds.state_dict()
    assert state["partitions"] == 4 and state["history"] == []
    other = make_dataset(buf.url, 8, "epoch", seed=5, cache_bytes=CACHE)
    with pytest.raises(ValueError, match="state was saved with 4 canonical partitions, this dataset has 46126080: "
                                         "make it with canonical_partitions=4"):
        other.load_state_dict(state)
    for bad in ({"world_size": 2, "num_workers": 1, "positions": [1, 2]}, {"world_size": 0, "num_workers": 1,
                "positions": [1]}, "x"):
        with pytest.raises(ValueError, match="epoch state 'history': expected a list of"):
            ds.load_state_dict({**state, "history": [bad]})


@pytest.mark.parametrize("world,new_world", [(2, 3), (3, 1)])
def test_a_dataset_state_resumes_on_another_world_size(buf, world, new_world):
    """The dataset iterated in one process per rank: rank 0's state, loaded on every new rank."""
    head, states = [], []
    for rank in range(world):
        ds = make_dataset(buf.url, 8, "epoch", seed=5, cache_bytes=CACHE, rank=rank, world_size=world)
        head.append(ids(itertools.islice(ds, 30)))
        states.append(ds.state_dict())
    tail = []
    for rank in range(new_world):
        ds = make_dataset(buf.url, 8, "epoch", seed=5, cache_bytes=CACHE, rank=rank, world_size=new_world)
        ds.load_state_dict(states[0])
        tail.append(ids(ds))
        assert ds.state_dict()["history"] == [{"world_size": world, "num_workers": 1, "positions": [30]}]
    assert_exactly_once(head + tail, 2000)


# ---- real process groups: ranks killed mid-epoch, resumed on another world size ---------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, url: str, workers: int, stop: int | None, saved: str | None,
               out: str) -> None:
    """One rank of a gloo group: from the state in ``saved`` (if any) read ``stop`` batches (None:
    to the end of the epoch), all ranks in lockstep; write its rows and its Loader state to
    ``out``/rank<r>.json, then (``stop`` given) go on reading until it is killed."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    ld = Loader(make_dataset(url, 8, "epoch", seed=5, cache_bytes=CACHE), num_workers=workers,
                multiprocessing_context="fork" if workers else None)  # rank and world size from the group
    assert (ld.dataset.rank, ld.dataset.world_size) == (rank, world)
    if saved is not None:
        with open(saved) as f:
            ld.load_state_dict(json.load(f))
    it = iter(ld)
    rows = ids(itertools.islice(it, stop))
    dist.barrier()  # the checkpoint: every rank at the same step
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rows": rows, "state": ld.state_dict()}, f)
    dist.barrier()
    for _ in it:  # the steps after the checkpoint, lost when the job is killed
        time.sleep(0.05)


def _job(url: str, world: int, workers: int, stop: int | None, saved: str | None, out: str) -> list[dict]:
    """Run ``world`` ranks; with ``stop``, kill them (SIGKILL) once each saved its checkpoint."""
    os.makedirs(out, exist_ok=True)
    context, port = mp.get_context("spawn"), _free_port()
    procs = [context.Process(target=_rank_main, args=(r, world, port, url, workers, stop, saved, out))
             for r in range(world)]
    for p in procs:
        p.start()
    files = [os.path.join(out, f"rank{r}.json") for r in range(world)]
    deadline = time.monotonic() + 300
    while stop is not None and not all(os.path.exists(f) for f in files) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        if stop is not None:
            time.sleep(0.2)  # let it read on past the checkpoint, then kill it mid-epoch
            p.kill()
        p.join(300)
    want = 0 if stop is None else -signal.SIGKILL  # killed mid-epoch: before its last batch
    assert [p.exitcode for p in procs] == [want] * world
    results = []
    for f in files:
        with open(f) as fh:
            results.append(json.load(fh))
    return results


@pytest.mark.parametrize("world,workers,new_worlds", [(4, 0, [(2, 2), (1, 0)]), (2, 2, [(4, 0)])])
def test_ranks_killed_mid_epoch_resume_on_another_world_size(buf, tmp_path, world, workers, new_worlds):
    """4 ranks (or 2 with 2 workers each) killed mid-epoch after each saved its Loader state at the
    same step; rank 0's state resumed on 2 ranks with 2 workers and on 1 rank (4 ranks): the rows
    before the checkpoint and after it are the epoch, each once."""
    killed = _job(buf.url, world, workers, 20, None, os.fspath(tmp_path / "killed"))
    states = [k["state"] for k in killed]
    assert all(s["positions"] == states[0]["positions"] and any(s["positions"]) for s in states)
    saved = os.fspath(tmp_path / "checkpoint.json")
    with open(saved, "w") as f:
        json.dump(states[0], f)
    for new_world, new_workers in new_worlds:
        resumed = _job(buf.url, new_world, new_workers, None, saved, os.fspath(tmp_path / f"on{new_world}"))
        assert_exactly_once([k["rows"] for k in killed] + [r["rows"] for r in resumed], 2000)


def test_states_saved_before_canonical_partitions(buf):
    """A state without "partitions" comes from the order before them: the same for one rank and
    one worker (resumed as it is), another for more (refused inside an epoch)."""
    ds = make_dataset(buf.url, 8, "epoch", seed=5, cache_bytes=CACHE)
    head = ids(itertools.islice(ds, 30))
    old = {k: v for k, v in ds.state_dict().items() if k not in ("partitions", "history")}
    again = make_dataset(buf.url, 8, "epoch", seed=5, cache_bytes=CACHE)
    again.load_state_dict(old)
    assert_exactly_once([head, ids(again)], 2000)
    two = {**old, "world_size": 2}
    with pytest.raises(ValueError, match="inside epoch 0 on world_size=2, num_workers=1 by a diskreplay without "
                                         "canonical partitions"):
        again.load_state_dict(two)
    again.load_state_dict({**two, "batch": 0})  # at an epoch boundary: any layout
    ld = loader(buf.url, 0, 1, 2)
    list(itertools.islice(ld, 20))
    state = ld.state_dict()
    state["dataset"] = {k: v for k, v in state["dataset"].items() if k not in ("partitions", "history")}
    with pytest.raises(ValueError, match="on world_size=1, num_workers=2 by a diskreplay without"):
        loader(buf.url, 0, 1, 2).load_state_dict(state)
    ld.close()
