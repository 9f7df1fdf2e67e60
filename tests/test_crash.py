"""Crash safety: a writer process is killed with SIGKILL at random points, again and again.

The writer adds a known sequence (row id ``i`` holds ``f(i)`` in every field) and flushes at
random intervals, announcing each step on a progress file *before* it happens ("adding N",
"flushing N") and each completed flush *after* ("flushed N"). After every kill the parent
checks, with a fresh read-only open:

- the buffer opens, `verify` finds nothing wrong, and a left-over writer lock is reported stale;
- the committed step count is the last completed flush, or the flush under way (its commit
  landed before the kill): never less, never anything else;
- every visible row equals ``f(row id)``; no committed row is missing, except rows a ring had
  already retired because the writer wrote past them (``lower``);

then starts the next writer on the same buffer (breaking the stale lock, resuming the sequence).
Writers are forked from one pre-imported "zygote" process so a kill round costs milliseconds of
start-up, not an interpreter start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from s3server import s3

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.io import lock as drlock
from diskreplay.storage import own_stores

ROWS_CODE = """
import numpy as np
import diskreplay as dr

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"),
          "done": dr.Field((), "bool"), "img": dr.Field((2, 2), "uint8")}


def f(ids):
    ids = np.asarray(ids, dtype=np.int64)
    return {"obs": np.stack([ids, ids + 0.25, -ids], -1).astype(np.float32), "act": ids,
            "done": ids % 7 == 3, "img": np.broadcast_to((ids % 251).astype(np.uint8)[..., None, None],
                                                          ids.shape + (2, 2)).copy()}


RAGGED = {"tok": dr.Field((None,), "int32"), "txt": dr.Field((), "str")}


def tok(i):
    return np.arange(i % 5, dtype=np.int32) + i


def txt(i):
    return "é" * (i % 4) + str(i)


def steps(first, n, lanes, ragged=False):
    ids = np.arange(first, first + n)[:, None] * lanes + np.arange(lanes)
    rows = f(ids if lanes > 1 else ids[:, 0])
    if ragged:  # lists of rows, nested like the lanes
        grid = ids.tolist() if lanes > 1 else ids[:, 0].tolist()
        for name, value in (("tok", tok), ("txt", txt)):
            rows[name] = [[value(i) for i in r] for r in grid] if lanes > 1 else [value(i) for i in grid]
    return rows
"""

ZYGOTE_CODE = ROWS_CODE + """
import json, logging, os, sys, traceback
try:  # pre-import what an S3 writer needs, once, before forking (no threads or loops start here)
    import s3fs  # noqa: F401
except ImportError:
    pass


def write_forever(job):
    out = os.open(job["progress"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    say = lambda line: os.write(out, (line + "\\n").encode())
    try:
        so, lanes = job["storage_options"], job["lanes"]
        rng = np.random.default_rng(job["seed"])
        caught = []  # the previous writer was killed: its lock is taken over, and that is logged
        handler = logging.Handler()
        handler.emit = caught.append
        logging.getLogger("diskreplay").addHandler(handler)
        buf = dr.ReplayBuffer.open(job["url"], "r+", storage_options=so)
        logging.getLogger("diskreplay").removeHandler(handler)
        say(f"tookover {sum('took over the writer lock' in r.getMessage() for r in caught)}")
        step = int(buf.state_dict()["total"][0])
        say(f"start {step}")
        while True:
            n = int(rng.integers(1, 3 * job["chunk_rows"]))
            say(f"adding {step + n}")
            rows = steps(step, n, lanes, job["ragged"])
            if rng.random() < 0.5:
                buf.extend(rows)
            else:
                for i in range(n):
                    buf.add(**{k: v[i] for k, v in rows.items()})
            step += n
            say(f"flushing {step}")
            buf.flush()
            say(f"flushed {step}")
    except BaseException:
        say("error " + traceback.format_exc().replace("\\n", " | "))
        os._exit(1)


for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "spawn":
        pid = os.fork()
        if pid == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            write_forever(cmd["job"])
        print(pid, flush=True)
    elif cmd["op"] == "reap":
        _, status = os.waitpid(cmd["pid"], 0)
        print(status, flush=True)
"""

namespace: dict = {}
exec(ROWS_CODE, namespace)
FIELDS, f, RAGGED = namespace["FIELDS"], namespace["f"], namespace["RAGGED"]


class Zygote:
    """A Python process with diskreplay imported that forks writer children on request."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE_CODE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, **cmd) -> str:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def spawn(self, job: dict) -> int:
        return int(self._ask(op="spawn", job=job))

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self._ask(op="reap", pid=pid)  # the writer is gone for good before anyone looks

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def progress(path: str) -> list[tuple[str, int]]:
    out = []
    with open(path) as fh:
        for line in fh:
            word, _, value = line.strip().partition(" ")
            if word == "error":
                raise AssertionError(f"the writer failed: {value}")
            out.append((word, int(value)))
    return out


def _wait_for(path: str, word: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            with open(path) as fh:
                text = fh.read()
            if any(line.split(" ")[0] in (word, "error") for line in text.splitlines()):
                return
        time.sleep(0.005)
    raise AssertionError(f"the writer never reported {word!r}")


def crash_rounds(tmp_path, kills: int, *, capacity: int | None, lanes: int, chunk_rows: int,
                 compression: str | None, seed: int, url: str | None = None,
                 storage_options: dict | None = None, max_delay: float = 0.15, after_start: float = 0.5,
                 label: str = "", ragged: bool = False) -> dict:
    url = url or str(tmp_path / "buf")
    first = dr.ReplayBuffer.create(url, FIELDS | (RAGGED if ragged else {}), capacity=capacity, num_envs=lanes,
                                   chunk_rows=chunk_rows, compression=compression, storage_options=storage_options)
    first.extend(namespace["steps"](0, 8, lanes, ragged))  # an episode end in every lane
    first.close()
    rng = np.random.default_rng(seed)
    lane_cap = None if capacity is None else capacity // lanes
    committed, most_added = 8, 8
    stats = {"kills": 0, "rows_lost": 0, "commit_landed": 0, "mid_flush": 0, "rows_checked": 0,
             "stale_locks": 0, "takeovers": 0}
    zygote = Zygote()
    try:
        for k in range(kills):
            path = str(tmp_path / f"progress-{k}.txt")
            pid = zygote.spawn({"url": url, "storage_options": storage_options, "lanes": lanes,
                                "chunk_rows": chunk_rows, "seed": int(rng.integers(2**31)), "progress": path,
                                "ragged": ragged})
            if rng.random() < after_start:  # else the kill may land while the writer opens the buffer
                _wait_for(path, "start", timeout=30)
            time.sleep(float(rng.uniform(0.0, max_delay)))
            zygote.kill(pid)
            stats["kills"] += 1
            events = progress(path) if os.path.exists(path) else []
            flushed = [v for w, v in events if w == "flushed"]
            low = flushed[-1] if flushed else committed
            high = events[-1][1] if events and events[-1][0] == "flushing" else low
            most_added = max([most_added] + [v for w, v in events if w == "adding"])
            stats["mid_flush"] += high != low
            where = f"{label} kill {k} (pid {pid}, last events {events[-3:]})"

            holder = drlock.lock_holder(url, own_stores(url, storage_options))
            if holder is not None:
                assert holder.stale_reason() is not None, where  # the next writer takes it over
                stats["stale_locks"] += 1
            stats["takeovers"] += sum(v for w, v in events if w == "tookover")
            buf = dr.ReplayBuffer.open(url, "r", storage_options=storage_options)
            total = buf.state_dict()["total"]
            assert (total == total[0]).all(), where
            visible = int(total[0])
            assert visible in (low, high), f"{where}: {visible} steps committed, expected {low} or {high}"
            stats["commit_landed"] += visible == high != low
            ids = buf.row_ids()
            got = buf[ids] if len(ids) else {}
            for name in FIELDS:
                if len(ids):
                    np.testing.assert_array_equal(got[name], f(ids)[name], err_msg=f"{where}: field {name}")
            if ragged and len(ids):
                assert [r.tolist() for r in got["tok"]] == [namespace["tok"](i).tolist() for i in ids.tolist()], where
                assert got["txt"].tolist() == [namespace["txt"](i) for i in ids.tolist()], where
            stats["rows_checked"] += len(ids)
            # committed rows that must be visible: all of them, except what a ring retired
            need_lo = 0 if lane_cap is None else max(0, visible - lane_cap, most_added - lane_cap)
            lane_steps = ids // lanes
            for lane in range(lanes):
                have = lane_steps[ids % lanes == lane]
                lost = max(0, visible - need_lo - len(have))
                stats["rows_lost"] += lost
                assert lost == 0 and (len(have) == 0 or have.max() == visible - 1), where
            buf.close()
            report = verify(url, storage_options)
            assert report.ok, f"{where}: {report}"
            assert report.rows == len(ids)
            committed = visible
    finally:
        zygote.close()
    stats["final_steps"] = committed
    print(f"\ncrash test {label}: {stats['kills']} SIGKILLs survived, {stats['rows_lost']} committed rows lost; "
          f"{stats['mid_flush']} kills during a flush ({stats['commit_landed']} of those after its commit "
          f"landed), {stats['rows_checked']} visible rows checked against f(id), {stats['stale_locks']} "
          f"stale locks reported, {stats['takeovers']} taken over by the next writer, {committed} steps per "
          f"lane at the end")
    return stats


@pytest.mark.parametrize("mode,kills,capacity,lanes,chunk_rows,compression,ragged", [
    ("ring", 28, 96, 1, 8, "zstd", False),
    ("dataset", 24, None, 2, 8, None, False),
    ("dataset-ragged", 20, None, 2, 8, "zstd", True),
], ids=["ring-zstd", "dataset-raw-2lanes", "dataset-zstd-2lanes-ragged-text"])
def test_sigkill_local(tmp_path, mode, kills, capacity, lanes, chunk_rows, compression, ragged):
    stats = crash_rounds(tmp_path, kills, capacity=capacity, lanes=lanes, chunk_rows=chunk_rows,
                         compression=compression, seed=1234 + kills, label=f"local {mode}", ragged=ragged)
    assert stats["kills"] == kills and stats["rows_lost"] == 0
    # how many kills land while the lock is held depends on timing: at least one must be taken over
    assert stats["final_steps"] > 0 and stats["takeovers"] > 0


def test_sigkill_s3(tmp_path, s3):
    stats = crash_rounds(tmp_path, 5, capacity=64, lanes=1, chunk_rows=8, compression="zstd", seed=7,
                         url=s3.new_url("crash"), storage_options=s3.storage_options(), max_delay=0.4,
                         after_start=1.0, label="s3 ring")
    assert stats["kills"] == 5 and stats["rows_lost"] == 0


# ---- a writer and readers in different processes ------------------------------------------

WRITER_CODE = ROWS_CODE + """
import sys, time
url, capacity, mode, compression = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
buf = dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, chunk_rows=8,
                             compression=None if compression == "raw" else compression)
total = 0
if mode == "commands":
    for line in sys.stdin:
        cmd, _, n = line.split()[0], None, int((line.split() + ["0"])[1])
        if cmd == "extend":
            buf.extend(steps(total, n, 1))
            total += n
        elif cmd == "flush":
            buf.flush()
        print("ok", total, flush=True)
else:  # free-running: random extends and flushes for a while
    rng = np.random.default_rng(5)
    deadline = time.monotonic() + float(mode)
    while time.monotonic() < deadline:
        n = int(rng.integers(1, 20))
        buf.extend(steps(total, n, 1))
        total += n
        if rng.random() < 0.5:
            buf.flush()
            print("flushed", total, flush=True)
buf.close()
print("done", total, flush=True)
"""


class Writer:
    def __init__(self, url: str, capacity: int, mode: str = "commands", compression: str = "zstd"):
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER_CODE, url, str(capacity), mode, compression],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def do(self, cmd: str) -> str:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.stdout.readline().startswith("done")
        self.proc.wait(timeout=30)


COMPRESSIONS = pytest.mark.parametrize("compression", ["zstd", "raw"])  # raw: memory-mapped reads


@COMPRESSIONS
def test_reader_that_did_not_refresh_never_gets_overwritten_rows(tmp_path, monkeypatch, compression):
    from diskreplay import StaleReadError
    from diskreplay.storage.stale import RetiredCheck
    url = str(tmp_path / "ring")
    writer = Writer(url, capacity=32, compression=compression)
    assert writer.do("extend 32") == "ok 32" and writer.do("flush") == "ok 32"
    cold = dr.ReplayBuffer.open(url)  # window [0, 32), nothing cached
    warm = dr.ReplayBuffer.open(url)
    assert_rows(warm[np.arange(32)], np.arange(32))
    warm.warm()  # everything cached
    unguarded = dr.ReplayBuffer.open(url)
    # the writer goes round the ring: it commits lower=8, then rewrites chunk 0 with steps 32..39
    assert writer.do("extend 8") == "ok 40"
    with pytest.raises(StaleReadError, match=r"rows \[0, 1, 2, 3, 4\]\.\.\. were overwritten by the writer"):
        cold[np.arange(8)]
    assert isinstance(StaleReadError("x"), IndexError)
    np.testing.assert_array_equal(cold.row_ids(), np.arange(8, 32))  # it adopted the new commit
    assert_rows(cold[np.arange(8, 32)], np.arange(8, 32))
    assert_rows(warm[np.arange(8)], np.arange(8))  # cached copies predate the overwrite: still right
    # without the guard, a stale reader would silently return the writer's next round
    monkeypatch.setattr(RetiredCheck, "check", lambda self, *a: [])
    wrong = unguarded[np.arange(8)]
    np.testing.assert_array_equal(wrong["act"], np.arange(32, 40))
    monkeypatch.undo()
    assert writer.do("flush") == "ok 40"
    assert cold.refresh()
    assert_rows(cold[np.arange(8, 40)], np.arange(8, 40))
    writer.close()


@COMPRESSIONS
def test_reader_does_not_cache_a_chunk_with_retired_slots(tmp_path, compression):
    """The writer rewrote chunk 0 as its new tail: slots 0-3 hold steps 32-35, slots 4-7 still
    steps 4-7. A stale reader asking for 4-7 gets them right, and must not keep the chunk: its
    slots 0-3 would otherwise answer a later request for steps 0-3 with steps 32-35."""
    from diskreplay import StaleReadError
    url = str(tmp_path / "ring")
    writer = Writer(url, capacity=32, compression=compression)
    writer.do("extend 32")
    writer.do("flush")
    reader = dr.ReplayBuffer.open(url)
    assert writer.do("extend 4") == "ok 36" and writer.do("flush") == "ok 36"
    assert_rows(reader[np.arange(4, 8)], np.arange(4, 8))
    with pytest.raises(StaleReadError, match=r"rows \[0, 1, 2, 3\] were overwritten"):
        reader[np.arange(0, 4)]
    assert_rows(reader[np.arange(4, 36)], np.arange(4, 36))
    writer.close()


def assert_rows(got: dict, ids) -> None:
    want = f(np.asarray(ids))
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def open_while_writing(url: str, **kw) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.open(url, "r", **kw)


@COMPRESSIONS
def test_reader_process_against_live_writer(tmp_path, compression):
    """A free-running writer process wraps a small ring again and again while this process
    samples with a tiny cache (every batch refetches chunks) and refreshes now and then. A
    stale read never escapes `sample`: the reader adopts the newest commit and draws again."""
    url = str(tmp_path / "live")
    writer = subprocess.Popen([sys.executable, "-c", WRITER_CODE, url, "64", "1.5", compression],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().startswith("flushed")
        reader = open_while_writing(url, cache_bytes=1)
        checked = refreshes = batches = empty = 0
        seen_max = 0
        calls = []  # every refresh, also those sample() makes after a stale read
        refresh = reader.refresh
        reader.refresh = lambda: calls.append(refresh()) or calls[-1]
        while writer.poll() is None:
            batches += 1
            if batches % 7 == 0:
                refreshes += reader.refresh()
            try:
                batch = reader.sample(32)
            except dr.EmptyBufferError:  # the writer retired every row of the reader's commit
                empty += 1
                reader.refresh()
                continue
            assert_rows(batch, batch["index"])
            checked += len(batch["index"])
            seen_max = max(seen_max, int(batch["index"].max()))
        final = int(writer.stdout.read().split()[-1])
        reader.refresh()
        assert_rows(reader[reader.row_ids()], reader.row_ids())
        assert reader.row_ids().max() == final - 1
    finally:
        writer.kill()
        writer.wait()
    stale = len(calls) - batches // 7 - empty
    print(f"\nlive writer + reader ({compression}): {batches} batches, {checked} rows checked, {stale} stale reads "
          f"absorbed by sample, {refreshes} refreshes picked up commits, {empty} empty windows, writer reached "
          f"{final} rows")
    assert checked > 0 and refreshes > 0 and seen_max > 64


# ---- a resumed writer's patch of a committed row ---------------------------------------------

CUT_CODE = """
import os, signal, sys
import numpy as np
import diskreplay as dr
buf = dr.ReplayBuffer.open(sys.argv[1], "r+")
buf.add(obs=np.float32([100, -100]), next_obs=np.float32([101, -101]), reward=np.float32(100),
        terminated=False, truncated=False)  # closes the open episode at step 99, as truncated
buf.storage.writer.wait()  # the patched chunk reached the store: no commit names it
os.kill(os.getpid(), signal.SIGKILL)
"""
CUT_FIELDS = {"obs": dr.Field((2,), "float32"), "next_obs": dr.Field((2,), "float32"),
              "reward": dr.Field((), "float32"), "terminated": dr.Field((), "bool"),
              "truncated": dr.Field((), "bool")}


CUT_RULES_CODE = """
import numpy as np


def cut_rows(ids, ends=(29, 59)):
    \"\"\"Steps ``ids`` of a lane whose episodes end (terminated) at ``ends``; the one after is open.\"\"\"
    ids = np.asarray(ids)
    end = np.isin(ids, ends)
    nxt = np.where(end[:, None], -0.5, 1.0) * (ids + 1)[:, None] * np.float32([1, -1])
    return {"obs": (ids[:, None] * np.float32([1, -1])).astype(np.float32), "next_obs": nxt.astype(np.float32),
            "reward": ids.astype(np.float32), "terminated": end, "truncated": np.zeros(len(ids), bool)}


EVERY_THIRD = tuple(range(1, 450, 3))
"""
exec(CUT_RULES_CODE, namespace)
cut_rows, EVERY_THIRD = namespace["cut_rows"], namespace["EVERY_THIRD"]


def assert_cut_rows(got: dict, want: dict, what: str) -> None:
    for name in CUT_FIELDS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{what}: {name}")


def test_resumed_writer_killed_before_commit_never_shows_its_cut_flag(tmp_path):
    """Writer A commits 100 steps, its last episode open. Writer B reopens, adds a step (closing
    that episode as truncated: a patch of committed step 99 whose chunk B's background write
    stores) and is killed before any commit. Readers of A's commit read A's bytes exactly; the
    flag shows with the commit of the next writer that closes the episode."""
    url = str(tmp_path / "buf")
    a = dr.ReplayBuffer.create(url, CUT_FIELDS, chunk_rows=4, derive_next=("obs",))  # 100 steps: 25 whole chunks
    a.extend(cut_rows(np.arange(100)))
    a.flush()
    a.close()
    early = dr.ReplayBuffer.open(url)
    want = cut_rows(np.arange(100))
    assert_cut_rows(early[np.arange(100)], want, "before B")  # every chunk cached at A's commit
    b = subprocess.run([sys.executable, "-c", CUT_CODE, url], capture_output=True, text=True, timeout=60)
    assert b.returncode == -signal.SIGKILL, b.stderr
    late = dr.ReplayBuffer.open(url)
    np.testing.assert_array_equal(late.state_dict()["total"], [100])
    assert_cut_rows(late[np.arange(100)], want, "after B was killed")
    assert not early.refresh()
    assert_cut_rows(early[np.arange(100)], want, "cached")
    c = dr.ReplayBuffer.open(url, "r+")
    c.add(**{k: v[0] for k, v in cut_rows([100]).items()})
    c.flush()
    c.close()
    want["truncated"][99] = True
    for reader, what in ((early, "refreshed"), (late, "refreshed, opened after B")):
        assert reader.refresh()
        assert_cut_rows(reader[np.arange(100)], want, what)
    assert_cut_rows(dr.ReplayBuffer.open(url)[np.arange(100)], want, "opened after C")


SIDE_FIRST_CODE = CUT_RULES_CODE + """
import os, signal, sys
import diskreplay as dr
from diskreplay.storage.commit_log import CommitLog
buf = dr.ReplayBuffer.open(sys.argv[1], "r+")
buf.extend(cut_rows(np.arange(100, 150), EVERY_THIRD))
buf.flush()
buf.extend(cut_rows(np.arange(150, 450), EVERY_THIRD))
main, commit = buf.url, CommitLog.commit


def killed_at_main_commit(log, *args, **kwargs):
    if log.url == main:  # the side store of final observations has committed: die before the main commit
        os.kill(os.getpid(), signal.SIGKILL)
    return commit(log, *args, **kwargs)


CommitLog.commit = killed_at_main_commit
buf.flush()
"""
def test_reader_of_side_store_commit_ahead_of_main_commit_after_restart(tmp_path):
    """A writer is killed between the commit of its ``derive_next`` side store (100 new final
    observations) and its main commit. A reader opening then shows the main commit and caches
    final observations no main commit names; the next writer resumes from the main commit (its
    open episode cut at step 149) and writes those ordinals anew. The reader, refreshed, reads
    every row right, as a reader opened then does."""
    url = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(url, CUT_FIELDS, chunk_rows=16, derive_next=("obs",)) as a:
        a.extend(cut_rows(np.arange(100), EVERY_THIRD))
    killed = subprocess.run([sys.executable, "-c", SIDE_FIRST_CODE, url], capture_output=True, text=True, timeout=60)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    reader = dr.ReplayBuffer.open(url)
    want = cut_rows(np.arange(450), EVERY_THIRD)
    want["truncated"][99] = True  # the killed writer's cut, in its one main commit
    assert_cut_rows(reader[np.arange(150)], {k: v[:150] for k, v in want.items()}, "at the main commit")
    with dr.ReplayBuffer.open(url, "r+") as b:
        b.extend(cut_rows(np.arange(150, 450), EVERY_THIRD))
    want["truncated"][149] = True
    assert reader.refresh()
    assert_cut_rows(reader[np.arange(450)], want, "refreshed after the next writer's commit")
    assert_cut_rows(dr.ReplayBuffer.open(url)[np.arange(450)], want, "opened after the next writer's commit")
