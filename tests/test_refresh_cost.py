"""What a learner's refresh of a sharded buffer reads: which shards committed (one listing of the
root's commit index), then only those shards' commits, states and journal records since the
adopted commit (docs/guide/shards.md, "What a refresh reads"). Store operations are counted at
the local store; the S3 request count is in tests/test_s3.py."""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diskreplay as dr
from diskreplay.io.local import LocalChunkStore
from diskreplay.storage.union import CommitIndex

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"),
          "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
READS = ("get", "get_many", "get_ranges", "read_into", "sizes")


def rows(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n, dtype=np.int64)
    return {"obs": np.stack([ids, ids + 0.5, -ids], -1).astype(np.float32), "act": ids,
            "terminated": ids % 7 == 6, "truncated": np.zeros(n, bool)}


@pytest.fixture
def reads(monkeypatch, tmp_path) -> Counter:
    """Counts every read operation of a local store of this test (under ``tmp_path``: not another
    test's writer renewing its lease meanwhile), ``{(operation, last part of its first key): n}``
    (a ``get_many``: each of its keys, ``("get_many", key)``, and not the gets it makes), and each
    listing of a commit index, ``("list", "commits")``."""
    counts: Counter = Counter()
    inside = threading.local()
    for name in READS:
        original = getattr(LocalChunkStore, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            first = args[0] if args else ""
            while isinstance(first, (list, tuple)) and first:  # get_ranges' ranges
                first = first[0]
            keys = args[0] if _name == "get_many" else [first if isinstance(first, str) and first else self.root]
            if getattr(inside, "depth", 0) == 0 and self.root.startswith(str(tmp_path)):
                counts.update((_name, key.rsplit("/", 1)[-1]) for key in keys)
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return _original(self, *args, **kwargs)
            finally:
                inside.depth -= 1
        monkeypatch.setattr(LocalChunkStore, name, counted)
    names = CommitIndex._names

    def listed(self):
        counts[("list", "commits")] += 1
        return names(self)
    monkeypatch.setattr(CommitIndex, "_names", listed)
    return counts


def commit(url: str, shard: int, start: int, n: int) -> None:
    with dr.ReplayBuffer.open_shard(url, shard=shard) as w:
        w.extend(rows(start, n))


@pytest.mark.parametrize("shards", [4, 64])
def test_a_refresh_reads_the_index_and_the_shards_that_committed(tmp_path, reads, shards):
    """The same reads at 4 and at 64 shards. (A shard in dataset mode whose arrays grew since
    also has its arrays' metadata read: here each shard is a ring.)"""
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=64, shards=shards, chunk_rows=8).close()
    with dr.ReplayBuffer.open(url, "r") as learner:
        for shard in (1, 3):
            commit(url, shard, 0, 10)
        reads.clear()
        assert learner.refresh() is True
        assert len(learner) == 20
        # one listing, then per shard that committed: its commit record and its episodes' journal tail
        assert sum(reads.values()) == 1 + 2 * 2, reads
        assert reads[("list", "commits")] == 1 and reads[("get", "commit.json")] == 2
        reads.clear()
        assert learner.refresh() is False
        assert dict(reads) == {("list", "commits"): 1}


def test_a_refresh_reads_only_the_journal_records_appended_since(tmp_path, reads, monkeypatch):
    """A shard's episode ends are a journal: full log chunks already read are not read again."""
    monkeypatch.setattr("diskreplay.format.journal.LOG_CHUNK", 4)
    monkeypatch.setattr("diskreplay.storage.journal.LOG_CHUNK", 4)
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=2, chunk_rows=8).close()
    with dr.ReplayBuffer.open(url, "r") as learner, dr.ReplayBuffer.open_shard(url, shard=0) as w:
        w.extend(rows(0, 70))  # 10 episodes end: 2 full log chunks and a tail
        w.flush()
        assert learner.refresh() is True
        reads.clear()
        w.extend(rows(70, 35))  # 5 more: a third full log chunk, a new tail
        w.flush()
        assert learner.refresh() is True
        assert sorted(key for _, key in reads if key.startswith(("log.", "base."))) == ["log.2"], reads
        assert learner.episodes().length.tolist() == [7] * 15


def test_a_readers_refresh_of_an_unchanged_buffer_reads_its_commit_record_only(tmp_path, reads):
    """A reader of one buffer refreshing reads the newest commit record, and its state (the
    episode index's journal) only where that commit is not the one it shows."""
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=8) as w, \
            dr.ReplayBuffer.open(url, "r") as reader:
        w.extend(rows(0, 14))
        w.flush()
        assert reader.refresh() is True
        reads.clear()
        assert reader.refresh() is False
        assert dict(reads) == {("get", "commit.json"): 1}
        w.extend(rows(14, 7))
        w.flush()
        reads.clear()
        assert reader.refresh() is True
        assert reads[("get", "commit.json")] == 1 and any(key.startswith("tail-") for _, key in reads), reads
        assert reader.episodes().length.tolist() == [7] * 3


def test_a_stale_read_check_reads_only_the_shards_it_fetched_from(tmp_path, reads):
    """A ring reader checks chunks it fetched against the newest commit of their shards only."""
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=32, shards=8, chunk_rows=8).close()
    with dr.ReplayBuffer.open(url, "r", memory_map=False) as learner:
        for shard in range(8):
            commit(url, shard, 0, 16)
        learner.refresh()
        for shard in range(8):
            commit(url, shard, 16, 8)  # every shard commits again: none overwrote a row yet
        reads.clear()
        batch = learner[[8 * 5 + 3]]  # step 5 of shard 3: one chunk fetched
        assert batch["act"].tolist() == [5]
        assert reads[("get", "commit.json")] == 1, reads


def test_a_root_without_the_index_refreshes_by_reading_every_shard(tmp_path, reads):
    """Buffers made before the commit index keep working: their refresh reads each shard's commit."""
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=4, chunk_rows=8).close()
    root = Path(url) / "zarr.json"
    document = json.loads(root.read_text())
    del document["attributes"]["diskreplay_shards"]["commit_index"]
    root.write_text(json.dumps(document))
    with dr.ReplayBuffer.open(url, "r") as learner:
        commit(url, 2, 0, 10)
        assert not (Path(url) / "diskreplay" / "objects" / "commits").exists()
        reads.clear()
        assert learner.refresh() is True
        assert len(learner) == 10
        assert reads[("get", "commit.json")] == 4 + 1 and ("list", "commits") not in reads


def test_the_index_announces_a_commit_before_it_is_made_never_after(tmp_path, monkeypatch):
    """An announcement that fails fails its commit (nothing changes); a commit that fails after
    its announcement leaves the index ahead, which only makes the learner read that shard's
    commit record (nothing new in it) until the shard commits. Before: the announcement came
    after the commit, and a writer killed in between left a commit no refresh would see."""
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=2, chunk_rows=8).close()
    with dr.ReplayBuffer.open(url, "r") as learner:
        put, put_if_version = LocalChunkStore.put, LocalChunkStore.put_if_version

        def refused(self, key, data, durable=False):
            if self.root.endswith("commits"):
                raise OSError("the store refused it")
            return put(self, key, data, durable)
        monkeypatch.setattr(LocalChunkStore, "put", refused)
        with pytest.raises(OSError, match="the store refused it"):
            commit(url, 1, 0, 10)
        monkeypatch.setattr(LocalChunkStore, "put", put)
        assert learner.refresh() is False and len(learner) == 0

        def cut(self, key, data, version, durable=False):
            if key.endswith("commit.json"):
                raise OSError("cut after its announcement")
            return put_if_version(self, key, data, version, durable)
        writer = dr.ReplayBuffer.open_shard(url, shard=1)
        writer.extend(rows(0, 10))
        monkeypatch.setattr(LocalChunkStore, "put_if_version", cut)
        with pytest.raises(OSError, match="cut after its announcement"):
            writer.flush()
        monkeypatch.setattr(LocalChunkStore, "put_if_version", put_if_version)
        assert learner.storage.committed_shards() == [1]  # announced ahead of the commit
        learner.refresh()
        assert len(learner) == 0 and learner.storage.committed_shards() == [1]
        writer.close()  # the commit is made
        assert learner.refresh() is True and len(learner) == 10
        assert learner.storage.committed_shards() == []


_runs = itertools.count()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(capacity=st.sampled_from([None, 24]),
       steps=st.lists(st.one_of(st.tuples(st.just("commit"), st.integers(0, 2), st.integers(1, 20)),
                                st.just(("refresh",))), min_size=1, max_size=12))
def test_after_a_refresh_the_learner_sees_exactly_what_a_fresh_open_sees(tmp_path, capacity, steps):
    url = str(tmp_path / f"b{next(_runs)}")
    dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, shards=3, chunk_rows=8).close()
    added = [0, 0, 0]
    writers = [dr.ReplayBuffer.open_shard(url, shard=s) for s in range(3)]
    learner = dr.ReplayBuffer.open(url, "r")
    try:
        for step in [*steps, ("refresh",)]:
            if step[0] == "commit":
                _, shard, n = step
                writers[shard].extend(rows(added[shard], n))
                writers[shard].flush()
                added[shard] += n
                continue
            learner.refresh()
            with dr.ReplayBuffer.open(url, "r") as fresh:
                np.testing.assert_array_equal(learner.storage.total, fresh.storage.total)
                lo, hi = fresh.storage.window()
                ids = np.concatenate([np.arange(a, b) * 3 + lane for lane, (a, b) in enumerate(zip(lo, hi))])
                ids = np.sort(ids).astype(np.int64)
                if len(ids):
                    got, want = learner[ids], fresh[ids]
                    for name in FIELDS:
                        np.testing.assert_array_equal(got[name], want[name])
                    np.testing.assert_array_equal(got["act"], ids // 3)
                assert learner.episodes().length.tolist() == fresh.episodes().length.tolist()
    finally:
        learner.close()
        for w in writers:
            w.close()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_cached_tail_chunk_is_patched_with_the_rows_appended(tmp_path, reads, compression):
    """Rows a shard appends to a chunk the learner holds are read as a byte range per field (raw
    fields); a compressed chunk is dropped and read whole by the next read that needs it."""
    fields = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64")}
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, fields, capacity=64, shards=2, chunk_rows=16, compression=compression).close()
    with dr.ReplayBuffer.open_shard(url, shard=1) as w, dr.ReplayBuffer.open(url, "r", memory_map=False) as learner:
        w.extend({k: v for k, v in rows(0, 5).items() if k in fields})
        w.flush()
        learner.refresh()
        learner.storage.warm()
        assert learner[np.arange(5) * 2 + 1]["act"].tolist() == [0, 1, 2, 3, 4]
        w.extend({k: v for k, v in rows(5, 6).items() if k in fields})
        w.flush()
        reads.clear()
        learner.refresh()
        ranged = sum(n for (op, key), n in reads.items() if op == "get_ranges" and key.startswith("c."))
        assert ranged == (1 if compression is None else 0), reads  # raw: one call, a range per field
        reads.clear()
        batch = learner[np.arange(11) * 2 + 1]
        assert batch["act"].tolist() == list(range(11))
        np.testing.assert_array_equal(batch["obs"][:, 1], np.arange(11) + 0.5)
        whole = sum(n for (op, key), n in reads.items() if op in ("get", "get_many") and key.startswith("c."))
        ranged = sum(n for (op, key), n in reads.items() if op == "get_ranges" and key.startswith("c."))
        assert (whole, ranged) == ((0, 0) if compression is None else (2, 0)), reads  # zstd: each field's chunk


def test_a_tail_chunk_of_the_wrong_size_is_not_patched_but_reported(tmp_path):
    """The rows appended to a cached tail chunk come from an object of that chunk's size only: a
    damaged one (a byte too many) is read whole instead, and the read names it."""
    fields = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64")}
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, fields, capacity=64, shards=2, chunk_rows=16, compression=None).close()
    with dr.ReplayBuffer.open_shard(url, shard=1) as w, dr.ReplayBuffer.open(url, "r", memory_map=False) as learner:
        w.extend({k: v for k, v in rows(0, 5).items() if k in fields})
        w.flush()
        learner.refresh()
        learner.storage.warm()
        w.extend({k: v for k, v in rows(5, 6).items() if k in fields})
        w.flush()
        damaged = next(Path(url).glob("shard-00001/act/c*"))
        damaged.write_bytes(damaged.read_bytes() + b"\0")
        learner.refresh()
        with pytest.raises(dr.CorruptBufferError, match=r"chunk 'shard-00001/act/c\.0\.0' has 133 bytes, expected 132"):
            learner[np.arange(11) * 2 + 1]
