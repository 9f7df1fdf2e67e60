"""Reading a buffer as of a past commit: `ReplayBuffer.pin` keeps a commit, ``open(url, "r",
at_commit=n)`` reads it exactly (rows, episodes, saved state) while the writer goes on round its
ring, `unpin` frees its copy, and `verify(url, at_commit=n)` checks it."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from format_v1 import downgrade

import diskreplay as dr
from diskreplay import cli
from diskreplay.audit import verify
from diskreplay.buffer import setup
from diskreplay.format.commit import CommitRecord
from diskreplay.format.pins import state_keys
from diskreplay.storage.pins import Pins

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"), "done": dr.Field((), "bool")}
LANES, CAPACITY, CHUNK = 2, 64, 8  # 32 steps per lane, 4 chunks per lane


def steps(start: int, n: int, sign: float = 1.0) -> dict[str, np.ndarray]:
    """Steps ``start..start+n`` of both lanes (time-major); row id ``step * LANES + lane`` has act == id."""
    ids = np.arange(start, start + n)[:, None] * LANES + np.arange(LANES)
    return {"obs": (sign * np.stack([ids, ids + 0.5, -ids], -1)).astype(np.float32), "act": ids,
            "done": ids % 7 == 5}


def files(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def pins_dir(url) -> str:
    return os.path.join(url, "diskreplay", "objects", "pins")


def snapshot(buf: dr.ReplayBuffer) -> dict:
    """Everything a reader shows of its commit: every row of every field, len, episodes, window."""
    ids = buf.row_ids()
    table = buf.episodes()
    return {"ids": ids, "rows": buf.rows(ids), "len": len(buf), "window": buf.window(),
            "episodes": (table.lane, table.start, table.length, table.complete)}


def assert_same(got: dict, want: dict) -> None:
    np.testing.assert_array_equal(got["ids"], want["ids"])
    assert got["rows"].keys() == want["rows"].keys()
    for name, values in want["rows"].items():
        assert got["rows"][name].tobytes() == values.tobytes(), name
    assert got["len"] == want["len"]
    for a, b in zip(got["window"], want["window"]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got["episodes"], want["episodes"]):
        np.testing.assert_array_equal(a, b)


def assert_same_batch(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("compression,memory_map", [("zstd", None), (None, True)], ids=["zstd", "raw-mapped"])
def test_pinned_commit_reads_the_same_bytes_after_the_ring_wrapped(tmp_path, compression, memory_map):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK,
                                 compression=compression, seed=5)
    buf.extend(steps(0, 45))
    n = buf.pin("eval")
    assert buf.pins() == {n: "eval"}
    before = dr.ReplayBuffer.open(url, "r", memory_map=memory_map)  # a plain reader of commit n
    assert before.storage.record.sequence == n
    want, golden = snapshot(before), before.sample(48, seed=11)
    # opened before the writer goes on
    early = dr.ReplayBuffer.open(url, "r", at_commit=n, memory_map=memory_map, cache_bytes=1)
    for start in (45, 77, 109):  # three times round the ring (32 steps per lane), other values
        buf.extend(steps(start, 32, sign=-1.0))
        buf.flush()
    now = dr.ReplayBuffer.open(url, "r")
    assert int(now.row_ids().min()) > int(want["ids"].max())  # every row of commit n overwritten
    for reader in (early, dr.ReplayBuffer.open(url, "r", at_commit=n, memory_map=memory_map),
                   dr.ReplayBuffer.open(url, "r", at_commit="eval", memory_map=memory_map)):
        assert_same(snapshot(reader), want)
        assert_same_batch(reader.sample(48, seed=11), golden)
        assert reader.refresh() is False and reader.storage.record.sequence == n
        assert_same(snapshot(reader), want)
        reader.close()
    for b in (before, now, buf):
        b.close()


def test_pinned_commit_keeps_its_sampler_state_and_generator(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK,
                                 sampler=dr.Prioritized(alpha=0.7), seed=2)
    buf.extend(steps(0, 40))
    batch = buf.sample(16)
    buf.update_priorities(batch["index"], np.arange(16, dtype=np.float64) + 1.0)
    n = buf.pin()
    before = dr.ReplayBuffer.open(url, "r")
    golden = [before.sample(32, beta=0.4) for _ in range(3)]  # the buffer's own generator, restored
    buf.update_priorities(buf.sample(16)["index"], np.full(16, 50.0))
    buf.extend(steps(40, 70))
    buf.flush()
    pinned = dr.ReplayBuffer.open(url, "r", at_commit=n)
    for want in golden:
        assert_same_batch(pinned.sample(32, beta=0.4), want)
    for b in (before, pinned, buf):
        b.close()


def test_a_derive_next_buffer_reads_its_pinned_next_obs(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, {**FIELDS, "next_obs": dr.Field((3,), "float32")}, capacity=CAPACITY,
                                 num_envs=LANES, chunk_rows=CHUNK, derive_next=("obs",))
    data = steps(0, 45)
    buf.extend({**data, "next_obs": data["obs"] + 1})
    n = buf.pin()
    want = snapshot(dr.ReplayBuffer.open(url, "r"))
    data = steps(45, 100, sign=-1.0)
    buf.extend({**data, "next_obs": data["obs"] - 1})
    buf.flush()
    with dr.ReplayBuffer.open(url, "r", at_commit=n) as pinned:
        assert_same(snapshot(pinned), want)
    buf.close()


def test_unpin_frees_the_copies(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 45))
    buf.flush()
    before = files(url)
    n = buf.pin("a")
    copies = files(pins_dir(url))
    # the record, the state object, journal objects, and each of the 4 chunks per lane of 3 fields
    assert copies[0] == f"{n:012d}/act/c.0.0" and len([c for c in copies if "/c." in c]) == 3 * 4 * LANES
    assert f"{n:012d}/commit.json" in copies
    assert len(files(url)) == len(before) + len(copies) + 1  # and pins.json
    buf.unpin("a")
    assert buf.pins() == {}
    assert len(files(url)) == len(before) and not os.path.exists(pins_dir(url))
    with pytest.raises(dr.CommitNotKeptError, match=rf"commit 'a' is not kept .* the newest, {n}, and the pinned: "
                                                    rf"none"):
        dr.ReplayBuffer.open(url, "r", at_commit="a")
    with pytest.raises(dr.CommitNotKeptError, match=r"commit 'a' is not kept"):
        buf.unpin("a")
    buf.close()


def test_opening_a_commit_that_is_gone_names_the_commits_that_can_be_opened(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 10))
    buf.flush()
    gone = buf.storage.record.sequence
    kept = buf.pin("eval")
    buf.extend(steps(10, 5))
    buf.flush()
    newest = buf.storage.record.sequence
    with pytest.raises(dr.CommitNotKeptError,
                       match=rf"commit {gone} is not kept \(only pinned commits and the newest can be opened "
                             rf"at_commit=\); commits that can be opened: the newest, {newest}, and the pinned: "
                             rf"{kept} \('eval'\)"):
        dr.ReplayBuffer.open(url, "r", at_commit=gone)
    with pytest.raises(ValueError, match="at_commit= opens a buffer read-only"):
        dr.ReplayBuffer.open(url, "r+", at_commit=kept)
    with pytest.raises(TypeError, match="at_commit: expected a commit sequence"):
        dr.ReplayBuffer.open(url, "r", at_commit=1.5)
    buf.close()


def test_the_newest_commit_opens_unpinned_until_the_writer_overwrites_it(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 20))
    buf.flush()
    n = buf.storage.record.sequence
    reader = dr.ReplayBuffer.open(url, "r", at_commit=n, cache_bytes=1)
    want = snapshot(dr.ReplayBuffer.open(url, "r"))
    buf.extend(steps(20, 10))  # still within the ring: commit n's rows stay
    buf.flush()
    assert reader.refresh() is False
    assert_same(snapshot(reader), want)
    buf.extend(steps(30, 40))  # round the ring: rows of commit n overwritten
    buf.flush()
    with pytest.raises(dr.CommitNotKeptError, match=rf"commit {n} is not kept"):
        reader.rows(want["ids"])
    buf.close()


def test_pin_names_and_who_may_pin(tmp_path):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 5))
    n = buf.pin("a")
    buf.extend(steps(5, 5))
    for name, error in (("a", rf"cannot pin as 'a': pin {n} \('a'\) exists"), ("12", "not all digits"),
                        ("", "a string of 1 to 255"), (3, "a string of 1 to 255")):
        with pytest.raises(ValueError, match=error):
            buf.pin(name)  # refused before anything is written
    assert buf.storage.record.sequence == n
    m = buf.pin()  # each pin flushes first: a commit of its own
    assert m == n + 1
    assert buf.pins() == {n: "a", m: None}
    with dr.ReplayBuffer.open(url, "r") as reader:
        assert reader.pins() == {n: "a", m: None}
        with pytest.raises(dr.ReadOnlyError):
            reader.pin()
    buf.close()


def test_an_interrupted_pin_is_never_read_and_its_copies_go(tmp_path, monkeypatch):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 45))
    buf.flush()
    before = files(url)
    copy = Pins._copy_keys

    def killed(self, source, keys, target, what):
        if what == "chunk":
            copy(self, source, keys[:5], target, what)
            raise OSError("killed while copying")
        return copy(self, source, keys, target, what)
    monkeypatch.setattr(Pins, "_copy_keys", killed)
    with pytest.raises(OSError, match="killed while copying"):
        buf.pin("x")
    monkeypatch.undo()
    index = json.loads(open(os.path.join(url, "diskreplay", "objects", "pins.json")).read())
    n = index["pins"][0]["commit"]
    assert index["pins"][0]["status"] == "copying"
    with pytest.raises(dr.CommitNotKeptError, match=r"the pinned: none"):
        dr.ReplayBuffer.open(url, "r", at_commit="x")
    assert verify(url, at_commit="x").problems[0].startswith("commit 'x' is not kept")
    assert f"pins.json: pin {n} ('x') is 'copying', left by an interrupted writer" in verify(url).notes[0]
    assert verify(url, at_commit=n).ok  # the newest commit itself, unpinned
    m = buf.pin("y")  # the writer's next pin deletes what the interrupted one left
    buf.unpin(m)
    assert len(files(url)) == len(before) and not os.path.exists(pins_dir(url))
    buf.close()


def test_verify_checks_a_pinned_commit_and_names_a_damaged_chunk(tmp_path, capsys):
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 45))
    n = buf.pin("eval")
    buf.extend(steps(45, 64))
    buf.flush()
    report = verify(url, at_commit=n)
    assert report.ok and report.rows == 64 and report.chunks_checked == 3 * 4 * LANES
    assert verify(url, at_commit="eval").ok
    key = f"pins/{n:012d}/obs/c.1.2.0"
    path = os.path.join(url, "diskreplay", "objects", *key.split("/"))
    with open(path, "r+b") as f:
        f.write(b"\xff\xff")
    report = verify(url, at_commit=n)
    assert report.problems[0].startswith(f"chunk {key!r} does not decode")
    assert verify(url).ok  # the buffer itself is fine
    assert cli.main(["verify", url, "--at-commit", str(n), "--no-progress"]) == 1
    assert key in capsys.readouterr().err
    with dr.ReplayBuffer.open(url, "r", at_commit=n) as pinned:
        with pytest.raises(dr.CorruptBufferError, match=r"pins/\d{12}.*chunk 'obs/c.1.2.0' does not decode"):
            pinned.rows(pinned.row_ids())
    os.remove(path)
    assert f"chunk {key!r} is missing" in verify(url, at_commit=n).problems[0]
    assert verify(url, at_commit=1).problems[0].startswith("commit 1 is not kept")
    buf.close()


def test_sharded_buffers_pin_shard_by_shard(tmp_path):
    url = str(tmp_path / "buf")
    dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK, shards=2).close()
    shard = dr.ReplayBuffer.open_shard(url, 1)
    shard.extend(steps(0, 40))
    n = shard.pin()
    want = snapshot(dr.ReplayBuffer.open(shard.url, "r"))
    shard.extend(steps(40, 64))
    shard.flush()
    with dr.ReplayBuffer.open(shard.url, "r", at_commit=n) as pinned:
        assert_same(snapshot(pinned), want)
    assert verify(shard.url, at_commit=n).ok
    with pytest.raises(ValueError, match=r"is a sharded buffer: its shards commit on their own, so it has no commit"):
        dr.ReplayBuffer.open(url, "r", at_commit=n)
    with dr.ReplayBuffer.open(url, "r") as union, pytest.raises(ValueError, match="a sharded buffer's union"):
        union.pins()
    assert verify(url, at_commit=n).problems[0].startswith("a sharded buffer has no commit")
    shard.close()


def test_a_format_1_buffer_opens_its_newest_commit_but_takes_no_pins(tmp_path):
    url = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK) as buf:
        buf.extend(steps(0, 5))
    downgrade(url)
    with dr.ReplayBuffer.open(url, "r") as reader:
        n = reader.storage.record.sequence
    with dr.ReplayBuffer.open(url, "r", at_commit=n) as reader:
        assert len(reader) == 5 * LANES
    with dr.ReplayBuffer.open(url, "r+") as buf:
        with pytest.raises(ValueError, match=r"is a diskreplay/1 buffer: pins need format diskreplay/2"):
            buf.pin()
        assert buf.pins() == {}


@pytest.mark.parametrize("index,error", [
    ('{"pins": [{"commit": 3, "name": null, "time": 1.0, "status": "kept"},'
     ' {"commit": 3, "name": "b", "time": 1.0, "status": "kept"}]}',
     r"pins.json field 'pins': expected each commit once, got \[3, 3\]"),
    ('{"pins": [{"commit": 3, "name": null, "time": 1.0, "status": "done"}]}',
     r"pins.json field 'pins': 'status': expected one of \['kept', 'copying', 'removing'\], got 'done'"),
    ('{"pins": [{"commit": -1, "name": null, "time": 1.0, "status": "kept"}]}',
     r"pins.json field 'pins': 'commit': expected an int >= 0, got -1"),
    ('[1]', r"pins.json is not a JSON object"),
], ids=["twice", "status", "commit", "not-an-object"])
def test_a_damaged_pin_index_is_named(tmp_path, index, error):
    url = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK) as buf:
        buf.extend(steps(0, 5))
        n = buf.pin()
    with open(os.path.join(url, "diskreplay", "objects", "pins.json"), "w") as f:
        f.write(index)
    with pytest.raises(dr.CorruptBufferError, match=error):
        dr.ReplayBuffer.open(url, "r", at_commit=n)
    assert [p for p in verify(url).problems if re.search(error, p)]


def test_a_damaged_pinned_record_is_named(tmp_path):
    url = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK) as buf:
        buf.extend(steps(0, 5))
        n = buf.pin()
        buf.extend(steps(5, 5))
    path = os.path.join(pins_dir(url), f"{n:012d}", "commit.json")
    record = json.loads(open(path).read())
    with dr.ReplayBuffer.open(url, "r", at_commit=np.int64(n)) as pinned:  # a numpy int names it too
        assert len(pinned) == 5 * LANES
    with open(path, "w") as f:
        json.dump({**record, "sequence": n + 1}, f)
    with pytest.raises(dr.CorruptBufferError, match=rf"pins/{n:012d}/commit.json field 'sequence': expected {n}"):
        dr.ReplayBuffer.open(url, "r", at_commit=n)
    os.remove(path)
    with pytest.raises(dr.CorruptBufferError, match=rf"pins/{n:012d}/commit.json is missing, but pins.json keeps"):
        dr.ReplayBuffer.open(url, "r", at_commit=n)


def test_a_torch_dataset_over_a_pinned_reader_reads_the_pinned_commit(tmp_path):
    """The datasets reopen the buffer in each process (DataLoader workers): at the same commit."""
    pytest.importorskip("torch")
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 45))
    n = buf.pin()
    buf.extend(steps(45, 70, sign=-1.0))
    buf.flush()
    with dr.ReplayBuffer.open(url, "r", at_commit=n) as pinned:
        assert pinned.at_commit == n and buf.at_commit is None
        ids = pinned.row_ids()
        epoch = list(pinned.as_dataset(16, mode="epoch", shuffle=False))
        got = np.concatenate([batch["index"].numpy() for batch in epoch])
        np.testing.assert_array_equal(np.sort(got), np.sort(ids))
        obs = np.concatenate([batch["obs"].numpy() for batch in epoch])
        np.testing.assert_array_equal(obs[:, 0], got.astype(np.float32))  # the values of commit n, not the newest
        batch = next(iter(pinned.as_dataset(32, mode="sample", seed=1)))
        assert np.isin(batch["index"].numpy(), ids).all()
    buf.close()


def test_the_newest_commit_replaced_while_a_reader_opens_it(tmp_path, monkeypatch):
    """The writer commits between a reader's read of the newest commit and of its state: the
    state's objects are gone, and the reader says the commit is no longer kept (not damaged)."""
    url = str(tmp_path / "buf")
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=LANES, chunk_rows=CHUNK)
    buf.extend(steps(0, 5))
    buf.flush()
    n = buf.storage.record.sequence
    opened = setup.open_storage

    def then_commit(*args, **kwargs):
        storage = opened(*args, **kwargs)
        buf.extend(steps(5, 10))  # new episode ends: the journal's tail object is replaced
        buf.flush()
        return storage
    monkeypatch.setattr(setup, "open_storage", then_commit)
    with pytest.raises(dr.CommitNotKeptError, match=rf"commit {n} is not kept: the writer committed since, and "
                                                     rf"deleted its state object 'state/episodes.ends/"):
        dr.ReplayBuffer.open(url, "r", at_commit=n)
    monkeypatch.undo()
    m = buf.pin()
    copy = os.path.join(pins_dir(url), f"{m:012d}")
    key = state_keys(CommitRecord.from_bytes(open(os.path.join(copy, "commit.json"), "rb").read(), url, LANES))[0]
    os.remove(os.path.join(copy, *key.split("/")))
    with pytest.raises(dr.CorruptBufferError, match=rf"state object '{key}' is missing"):
        dr.ReplayBuffer.open(url, "r", at_commit=m)
    buf.close()


def test_a_buffer_with_variable_length_fields_takes_no_pins(tmp_path):
    fields = {"tokens": dr.Field((None,), "int32"), "done": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(tmp_path / "b", fields, capacity=64, chunk_rows=8) as buf:
        buf.add(tokens=np.arange(5, dtype=np.int32), done=False)
        with pytest.raises(ValueError, match=r"pins do not keep variable-length fields yet \(the values arrays of "
                                             r"\['tokens'\]\)"):
            buf.pin()
        assert buf.pins() == {}
