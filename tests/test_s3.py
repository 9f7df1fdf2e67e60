"""Buffers on S3 through each S3 client (s3fs, obstore: every test runs on both), against a real
S3-compatible server (moto) over HTTP on 127.0.0.1.

Failures are real too: a proxy in front of the server answers 5xx/SlowDown or resets the
connection for chosen requests (tests/s3server.py).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import threading
import time

import fsspec.asyn
import numpy as np
import pytest
import zarr
from conftest import OWN, logged, same_state
from s3server import FaultProxy, fault_proxy, proxy_options, s3, s3_client

import diskreplay as dr
from diskreplay import RetryPolicy, StoreUnavailableError
from diskreplay.io.lock import LOCK_KEY

pytestmark = pytest.mark.usefixtures("s3_client")
FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"), "done": dr.Field((), "bool")}


def rows(start: int, n: int, lanes: int = 1) -> dict[str, np.ndarray]:
    """Steps ``start..start+n`` of every lane; row id ``step * lanes + lane`` has obs[0] == id."""
    ids = (np.arange(start, start + n)[:, None] * lanes + np.arange(lanes)).astype(np.int64)
    out = {"obs": np.stack([ids, ids + 0.5, -ids], -1).astype(np.float32), "act": ids, "done": ids % 5 == 4}
    return {k: v[:, 0] for k, v in out.items()} if lanes == 1 else out


def check_rows(batch: dict, ids) -> None:
    ids = np.asarray(ids)
    np.testing.assert_array_equal(batch["act"], ids)
    np.testing.assert_array_equal(batch["obs"][..., 0], ids.astype(np.float32))
    np.testing.assert_array_equal(batch["done"], ids % 5 == 4)


@pytest.mark.parametrize("capacity,num_envs,compression", [(96, 2, "zstd"), (None, 1, None)],
                         ids=["ring-2lanes-zstd", "dataset-raw"])
def test_s3_behaves_like_local_disk(s3, tmp_path, capacity, num_envs, compression):
    so = s3.storage_options()
    urls = {"local": str(tmp_path / "b"), "s3": s3.new_url()}
    bufs = {k: dr.ReplayBuffer.create(u, FIELDS, capacity=capacity, num_envs=num_envs, chunk_rows=8,
                                      compression=compression, seed=3,
                                      storage_options=so if k == "s3" else None) for k, u in urls.items()}
    step = 0
    for n in (5, 30, 1, 41, 17):
        for buf in bufs.values():
            buf.extend(rows(step, n, num_envs) if num_envs > 1 else rows(step, n))
        step += n
        if n % 2:
            for buf in bufs.values():
                buf.flush()
    samples = {k: b.sample(64) for k, b in bufs.items()}
    for name in ("obs", "act", "done", "index"):
        np.testing.assert_array_equal(samples["local"][name], samples["s3"][name])
    check_rows(samples["s3"], samples["s3"]["index"])
    for buf in bufs.values():
        buf.close()
    opened = {k: dr.ReplayBuffer.open(u, "r", storage_options=so if k == "s3" else None) for k, u in urls.items()}
    ids = opened["local"].row_ids()
    np.testing.assert_array_equal(opened["s3"].row_ids(), ids)
    check_rows(opened["s3"][ids], ids)
    a, b = opened["local"].sample(50, seed=9), opened["s3"].sample(50, seed=9)
    np.testing.assert_array_equal(a["obs"], b["obs"])
    # the same chunk objects, byte for byte (state objects differ only by their sequence number)
    stored = s3.keys(urls["s3"])
    local_chunks = {k: v for k, v in _local_files(urls["local"]).items() if "/c." in k}
    assert local_chunks == {k: v for k, v in stored.items() if "/c." in k}
    assert "writer.lock" not in stored


def _local_files(path):
    import os
    out = {}
    for root, _, files in os.walk(path):
        for f in files:
            full = os.path.join(root, f)
            out[os.path.relpath(full, path)] = open(full, "rb").read()
    return out


def test_s3_reader_sees_commits_only_and_refreshes(s3):
    so = s3.storage_options()
    url = s3.new_url()
    writer = dr.ReplayBuffer.create(url, FIELDS, capacity=48, chunk_rows=8, storage_options=so)
    writer.extend(rows(0, 20))
    writer.flush()
    reader = dr.ReplayBuffer.open(url, "r", storage_options=so)
    writer.extend(rows(20, 40))  # unflushed, and wraps the ring (the writer retires old rows first)
    assert len(reader) == 20 and reader.refresh() is True  # a retire commit: fewer rows, none new
    np.testing.assert_array_equal(reader.row_ids(), np.arange(12, 20))
    check_rows(reader[np.arange(12, 20)], np.arange(12, 20))
    writer.extend(rows(60, 10))
    writer.flush()
    assert reader.refresh() is True
    np.testing.assert_array_equal(reader.row_ids(), np.arange(22, 70))
    check_rows(reader.sample(40, seed=1), reader.sample(40, seed=1)["index"])
    with pytest.raises(dr.ReadOnlyError):
        reader.extend(rows(0, 1))
    writer.close()
    reader.close()


# ---- transient failures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored(s3):
    """A ring buffer on the server (written directly): 160 steps, capacity 128, chunks of 8."""
    url = s3.new_url("retry")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=128, chunk_rows=8, storage_options=s3.storage_options())
    buf.extend(rows(0, 160))
    buf.close()
    return url


def chunk_of(step: int, capacity: int = 128, chunk_rows: int = 8) -> str:
    return f"obs/c.0.{(step % capacity) // chunk_rows}.0"


@pytest.mark.parametrize("fault,times", [("503", 2), ("500", 3), ("slowdown", 2), ("reset", 2)])
def test_transient_read_failures_are_retried(s3, stored, fault_proxy, fault, times):
    reader = dr.ReplayBuffer.open(stored, "r", storage_options=proxy_options(s3, fault_proxy))
    key = chunk_of(100)
    fault_proxy.fail(fault, key, times=times, method="GET")
    got = reader[np.arange(96, 104)]
    check_rows(got, np.arange(96, 104))
    assert fault_proxy.faults[fault] == times
    assert fault_proxy.count(key, "GET") == times + 1  # each failure retried once, then success
    reader.close()


def test_transient_write_failures_are_retried(s3, fault_proxy):
    so = proxy_options(s3, fault_proxy)
    url = s3.new_url()
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=8, storage_options=so)
    fault_proxy.fail("503", OWN + "commit.json", times=2, method="PUT")
    fault_proxy.fail("reset", "obs/c.0.1.0", times=1, method="PUT")
    buf.extend(rows(0, 12))
    buf.flush()
    assert fault_proxy.faults["503"] == 2 and fault_proxy.faults["reset"] == 1
    buf.close()
    reader = dr.ReplayBuffer.open(url, "r", storage_options=s3.storage_options())
    check_rows(reader[np.arange(12)], np.arange(12))


def test_persistent_failure_raises_naming_the_chunk(s3, stored, fault_proxy, caplog):
    reader = dr.ReplayBuffer.open(stored, "r", storage_options=proxy_options(s3, fault_proxy))
    reader.storage.store.retry = RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)
    key = chunk_of(40)
    fault_proxy.fail("500", key, times=10**6, method="GET")
    with logged(caplog, rf"read of '{key}' failed \(.*\); try 4 of 4 in", logging.INFO), \
            pytest.raises(StoreUnavailableError, match=rf"read of '{key}' failed after 4 tries .*InternalError|"
                                                       rf"read of '{key}' failed after 4 tries"):
        reader[np.arange(40, 44)]
    retries = [r for r in caplog.records if r.name == "diskreplay.io.remote" and key in r.getMessage()]
    assert [r.getMessage().split("; try ")[1][:6] for r in retries] == ["2 of 4", "3 of 4", "4 of 4"]
    assert fault_proxy.count(key, "GET") == 4  # bounded: exactly the policy's attempts
    assert isinstance(StoreUnavailableError(), OSError)
    fault_proxy.rules.clear()
    check_rows(reader[np.arange(40, 44)], np.arange(40, 44))  # the cache was not poisoned


def test_missing_chunk_is_an_error_not_zeros(s3):
    so = s3.storage_options()
    url = s3.new_url()
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=8, storage_options=so)
    buf.extend(rows(0, 30))
    buf.close()
    prefix = url.split(f"s3://{s3.bucket}/")[1]
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{prefix}/act/c.0.2")
    reader = dr.ReplayBuffer.open(url, "r", storage_options=so)
    check_rows(reader[np.arange(0, 16)], np.arange(0, 16))
    with pytest.raises(dr.CorruptBufferError, match=r"chunk 'act/c.0.2' is missing, but the last commit says"):
        reader[[17]]
    from diskreplay.audit import verify
    report = verify(url, so)
    assert not report.ok and any("act/c.0.2" in p for p in report.problems)


def test_ranged_reads_of_short_and_empty_objects(s3):
    """``get(key, limit)`` (how metadata objects are read): the first ``limit`` bytes; an object
    shorter than ``limit`` whole, even an empty one (S3 answers a range of it with 416)."""
    from diskreplay.io import open_chunkstore

    store = open_chunkstore(s3.new_url("ranges"), s3.storage_options())
    store.put("full", b"0123456789")
    store.put("empty", b"")
    assert [store.get("full", 4), store.get("full", 100), store.get("empty", 10), store.get("absent", 10)] == \
        [b"0123", b"0123456789", b"", None]
    assert store.get_many(["empty", "full"]) == [b"", b"0123456789"]
    assert store.get_ranges([("full", 2, 5), ("full", 8, 20), ("absent", 0, 1)]) == [(b"234", 10), (b"89", 10), None]
    assert [ranged[0] for ranged in store.get_ranges([("full", 10, 12), ("empty", 0, 4)])] == [b"", b""]
    assert store.sizes() == {"full": 10, "empty": 0}


def test_remote_fetches_are_concurrent_bounded_and_head_free(s3, stored):
    proxy = FaultProxy(s3.endpoint, latency_s=0.03)
    try:
        for threads in (1, 8):
            reader = dr.ReplayBuffer.open(stored, "r", storage_options=proxy_options(s3, proxy),
                                          io_threads=threads, cache_bytes=10 * 8 * 21)  # no fill: 10 of 16 chunks
            if hasattr(reader.storage.store, "fs"):
                reader.storage.store.fs.retries = 1  # s3fs would retry a slow answer silently: an uncounted GET
            proxy.reset_stats()
            reader[np.arange(32, 96)]  # 8 chunks x 3 fields, all cold
            # one GET per chunk, plus any retry of diskreplay's own layer (the only one left on)
            assert proxy.count("/c.", "GET") == 24 + reader.storage.store.retried
            assert proxy.count("/c.", "HEAD") == 0  # one GET per chunk, no HEAD first
            assert proxy.max_in_flight <= threads
            if threads > 1:  # what the server saw: requests overlapping, not one after the other
                assert proxy.max_in_flight > 1
            reader.close()
    finally:
        proxy.close()


def test_get_many_has_as_many_requests_in_flight_as_asked(s3, s3_client):
    """botocore's default pool of 10 connections must not cap the GETs ``concurrency`` asks for."""
    from diskreplay.io import open_chunkstore

    url = s3.new_url("pool")
    prefix = url.split(f"s3://{s3.bucket}/")[1]
    client = s3.client()
    for i in range(32):
        client.put_object(Bucket=s3.bucket, Key=f"{prefix}/k{i}", Body=bytes([i]) * 100)
    proxy = FaultProxy(s3.endpoint, latency_s=0.2)
    try:
        store = open_chunkstore(url, proxy_options(s3, proxy), concurrency=32)
        assert type(store).__name__ == {"s3fs": "FsspecChunkStore", "obstore": "ObstoreChunkStore"}[s3_client]
        got = store.get_many([f"k{i}" for i in range(32)])
        assert got == [bytes([i]) * 100 for i in range(32)]
        assert proxy.count("/k", "GET") == 32
        assert 10 < proxy.max_in_flight <= 32
        proxy.reset_stats()
        ranges = [(f"k{i % 32}", j, j + 3) for i in range(128) for j in (10 * (i // 32),)]
        assert store.get_ranges(ranges) == [(bytes([int(key[1:])]) * 3, 100) for key, _, _ in ranges]
        assert proxy.count("/k", "GET") == 128 and proxy.bytes_out == 3 * 128
        assert 32 < proxy.max_in_flight <= 128  # small ranged GETs: more in flight than whole objects
    finally:
        proxy.close()


def assert_samples_make_no_request(buf: dr.ReplayBuffer, proxy: FaultProxy) -> None:
    """A reader whose window is in its cache samples right rows without a request for chunks."""
    proxy.reset_stats()
    check_rows(buf.sample(500, seed=0), buf.sample(500, seed=0)["act"])
    assert proxy.count("/c.", "GET") == 0


@pytest.fixture
def ranges_cost_pages(monkeypatch):
    """The chunks of these tests are a few KB, which a read of a few rows loads whole from an
    object store (`request_bytes`: a request costs about 256 KB there); here rows are read by
    ranges, as they are from chunks of MBs."""
    from diskreplay.io import FsspecChunkStore

    monkeypatch.setattr(FsspecChunkStore, "request_bytes", 1)
    if importlib.util.find_spec("obstore") is not None:
        from diskreplay.io.obstore_store import ObstoreChunkStore

        monkeypatch.setattr(ObstoreChunkStore, "request_bytes", 1)


def test_rows_dense_for_what_a_request_costs_load_their_chunk_whole(s3):
    """A cold read takes rows by ranges while a range per row and field costs less than the chunk
    whole and a request per field, at what the store says a request costs (``request_bytes``):
    chunks of 786 KB here, so from 3 rows per chunk through s3fs, 4 through obstore."""
    url = s3.new_url("dense-for-a-request")
    obs = {"obs": dr.Field((3,), "float32")}
    with dr.ReplayBuffer.create(url, obs, capacity=None, chunk_rows=65536, compression=None,
                                storage_options=s3.storage_options()) as buf:
        buf.extend({"obs": rows(0, 2 * 65536)["obs"]})
    proxy = FaultProxy(s3.endpoint, latency_s=0.0)
    try:
        # a cache of one chunk: no fill of the whole window behind the first read
        reader = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=65536 * 12)
        dense = -(-(65536 * 12) // reader.storage.store.request_bytes) + 1
        assert dense == {"FsspecChunkStore": 3, "ObstoreChunkStore": 4}[type(reader.storage.store).__name__]
        proxy.reset_stats()
        few = np.arange(dense - 1) * 10000 + 7  # 120 KB apart: a range each
        np.testing.assert_array_equal(reader[few]["obs"][:, 0], few)
        assert (reader.stats().rows_read_directly, reader.stats().chunks_loaded) == (dense - 1, 0)
        assert proxy.count("/obs/c.0.0", "GET") == dense - 1
        many = 65536 + np.arange(dense) * 10000 + 7
        np.testing.assert_array_equal(reader[many]["obs"][:, 0], many)
        assert (reader.stats().rows_read_directly, reader.stats().chunks_loaded) == (dense - 1, 1)
        assert proxy.count("/obs/c.0.1", "GET") == 1  # chunk 1, whole
        reader.close()
    finally:
        proxy.close()


def test_cold_rows_a_fraction_of_a_request_apart_share_one_range(s3):
    """On an object store, rows of one chunk closer than an eighth of what a request costs
    (``request_bytes``: 32 KiB through obstore, 64 KiB through s3fs) are fetched in one ranged
    GET, the bytes between them with it; rows farther apart in a GET each."""
    url = s3.new_url("joined-ranges")
    with dr.ReplayBuffer.create(url, {"obs": FIELDS["obs"]}, capacity=None, chunk_rows=131072, compression=None,
                                storage_options=s3.storage_options()) as buf:
        buf.extend({"obs": rows(0, 2 * 131072)["obs"]})
    proxy = FaultProxy(s3.endpoint, latency_s=0.0)
    try:
        reader = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=131072 * 12)
        assert reader.storage.store.request_bytes // 8 in (32768, 65536)
        proxy.reset_stats()
        ids = np.array([7, 1007, 131072 + 7, 131072 + 10007])  # 12,000 bytes apart; then 120,000
        np.testing.assert_array_equal(reader[ids]["obs"][:, 0], ids)
        assert (proxy.count("/obs/c.0.0", "GET"), proxy.count("/obs/c.0.1", "GET")) == (1, 2)
        assert proxy.bytes_out == 1001 * 12 + 2 * 12
        assert (reader.stats().rows_read_directly, reader.stats().ranges_read) == (4, 3)
        reader.close()
    finally:
        proxy.close()


@pytest.mark.usefixtures("ranges_cost_pages")
def test_cold_rows_are_read_as_byte_ranges_of_their_chunks(s3):
    """A reader missing rows of raw fields fetches just their bytes: one ranged GET per run of
    nearby rows of a chunk and field; with a window that fits its cache, the whole window follows
    behind the first read, and reads after it fetch nothing."""
    url = s3.new_url("ranges-rows")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=256, compression=None,
                                storage_options=s3.storage_options()) as buf:
        buf.extend(rows(0, 4096))
    proxy = FaultProxy(s3.endpoint, latency_s=0.0)
    try:
        small = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=4 * 256 * 21)
        proxy.reset_stats()
        ids = [5, 6, 900, 3000, 5]
        check_rows(small[ids], ids)
        assert proxy.count("/c.", "GET") == 3 * 3  # rows 5-6, 900, 3000: 3 ranges per field
        assert proxy.bytes_out == 4 * 21  # each distinct row's 12 + 8 + 1 bytes, once
        stats = small.stats()
        assert (stats.rows_read_directly, stats.ranges_read, stats.chunks_loaded) == (5, 9, 0)
        check_rows(small[[7, 260]], [7, 260])  # not cached: read again, as ranges
        assert proxy.count("/c.", "GET") == 9 + 6
        small.close()

        whole = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy))
        proxy.reset_stats()
        check_rows(whole[ids], ids)
        whole.warm()
        assert whole.stats().resident and whole.stats().chunks_loaded == 16
        assert proxy.count("/c.", "GET") == 9 + 16 * 3  # the first read's ranges, then each chunk once
        assert_samples_make_no_request(whole, proxy)
        whole.close()
    finally:
        proxy.close()


def test_cold_frames_are_read_as_inner_chunks_of_their_shards(s3):
    """Compressed frames (sharded chunks) missing from a reader's cache cost their shard's index
    (read once, kept) and one inner chunk each, never the whole chunk; a damaged inner chunk is
    an error naming its chunk."""
    frames = {"img": dr.Field((32, 32), "uint8"), "act": dr.Field((), "int64")}
    data = {"img": (np.arange(512)[:, None, None] * 7 + np.arange(1024).reshape(32, 32)).astype(np.uint8),
            "act": np.arange(512)}
    url = s3.new_url("frames")
    with dr.ReplayBuffer.create(url, frames, capacity=None, chunk_rows=64, compression="zstd",
                                storage_options=s3.storage_options()) as buf:
        buf.extend(data)
    proxy = FaultProxy(s3.endpoint, latency_s=0.0)
    try:
        reader = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=2 * 64 * 1032)
        sizes = reader.storage.store.sizes()
        proxy.reset_stats()
        ids = np.array([3, 5, 100, 500])  # 1 KiB frames: inner chunks of 8 frames (8 KiB)
        np.testing.assert_array_equal(reader[ids]["img"], data["img"][ids])
        reader.warm()  # act's other chunks follow behind the read
        assert proxy.count("/shard-index-tables/img", "GET") == 1  # the table the writer's close left: every index
        assert proxy.count("/shard-indexes/img", "GET") == 0  # nor an earlier version's: it has this one
        assert proxy.count("/img/c.", "GET") == 3  # 3 inner chunks (rows 3 and 5 share one)
        assert proxy.count("/act/c.", "GET") == 3 + 5  # a chunk each (act is not sharded), then the other 5
        table = sizes["diskreplay/objects/shard-index-tables/img"]
        img = proxy.bytes_out - table - sum(sizes[f"act/c.0.{c}"] for c in range(8))
        assert img < sum(sizes[f"img/c.0.{c}.0.0"] for c in (0, 1, 7)) / 4
        proxy.reset_stats()
        np.testing.assert_array_equal(reader[[4, 101]]["img"], data["img"][[4, 101]])
        assert proxy.count("/img/c.", "GET") == 2  # the indexes were kept: inner chunks only
        reader.close()
        s3.client().delete_object(Bucket=s3.bucket, Key=url.split(f"s3://{s3.bucket}/")[1] +
                                  "/diskreplay/objects/shard-index-tables/img")
        untabled = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=2 * 64 * 1032)
        proxy.reset_stats()
        np.testing.assert_array_equal(untabled[ids]["img"], data["img"][ids])
        assert proxy.count("/img/c.", "GET") == 3 + 3  # without it: 3 shard indexes, then 3 inner chunks
        untabled.close()
        client, key = s3.client(), url.split(f"s3://{s3.bucket}/")[1] + "/img/c.0.2.0.0"
        blob = bytearray(client.get_object(Bucket=s3.bucket, Key=key)["Body"].read())
        blob[-1] ^= 1  # the checksum of the shard's last inner chunk
        client.put_object(Bucket=s3.bucket, Key=key, Body=bytes(blob))
        damaged = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=2 * 64 * 1032)
        np.testing.assert_array_equal(damaged[[128]]["img"], data["img"][[128]])  # another inner chunk of it
        with pytest.raises(dr.CorruptBufferError, match=r"chunk 'img/c.0.2.0.0' does not decode \(checksum mismatch"):
            damaged[[191]]
        damaged.close()
    finally:
        proxy.close()


@pytest.mark.usefixtures("ranges_cost_pages")
def test_cold_rows_of_small_compressed_fields_cost_inner_chunks(s3):
    """By default (``row_shards=True``), compressed fields of small rows are shards when a chunk holds
    four inner chunks or more (obs: 512 rows of 12 bytes, act: 1,024 of 8; done's 4 KiB chunks are
    not): a reader's cold rows cost each shard's index once and an inner chunk per row, a
    fraction of the chunks' bytes; rows dense in a chunk load it whole; zarr-python reads the
    arrays. With ``row_shards=False`` each chunk is one frame, fetched whole."""
    url, plain = s3.new_url("small-rows"), s3.new_url("plain-rows")
    for at, layout in ((url, {}), (plain, {"row_shards": False})):
        with dr.ReplayBuffer.create(at, FIELDS, capacity=None, chunk_rows=4096, compression="zstd",
                                    storage_options=s3.storage_options(), **layout) as buf:
            buf.extend(rows(0, 8192))
    proxy = FaultProxy(s3.endpoint, latency_s=0.0)
    try:
        reader = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=4096 * 21)
        assert {name: codec.inner_rows for name, codec in reader.storage.codecs.items()} == {
            "obs": 512, "act": 1024, "done": None}
        sizes = reader.storage.store.sizes()
        proxy.reset_stats()
        ids = [5, 6, 1000, 5000]
        check_rows(reader[ids], ids)
        assert proxy.count("/shard-index-tables/", "GET") == 2  # obs's and act's tables of shard indexes
        assert proxy.count("/shard-indexes/", "GET") == 0  # nor an earlier version's: it has these
        # inner chunks: rows 5 and 6 share one, row 1000's lies beside it (one range); 5000's
        assert proxy.count("/obs/c.", "GET") == 2
        assert proxy.count("/act/c.", "GET") == 2
        assert proxy.count("/done/c.", "GET") == 2  # each chunk whole, into the cache
        assert proxy.bytes_out < sum(size for key, size in sizes.items() if key.startswith(("obs/c.", "act/c."))) / 4
        proxy.reset_stats()
        check_rows(reader[ids], ids)
        assert proxy.count("/c.", "GET") == 2 + 2  # the indexes were kept; done's chunks are cached
        reader.close()
        whole = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy))  # fits its cache
        proxy.reset_stats()
        check_rows(whole[ids], ids)
        assert (whole.stats().rows_read_directly, whole.stats().ranges_read) == (4, 2 + 2 + 2)
        whole.warm()  # the window followed behind the first read
        assert proxy.count("/c.", "GET") == (2 + 2 + 2) + 2 * 3
        assert_samples_make_no_request(whole, proxy)
        whole.close()
        dense = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy))  # fits its cache
        proxy.reset_stats()
        check_rows(dense[np.arange(0, 4096, 7)], np.arange(0, 4096, 7))  # dense in chunk 0: it is loaded whole
        # (the fill of chunk 1 may start behind the read)
        assert [proxy.count(f"/{name}/c.0.0", "GET") for name in ("obs", "act", "done")] == [1, 1, 1]
        assert dense.stats().rows_read_directly == 0
        dense.close()
        reader = dr.ReplayBuffer.open(plain, storage_options=proxy_options(s3, proxy), cache_bytes=4096 * 21)
        assert {codec.inner_rows for codec in reader.storage.codecs.values()} == {None}
        proxy.reset_stats()
        check_rows(reader[ids], ids)
        assert [proxy.count(f"/{name}/c.", "GET") for name in ("obs", "act", "done")] == [2, 2, 2]  # whole chunks
        reader.close()
    finally:
        proxy.close()
    array = zarr.open_array(store=url + "/obs", mode="r", storage_options=s3.storage_options())
    np.testing.assert_array_equal(array[0, :, 0], np.arange(8192, dtype=np.float32))


SMALL_AND_LARGE = {"obs": dr.Field((32,), "float32"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}


def small_and_large(url: str, storage_options: dict, chunks: int = 8) -> dict[str, np.ndarray]:
    """``chunks`` zstd chunks of 8,192 rows: obs (128 B rows) and reward sharded, done one frame."""
    ids = np.arange(chunks * 8192)
    data = {"obs": (ids[:, None] + np.arange(32)).astype(np.float32), "reward": ids.astype(np.float32) / 2,
            "done": ids % 7 == 0}
    with dr.ReplayBuffer.create(url, SMALL_AND_LARGE, capacity=None, chunk_rows=8192, compression="zstd",
                                storage_options=storage_options) as buf:
        buf.extend(data)
    return data


def test_a_reader_past_its_cache_keeps_the_chunks_of_its_small_fields(s3):
    """A reader whose rows do not fit its cache reads its large sharded fields row by row; the
    small fields, whose every chunk fits half its cache, are read by ranges in its first read,
    then their chunks follow into the cache behind it: later reads fetch the large field only."""
    url = s3.new_url("small-kept")
    data = small_and_large(url, s3.storage_options())
    proxy = FaultProxy(s3.endpoint, latency_s=0.0)
    try:
        reader = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=6 << 20)
        assert reader.storage.row_reads is not None and reader.storage.row_reads.names == ("obs",)
        proxy.reset_stats()
        ids = np.array([5, 8192 + 5, 3 * 8192 + 5, 7 * 8192 + 5])
        got = reader[ids]
        for name in SMALL_AND_LARGE:
            np.testing.assert_array_equal(got[name], data[name][ids])
        reader.warm()  # the small fields' 8 chunks, behind the read
        # the read: an inner chunk of obs and of reward per row, done's chunks whole (one frame each)
        assert [proxy.count(f"/{name}/c.", "GET") for name in SMALL_AND_LARGE] == [4, 4 + 8, 4 + 8]
        assert reader.stats().chunks_loaded == 8
        proxy.reset_stats()
        ids = np.array([6, 8192 + 6, 2 * 8192 + 6, 5 * 8192 + 6])
        got = reader[ids]
        for name in SMALL_AND_LARGE:
            np.testing.assert_array_equal(got[name], data[name][ids])
        assert [proxy.count(f"/{name}/c.", "GET") for name in SMALL_AND_LARGE] == [4, 0, 0]
        reader.close()
    finally:
        proxy.close()


def test_contiguous_rows_past_the_cache_are_read_a_shard_run_at_a_time(s3):
    """A reader past its cache reads sharded fields as inner chunks; the inner chunks of a
    contiguous read lie side by side in their shard and are fetched as one range per shard."""
    url = s3.new_url("contiguous-rows")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=4096, compression="zstd",
                                storage_options=s3.storage_options()) as buf:
        buf.extend(rows(0, 8192))
    proxy = FaultProxy(s3.endpoint, latency_s=0.0)
    try:
        reader = dr.ReplayBuffer.open(url, storage_options=proxy_options(s3, proxy), cache_bytes=4096 * 21)
        reader[[0]]  # the shard index tables
        proxy.reset_stats()
        ids = np.arange(600, 6000)  # obs: inner chunks 1-7 of chunk 0 and 0-3 of chunk 1; act: 0-3 and 0-1
        check_rows(reader[ids], ids)
        assert [proxy.count(f"/{name}/c.", "GET") for name in ("obs", "act")] == [2, 2]
        assert reader.stats().ranges_read == 2 + 2 + 2  # the first read's two inner chunks, then a range per shard
        reader.close()
    finally:
        proxy.close()


def test_a_kept_shard_index_of_a_rewritten_tail_chunk_is_read_again(s3):
    """A reader keeps each shard's index; when the writer rewrites the tail chunk (more rows in
    it: its inner chunks move), rows read through the old index fail their checksums. The reader
    reads the index anew and the rows again, before any refresh, and reports no damage."""
    url = s3.new_url("tail-index")
    writer = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=4096, compression="zstd",
                                    storage_options=s3.storage_options())
    writer.extend(rows(0, 2000))
    writer.flush()
    # its cache holds done's chunks only: obs and act are read row by row (inner chunks)
    reader = dr.ReplayBuffer.open(url, storage_options=s3.storage_options(), cache_bytes=4096 * 4)
    check_rows(reader[[100, 1900]], [100, 1900])  # obs: inner chunks 0 and 3 of 8 (512 rows each)
    kept = dict(reader.storage._reader.points.indexes)
    writer.extend(rows(2000, 1000))  # inner chunks 3 to 5 of the tail chunk grow
    writer.flush()
    check_rows(reader[[100, 1900]], [100, 1900])  # the old view, not refreshed
    assert reader.storage._reader.points.indexes[("obs", 0, 0)].tolist() != kept[("obs", 0, 0)].tolist()
    writer.close()
    reader.close()


def test_opening_shards_reads_their_metadata_concurrently(s3, monkeypatch):
    """Opening a union of S shards reads each shard's metadata (its group, commit record and
    arrays) with the shards' reads in flight together, not ~6 requests per shard one after the
    other (28 s for 64 shards at 20 ms); the count is (4 + fields) per shard of a ring + 3
    (docs/guide/shards.md; one more per shard whose commit saved a state: none here)."""
    from diskreplay.storage import UnionStorage

    shards = 8
    url, so = s3.new_url("open-shards"), s3.storage_options()
    dr.ReplayBuffer.create(url, FIELDS, capacity=64, shards=shards, chunk_rows=8, storage_options=so).close()
    proxy = FaultProxy(s3.endpoint, latency_s=0.02)  # every request takes a while: overlaps are seen
    try:
        options = proxy_options(s3, proxy)
        dr.ReplayBuffer.open(url, "r", storage_options=options).close()  # the clients' own first requests
        metadata_in_flight = []
        states = UnionStorage.shard_states

        def observed(self, which):  # the reads before the shards' states: their metadata
            metadata_in_flight.append(proxy.max_in_flight)
            return states(self, which)
        monkeypatch.setattr(UnionStorage, "shard_states", observed)
        proxy.reset_stats()
        proxy.hits.clear()
        with dr.ReplayBuffer.open(url, "r", storage_options=options) as buf:
            assert buf.storage.shards == shards
        assert sum(proxy.hits.values()) == (4 + len(FIELDS)) * shards + 3  # a ring's commit: again after its group
        assert proxy.count("/zarr.json", "GET") == (1 + len(FIELDS)) * shards + 2
        assert metadata_in_flight[0] > 1
    finally:
        proxy.close()


def test_refresh_of_16_shards_with_2_committed_costs_2k_plus_1_requests(s3):
    """A learner's refresh lists the root's commit index once (which shards committed), then
    reads only the k shards that did: their commit record and its state object, 2k + 1 requests
    (it read every shard's commit record, 16 + 2k: docs/guide/shards.md)."""
    shards, changed = 16, [5, 12]
    url, so = s3.new_url("refresh-cost"), s3.storage_options()
    dr.ReplayBuffer.create(url, FIELDS, capacity=64, shards=shards, chunk_rows=8, storage_options=so).close()
    proxy = FaultProxy(s3.endpoint)
    try:
        with dr.ReplayBuffer.open(url, "r", storage_options=proxy_options(s3, proxy)) as learner:
            assert learner.refresh() is False
            for shard in changed:
                with dr.ReplayBuffer.open_shard(url, shard=shard, storage_options=so) as w:
                    w.extend(rows(0, 10))
            proxy.reset_stats()
            assert learner.refresh() is True
            requests = sum(proxy.hits.values())
            assert len(learner) == 20
            assert requests == 2 * len(changed) + 1, dict(proxy.hits)
            proxy.reset_stats()
            assert learner.refresh() is False
            assert sum(proxy.hits.values()) == 1  # one listing tells nothing changed
    finally:
        proxy.close()


@pytest.mark.parametrize("capacity,commit_reads", [(64, 2), (None, 1)])
def test_opening_a_buffer_reads_its_field_documents_together(s3, capacity, commit_reads):
    """A reader's open: its group and its commit record (a ring's again after its group), then
    every field's array document at once (they must be read after the commit: they cover its
    rows), not one after the other, and beside them the state its commit names (the episode
    index)."""
    url, so = s3.new_url("open-one"), s3.storage_options()
    with dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, chunk_rows=8, storage_options=so) as buf:
        buf.extend(rows(0, 20))
    proxy = FaultProxy(s3.endpoint, latency_s=0.02)  # every request takes a while: overlaps are seen
    try:
        options = proxy_options(s3, proxy)
        dr.ReplayBuffer.open(url, "r", storage_options=options).close()  # the clients' own first requests
        proxy.reset_stats()
        proxy.hits.clear()
        dr.ReplayBuffer.open(url, "r", storage_options=options).close()
        assert proxy.count("/zarr.json", "GET") == 1 + len(FIELDS)
        assert proxy.count("/commit.json", "GET") == commit_reads
        assert proxy.max_in_flight == len(FIELDS) + 1
        assert sum(proxy.hits.values()) == 2 + commit_reads + len(FIELDS)  # docs/guide/cloud.md
    finally:
        proxy.close()


@pytest.mark.parametrize("capacity,sampler,state_objects",
                         [(None, None, 1), (64, None, 1), (64, "per", 3), (64, "wor", 2)])
def test_a_datasets_open_reads_its_group_and_commit_in_one_round(s3, capacity, sampler, state_objects, monkeypatch):
    """The rounds of requests of a reader's open: a dataset's group and commit record in one,
    then its field documents with its saved state beside them (the documents' read waits here
    until the state's has begun: read one after the other, it would wait in vain); a ring's
    commit record read again, alone, after its group (a ring's group changes with its capacity)."""
    from diskreplay.io.obstore_store import ObstoreChunkStore
    from diskreplay.io.remote import FsspecChunkStore

    url, so = s3.new_url("open-rounds"), s3.storage_options()
    with dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, chunk_rows=8, storage_options=so,
                                sampler={"per": dr.Prioritized(), "wor": dr.WithoutReplacement()}.get(sampler)) as buf:
        buf.extend(rows(0, 20))
        if sampler == "per":
            buf.update_priorities(np.arange(20), np.arange(1.0, 21.0))
        buf.flush()
        saved = buf.sampler.state_dict()
    rounds: list[list[str]] = []
    state_reads: list[list[str]] = []
    reads_before_documents: list[int] = []
    state_asked = threading.Event()
    for store in (ObstoreChunkStore, FsspecChunkStore):
        def logged_rounds(self, keys, limit=None, _get_many=store.get_many):
            if any(key.startswith("diskreplay/objects/state/") for key in keys):
                state_reads.append(list(keys))
                state_asked.set()
                return _get_many(self, keys, limit)
            documents = any(key.endswith("/zarr.json") for key in keys)
            if documents:
                assert state_asked.wait(30), "the field documents were read before the state was asked for"
            rounds.append(list(keys))
            got = _get_many(self, keys, limit)
            if documents:
                reads_before_documents.append(len(state_reads))
            return got
        monkeypatch.setattr(store, "get_many", logged_rounds)
    with dr.ReplayBuffer.open(url, "r", storage_options=so) as opened:
        assert same_state(opened.sampler.state_dict(), saved)
    keys = [key for read in state_reads for key in read]
    assert len(keys) == len(set(keys)) == state_objects  # each read once: the episode index, priorities, draws
    assert reads_before_documents == [len(state_reads)]  # every one asked for while the documents were read
    commit = ["diskreplay/objects/commit.json"]
    assert [sorted(keys) for keys in rounds] == [sorted(["zarr.json", *commit]), *([commit] if capacity else []),
                                                 sorted(f"{name}/zarr.json" for name in FIELDS)]


def test_an_epoch_dataset_made_from_a_url_reads_with_the_handle_it_opened(s3):
    """``make_dataset(url, mode="epoch")`` opens the buffer once in its process: the handle it reads
    the layout from is the one the epoch then reads with (made from an open buffer, it opens a second)."""
    url, so = s3.new_url("epoch-url"), s3.storage_options()
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=8, storage_options=so) as buf:
        buf.extend(rows(0, 20))
    proxy = FaultProxy(s3.endpoint)
    try:
        options = proxy_options(s3, proxy)
        dr.ReplayBuffer.open(url, "r", storage_options=options).close()  # the clients' own first requests
        for made_from, opens in [("url", 1), ("buffer", 2)]:
            proxy.hits.clear()
            given = url if made_from == "url" else dr.ReplayBuffer.open(url, "r", storage_options=options)
            ds = dr.make_dataset(given, 4, mode="epoch", shuffle=False, storage_options=options)
            batches = list(ds)
            assert np.concatenate([b["obs"][:, 0].numpy() for b in batches]).tolist() == list(range(20))
            assert proxy.count("/commit.json", "GET") == opens
            assert proxy.count("/zarr.json", "GET") == opens * (1 + len(FIELDS))
            ds.reader.get().close()
            if made_from == "buffer":
                given.close()
    finally:
        proxy.close()


def test_s3_pinned_commit_reads_as_it_was_and_unpin_deletes_its_objects(s3):
    """A pin on S3: the commit reads the same rows after the ring wrapped; unpin leaves exactly
    the objects there were before the pin (a commit of the same rows apart)."""
    so, url = s3.storage_options(), s3.new_url()
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=48, num_envs=2, chunk_rows=8, storage_options=so)
    buf.extend(rows(0, 20, 2))
    buf.flush()
    before = set(s3.keys(url))
    n = buf.pin("eval")
    with dr.ReplayBuffer.open(url, "r", storage_options=so) as reader:
        ids, want = reader.row_ids(), reader.rows(reader.row_ids())
    buf.extend(rows(20, 60, 2))
    buf.flush()
    pinned = {key for key in s3.keys(url) if key.startswith(f"diskreplay/objects/pins/{n:012d}/")}
    assert len([key for key in pinned if "/c." in key]) == 3 * 3 * 2  # 3 fields, 3 chunks of 2 lanes
    with dr.ReplayBuffer.open(url, "r", storage_options=so, at_commit="eval") as past:
        np.testing.assert_array_equal(past.row_ids(), ids)
        got = past.rows(ids)
        for name in want:
            assert got[name].tobytes() == want[name].tobytes()
        check_rows(got, ids)
    from diskreplay.audit import verify
    assert verify(url, so, at_commit=n).ok
    buf.unpin(n)
    assert {key for key in s3.keys(url) if "pins" in key} == set()
    assert len(s3.keys(url)) == len(before)
    buf.close()


def test_buffers_and_imports_on_object_stores_default_to_longer_chunks(s3, tmp_path):
    so = s3.storage_options()
    local = dr.ReplayBuffer.create(str(tmp_path / "b"), FIELDS, capacity=None)
    remote = dr.ReplayBuffer.create(s3.new_url("long"), FIELDS, capacity=None, storage_options=so)
    small_cache = dr.ReplayBuffer.create(s3.new_url("small"), FIELDS, capacity=None, storage_options=so,
                                         cache_bytes=4 << 20)
    # rows of 21 B: 4,096 per chunk on local disk, 8 times that on S3 where a writer's staging fits
    assert [b.storage.layout.chunk_rows for b in (local, remote, small_cache)] == [4096, 32768, 16384]
    remote.extend(rows(0, 40_000))
    remote.close()
    assert sorted(k for k in s3.keys(remote.url) if k.startswith("act/c.")) == ["act/c.0.0", "act/c.0.1"]
    data = {"observations": np.zeros((5000, 3), np.float32), "actions": np.zeros((5000, 2), np.float32),
            "rewards": np.ones(5000, np.float32), "terminals": np.arange(5000) % 100 == 99}
    np.savez(tmp_path / "d.npz", **data)
    imported = dr.offline.import_dataset(tmp_path / "d.npz", s3.new_url("imported"), storage_options=so,
                                         progress=False)
    assert imported.storage.layout.chunk_rows == 8 * dr.offline.import_dataset(
        tmp_path / "d.npz", tmp_path / "imported", progress=False).storage.layout.chunk_rows


def test_a_writer_collected_on_the_event_loop_releases_its_lock(s3, s3_client):
    """An unclosed writer's lock is released by its finalizer, which the garbage collector may run
    on fsspec's I/O thread: a store call made there would wait on that very loop (before, the
    release failed and the lock stayed until its lease ran out)."""
    url = s3.new_url("collected")
    held = [dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=8, storage_options=s3.storage_options())]
    held[0].extend(rows(0, 5))
    held[0].flush()
    lock = url.split(f"s3://{s3.bucket}/", 1)[1] + "/" + OWN + LOCK_KEY

    def locked() -> bool:
        return bool(s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=lock)["KeyCount"])

    assert locked()

    async def drop() -> None:  # the writer's last reference goes on the loop's thread
        held.clear()
        gc.collect()

    fsspec.asyn.sync(fsspec.asyn.get_loop(), drop)
    for _ in range(400):  # the release runs beside the loop: a bound, not a measurement
        if not locked():
            break
        time.sleep(0.05)
    assert not locked()
    with dr.ReplayBuffer.open(url, mode="r+", storage_options=s3.storage_options()) as again:
        assert len(again) == 5
