"""Core ReplayBuffer behaviour: round trips, ring semantics, commits, determinism, bad input.

Everything is checked against `conftest.Model`, a plain list of every row ever added per lane.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import zarr
from conftest import (
    OWN,
    SMALL_FIELDS,
    Model,
    assert_rows_equal,
    check_buffer_against,
    dir_snapshot,
    min_cache,
    stack_rows,
    writes_done,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.format import keys
from diskreplay.io import open_chunkstore

SPEC_FIELDS = {
    "obs": dr.Field((17,), "float32"),
    "action": dr.Field((6,), "float32"),
    "reward": dr.Field((), "float32"),
    "next_obs": dr.Field((17,), "float32"),
    "done": dr.Field((), "bool"),
}
DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool"]
SHAPES = [(), (3,), (2, 3), (2, 1, 2)]
SMALL_CACHE = 1 << 16

pytestmark = pytest.mark.usefixtures("no_fsync")


def create(url, capacity=None, *, fields=SMALL_FIELDS, chunk_rows=4, **kw):
    kw.setdefault("cache_bytes", SMALL_CACHE)
    return dr.ReplayBuffer.create(url, fields, capacity, chunk_rows=chunk_rows, **kw)


def lanes_of(model: Model, env_ids):
    return list(range(model.num_envs)) if env_ids is None else list(env_ids)


def do_add(buf, model: Model, env_ids=None):
    lanes = lanes_of(model, env_ids)
    rows = model.next_rows(len(lanes))
    if model.num_envs == 1 and env_ids is None:
        buf.add(**rows[0])
    else:
        buf.add(env_ids=env_ids, **stack_rows(rows))
    for lane, row in zip(lanes, rows):
        model.append(lane, [row])


def do_extend(buf, model: Model, n: int, env_ids=None):
    lanes = lanes_of(model, env_ids)
    rows = model.next_rows(n * len(lanes))
    data = stack_rows(rows)
    if model.num_envs == 1 and env_ids is None:
        buf.extend(data)
    else:
        buf.extend({k: v.reshape(n, len(lanes), *v.shape[1:]) for k, v in data.items()}, env_ids=env_ids)
    for j, lane in enumerate(lanes):
        model.append(lane, rows[j::len(lanes)])


def abandon(buf):
    """Drop a writer without flushing, as a killed process would (its lock released, as if broken)."""
    buf.storage.close()


def random_values(field: dr.Field, n: int, rng: np.random.Generator) -> np.ndarray:
    shape = (n, *field.shape)
    dt = field.dtype
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt.kind == "f":
        out = (rng.standard_normal(shape) * 100).astype(dt)
        flat = out.reshape(-1)
        extremes = np.array([np.inf, -np.inf, np.nan, np.finfo(dt).max, np.finfo(dt).tiny, -0.0], dtype=dt)
        k = min(len(extremes), flat.size)
        flat[:k] = extremes[:k]
        return out
    info = np.iinfo(dt)
    out = rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    flat = out.reshape(-1)
    flat[:2] = [info.min, info.max]
    return out


# ---- API basics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd", "lz4", "lz4hc"])
def test_spec_example(url, compression):
    rng = np.random.default_rng(0)
    with dr.ReplayBuffer.create(url, SPEC_FIELDS, capacity=1_000_000, chunk_rows=4096,
                                compression=compression, seed=0) as buf:
        assert buf.capacity == 1_000_000 and len(buf) == 0
        assert buf.fields == SPEC_FIELDS
        one = {k: random_values(f, 1, rng)[0] for k, f in SPEC_FIELDS.items()}
        buf.add(**one)
        many = {k: random_values(f, 300, rng) for k, f in SPEC_FIELDS.items()}
        buf.extend(many)
        assert len(buf) == 301
        buf.flush()
        batch = buf.sample(256)
        assert set(batch) == set(SPEC_FIELDS) | {"index"}
        assert batch["index"].dtype == np.int64 and batch["index"].shape == (256,)
        assert batch["obs"].shape == (256, 17) and batch["obs"].dtype == np.float32
        assert batch["done"].dtype == np.bool_
        rows = buf[[0, 3, 300]]
        np.testing.assert_array_equal(rows["obs"][0], one["obs"])
        np.testing.assert_array_equal(rows["action"][1], many["action"][2])
        np.testing.assert_array_equal(rows["reward"][2], many["reward"][299])
        scalar = buf[7]
        assert scalar["obs"].shape == (17,)
    with dr.ReplayBuffer.open(url, mode="r+") as buf:
        assert len(buf) == 301 and buf.mode == "r+" and buf.num_envs == 1
    ro = dr.ReplayBuffer.open(url, mode="r")
    assert len(ro) == 301 and ro.capacity == 1_000_000
    ro.close()


@pytest.mark.parametrize("compression", [None, "zstd", "lz4", "lz4hc"])
def test_round_trip_every_dtype_and_shape(url, compression):
    # every dtype as a scalar and in one of the 1-D to 3-D shapes (every shape for several dtypes)
    fields = {f"f_{d}_{len(s)}d": dr.Field(s, d)
              for i, d in enumerate(DTYPES) for s in (SHAPES[0], SHAPES[1 + i % 3])}
    rng = np.random.default_rng(1)
    n = 11
    data = {name: random_values(f, n, rng) for name, f in fields.items()}
    buf = create(url, None, fields=fields, chunk_rows=4, compression=compression)
    buf.extend({k: v[:5] for k, v in data.items()})
    for i in range(5, n):
        buf.add(**{k: v[i] for k, v in data.items()})
    ids = np.arange(n)
    assert_rows_equal(buf[ids], data, "staged")
    buf.flush()
    assert_rows_equal(buf[ids], data, "committed")
    buf.close()
    with dr.ReplayBuffer.open(url, mode="r") as ro:
        assert ro.fields == fields
        assert_rows_equal(ro[ids], data, "reopened")
        batch = ro.sample(40, seed=0)
        assert_rows_equal(batch, {k: v[batch["index"]] for k, v in data.items()}, "sample")
    group = zarr.open_group(url, mode="r")
    for name, field in fields.items():
        arr = group[name]
        assert arr.shape == (1, n, *field.shape)
        assert np.dtype(arr.dtype) == field.dtype
        np.testing.assert_array_equal(arr[0], data[name], err_msg=name)


# ---- ring semantics ---------------------------------------------------------------------------


@pytest.mark.parametrize("capacity,chunk_rows", [(8, 4), (10, 4), (12, 4), (7, 3), (4, 4), (3, 8), (5, 1)])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_ring_adds_wrap_around(tmp_path, capacity, chunk_rows, compression):
    model = Model(1, capacity)
    buf = create(tmp_path / "b", capacity, chunk_rows=chunk_rows, compression=compression,
                 cache_bytes=min_cache(chunk_rows=min(chunk_rows, capacity)))
    for i in range(3 * capacity + 2):
        do_add(buf, model)
        check_buffer_against(buf, model)
        if i % 5 == 4:
            buf.flush()
            model.flush()
    buf.close()
    model.flush()
    with dr.ReplayBuffer.open(tmp_path / "b") as ro:
        check_buffer_against(ro, model, committed=True)


@pytest.mark.parametrize("capacity,chunk_rows", [(8, 4), (10, 4), (7, 3), (3, 8)])
@pytest.mark.parametrize("n", [3, 7, 10, 11, 25])
def test_extend_larger_than_capacity_keeps_last_rows(tmp_path, capacity, chunk_rows, n):
    model = Model(1, capacity)
    buf = create(tmp_path / "b", capacity, chunk_rows=chunk_rows)
    do_extend(buf, model, 2)
    do_extend(buf, model, n)
    check_buffer_against(buf, model)
    do_extend(buf, model, 3 * capacity + 1)
    check_buffer_against(buf, model)
    buf.close()
    model.flush()
    with dr.ReplayBuffer.open(tmp_path / "b") as ro:
        check_buffer_against(ro, model, committed=True)


ID_FIELDS = {"id": dr.Field((), "int64")}
NEXT_FIELDS = {"obs": dr.Field((), "int64"), "next_obs": dr.Field((), "int64"), "terminated": dr.Field((), "bool")}


def id_rows(first: int, n: int, num_envs: int, derive: bool) -> dict[str, np.ndarray]:
    """Steps ``[first, first + n)`` of every lane (time-major), each holding its own row id (with
    ``derive``: as ``obs``, ``next_obs`` the next step's or, at an episode's end, a final ``-id - 1``)."""
    ids = np.arange(first, first + n)[:, None] * num_envs + np.arange(num_envs)
    if derive:
        end = ids % 37 == 36
        rows = {"obs": ids, "next_obs": np.where(end, -ids - 1, ids + num_envs), "terminated": end}
    else:
        rows = {"id": ids}
    return rows if num_envs > 1 else {k: v[:, 0] for k, v in rows.items()}


def assert_last_rows(buf: dr.ReplayBuffer, total: int, lane_capacity: int, derive: bool, context: str) -> None:
    """``buf`` holds exactly the last ``lane_capacity`` of the ``total`` steps of each lane (`id_rows`)."""
    n = buf.num_envs
    want = np.concatenate([np.arange(max(total - lane_capacity, 0), total) * n + lane for lane in range(n)])
    ids = buf.row_ids()
    np.testing.assert_array_equal(ids, want, err_msg=context)
    got = buf[ids]
    stored = id_rows(0, total, n, derive)
    for name, values in got.items():
        np.testing.assert_array_equal(values, stored[name].reshape(-1)[ids], err_msg=f"{context}: {name}")


def extend_and_check(url: str, capacity: int, chunk_rows: int, sizes: tuple, compression: str | None,
                     num_envs: int, derive: bool) -> None:
    """Extends of ``sizes`` steps per lane (or ``"flush"``) into a ring of ``capacity`` steps per lane:
    the writer, a reader after the flush and the buffer reopened hold exactly the last rows."""
    buf = dr.ReplayBuffer.create(url, NEXT_FIELDS if derive else ID_FIELDS, capacity * num_envs, num_envs=num_envs,
                                 chunk_rows=chunk_rows, compression=compression, io_threads=2,
                                 derive_next=("obs",) if derive else ())
    total = 0
    for size in sizes:
        if size == "flush":
            buf.flush()
        else:
            buf.extend(id_rows(total, size, num_envs, derive))
            total += size
    assert_last_rows(buf, total, capacity, derive, "writer")
    buf.flush()
    with dr.ReplayBuffer.open(url) as reader:
        assert_last_rows(reader, total, capacity, derive, "reader")
    buf.close()
    with dr.ReplayBuffer.open(url) as reopened:
        assert_last_rows(reopened, total, capacity, derive, "reopened")
    assert verify(url).ok


@pytest.mark.parametrize("capacity,chunk_rows,sizes", [
    (128, 16, (150, 36, 150, 150)),
    (128, 16, (150, "flush", 36, 150, 150)),
    (128, 16, (129, 129, "flush", 129, 5, 129)),
    (128, 16, (128, 128, 7, 128, 128)),
    (128, 16, (271, 5, 271, "flush", 8, 271)),
    (1024, 16, (1046, 36, 1046, 1046)),
    (1024, 32, (1062, 62, 1052, 1052)),
    (1024, 32, (1025, 36, 1024, 2079, 2079)),
])
@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
@pytest.mark.parametrize("num_envs", [1, 2])
@pytest.mark.parametrize("derive", [False, True])
@pytest.mark.usefixtures("lagging_writes")
def test_extends_past_capacity_keep_exactly_the_last_rows(tmp_path, capacity, chunk_rows, sizes, compression,
                                                          num_envs, derive):
    """Issue 39: a chunk an extend staged again before its write was queued twice; the first write
    unpinned its slot, a later extend wrote the chunk straight from its rows, then the second entry
    wrote the slot's stale rows (or, once the slot was reused, another chunk's) over it."""
    extend_and_check(str(tmp_path / "b"), capacity, chunk_rows, sizes, compression, num_envs, derive)


@pytest.mark.usefixtures("lagging_writes")
def test_extends_past_a_large_capacity_keep_exactly_the_last_rows(tmp_path):
    extend_and_check(str(tmp_path / "b"), 32768, 16, (32790, 36, 32790, 32790), "zstd", 2, True)


@pytest.mark.parametrize("capacity,chunk_rows", [(None, 4), (8, 4), (10, 4), (7, 3)])
@pytest.mark.parametrize("n", [3, 6, 9, 23])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_small_adds_and_one_extend_store_identical_bytes(tmp_path, capacity, chunk_rows, n, compression):
    """add() one row at a time (with a cache so small that slots are recycled), one extend, and
    extends in odd pieces leave byte-identical chunk files and zarr metadata."""
    model = Model(1, capacity)
    rows = model.next_rows(n)
    tiny = min_cache(chunk_rows=min(chunk_rows, capacity or chunk_rows))
    a = create(tmp_path / "a", capacity, chunk_rows=chunk_rows, compression=compression, cache_bytes=tiny)
    for row in rows:
        a.add(**row)
    b = create(tmp_path / "b", capacity, chunk_rows=chunk_rows, compression=compression)
    b.extend(stack_rows(rows))
    c = create(tmp_path / "c", capacity, chunk_rows=chunk_rows, compression=compression, cache_bytes=tiny)
    for start in range(0, n, 5):
        c.extend(stack_rows(rows[start:start + 5]))
    for buf in (a, b, c):
        buf.close()
    files = [_data_files(tmp_path / name) for name in "abc"]
    assert files[0] == files[1] == files[2]


@pytest.mark.parametrize("memory_map", [False, True])
def test_whole_chunks_of_an_extend_skip_staging(tmp_path, memory_map):
    """A ring's second round written by an extend: its whole chunks go straight from the caller's
    arrays to the files, cached and mapped copies of the first round are dropped, and the caller
    may reuse its arrays as soon as extend returns."""
    model = Model(1, 12)
    buf = create(tmp_path / "b", 12, chunk_rows=4, memory_map=memory_map)
    do_extend(buf, model, 12)
    buf.flush()
    model.flush()
    check_buffer_against(buf, model)  # every first-round chunk now cached (or mapped)
    rows = model.next_rows(10)  # steps 12..21: chunks 0 and 1 whole, chunk 2 half
    data = stack_rows(rows)
    buf.extend(data)
    model.append(0, rows)
    cache = buf.storage._cache  # which chunks it holds: stats() only counts them
    assert cache.slot_of(0, 0) < 0 and cache.slot_of(0, 1) < 0 and cache.slot_of(0, 2) >= 0
    for values in data.values():
        values[...] = 0
    check_buffer_against(buf, model)
    buf.close()
    model.flush()
    with dr.ReplayBuffer.open(tmp_path / "b", "r") as reader:
        check_buffer_against(reader, model, committed=True)


def _data_files(path):
    """Chunk files and zarr metadata: everything but the commit record and saved state objects."""
    return {k: v for k, v in dir_snapshot(path).items() if not k.startswith(OWN)}


def test_ring_overwritten_ids_raise(tmp_path):
    buf = create(tmp_path / "b", 6, chunk_rows=4)
    buf.extend(stack_rows(Model(1, 6).next_rows(9)))
    assert len(buf) == 6
    np.testing.assert_array_equal(buf.row_ids(), np.arange(3, 9))
    for bad in (0, 2, 9, -1, 100):
        with pytest.raises(IndexError, match=str(bad)):
            buf[[bad]]
    with pytest.raises(IndexError):
        buf[np.array([3, 4, 2])]
    with pytest.raises(IndexError):
        buf[np.array([1.0])]


def test_multi_env_row_ids_and_env_ids(tmp_path):
    model = Model(3, 3 * 5)
    buf = create(tmp_path / "b", 15, chunk_rows=2, num_envs=3)
    do_add(buf, model)
    do_add(buf, model, env_ids=[2])
    do_add(buf, model, env_ids=np.array([2, 0]))
    do_extend(buf, model, 4, env_ids=[1])
    do_extend(buf, model, 3)
    check_buffer_against(buf, model)
    # row id = step * num_envs + lane
    lane2 = model.rows[2]
    np.testing.assert_array_equal(buf[[2 * 3 + 2]]["obs"][0], lane2[2]["obs"])
    assert len(buf) == sum(min(len(r), 5) for r in model.rows)


# ---- random sequences against the reference model ---------------------------------------------


@st.composite
def scenarios(draw):
    num_envs = draw(st.sampled_from([1, 3]))
    lane_cap = draw(st.sampled_from([None, 1, 2, 3, 5, 8, 9]))
    chunk_rows = draw(st.integers(1, 5))
    row_bytes = sum(f.row_bytes for f in SMALL_FIELDS.values())
    config = dict(
        num_envs=num_envs,
        capacity=None if lane_cap is None else lane_cap * num_envs,
        chunk_rows=chunk_rows,
        compression=draw(st.sampled_from([None, "zstd"])),
        # a writer's cache: its staging (2 * num_envs + 2 chunk slots) and up to 10 slots more
        cache_bytes=draw(st.integers(2 * num_envs + 2, 2 * num_envs + 12)) * min(chunk_rows, lane_cap or chunk_rows)
        * row_bytes,
    )
    env_ids = st.none()
    if num_envs > 1:
        env_ids = st.one_of(st.none(), st.permutations(range(num_envs)).flatmap(
            lambda p: st.integers(1, num_envs).map(lambda k: list(p[:k]))))
    op = st.one_of(
        st.tuples(st.just("add"), env_ids),
        st.tuples(st.just("extend"), st.integers(0, 2 * (lane_cap or 6) + 3), env_ids),
        st.sampled_from([("flush",), ("reopen",), ("crash",), ("reader",)]),
    )
    return config, draw(st.lists(op, max_size=20))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario=scenarios())
def test_random_ops_match_reference_model(tmp_path_factory, scenario):
    config, ops = scenario
    path = tmp_path_factory.mktemp("ops") / "buf"
    model = Model(config["num_envs"], config["capacity"])
    buf = create(path, **config)
    reader = dr.ReplayBuffer.open(path, mode="r", cache_bytes=config["cache_bytes"])
    clean = True  # no rows added since the last commit: the reader's window must be exact
    try:
        for op in ops:
            if op[0] == "add":
                do_add(buf, model, op[1])
                clean = False
            elif op[0] == "extend":
                do_extend(buf, model, op[1], op[2])
                clean = clean and op[1] == 0
            elif op[0] == "flush":
                buf.flush()
                model.flush()
                clean = True
            elif op[0] == "reopen":
                buf.close()
                model.flush()
                clean = True
                buf = dr.ReplayBuffer.open(path, mode="r+", cache_bytes=config["cache_bytes"])
            elif op[0] == "crash":
                abandon(buf)
                model.crash()
                buf = dr.ReplayBuffer.open(path, mode="r+", cache_bytes=config["cache_bytes"])
                # rows the dead writer was overwriting are gone; whatever is shown must be intact
                check_buffer_against(buf, model, exact=False)
                lanes, steps = np.divmod(buf.row_ids(), model.num_envs)[::-1]
                for lane in range(model.num_envs):
                    own = steps[lanes == lane]
                    model.floor[lane] = int(own.min()) if own.size else model.committed[lane]
            elif op[0] == "reader":
                writes_done(buf)
                reader.refresh()
                check_buffer_against(reader, model, committed=True, exact=clean)
            check_buffer_against(buf, model)
        buf.close()
        model.flush()
        reader.refresh()
        check_buffer_against(reader, model, committed=True)
    finally:
        reader.close()


# ---- staged vs committed, readers, reopen -------------------------------------------------------


def test_staged_rows_visible_to_writer_not_reader(url):
    model = Model(1, None)
    buf = create(url, None, chunk_rows=4, seed=0)
    do_extend(buf, model, 6)
    buf.flush()
    model.flush()
    do_extend(buf, model, 5)  # staged only
    check_buffer_against(buf, model)
    assert len(buf) == 11
    # the writer samples staged rows too
    seen = set(np.concatenate([buf.sample(64)["index"] for _ in range(5)]).tolist())
    assert seen == set(range(11))
    reader = dr.ReplayBuffer.open(url, mode="r")
    check_buffer_against(reader, model, committed=True)
    assert len(reader) == 6
    with pytest.raises(IndexError):
        reader[[8]]
    assert set(reader.sample(200, seed=1)["index"].tolist()) == set(range(6))
    buf.flush()
    model.flush()
    assert len(reader) == 6  # not until refresh
    assert reader.refresh() is True
    assert reader.refresh() is False
    check_buffer_against(reader, model, committed=True)
    buf.close()
    reader.close()


@pytest.mark.parametrize("capacity", [None, 10])
def test_reader_refresh_after_ring_overwrites(tmp_path, capacity):
    model = Model(1, capacity)
    buf = create(tmp_path / "b", capacity, chunk_rows=4)
    reader = dr.ReplayBuffer.open(tmp_path / "b", mode="r")
    for n in [3, 4, 1, 6, 9, 2, 13, 5]:
        reader[reader.row_ids()] if len(reader) else None  # fill the reader's cache
        do_extend(buf, model, n)
        buf.flush()
        model.flush()
        reader.refresh()
        check_buffer_against(reader, model, committed=True)
    buf.close()
    reader.close()


@pytest.mark.parametrize("capacity", [None, 10])
def test_unflushed_rows_lost_when_writer_abandoned(url, capacity):
    model = Model(1, capacity)
    buf = create(url, capacity, chunk_rows=4)
    do_extend(buf, model, 7)
    buf.flush()
    model.flush()
    do_extend(buf, model, 6)  # some full chunks get written, but never committed
    writes_done(buf)
    with dr.ReplayBuffer.open(url, mode="r") as reader:  # a second process, before close
        # a ring writer retires the rows its chunk writes destroy, so a reader may see fewer
        assert reader.row_ids().max() == 6 and len(reader) <= 7
        check_buffer_against(reader, model, committed=True, exact=capacity is None)
    abandon(buf)
    model.crash()
    buf = dr.ReplayBuffer.open(url, mode="r+")
    check_buffer_against(buf, model, exact=False)
    assert buf.row_ids().max() == 6
    lanes_steps = buf.row_ids()
    model.floor[0] = int(lanes_steps.min())
    do_extend(buf, model, 9)
    check_buffer_against(buf, model)
    buf.close()
    model.flush()
    with dr.ReplayBuffer.open(url) as ro:
        check_buffer_against(ro, model, committed=True)


def test_crash_mid_ring_overwrite_hides_torn_rows(tmp_path):
    """The writer committed a raised `lower` and rewrote a chunk, then died before its commit:
    a reopened writer must not serve the rewritten slots as the old rows."""
    path = tmp_path / "b"
    model = Model(1, 8)
    buf = create(path, 8, chunk_rows=4)
    do_extend(buf, model, 8)
    buf.flush()
    model.flush()
    do_extend(buf, model, 4)  # overwrites chunk 0 (steps 0..3) on disk, uncommitted
    abandon(buf)
    model.crash()
    for mode in ("r", "r+"):
        with dr.ReplayBuffer.open(path, mode=mode) as again:
            np.testing.assert_array_equal(again.row_ids(), np.arange(4, 8))
            model.floor[0] = 4
            check_buffer_against(again, model, committed=(mode == "r"))


@pytest.mark.parametrize("capacity", [None, 12, 16])
@pytest.mark.parametrize("num_envs", [1, 2])
def test_reopen_and_continue_is_identical_to_uninterrupted(tmp_path, capacity, num_envs):
    pieces = [3, 5, 1, 7, 4, 2]
    model = Model(num_envs, capacity)
    rows = model.next_rows(sum(pieces) * num_envs)
    runs = {}
    for name, interrupt in (("once", False), ("resumed", True)):
        path = tmp_path / name
        buf = create(path, capacity, chunk_rows=4, num_envs=num_envs, seed=3)
        at = 0
        batches = []
        for i, n in enumerate(pieces):
            chunk = stack_rows(rows[at * num_envs:(at + n) * num_envs])
            at += n
            if num_envs > 1:
                chunk = {k: v.reshape(n, num_envs, *v.shape[1:]) for k, v in chunk.items()}
            buf.extend(chunk)
            if interrupt and i % 2 == 1:
                buf.close()
                buf = dr.ReplayBuffer.open(path, mode="r+")
            batches.append(buf.sample(8)["index"])
        buf.close()
        snap = _data_files(path)
        runs[name] = (snap, batches)
    assert runs["once"][0] == runs["resumed"][0]
    for x, y in zip(runs["once"][1], runs["resumed"][1]):
        np.testing.assert_array_equal(x, y)


# ---- determinism ------------------------------------------------------------------------------


def _filled(path, seed, n=40, capacity=None):
    buf = create(path, capacity, chunk_rows=4, seed=seed)
    buf.extend(stack_rows(Model(1, None).next_rows(n)))
    return buf


def test_same_seed_same_batches(tmp_path):
    a, b = _filled(tmp_path / "a", 11), _filled(tmp_path / "b", 11)
    for _ in range(4):
        np.testing.assert_array_equal(a.sample(32)["index"], b.sample(32)["index"])
    np.testing.assert_array_equal(a.sample(32, seed=5)["index"], b.sample(32, seed=5)["index"])
    np.testing.assert_array_equal(a.sample(32, rng=np.random.default_rng(6))["index"],
                                  b.sample(32, rng=np.random.default_rng(6))["index"])
    # an explicit seed/rng does not advance the buffer's own generator
    np.testing.assert_array_equal(a.sample(32)["index"], b.sample(32)["index"])
    c = _filled(tmp_path / "c", 12)
    assert not np.array_equal(a.sample(64)["index"], c.sample(64)["index"])
    for buf in (a, b, c):
        buf.close()


def test_state_dict_round_trip(tmp_path):
    buf = _filled(tmp_path / "a", 0)
    buf.sample(16)
    state = buf.state_dict()
    first = [buf.sample(16)["index"] for _ in range(3)]
    buf.load_state_dict(state)
    again = [buf.sample(16)["index"] for _ in range(3)]
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    buf.add(**Model(1, None).next_rows(1)[0])
    with pytest.raises(ValueError, match="steps per lane"):
        buf.load_state_dict(state)
    buf.close()


@pytest.mark.parametrize("reopen_mode", ["r+", "r"])
def test_close_reopen_continues_rng(tmp_path, reopen_mode):
    ref = _filled(tmp_path / "ref", 7, capacity=32)
    ref.flush()
    want = [ref.sample(8)["index"] for _ in range(6)]
    buf = _filled(tmp_path / "b", 7, capacity=32)
    got = [buf.sample(8)["index"] for _ in range(3)]
    buf.close()
    buf = dr.ReplayBuffer.open(tmp_path / "b", mode=reopen_mode)
    got += [buf.sample(8)["index"] for _ in range(3)]
    for x, y in zip(want, got):
        np.testing.assert_array_equal(x, y)
    buf.close()
    ref.close()


def test_snapshot_round_trip(url, tmp_path):
    buf = create(url, 24, chunk_rows=4, seed=9)
    model = Model(1, 24)
    do_extend(buf, model, 30)
    buf.sample(5)
    buf.save_snapshot(tmp_path / "snap")
    arrays, meta = sorted(os.listdir(tmp_path / "snap"))
    assert re.fullmatch(r"state-[0-9a-f]{16}\.safetensors", arrays) and meta == "state.json"
    want = [buf.sample(8)["index"] for _ in range(4)]
    buf.close()
    model.flush()
    restored = dr.ReplayBuffer.load_snapshot(tmp_path / "snap", cache_bytes=SMALL_CACHE)
    check_buffer_against(restored, model)
    got = [restored.sample(8)["index"] for _ in range(4)]
    for x, y in zip(want, got):
        np.testing.assert_array_equal(x, y)
    restored.close()


# ---- the store is plain zarr ------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd", "lz4", "lz4hc"])
def test_plain_zarr_reader_sees_committed_rows_ring(url, compression):
    model = Model(3, 30)
    buf = create(url, 30, chunk_rows=4, num_envs=3, compression=compression)
    do_extend(buf, model, 13)
    do_extend(buf, model, 5, env_ids=[1])
    do_add(buf, model, env_ids=[2, 0])
    buf.flush()
    model.flush()
    for staged in (0, 2, 5):
        if staged:  # uncommitted rows: chunk writes may already destroy old committed rows
            do_extend(buf, model, staged)
            writes_done(buf)
        group = zarr.open_group(url, mode="r")
        with dr.ReplayBuffer.open(url, mode="r") as reader:
            visible = reader.row_ids()
        if not staged:
            np.testing.assert_array_equal(np.sort(visible), model.readable_ids(committed=True))
        lanes, steps = visible % 3, visible // 3
        for name, field in SMALL_FIELDS.items():
            arr = group[name]
            assert arr.shape == (3, 10, *field.shape) and np.dtype(arr.dtype) == field.dtype
            np.testing.assert_array_equal(arr[...][lanes, steps % 10], model.expected(visible)[name])
    buf.close()
    model.flush()
    group = zarr.open_group(url, mode="r")
    ids = model.readable_ids()
    assert len(ids) == 30
    for name in SMALL_FIELDS:
        np.testing.assert_array_equal(group[name][...][ids % 3, ids // 3 % 10], model.expected(ids)[name])


def test_buffers_with_slash_chunk_keys_still_open(tmp_path, monkeypatch):
    """Buffers made before the "." chunk keys name chunks "obs/c/0/1/0": they open, grow, map and verify."""
    path = tmp_path / "old"
    model = Model(1, 12)
    monkeypatch.setattr(keys, "CHUNK_KEY_SEPARATOR", "/")
    with create(path, 12, chunk_rows=4) as buf:
        do_extend(buf, model, 6)
    model.flush()
    monkeypatch.undo()
    assert (path / "obs" / "c" / "0" / "1" / "0").is_file() and not (path / "obs" / "c.0.0.0").exists()
    with dr.ReplayBuffer.open(path, "r+") as buf:
        do_extend(buf, model, 9)
    model.flush()
    assert (path / "obs" / "c" / "0" / "2" / "0").is_file()
    for memory_map in (False, True):
        with dr.ReplayBuffer.open(path, "r", memory_map=memory_map) as reader:
            check_buffer_against(reader, model, committed=True)
    assert verify(path).ok
    ids = model.readable_ids()
    np.testing.assert_array_equal(zarr.open_group(path, mode="r")["obs"][...][0, ids % 12],
                                  model.expected(ids)["obs"])


def test_plain_zarr_reader_dataset_mode(url):
    model = Model(2, None)
    buf = create(url, None, chunk_rows=4, num_envs=2, compression="zstd")
    do_extend(buf, model, 5)
    do_extend(buf, model, 6, env_ids=[1])
    buf.flush()
    model.flush()
    group = zarr.open_group(url, mode="r")
    assert group["obs"].shape == (2, 11, 2)
    data = group["img"][...]
    for lane in range(2):
        for step, row in enumerate(model.rows[lane]):
            np.testing.assert_array_equal(data[lane, step], row["img"])
    np.testing.assert_array_equal(data[0, 5:], 0)  # lane 0 is shorter: fill value
    buf.close()


# ---- bad input --------------------------------------------------------------------------------

BAD_FIELDS = {**SPEC_FIELDS, "steps": dr.Field((), "int16")}


def _good_step():
    return {"obs": np.zeros(17, np.float32), "action": np.zeros(6, np.float32), "reward": 1.0,
            "next_obs": np.ones(17, np.float32), "done": False, "steps": 3}


def _good_batch(n, lanes=None):
    lead = (n,) if lanes is None else (n, lanes)
    return {k: np.zeros(lead + f.shape, f.dtype) for k, f in BAD_FIELDS.items()}


def _with(base, **changes):
    out = dict(base)
    for k, v in changes.items():
        if v is None:
            out.pop(k)
        else:
            out[k] = v
    return out


BAD_ADDS = [
    ("unknown field", dict(_good_step(), color=1), r"unknown \['color'\]"),
    ("missing field", _with(_good_step(), reward=None), r"missing \['reward'\]"),
    ("wrong shape", _with(_good_step(), obs=np.zeros(16, np.float32)), r"'obs'.*\(17,\).*\(16,\)"),
    ("scalar for vector", _with(_good_step(), action=0.0), r"'action'.*\(6,\).*\(\)"),
    ("float into int", _with(_good_step(), steps=1.5), r"'steps'.*int16.*float64"),
    ("out of range int", _with(_good_step(), steps=70000), r"'steps'.*70000.*int16"),
    ("negative into unsigned", None, None),
    ("int into bool", _with(_good_step(), done=1), r"'done'.*bool.*int64"),
    ("float into bool", _with(_good_step(), done=0.0), r"'done'.*bool.*float64"),
    ("string", _with(_good_step(), reward="x"), r"'reward'.*float32"),
]
BAD_ADDS = [case for case in BAD_ADDS if case[1] is not None]

BAD_EXTENDS = [
    ("mismatched leading axes", _with(_good_batch(5), reward=np.zeros(4, np.float32)), r"'reward'.*\(5,\).*\(4,\)"),
    ("missing step axis", _with(_good_batch(5), next_obs=np.zeros(17, np.float32)), r"'next_obs'.*\(5, 17\).*\(17,\)"),
    ("unknown field", dict(_good_batch(5), extra=np.zeros(5)), r"unknown \['extra'\]"),
    ("missing field", _with(_good_batch(5), done=None), r"missing \['done'\]"),
    ("float into int", _with(_good_batch(5), steps=np.zeros(5)), r"'steps'.*int16.*float64"),
    ("out of range int", _with(_good_batch(5), steps=np.array([0, 1, -40000, 2, 3])), r"'steps'.*-40000.*int16"),
    ("non-bool into bool", _with(_good_batch(5), done=np.zeros(5, np.uint8)), r"'done'.*bool.*uint8"),
]


@pytest.fixture
def live_buffer(tmp_path):
    """A ring buffer with committed rows and staged rows, and a function checking it is unchanged."""
    path = tmp_path / "b"
    buf = dr.ReplayBuffer.create(path, BAD_FIELDS, 12, chunk_rows=4, cache_bytes=SMALL_CACHE, seed=0)
    rng = np.random.default_rng(0)
    buf.extend({k: random_values(f, 9, rng) for k, f in BAD_FIELDS.items()})
    buf.flush()
    buf.extend({k: random_values(f, 6, rng) for k, f in BAD_FIELDS.items()})  # wraps, partly staged
    writes_done(buf)

    before = (len(buf), buf.row_ids(), buf[buf.row_ids()], dir_snapshot(path))

    def unchanged():
        ids = buf.row_ids()
        assert len(buf) == before[0]
        np.testing.assert_array_equal(ids, before[1])
        assert_rows_equal(buf[ids], before[2])
        assert dir_snapshot(path) == before[3]

    yield buf, unchanged
    buf.close()


@pytest.mark.parametrize("name,step,match", BAD_ADDS, ids=[c[0] for c in BAD_ADDS])
def test_bad_add_is_refused_and_changes_nothing(live_buffer, name, step, match):
    buf, unchanged = live_buffer
    with pytest.raises(dr.SchemaError, match=match):
        buf.add(**step)
    unchanged()


def test_bad_add_negative_into_unsigned(tmp_path):
    buf = create(tmp_path / "b", None)
    step = dict(Model(1, None).next_rows(1)[0])
    step["img"] = np.full((2, 2), -1)
    with pytest.raises(dr.SchemaError, match=r"'img'.*-1.*uint8"):
        buf.add(**step)
    assert len(buf) == 0
    buf.close()


@pytest.mark.parametrize("name,data,match", BAD_EXTENDS, ids=[c[0] for c in BAD_EXTENDS])
def test_bad_extend_is_refused_and_changes_nothing(live_buffer, name, data, match):
    buf, unchanged = live_buffer
    with pytest.raises(dr.SchemaError, match=match):
        buf.extend(data)
    unchanged()


def test_schema_error_is_a_value_error(live_buffer):
    buf, unchanged = live_buffer
    with pytest.raises(ValueError):
        buf.add(**_with(_good_step(), obs=np.zeros(3)))
    unchanged()


@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_sample_and_rows_gather_into_given_arrays(tmp_path, sampler):
    """``out=`` arrays receive exactly the rows a plain call returns, and are the arrays returned."""
    kw = {"sampler": dr.Prioritized(alpha=0.6)} if sampler == "prioritized" else {}
    buf = create(tmp_path / "b", 40, chunk_rows=4, cache_bytes=min_cache(), **kw)  # a tiny cache: misses too
    buf.extend(stack_rows(Model(1, 40).next_rows(37)))
    if sampler == "prioritized":
        buf.update_priorities(np.arange(37), np.linspace(0.1, 3.0, 37))
    want = buf.sample(16, seed=4)
    out = {name: np.full((16, *f.shape), 7, f.dtype) for name, f in SMALL_FIELDS.items()}
    out["index"] = np.zeros(16, np.int64)
    if sampler == "prioritized":
        out["weight"] = np.zeros(16, np.float32)
    got = buf.sample(16, seed=4, out=out)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    assert all(got[name] is out[name] for name in out)
    rows = {name: np.empty((3, *f.shape), f.dtype) for name, f in SMALL_FIELDS.items() if name != "obs"}
    got = buf.rows([5, 30, 2], out=rows)
    assert got["act"] is rows["act"]
    for name, value in buf[[5, 30, 2]].items():
        np.testing.assert_array_equal(got[name], value)
    buf.close()


def test_sample_into_bad_arrays_is_refused(tmp_path):
    buf = create(tmp_path / "b", 40, chunk_rows=4, episode_end="done")
    buf.extend(stack_rows(Model(1, 40).next_rows(20)))
    obs = SMALL_FIELDS["obs"]
    cases = [
        ({"obs": np.empty((8, *obs.shape), np.float64)}, {},
         rf"out\['obs'\]: expected a C-contiguous {obs.dtype} array shaped \(8, {obs.shape[0]},?\), got float64"),
        ({"obs": np.empty((9, *obs.shape), obs.dtype)}, {}, r"out\['obs'\]: expected .* shaped \(8,"),
        ({"nope": np.empty(8)}, {}, r"out: unknown names \['nope'\]"),
        ({"index": np.empty(8, np.int32)}, {},
         r"out\['index'\]: expected a C-contiguous int64 array shaped \(8,\), got int32"),
        ({"obs": np.empty((8, *obs.shape), obs.dtype)}, {"n_step": 2}, "plain transitions only"),
    ]
    for out, options, match in cases:
        with pytest.raises(ValueError, match=match):
            buf.sample(8, seed=0, out=out, **options)
    buf.close()


@pytest.fixture
def multi_env(tmp_path):
    path = tmp_path / "m"
    buf = dr.ReplayBuffer.create(path, BAD_FIELDS, 12, num_envs=3, chunk_rows=2, cache_bytes=SMALL_CACHE)
    buf.extend(_good_batch(3, 3))
    buf.flush()
    buf.add(env_ids=[1], **_good_batch(1))
    writes_done(buf)
    before = (len(buf), dir_snapshot(path))
    yield buf, lambda: (len(buf), dir_snapshot(path)) == before
    buf.close()


@pytest.mark.parametrize("env_ids,match", [
    ([3], r"env_ids.*\[0, 3\).*\[3\]"),
    ([-1], r"env_ids.*\[0, 3\).*\[-1\]"),
    ([0, 0], r"env_ids.*distinct.*\[0, 0\]"),
    ([0.5], r"env_ids.*ints.*float64"),
])
def test_bad_env_ids(multi_env, env_ids, match):
    buf, unchanged = multi_env
    n = len(env_ids)
    with pytest.raises(dr.SchemaError, match=match):
        buf.add(env_ids=env_ids, **_good_batch(n))
    with pytest.raises(dr.SchemaError, match=match):
        buf.extend(_good_batch(2, n), env_ids=env_ids)
    assert unchanged()


def test_multi_env_wrong_lane_axis(multi_env):
    buf, unchanged = multi_env
    with pytest.raises(dr.SchemaError, match=r"'obs'.*\(3, 17\).*\(17,\)"):
        buf.add(**_with(_good_batch(3), obs=np.zeros(17, np.float32)))
    with pytest.raises(dr.SchemaError, match=r"'reward'.*\(4, 2\).*\(4, 3\)"):
        buf.extend(_with(_good_batch(4, 2), reward=np.zeros((4, 3), np.float32)), env_ids=[0, 2])
    assert unchanged()


def test_sampling_errors(tmp_path):
    buf = create(tmp_path / "b", 8)
    with pytest.raises(dr.EmptyBufferError, match="empty"):
        buf.sample(4)
    assert isinstance(dr.EmptyBufferError("x"), IndexError)
    buf.add(**Model(1, None).next_rows(1)[0])
    for bad in (0, -3, 2.5, "4"):
        with pytest.raises(ValueError, match="batch_size"):
            buf.sample(bad)
    assert buf.sample(3)["index"].tolist() == [0, 0, 0]
    buf.close()
    with dr.ReplayBuffer.open(tmp_path / "b", mode="r") as ro:
        assert len(ro) == 1
    # a reader of a buffer whose rows are all uncommitted sees an empty buffer
    buf = create(tmp_path / "c", None)
    buf.add(**Model(1, None).next_rows(1)[0])
    with dr.ReplayBuffer.open(tmp_path / "c", mode="r") as ro:
        with pytest.raises(dr.EmptyBufferError):
            ro.sample(1)
    buf.close()


def test_open_not_a_buffer(tmp_path, memory_url):
    missing = tmp_path / "nothing"
    with pytest.raises(dr.NotABufferError, match="nothing"):
        dr.ReplayBuffer.open(missing)
    assert not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(dr.NotABufferError, match="empty"):
        dr.ReplayBuffer.open(empty, mode="r+")
    assert os.listdir(empty) == []
    plain = tmp_path / "plain"
    group = zarr.open_group(plain, mode="w")
    group.create_array("obs", shape=(4, 2), dtype="float32")
    with pytest.raises(dr.NotABufferError, match="plain"):
        dr.ReplayBuffer.open(plain)
    # a zarr group that carries a commit record but not the diskreplay attributes
    (plain / OWN).mkdir(parents=True)
    (plain / OWN / "commit.json").write_text(json.dumps(
        {"sequence": 1, "time": 0.0, "committed": [0], "lower": [0], "extra": {}}))
    with pytest.raises(dr.NotABufferError, match="not a diskreplay buffer"):
        dr.ReplayBuffer.open(plain)
    with pytest.raises(dr.NotABufferError):
        dr.ReplayBuffer.open(memory_url)
    assert isinstance(dr.NotABufferError("x"), FileNotFoundError)
    with pytest.raises(ValueError, match="mode"):
        dr.ReplayBuffer.open(tmp_path / "x", mode="w")


def test_read_only_refuses_writes(url):
    buf = create(url, 8)
    buf.extend(stack_rows(Model(1, None).next_rows(5)))
    buf.close()
    ro = dr.ReplayBuffer.open(url, mode="r")
    row = Model(1, None).next_rows(1)[0]
    before = dir_snapshot(url) if not url.startswith("memory://") else None
    with pytest.raises(dr.ReadOnlyError, match="read-only"):
        ro.add(**row)
    with pytest.raises(dr.ReadOnlyError, match="read-only"):
        ro.extend(stack_rows([row]))
    assert before is None or dir_snapshot(url) == before
    with pytest.raises(dr.ReadOnlyError, match="read-only"):
        ro.flush()
    assert len(ro) == 5
    ro.close()
    with dr.ReplayBuffer.open(url, mode="r") as again:
        assert len(again) == 5


def test_read_only_flush_writes_nothing(tmp_path):
    path = tmp_path / "b"
    buf = create(path, 8)
    buf.extend(stack_rows(Model(1, None).next_rows(5)))
    buf.close()
    ro = dr.ReplayBuffer.open(path, mode="r")
    before = dir_snapshot(path)
    with pytest.raises(dr.ReadOnlyError):
        ro.flush()
    ro.close()
    assert dir_snapshot(path) == before


def test_create_over_existing(url, tmp_path):
    buf = create(url, 8)
    buf.extend(stack_rows(Model(1, None).next_rows(5)))
    buf.close()
    with pytest.raises(dr.BufferExistsError, match="overwrite=True"):
        create(url, 8)
    with dr.ReplayBuffer.open(url) as ro:
        assert len(ro) == 5
    fresh = create(url, 16, overwrite=True)
    assert len(fresh) == 0 and fresh.capacity == 16
    fresh.close()
    with dr.ReplayBuffer.open(url) as ro:
        assert len(ro) == 0 and ro.capacity == 16
    # a non-empty directory that is not a buffer is never deleted
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    with pytest.raises(dr.BufferExistsError):
        create(other, 8)
    with pytest.raises(dr.BufferExistsError):
        create(other, 8, overwrite=True)
    assert (other / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("kwargs,match", [
    (dict(capacity=10, num_envs=3), "multiple of num_envs=3"),
    (dict(capacity=0), "capacity"),
    (dict(capacity=-4), "capacity"),
    (dict(capacity=8, chunk_rows=0), "chunk_rows"),
    (dict(capacity=8, num_envs=0), "num_envs"),
    (dict(capacity=8, compression="gzip"), "compression"),
])
def test_bad_create_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dr.ReplayBuffer.create(tmp_path / "b", SMALL_FIELDS, **kwargs)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_missing_chunk_is_corrupt(url, compression):
    buf = create(url, None, chunk_rows=4, compression=compression)
    buf.extend(stack_rows(Model(1, None).next_rows(12)))
    buf.close()
    key = "obs/c.0.1.0"
    store = open_chunkstore(url)
    assert store.exists(key)
    store.delete(key)
    with dr.ReplayBuffer.open(url, mode="r") as ro:
        ro[[0, 9]]  # chunks 0 and 2 are intact
        with pytest.raises(dr.CorruptBufferError, match="obs/c.0.1.0"):
            ro[[5]]
        with pytest.raises(dr.CorruptBufferError, match="obs/c.0.1.0"):
            ro.sample(200, seed=0)
    with dr.ReplayBuffer.open(url, mode="r+") as rw:
        with pytest.raises(dr.CorruptBufferError, match="obs/c.0.1.0"):
            rw[[4]]


def test_an_object_of_more_parts_than_one_writev_takes(tmp_path):
    """A shard of many inner chunks is written from more buffers than one ``writev`` call takes
    (IOV_MAX, 1024 on Linux): all of them land, in order, in place or by replacement."""
    store = open_chunkstore(str(tmp_path / "s"))
    parts = [bytes([i % 251]) * (1 + i % 3) for i in range(3000)]
    store.put_in_place("obs/c.0.0.0", parts)
    store.put("obs/c.0.1.0", parts, durable=False)
    assert store.get("obs/c.0.0.0") == store.get("obs/c.0.1.0") == b"".join(parts)


def test_local_ranges_of_more_files_than_may_be_open_at_once(tmp_path, monkeypatch):
    """Ranges over 40 files, at most 8 held open at once: every range answered, in order, and
    never more than 8 descriptors open (a batch of a buffer of short chunks touches thousands)."""
    from diskreplay.io import local

    store = local.LocalChunkStore(str(tmp_path))
    for i in range(40):
        store.put(f"f/{i}", bytes([i]) * 10)
    files = OpenFiles(monkeypatch, at_once=8)
    ranges = [(f"f/{i % 40}", i % 3, i % 3 + 2) for i in range(120)] + [("nope", 0, 1)]
    assert store.get_ranges(ranges) == [(bytes([i % 40]) * 2, 10) for i in range(120)] + [None]
    assert files.most == 8 and not files.held


class OpenFiles:
    """The descriptors `LocalChunkStore` holds open, counted (``FILES_AT_ONCE`` set to ``at_once``)."""

    def __init__(self, monkeypatch, at_once: int):
        from diskreplay.io import local

        self.held: set[int] = set()
        self.most = 0
        opened, closed = local.open_for_reading, os.close

        def counted_open(path):
            fd = opened(path)
            self.held.add(fd)
            self.most = max(self.most, len(self.held))
            return fd

        def counted_close(fd):
            self.held.discard(fd)
            closed(fd)
        monkeypatch.setattr(local, "FILES_AT_ONCE", at_once)
        monkeypatch.setattr(local, "open_for_reading", counted_open)
        monkeypatch.setattr(local.os, "close", counted_close)


def test_local_objects_of_more_files_than_may_be_open_at_once(tmp_path, monkeypatch):
    """`get_many` over 20 files, at most 8 held open at once, each asked of the OS before the
    first of its run is read: every object answered in order (limits, missing files and folders
    among them), never more than 8 descriptors open."""
    from diskreplay.io import local

    store = local.LocalChunkStore(str(tmp_path))
    for i in range(20):
        store.put(f"f/{i}", bytes([i]) * (10 + i))
    os.makedirs(tmp_path / "folder")
    files, advised, fadvise = OpenFiles(monkeypatch, at_once=8), [], os.posix_fadvise

    def counted_fadvise(fd, offset, length, advice):
        advised.append((len(files.held), length, advice))
        return fadvise(fd, offset, length, advice)
    monkeypatch.setattr(local.os, "posix_fadvise", counted_fadvise)
    keys = [f"f/{i}" for i in range(20)] + ["nope", "folder"]
    assert store.get_many(keys) == [bytes([i]) * (10 + i) for i in range(20)] + [None, None]
    assert files.most == 8 and not files.held
    assert [n for n, _, _ in advised[:8]] == list(range(1, 9)) and len(advised) == 21  # a run's files: all open first
    assert {advice for _, _, advice in advised} == {os.POSIX_FADV_WILLNEED}
    advised.clear()
    assert store.get_many(["f/3", "f/12"], limit=12) == [bytes([3]) * 12, bytes([12]) * 12]
    assert [length for _, length, _ in advised] == [12, 12]


def test_both_stores_keep_the_chunkstore_protocol_alike(url):
    """Local files and an fsspec store answer every `ChunkStore` call the same way."""
    store = open_chunkstore(url)
    store.put_in_place("obs/c.0.0.0", (b"abc", b"defg"))
    store.put("obs/c.0.1.0", b"xy", durable=False)
    store.sync(["obs/c.0.0.0", "obs/c.0.1.0"])
    head, tail = bytearray(4), bytearray(8)
    assert store.read_into("obs/c.0.0.0", [memoryview(head), memoryview(tail)]) == 7
    assert bytes(head) == b"abcd" and bytes(tail) == b"efg" + bytes(5)
    assert store.read_into("obs/c.0.9.0", [memoryview(head)]) is None
    assert store.get("obs/c.0.0.0", limit=2) == b"ab" and store.get_many(["obs/c.0.1.0", "nope"]) == [b"xy", None]
    assert store.get_ranges([("obs/c.0.0.0", 2, 5), ("nope", 0, 4), ("obs/c.0.0.0", 5, 99), ("obs/c.0.1.0", 0, 1)]) \
        == [(b"cde", 7), None, (b"fg", 7), (b"x", 2)]
    assert store.get_ranges([("obs/c.0.0.0", 9, 12)])[0][0] == b""  # the object ends before the range
    assert store.put_if_absent("lock", b"1") and not store.put_if_absent("lock", b"2") and store.get("lock") == b"1"
    store.prefetch(["obs/c.0.0.0", "nope"])
    assert store.sizes() == {"obs/c.0.0.0": 7, "obs/c.0.1.0": 2, "lock": 1}
    store.delete("lock")
    store.delete("lock")  # a missing object is no error
    assert not store.exists("lock")
    store.clear()
    assert not store.exists("obs/c.0.0.0")
