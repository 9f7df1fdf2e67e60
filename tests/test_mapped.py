"""Memory-mapped reads of raw local chunk files (`diskreplay.mapped`)."""

import os

import numpy as np
import pytest

import diskreplay as dr
from diskreplay import mapped

FIELDS = {"obs": dr.Field((3,), "float32"), "flag": dr.Field((), "bool"), "img": dr.Field((2, 5), "uint8")}


def rows(first, n):
    i = np.arange(first, first + n)
    return {"obs": np.stack([i, -i, i * 0.5], axis=1).astype(np.float32), "flag": i % 3 == 0,
            "img": (i[:, None, None] + np.arange(10).reshape(2, 5)).astype(np.uint8)}


def check(buf, ids):
    got = buf[ids]
    want = rows(0, int(ids.max()) + 1)
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], want[name][ids])


def test_mapping_is_chosen_only_where_it_is_faster(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=4096, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 4096))
    assert dr.ReplayBuffer.open(url).storage.mapped is None  # fits the default cache
    assert dr.ReplayBuffer.open(url, cache_bytes=1024).storage.mapped is not None
    assert dr.ReplayBuffer.open(url, memory_map=True).storage.mapped is not None
    zstd = str(tmp_path / "z")
    dr.ReplayBuffer.create(zstd, FIELDS, capacity=64, compression="zstd").close()
    assert dr.ReplayBuffer.open(zstd, memory_map=True).storage.mapped is None


@pytest.mark.parametrize("capacity", [None, 1000])
def test_mapped_reads_equal_what_was_written(tmp_path, capacity):
    url = str(tmp_path / "b")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, chunk_rows=48, compression=None,
                                 memory_map=True, seed=0)
    added = 0
    for n in (7, 300, 1, 1200, 333):
        buf.extend(rows(added, n))
        added += n
        check(buf, buf.row_ids())  # staged tail from the cache, written chunks from the maps
        buf.flush()
        check(buf, buf.row_ids())
    batch = buf.sample(500, seed=1)
    np.testing.assert_array_equal(batch["obs"], rows(0, added)["obs"][batch["index"]])
    buf.close()
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    check(reader, reader.row_ids())


def test_reader_remaps_chunks_the_writer_rewrote(tmp_path):
    url = str(tmp_path / "b")
    writer = dr.ReplayBuffer.create(url, FIELDS, capacity=200, chunk_rows=32, compression=None)
    writer.extend(rows(0, 150))
    writer.flush()
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    check(reader, reader.row_ids())  # maps every chunk, the partial tail included
    writer.extend(rows(150, 230))  # rewrites the tail chunk and wraps the ring
    writer.flush()
    assert reader.refresh()
    ids = reader.row_ids()
    assert ids.min() == 180 and ids.max() == 379
    check(reader, ids)


def test_dataset_mode_grows_past_the_reservation(tmp_path, monkeypatch):
    monkeypatch.setattr(mapped, "DATASET_CHUNKS", 4)
    url = str(tmp_path / "b")
    buf = dr.ReplayBuffer.create(url, FIELDS, chunk_rows=8, compression=None, memory_map=True)
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    for start in range(0, 200, 25):
        buf.extend(rows(start, 25))
        buf.flush()
        check(buf, buf.row_ids())
        reader.refresh()
        check(reader, reader.row_ids())
    assert reader.storage.mapped.chunks >= 25


def test_tight_budget_trims_and_stays_correct(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=6000, chunk_rows=64, compression=None) as buf:
        buf.extend(rows(0, 6000))
    reader = dr.ReplayBuffer.open(url, memory_map=True, cache_bytes=8192)
    trims = []
    region = next(iter(reader.storage.mapped.regions.values()))
    original = type(region).trim
    type(region).trim = lambda self: (trims.append(1), original(self))
    try:
        for seed in range(30):
            batch = reader.sample(256, seed=seed)
            np.testing.assert_array_equal(batch["img"], rows(0, 6000)["img"][batch["index"]])
    finally:
        type(region).trim = original
    assert trims  # the budget was exceeded and page-table entries dropped


def test_missing_or_short_chunk_file_is_an_error_not_a_crash(tmp_path):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=256, chunk_rows=32, compression=None) as buf:
        buf.extend(rows(0, 256))
    os.remove(os.path.join(url, "obs", "c.0.2.0"))
    with open(os.path.join(url, "flag", "c.0.5"), "r+b") as f:
        f.truncate(10)
    reader = dr.ReplayBuffer.open(url, memory_map=True)
    with pytest.raises(dr.CorruptBufferError, match=r"chunk 'obs/c.0.2.0' is missing"):
        reader[[70]]
    with pytest.raises(dr.CorruptBufferError, match=r"has 10 bytes, expected 36"):
        reader[[5 * 32 + 1]]
    check(reader, np.arange(0, 64))  # other chunks still read
