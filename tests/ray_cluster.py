"""A real Ray cluster of two nodes on 127.0.0.1 for the tests: a head and a worker node, each
started by ``ray start`` with one CPU, in a temp dir of their own, their workers importing this
checkout (and tests/). `RayCluster.stop` kills every process the two ``ray start`` runs left
(their process groups, then any process still naming the temp dir), so nothing leaks.

Fixture ``ray_cluster`` (one cluster per test session) yields it; ``ray_driver`` (per module)
connects this process to it and disconnects after the module, so that other modules may start
Ray in this process too.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 180
STARTS = 3
"""Clusters tried: the head's port is free when picked, but another process (another test
worker's cluster) may bind it before the head's GCS does."""
PORT_TAKEN = ("Failed to start the grpc server", "Address already in use")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RayCluster:
    """Two nodes, ``ray start``-ed; ``address`` is the head's GCS (``127.0.0.1:<port>``)."""

    def __init__(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="dr-ray-", dir="/tmp")  # short: Ray's socket paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.groups: list[int] = []
        # a token of its own: not ~/.ray/auth_token, which a local ray.init() elsewhere may have made
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.env = {**os.environ, **self.auth, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0",
                    "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}

    def start(self) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0", "--disable-usage-stats",
                  f"--object-store-memory={200 << 20}"]
        self._run([ray, "start", "--head", f"--port={self.port}", f"--temp-dir={self.temp}",
                   "--include-dashboard=false", *common])
        self._run([ray, "start", f"--address={self.address}", *common])

    def _run(self, argv: list[str]) -> None:
        """Runs ``ray start`` in a process group of its own: the daemons it leaves stay in it."""
        proc = subprocess.Popen(argv, env=self.env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        self.groups.append(proc.pid)
        out, _ = proc.communicate(timeout=STARTUP_S)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{out}")

    def stop(self) -> None:
        for group in self.groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in self._stragglers():  # a daemon that left the group: it still names our temp dir
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self._stragglers() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.temp, ignore_errors=True)

    def _stragglers(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                except OSError:
                    continue
                if self.temp.encode() in cmdline:
                    pids.append(int(entry))
        return pids


@pytest.fixture(scope="session")
def ray_cluster():
    pytest.importorskip("ray.data")
    cluster = started_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


def started_cluster() -> RayCluster:
    """A started `RayCluster`, on another port where the head's was taken meanwhile."""
    for attempt in range(STARTS):
        cluster = RayCluster()
        try:
            cluster.start()
            return cluster
        except RuntimeError as exc:
            cluster.stop()
            if attempt == STARTS - 1 or not any(why in str(exc) for why in PORT_TAKEN):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def ray_driver(ray_cluster):
    """This process connected to `ray_cluster` (``ray.init(address=...)``) for one test module."""
    import ray

    saved = {name: os.environ.get(name) for name in ray_cluster.auth}
    os.environ.update(ray_cluster.auth)
    auth_reread()
    try:
        ray.init(address=ray_cluster.address, _node_ip_address="127.0.0.1", log_to_driver=False)
        yield ray
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        auth_reread()


def auth_reread() -> None:
    """This process's Ray reads the token settings from the environment again (it caches them)."""
    try:
        from ray._private.authentication_test_utils import reset_auth_token_state
    except ImportError:  # a Ray without token authentication
        return
    reset_auth_token_state()
