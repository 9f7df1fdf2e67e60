"""The chunk cache alone, and buffers whose cache is much smaller than what a batch touches."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL_FIELDS, Model, assert_rows_equal, check_buffer_against, min_cache, stack_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diskreplay as dr
from diskreplay.format.codecs import Codec
from diskreplay.format.lanes import LaneLayout
from diskreplay.format.schema import Field, Schema
from diskreplay.storage import cache_slots, outputs
from diskreplay.storage.cache import ChunkCache
from diskreplay.storage.sizing import BEHIND_CHUNKS, fields_read_by_rows

pytestmark = pytest.mark.usefixtures("no_fsync")

ROW_BYTES = sum(f.row_bytes for f in SMALL_FIELDS.values())


def make_cache(slots=3, num_envs=2, chunk_rows=3, chunks_per_lane=4):
    return ChunkCache(Schema(SMALL_FIELDS), num_envs, chunk_rows, slots, chunks_per_lane)


def A(*values):
    return np.array(values, dtype=np.int64)


# ---- rows gathered from the slabs ---------------------------------------------------------------

ROW_SHAPES = [((17,), np.float32), ((), np.bool_), ((2, 3), np.int16), ((), np.float64), ((40, 3), np.uint8)]


@pytest.mark.parametrize("extension", [True, False])
@given(rows=st.integers(1, 300), picks=st.lists(st.integers(0, 10**6), max_size=80), seed=st.integers(0, 99),
       shared=st.booleans(), run=st.tuples(st.integers(0, 10**6), st.integers(0, 60)))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_take_rows_is_fancy_indexing(monkeypatch: pytest.MonkeyPatch, extension: bool, rows: int, picks: list[int],
                                     seed: int, shared: bool, run: tuple[int, int]) -> None:
    """Rows of several fields of any dtype and row shape, at random and in runs of consecutive
    rows, at one index for all or one per field (of sources of their own lengths), by the C
    extension and by numpy."""
    if not extension:
        monkeypatch.setattr(outputs, "_TAKE_ROWS", None)
    elif outputs._TAKE_ROWS is None:
        pytest.skip("the _batch extension is not built with take_rows")
    half = len(picks) // 2
    picks = [*picks[:half], *range(run[0], run[0] + run[1]), *picks[half:]]
    rng = np.random.default_rng(seed)
    lengths = [rows] * len(ROW_SHAPES) if shared else [rows + 7 * f for f in range(len(ROW_SHAPES))]
    sources = [rng.integers(0, 100, (n, *shape)).astype(dtype) for n, (shape, dtype) in zip(lengths, ROW_SHAPES)]
    indexes = [np.array(picks, dtype=np.int64) % (rows if shared else n) for n in lengths]
    outs = [np.full((len(picks), *shape), 7, dtype) for shape, dtype in ROW_SHAPES]
    outputs.take_rows(sources, indexes, outs)
    for source, index, out in zip(sources, indexes, outs):
        assert out.dtype == source.dtype and np.array_equal(out, source[index])


def test_take_rows_copies_more_fields_than_one_call_takes() -> None:
    sources = [np.arange(10, dtype=np.int64) * 100 + f for f in range(150)]
    outs = [np.zeros(3, np.int64) for _ in sources]
    outputs.take_rows(sources, [A(9, 0, 4)] * len(sources), outs)
    assert [out.tolist() for out in outs] == [[900 + f, f, 400 + f] for f in range(150)]


def test_take_rows_refuses_what_it_cannot_copy() -> None:
    take = outputs._TAKE_ROWS
    if take is None:
        pytest.skip("the _batch extension is not built with take_rows")
    source, out = np.arange(20, dtype=np.float32).reshape(10, 2), np.zeros((3, 2), np.float32)
    flags = np.zeros(3, bool)
    with pytest.raises(IndexError, match=r"indexes\[1\]\[1\] = 10 is outside the 10 rows of sources\[1\]"):
        take((source, source), (out, out), (A(0, 1, 2), A(3, 10, 0)))
    with pytest.raises(IndexError, match=r"indexes\[0\]\[0\] = -1 is outside"):
        take((source,), (out,), (A(-1, 0, 0),))
    with pytest.raises(ValueError, match=r"targets\[0\] must hold 3 rows of 8 bytes, as sources\[0\] has"):
        take((source,), (out[:2],), (A(0, 1, 2),))
    with pytest.raises(ValueError, match=r"targets\[1\] must hold 3 rows of 8 bytes, as sources\[1\] has"):
        take((source, source), (out, flags), (A(0, 1, 2), A(0, 1, 2)))
    with pytest.raises(ValueError, match=r"indexes\[1\] must hold 3 int64 rows, as indexes\[0\] does"):
        take((source, source), (out, out), (A(0, 1, 2), A(0, 1)))
    with pytest.raises(ValueError, match="as many targets and indexes as sources"):
        take((source, source), (out,), (A(0, 1, 2),))
    with pytest.raises(ValueError, match="not C-contiguous"):
        take((source[:, :1],), (out,), (A(0, 1, 2),))
    assert out.tolist() == [[0, 0]] * 3  # nothing copied by a refused call
    take((source,), (out,), (A(9, 0, 9),))
    assert out.tolist() == [[18, 19], [0, 1], [18, 19]]


def test_a_reader_gathers_the_same_rows_without_the_extension(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), SMALL_FIELDS, capacity=None, chunk_rows=16)
    rng = np.random.default_rng(0)
    buf.extend({name: rng.standard_normal((200, *f.shape)).astype(f.dtype) for name, f in SMALL_FIELDS.items()})
    buf.flush()
    ids = rng.integers(0, 200, 64)
    calls: list[int] = []
    if outputs._TAKE_ROWS is not None:
        take = outputs._TAKE_ROWS
        monkeypatch.setattr(outputs, "_TAKE_ROWS", lambda *args: calls.append(len(args[2][0])) or take(*args))
    fast = buf.rows(ids)
    assert calls == ([] if outputs._TAKE_ROWS is None else [64])  # the rows came through the cache's slabs
    monkeypatch.setattr(outputs, "_TAKE_ROWS", None)
    slow = buf.rows(ids)
    into = {name: np.empty((64, *f.shape), f.dtype) for name, f in SMALL_FIELDS.items()}
    given = buf.rows(ids, out=into)
    for name in SMALL_FIELDS:
        assert np.array_equal(fast[name], slow[name]) and np.array_equal(given[name], slow[name])
        assert given[name] is into[name]
    buf.close()


# ---- ChunkCache unit behaviour ------------------------------------------------------------------


def table(cache):
    """The cache's (lane, chunk) -> slot table, read through its public lookup."""
    lanes, chunks = np.meshgrid(np.arange(cache.lanes), np.arange(cache.width), indexing="ij")
    return cache.slots_of(lanes.ravel(), chunks.ravel()).reshape(cache.lanes, cache.width)


def test_layout_of_a_fresh_cache():
    cache = make_cache()
    assert table(cache).shape == (2, 4) and (table(cache) == -1).all()
    for name, field in SMALL_FIELDS.items():
        assert cache.slabs[name].shape == (3 * 3, *field.shape)
        assert cache.slabs[name].dtype == field.dtype
    assert cache.evictable() == 3
    assert (table(cache)[A(0, 1), A(3, 0)] == -1).all()


def test_assign_pins_and_maps():
    cache = make_cache()
    slots = cache.assign(A(0, 1), A(2, 0))
    assert len(set(slots.tolist())) == 2
    assert table(cache)[0, 2] == slots[0] and table(cache)[1, 0] == slots[1]
    assert cache.is_pinned(slots).all() and cache.evictable() == 1
    np.testing.assert_array_equal(cache.owners(slots), [[0, 1], [2, 0]])
    assert cache.assign(A(), A()).size == 0


def test_chunk_rows_of_is_a_view_of_the_slab():
    cache = make_cache()
    slot = int(cache.assign(A(1), A(3))[0])
    cache.chunk_rows_of("obs", slot)[:] = 7.0
    assert (cache.slabs["obs"][slot * 3:(slot + 1) * 3] == 7.0).all()
    assert cache.chunk_rows_of("img", slot).shape == (3, 2, 2)


def test_lru_eviction_order():
    cache = make_cache(slots=3)
    s = cache.assign(A(0, 0, 0), A(0, 1, 2))
    cache.unpin(np.arange(cache.slots))
    cache.touch(s[[0]])  # chunk 0 most recent, then 2, then 1 least
    cache.touch(s[[2]])
    cache.touch(s[[0]])
    new = cache.assign(A(1), A(0))
    assert new[0] == s[1]
    assert table(cache)[0, 1] == -1 and table(cache)[1, 0] == s[1]
    assert table(cache)[0, 0] == s[0] and table(cache)[0, 2] == s[2]
    cache.unpin(np.arange(cache.slots))
    new = cache.assign(A(1), A(1))
    assert new[0] == s[2]  # chunk 2 is now the least recently used
    assert table(cache)[0, 2] == -1


def test_unused_slots_are_taken_before_evicting():
    cache = make_cache(slots=3)
    first = cache.assign(A(0), A(0))
    cache.unpin(np.arange(cache.slots))
    cache.touch(first)
    second = cache.assign(A(0), A(1))
    assert second[0] != first[0] and table(cache)[0, 0] == first[0]


def test_pinned_slots_are_never_evicted():
    cache = make_cache(slots=3)
    pinned = cache.assign(A(0, 0), A(0, 1))  # stay pinned
    free = cache.assign(A(0), A(2))
    cache.unpin(free)
    cache.touch(free)  # the only unpinned slot is also the most recent: still the victim
    got = cache.assign(A(1), A(3))
    assert got[0] == free[0]
    assert table(cache)[0, 0] == pinned[0] and table(cache)[0, 1] == pinned[1]
    with pytest.raises(RuntimeError, match="free slots"):
        cache.assign(A(1), A(0))
    with pytest.raises(RuntimeError):
        make_cache(slots=2).assign(A(0, 0, 0), A(0, 1, 2))


def test_reserved_slots_are_pinned_and_found_only_once_placed():
    cache = make_cache(slots=3)
    old = cache.assign(A(0), A(1))
    cache.unpin(old)
    reserved = cache.reserve(3)  # a read-ahead's slots: the least recently used one emptied too
    assert sorted(reserved.tolist()) == [0, 1, 2]
    assert cache.is_pinned(reserved).all() and cache.evictable() == 0
    assert (table(cache) == -1).all()  # reads find none of them yet
    with pytest.raises(RuntimeError, match="chunk cache has 0 free slots, 1 needed"):
        cache.reserve(1)
    cache.place(A(1), A(2), reserved[:1])
    assert table(cache)[1, 2] == reserved[0]
    cache.release(reserved[1:])
    assert cache.evictable() == 2 and cache.cached_chunks() == 1


def test_placing_a_chunk_held_elsewhere_forgets_the_other_copy():
    schema = Schema({"obs": Field((8,), "float32"), "reward": Field((), "float32")})
    cache = ChunkCache(schema, 1, 16, 4, 8, full_slots=2, row_fields=("obs",))
    partial = cache.assign(A(0, 0), A(3, 5), whole=False)  # slots 3 and 2: some fields of chunks 3 and 5
    cache.unpin(partial)
    whole = cache.reserve(2)  # a fill of every field of chunk 3 and of chunk 1
    cache.unpin(cache.place(A(0, 0), A(3, 1), whole))
    assert table(cache)[0, 3] == whole[0] and table(cache)[0, 5] == partial[1]
    np.testing.assert_array_equal(cache.owners(partial), [[-1, 0], [-1, 5]])  # chunk 3's partial copy forgotten
    assert cache.cached_chunks() == 3 and not cache.is_partial(whole).any()
    cache.evict(partial[:1])  # the forgotten slot, recycled: chunk 3 stays where it was placed
    assert table(cache)[0, 3] == whole[0]
    cache.place(A(0), A(3), whole[:1])  # placed again in its own slot: kept
    assert table(cache)[0, 3] == whole[0] and cache.owners(whole[:1])[1].tolist() == [3]


def test_evict_and_invalidate():
    cache = make_cache(slots=3)
    s = cache.assign(A(0, 0, 1), A(0, 1, 1))
    cache.unpin(s[1:])
    cache.invalidate(0, A(0, 1, 3, 99))  # chunk 0 pinned: kept; 1 dropped; 3 absent; 99 past the table
    assert table(cache)[0, 0] == s[0] and table(cache)[0, 1] == -1 and table(cache)[1, 1] == s[2]
    assert cache.owners(s[[1]])[0][0] == -1
    cache.evict(s[[2]])
    assert table(cache)[1, 1] == -1
    cache.evict(s[[2]])  # evicting an empty slot is harmless
    assert cache.evictable() == 2


def test_ensure_chunks_grows_and_keeps_entries():
    cache = make_cache(chunks_per_lane=2)
    s = cache.assign(A(1), A(1))
    cache.ensure_chunks(1)
    assert table(cache).shape == (2, 2)
    cache.ensure_chunks(5)
    assert table(cache).shape[1] >= 5 and table(cache)[1, 1] == s[0]
    assert (table(cache)[:, 2:] == -1).all()


def test_slots_for_budget():
    schema = Schema(SMALL_FIELDS)
    chunk = 4 * schema.row_bytes
    one_lane = LaneLayout(1, None, 4)
    assert cache_slots(schema, one_lane, 10 * chunk, writer=True) == (10, 10)
    assert cache_slots(schema, one_lane, 10 * chunk + chunk - 1, writer=True) == (10, 10)
    assert cache_slots(schema, one_lane, 1, writer=False) == (1, 1)  # a reader keeps one chunk at least
    with pytest.raises(ValueError, match=rf"cache_bytes=1 is too small for a writer: staging needs 4 chunks "
                                         rf"\(2 per env lane \+ 2\) of {chunk} bytes"):
        cache_slots(schema, one_lane, 1, writer=True)
    huge, _ = cache_slots(schema, LaneLayout(1, None, 1), 2**40, writer=True)
    assert 4 <= huge <= ChunkCache.MAX_SLOTS


def test_row_fields_have_room_in_the_staging_slots_only():
    """Frames read row by row: the budget beyond a writer's staging caches the small fields."""
    schema = Schema({"obs": Field((84, 84), "uint8"), "reward": Field((), "float32")})
    layout = LaneLayout(2, None, 128)
    staging = 6 * 128 * schema.row_bytes
    assert cache_slots(schema, layout, staging + 100 * 128 * 4, writer=True, row_fields=("obs",)) == (106, 6)
    assert cache_slots(schema, layout, 1 << 20, writer=False, row_fields=("obs",)) == (2048, 0)
    # a bigger budget: `BEHIND_CHUNKS` more per lane for chunks written behind and read ahead, if half holds them
    assert cache_slots(schema, layout, 1 << 30, writer=True, row_fields=("obs",))[1] == 6 + 2 * BEHIND_CHUNKS
    assert cache_slots(schema, layout, 40 * 128 * schema.row_bytes, writer=True, row_fields=("obs",))[1] == 20
    cache = ChunkCache(schema, 2, 128, 106, 8, full_slots=6, row_fields=("obs",))
    assert cache.slabs["obs"].shape == (6 * 128, 84, 84) and cache.slabs["reward"].shape == (106 * 128,)
    partial = cache.assign(np.array([0, 1]), np.array([0, 0]), whole=False)
    whole = cache.assign(np.array([0]), np.array([1]))
    assert partial.tolist() == [105, 104] and cache.is_partial(partial).all()
    assert whole.tolist() == [0] and not cache.is_partial(whole).any()
    assert cache.evictable(whole=True) == 5 and cache.evictable(whole=False) == 103


def test_a_reader_keeps_the_small_sharded_fields_whose_chunks_fit_half_its_cache():
    """Of a buffer larger than the cache, a writer reads every sharded field row by row; a reader
    keeps the chunks of those of the smallest rows whole while all their chunks, with the fields
    not sharded, fit half its cache (none where that would be all of them)."""
    schema = Schema({"obs": Field((64,), "float32"), "reward": Field((), "float32"), "done": Field((), "bool"),
                     "count": Field((), "int64")})
    sharded, plain = Codec("zstd", inner_rows=64), Codec("zstd")
    codecs = {"obs": sharded, "reward": sharded, "done": sharded, "count": plain}
    chunks, rows = 10, 1024  # all chunks of obs: 2,621,440 bytes, reward 40,960, done 10,240, count 81,920
    assert fields_read_by_rows(schema, codecs, chunks, rows, 1 << 20, reader=False) == ("obs", "reward", "done")
    assert fields_read_by_rows(schema, codecs, chunks, rows, 1 << 20, reader=True) == ("obs",)
    assert fields_read_by_rows(schema, codecs, chunks, rows, 2 * 122_880, reader=True) == ("obs", "reward")
    assert fields_read_by_rows(schema, codecs, chunks, rows, 2 * 92_159, reader=True) == ("obs", "reward", "done")
    assert fields_read_by_rows(schema, codecs, chunks, rows, 1 << 30, reader=True) == ("obs", "reward", "done")


def test_a_partial_reservation_takes_free_slots_without_room_for_row_fields_only():
    schema = Schema({"obs": Field((8,), "float32"), "reward": Field((), "float32")})
    cache = ChunkCache(schema, 1, 16, 6, 8, full_slots=2, row_fields=("obs",))
    cache.assign(np.array([0]), np.array([0]), whole=False)  # slot 5
    assert cache.reserve_partial(4) is None
    slots = cache.reserve_partial(3)
    assert slots.tolist() == [2, 3, 4] and cache.is_pinned(slots).all() and cache.evictable(whole=True) == 2
    assert cache.slots_of(np.zeros(3, np.int64), np.arange(1, 4)).tolist() == [-1, -1, -1]  # found once placed


def test_buffer_cache_size_is_bounded(tmp_path):
    # a ring never needs more slots than it has chunks; tiny chunks must not make a giant table
    ring = dr.ReplayBuffer.create(tmp_path / "r", SMALL_FIELDS, 3 * 40, num_envs=3, chunk_rows=4)
    assert ring.stats().cache_slots <= max(2 * 3 + 2, 3 * 10)
    ring.close()
    data = dr.ReplayBuffer.create(tmp_path / "d", SMALL_FIELDS, None, chunk_rows=1)
    assert data.stats().cache_slots <= ChunkCache.MAX_SLOTS
    data.close()


# ---- buffers with a cache far smaller than a batch's chunks -----------------------------------


@pytest.mark.parametrize("capacity", [None, 3 * 60])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_tiny_cache_returns_correct_rows(tmp_path, capacity, compression):
    model = Model(3, capacity)
    buf = dr.ReplayBuffer.create(tmp_path / "b", SMALL_FIELDS, capacity, num_envs=3, chunk_rows=2,
                                 compression=compression, cache_bytes=min_cache(num_envs=3, chunk_rows=2), seed=0)
    slots = buf.stats().cache_slots
    assert slots == 2 * 3 + 2  # the minimum
    for n in (25, 40, 7):
        rows = model.next_rows(3 * n)
        data = stack_rows(rows)
        buf.extend({k: v.reshape(n, 3, *v.shape[1:]) for k, v in data.items()})
        for j in range(3):
            model.append(j, rows[j::3])
    ids = buf.row_ids()
    assert len(np.unique(ids // 3 // 2)) > slots  # one read touches far more chunks than slots
    batch = buf.sample(256)
    assert_rows_equal(batch, model.expected(batch["index"]), "writer sample")
    assert_rows_equal(buf[ids], model.expected(ids), "writer rows")
    buf.flush()
    model.flush()
    reader = dr.ReplayBuffer.open(tmp_path / "b", mode="r", cache_bytes=1)
    assert reader.stats().cache_slots == 1  # a reader stages nothing: one chunk at a time
    for _ in range(3):
        batch = reader.sample(256)
        assert_rows_equal(batch, model.expected(batch["index"]), "reader sample")
    check_buffer_against(reader, model, committed=True)
    reader.close()
    buf.close()


def test_tiny_cache_while_writing_interleaved_reads(tmp_path):
    model = Model(2, 2 * 24)
    buf = dr.ReplayBuffer.create(tmp_path / "b", SMALL_FIELDS, 2 * 24, num_envs=2, chunk_rows=3,
                                 cache_bytes=min_cache(num_envs=2, chunk_rows=3))
    for i in range(40):
        lanes = [i % 2] if i % 3 else None
        rows = model.next_rows(len(lanes) if lanes else 2)
        buf.add(env_ids=lanes, **stack_rows(rows))
        for lane, row in zip(lanes or [0, 1], rows):
            model.append(lane, [row])
        batch = buf.sample(64, seed=i)
        assert_rows_equal(batch, model.expected(batch["index"]), f"step {i}")
        if i % 7 == 6:
            buf.flush()
    check_buffer_against(buf, model)
    buf.close()


def test_ring_wrap_restaging_a_sealed_chunk_keeps_it_pinned(tmp_path):
    """An extend that wraps the ring re-stages the chunk it started in, which it has already sealed.
    Writing the sealed chunks must not unpin it: other lanes' chunks would evict it from under the
    writer's next row."""
    model = Model(3, 48)
    buf = dr.ReplayBuffer.create(tmp_path / "b", SMALL_FIELDS, 48, num_envs=3, chunk_rows=4,
                                 cache_bytes=10 * 4 * ROW_BYTES)
    assert buf.stats().cache_slots == 10  # fewer than the 12 chunks, more than twice a lane's 4
    rows = model.next_rows(2)
    buf.extend({k: v[:, None] for k, v in stack_rows(rows).items()}, env_ids=[0])
    model.append(0, rows)
    rows = model.next_rows(17)  # starts mid-chunk 0, wraps back into chunk 0
    buf.extend({k: v[:, None] for k, v in stack_rows(rows).items()}, env_ids=[0])
    model.append(0, rows)
    rows = model.next_rows(32)  # lanes 1 and 2 need 8 slots: evicts whatever lane 0 left unpinned
    buf.extend({k: v.reshape(16, 2, *v.shape[1:]) for k, v in stack_rows(rows).items()}, env_ids=[1, 2])
    model.append(1, rows[0::2])
    model.append(2, rows[1::2])
    rows = model.next_rows(1)
    buf.add(env_ids=[0], **stack_rows(rows))
    model.append(0, rows)
    check_buffer_against(buf, model)
    buf.close()
    model.flush()
    with dr.ReplayBuffer.open(tmp_path / "b", cache_bytes=1) as ro:
        check_buffer_against(ro, model, committed=True)
