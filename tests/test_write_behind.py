"""Sealed chunks are written behind the appends (issue #13: a single add never waits for a chunk
write, its retire commit or the disk).

A wrapper around `LocalChunkStore`'s writes holds chosen writes until the test lets them go, or
fails them: what is shown is what the writer did while a write was held (calls returned, rows
read, commits on disk), never how long anything took.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from conftest import OWN, dir_snapshot

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.io import LocalChunkStore
from diskreplay.storage import ring_reads, write_behind
from diskreplay.storage.chunk_io import ChunkIO, balanced
from diskreplay.storage.ring_reads import READ_AHEAD_CHUNKS
from diskreplay.storage.write_behind import WriteBehind
from diskreplay.storage.writer import BACKLOG_SHARE, PACE_S, PACE_SHARE, StagingWriter

CHUNK = 8
SAFETY_S = 30
FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64")}


def rows(ids) -> dict[str, np.ndarray]:
    ids = np.asarray(ids, dtype=np.int64)
    return {"obs": np.stack([ids, ids + 0.5, -ids], -1).astype(np.float32), "act": ids * 3}


def add(buf: dr.ReplayBuffer, first: int, n: int) -> None:
    for i in range(first, first + n):
        buf.add(**{k: v[0] for k, v in rows([i]).items()})


class Writes:
    """Every `LocalChunkStore` write (``put`` and ``put_in_place``) under a root, seen, and held
    or failed while a rule says so."""

    def __init__(self, root: str, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        self.hold: Callable[[str], bool] = lambda key: False
        self.fail: Callable[[str], bool] = lambda key: False
        self.released = threading.Event()
        self.held = threading.Event()
        self.failed: list[str] = []
        self.keys: list[str] = []
        put, put_in_place = LocalChunkStore.put, LocalChunkStore.put_in_place

        def check(store: LocalChunkStore, key: str) -> None:
            if not store.root.startswith(root):
                return
            key = os.path.relpath(store.path(key), root)
            self.keys.append(key)
            if self.hold(key):
                self.held.set()
                assert self.released.wait(SAFETY_S), "held write never released"
            if self.fail(key):
                self.fail = lambda key: False  # once
                self.failed.append(key)
                raise OSError(errno.EIO, os.strerror(errno.EIO), key)

        def wrapped_put(store, key, data, durable=False):
            check(store, key)
            return put(store, key, data, durable)

        def wrapped_put_in_place(store, key, data):
            check(store, key)
            return put_in_place(store, key, data)

        monkeypatch.setattr(LocalChunkStore, "put", wrapped_put)
        monkeypatch.setattr(LocalChunkStore, "put_in_place", wrapped_put_in_place)


def is_chunk(key: str) -> bool:
    return key.startswith(("obs/c", "act/c"))


def committed_ids(url: str) -> np.ndarray:
    with dr.ReplayBuffer.open(url, "r") as reader:
        ids = reader.row_ids()
        got = reader[ids]
        np.testing.assert_array_equal(got["obs"], rows(ids)["obs"])
        np.testing.assert_array_equal(got["act"], rows(ids)["act"])
        return np.sort(ids)


@pytest.fixture
def writes(tmp_path, monkeypatch) -> Writes:
    return Writes(str(tmp_path / "buf"), monkeypatch)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_adds_go_on_while_a_sealed_chunk_is_written(writes, compression):
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=4 * CHUNK, chunk_rows=CHUNK,
                                 compression=compression, seed=0)
    try:
        writes.hold = is_chunk
        add(buf, 0, CHUNK)  # the last add seals chunk 0: its write starts and is held
        assert writes.held.wait(SAFETY_S)
        add(buf, CHUNK, CHUNK - 1)  # more adds return while it is held
        ids = buf.row_ids()
        np.testing.assert_array_equal(ids, np.arange(2 * CHUNK - 1))
        np.testing.assert_array_equal(buf[ids]["act"], rows(ids)["act"])  # chunk 0 read from the cache
        assert not any(key.startswith(("obs/c.0.1", "act/c.0.1")) for key in writes.keys)  # chunk 1: staged
        writes.released.set()
        buf.flush()
        np.testing.assert_array_equal(committed_ids(writes.root), np.arange(2 * CHUNK - 1))
    finally:
        writes.released.set()
        buf.close()
    assert verify(writes.root).ok


def test_adds_stage_in_place_while_a_sealed_chunk_waits_for_the_write_in_flight(writes):
    """A chunk sealed while the one before is still being written waits for that write whichever
    way the next adds go: they take the short way (`StepStaging`, one assignment per field) and
    store the same rows, not the long way for as long as the write lasts."""
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=None, chunk_rows=CHUNK, seed=0)
    writer = buf.storage.writer
    staging, short = writer.steps, []
    inner = staging.append

    def counted(rows: dict[str, np.ndarray]) -> int:
        step = inner(rows)
        if step >= 0:
            short.append(step)
        return step
    staging.append = counted  # type: ignore[method-assign]
    try:
        writes.hold = is_chunk
        add(buf, 0, CHUNK)  # seals chunk 0: its write starts and is held
        assert writes.held.wait(SAFETY_S)
        add(buf, CHUNK, CHUNK)  # seals chunk 1: it waits for chunk 0's write
        del short[:]
        add(buf, 2 * CHUNK, CHUNK - 1)
        assert short == list(range(2 * CHUNK + 1, 3 * CHUNK - 1))  # all but the chunk's first row
        assert [chunk for _, chunk, _ in writer.sealed] == [1] and writer.behind.busy
        np.testing.assert_array_equal(buf[buf.row_ids()]["act"], rows(np.arange(3 * CHUNK - 1))["act"])
        writes.released.set()
        add(buf, 3 * CHUNK - 1, 2)
        buf.flush()
        np.testing.assert_array_equal(committed_ids(writes.root), np.arange(3 * CHUNK + 1))
    finally:
        writes.released.set()
        buf.close()
    assert verify(writes.root).ok


def test_the_retire_commit_of_a_full_ring_is_behind_the_add_too(writes):
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=2 * CHUNK, chunk_rows=CHUNK, seed=0)
    try:
        add(buf, 0, 2 * CHUNK)
        buf.flush()
        writes.hold = lambda key: key == OWN + "commit.json"
        commits = len([k for k in writes.keys if k == OWN + "commit.json"])
        add(buf, 2 * CHUNK, CHUNK)  # overwrites chunk 0: retire commit first, held
        assert writes.held.wait(SAFETY_S)
        add(buf, 3 * CHUNK, 3)
        np.testing.assert_array_equal(buf.row_ids(), np.arange(CHUNK + 3, 3 * CHUNK + 3))
        assert len([k for k in writes.keys if k == OWN + "commit.json"]) == commits + 1  # the held one
        writes.released.set()
        buf.flush()
        np.testing.assert_array_equal(committed_ids(writes.root), np.arange(CHUNK + 3, 3 * CHUNK + 3))
    finally:
        writes.released.set()
        buf.close()


def background_job(buf: dr.ReplayBuffer):
    writer = buf.storage.writer
    assert writer is not None
    return writer.behind._job


def test_a_failed_background_write_is_raised_once_by_the_next_add_and_written_again(writes):
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=4 * CHUNK, chunk_rows=CHUNK, seed=0)
    try:
        add(buf, 0, 3)
        buf.flush()
        writes.fail = is_chunk
        add(buf, 3, CHUNK - 3)  # seals chunk 0: its write fails in the background
        job = background_job(buf)
        assert job is not None and isinstance(job.exception(SAFETY_S), OSError)
        before = buf.state_dict()["total"]
        with pytest.raises(OSError, match=os.strerror(errno.EIO)) as info:
            add(buf, CHUNK, 1)
        assert info.value.filename in writes.failed
        np.testing.assert_array_equal(buf.state_dict()["total"], before)  # that add stored nothing
        np.testing.assert_array_equal(buf.row_ids(), np.arange(CHUNK))
        np.testing.assert_array_equal(committed_ids(writes.root), np.arange(3))
        add(buf, CHUNK, 2)  # raised once: the writer goes on, chunk 0 is written again
        buf.flush()
        np.testing.assert_array_equal(committed_ids(writes.root), np.arange(CHUNK + 2))
    finally:
        buf.close()
    assert verify(writes.root).ok


def test_a_failed_background_write_fails_the_flush_which_commits_nothing(writes):
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=None, chunk_rows=CHUNK, seed=0)
    try:
        writes.hold = writes.fail = is_chunk
        add(buf, 0, CHUNK + 2)  # chunk 0's write is held, then fails
        assert writes.held.wait(SAFETY_S)
        writes.released.set()
        with pytest.raises(OSError, match=os.strerror(errno.EIO)):
            buf.flush()
        assert len(committed_ids(writes.root)) == 0
        buf.flush()  # the rows stayed staged
        np.testing.assert_array_equal(committed_ids(writes.root), np.arange(CHUNK + 2))
    finally:
        buf.close()
    assert verify(writes.root).ok


def test_close_waits_for_the_write_in_flight(writes):
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=None, chunk_rows=CHUNK, seed=0)
    before = set(threading.enumerate())
    writes.hold = is_chunk
    add(buf, 0, CHUNK)
    assert writes.held.wait(SAFETY_S)
    job = background_job(buf)
    assert job is not None and not job.done()
    threads = [t for t in set(threading.enumerate()) - before if t.name.startswith("diskreplay-write-behind")]
    assert len(threads) == 1
    threading.Timer(0.05, writes.released.set).start()  # close must wait for it
    buf.close()
    assert writes.released.is_set() and job.done() and job.exception() is None
    assert not threads[0].is_alive()
    np.testing.assert_array_equal(committed_ids(writes.root), np.arange(CHUNK))  # close flushed
    dr.ReplayBuffer.open(writes.root, "r+").close()  # and released the lock


def test_appends_wait_for_a_store_that_falls_behind(writes, monkeypatch):
    """While one batch is held, sealed chunks pile up: past 1/`BACKLOG_SHARE` of the cache, the
    add that seals one more waits for the batch in flight (not for half the cache, which would be
    one long stall). Batches are short: the next one takes a few chunks, not the whole pile."""
    row_bytes = sum(field.row_bytes for field in FIELDS.values())
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=None, chunk_rows=CHUNK, seed=0,
                                 cache_bytes=40 * CHUNK * row_bytes)
    writer = buf.storage.writer
    limit, batch = writer.cache.full_slots // BACKLOG_SHARE, writer.io.threads
    assert 4 <= limit and batch < limit
    added, seen = [], []
    settle = StagingWriter.settle

    def spied(writer: StagingWriter, wait: bool = False) -> None:
        if wait:
            seen.append((len(added), len(writer.sealed), writes.released.is_set()))
        settle(writer, wait)
    monkeypatch.setattr(StagingWriter, "settle", spied)
    writes.hold = lambda key: is_chunk(key) and not writes.released.is_set()
    total = (limit + 4) * CHUNK

    def adds() -> None:
        for i in range(total):
            add(buf, i, 1)
            added.append(i)
    thread = threading.Thread(target=adds)
    try:
        thread.start()
        assert writes.held.wait(SAFETY_S)
        deadline = threading.Event()
        while not seen and thread.is_alive() and not deadline.wait(0.01):
            pass
        assert seen[0] == ((limit + 2) * CHUNK - 1, limit + 1, False)  # chunk 0 held, 1..limit+1 sealed
    finally:
        writes.released.set()
        thread.join(SAFETY_S)
    assert not thread.is_alive() and len(added) == total
    assert len(writer.sealed) <= limit + 1 and len(writer.behind.in_flight) <= batch
    buf.flush()
    buf.close()
    np.testing.assert_array_equal(committed_ids(writes.root), np.arange(total))


ROUND = 48 * CHUNK


def backlog_ring(writes: Writes) -> tuple[dr.ReplayBuffer, StagingWriter]:
    """A full ring of `ROUND` rows, committed; its cache lets sealed chunks wait."""
    row_bytes = sum(field.row_bytes for field in FIELDS.values())
    buf = dr.ReplayBuffer.create(writes.root, FIELDS, capacity=ROUND, chunk_rows=CHUNK, seed=0,
                                 cache_bytes=80 * CHUNK * row_bytes)
    add(buf, 0, ROUND)
    buf.flush()
    return buf, buf.storage.writer


def commits(writes: Writes) -> int:
    return writes.keys.count(OWN + "commit.json")


def test_one_retire_commit_covers_the_chunks_sealed_before_it(writes):
    """After a stall, the chunks that piled up go in several batches, but the rows they overwrite
    were all retired by the first batch's commit: one fsync, not one per batch."""
    buf, writer = backlog_ring(writes)
    limit, batch = writer.cache.full_slots // BACKLOG_SHARE, max(writer.io.threads, 1)
    assert limit > 2 * batch
    try:
        writes.hold = lambda key: is_chunk(key) and not writes.released.is_set()
        add(buf, ROUND, CHUNK)  # seals chunk 0 of the next round: retired, then its write held
        assert writes.held.wait(SAFETY_S)
        add(buf, ROUND + CHUNK, limit * CHUNK)  # seals chunks 1..limit meanwhile
        assert len(writer.sealed) == limit
        before = commits(writes)
        writes.released.set()
        batches, step = 0, ROUND + (limit + 1) * CHUNK
        while writer.sealed:  # an add per batch: each moves the lower bound a retire would commit
            writer.wait()
            add(buf, step, 1)
            step, batches = step + 1, batches + 1
        assert step < ROUND + (limit + 2) * CHUNK  # no add sealed another chunk
        writer.wait()
        assert batches >= limit // batch and commits(writes) == before + 1
        buf.flush()
    finally:
        writes.released.set()
        buf.close()
    end = step
    np.testing.assert_array_equal(committed_ids(writes.root), np.arange(end - ROUND, end))
    assert verify(writes.root).ok


def test_appends_past_a_part_of_the_backlog_give_the_write_a_moment(writes, monkeypatch):
    """Between 1/`PACE_SHARE` of the backlog and all of it, each append gives the batch in flight
    `PACE_S` (it returns while the write is still held): a store falling behind slows the appends
    a little at a time instead of stopping one of them for a whole batch."""
    buf, writer = backlog_ring(writes)
    limit = writer.cache.full_slots // BACKLOG_SHARE
    paced: list[tuple[int, float]] = []
    wait = WriteBehind.wait
    monkeypatch.setattr(WriteBehind, "wait", lambda behind, timeout: (paced.append((len(writer.sealed), timeout)),
                                                                       wait(behind, timeout)))
    try:
        writes.hold = lambda key: is_chunk(key) and not writes.released.is_set()
        add(buf, ROUND, CHUNK)
        assert writes.held.wait(SAFETY_S)
        add(buf, ROUND + CHUNK, limit * CHUNK)
        assert writer.behind.busy and len(writer.sealed) == limit  # nothing was waited for to the end
        soft = limit // PACE_SHARE
        # the add sealing a chunk and the ones after it until the next chunk seals see the same backlog
        want = [(sealed, PACE_S) for sealed in range(soft + 1, limit) for _ in range(CHUNK)]
        assert paced == want + [(limit, PACE_S)]
    finally:
        writes.released.set()
        buf.close()


# ---- reading ahead ---------------------------------------------------------------------------

RING = 32  # chunks per lane: more than the caches below hold

EPISODIC = {"obs": dr.Field((4, 4), "uint8"), "next_obs": dr.Field((4, 4), "uint8"),
            "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}


def episodic_steps(first: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(first, first + n)
    obs = (ids[:, None, None] * 7 + np.arange(16).reshape(4, 4)).astype(np.uint8)
    return {"obs": obs, "next_obs": obs + 7, "reward": (ids % 5).astype(np.float32), "done": ids % 23 == 22}


def go_round(path: str, read_depth: int | None, compression: str | None, lanes: int,
             after_add: Callable[[int, dr.ReplayBuffer], None] | None = None) -> dr.ReplayBuffer:
    """A ring with episodic returns (which patch rows already added) and next_obs, going round 3
    times with single adds (every 5th of lane 0 only, so lanes start chunks apart) and flushes
    mid-chunk. ``read_depth``: chunks each lane reads ahead (None: the writer's own choice);
    ``after_add(i, buf)``: called after add i."""
    buf = dr.ReplayBuffer.create(path, EPISODIC, capacity=RING * CHUNK * lanes, num_envs=lanes, chunk_rows=CHUNK,
                                 compression=compression, seed=0, derive_next=("obs",),
                                 episodic_return=dr.EpisodicReturn(gamma=0.5),
                                 cache_bytes=4608 * lanes)  # fewer chunks than the ring; the side store's staging
    assert buf.storage.writer.reads.depth == READ_AHEAD_CHUNKS and buf.storage._cache.full_slots < RING * lanes
    if read_depth is not None:
        buf.storage.writer.reads.depth = read_depth
    for i in range(3 * RING * CHUNK + 5):
        step = {k: v.reshape(lanes, *v.shape[1:]) for k, v in episodic_steps(i * lanes, lanes).items()}
        if lanes > 1 and i % 5 == 4:
            buf.add(env_ids=[0], **{k: v[:1] for k, v in step.items()})
        else:
            buf.add(**({k: v[0] for k, v in step.items()} if lanes == 1 else step))
        if i % 37 == 36:
            buf.flush()
        if after_add is not None:
            after_add(i, buf)
    return buf


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_reading_ahead_stores_exactly_what_loading_in_the_add_does(tmp_path, compression, lanes):
    files = []
    for read_depth in (0, 1, None, RING - 1):  # none, the next chunk, the default, every other chunk of the ring
        path = str(tmp_path / f"ahead-{read_depth}")
        buf = go_round(path, read_depth, compression, lanes)
        ids = buf.row_ids()
        rows = buf[ids]
        buf.close()
        files.append(({k: v for k, v in dir_snapshot(path).items() if OWN not in k}, ids, rows))
    want, want_ids, want_rows = files[0]
    for got, got_ids, got_rows in files[1:]:
        assert got == want
        np.testing.assert_array_equal(got_ids, want_ids)
        for name in want_rows:
            np.testing.assert_array_equal(got_rows[name], want_rows[name], err_msg=name)


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("lanes", [1, 2])
def test_chunks_staged_before_their_reads_ahead_land_store_and_read_what_loading_in_the_add_does(
        tmp_path, monkeypatch, compression, lanes):
    """Each read ahead held until the lane is past the chunk it reads (and every 4th failing),
    so that lanes stage chunks before their stored rows land, which then follow: the files, and
    every row read every 11 adds, are those of a writer that reads each chunk in the add that
    starts it. Where the writer waits for a read, the reads started before go on at once."""
    def reads_every_11(seen: list[dict[str, np.ndarray]]) -> Callable[[int, dr.ReplayBuffer], None]:
        return lambda i, buf: seen.append(buf[buf.row_ids()]) if i % 11 == 10 else None

    want_seen: list[dict[str, np.ndarray]] = []
    want = go_round(str(tmp_path / "now"), 0, compression, lanes, reads_every_11(want_seen))
    want.close()
    adds, calls, landed, submitted, released = [0], [0], [0], [0], [0]
    order: dict[tuple[int, int], int] = {}  # (lane, chunk) -> its read ahead's number
    gate = threading.Condition()
    read_rows, read_ahead, land = write_behind.read_rows, WriteBehind.read_ahead, ring_reads.OldRows.land

    def counted_read_ahead(behind, io, lane, chunks, like):
        for chunk in chunks:
            if (lane, chunk) not in order:
                submitted[0] += 1
                order[(lane, chunk)] = submitted[0]
        return read_ahead(behind, io, lane, chunks, like)

    def held(io, lane, chunk, like, must_exist):
        calls[0] += 1
        failing = calls[0] % 4 == 0
        with gate:  # the lane is past the next chunk's first row (the timeout only guards against a hang)
            until, number = adds[0] + CHUNK + 2, order.pop((lane, chunk), 0)
            gate.wait_for(lambda: number <= released[0] or adds[0] >= until, timeout=30)
        if failing:
            raise OSError("a read ahead failing")
        return read_rows(io, lane, chunk, like, must_exist)

    def releasing(wait_for_reads):
        def run(*args, **kwargs):
            with gate:
                released[0] = submitted[0]  # every read asked for so far
                gate.notify_all()
            return wait_for_reads(*args, **kwargs)

        return run

    def counted_land(old, cache, position):
        landed[0] += 1
        return land(old, cache, position)

    load = ring_reads.RingReads.load  # waits for a read ahead only for a chunk staged from a later row
    monkeypatch.setattr(write_behind, "read_rows", held)
    monkeypatch.setattr(WriteBehind, "read_ahead", counted_read_ahead)
    monkeypatch.setattr(ring_reads.OldRows, "land", releasing(counted_land))
    monkeypatch.setattr(ring_reads.RingReads, "load", lambda reads, lane, chunk, first, offset: (
        releasing(load) if offset else load)(reads, lane, chunk, first, offset))
    monkeypatch.setattr(WriteBehind, "close", releasing(WriteBehind.close))
    record = reads_every_11(got_seen := [])

    def after_add(i: int, buf: dr.ReplayBuffer) -> None:
        with gate:
            adds[0] = i + 1
            gate.notify_all()
        record(i, buf)

    got = go_round(str(tmp_path / "later"), 1, compression, lanes, after_add)
    got.close()
    assert landed[0] >= 1  # chunks staged before their read landed, then merged (5 to 50 per case; 2 seen under load)
    assert ({k: v for k, v in dir_snapshot(str(tmp_path / "later")).items() if OWN not in k}
            == {k: v for k, v in dir_snapshot(str(tmp_path / "now")).items() if OWN not in k})
    assert len(got_seen) == len(want_seen)
    for got_rows, want_rows in zip(got_seen, want_seen):
        assert got_rows.keys() == want_rows.keys()
        for name in want_rows:
            np.testing.assert_array_equal(got_rows[name], want_rows[name], err_msg=name)


def test_a_ring_going_round_reads_the_chunks_it_overwrites_ahead(tmp_path, monkeypatch):
    """No add reads a stored chunk itself: the read-ahead thread has read it, as the lane started
    the chunk before (the add waits for that read if it has not ended)."""
    row_bytes = sum(field.row_bytes for field in FIELDS.values())
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), FIELDS, capacity=RING * CHUNK, chunk_rows=CHUNK,
                                 compression="zstd", seed=0, cache_bytes=10 * CHUNK * row_bytes)
    assert buf.storage.writer.reads.depth == READ_AHEAD_CHUNKS and buf.storage._cache.full_slots < RING
    add(buf, 0, RING * CHUNK)
    buf.flush()
    readers: list[tuple[str, int]] = []
    read = ChunkIO.read

    def spied(io: ChunkIO, work, must_exist):
        readers.append((threading.current_thread().name, len(work)))
        return read(io, work, must_exist)
    monkeypatch.setattr(ChunkIO, "read", spied)
    add(buf, RING * CHUNK, 2 * RING * CHUNK)  # round two and three
    names = [name for name, _ in readers]  # (chunks still cached are not read at all)
    assert len(names) >= RING and all(n.startswith("diskreplay-read-ahead") for n in names), names
    assert all(fields == len(FIELDS) for _, fields in readers)
    np.testing.assert_array_equal(buf[buf.row_ids()]["act"], rows(buf.row_ids())["act"])
    buf.close()


def test_each_lane_reads_ahead_the_chunks_its_share_of_the_budget_holds(tmp_path, monkeypatch):
    """A lane starting a chunk reads the next ones ahead: as many as its share of
    `READ_AHEAD_BYTES` holds, at least one, at most `READ_AHEAD_CHUNKS` and never the whole ring;
    none in a buffer that is not a ring. Reads ahead of chunks left behind are dropped."""
    row_bytes = sum(field.row_bytes for field in FIELDS.values())
    lanes = dr.ReplayBuffer.create(str(tmp_path / "l"), FIELDS, capacity=2 * RING * CHUNK, num_envs=2,
                                   chunk_rows=CHUNK, seed=0, cache_bytes=40 * CHUNK * row_bytes)
    lane_chunk = 2 * CHUNK * row_bytes  # a chunk of each of the two lanes
    for budget, depth in ((3 * lane_chunk, 3), (lane_chunk // 2, 1), (100 * lane_chunk, READ_AHEAD_CHUNKS)):
        monkeypatch.setattr(ring_reads, "READ_AHEAD_BYTES", budget)
        assert ring_reads.read_depth(lanes.storage.layout, row_bytes, lanes.storage._cache.full_slots) == depth
    lanes.close()
    small = dr.ReplayBuffer.create(str(tmp_path / "s"), FIELDS, capacity=12 * CHUNK, chunk_rows=CHUNK, seed=0,
                                   cache_bytes=40 * CHUNK * row_bytes)
    unbounded = dr.ReplayBuffer.create(str(tmp_path / "u"), FIELDS, capacity=None, chunk_rows=CHUNK, seed=0)
    assert (small.storage.writer.reads.depth, unbounded.storage.writer.reads.depth) == (11, 0)
    small.close()
    unbounded.close()
    with dr.ReplayBuffer.create(str(tmp_path / "b"), FIELDS, capacity=RING * CHUNK, chunk_rows=CHUNK,
                                compression="zstd", seed=0) as buf:
        add(buf, 0, RING * CHUNK)
    buf = dr.ReplayBuffer.open(str(tmp_path / "b"), "r+", cache_bytes=10 * CHUNK * row_bytes)  # nothing cached
    buf.storage.writer.reads.depth = 3
    add(buf, RING * CHUNK, 3 * CHUNK + 1)  # into chunk 3 of round two
    assert sorted(buf.storage.writer.behind._reads) == [(0, 4), (0, 5), (0, 6)]
    buf.storage.writer.reads.depth = 1
    add(buf, (RING + 3) * CHUNK + 1, CHUNK)  # into chunk 4: 5 is kept, 6 dropped
    assert sorted(buf.storage.writer.behind._reads) == [(0, 5)]
    np.testing.assert_array_equal(buf[buf.row_ids()]["act"], rows(buf.row_ids())["act"])
    buf.close()


def test_a_batchs_frame_chunks_go_to_different_io_jobs(tmp_path, monkeypatch):
    """Chunk writes are dealt to the I/O threads' jobs by bytes, biggest first: the two frame
    chunks of a batch go to the two jobs, though the four fields would put every frame chunk in
    one job if dealt in turn."""
    fields = {"obs": dr.Field((32, 32), "uint8"), "action": dr.Field((), "int64"),
              "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), fields, capacity=1024, chunk_rows=64, compression="lz4",
                                 io_threads=2)
    jobs: list[list[str]] = []
    put_batch = ChunkIO._put_batch
    monkeypatch.setattr(ChunkIO, "_put_batch", lambda self, work, durable: (
        jobs.append(sorted(key.split("/")[0] for key, *_ in work)), put_batch(self, work, durable))[1])
    steps = np.arange(128)
    buf.extend({"obs": np.repeat(steps.astype(np.uint8), 1024).reshape(128, 32, 32), "action": steps,
                "reward": steps.astype(np.float32), "done": steps % 50 == 49})
    buf.flush()
    assert sorted(jobs) == [["action", "done", "obs", "reward"]] * 2, jobs
    np.testing.assert_array_equal(buf[np.arange(128)]["obs"][:, 0, 0], steps)
    buf.close()


def test_chunk_writes_are_dealt_by_bytes():
    """Biggest first, each to the lightest list; each list keeps the batch's order."""
    def work(*sizes: int) -> list:
        return [(f"k{i}", None, np.empty(size, np.uint8), False) for i, size in enumerate(sizes)]
    keys = lambda lists: [[key for key, *_ in part] for part in lists]  # noqa: E731
    assert keys(balanced(work(100, 1, 1, 1, 100, 1, 1, 1), 2)) == [["k0", "k1", "k3", "k6"], ["k2", "k4", "k5", "k7"]]
    assert keys(balanced(work(5, 9), 4)) == [["k1"], ["k0"]]
    assert balanced([], 2) == []
