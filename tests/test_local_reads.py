"""Reads of a local store leave the files' access times alone (``O_NOATIME``): updating one
needs the filesystem's journal, which a commit behind other writes (and discards) can hold for
100s of ms, stalling the read, and a ring's add waiting for it."""

import os
from pathlib import Path

import numpy as np
import pytest

import diskreplay as dr
from diskreplay.io import LocalChunkStore, open_for_reading

FIELDS = {"obs": dr.Field((40, 40), "uint8"), "act": dr.Field((), "int64"), "done": dr.Field((), "bool")}
HOUR_NS = 3600 * 10**9


def age_access_times(root: Path) -> dict[str, int]:
    """Set every file's access time an hour before its modification (a read then updates it,
    under ``relatime``); returns them."""
    times = {}
    for path in root.rglob("*"):
        if path.is_file():
            stat = path.stat()
            os.utime(path, ns=(stat.st_mtime_ns - HOUR_NS, stat.st_mtime_ns))
            times[str(path)] = stat.st_mtime_ns - HOUR_NS
    return times


@pytest.fixture
def atime_updating(tmp_path):
    """Skip where this filesystem does not update access times on reads (mounted noatime)."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 100)
    age_access_times(tmp_path)
    before = probe.stat().st_atime_ns
    probe.read_bytes()
    if probe.stat().st_atime_ns == before:
        pytest.skip("this filesystem does not update access times on reads")
    probe.unlink()


@pytest.mark.parametrize("compression", [None, "zstd", "lz4"])
def test_reads_and_maps_of_a_buffer_leave_access_times_alone(tmp_path, atime_updating, compression):
    """Memory-mapped raw chunks, whole compressed chunks, frames read from mapped shard files:
    none of the buffer's chunk files gets its access time updated."""
    url = tmp_path / "b"
    steps = np.arange(600)
    obs = np.random.default_rng(0).integers(0, 4, (600, 40, 40), dtype=np.uint8)
    with dr.ReplayBuffer.create(str(url), FIELDS, capacity=600, chunk_rows=64, compression=compression, seed=0) as buf:
        buf.extend({"obs": obs, "act": steps, "done": steps % 50 == 49})
    chunks = url / "obs"
    times = age_access_times(chunks)
    reader = dr.ReplayBuffer.open(str(url), "r", cache_bytes=64 << 10)
    ids = reader.row_ids()
    np.testing.assert_array_equal(reader[ids]["obs"], obs[ids])
    reader.sample(256, seed=0)
    reader.close()
    assert {path: os.stat(path).st_atime_ns for path in times} == times


def test_local_store_reads_leave_access_times_alone(tmp_path, atime_updating):
    store = LocalChunkStore(str(tmp_path / "s"))
    store.put("a/b", b"0123456789")
    times = age_access_times(tmp_path / "s")
    buffer = bytearray(10)
    assert store.get("a/b") == b"0123456789" and store.get("a/b", limit=4) == b"0123"
    assert store.read_into("a/b", [memoryview(buffer)]) == 10 and buffer == b"0123456789"
    store.prefetch(["a/b", "missing"])
    fd = open_for_reading(store.path("a/b"))
    assert os.read(fd, 3) == b"012"
    os.close(fd)
    assert {path: os.stat(path).st_atime_ns for path in times} == times
    with pytest.raises(FileNotFoundError):
        open_for_reading(store.path("missing"))
