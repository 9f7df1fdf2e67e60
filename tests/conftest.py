"""Shared fixtures and the reference model of a replay buffer used by the core tests.

`Model` is the plain-Python truth: a list of every row ever added, per lane, plus the committed
count per lane. Everything a `ReplayBuffer` returns is compared against it.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import signal
import sys
import time
import uuid
from concurrent.futures import Future
from typing import Any

import fsspec
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

import diskreplay as dr
from diskreplay.storage.write_behind import WriteBehind

# Where the environment turns bytecode caches off (PYTHONDONTWRITEBYTECODE), every process the tests
# start (CLI runs, killed writers, spawned workers) would compile the package again: ~0.3 s each.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

OWN = "diskreplay/objects/"
"""Where a buffer keeps its own objects (commit record, state, writer lock): docs/format.md, section 1."""


def writers(buf: dr.ReplayBuffer) -> list:
    """The `StagingWriter` of a writer's storage and of its ``derive_next`` side store."""
    return [storage.writer for storage in (buf.storage, buf._finals) if storage is not None and storage.writer]


def writes_done(buf: dr.ReplayBuffer) -> None:
    """Wait for the chunk writes in flight behind a writer's appends (on its background thread): a
    reader opened right after an append could find them half done. Starts no write (chunks sealed
    meanwhile wait for the writer's next call) and raises nothing (the next call raises a failure)."""
    for writer in writers(buf):
        writer.wait()


# A small schema touching several dtypes and ranks; `row_values` fills it from a row counter so
# every row ever added is distinguishable.
SMALL_FIELDS = {
    "obs": dr.Field((2,), "float32"),
    "act": dr.Field((), "int16"),
    "done": dr.Field((), "bool"),
    "img": dr.Field((2, 2), "uint8"),
}


def row_values(counter: int) -> dict[str, np.ndarray]:
    """The row with serial number ``counter`` (unique per counter in obs)."""
    c = int(counter)
    return {
        "obs": np.array([c, -0.5 * c], dtype=np.float32),
        "act": np.int16(c % 30000),
        "done": np.bool_(c % 3 == 0),
        "img": np.full((2, 2), c % 251, dtype=np.uint8) + np.eye(2, dtype=np.uint8),
    }


def min_cache(fields=SMALL_FIELDS, num_envs: int = 1, chunk_rows: int = 4) -> int:
    """The smallest ``cache_bytes`` a writer accepts: its staging, ``2 * num_envs + 2`` chunks."""
    return (2 * num_envs + 2) * chunk_rows * sum(f.row_bytes for f in fields.values())


def stack_rows(rows: list[dict[str, np.ndarray]], fields=SMALL_FIELDS) -> dict[str, np.ndarray]:
    if not rows:
        return {k: np.zeros((0, *f.shape), f.dtype) for k, f in fields.items()}
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in fields}


class Model:
    """Reference buffer: every row ever added per lane, the commit point and the lost-below floor."""

    def __init__(self, num_envs: int, capacity: int | None):
        self.num_envs = num_envs
        self.lane_cap = None if capacity is None else capacity // num_envs
        self.rows: list[list[dict]] = [[] for _ in range(num_envs)]
        self.committed = [0] * num_envs
        self.floor = [0] * num_envs  # steps below this were lost in a crash (ring only)
        self.counter = 0

    def next_rows(self, n: int) -> list[dict]:
        out = [row_values(self.counter + i) for i in range(n)]
        self.counter += n
        return out

    def append(self, lane: int, rows: list[dict]) -> None:
        self.rows[lane].extend(rows)

    def flush(self) -> None:
        self.committed = [len(r) for r in self.rows]

    def crash(self) -> None:
        """Unflushed rows are lost."""
        for lane in range(self.num_envs):
            del self.rows[lane][self.committed[lane]:]

    def window(self, lane: int, committed: bool = False) -> tuple[int, int]:
        hi = self.committed[lane] if committed else len(self.rows[lane])
        lo = 0 if self.lane_cap is None else max(0, hi - self.lane_cap)
        return min(max(lo, self.floor[lane]), hi), hi

    def readable_ids(self, committed: bool = False) -> np.ndarray:
        ids = [step * self.num_envs + lane
               for lane in range(self.num_envs)
               for step in range(*self.window(lane, committed))]
        return np.array(sorted(ids), dtype=np.int64)

    def row(self, row_id: int) -> dict:
        step, lane = divmod(int(row_id), self.num_envs)
        return self.rows[lane][step]

    def expected(self, ids) -> dict[str, np.ndarray]:
        return stack_rows([self.row(i) for i in np.asarray(ids).reshape(-1)])

    def __len__(self) -> int:
        return sum(hi - lo for lo, hi in (self.window(lane) for lane in range(self.num_envs)))


def assert_rows_equal(got: dict, want: dict, context: str = "") -> None:
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=f"{context} field {name!r}")
        assert np.asarray(got[name]).dtype == want[name].dtype, (context, name)


def check_buffer_against(buf: dr.ReplayBuffer, model: Model, committed: bool = False,
                         exact: bool = True) -> None:
    """Every readable id matches the model; ids outside the window raise IndexError.

    ``committed``: compare against the committed rows only (a reader). ``exact=False``: the buffer
    may expose fewer old rows than the model (a reader between commits, whose lower cursor was
    raised by the writer), but what it exposes must match and end at the commit point.
    """
    want_ids = model.readable_ids(committed)
    got_ids = np.sort(buf.row_ids())
    if exact:
        np.testing.assert_array_equal(got_ids, want_ids)
        assert len(buf) == len(want_ids)
    else:
        assert set(got_ids.tolist()) <= set(want_ids.tolist())
        assert len(buf) == len(got_ids)
    if len(got_ids):
        assert_rows_equal(buf[got_ids], model.expected(got_ids), "buf[ids]")
    # ids that must not be readable: negative, future, overwritten
    bad = [-1, -model.num_envs - 1]
    for lane in range(model.num_envs):
        lo, hi = model.window(lane, committed)
        bad.append(hi * model.num_envs + lane)
        if lo > 0:
            bad.append((lo - 1) * model.num_envs + lane)
    for row_id in bad:
        with pytest.raises(IndexError):
            buf[[row_id]]
    if len(got_ids):
        batch = buf.sample(16, seed=len(got_ids))
        assert batch["index"].dtype == np.int64
        assert set(batch["index"].tolist()) <= set(got_ids.tolist())
        assert_rows_equal(batch, model.expected(batch["index"]), "sample")


@pytest.fixture(autouse=True, scope="session")
def sb3_logger_folder(tmp_path_factory):
    """Stable-Baselines3's `learn` makes a folder for its logger (tempdir/SB3-<time>, left
    behind) unless ``SB3_LOGDIR`` names one: the session's own, removed with its temp files."""
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3-logs"))


@pytest.fixture
def no_fsync(monkeypatch):
    """Skip fsync: durability is not observable inside one process, and on a busy disk each
    commit's fsyncs cost milliseconds. Opt in with ``pytestmark = pytest.mark.usefixtures("no_fsync")``."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.fixture
def lagging_writes(monkeypatch):
    """A store always slower than the appends: a writer's background chunk writes (`WriteBehind`)
    run only when the writer waits for them, so what it does while a batch is in flight is the
    same on every machine, however fast its disk."""
    finish, pending = WriteBehind.finish, {}

    def start(behind, chunks, write):
        job = Future()
        pending[id(job)] = write
        behind.in_flight, behind._job = chunks, job

    def finish_when_waited(behind, wait):
        job = behind._job
        if wait and job is not None and not job.done():
            try:
                pending.pop(id(job))()
            except BaseException as exc:
                job.set_exception(exc)
            else:
                job.set_result(None)
        return finish(behind, wait)

    monkeypatch.setattr(WriteBehind, "start", start)
    monkeypatch.setattr(WriteBehind, "finish", finish_when_waited)


@pytest.fixture
def memory_url():
    """A fresh memory:// URL, removed from the process-wide memory filesystem afterwards."""
    name = f"diskreplay-test-{uuid.uuid4().hex}"
    url = f"memory://{name}"
    yield url
    fs = fsspec.filesystem("memory")
    if any(path.endswith("writer.lock") for path in fs.find(f"/{name}")):
        gc.collect()  # unclosed writers release their locks now, not mid-way through rm
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    """A buffer location: a local directory path or a memory:// URL."""
    if request.param == "local":
        yield os.fspath(tmp_path / "buf")
        return
    yield request.getfixturevalue("memory_url")


def dir_snapshot(path: str) -> dict[str, bytes]:
    """Every file under a local directory, by relative path, with its bytes (a symbolic link
    that leads to no directory: ``b"-> "`` and its target)."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if os.path.islink(full):
                out[os.path.relpath(full, path)] = b"-> " + os.fsencode(os.readlink(full))
                continue
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def exit_code_in_fork(child, timeout_s: float = 30.0) -> int:
    """Fork; the child exits 0 if ``child()`` returns True, else 1. The parent returns that code,
    or fails the test (killing the child) when it has not exited within ``timeout_s``: the guard
    against a child that waits forever."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if child() else 1
        finally:
            os._exit(code)
    for _ in range(int(timeout_s / 0.05)):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child did not finish in {timeout_s:.0f} s")


@contextlib.contextmanager
def logged(caplog, pattern: str, level: int = logging.WARNING):
    """Assert that the block logs a record matching ``pattern`` at ``level`` under "diskreplay"."""
    caplog.clear()
    with caplog.at_level(level, logger="diskreplay"):
        yield
    found = [r.getMessage() for r in caplog.records if r.name.startswith("diskreplay") and r.levelno == level]
    assert any(re.search(pattern, m) for m in found), f"no log record matching {pattern!r} in {found}"


# Hypothesis profiles of the model-based test (tests/test_model.py): "fast" in everyday runs and
# the fast subset, "ci" (many more examples) where CI=true. HYPOTHESIS_PROFILE names either one.
# The example database stays hypothesis's default (.hypothesis/examples), so that a failure found
# once is replayed first by the next run. Other tests keep their own settings.
_MODEL_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                       report_multiple_bugs=False, phases=[p for p in Phase if p is not Phase.explain])
settings.register_profile("fast", max_examples=60, stateful_step_count=30, **_MODEL_SETTINGS)
settings.register_profile("ci", max_examples=500, stateful_step_count=50, **_MODEL_SETTINGS)
# Every other property test: no deadline either. A test asserts what the code did, never how long it
# took (hypothesis's default 200 ms deadline failed a 0.3 ms example that a busy machine delayed).
settings.register_profile("untimed", deadline=None)
settings.load_profile("untimed")


def model_test_settings() -> settings:
    """The settings of the model-based test: ``HYPOTHESIS_PROFILE``'s profile, else "ci" where
    ``CI=true``, else "fast"."""
    name = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI", "").lower() == "true" else "fast")
    return settings.get_profile(name)


SLOW_MODULES = frozenset({"test_cli", "test_concurrency", "test_crash", "test_device", "test_examples", "test_faults",
                          "test_lock", "test_docs", "test_s3", "test_s3_faults", "test_torch_data",
                          "test_worker_ring"})
"""Modules of subprocesses, S3 servers, DataLoader workers and kills: ``-m "not slow"`` leaves them out."""
SLOW_TESTS = frozenset({"test_random_ops_match_reference_model", "test_frame_stack_matches_reference",
                        "test_updates_match_numpy_reference", "test_nstep_matches_reference",
                        "test_episodes_table_matches_reference", "test_episode_index_matches_reference",
                        "test_find_prefix_sum_exact_on_integer_priorities", "test_import_memory_is_bounded",
                        "test_nstep_with_prioritized_sampler", "test_frame_stack_next_step",
                        "test_her_relabels_from_same_episode"})
"""Long randomized comparisons against reference models, also left out by ``-m "not slow"``."""


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES or item.originalname in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def same_state(a: Any, b: Any) -> bool:
    """Whether two saved states (nested dicts, lists and arrays) are equal, dtypes included."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same_state, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b
