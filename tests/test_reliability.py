"""Misuse, crashes and damaged files that used to lose or corrupt data (issue #11): use after
close and lost locks, episodic returns across a crash, resuming after a kill, truncated memory
mapped chunks, and chunk checksums. Writers that die are real processes killed with SIGKILL."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import zarr
from conftest import OWN, logged

import diskreplay as dr
from diskreplay.audit import verify

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"obs": dr.Field((3,), "float32"), "next_obs": dr.Field((3,), "float32"),
          "reward": dr.Field((), "float32"), "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}


def steps(first: int, n: int, end_every: int = 0) -> dict[str, np.ndarray]:
    """Steps ``first..first+n`` of one lane: obs[t] = (t, t, t), next_obs[t] = obs[t + 1], reward
    t / 10, an episode end (terminated) every ``end_every`` steps."""
    t = np.arange(first, first + n)
    obs = np.repeat(t[:, None], 3, 1).astype(np.float32)
    ends = (t + 1) % end_every == 0 if end_every else np.zeros(n, bool)
    return {"obs": obs, "next_obs": obs + 1, "reward": (t / 10).astype(np.float32), "terminated": ends,
            "truncated": np.zeros(n, bool)}


def run_and_kill(code: str, *args: str) -> None:
    """Run a writer in a subprocess until it prints "ready", then SIGKILL it (it waits on its
    stdin, a pipe kept open, so it cannot exit by itself and release its lock first)."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


# ---- use after close, lost locks ------------------------------------------------------------


CLOSED_CALLS = {
    "add": lambda b: b.add(**{k: v[0] for k, v in steps(0, 1).items()}),
    "extend": lambda b: b.extend(steps(0, 2)),
    "flush": lambda b: b.flush(),
    "sample": lambda b: b.sample(4),
    "update_priorities": lambda b: b.update_priorities([0], [1.0]),
    "rows": lambda b: b[[0]],
    "episodes": lambda b: b.episodes(),
    "refresh": lambda b: b.refresh(),
    "state_dict": lambda b: b.state_dict(),
    "len": len,
}


@pytest.mark.parametrize("call", list(CLOSED_CALLS))
@pytest.mark.parametrize("mode", ["r+", "r"])
def test_every_call_on_a_closed_buffer_raises_closed_error(tmp_path, call, mode):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, 64, chunk_rows=8, sampler=dr.Prioritized()) as buf:
        buf.extend(steps(0, 10))
    buf = dr.ReplayBuffer.open(url, mode)
    buf.close()
    buf.close()  # idempotent
    with pytest.raises(dr.ClosedError, match=rf"buffer {url!r} is closed; open it again to use it"):
        CLOSED_CALLS[call](buf)
    assert repr(buf) == f"ReplayBuffer({url!r}, closed)"


def test_closed_writer_cannot_roll_back_the_next_writers_commit(tmp_path):
    """Before: ``flush()`` after ``close()`` rewrote commit.json without the lock, rolling back
    another writer's 20 committed rows."""
    url = str(tmp_path / "b")
    first = dr.ReplayBuffer.create(url, FIELDS, 64, chunk_rows=8)
    first.extend(steps(0, 10))
    first.close()
    second = dr.ReplayBuffer.open(url, "r+")
    second.extend(steps(10, 20))
    second.flush()
    for call in (lambda: first.add(**{k: v[0] for k, v in steps(99, 1).items()}), first.flush):
        with pytest.raises(dr.ClosedError):
            call()
    with dr.ReplayBuffer.open(url) as reader:
        assert len(reader) == 30
        np.testing.assert_array_equal(reader[np.arange(30)]["obs"][:, 0], np.arange(30))
    second.close()


def test_writer_whose_lock_was_broken_stops_writing(tmp_path):
    """A writer whose lock another writer broke (break_lock=True) must write no chunk, state
    object or commit over its successor's: every later write raises LockedError."""
    url = str(tmp_path / "b")
    first = dr.ReplayBuffer.create(url, FIELDS, 64, chunk_rows=8)
    first.extend(steps(0, 10))
    first.flush()
    second = dr.ReplayBuffer.open(url, "r+", break_lock=True)
    second.extend(steps(10, 20))
    second.flush()
    committed = open(os.path.join(url, OWN, "commit.json"), "rb").read()
    states = sorted(os.listdir(os.path.join(url, OWN, "state")))
    first.extend(steps(10, 3))  # staged in RAM only: no chunk is full yet
    with pytest.raises(dr.LockedError, match=r"this writer no longer holds the writer lock.*it stopped writing"):
        first.flush()
    with pytest.raises(dr.LockedError, match=r"this writer no longer holds the writer lock"):
        first.extend(steps(13, 30))  # fills chunks: refused before any is written, and undone
    assert open(os.path.join(url, OWN, "commit.json"), "rb").read() == committed
    assert sorted(os.listdir(os.path.join(url, OWN, "state"))) == states
    with pytest.raises(dr.LockedError):
        first.close()
    second.extend(steps(30, 5))
    second.close()
    with dr.ReplayBuffer.open(url) as reader:
        np.testing.assert_array_equal(reader[reader.row_ids()]["obs"][:, 0], np.arange(35))


# ---- episodic returns across a crash --------------------------------------------------------

RETURNS_WRITER = """
import sys, numpy as np, diskreplay as dr
exec(sys.argv[2])
buf = dr.ReplayBuffer.create(sys.argv[1], FIELDS, chunk_rows=4, compression=None,
                             episodic_return=dr.EpisodicReturn(gamma=0.5, default_return=-7.0))
buf.extend(steps(0, 10))  # one open episode, committed
buf.flush()
buf.extend(steps(10, 3, end_every=13))  # ends it at step 12: rows 0-9 are patched and written...
w = buf.storage.writer                   # (behind the extend, on the writer's background thread)
while w.sealed or w.behind.busy:
    w.write_behind(); w.wait()
print("ready", flush=True)               # ...but the end is never committed
sys.stdin.readline()
"""


def test_episodic_returns_come_only_from_committed_rows(tmp_path, caplog):
    url = str(tmp_path / "b")
    run_and_kill(RETURNS_WRITER, url, _source_of(FIELDS, steps))
    on_disk = zarr.open_group(url, mode="r")["return"][0, :10]
    assert (on_disk != -7.0).all()  # the dead writer's patch reached the chunks (rewards 10-12 included)
    with dr.ReplayBuffer.open(url) as reader:  # ...but its episode end is not committed
        assert len(reader) == 10 and not reader.episodes().complete.any()
        np.testing.assert_array_equal(reader[np.arange(10)]["return"], np.full(10, -7.0, np.float32))
        np.testing.assert_array_equal(reader.sample(32, seed=0)["return"], np.full(32, -7.0, np.float32))
    with logged(caplog, "took over the writer lock"):
        writer = dr.ReplayBuffer.open(url, "r+")
    writer.extend(steps(100, 2))  # the episode the crash cut is closed: returns of committed rewards only
    want = np.array([sum(0.5 ** (i - t) * i / 10 for i in range(t, 10)) for t in range(10)], np.float32)
    np.testing.assert_allclose(writer[np.arange(10)]["return"], want, rtol=1e-6)
    writer.close()
    with dr.ReplayBuffer.open(url) as reader:
        np.testing.assert_allclose(reader[np.arange(10)]["return"], want, rtol=1e-6)
        assert reader[[9]]["truncated"][0] and not reader[[9]]["terminated"][0]
        np.testing.assert_array_equal(reader[[10, 11]]["return"], np.full(2, -7.0, np.float32))


def _source_of(fields, fn) -> str:
    """Code defining ``FIELDS`` and ``fn`` (e.g. `steps`) for a writer subprocess."""
    import inspect

    spec = ", ".join(f"{name!r}: dr.Field({f.shape!r}, {f.dtype.name!r})" for name, f in fields.items())
    return (f"import numpy as np\nimport diskreplay as dr\nFIELDS = {{{spec}}}\n"
            + textwrap.dedent(inspect.getsource(fn)))


# ---- resuming after a kill ------------------------------------------------------------------

RESUME_WRITER = """
import sys, numpy as np, diskreplay as dr
exec(sys.argv[2])
buf = dr.ReplayBuffer.create(sys.argv[1], FIELDS, capacity=200, num_envs=2, chunk_rows=8,
                             derive_next=("obs",), seed=0)
for lane, n in ((0, 23), (1, 17)):  # both lanes end mid-episode (episodes of 10 steps)
    buf.extend({k: v[:, None] for k, v in steps(0, n, end_every=10).items()}, env_ids=[lane])
buf.flush()
buf.extend({k: v[:, None] for k, v in steps(23, 4, end_every=10).items()}, env_ids=[0])  # never committed
print("ready", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("continue_episodes", [False, True])
def test_resume_after_sigkill_closes_the_cut_episodes(tmp_path, continue_episodes, caplog):
    """Before: episodes() reported one episode across the restart, with next_obs[t] != obs[t+1]."""
    url = str(tmp_path / "b")
    run_and_kill(RESUME_WRITER, url, _source_of(FIELDS, steps))
    with logged(caplog, r"took over the writer lock left by pid \d+ .*no longer running"):
        buf = dr.ReplayBuffer.open(url, "r+", **({"continue_episodes": True} if continue_episodes else {}))
    assert buf.state_dict()["total"].tolist() == [23, 17]  # the unflushed steps are gone
    for lane in (0, 1):  # a new episode starts in each lane
        buf.extend({k: v[:, None] for k, v in steps(1000, 6, end_every=6).items()}, env_ids=[lane])
    table = buf.episodes()
    cut_at = {0: 23, 1: 17}
    cut = {lane: (int(s), int(n)) for lane, s, n in zip(table.lane, table.start, table.length) if s + n == cut_at[lane]}
    rows = buf[np.array([22 * 2, 16 * 2 + 1])]  # the last committed step of each lane
    if continue_episodes:
        assert cut == {} and not rows["truncated"].any()
        np.testing.assert_array_equal(rows["next_obs"][:, 0], [1000, 1000])  # the merged episode goes on
    else:
        assert cut == {0: (20, 3), 1: (10, 7)}
        assert rows["truncated"].all() and not rows["terminated"].any()
        np.testing.assert_array_equal(rows["next_obs"][:, 0], [23, 17])  # what the dead writer saw next
        obs = buf.sample(200, seq_len=3, seed=1)["obs"][:, :, 0]
        assert (np.diff(obs, axis=1) == 1).all()  # inside one episode: no slice spans the restart
        batch = buf.sample(200, n_step=3, gamma=0.5, seed=2)
        cut_rows = np.isin(batch["index"], [20 * 2, 21 * 2, 22 * 2, 14 * 2 + 1, 15 * 2 + 1, 16 * 2 + 1])
        assert cut_rows.any() and (batch["next_obs"][cut_rows, 0] <= 23).all()  # n-step stops at the cut
    buf.close()
    assert verify(url).ok


# ---- memory-mapped chunks that are truncated -------------------------------------------------

MAPPED_READER = """
import os, sys, numpy as np, diskreplay as dr
url = sys.argv[1]
F = {"obs": dr.Field((17,), "float32"), "done": dr.Field((), "bool")}
w = dr.ReplayBuffer.create(url, F, capacity=16384, chunk_rows=256, compression=None)
w.extend({"obs": np.ones((16384, 17), np.float32), "done": np.zeros(16384, bool)})
w.flush()
r = dr.ReplayBuffer.open(url, "r", memory_map=True)
assert r.storage.mapped is not None
r.storage._reader.warmer.pending = False                 # map chunks as read, not all at the first read
r[np.arange(1024)]                                      # maps chunks 0-3
os.truncate(os.path.join(url, "obs", "c.0.15.0"), 100)  # a chunk it has not mapped yet
w.extend({"obs": np.ones((256, 17), np.float32), "done": np.zeros(256, bool)})  # rewrites chunk 0...
w.flush()
os.truncate(os.path.join(url, "obs", "c.0.0.0"), 10)    # ...which is then damaged
r.refresh()
for rows, key in (([15 * 256 + 1], "c.0.15.0"), ([16384 + 3], "c.0.0.0")):
    try:
        r[rows]
        print("no error")
    except dr.CorruptBufferError as exc:
        print("refused", key in str(exc), "bytes, expected" in str(exc))
print("alive")
"""


def test_truncated_chunk_files_are_refused_before_they_are_mapped(tmp_path):
    """A chunk file is checked before it is mapped, and again when a rewritten chunk is mapped
    anew, so a truncated file is a CorruptBufferError, never a SIGBUS. (A file truncated while
    it is mapped cannot be caught in Python: see docs/guide/limits.md.)"""
    done = subprocess.run([sys.executable, "-c", MAPPED_READER, str(tmp_path / "b")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr)  # -7 would be SIGBUS
    assert done.stdout.split("\n")[:3] == ["refused True True", "refused True True", "alive"]


# ---- checksums -----------------------------------------------------------------------------


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("damage", ["zeros", "garbage", "one-bit"])
def test_checksums_catch_same_size_damage(tmp_path, compression, damage):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, chunk_rows=8, compression=compression) as buf:
        buf.extend(steps(0, 24, end_every=5))
    path = os.path.join(url, "obs", "c.0.1.0")
    blob = bytearray(open(path, "rb").read())
    if damage == "zeros":
        blob[:] = bytes(len(blob))
    elif damage == "garbage":
        blob[:] = np.random.default_rng(0).integers(0, 256, len(blob), dtype=np.uint8).tobytes()
    else:
        blob[len(blob) // 2] ^= 1
    open(path, "wb").write(bytes(blob))
    report = verify(url)
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith("chunk 'obs/c.0.1.0' does not decode to 96 bytes (checksum mismatch")
    with dr.ReplayBuffer.open(url, memory_map=False) as reader:
        reader.warm()  # the fill reads every chunk whole: it finds the damage, and reads check whole chunks since
        reason = "fails its checksum" if compression is None else "does not decode \\(checksum mismatch"
        with pytest.raises(dr.CorruptBufferError, match=rf"chunk 'obs/c.0.1.0' {reason}"):
            reader[[9]]
        np.testing.assert_array_equal(reader[np.arange(8)]["obs"][:, 0], np.arange(8))  # other chunks read
    with dr.ReplayBuffer.open(url, memory_map=False) as reader:  # a fresh reader's first read, without the fill
        with pytest.raises(dr.CorruptBufferError, match=rf"chunk 'obs/c.0.1.0' {reason}"):
            reader[np.arange(8, 16)]  # the rows of the damaged chunk


def test_chunks_carry_zarrs_crc32c_codec_and_buffers_without_it_still_work(tmp_path, monkeypatch):
    url = str(tmp_path / "b")
    with dr.ReplayBuffer.create(url, FIELDS, chunk_rows=8, compression=None) as buf:
        buf.extend(steps(0, 20))
    arr = zarr.open_group(url, mode="r")["obs"]
    assert [c.to_dict()["name"] for c in arr.metadata.codecs] == ["bytes", "crc32c"]
    np.testing.assert_array_equal(arr[0, :16, 0], np.arange(16))  # zarr reads (and checks) them
    assert os.path.getsize(os.path.join(url, "obs", "c.0.0.0")) == 8 * 12 + 4
    from dataclasses import replace

    from diskreplay.format import layout

    old = str(tmp_path / "old")
    with_checksum = layout.field_codec
    monkeypatch.setattr(layout, "field_codec", lambda *args: replace(with_checksum(*args), checksum=False))
    with dr.ReplayBuffer.create(old, FIELDS, chunk_rows=8, compression=None) as buf:  # as before checksums
        buf.extend(steps(0, 20))
    monkeypatch.undo()
    assert os.path.getsize(os.path.join(old, "obs", "c.0.0.0")) == 8 * 12
    for memory_map in (False, True):
        with dr.ReplayBuffer.open(old, "r+", memory_map=memory_map) as buf:
            buf.extend(steps(20, 5))
            np.testing.assert_array_equal(buf[np.arange(25)]["obs"][:, 0], np.arange(25))
    assert verify(old).ok


TESTS_PRINTED = """
crash test local ring: 20 SIGKILLs survived, 0 committed rows lost
crash test s3: 7 SIGKILLs survived, 0 committed rows lost
faults: 100 injected, 100 survived
faults: 75 injected, 75 survived
live ring writer + 3 readers (plain): reader rows checked 2000000, wrong 0
live writer + reader (sharded): 40 batches, 127008 rows checked
bad-input kinds: 348 calls refused
model test: 509 sequences, 21968 steps checked, 98 layouts (lanes [1, 2, 3], samplers 4)
====== 505 passed in 301.20s ======
"""
"""What the tests that tools/reliability_report.py runs print (pytest -s), in short."""


def table_rows(text: str) -> list[list[str]]:
    """The cells of each row of the first markdown table in ``text``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[start:end]]


def test_reliability_report_prints_the_docs_table():
    """tools/reliability_report.py sums the tests' lines into the table of docs/benchmarks.md's
    Reliability section: the same columns and rows (numbers aside), so a new run's table can
    replace the page's."""
    spec = importlib.util.spec_from_file_location("reliability_report", ROOT / "tools" / "reliability_report.py")
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    printed = report.table(TESTS_PRINTED, 0)
    assert table_rows(printed)[2:] == [
        ["writer processes killed with SIGKILL (local ring, local dataset, S3)", "27 survived",
         "0 committed rows lost"],
        ["faults injected: full disk (tmpfs), S3 503 answers, S3 requests never answered", "175 injected",
         "175 survived"],
        ["bad-input and tampered-file kinds", "348 refused", "store unchanged in each"],
        ["rows returned to readers of a live ring writer (3 reader processes, and one in-process)",
         "2,127,008 checked", "0 wrong"],
        ["random operation sequences against a reference model (lanes [1, 2, 3], samplers 4)",
         "509 sequences, 21,968 steps, 98 layouts", "0 differences"]]
    assert printed.endswith("\n\npytest: 505 passed in 301.20s")

    page = (ROOT / "docs" / "benchmarks.md").read_text()
    section = page.split("\n## Reliability\n", 1)[1].split("\n## ", 1)[0]
    assert table_shape(table_rows(section)) == table_shape(table_rows(printed))


def table_shape(rows: list[list[str]]) -> list[list[str]]:
    """``rows`` with their numbers as N and the first cell's details in brackets cut."""
    return [[re.sub(r" \(.*", "", row[0]), *(re.sub(r"[\d,]+", "N", cell) for cell in row[1:])] for row in rows]
