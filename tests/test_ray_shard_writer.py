"""`diskreplay.ray.ShardWriter` on a real two-node Ray cluster (tests/ray_cluster.py): an actor
that owns one shard, whose worker process is SIGKILLed (as Ray does after a node loss), is
restarted by Ray and reopens its shard, keeping exactly the rows it committed before. Writers
"on another host" are subprocesses with their own ``DISKREPLAY_HOST_ID``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray.data")
import ray
from ray_cluster import ray_cluster, ray_driver

import diskreplay as dr
from diskreplay.errors import LockedError
from diskreplay.io import lock as drlock
from diskreplay.ray import ShardWriter, start_shard_writer
from diskreplay.ray.shard_writer import open_shard_patiently

SPEC: dict[str, Any] = {"fields": {"obs": dr.Field((), "int64"), "done": dr.Field((), "bool")}, "shards": 2,
                        "capacity": None}
HOLDER = """
    import sys
    import numpy as np
    import diskreplay as dr
    w = dr.ReplayBuffer.open_shard(sys.argv[1], 0, lease_s=float(sys.argv[2]))
    w.extend({"obs": np.arange(5), "done": np.zeros(5, bool)})
    w.flush()
    print("ready", flush=True)
    sys.stdin.read()
    w.close()
"""


def steps(obs: np.ndarray) -> dict[str, np.ndarray]:
    return {"obs": obs, "done": np.zeros(len(obs), bool)}


def learner_obs(url: str) -> list[int]:
    """Every row the learner (a reader of the union) sees, in row-id order."""
    with dr.ReplayBuffer.open(url, "r") as buf:
        return [int(x) for x in buf[buf.row_ids()]["obs"]]


def restarted_pid(writer: Any, old_pid: int) -> int:
    """The pid of ``writer``'s process once Ray restarted it (calls fail while it is dead)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            pid = int(ray.get(writer.pid.remote(), timeout=30))
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.2)
            continue
        if pid != old_pid:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"the actor of process {old_pid} was not restarted")


def start_holder(url: str, host: str, lease_s: float = 1) -> subprocess.Popen:
    """A writer of shard 0 on host ``host`` that committed obs 0..4 and keeps its shard open."""
    env = {**os.environ, drlock.HOST_ENV: host, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), url, str(lease_s)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_killed_writer_is_restarted_by_ray_and_keeps_its_committed_rows(ray_driver, tmp_path):
    url = str(tmp_path / "buf")
    writer = ShardWriter.options(max_restarts=2).remote(url, 0, create=SPEC, lease_s=2)
    ray.get(writer.extend.remote(steps(np.arange(10))))
    assert ray.get(writer.flush.remote()) == 10
    ray.get(writer.add.remote(obs=10, done=False))   # staged, never committed: lost with the process
    assert ray.get(writer.rows.remote()) == 11
    pid = ray.get(writer.pid.remote())
    os.kill(pid, signal.SIGKILL)

    restarted_pid(writer, pid)
    assert ray.get(writer.committed.remote()) == 10
    assert ray.get(writer.rows.remote()) == 10
    ray.get(writer.extend.remote(steps(np.arange(100, 105))))
    assert ray.get(writer.flush.remote()) == 15
    assert learner_obs(url) == [*range(10), *range(100, 105)]
    ray.get(writer.close.remote())
    with dr.ReplayBuffer.open(url, "r") as buf:  # the episode the kill cut ends at step 9 (truncated)
        episodes = buf.episodes()
        assert [int(x) for x in episodes.length] == [10, 5]
        assert [bool(x) for x in episodes.complete] == [True, False]


def test_restart_on_a_new_host_takes_over_a_dead_writers_lease(ray_driver, tmp_path):
    url = str(tmp_path / "buf")
    dr.ReplayBuffer.create(url, **SPEC).close()
    holder = start_holder(url, "host-gone")
    holder.kill()
    holder.wait()
    writer = start_shard_writer(url, 0, create=SPEC, lease_s=1)   # waits for the dead writer's lease to expire
    assert ray.get(writer.committed.remote()) == 5         # the existing buffer was not recreated
    ray.get(writer.extend.remote(steps(np.arange(20, 23))))
    assert ray.get(writer.flush.remote()) == 8
    assert learner_obs(url) == [0, 1, 2, 3, 4, 20, 21, 22]
    ray.get(writer.close.remote())


def test_live_writer_on_another_host_makes_the_open_fail_after_lease_plus_grace(ray_driver, tmp_path):
    url = str(tmp_path / "buf")
    dr.ReplayBuffer.create(url, **SPEC).close()
    holder = start_holder(url, "host-alive", lease_s=30)  # renewed every 10 s: held past the 2 opens of 6 s
    try:
        writer = start_shard_writer(url, 0, lease_s=1, max_restarts=1)
        with pytest.raises(ray.exceptions.RayActorError,
                           match=r"(?s)LockedError.*shard 0 of .*: its writer lock is still held after "
                                 r"lease_s \+ 5 s = 6 s of retries.*host 'host-alive'"):
            ray.get(writer.rows.remote())
    finally:
        holder.communicate("")
    assert learner_obs(url) == [0, 1, 2, 3, 4]


def test_open_is_retried_until_a_dead_writers_lease_expires(tmp_path):
    url = str(tmp_path / "buf")
    dr.ReplayBuffer.create(url, **SPEC).close()
    holder = start_holder(url, "host-gone", lease_s=4)
    holder.kill()
    holder.wait()
    with pytest.raises(LockedError, match="host 'host-gone'.*its lease expires in"):  # not yet expired
        dr.ReplayBuffer.open_shard(url, 0, lease_s=4)
    with open_shard_patiently(url, 0, 4.0, {}) as writer:   # retried until the lease expired
        assert len(writer) == 5
        writer.extend(steps(np.arange(7, 9)))
    assert learner_obs(url) == [0, 1, 2, 3, 4, 7, 8]
