"""Epochs read ahead: the chunks of the next batches are fetched and decoded on threads, in order
of need, bounded by bytes (`diskreplay.storage.read_ahead`). Checked by counts: requests and the
most in flight at the S3 proxy (tests/s3server.py), bytes fetched, chunks in `stats()`."""

from __future__ import annotations

import os

import numpy as np
import pytest
from s3server import FaultProxy, proxy_options, s3, s3_client

import diskreplay as dr
from diskreplay.errors import CorruptBufferError
from diskreplay.torch import Loader, make_dataset
from diskreplay.torch.read_sizes import batches_per_read

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64")}
CHUNK = 64
CHUNKS = 48
ROW_BYTES = 12 + 8
CHUNK_BYTES = CHUNK * ROW_BYTES


def write(url: str, storage_options: dict | None = None, compression: str | None = "zstd") -> None:
    """``CHUNKS`` chunks of ``CHUNK`` rows; row id ``i`` has act == i and obs == (i, i + .5, -i)."""
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=CHUNK, compression=compression,
                                 storage_options=storage_options)
    ids = np.arange(CHUNKS * CHUNK)
    buf.extend({"obs": np.stack([ids, ids + 0.5, -ids], -1).astype(np.float32), "act": ids})
    buf.close()


def check_epoch(ds) -> None:
    """One epoch in this process: every row exactly once, each with its own values."""
    check_batches(Loader(ds))


def check_batches(batches) -> None:
    """An epoch's batches: every row exactly once, each with its own values."""
    seen = []
    for batch in batches:
        ids = batch["index"].numpy()
        np.testing.assert_array_equal(batch["act"].numpy(), ids)
        np.testing.assert_array_equal(batch["obs"].numpy(), np.stack([ids, ids + 0.5, -ids], -1).astype(np.float32))
        seen.append(ids)
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(CHUNKS * CHUNK))


def chunk_gets(proxy: FaultProxy) -> dict[str, int]:
    """GETs of each chunk object the proxy saw."""
    with proxy.lock:
        return {path: n for (method, path), n in proxy.hits.items() if method == "GET" and "/c." in path}


@pytest.mark.parametrize("shuffle", ["none", "block"])
def test_s3_epoch_keeps_the_store_busy_and_fetches_each_chunk_once(s3, s3_client, shuffle):
    url = s3.new_url("ahead")
    write(url, s3.storage_options())
    proxy = FaultProxy(s3.endpoint, latency_s=0.05)
    try:
        ds = make_dataset(url, 16, mode="epoch", shuffle=shuffle, io_threads=8,
                          storage_options=proxy_options(s3, proxy))
        reader = ds.reader.get()
        if s3_client == "s3fs":
            reader.storage.store.fs.retries = 1  # s3fs would retry a slow answer silently: an uncounted GET
        proxy.reset_stats()
        check_epoch(ds)
        gets = chunk_gets(proxy)
        assert len(gets) == 2 * CHUNKS
        assert sum(gets.values()) == 2 * CHUNKS + reader.storage.store.retried
        # before: one batch's chunk at a time (2 requests in flight with shuffle="none")
        assert 8 < proxy.max_in_flight <= 4 * 8  # up to four requests per I/O thread of the store, never more
        stats = reader.stats()
        assert stats.chunks_loaded == stats.chunks_read_ahead == CHUNKS
    finally:
        proxy.close()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_first_batch_decodes_its_chunks_and_the_budget_only(s3, tmp_path, where):
    so = s3.storage_options() if where == "s3" else None
    url = s3.new_url("first") if where == "s3" else str(tmp_path / "b")
    write(url, so)
    ds = make_dataset(url, 16, mode="epoch", shuffle="none", storage_options=so)
    ds.read_ahead_bytes = 4 * CHUNK_BYTES
    reader = ds.reader.get()
    batches = iter(Loader(ds))
    next(batches)
    first_read = 16 * batches_per_read(16, reader)  # rows the first gather reads: whole chunks here
    assert first_read % CHUNK == 0
    # before: 48 on local disk (the first read filled the cache with every chunk, decoding each)
    assert reader.stats().chunks_loaded == first_read // CHUNK + 4
    assert reader.stats().chunks_read_ahead == first_read // CHUNK + 4
    for _ in batches:
        pass
    assert reader.stats().chunks_loaded == CHUNKS


def test_read_ahead_stays_within_its_byte_budget(s3):
    url = s3.new_url("budget")
    write(url, s3.storage_options(), compression=None)
    buf = dr.ReplayBuffer.open(url, "r", storage_options=s3.storage_options(), io_threads=4)
    storage, fetched = buf.storage, {}
    keys = {storage.chunk_key(name, 0, c): c for name in FIELDS for c in range(CHUNKS)}
    original = storage.store.get_many

    def counted(names, *args):
        blobs = original(names, *args)
        for name, blob in zip(names, blobs):
            fetched[keys[name]] = fetched.get(keys[name], 0) + len(blob)
        return blobs

    storage.store.get_many = counted
    budget = 3 * CHUNK_BYTES + CHUNK_BYTES // 2
    lane = np.zeros(CHUNK, np.int64)
    steps = [np.arange(c * CHUNK, (c + 1) * CHUNK)[::-1].copy() for c in range(CHUNKS)]
    storage.read_ahead(((lane, s) for s in steps), budget)
    for c, step in enumerate(steps):
        rows = storage.gather(lane, step)
        np.testing.assert_array_equal(rows["act"], step)
        ahead = sum(n for chunk, n in fetched.items() if chunk > c)  # fetched, not yet read
        assert ahead <= budget + CHUNK_BYTES
        assert storage.stats().chunks_loaded == min(CHUNKS, c + 1 + 3)  # 3 chunks of the budget ahead
    assert sorted(fetched) == list(range(CHUNKS))
    assert all(n == 2 * 4 + CHUNK_BYTES for n in fetched.values())  # each chunk once (+ 2 checksums)
    buf.close()


def test_a_missing_chunk_is_reported_by_the_read_that_needs_it(tmp_path):
    url = str(tmp_path / "b")
    write(url)
    reader = dr.ReplayBuffer.open(url, "r")
    key = reader.storage.chunk_key("obs", 0, 5)
    reader.close()
    os.remove(os.path.join(url, key))
    ds = make_dataset(url, 16, mode="epoch", shuffle="none")
    with pytest.raises(CorruptBufferError, match=f"chunk '{key}' is missing, but the last commit says it holds rows"):
        check_epoch(ds)


def test_a_plan_over_cached_chunks_is_walked_as_the_reads_go(tmp_path):
    """Announced reads whose chunks are all cached (by an earlier pass): the plan is looked at a
    few chunks per read (``4 * io_threads``), not walked to its end before the first read."""
    url = str(tmp_path / "b")
    write(url)
    reader = dr.ReplayBuffer.open(url, io_threads=2)
    asked: list[int] = []

    def steps():
        for chunk in range(CHUNKS):
            asked.append(chunk)
            yield np.zeros(CHUNK, np.int64), np.arange(chunk * CHUNK, (chunk + 1) * CHUNK)

    def one_pass():
        for chunk in range(CHUNKS):
            ids = np.arange(chunk * CHUNK, (chunk + 1) * CHUNK)
            np.testing.assert_array_equal(reader[ids]["act"], ids)

    reader.storage.read_ahead(steps())
    one_pass()  # every chunk read ahead, and cached
    assert reader.stats().chunks_loaded == CHUNKS and reader.stats().cached_chunks == CHUNKS
    asked.clear()
    reader.storage.read_ahead(steps())
    assert asked == list(range(8))
    one_pass()
    assert asked == list(range(CHUNKS)) and reader.stats().chunks_loaded == CHUNKS


def test_an_epoch_of_a_fresh_local_reader_reads_whole_chunks_each_once(tmp_path):
    """Raw local chunks, a reader whose cache holds them all (its fill is due): the epoch's
    batches load whole chunks, each once, never rows of them one by one (before: every block
    shuffled batch read its rows of each chunk of its window again, a range each)."""
    url = str(tmp_path / "b")
    write(url, compression=None)
    ds = make_dataset(url, 16, mode="epoch", seed=3)
    reader = ds.reader.get()
    check_epoch(ds)
    stats = reader.stats()
    assert (stats.rows_read_directly, stats.ranges_read) == (0, 0)
    assert stats.chunks_loaded == stats.cached_chunks == CHUNKS


@pytest.mark.parametrize("where", ["local", "s3"])
def test_block_shuffle_reads_two_windows_ahead_whatever_the_budget(s3, tmp_path, where):
    so = s3.storage_options() if where == "s3" else None
    url = s3.new_url("window") if where == "s3" else str(tmp_path / "b")
    write(url, so)
    ds = make_dataset(url, 16, mode="epoch", shuffle="block", shuffle_window=16, io_threads=4, storage_options=so)
    ds.read_ahead_bytes = 4 * CHUNK_BYTES  # a quarter of a window
    reader = ds.reader.get()
    batches = iter(Loader(ds))
    first_half = [next(batches) for _ in range(16 * CHUNK // 16 // 2)]  # the first window's chunks all read
    # before: 32 (the first window and the next; the third started once the second was read), and
    # earlier the reads of each window loaded the 12 chunks the budget left out themselves (36 of 48)
    assert reader.stats().chunks_read_ahead == reader.stats().chunks_loaded == 3 * 16
    check_batches([*first_half, *batches])
    assert reader.stats().chunks_loaded == reader.stats().chunks_read_ahead == CHUNKS


@pytest.mark.parametrize("shuffle", ["none", "block"])
def test_an_epoch_past_the_cache_reads_sharded_fields_as_whole_chunks(s3, shuffle):
    """A reader whose rows do not fit its cache reads the fields stored as shards of inner chunks
    row by row when it samples; an epoch, which reads every row, reads their whole chunks ahead
    instead: each chunk object fetched once, no byte range of it. (Before, every batch fetched
    the inner chunks of its rows, and a shuffled batch decoded an inner chunk per row.)"""
    url, rows, chunk = s3.new_url("sharded"), 16 * 4096, 4096
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=chunk, compression="zstd",
                                 storage_options=s3.storage_options())
    ids = np.arange(rows)
    buf.extend({"obs": np.stack([ids, ids + 0.5, -ids], -1).astype(np.float32), "act": ids})
    buf.close()
    proxy = FaultProxy(s3.endpoint)
    try:
        ds = make_dataset(url, 512, mode="epoch", shuffle=shuffle, shuffle_window=2, cache_bytes=8 * chunk * ROW_BYTES,
                          storage_options=proxy_options(s3, proxy))
        reader = ds.reader.get()
        assert reader.storage.row_reads is not None and set(reader.storage.row_reads.names) == {"obs", "act"}
        proxy.reset_stats()
        seen = []
        for batch in Loader(ds):
            got = batch["index"].numpy()
            np.testing.assert_array_equal(batch["act"].numpy(), got)
            np.testing.assert_array_equal(batch["obs"].numpy()[:, 1], got + 0.5)
            seen.append(got)
        np.testing.assert_array_equal(np.sort(np.concatenate(seen)), ids)
        gets = chunk_gets(proxy)
        assert len(gets) == 2 * 16 and set(gets.values()) == {1}
        assert reader.stats().chunks_read_ahead == 16
    finally:
        proxy.close()


def test_an_epoch_of_a_reader_holding_some_fields_of_its_chunks_reads_them_whole(s3):
    """A reader past its cache that keeps its small fields' chunks (`test_s3`) and then reads an
    epoch reads every chunk whole ahead, each chunk object once: the chunks it holds some fields
    of count as not cached for the epoch."""
    from test_s3 import SMALL_AND_LARGE, small_and_large

    url = s3.new_url("epoch-kept")
    data = small_and_large(url, s3.storage_options())
    proxy = FaultProxy(s3.endpoint)
    try:
        ds = make_dataset(url, 4096, mode="epoch", shuffle="none", cache_bytes=6 << 20,
                          storage_options=proxy_options(s3, proxy))
        reader = ds.reader.get()
        reader[[5, 9000]]
        reader.warm()
        assert reader.stats().cached_chunks == 8 and reader.storage.row_reads.names == ("obs",)
        proxy.reset_stats()
        seen = []
        for batch in Loader(ds):
            got = batch["index"].numpy()
            for name in SMALL_AND_LARGE:
                np.testing.assert_array_equal(batch[name].numpy(), data[name][got])
            seen.append(got)
        np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(8 * 8192))
        gets = chunk_gets(proxy)
        assert len(gets) == 3 * 8 and set(gets.values()) == {1}
        assert reader.stats().chunks_read_ahead == 8
    finally:
        proxy.close()
