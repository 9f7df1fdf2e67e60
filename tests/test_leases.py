"""Writer locks are leases: a writer that stops renewing (killed, paused, its host lost) is taken
over from any host once its lease has expired, and the commit record fences it: it can never
commit again. Real subprocesses (SIGSTOP / SIGCONT), on local disk and on a moto S3 server with
both S3 clients. No test measures time: leases are short and the tests wait for conditions."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import logged
from s3server import moto_server

import diskreplay as dr
from diskreplay.io import lock as drlock
from diskreplay.io import open_chunkstore
from diskreplay.storage import own_stores

FIELDS = {"obs": dr.Field((2,), "float32"), "done": dr.Field((), "bool")}
PATIENCE_S = 60.0  # a bound on waiting for a condition, never an assertion about time


def rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n)
    return {"obs": np.stack([i, -i], 1).astype(np.float32), "done": i % 4 == 3}


@pytest.fixture(params=["local", "s3fs", "obstore"])
def location(request, tmp_path, monkeypatch) -> tuple[str, dict[str, Any] | None]:
    """A new buffer's URL and storage options: local disk, or moto S3 through each client. This
    process is host 'host-b' (`DISKREPLAY_HOST_ID`)."""
    monkeypatch.setenv(drlock.HOST_ENV, "host-b")
    if request.param == "local":
        return str(tmp_path / "b"), None
    pytest.importorskip(request.param)
    monkeypatch.setenv("DISKREPLAY_S3_CLIENT", request.param)
    s3 = moto_server()
    return s3.new_url(), s3.storage_options()


def make(url: str, so: dict[str, Any] | None) -> None:
    with dr.ReplayBuffer.create(url, FIELDS, capacity=64, chunk_rows=8, storage_options=so) as buf:
        buf.extend(rows(20))


def wait_for(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + PATIENCE_S
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def holder(url: str, so: dict[str, Any] | None) -> drlock.LockInfo | None:
    return drlock.lock_holder(url, own_stores(url, so))


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return stat[stat.rfind(b")") + 2:][:1] == b"T"


WRITER = """
    import json, os, signal, sys, numpy as np, diskreplay as dr
    from diskreplay.storage.commit_log import CommitLog
    url, so, lease_s, pause_in_commit = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
    def rows(i):
        return {"obs": np.stack([i, -i], 1).astype(np.float32), "done": i % 4 == 3}
    buf = dr.ReplayBuffer.open(url, "r+", storage_options=so, lease_s=lease_s)
    buf.extend(rows(np.arange(100, 108)))
    buf.flush()
    buf.extend(rows(np.arange(108, 111)))  # staged: no chunk write in flight while it is paused
    print("ready", flush=True)
    sys.stdin.readline()
    if pause_in_commit:  # stop right after the commit's own lock check passed: the race fencing must close
        commit = CommitLog.commit
        def commit_then_stop(self, *args, **kwargs):
            check = self.check_lock
            def check_then_stop():
                check()
                os.kill(os.getpid(), signal.SIGSTOP)
            self.check_lock = check_then_stop
            return commit(self, *args, **kwargs)
        CommitLog.commit = commit_then_stop
    try:
        buf.flush()
        print("committed", flush=True)
    except dr.LockedError as exc:
        print("refused:", exc, flush=True)
    """


def start_writer(url: str, so: dict[str, Any] | None, lease_s: float,
                 pause_in_commit: bool = False) -> subprocess.Popen:
    env = {**os.environ, drlock.HOST_ENV: "host-a", "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), url, json.dumps(so), str(lease_s),
                             "1" if pause_in_commit else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def take_over(url: str, so: dict[str, Any] | None, writer: subprocess.Popen, caplog) -> dr.ReplayBuffer:
    """Wait until the paused writer's lease has expired, then open the buffer as its successor."""
    wait_for(lambda: holder(url, so).stale_reason(), "the paused writer's lease to expire")
    with logged(caplog, rf"took over the writer lock left by pid {writer.pid} on host 'host-a' since .*, its lease "
                        rf"expired .* ago \(its lease expired .* ago without a renewal\); its committed rows are "
                        rf"kept, its unflushed rows are lost"):
        successor = dr.ReplayBuffer.open(url, "r+", storage_options=so, lease_s=5)
    successor.extend(rows(5, 1000))
    successor.flush()
    return successor


def check_successor_rows_only(url: str, so: dict[str, Any] | None) -> None:
    with dr.ReplayBuffer.open(url, "r", storage_options=so) as reader:
        got = reader.rows(reader.row_ids())["obs"][:, 0]
        np.testing.assert_array_equal(got, np.concatenate([np.arange(20), np.arange(100, 108), np.arange(1000, 1005)]))


def finish(writer: subprocess.Popen) -> str:
    out, _ = writer.communicate(timeout=PATIENCE_S)
    return out


def test_paused_writer_is_taken_over_from_another_host_and_cannot_write(location, caplog):
    url, so = location
    make(url, so)
    writer = start_writer(url, so, lease_s=1)
    try:
        os.kill(writer.pid, signal.SIGSTOP)
        successor = take_over(url, so, writer, caplog)
        os.kill(writer.pid, signal.SIGCONT)
        writer.stdin.write("\n")
        writer.stdin.flush()
        out = finish(writer)
    finally:
        writer.kill()
    assert out.startswith(
        f"refused: {url!r}: this writer no longer holds the writer lock 'writer.lock' (it is now held by pid "
        f"{os.getpid()} on host 'host-b' since "), out
    check_successor_rows_only(url, so)
    successor.extend(rows(3, 2000))  # the successor goes on writing
    successor.close()
    with dr.ReplayBuffer.open(url, "r", storage_options=so) as reader:
        assert len(reader) == 36


def test_writer_paused_after_its_lock_check_cannot_commit(location, caplog):
    url, so = location
    make(url, so)
    writer = start_writer(url, so, lease_s=1, pause_in_commit=True)
    try:
        writer.stdin.write("\n")
        writer.stdin.flush()
        wait_for(lambda: stopped(writer.pid), "the writer to stop inside its commit")
        successor = take_over(url, so, writer, caplog)
        os.kill(writer.pid, signal.SIGCONT)
        out = finish(writer)
    finally:
        writer.kill()
    assert out.strip() == (
        f"refused: {url!r}: this writer's commit was refused: commit.json changed since its last commit (another "
        f"writer took the buffer over: this writer's lease expired or its lock was broken); it stopped writing so as "
        f"not to overwrite that writer's rows. Open the buffer again to write"), out
    check_successor_rows_only(url, so)
    successor.close()
    with dr.ReplayBuffer.open(url, "r+", storage_options=so) as again:  # the successor's commits are intact
        assert len(again) == 33


def test_live_holder_on_another_host_is_refused_naming_it_and_its_expiry(location):
    url, so = location
    make(url, so)
    writer = start_writer(url, so, lease_s=30)
    try:
        with pytest.raises(dr.LockedError, match=rf"is already open for writing by pid {writer.pid} on host 'host-a' "
                                                 rf"since .*, its lease expires in \d+\.\d s; a writer that stops "
                                                 rf"renewing its lease \(killed, crashed, paused, another machine\) "
                                                 rf"is taken over from any host once the lease has expired"):
            dr.ReplayBuffer.open(url, "r+", storage_options=so)
    finally:
        writer.kill()
        writer.wait()


def test_renewal_keeps_an_idle_writers_lease(location):
    url, so = location
    with dr.ReplayBuffer.create(url, FIELDS, capacity=64, chunk_rows=8, storage_options=so, lease_s=1) as buf:
        buf.extend(rows(4))
        first = holder(url, so)
        assert first is not None and first.expires is not None
        renewed = wait_for(lambda: (h := holder(url, so)) and h.expires > first.expires + 2 and h,
                           "three renewals of the idle writer's lease")
        assert renewed.token == first.token and renewed.host == "host-b" and renewed.stale_reason() is None
        child = subprocess.run([sys.executable, "-c", textwrap.dedent("""
            import json, sys, diskreplay as dr
            try:
                dr.ReplayBuffer.open(sys.argv[1], "r+", storage_options=json.loads(sys.argv[2]))
            except dr.LockedError as exc:
                print("refused:", exc)
            """), url, json.dumps(so)], capture_output=True, text=True, timeout=PATIENCE_S,
            env={**os.environ, drlock.HOST_ENV: "host-a", "PYTHONPATH": os.getcwd()})
        assert child.stdout.startswith(f"refused: {url!r} is already open for writing by pid {os.getpid()} on "
                                       f"host 'host-b'"), child
    assert holder(url, so) is None  # released on close


def test_killed_writer_on_another_host_is_taken_over_after_its_lease(location, caplog):
    url, so = location
    make(url, so)
    writer = start_writer(url, so, lease_s=1)
    writer.kill()
    writer.wait()
    successor = take_over(url, so, writer, caplog)
    successor.close()
    check_successor_rows_only(url, so)


def test_lease_s_is_checked_before_anything_is_written(tmp_path):
    url = str(tmp_path / "b")
    with pytest.raises(ValueError, match=r"lease_s: expected seconds in \[0.1, 86400\] \(or None: 30\), got 0"):
        dr.ReplayBuffer.create(url, FIELDS, capacity=64, lease_s=0)
    assert not os.path.exists(url)
    make(url, None)
    with pytest.raises(ValueError, match=r"lease_s: expected seconds .* got nan"):
        dr.ReplayBuffer.open(url, "r+", lease_s=float("nan"))
    assert holder(url, None) is None


def test_compare_and_swap_of_an_object(location):
    url, so = location
    store = open_chunkstore(url, so)
    first = store.put_if_version("k", b"one", None)
    assert first is not None
    assert store.put_if_version("k", b"other", None) is None  # it exists
    assert store.get_versioned("k") == (b"one", first)
    second = store.put_if_version("k", b"two", first)
    assert second is not None and second != first
    assert store.put_if_version("k", b"three", first) is None  # a stale version
    assert store.get("k") == b"two"
    assert store.put_if_version("k", b"two", first) == second  # our own write whose reply was lost
    assert store.get_versioned("missing") is None


def test_two_writers_taking_over_one_expired_lease_at_once_one_wins(location):
    url, so = location
    make(url, so)
    expired = {"pid": 4242, "host": "host-gone", "time": 1.0e9, "token": "x", "lease_s": 1.0, "expires": 1.0e9 + 1}
    assert open_chunkstore(url, so).put_if_version("diskreplay/objects/writer.lock", json.dumps(expired).encode(),
                                                   None) is not None
    code = textwrap.dedent("""
        import json, sys, diskreplay as dr
        try:
            buf = dr.ReplayBuffer.open(sys.argv[1], "r+", storage_options=json.loads(sys.argv[2]))
            print("opened", flush=True)
        except dr.LockedError as exc:
            print("refused:", exc, flush=True)
        sys.stdin.readline()
        """)
    procs = [subprocess.Popen([sys.executable, "-c", code, url, json.dumps(so)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, drlock.HOST_ENV: f"host-{n}", "PYTHONPATH": os.getcwd()})
             for n in "cd"]
    try:
        said = sorted(proc.stdout.readline().strip() for proc in procs)
    finally:
        for proc in procs:
            proc.communicate("\n", timeout=PATIENCE_S)
    assert said[0] == "opened" and said[1].startswith(f"refused: {url!r}"), said
    assert "host-gone" not in said[1] and re.search(r"by pid \d+ on host 'host-[cd]'", said[1]), said
