"""Shard index tables: a closing writer's table of every shard index of each sharded field, and the
cold reads of readers that take it (local disk; `test_s3.py` counts the GETs on S3)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import zstandard
from conftest import writes_done

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.format.codecs import EMPTY_INNER, checksum
from diskreplay.format.shard_table import HEADER, ShardTable, table_bytes
from diskreplay.storage import shard_tables
from diskreplay.storage.shard_maps import ShardMaps

FIELDS = {"obs": dr.Field((17,), "float32"), "act": dr.Field((6,), "float32"), "done": dr.Field((), "bool")}
CHUNK = 4096  # obs: shards of 64 inner chunks (64 rows); act: 16 (256 rows); done: 4 KiB chunks, not sharded


def rows(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n)
    return {"obs": (ids[:, None] * 17 + np.arange(17)).astype(np.float32),
            "act": np.repeat(ids[:, None], 6, 1).astype(np.float32), "done": ids % 7 == 0}


def check(batch: dict, ids) -> None:
    ids = np.asarray(ids)
    np.testing.assert_array_equal(batch["obs"], rows(0, int(ids.max()) + 1)["obs"][ids])
    np.testing.assert_array_equal(batch["act"][:, 0], ids.astype(np.float32))
    np.testing.assert_array_equal(batch["done"], ids % 7 == 0)


def table_path(url, name: str) -> str:
    return os.path.join(url, "diskreplay", "objects", "shard-index-tables", name)


def read_table(url, name: str, inner: int) -> ShardTable:
    with open(table_path(url, name), "rb") as f:
        return ShardTable.from_bytes(f.read(), name, str(url), 1, inner)


def shard_index(url, name: str, chunk: int, inner: int) -> np.ndarray:
    with open(os.path.join(url, name, f"c.0.{chunk}.0"), "rb") as f:
        return np.frombuffer(f.read(16 * inner), "<u8").reshape(inner, 2)


@pytest.fixture
def dataset(tmp_path):
    url = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=CHUNK, compression="zstd") as buf:
        buf.extend(rows(0, 3 * CHUNK + 100))
    return url


IDS = [5, 9, CHUNK + 300, 3 * CHUNK + 50]  # chunks 0, 1, 3; obs: 3 inner chunks; act: 3


def cold_ranges(url, ids=IDS) -> int:
    """Ranges a fresh reader reads for its first rows ``ids`` (checked)."""
    with dr.ReplayBuffer.open(url) as reader:
        check(reader[ids], ids)
        return reader.stats().ranges_read


def test_a_writer_writes_its_tables_as_it_closes_not_as_it_flushes(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=CHUNK, compression="zstd")
    buf.extend(rows(0, 2 * CHUNK + 10))
    buf.flush()
    assert not os.path.exists(table_path(url, "obs"))
    buf.close()
    assert sorted(os.listdir(os.path.dirname(table_path(url, "obs")))) == ["act", "obs"]  # done is not sharded
    with dr.ReplayBuffer.open(url) as reader:
        record = reader.storage.record
    for name, inner in (("obs", 64), ("act", 16)):
        table = read_table(url, name, inner)
        assert (table.sequence, table.time) == (record.sequence, record.time)
        assert table.present.tolist() == [[True, True, True]]
        for chunk in range(3):
            np.testing.assert_array_equal(table.entries[0, chunk], shard_index(url, name, chunk, inner))


def test_a_cold_reader_takes_the_shard_indexes_from_the_tables(dataset):
    """With the tables, a cold read costs each sharded row's inner chunk (and done's chunks whole);
    without one, each shard's index first."""
    assert cold_ranges(dataset) == 3 + 3 + 3
    os.remove(table_path(dataset, "act"))
    assert cold_ranges(dataset) == 3 + (3 + 3) + 3  # act's 3 shard indexes


def test_a_table_of_an_older_commit_is_not_taken(dataset):
    """A writer that opens the buffer again and commits rewrites the tail chunk: the table of the
    last close no longer describes it. Readers read shard indexes until the next close."""
    writer = dr.ReplayBuffer.open(dataset, "r+")
    writer.extend(rows(3 * CHUNK + 100, 500))
    writer.flush()
    ids = [*IDS, 3 * CHUNK + 550]  # the tail chunk's new rows
    # obs and act: 3 shard indexes each; act's inner chunks 0 and 2 of chunk 3, a small inner chunk
    # apart, are read as one range
    assert cold_ranges(dataset, ids) == 4 + 3 + (3 + 3) + 3
    writer.close()
    assert cold_ranges(dataset, ids) == 4 + 3 + 3


def test_a_writer_closing_without_rows_writes_tables_of_shards_it_did_not_write(dataset):
    os.remove(table_path(dataset, "obs"))
    dr.ReplayBuffer.open(dataset, "r+").close()
    assert cold_ranges(dataset) == 3 + 3 + 3
    for chunk in range(4):
        np.testing.assert_array_equal(read_table(dataset, "obs", 64).entries[0, chunk],
                                      shard_index(dataset, "obs", chunk, 64))


def test_a_ring_writes_the_tables_of_the_shards_it_holds(tmp_path):
    url = str(tmp_path / "ring")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=2 * CHUNK, chunk_rows=CHUNK, compression="zstd") as buf:
        buf.extend(rows(0, 3 * CHUNK + 200))  # chunk 0 holds the newest rows, chunk 1 the oldest
    table = read_table(url, "obs", 64)
    assert table.present.tolist() == [[True, True]]
    for chunk in range(2):
        np.testing.assert_array_equal(table.entries[0, chunk], shard_index(url, "obs", chunk, 64))
    with dr.ReplayBuffer.open(url) as reader:
        ids = [CHUNK + 1000, 2 * CHUNK + 7, 3 * CHUNK + 150]  # chunks 1, 0, 1
        check(reader[ids], ids)
        assert reader.stats().ranges_read == 3 + 2 + 2  # act: inner chunks 0 and 3 of chunk 1 in one range


def test_a_table_entry_that_does_not_match_its_shard_costs_the_shards_index(dataset):
    """A table stamped with the reader's commit whose entries are wrong (a shifted inner chunk)
    fails the inner chunks' checksums: the reader reads the shards' own indexes and the right rows."""
    table = read_table(dataset, "obs", 64)
    entries = table.entries.copy()
    entries[0, :, :, 0] += 3
    with open(table_path(dataset, "obs"), "wb") as f:
        f.write(ShardTable.of(table.sequence, table.time, table.present, entries).to_bytes())
    # then, for the chunks read, every sharded field's shard index and inner chunk again
    assert cold_ranges(dataset) == 3 + 3 + 3 + (3 + 3) + (3 + 3)


def _indexes_as(blob: bytes, frame: bytes) -> bytes:
    """``blob`` with ``frame`` in place of its zstd frame of indexes (4 shards: 4,096 bytes)."""
    body = blob[:HEADER.itemsize + 4] + frame
    return body + checksum(body)


def _presence(blob: bytes) -> bytes:
    body = bytearray(blob[:-4])
    body[HEADER.itemsize + 2] = 2  # chunk 2's presence byte
    return bytes(body) + checksum(bytes(body))


def _span_outside(table: ShardTable) -> ShardTable:
    entries = table.entries.copy()
    entries[0, 1, 5] = (2, 100)  # inside the shard's index
    return ShardTable.of(table.sequence, table.time, table.present, entries)


@pytest.mark.parametrize("damage,message", [
    (lambda blob, table: blob[:10], r"10 bytes, expected at least 44"),
    (lambda blob, table: blob[:-5] + bytes([blob[-5] ^ 1]) + blob[-4:], r"checksum mismatch"),
    (lambda blob, table: _indexes_as(blob, zstandard.compress(bytes(3 * 64 * 16))),
     r"its indexes would decode to 3072 bytes \(-1: unsaid\), expected 4096"),
    (lambda blob, table: _indexes_as(blob, zstandard.compress(bytes(5 * 64 * 16))),
     r"its indexes would decode to 5120 bytes \(-1: unsaid\), expected 4096"),
    (lambda blob, table: _indexes_as(blob, b"not zstd"), r"its indexes do not decode \(.*\), expected 4096 bytes"),
    (lambda blob, table: _presence(blob), r"a presence byte other than 0 or 1"),
    (lambda blob, table: ShardTable.of(table.sequence, table.time, np.ones((2, 4), bool),
                                    np.zeros((2, 4, 64, 2), "<u8")).to_bytes(),
     r"header \(magic, lanes, inner\) \(b'DRSHIDX2', 2, 64\), expected \(b'DRSHIDX2', 1, 64\)"),
    (lambda blob, table: _span_outside(table).to_bytes(),
     r"the shard index table of 'obs' is damaged: lane 0, chunk 1: inner chunk 5: span \(2, 100\) outside "
     r"the shard's data"),
], ids=["short", "checksum", "fewer", "more", "frame", "presence", "lanes", "span"])
def test_a_damaged_table_is_an_error_naming_it(dataset, damage, message):
    with open(table_path(dataset, "obs"), "rb") as f:
        blob = f.read()
    damaged = damage(blob, ShardTable.from_bytes(blob, "obs", dataset, 1, 64))
    with open(table_path(dataset, "obs"), "wb") as f:
        f.write(damaged)
    with dr.ReplayBuffer.open(dataset) as reader:
        with pytest.raises(dr.CorruptBufferError, match=message):
            reader[IDS]
    with open(table_path(dataset, "obs"), "rb") as f:
        assert f.read() == damaged  # nothing was changed


def test_a_table_larger_than_the_bound_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setattr(shard_tables, "MAX_TABLE_BYTES", HEADER.itemsize + 3 * (1 + 16 * 64) + 4)  # obs alone
    url = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=CHUNK, compression="zstd") as buf:
        buf.extend(rows(0, 2 * CHUNK + 10))
    assert not os.path.exists(os.path.dirname(table_path(url, "obs")))


def test_verify_checks_the_tables(dataset):
    """verify passes a buffer's tables, reports a damaged one, and notes one that differs from
    its shards' indexes and one of another commit."""
    assert verify(dataset).ok
    with open(table_path(dataset, "obs"), "rb") as f:
        blob = f.read()
    table = ShardTable.from_bytes(blob, "obs", dataset, 1, 64)
    entries = table.entries.copy()
    entries[0, 2, 7, 1] += 1
    with open(table_path(dataset, "obs"), "wb") as f:
        f.write(ShardTable.of(table.sequence, table.time, table.present, entries).to_bytes())
    report = verify(dataset)
    assert report.ok and [n for n in report.notes if "shard index" in n] == [
        "shard index table 'shard-index-tables/obs' differs from the index of 1 shard(s), first 'obs/c.0.2.0' "
        "(a writer rewrote them since its last commit): readers read those shards' own indexes"]
    with open(table_path(dataset, "obs"), "wb") as f:
        f.write(blob[:-1])
    assert verify(dataset).problems == ["shard index table 'shard-index-tables/obs' is damaged: checksum mismatch"]
    with open(table_path(dataset, "obs"), "wb") as f:
        f.write(blob)
    writer = dr.ReplayBuffer.open(dataset, "r+")
    writer.extend(rows(3 * CHUNK + 100, 10))
    writer.flush()
    report = verify(dataset)
    assert report.ok and [n for n in report.notes if "shard index" in n] == [
        f"shard index table 'shard-index-tables/{name}' is of commit {table.sequence}, not {table.sequence + 1}: "
        f"readers do not use it" for name in ("obs", "act")]
    writer.close()


def test_a_store_that_refuses_the_tables_costs_a_warning_not_the_commit(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=CHUNK, compression="zstd")
    buf.extend(rows(0, 2 * CHUNK + 10))
    with open(os.path.dirname(table_path(url, "obs")), "w"):  # a file where the tables' folder goes
        pass
    with pytest.warns(UserWarning, match=r"the shard index tables were not written \(.*File exists.*\); "
                                         r"readers read each shard's own index"):
        buf.close()
    with dr.ReplayBuffer.open(url) as reader:
        ids = [3, CHUNK + 5, 2 * CHUNK + 9]
        check(reader[ids], ids)
        assert reader.stats().ranges_read == 3 + 3 + (3 + 3) + 3  # obs and act: a shard index each


def test_a_writer_takes_the_indexes_of_shards_it_did_not_write_from_the_tables_it_opened_with(dataset, monkeypatch):
    """A writer that opened at the commit of the tables reads no shard index as it closes: those
    it did not write come from them; with them gone, it reads every such shard's index."""
    from diskreplay.io.local import LocalChunkStore

    read = []
    get_ranges = LocalChunkStore.get_ranges
    monkeypatch.setattr(LocalChunkStore, "get_ranges", lambda self, ranges: read.extend(ranges) or
                        get_ranges(self, ranges))
    writer = dr.ReplayBuffer.open(dataset, "r+")
    writer.extend(rows(3 * CHUNK + 100, CHUNK))  # the tail chunk (3) and a new one (4)
    writer.close()
    assert read == []
    for name, inner in (("obs", 64), ("act", 16)):
        table = read_table(dataset, name, inner)
        assert table.present.tolist() == [[True] * 5]
        for chunk in range(5):
            np.testing.assert_array_equal(table.entries[0, chunk], shard_index(dataset, name, chunk, inner))
    for name in ("obs", "act"):
        os.remove(table_path(dataset, name))
    writer = dr.ReplayBuffer.open(dataset, "r+")
    writer.extend(rows(4 * CHUNK + 100, 10))
    writer.close()
    assert sorted(key for key, _, _ in read) == sorted(f"{name}/c.0.{chunk}.0" for name in ("obs", "act")
                                                       for chunk in range(4))  # chunk 4 was written
    assert cold_ranges(dataset) == 3 + 3 + 3


def rewritten_behind(tmp_path) -> tuple[str, np.ndarray, dr.ReplayBuffer]:
    """A dataset of 10 frames closed (its tables written), then opened again by the writer
    returned, which fills the tail chunk and writes it behind its appends, before its next commit."""
    url = str(tmp_path / "frames")
    frames = (np.arange(16)[:, None, None] * 13 + np.arange(1024).reshape(32, 32)).astype(np.uint8)
    with dr.ReplayBuffer.create(url, {"img": dr.Field((32, 32), "uint8")}, capacity=None, chunk_rows=16,
                                compression="zstd") as buf:  # 1 KiB rows: shards of two 8-row inner chunks
        buf.extend({"img": frames[:10]})
    writer = dr.ReplayBuffer.open(url, "r+")
    writer.extend({"img": frames[10:]})  # chunk 0 is full: written behind, not committed
    writes_done(writer)
    return url, frames, writer


def test_a_shard_rewritten_after_the_tables_commit_is_read_through_its_own_index(tmp_path):
    """Found by the model test: a writer opened again fills the tail chunk and writes it behind
    its appends, before its next commit; the tables of the last commit then differ from that
    shard. verify notes it, and a reader of that commit reads the shard's own index and the
    rows of its commit."""
    url, frames, writer = rewritten_behind(tmp_path)
    report = verify(url)
    assert report.ok and any("differs from the index of 1 shard(s), first 'img/c.0.0.0.0'" in n for n in report.notes)
    with dr.ReplayBuffer.open(url) as reader:
        np.testing.assert_array_equal(reader[[3, 9]]["img"], frames[[3, 9]])
        # inner chunks 0 and 1 in one range; inner chunk 1 fails its checksum: the index, then both again
        assert reader.stats().ranges_read == 1 + 1 + 1
    writer.close()


def test_with_the_tables_a_cold_read_makes_one_round_of_requests(dataset, monkeypatch):
    """The tables give every index a read needs before its first request: the inner chunks go in
    the same round as the small fields' chunks. Without them, the shard indexes come first."""
    from diskreplay.io.local import LocalChunkStore

    rounds = []
    get_ranges = LocalChunkStore.get_ranges
    monkeypatch.setattr(LocalChunkStore, "get_ranges", lambda self, ranges: rounds.append(len(ranges)) or
                        get_ranges(self, ranges))
    assert cold_ranges(dataset) == 9
    assert rounds == [9]
    os.remove(table_path(dataset, "obs"))
    rounds.clear()
    assert cold_ranges(dataset) == 12
    assert rounds == [3 + 3, 3 + 3]  # done's chunks and obs's indexes; then the inner chunks of obs and act


def test_a_damaged_small_chunk_read_whole_is_named(dataset):
    """done's chunks (4 KiB, not sharded) are read whole with the inner chunks and decoded in one
    batch; a damaged one is named, as a chunk read alone would be."""
    path = os.path.join(dataset, "done", "c.0.1")
    with open(path, "rb") as f:
        blob = bytearray(f.read())
    blob[-1] ^= 1
    with open(path, "wb") as f:
        f.write(bytes(blob))
    with dr.ReplayBuffer.open(dataset) as reader:
        check(reader[[5, 3 * CHUNK + 50]], [5, 3 * CHUNK + 50])  # chunks 0 and 3
    with dr.ReplayBuffer.open(dataset) as reader:
        with pytest.raises(dr.CorruptBufferError, match=r"chunk 'done/c.0.1' does not decode \(checksum mismatch"):
            reader[IDS]


# ---- a reader past its cache: shard files mapped, their indexes taken from the tables ----------

PAST = 64 << 10
"""A reader's cache_bytes far below the dataset's rows: obs and act are read row by row from
their mapped shard files."""


def damage_index(url, name: str, chunk: int) -> None:
    """Damage the shard's own index (its checksum then fails)."""
    with open(os.path.join(url, name, f"c.0.{chunk}.0"), "r+b") as f:
        f.seek(5)
        f.write(b"\xff")


def past_the_cache(url, ids=IDS) -> None:
    with dr.ReplayBuffer.open(url, cache_bytes=PAST) as reader:
        assert isinstance(reader.storage.row_reads.maps, ShardMaps)  # read row by row from maps
        check(reader[ids], ids)


def test_a_reader_past_its_cache_takes_the_shard_indexes_from_the_tables(dataset):
    """The shards' own indexes are not read where the table has them: one damaged reads as if
    whole (`verify` reports it); without the table, it is read and named."""
    damage_index(dataset, "obs", 1)
    past_the_cache(dataset)
    assert not verify(dataset).ok
    os.remove(table_path(dataset, "obs"))
    with pytest.raises(dr.CorruptBufferError, match=r"chunk 'obs/c.0.1.0' does not decode .*checksum mismatch"):
        past_the_cache(dataset)


def test_a_table_entry_outside_its_shard_file_costs_the_shards_own_index(dataset):
    """A span of the table that does not fit its shard file: the shard's own index decides."""
    table = read_table(dataset, "obs", 64)
    entries = table.entries.copy()
    entries[0, 1, (CHUNK + 300) % CHUNK // 64] = (10**9, 100)  # the inner chunk of row CHUNK + 300
    with open(table_path(dataset, "obs"), "wb") as f:
        f.write(ShardTable.of(table.sequence, table.time, table.present, entries).to_bytes())
    past_the_cache(dataset)
    damage_index(dataset, "obs", 1)
    with pytest.raises(dr.CorruptBufferError, match=r"chunk 'obs/c.0.1.0' does not decode .*checksum mismatch"):
        past_the_cache(dataset)


def test_a_table_entry_that_does_not_match_its_shard_costs_the_shards_own_index_past_the_cache(dataset):
    """Entries that fit the file but are wrong (shifted) fail the inner chunks' checksums: the
    shards' own indexes are read and the rows decoded again."""
    table = read_table(dataset, "obs", 64)
    entries = table.entries.copy()
    entries[0, :, :32, 0] += 3  # the first half of each shard's inner chunks: still inside the file
    with open(table_path(dataset, "obs"), "wb") as f:
        f.write(ShardTable.of(table.sequence, table.time, table.present, entries).to_bytes())
    past_the_cache(dataset)
    past_the_cache(dataset, np.arange(0, 3 * CHUNK + 100, 97))


def test_past_its_cache_a_shard_rewritten_after_the_tables_commit_is_read_through_its_own_index(tmp_path):
    """As `test_a_shard_rewritten_after_the_tables_commit_is_read_through_its_own_index`, for a
    reader whose rows exceed its cache: its shard maps take the table's index, find the rewritten
    inner chunk fails its checksum, and read the shard's own."""
    url, frames, writer = rewritten_behind(tmp_path)
    with dr.ReplayBuffer.open(url, cache_bytes=4096) as reader:
        assert isinstance(reader.storage.row_reads.maps, ShardMaps)
        np.testing.assert_array_equal(reader[[3, 9]]["img"], frames[[3, 9]])
        np.testing.assert_array_equal(reader[np.arange(10)]["img"], frames[:10])
    writer.close()


@pytest.mark.parametrize("cold", [True, False])
def test_past_its_cache_a_batch_asks_for_every_fields_inner_chunks_before_it_decodes(dataset, monkeypatch, cold):
    """Shard files that were not in the page cache when mapped: a batch asks the OS for the inner
    chunks of all its sharded fields (one call per field, one span per row), then decodes them,
    so that the reads are in flight together; an inner chunk read before is not asked for again.
    Files in the page cache are never asked for."""
    from diskreplay.storage import shard_maps

    events = []
    if cold:
        monkeypatch.setattr(shard_maps, "resident", lambda address, size: False)
    monkeypatch.setattr(shard_maps, "will_need", lambda addresses, sizes: len(addresses) and events.append(
        ("ask", len(addresses))))
    decode = ShardMaps._decode_held
    monkeypatch.setattr(ShardMaps, "_decode_held", lambda self, name, *args: (
        events.append(("decode", name)), decode(self, name, *args))[1])
    with dr.ReplayBuffer.open(dataset, cache_bytes=PAST) as reader:
        check(reader[IDS], IDS)
        asked = [("ask", len(IDS))] * 2 if cold else []
        assert events == [*asked, ("decode", "obs"), ("decode", "act")]
        events.clear()
        check(reader[IDS[::-1]], IDS[::-1])
        assert events == [("decode", "obs"), ("decode", "act")]
        ids = [7, 2 * CHUNK + 1]  # an inner chunk read before (obs and act), one not (both)
        check(reader[ids], ids)
        assert events[2:] == ([("ask", 1)] * 2 if cold else []) + [("decode", "obs"), ("decode", "act")]


def v1_bytes(table: ShardTable) -> bytes:
    """``table`` as an earlier version wrote it (format section 6: ``DRSHIDX1``, uncompressed)."""
    lanes, chunks, inner, _ = table.entries.shape
    head = np.array([(b"DRSHIDX1", table.sequence, table.time, lanes, chunks, inner, 0)], HEADER)
    body = head.tobytes() + table.present.astype(np.uint8).tobytes() + table.entries.astype("<u8").tobytes()
    return body + checksum(body)


def test_a_table_keeps_any_indexes_exactly():
    """Offsets far from where a writer puts them, stored empty inner chunks, shards not held:
    the table gives back every index of the shards it holds, bit for bit."""
    rng = np.random.default_rng(5)
    present = rng.random((3, 7)) < 0.6
    entries = np.zeros((3, 7, 16, 2), "<u8")
    entries[present] = rng.integers(0, 2**64, (int(present.sum()), 16, 2), np.uint64, endpoint=False)
    entries[present, 3] = EMPTY_INNER
    entries[0, present[0], :, 1] = 4372  # sizes a writer gives: offsets from them
    blob = ShardTable.of(9, 1.5, present, entries).to_bytes()
    table = ShardTable.from_bytes(blob, "k", "u", 3, 16)
    assert (table.sequence, table.time) == (9, 1.5)
    np.testing.assert_array_equal(table.present, present)
    np.testing.assert_array_equal(table.entries, entries)


def test_a_writers_table_takes_a_few_bytes_per_inner_chunk(dataset):
    """As a writer lays shards out, each offset follows from the sizes before it: obs's table of
    4 shards of 64 inner chunks (4,141 bytes uncompressed) takes a few hundred."""
    for name, inner in (("obs", 64), ("act", 16)):
        size = os.path.getsize(table_path(dataset, name))
        assert size < HEADER.itemsize + 4 + 4 + 4 * 4 * inner < table_bytes(1, 4, inner) / 3
        table = read_table(dataset, name, inner)
        for chunk in range(4):
            np.testing.assert_array_equal(table.entries[0, chunk], shard_index(dataset, name, chunk, inner))


def test_a_table_an_earlier_version_wrote_is_taken(dataset):
    """A buffer closed by an earlier version has uncompressed tables elsewhere (``DRSHIDX1``):
    a reader takes them as it takes this version's, where they are stamped with its commit."""
    for name, inner in (("obs", 64), ("act", 16)):
        table = read_table(dataset, name, inner)
        os.makedirs(os.path.dirname(old := table_path(dataset, name).replace("shard-index-tables", "shard-indexes")),
                    exist_ok=True)
        with open(old, "wb") as f:
            f.write(v1_bytes(table))
        os.remove(table_path(dataset, name))
    assert cold_ranges(dataset) == 3 + 3 + 3
    assert verify(dataset).ok
    with open(old, "rb") as f:
        act = ShardTable.from_bytes(f.read(), "act", dataset, 1, 16)
    with open(old, "wb") as f:
        f.write(v1_bytes(ShardTable.of(act.sequence - 1, act.time, act.present, act.entries)))
    assert cold_ranges(dataset) == 3 + (3 + 3) + 3  # act's table is of another commit: its 3 shard indexes


def test_a_writers_close_replaces_an_earlier_versions_table(dataset):
    """An earlier version's table left beside this version's would cost each cold reader its fetch:
    a writer's close removes it."""
    old = table_path(dataset, "obs").replace("shard-index-tables", "shard-indexes")
    os.makedirs(os.path.dirname(old))
    with open(old, "wb") as f:
        f.write(v1_bytes(read_table(dataset, "obs", 64)))
    dr.ReplayBuffer.open(dataset, "r+").close()
    assert not os.path.exists(old)
    assert cold_ranges(dataset) == 3 + 3 + 3
