"""The writer lock: one writer per buffer, any number of readers; stale locks are explained and
can be broken explicitly. Local disk and a real (moto) S3 server."""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import OWN, logged
from s3server import s3, s3_client

import diskreplay as dr
from diskreplay.io import lock as drlock
from diskreplay.io import open_chunkstore
from diskreplay.storage import Options, open_storage, own_stores

FIELDS = {"obs": dr.Field((2,), "float32"), "done": dr.Field((), "bool")}

buffer_threads_break_lock = pytest.mark.skipif(
    "break_lock" not in inspect.signature(dr.ReplayBuffer.open).parameters,
    reason="ReplayBuffer.open/create do not take break_lock yet")


def rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n)
    return {"obs": np.stack([i, -i], 1).astype(np.float32), "done": i % 4 == 3}


def make(url, **kw) -> dr.ReplayBuffer:
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=64, chunk_rows=8, **kw)
    buf.extend(rows(20))
    buf.flush()
    return buf


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=60)


def test_second_writer_is_refused_and_readers_are_not(tmp_path):
    url = str(tmp_path / "b")
    writer = make(url)
    for attempt in (lambda: dr.ReplayBuffer.open(url, "r+"),
                    lambda: open_storage(url, "r+", Options(cache_bytes=1 << 20, io_threads=1))):
        with pytest.raises(dr.LockedError, match=r"already open for writing by this process on host") as err:
            attempt()
        assert "break_lock=True" in str(err.value) and f"diskreplay unlock {url}" in str(err.value)
    reader = dr.ReplayBuffer.open(url, "r")  # readers never take the lock
    assert len(reader) == 20
    reader.close()
    writer.close()
    assert not os.path.exists(os.path.join(url, OWN, drlock.LOCK_KEY))
    again = dr.ReplayBuffer.open(url, "r+")  # released on close
    again.extend(rows(3, 20))
    again.close()
    assert len(dr.ReplayBuffer.open(url)) == 23


def test_lock_file_records_the_holder(tmp_path):
    url = str(tmp_path / "b")
    buf = make(url)
    info = json.loads(open(os.path.join(url, OWN, drlock.LOCK_KEY)).read())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert isinstance(info["time"], float) and info["token"]
    holder = drlock.lock_holder(url, own_stores(url))
    assert holder.pid == os.getpid() and holder.stale_reason() is None
    buf.close()
    assert drlock.lock_holder(url, own_stores(url)) is None


def test_killed_writer_leaves_a_stale_lock_that_the_next_writer_takes_over(tmp_path, caplog):
    url = str(tmp_path / "b")
    make(url).close()
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, signal, sys, numpy as np, diskreplay as dr
        buf = dr.ReplayBuffer.open(sys.argv[1], "r+")
        print("locked", flush=True)
        sys.stdin.readline()
        """), url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(dr.LockedError, match=rf"pid {proc.pid} on host .*its lease expires in .* s; "
                                                     r"a writer that stops renewing its lease"):
            dr.ReplayBuffer.open(url, "r+")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    holder = drlock.lock_holder(url, own_stores(url))
    assert holder.stale_reason() == f"process {proc.pid} is no longer running on this host"
    with logged(caplog, rf"took over the writer lock left by pid {proc.pid} .*no longer running "
                                         r"on this host.*unflushed rows are lost"):
        buf = dr.ReplayBuffer.open(url, "r+")
    assert len(buf) == 20
    buf.close()
    assert drlock.lock_holder(url, own_stores(url)) is None


def test_storage_break_lock_takes_over(tmp_path):
    url = str(tmp_path / "b")
    first = make(url)
    second = open_storage(url, "r+", Options(cache_bytes=1 << 20, io_threads=1, break_lock=True))
    assert drlock.lock_holder(url, own_stores(url)).token == second._log.lock.token
    with pytest.raises(dr.LockedError, match=r"this writer no longer holds the writer lock 'writer.lock' \(it is now "
                                             r"held by this process .*it stopped writing"):
        first.close()  # the broken writer must neither commit nor delete its successor's lock
    assert first.closed
    assert drlock.lock_holder(url, own_stores(url)).token == second._log.lock.token
    second.close()
    assert drlock.lock_holder(url, own_stores(url)) is None


@buffer_threads_break_lock
def test_buffer_break_lock(tmp_path):
    url = str(tmp_path / "b")
    first = make(url)
    second = dr.ReplayBuffer.open(url, "r+", break_lock=True)
    second.close()
    first.storage.close()


def test_create_overwrite_does_not_destroy_a_locked_buffer(tmp_path):
    url = str(tmp_path / "b")
    buf = make(url)
    with pytest.raises(dr.LockedError):
        dr.ReplayBuffer.create(url, FIELDS, capacity=64, overwrite=True)
    assert len(dr.ReplayBuffer.open(url)) == 20
    buf.close()


def test_reused_pid_is_stale_and_taken_over(tmp_path, caplog):
    url = str(tmp_path / "b")
    make(url).close()
    fake = {"pid": os.getpid(), "host": socket.gethostname(), "time": 1.0e9, "token": "x", "start_ticks": -5}
    open_chunkstore(url).put(OWN + drlock.LOCK_KEY, json.dumps(fake).encode())
    assert drlock.lock_holder(url, own_stores(url)).stale_reason() == (
        f"pid {os.getpid()} now belongs to another process (the holder exited)")
    with logged(caplog, r"took over the writer lock left by this process .* now belongs to another"):
        buf = dr.ReplayBuffer.open(url, "r+")
    assert drlock.lock_holder(url, own_stores(url)).token == buf.storage._log.lock.token
    buf.close()


def test_lock_of_another_host_is_not_called_stale(tmp_path):
    url = str(tmp_path / "b")
    make(url).close()
    fake = {"pid": 1, "host": "some-other-machine", "time": 1.0e9, "token": "x"}
    open_chunkstore(url).put(OWN + drlock.LOCK_KEY, json.dumps(fake).encode())
    with pytest.raises(dr.LockedError, match=r"pid 1 on host 'some-other-machine' since 2001-.*days ago; "
                                             r"if that writer is gone"):
        dr.ReplayBuffer.open(url, "r+")


def test_unreadable_lock_still_refuses(tmp_path):
    url = str(tmp_path / "b")
    make(url).close()
    open_chunkstore(url).put(OWN + drlock.LOCK_KEY, b"\x00garbage")
    with pytest.raises(dr.LockedError, match="unreadable lock object"):
        dr.ReplayBuffer.open(url, "r+")
    drlock.break_lock(url, own_stores(url))
    dr.ReplayBuffer.open(url, "r+").close()


def test_unclosed_writer_releases_at_exit(tmp_path):
    url = str(tmp_path / "b")
    make(url).close()
    done = run_python("""
        import sys, numpy as np, diskreplay as dr
        buf = dr.ReplayBuffer.open(sys.argv[1], "r+")
        buf.extend({"obs": np.zeros((2, 2), np.float32), "done": np.zeros(2, bool)})
        """, url)  # exits without close()
    assert done.returncode == 0, done.stderr
    assert drlock.lock_holder(url, own_stores(url)) is None
    dr.ReplayBuffer.open(url, "r+").close()


def test_check_unlocked(tmp_path):
    url = str(tmp_path / "b")
    buf = make(url)
    with pytest.raises(dr.LockedError):
        drlock.check_unlocked(url, own_stores(url))
    drlock.check_unlocked(url, own_stores(url), break_lock=True)
    assert drlock.lock_holder(url, own_stores(url)) is None
    buf.storage.close()


def test_s3_conditional_put_and_second_writer(s3, s3_client):
    url = s3.new_url()
    so = s3.storage_options()
    store = open_chunkstore(url, so)
    assert store.put_if_absent("probe", b"a") is True
    assert store.put_if_absent("probe", b"b") is False  # If-None-Match: * honoured
    assert store.get("probe") == b"a"
    buf = make(url, storage_options=so)
    with pytest.raises(dr.LockedError, match=r"already open for writing by this process"):
        dr.ReplayBuffer.open(url, "r+", storage_options=so)
    reader = dr.ReplayBuffer.open(url, "r", storage_options=so)
    assert len(reader) == 20
    buf.close()
    assert drlock.lock_holder(url, own_stores(url, so)) is None
    buf = dr.ReplayBuffer.open(url, "r+", storage_options=so)
    buf.close()


def test_s3_lock_across_processes(s3, s3_client):
    url = s3.new_url()
    so = s3.storage_options()
    holder = make(url, storage_options=so)
    child = run_python("""
        import json, sys, diskreplay as dr
        try:
            dr.ReplayBuffer.open(sys.argv[1], "r+", storage_options=json.loads(sys.argv[2]))
        except dr.LockedError as exc:
            print("refused:", exc)
        """, url, json.dumps(so))
    assert f"refused: {url!r} is already open for writing by pid {os.getpid()}" in child.stdout, child
    holder.close()
    assert drlock.lock_holder(url, own_stores(url, so)) is None
