"""Growing state commits what changed (issue 16): priorities and episode ends go to journals, a
flush writes bytes in proportion to the changes, not to the capacity, and every reopen — also
after a SIGKILL mid-flush — gives exactly the state of the last commit."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace

import numpy as np
import pytest
from conftest import OWN
from s3server import s3, s3_client

import diskreplay as dr
from diskreplay.format.journal import LOG_CHUNK, JournalRef
from diskreplay.io.local import LocalChunkStore
from diskreplay.io.store import objects_at
from diskreplay.storage.journal import FIRST_ROUND, Journal, MissingObject

FIELDS = {"obs": dr.Field((2,), "float32"), "done": dr.Field((), "bool")}


def rows(first: int, n: int, episode: int = 7) -> dict[str, np.ndarray]:
    t = np.arange(first, first + n)
    return {"obs": np.stack([t, -t], 1).astype(np.float32), "done": t % episode == episode - 1}


def written_bytes() -> int:
    """Bytes this process has passed to write() so far (Linux /proc/self/io)."""
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("wchar"))


def state_files(path) -> list[str]:
    root = os.path.join(path, OWN, "state")
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def leaves(buf: dr.ReplayBuffer) -> np.ndarray:
    return buf.sampler.state_dict()["leaves"]


def per_buffer(path, capacity: int | None, n: int, **kw) -> dr.ReplayBuffer:
    buf = dr.ReplayBuffer.create(path, FIELDS, capacity=capacity, chunk_rows=1024, seed=0,
                                 sampler=dr.Prioritized(alpha=0.6), **kw)
    for first in range(0, n, 1 << 15):
        buf.extend(rows(first, min(1 << 15, n - first)))
    buf.flush(durable=False)
    return buf


def flush_bytes_after_updates(path, capacity: int, updates: int) -> int:
    with per_buffer(path, capacity, 1 << 16) as buf:
        rng = np.random.default_rng(1)
        for _ in range(updates // 250):
            buf.update_priorities(rng.integers(0, 1 << 16, 250), rng.random(250))
        before = written_bytes()
        buf.flush(durable=False)
        return written_bytes() - before


def test_a_flush_writes_what_changed_not_what_exists(tmp_path):
    small = flush_bytes_after_updates(tmp_path / "small", 1 << 16, 1000)
    big = flush_bytes_after_updates(tmp_path / "big", 1 << 23, 1000)  # 32 MiB of float32 leaves
    assert big <= 2 * small, (small, big)
    assert big < 64 << 10, big  # ~1,000 records of 12 bytes, a tail chunk and commit.json


def test_records_past_an_eighth_of_the_leaves_write_a_new_base(tmp_path):
    capacity = 1 << 19
    with per_buffer(tmp_path / "b", capacity, 1 << 16) as buf:
        generation = {f.split("/")[1] for f in state_files(tmp_path / "b") if f.startswith("sampler.leaves/")}
        rng = np.random.default_rng(2)
        for _ in range(3):
            buf.update_priorities(rng.integers(0, 1 << 16, 1 << 15), rng.random(1 << 15))
            buf.flush(durable=False)
        before = written_bytes()
        buf.update_priorities(rng.integers(0, 1 << 16, 1 << 15), rng.random(1 << 15))  # past 65,536 records
        buf.flush(durable=False)
        assert written_bytes() - before >= 4 * capacity  # every leaf, as float32
        buf.flush(durable=False)  # the old generation is deleted after the commit that replaced it
        now = {f.split("/")[1] for f in state_files(tmp_path / "b") if f.startswith("sampler.leaves/")}
        assert len(now) == 1 and now != generation
        expected = leaves(buf)
    with dr.ReplayBuffer.open(tmp_path / "b", "r") as reader:
        np.testing.assert_array_equal(leaves(reader), expected)


@pytest.mark.parametrize("capacity", [1 << 14, None])
def test_reopen_gives_the_priorities_and_episodes_of_the_last_commit(tmp_path, capacity):
    path = tmp_path / "b"
    rng = np.random.default_rng(3)
    buf = per_buffer(path, capacity, 5000)
    added = 5000
    for _ in range(12):
        n = int(rng.integers(1, 3 * LOG_CHUNK))  # tails, full log chunks, and (dataset) a wider stride
        buf.extend(rows(added, n))
        added += n
        buf.update_priorities(buf.row_ids()[rng.integers(0, len(buf), 300)], rng.random(300) * 5)
        buf.flush(durable=False)
        committed = leaves(buf), buf.episodes(), buf.sampler.max_priority
        buf.update_priorities(buf.row_ids()[:10], np.full(10, 99.0))  # not committed
        with dr.ReplayBuffer.open(path, "r") as reader:
            np.testing.assert_array_equal(leaves(reader), committed[0])
            assert reader.sampler.max_priority == committed[2]
            for name in ("lane", "start", "length", "complete"):
                np.testing.assert_array_equal(getattr(reader.episodes(), name), getattr(committed[1], name))
    buf.close()
    if capacity is None:
        assert buf.sampler.stride == 1 << 16 or added > 1 << 16


def test_a_ring_keeps_its_episode_journal_bounded(tmp_path):
    path = tmp_path / "ring"
    with dr.ReplayBuffer.create(path, FIELDS, capacity=2000, chunk_rows=256) as buf:
        for k in range(200):
            buf.extend(rows(k * 500, 500, episode=3))  # 167 episodes per flush, 667 live
            buf.flush(durable=False)
        table = buf.episodes()
    objects = [f for f in state_files(path) if f.startswith("episodes.ends/")]
    size = sum(os.path.getsize(os.path.join(path, OWN, "state", f)) for f in objects)
    assert size <= 16 * (2 * 667 + 2 * LOG_CHUNK), size  # not the 33,000 ends of all 200 flushes
    with dr.ReplayBuffer.open(path, "r") as reader:
        for name in ("lane", "start", "length", "complete"):
            np.testing.assert_array_equal(getattr(reader.episodes(), name), getattr(table, name))


def test_a_failed_commit_writes_its_records_again_first(tmp_path, monkeypatch):
    path = tmp_path / "b"
    buf = per_buffer(path, 1 << 14, 6000)
    real_put = LocalChunkStore.put
    fail = {OWN + "commit.json": 1}

    def put(store, key, data, durable=False):
        if fail.get(key):
            fail[key] -= 1
            raise OSError(28, "No space left on device")
        return real_put(store, key, data, durable)

    monkeypatch.setattr(LocalChunkStore, "put", put)
    rng = np.random.default_rng(4)
    buf.update_priorities(buf.row_ids()[:LOG_CHUNK + 100], rng.random(LOG_CHUNK + 100))
    with pytest.raises(OSError):
        buf.flush(durable=False)
    buf.update_priorities(buf.row_ids()[50:70], np.full(20, 3.0))
    buf.flush(durable=False)
    expected = leaves(buf)
    buf.close()
    with dr.ReplayBuffer.open(path, "r") as reader:
        np.testing.assert_array_equal(leaves(reader), expected)


def test_the_commit_record_stays_small(tmp_path):
    with per_buffer(tmp_path / "b", 1 << 22, 1 << 16) as buf:
        buf.update_priorities(buf.row_ids()[:5000], np.random.default_rng(5).random(5000))
        buf.flush(durable=False)
    assert os.path.getsize(tmp_path / "b" / OWN / "commit.json") < 4096


WRITER = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    import diskreplay as dr
    path, capacity = sys.argv[1], int(sys.argv[2])
    fields = {"obs": dr.Field((2,), "float32"), "done": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.open(path, "r+", sampler=dr.Prioritized(alpha=0.6))
    rng = np.random.default_rng(int(sys.argv[3]))
    for k in range(10**6):
        t = len(buf) + np.arange(500)
        buf.extend({"obs": np.stack([t, -t], 1).astype(np.float32), "done": t % 7 == 6})
        buf.update_priorities(buf.row_ids()[rng.integers(0, len(buf), 20000)], rng.random(20000) * 3)
        episodes = buf.episodes()
        digest = hashlib.sha256(buf.sampler.state_dict()["leaves"].tobytes() + episodes.start.tobytes()
                                + episodes.length.tobytes()).hexdigest()
        print("begin", digest, flush=True)
        buf.flush(durable=True)
        print("done", digest, flush=True)
""")


def _reports(text: str) -> list[list[str]]:
    """The writer's whole ``begin``/``done`` lines in ``text`` (a kill may cut the last one; the CI
    once met a line of one word here)."""
    return [parts for line in text.splitlines(keepends=True) if line.endswith("\n")
            and len(parts := line.split()) == 2 and parts[0] in ("begin", "done") and len(parts[1]) == 64]


@pytest.mark.slow
def test_priorities_after_sigkill_mid_flush_are_those_of_the_last_commit(tmp_path):
    """A writer flushing a large PER buffer (rebases every few flushes) is killed at random
    moments; each reopen shows exactly the leaves and episodes of the last flush that returned,
    or of the one in flight (its commit may have landed just before the kill)."""
    path = str(tmp_path / "b")
    capacity = 1 << 20
    per_buffer(path, capacity, 1 << 15).close()
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    rng = np.random.default_rng(6)
    for round_ in range(8):
        proc = subprocess.Popen([sys.executable, str(script), path, str(capacity), str(round_)],
                                stdout=subprocess.PIPE, text=True)
        lines = []
        target = int(rng.integers(2, 9))
        while len([x for x in lines if x[0] == "done"]) < target:
            line = proc.stdout.readline()
            assert line, "the writer died on its own"
            lines += _reports(line)
        time.sleep(float(rng.uniform(0, 0.3)))  # somewhere inside a later flush
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        lines += _reports(proc.stdout.read())
        done = [d for kind, d in lines if kind == "done"][-1]
        in_flight = [d for kind, d in lines if kind == "begin"][-1]
        with dr.ReplayBuffer.open(path, "r") as reader:
            episodes = reader.episodes()
            got = hashlib.sha256(leaves(reader).tobytes() + episodes.start.tobytes()
                                 + episodes.length.tobytes()).hexdigest()
        assert got in (done, in_flight), round_
        dr.ReplayBuffer.open(path, "r+", break_lock=True).close()  # the killed writer's lock


def test_final_observations_commit_what_changed(tmp_path):
    """The ``derive_next`` side store of final observations grows by chunks of its own: a flush
    after one more episode writes the same few bytes after 100 episodes as after 16,484 (sizes
    that leave the same partial chunks: data, final observations and the episode journal's tail)."""
    fields = {"obs": dr.Field((8,), "float32"), "next_obs": dr.Field((8,), "float32"), "done": dr.Field((), "bool")}

    def flush_bytes(episodes: int) -> int:
        with dr.ReplayBuffer.create(tmp_path / str(episodes), fields, capacity=None, chunk_rows=20,
                                    derive_next=("obs",)) as buf:
            t = np.arange(episodes * 5)
            obs = np.repeat(t[:, None], 8, 1).astype(np.float32)
            buf.extend({"obs": obs, "next_obs": obs + 1, "done": t % 5 == 4})
            buf.flush(durable=False)
            buf.extend({"obs": obs[:5], "next_obs": obs[:5] + 1, "done": t[:5] % 5 == 4})
            before = written_bytes()
            buf.flush(durable=False)
            return written_bytes() - before

    small, big = flush_bytes(100), flush_bytes(100 + 4 * LOG_CHUNK)
    assert big <= 1.2 * small, (small, big)


def test_journals_on_s3_commit_reopen_and_collect(s3, s3_client):
    """The same journals through an object store: every commit PUTs its new objects, a reader
    gets the last commit's priorities and episodes, and replaced tails and bases are deleted."""
    url, options = s3.new_url("journals"), s3.storage_options()
    rng = np.random.default_rng(7)
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=1 << 13, chunk_rows=512, sampler=dr.Prioritized(),
                                 storage_options=options)
    for k in range(6):
        buf.extend(rows(k * 3000, 3000))
        n = 70_000 if k == 3 else 2000  # past 65,536 records: a new base
        buf.update_priorities(buf.row_ids()[rng.integers(0, len(buf), n)], rng.random(n))
        buf.flush()
    expected, episodes = leaves(buf), buf.episodes()
    buf.close()
    with dr.ReplayBuffer.open(url, "r", storage_options=options) as reader:
        np.testing.assert_array_equal(leaves(reader), expected)
        np.testing.assert_array_equal(reader.episodes().start, episodes.start)
    record = json.loads(s3.keys(url)[OWN + "commit.json"])
    state = record["extra"]["state"]
    named = set()
    for path, part in (("sampler.leaves", state["sampler"]["leaves"]), ("episodes.ends", state["episodes"]["ends"])):
        named |= set(JournalRef.from_json(path, part["__journal__"], record["sequence"]).keys())
    stored = {k.removeprefix(OWN) for k in s3.keys(url)
              if k.startswith(OWN + "state/") and not k.endswith(".safetensors")}
    assert stored == named


def test_a_buffer_committed_before_journals_opens_and_moves_to_them(tmp_path):
    """A commit of the earlier format (every float64 leaf and every episode end in the state
    object) opens with the same priorities and episodes; its first commit writes journals."""
    from diskreplay.format import state as saved
    from diskreplay.format.commit import state_key

    path = tmp_path / "b"
    with per_buffer(path, 1 << 12, 3000) as buf:
        buf.update_priorities(buf.row_ids()[:500], np.random.default_rng(8).random(500) * 4)
        full = buf.state_dict()
        buf.flush()
    own = path / OWN
    record = json.loads((own / "commit.json").read_text())
    meta, arrays = saved.split({k: v for k, v in full.items() if k != "total"})
    arrays["sampler.leaves"] = arrays["sampler.leaves"].astype(np.float64)
    key = state_key(record["sequence"])
    (own / key).write_bytes(saved.arrays_to_bytes(arrays))
    record["extra"] = {"state": meta, "state_arrays": key}
    (own / "commit.json").write_text(json.dumps(record))
    for journal in ("sampler.leaves", "episodes.ends"):
        shutil.rmtree(own / "state" / journal)
    with dr.ReplayBuffer.open(path, "r+") as buf:
        np.testing.assert_array_equal(leaves(buf), full["sampler"]["leaves"])
        assert len(buf.episodes()) == 3000 // 7 + 1
        buf.flush()
    assert {f.split("/")[0] for f in state_files(path)} >= {"sampler.leaves", "episodes.ends"}
    with dr.ReplayBuffer.open(path, "r") as reader:
        np.testing.assert_array_equal(leaves(reader), full["sampler"]["leaves"])
        assert len(reader.episodes()) == 3000 // 7 + 1


def journal_refs(path) -> dict[str, dict]:
    """The journal references of the last commit, by state path."""
    state = json.loads((path / OWN / "commit.json").read_text())["extra"]["state"]
    return {"sampler.leaves": state["sampler"]["leaves"]["__journal__"],
            "episodes.ends": state["episodes"]["ends"]["__journal__"]}


def test_one_flipped_bit_in_a_log_chunk_is_found_by_open_and_verify(tmp_path):
    from diskreplay.audit import verify

    path = tmp_path / "b"
    with per_buffer(path, 1 << 14, 6000) as buf:
        buf.update_priorities(buf.row_ids()[:5000], np.random.default_rng(9).random(5000) + 1)
    assert verify(path).ok
    ref = journal_refs(path)["sampler.leaves"]
    assert ref["records"] > LOG_CHUNK and ref["checksum"] == "crc32c"
    log = path / OWN / "state" / "sampler.leaves" / ref["generation"] / "log.0"
    data = bytearray(log.read_bytes())
    data[100 * 12 + 8] ^= 1  # the lowest bit of a value: still a valid priority
    log.write_bytes(bytes(data))
    damaged = (rf"journal object 'state/sampler\.leaves/{ref['generation']}/log\.0' is damaged: checksum "
               rf"mismatch \(stored [0-9a-f]{{8}}, computed [0-9a-f]{{8}}\)")
    for mode in ("r", "r+"):
        with pytest.raises(dr.CorruptBufferError, match=damaged):
            dr.ReplayBuffer.open(path, mode)
    report = verify(path)
    assert not report.ok and len(report.problems) == 1 and re.fullmatch(damaged, report.problems[0]), report.problems


def test_journals_written_before_checksums_open_verify_and_move_to_them(tmp_path):
    """A commit whose journals carry no checksums (as diskreplay wrote them before) opens with the
    same state and verifies; appends to such a journal stay unchecked until its part writes a new
    generation, which has checksums."""
    from diskreplay.audit import verify

    path = tmp_path / "b"
    with per_buffer(path, 1 << 14, 5000) as buf:
        buf.update_priorities(buf.row_ids()[:300], np.random.default_rng(10).random(300) + 1)
        expected, episodes = leaves(buf), buf.episodes()
    record = json.loads((path / OWN / "commit.json").read_text())
    for name in ("sampler", "episodes"):
        part = record["extra"]["state"][name]["leaves" if name == "sampler" else "ends"]["__journal__"]
        del part["checksum"]
    assert record["extra"]["state_arrays"] is None  # everything of this state is in journals
    (path / OWN / "commit.json").write_text(json.dumps(record))
    for journal in ("sampler.leaves", "episodes.ends"):
        for item in (path / OWN / "state" / journal).rglob("*"):
            if item.is_file():
                item.write_bytes(item.read_bytes()[:-4])
    assert verify(path).ok
    with dr.ReplayBuffer.open(path, "r+") as buf:
        np.testing.assert_array_equal(leaves(buf), expected)
        np.testing.assert_array_equal(buf.episodes().start, episodes.start)
        buf.update_priorities(buf.row_ids()[:10], np.full(10, 7.0))
        buf.flush()
        expected = leaves(buf)
    assert "checksum" not in journal_refs(path)["sampler.leaves"]
    assert verify(path).ok
    with dr.ReplayBuffer.open(path, "r+") as buf:
        np.testing.assert_array_equal(leaves(buf), expected)
        for k in range(14):  # past 65,536 records since the base
            buf.update_priorities(buf.row_ids(), np.full(5000, 2.0 + k))
            buf.flush(durable=False)
        expected = leaves(buf)
    assert journal_refs(path)["sampler.leaves"]["checksum"] == "crc32c"
    assert verify(path).ok
    with dr.ReplayBuffer.open(path, "r") as reader:
        np.testing.assert_array_equal(leaves(reader), expected)


class CountingStore:
    """A store's reads, recorded: ``(method, keys)`` per call."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def get(self, key, limit=None):
        self.calls.append(("get", [key]))
        return self.store.get(key, limit)

    def get_many(self, keys, limit=None):
        self.calls.append(("get_many", list(keys)))
        return self.store.get_many(keys, limit)


def episode_journal_ref(path) -> JournalRef:
    record = json.loads((path / OWN / "commit.json").read_text())
    part = record["extra"]["state"]["episodes"]["ends"]["__journal__"]
    return JournalRef.from_json("episodes.ends", part, record["sequence"])


def test_a_journal_is_read_in_one_request_per_object_all_at_once(tmp_path):
    # before: one read after another (on S3 a round trip each: an open of a buffer of 20M steps
    # with 16,000 episodes took 9 round trips instead of 5)
    path = tmp_path / "b"
    buf = dr.ReplayBuffer.create(str(path), FIELDS, capacity=None, chunk_rows=1024)
    buf.extend(rows(0, 3 * LOG_CHUNK * 2 + 100, episode=2))  # 3 full log chunks of episode ends, then a tail
    buf.flush()
    first = episode_journal_ref(path)
    objects = CountingStore(objects_at(LocalChunkStore(str(path)), OWN))
    journal = Journal(objects, str(path), "episodes.ends")
    content = journal.read(first)
    assert objects.calls == [("get_many", first.keys())]
    assert len(first.keys()) == 3 + 1 + len(first.base_keys())
    assert len(content.records) == first.records == 3 * LOG_CHUNK + 50
    buf.extend(rows(3 * LOG_CHUNK * 2 + 100, 2 * LOG_CHUNK, episode=2))  # one more full log chunk and a new tail
    buf.flush()
    buf.close()
    second = episode_journal_ref(path)
    objects.calls.clear()
    again = journal.read(second)
    new = [key for key in second.keys() if key not in first.keys()]
    assert objects.calls == [("get_many", new)] and len(new) == 2  # the full log chunks read before are kept
    np.testing.assert_array_equal(again.records[:len(content.records) - 50], content.records[:-50])
    with dr.ReplayBuffer.open(str(path), "r") as reader:
        assert len(reader.episodes()) == len(again.records)


def test_a_reference_claiming_more_log_chunks_than_exist_fails_after_one_round(tmp_path):
    # before: a request for every log chunk claimed (a damaged count of 2**30 records: 262,144)
    path = tmp_path / "b"
    with dr.ReplayBuffer.create(str(path), FIELDS, capacity=None, chunk_rows=1024) as buf:
        buf.extend(rows(0, 2 * LOG_CHUNK * 2 + 100, episode=2))  # 2 full log chunks of episode ends, then a tail
    ref = episode_journal_ref(path)
    claimed = replace(ref, records=3 * FIRST_ROUND * LOG_CHUNK + ref.records % LOG_CHUNK)
    objects = CountingStore(objects_at(LocalChunkStore(str(path)), OWN))
    with pytest.raises(MissingObject, match=re.escape(ref.log_key(2))):
        Journal(objects, str(path), "episodes.ends").read(claimed)
    assert [(call, len(keys)) for call, keys in objects.calls] == [("get_many", FIRST_ROUND)]
    objects.calls.clear()
    content = Journal(objects, str(path), "episodes.ends").read(ref)  # the true count: one round, all of it
    assert objects.calls == [("get_many", ref.keys())] and len(content.records) == ref.records


def test_opening_reads_every_journal_of_the_state_in_one_round(tmp_path, monkeypatch):
    # before: one round per journal (priorities, then episode ends)
    path = str(tmp_path / "b")
    with per_buffer(path, None, 3 * LOG_CHUNK) as buf:
        buf.update_priorities(buf.row_ids()[:10], np.arange(1.0, 11.0))
        leaves_before, starts = leaves(buf), buf.episodes().start
    rounds: list[list[str]] = []
    get_many = LocalChunkStore.get_many

    def recorded(self, keys, limit=None):
        if any("/state/" in f"/{key}" for key in keys):
            rounds.append(list(keys))
        return get_many(self, keys, limit)
    monkeypatch.setattr(LocalChunkStore, "get_many", recorded)
    with dr.ReplayBuffer.open(path, "r") as reader:
        np.testing.assert_array_equal(leaves(reader), leaves_before)
        np.testing.assert_array_equal(reader.episodes().start, starts)
    assert len(rounds) == 1, rounds
    assert {key.split("/")[3] for key in rounds[0]} == {"sampler.leaves", "episodes.ends"}
