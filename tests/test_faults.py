"""Failed writes with real parts: a full disk (a real, small tmpfs) and an S3 server behind a
fault-injecting HTTP proxy (issue #11, items 1 and 7).

What every test here proves about a call that fails (`extend`, `add`, `flush`, `open`):

- it raises the real error (``OSError`` ENOSPC from the filesystem, `StoreUnavailableError` from
  the retry layer; never `NotABufferError` for an unreachable store);
- the writer is as before the call: ``state_dict()["total"]``, ``len(buf)`` and the readable
  row ids are unchanged, except that a ring may retire the oldest rows the call would have
  overwritten (fewer old rows, never wrong ones); a fresh reader sees exactly the last commit
  (in a ring, possibly with a raised first step); no ``*.partial`` temp file is left behind;
- once the fault is gone the same writer object goes on: the same call again gets the row ids
  it would have got without the failure, a flush commits, `verify` passes, and every row equals
  ``f(row id)`` (or, with derived fields, a plain-Python reference).

Disk full: as root, a small tmpfs (2 MiB) is mounted per test and filled with a filler file,
leaving 0, 1, 2, ... free pages before each try of the same call until it fits (`FREE_PAGES`);
the failure points of the call (retire commit, whole chunks, sealed chunks, tail chunks, state
object, array metadata, commit) are hit on the way. Without permission to mount, a wrapper
around `LocalChunkStore`'s writes raises ENOSPC after a byte budget instead; test ids say which
one ran ("tmpfs" or "wrapper"), and `test_disk_full_wrapper_fallback` always runs the wrapper so
the fallback is known to work. One variant adds ``derive_next``, ``episodic_return`` and a
prioritized sampler, checked against a plain-Python `Reference`.

S3: a moto server behind `FaultProxy` (real HTTP): chunk PUTs, the commit PUT and a full
ring's retire commit answered 503; an endpoint that never answers during a flush (the
``retry=`` policy's ``budget_s`` is a deadline); ``open()`` with 503s on each metadata object.

No test measures time; calls that could hang run on a thread joined for `SAFETY_S` seconds so a
regression fails instead of hanging. A module-level tally of faults injected and survived (the
writer recovered and `verify` passed afterwards) is printed at the end (``pytest -s``).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import subprocess
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import OWN, writers, writes_done
from s3server import SAFETY_S, FaultProxy, outcome, proxy_options, s3, s3_client

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.format.journal import JOURNAL_MARK, JournalRef
from diskreplay.io import LocalChunkStore, open_chunkstore

CHUNK = 8
LANE_CAP = 48  # ring: 6 chunks per lane
PAGE = 4096
DISK_BYTES = 2 * 2**20
ENOSPC_MESSAGE = os.strerror(errno.ENOSPC)

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int64"),
          "done": dr.Field((), "bool"), "img": dr.Field((2, 2), "uint8")}


# ---- rows derived from row ids -------------------------------------------------------------


def f(ids) -> dict[str, np.ndarray]:
    """The row with id ``i`` holds f(i) in every field (as in tests/test_crash.py)."""
    ids = np.asarray(ids, dtype=np.int64)
    return {"obs": np.stack([ids, ids + 0.25, -ids], -1).astype(np.float32), "act": ids,
            "done": ids % 7 == 3,
            "img": np.broadcast_to((ids % 251).astype(np.uint8)[..., None, None], ids.shape + (2, 2)).copy()}


def step_ids(first: int, n: int, lanes: int) -> np.ndarray:
    """Row ids of steps ``first..first+n`` of every lane, time-major ``(n, lanes)``."""
    return np.arange(first, first + n)[:, None] * lanes + np.arange(lanes)


def steps(first: int, n: int, lanes: int, rows: Callable = f) -> dict[str, np.ndarray]:
    """What `extend` takes for those steps: ``(n, ...)`` with one lane, ``(n, lanes, ...)`` else."""
    ids = step_ids(first, n, lanes)
    return rows(ids if lanes > 1 else ids[:, 0])


def one_step(first: int, lanes: int, rows: Callable = f) -> dict[str, np.ndarray]:
    """What `add` takes for step ``first`` of every lane."""
    return {k: v[0] for k, v in steps(first, 1, lanes, rows).items()}


def assert_rows(got: dict, ids, rows: Callable = f, names=None) -> None:
    want = rows(np.asarray(ids))
    for name in names or want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"field {name!r}")
        assert np.asarray(got[name]).dtype == want[name].dtype, name


# ---- what the writer and a reader see ------------------------------------------------------


def windows(ids: np.ndarray, lanes: int, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per lane, the readable steps ``[lo, hi)`` behind a set of row ids (which must be one
    contiguous run per lane); an empty lane is ``[total, total)``."""
    lo, hi = total.copy(), total.copy()
    for lane in range(lanes):
        own = np.sort(ids[ids % lanes == lane] // lanes)
        if len(own):
            np.testing.assert_array_equal(own, np.arange(own[0], own[-1] + 1), err_msg=f"lane {lane} has a gap")
            lo[lane], hi[lane] = own[0], own[-1] + 1
    return lo, hi


@dataclass
class View:
    """What the writer and a fresh reader see, and the stored commit record."""

    total: np.ndarray
    length: int
    ids: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    reader_ids: np.ndarray
    reader_lo: np.ndarray
    reader_hi: np.ndarray
    commit: bytes


def committed_record(url: str, so: dict | None) -> bytes:
    blob = open_chunkstore(url, so).get(OWN + "commit.json")
    assert blob is not None
    return blob


def look(buf: dr.ReplayBuffer, so: dict | None = None, rows: Callable = f) -> View:
    """The writer's and a fresh reader's view, every readable row checked against ``rows``."""
    writes_done(buf)  # a reader opened meanwhile would race the chunk writes behind the last call
    lanes = buf.num_envs
    total = buf.state_dict()["total"]
    ids = buf.row_ids()
    lo, hi = windows(ids, lanes, total)
    np.testing.assert_array_equal(hi, total)
    assert len(buf) == len(ids) == int((hi - lo).sum())
    if len(ids):
        assert_rows(buf[ids], ids, rows)
    with dr.ReplayBuffer.open(buf.url, "r", storage_options=so) as reader:
        reader_total = reader.state_dict()["total"]
        reader_ids = reader.row_ids()
        reader_lo, reader_hi = windows(reader_ids, lanes, reader_total)
        if len(reader_ids):
            assert_rows(reader[reader_ids], reader_ids, rows)
    return View(total, len(buf), ids, lo, hi, reader_ids, reader_lo, reader_hi, committed_record(buf.url, so))


def partial_files(url: str) -> list[str]:
    if "://" in url:
        return []
    return sorted(os.path.relpath(os.path.join(root, name), url)
                  for root, _, names in os.walk(url) for name in names if name.endswith(".partial"))


def check_failed_call(buf: dr.ReplayBuffer, before: View, start: np.ndarray, count: int,
                      so: dict | None = None, rows: Callable = f) -> View:
    """A call that tried to add steps ``[start, start + count)`` per lane (``count=0``: a flush)
    failed: the writer is as before, a reader sees the last commit, nothing is left half-written.

    A ring may have retired the oldest rows the call would have overwritten: its first readable
    step may rise, at most to ``min(start + count - capacity, start)``, and a reader's at most to
    the writer's; nothing else may change."""
    after = look(buf, so, rows)
    np.testing.assert_array_equal(after.total, before.total)
    np.testing.assert_array_equal(after.hi, before.hi)
    np.testing.assert_array_equal(after.reader_hi, before.reader_hi)
    if buf.capacity is None:  # dataset mode: nothing may change at all
        assert after.length == before.length
        np.testing.assert_array_equal(after.ids, before.ids)
        np.testing.assert_array_equal(after.reader_ids, before.reader_ids)
        assert after.commit == before.commit
    else:
        cap = buf.capacity // buf.num_envs
        bound = np.maximum(before.lo, np.minimum(start + count - cap, start)) if count else before.lo
        assert (before.lo <= after.lo).all() and (after.lo <= bound).all(), (before.lo, after.lo, bound)
        assert (before.reader_lo <= after.reader_lo).all(), (before.reader_lo, after.reader_lo)
        assert (after.reader_lo <= np.maximum(after.lo, before.reader_lo)).all(), (after.reader_lo, after.lo)
        assert after.length == before.length - int((after.lo - before.lo).sum())
    assert partial_files(buf.url) == []
    return after


def check_recovered(buf: dr.ReplayBuffer, steps_per_lane: int, so: dict | None = None,
                    rows: Callable = f) -> None:
    """After the faults: flush, then writer, a reader and `verify` agree with the reference:
    every lane holds ``steps_per_lane`` steps, the newest ``capacity`` of them in a ring."""
    lanes = buf.num_envs
    buf.flush()
    cap = None if buf.capacity is None else buf.capacity // lanes
    lo = 0 if cap is None else max(0, steps_per_lane - cap)
    want = np.sort(step_ids(lo, steps_per_lane - lo, lanes).reshape(-1))
    view = look(buf, so, rows)
    np.testing.assert_array_equal(view.total, [steps_per_lane] * lanes)
    np.testing.assert_array_equal(np.sort(view.ids), want)
    np.testing.assert_array_equal(np.sort(view.reader_ids), want)
    report = verify(buf.url, so)
    assert report.ok, str(report)
    assert report.rows == len(want)
    assert not any("orphaned" in note for note in report.notes), report.notes
    assert partial_files(buf.url) == []
    stored_states = sorted(k.removeprefix(OWN) for k in stored_keys(buf.url, so) if k.startswith(OWN + "state/"))
    assert stored_states == named_state_keys(view.commit), stored_states  # failed flushes' objects collected


def named_state_keys(commit: bytes) -> list[str]:
    """The state object and every journal object a commit record names."""
    record = json.loads(commit)
    keys = [record["extra"]["state_arrays"]] if record["extra"].get("state_arrays") else []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict) and set(value) == {JOURNAL_MARK}:
            keys.extend(JournalRef.from_json(path, value[JOURNAL_MARK], record["sequence"]).keys())
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}" if path else key)
    walk(record["extra"].get("state") or {}, "")
    return sorted(keys)


def stored_keys(url: str, so: dict | None) -> list[str]:
    if "://" not in url:
        return [os.path.relpath(os.path.join(root, name), url) for root, _, names in os.walk(url) for name in names]
    return sorted(open_chunkstore(url, so).sizes())


# ---- the tally of faults ---------------------------------------------------------------------

TALLY: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def fault_tally():
    """Prints one summary line after this module's tests (shown with ``pytest -s``)."""
    yield TALLY
    kinds = {"disk full": f"calls failed on a full disk ({DISK_KIND})", "S3 HTTP error": "S3 HTTP 503 answers",
             "S3 request held": "S3 request(s) never answered"}
    detail = ", ".join(f"{TALLY['injected:' + k]} {text}" for k, text in kinds.items() if TALLY["injected:" + k])
    print(f"\nfaults: {TALLY['injected']} injected, {TALLY['survived']} survived ({detail})")


class Faults:
    """One test's injected faults; `survived` once the writer recovered and `verify` passed."""

    def __init__(self):
        self.count = 0

    def injected(self, kind: str, n: int = 1) -> None:
        self.count += n
        TALLY["injected"] += n
        TALLY["injected:" + kind] += n

    def survived(self) -> None:
        assert self.count > 0, "no fault was injected"
        TALLY["survived"] += self.count
        self.count = 0


@pytest.fixture
def faults() -> Faults:
    return Faults()


@pytest.fixture
def opened():
    """Buffers a test opens, closed at teardown also when the test fails. (An unclosed writer
    releases its lock from a finalizer at garbage collection, on whatever thread collects: on a
    thread of the in-process S3 server, that request waits on the server itself.)"""
    buffers: list[dr.ReplayBuffer] = []
    yield buffers
    for buf in reversed(buffers):
        try:
            buf.close()
        except Exception:
            pass


# ---- a small disk that fills up --------------------------------------------------------------


def _can_mount_tmpfs() -> bool:
    if os.geteuid() != 0:
        return False
    point = tempfile.mkdtemp(prefix="diskreplay-mount-probe-")
    try:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", point],
                          capture_output=True).returncode != 0:
            return False
        subprocess.run(["umount", point], check=True, capture_output=True)
        return True
    except OSError:  # no mount binary
        return False
    finally:
        os.rmdir(point)


DISK_KIND = "tmpfs" if _can_mount_tmpfs() else "wrapper"


class TmpfsDisk:
    """A real tmpfs of ``size`` bytes at ``root``: `leave` fills it with a filler file up to
    ``pages`` free pages, `free` deletes the filler."""

    def __init__(self, root: str, size: int = DISK_BYTES):
        self.root = root
        self.filler = os.path.join(root, "filler")
        os.makedirs(root, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", root], check=True)

    def leave(self, pages: int) -> None:
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            size = os.fstat(fd).st_size
            for block in (b"\xff" * 65536, b"\xff" * PAGE):
                while True:
                    try:
                        size += os.write(fd, block)
                    except OSError as exc:
                        assert exc.errno == errno.ENOSPC, exc
                        break
            os.ftruncate(fd, max(0, size - pages * PAGE))
        finally:
            os.close(fd)
        stat = os.statvfs(self.root)
        assert stat.f_bavail * stat.f_frsize <= pages * PAGE  # full up to the pages asked for

    def free(self) -> None:
        if os.path.exists(self.filler):
            os.remove(self.filler)

    def close(self) -> None:
        gc.collect()  # maps of unclosed buffers (a failed test) would keep the mount busy
        if subprocess.run(["umount", self.root], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", self.root], check=True)


class WrapperDisk:
    """The fallback: `LocalChunkStore.put` and ``put_in_place`` raise ENOSPC once a byte budget
    (whole 4 KiB pages per object, as a filesystem counts) is spent."""

    def __init__(self, root: str, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        os.makedirs(root, exist_ok=True)
        self.budget: int | None = None
        self.lock = threading.Lock()
        put, put_in_place = LocalChunkStore.put, LocalChunkStore.put_in_place
        disk = self

        def spend(store: LocalChunkStore, key: str, data: Any) -> None:
            parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
            size = sum(memoryview(p).nbytes for p in parts)
            cost = -(-size // PAGE) * PAGE
            with disk.lock:
                if disk.budget is not None and store.root.startswith(disk.root):
                    if cost > disk.budget:
                        raise OSError(errno.ENOSPC, ENOSPC_MESSAGE, store.path(key))
                    disk.budget -= cost

        def wrapped_put(store, key, data, durable=False):
            spend(store, key, data)
            return put(store, key, data, durable)

        def wrapped_put_in_place(store, key, data):
            spend(store, key, data)
            return put_in_place(store, key, data)

        monkeypatch.setattr(LocalChunkStore, "put", wrapped_put)
        monkeypatch.setattr(LocalChunkStore, "put_in_place", wrapped_put_in_place)

    def leave(self, pages: int) -> None:
        with self.lock:
            self.budget = pages * PAGE

    def free(self) -> None:
        with self.lock:
            self.budget = None

    def close(self) -> None:
        pass


def make_disk(kind: str, tmp_path, monkeypatch, size: int = DISK_BYTES) -> TmpfsDisk | WrapperDisk:
    root = str(tmp_path / "fs")
    return TmpfsDisk(root, size) if kind == "tmpfs" else WrapperDisk(root, monkeypatch)


@pytest.fixture
def disk(request, tmp_path, monkeypatch):
    """A small disk (`DISK_KIND`): a tmpfs as root, else the wrapper. Its size in bytes may be
    given by indirect parametrization."""
    made = make_disk(DISK_KIND, tmp_path, monkeypatch, getattr(request, "param", DISK_BYTES))
    yield made
    made.close()


# free pages left before each try: one by one where a call's writes are (a few pages each), then
# growing (a prioritized dataset's state object is 256 pages)
FREE_PAGES = sorted(set(range(16)) | {int(16 * 1.5 ** k) for k in range(12)})


def until_it_fits(disk, buf: dr.ReplayBuffer, call: Callable[[], Any], on_failure: Callable[[], Any],
                  faults: Faults) -> int:
    """Try ``call`` with `FREE_PAGES` free pages until it succeeds (then free the disk): every
    failure point of the call is met on the way. After each failure, ``on_failure()`` checks the
    writer. Returns the failures.

    The chunks a call seals are written behind it, on the same disk (waited for before the disk
    changes): when that write fails, the writer's next call raises the error and changes nothing
    (`raise_deferred`)."""
    failures = 0
    try:
        for pages in FREE_PAGES:
            disk.leave(pages)
            try:
                call()
                writes_done(buf)
            except OSError as exc:
                assert type(exc) is OSError and exc.errno == errno.ENOSPC, repr(exc)
                assert ENOSPC_MESSAGE in str(exc), str(exc)
                failures += 1
                faults.injected("disk full")
                disk.free()  # a reader may need room to open; the writer is as the failure left it
                on_failure()
                continue
            return failures
        raise AssertionError(f"the call still failed with {FREE_PAGES[-1]} pages free")
    finally:
        disk.free()


def raise_deferred(buf: dr.ReplayBuffer, call: Callable[[], Any], rows: Callable = f) -> int:
    """If a chunk write behind the writer's last call failed, ``call`` raises that error, once,
    and changes nothing. Returns the failures (0 or 1)."""
    if all(writer.failure is None for writer in writers(buf)):
        return 0
    before = look(buf, rows=rows)
    with pytest.raises(OSError, match=ENOSPC_MESSAGE):
        call()
    after = look(buf, rows=rows)
    np.testing.assert_array_equal(after.total, before.total)
    np.testing.assert_array_equal(after.ids, before.ids)
    assert after.commit == before.commit
    return 1


# ---- disk full: the matrix -----------------------------------------------------------------

PREFILL, STAGED = 61, 5  # committed steps per lane, then staged ones (a ring of 48 has wrapped)
EXTEND, ADDS, AFTER = 21, 14, 30  # the adds fill and seal two chunks per lane


def disk_case(mode: str, compression: str | None, lanes: int, op: str, kind: str = DISK_KIND):
    return pytest.param(mode, compression, lanes, op,
                        id=f"{kind}-{mode}-{compression or 'raw'}-{lanes}env-{op}")


MATRIX = [disk_case(mode, comp, lanes, op) for mode in ("dataset", "ring") for comp in (None, "zstd")
          for lanes in (1, 2) for op in ("extend", "add", "flush")]


def new_buffer(url: str, mode: str, compression: str | None, lanes: int, fields=FIELDS, **options) -> dr.ReplayBuffer:
    # a small cache: raw chunks are then read through memory maps and zstd ones are evicted
    cache = 16 * CHUNK * sum(field.row_bytes for field in fields.values()) * lanes
    return dr.ReplayBuffer.create(url, fields, capacity=LANE_CAP * lanes if mode == "ring" else None,
                                  num_envs=lanes, chunk_rows=CHUNK, compression=compression, seed=0,
                                  cache_bytes=cache, **options)


def run_disk_full(disk, faults: Faults, opened: list, mode: str, compression: str | None, lanes: int,
                  op: str) -> None:
    url = os.path.join(disk.root, "buf")
    buf = new_buffer(url, mode, compression, lanes)
    opened.append(buf)
    buf.extend(steps(0, PREFILL, lanes))
    buf.flush()
    buf.extend(steps(PREFILL, STAGED, lanes))  # staged, not committed: must survive every failure
    step = PREFILL + STAGED
    failures = 0
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=1)  # open throughout, refreshing now and then
    opened.append(reader)

    def check_reader() -> None:
        reader.refresh()
        ids = reader.row_ids()
        assert_rows(reader[ids], ids)

    def attempt(call, count):
        nonlocal failures
        before = look(buf)
        start = before.total.copy()

        def on_failure():
            check_failed_call(buf, before, start, count)
            check_reader()

        failures += until_it_fits(disk, buf, call, on_failure, faults)

    if op == "extend":  # a partial chunk sealed, a whole chunk straight from the arrays, a tail staged
        attempt(lambda: buf.extend(steps(step, EXTEND, lanes)), EXTEND)
        step += EXTEND
    elif op == "add":  # single steps; every 8th fills a chunk, which is sealed and written
        for _ in range(ADDS):
            attempt(lambda step=step: buf.add(**one_step(step, lanes)), 1)
            step += 1
    else:  # the tail chunk of every lane, the state object, the metadata of grown arrays, the commit
        attempt(buf.flush, 0)
    # the same writer goes on, on a disk with room again
    failures += raise_deferred(buf, lambda: buf.extend(steps(step, AFTER, lanes)))
    assert failures >= (2 if op == "add" else 1), failures
    buf.extend(steps(step, AFTER, lanes))
    step += AFTER
    check_recovered(buf, step)
    check_reader()
    np.testing.assert_array_equal(np.sort(reader.row_ids()), np.sort(buf.row_ids()))
    reader.close()
    buf.close()
    assert verify(url).ok
    faults.survived()


@pytest.mark.parametrize("mode,compression,lanes,op", MATRIX)
def test_disk_full(disk, opened, faults, mode, compression, lanes, op):
    run_disk_full(disk, faults, opened, mode, compression, lanes, op)


@pytest.mark.parametrize("mode,compression,lanes,op", [
    disk_case("ring", "zstd", 2, op, kind="wrapper") for op in ("extend", "add", "flush")] + [
    disk_case("dataset", None, 1, "extend", kind="wrapper")])
def test_disk_full_wrapper_fallback(tmp_path, monkeypatch, opened, faults, mode, compression, lanes, op):
    """The fault-injecting store that stands in for a tmpfs where mounting is not permitted."""
    wrapper = make_disk("wrapper", tmp_path, monkeypatch)
    run_disk_full(wrapper, faults, opened, mode, compression, lanes, op)


def test_disk_full_leaves_the_filesystem_as_a_real_one_would(disk):
    """The small disk really refuses writes once full, and takes them again once freed."""
    store = LocalChunkStore(os.path.join(disk.root, "probe"))
    store.put("a", b"x" * 100)
    disk.leave(0)
    with pytest.raises(OSError) as failed:
        store.put("a", b"y" * 100)
    assert failed.value.errno == errno.ENOSPC
    assert store.get("a") == b"x" * 100  # the old object is untouched
    assert partial_files(store.root) == []
    disk.free()
    store.put("a", b"y" * 100)
    assert store.get("a") == b"y" * 100


# ---- disk full with derived fields and prioritized sampling ----------------------------------

DERIVED_FIELDS = {"obs": dr.Field((3,), "float32"), "next_obs": dr.Field((3,), "float32"),
                  "act": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
                  "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
GAMMA, DEFAULT_RETURN = 0.5, -3.0  # returns of half-integer rewards are exact in float32
ALPHA, BETA, EPS = 0.5, 0.4, 0.0


def _ends(ids: np.ndarray, lanes: int) -> tuple[np.ndarray, np.ndarray]:
    step, lane = np.divmod(ids, lanes)
    phase = step + 3 * lane
    terminated = phase % 11 == 10
    truncated = (phase % 7 == 6) & ~terminated
    return terminated, truncated


def g(ids, lanes: int) -> dict[str, np.ndarray]:
    """Rows of the derived-fields buffer: episodes of varying length end by termination or
    truncation; a non-final step's next_obs is its lane's next obs (as derive_next assumes)."""
    ids = np.asarray(ids, dtype=np.int64)
    obs = lambda i: np.stack([i, i + 0.5, -i], -1).astype(np.float32)  # noqa: E731
    terminated, truncated = _ends(ids, lanes)
    end = terminated | truncated
    final = np.stack([ids, 1000.0 + ids, np.full(ids.shape, 7.0)], -1).astype(np.float32)
    return {"obs": obs(ids), "next_obs": np.where(end[..., None], final, obs(ids + lanes)), "act": ids,
            "reward": (((ids * 7) % 5 - 2) / 2).astype(np.float32), "terminated": terminated, "truncated": truncated}


class Reference:
    """Plain Python: the rows added so far per lane, and what the buffer derives from them."""

    def __init__(self, lanes: int, lane_cap: int | None):
        self.lanes, self.lane_cap = lanes, lane_cap
        self.total = 0  # steps per lane (every call here adds to all lanes)
        self.leaves: dict[tuple[int, int], float] = {}  # float32 values, as the sampler keeps them
        self.max_priority = 1.0

    def rows(self, ids) -> dict[str, np.ndarray]:
        return g(ids, self.lanes)

    def added(self, n: int) -> None:
        for step in range(self.total, self.total + n):
            for lane in range(self.lanes):
                self.leaves[(lane, self.slot(step))] = float(np.float32(self.max_priority ** ALPHA))
        self.total += n

    def slot(self, step: int) -> int:
        return step % self.lane_cap if self.lane_cap else step

    def is_end(self, lane: int, step: int) -> bool:
        terminated, truncated = _ends(np.array([step * self.lanes + lane]), self.lanes)
        return bool(terminated[0] or truncated[0])

    def returns(self, ids: np.ndarray) -> np.ndarray:
        out = []
        for i in ids.tolist():
            step, lane = divmod(i, self.lanes)
            value, scale, end = 0.0, 1.0, None
            for t in range(step, self.total):
                value += scale * float(self.rows([t * self.lanes + lane])["reward"][0])
                scale *= GAMMA
                if self.is_end(lane, t):
                    end = t
                    break
            out.append(value if end is not None else DEFAULT_RETURN)
        return np.array(out, dtype=np.float32)

    def episodes(self, lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int, int, bool]]:
        table = []
        for lane in range(self.lanes):
            start = int(lo[lane])
            for t in range(int(lo[lane]), int(hi[lane])):
                if self.is_end(lane, t) or t == hi[lane] - 1:
                    first = start == 0 or self.is_end(lane, start - 1)
                    table.append((lane, start, t - start + 1, first and self.is_end(lane, t)))
                    start = t + 1
        return table

    def update(self, ids: np.ndarray, td: np.ndarray) -> None:
        priority = np.abs(td) + EPS
        for i, p in zip(ids.tolist(), (priority ** ALPHA).astype(np.float32).astype(np.float64).tolist()):
            step, lane = divmod(i, self.lanes)
            self.leaves[(lane, self.slot(step))] = p
        self.max_priority = max(self.max_priority, float(priority.max()))

    def weights(self, ids: np.ndarray) -> np.ndarray:
        smallest = min(self.leaves.values())
        p = np.array([self.leaves[(i % self.lanes, self.slot(i // self.lanes))] for i in ids.tolist()])
        return ((p / smallest) ** -BETA).astype(np.float32)


def check_derived(buf: dr.ReplayBuffer, ref: Reference, with_reader: bool = True) -> None:
    """next_obs, return, episodes() and prioritized samples of the writer (and of a reader,
    right after a flush: both then hold the same rows) equal the reference."""
    for reader in (False, True) if with_reader else (False,):
        b = dr.ReplayBuffer.open(buf.url, "r") if reader else buf
        try:
            ids = b.row_ids()
            lo, hi = windows(ids, ref.lanes, b.state_dict()["total"])
            got = b[ids]
            assert_rows(got, ids, ref.rows)  # obs, next_obs (derived), act, reward, flags
            np.testing.assert_array_equal(got["return"], ref.returns(ids))
            table = b.episodes()
            assert list(zip(table.lane.tolist(), table.start.tolist(), table.length.tolist(),
                            table.complete.tolist())) == ref.episodes(lo, hi)
            batch = b.sample(64, seed=5)
            assert set(batch["index"].tolist()) <= set(ids.tolist())
            assert_rows(batch, batch["index"], ref.rows)
            np.testing.assert_array_equal(batch["return"], ref.returns(batch["index"]))
            np.testing.assert_array_equal(batch["weight"], ref.weights(batch["index"]))
        finally:
            if reader:
                b.close()


@pytest.mark.parametrize("disk", [8 * 2**20], ids=[f"{DISK_KIND}-8MiB"], indirect=True)
@pytest.mark.parametrize("mode,op", [(m, o) for m in ("dataset", "ring") for o in ("extend", "add", "flush")])
def test_disk_full_with_derived_fields_and_priorities(disk, opened, faults, mode, op):
    """A dataset-mode prioritized buffer saves 65,536 leaves per lane with each commit (1 MiB
    for 2 lanes): a bigger disk."""
    lanes = 2
    url = os.path.join(disk.root, "buf")
    buf = new_buffer(url, mode, "zstd", lanes, DERIVED_FIELDS, derive_next=("obs",),
                     episodic_return=dr.EpisodicReturn(gamma=GAMMA, default_return=DEFAULT_RETURN),
                     sampler=dr.Prioritized(alpha=ALPHA, beta=BETA, eps=EPS))
    opened.append(buf)
    ref = Reference(lanes, LANE_CAP if mode == "ring" else None)
    rows = lambda ids: g(ids, lanes)  # noqa: E731
    buf.extend(steps(0, PREFILL, lanes, rows))
    ref.added(PREFILL)
    buf.flush()
    ids = buf.row_ids()[::3]
    td = 0.5 + (ids % 5).astype(np.float64)  # priorities from 0.5 to 4.5: no longer all the same
    assert buf.update_priorities(ids, td) == len(ids)
    ref.update(ids, td)
    buf.extend(steps(PREFILL, STAGED, lanes, rows))
    ref.added(STAGED)
    check_derived(buf, ref, with_reader=False)
    failures = 0

    def attempt(call, count):
        nonlocal failures
        before = look(buf, rows=rows)
        start = before.total.copy()

        def on_failure():  # rows as before, and so are next_obs, returns, episodes and priorities
            check_failed_call(buf, before, start, count, rows=rows)
            check_derived(buf, ref, with_reader=False)

        failures += until_it_fits(disk, buf, call, on_failure, faults)
        ref.added(count)

    step = ref.total
    if op == "extend":
        attempt(lambda: buf.extend(steps(step, EXTEND, lanes, rows)), EXTEND)
    elif op == "add":  # one chunk per lane filled and sealed
        for k in range(CHUNK):
            attempt(lambda k=k: buf.add(**one_step(step + k, lanes, rows)), 1)
    else:
        attempt(buf.flush, 0)
    failures += raise_deferred(buf, lambda: buf.extend(steps(ref.total, AFTER, lanes, rows)), rows)
    assert failures >= 1
    buf.extend(steps(ref.total, AFTER, lanes, rows))
    ref.added(AFTER)
    check_recovered(buf, ref.total, rows=rows)
    check_derived(buf, ref)
    buf.close()
    faults.survived()


# ---- S3 through the fault proxy --------------------------------------------------------------

# fewer rows than on disk: every request costs moto milliseconds. A ring of 16 steps per lane
# (2 chunks) has wrapped after S3_PREFILL; the extend fills the staged chunk, writes a whole one
# and stages a tail.
S3_CAP, S3_PREFILL, S3_STAGED, S3_EXTEND, S3_AFTER = 16, 21, 2, 13, 10
S3_POLICY = dict(attempts=2, base_delay=0.01, max_delay=0.02, budget_s=30.0)
S3_FIELDS = {name: FIELDS[name] for name in ("obs", "act")}  # two fields: half the objects


def s3_rows(ids) -> dict[str, np.ndarray]:
    return {name: value for name, value in f(ids).items() if name in S3_FIELDS}


def clear_faults(proxy: FaultProxy) -> None:
    """Stop every rule of the proxy from firing (the fault is gone)."""
    with proxy.lock:
        for rule in proxy.rules:
            rule["times"] = 0


@pytest.fixture(scope="module")
def shared_proxy(s3):
    """One `FaultProxy` for the module: the writers' s3fs client (one per endpoint) and its
    connections are set up once, not per test."""
    proxy = FaultProxy(s3.endpoint)
    yield proxy
    proxy.close()


@pytest.fixture
def fault_proxy(shared_proxy):
    """The shared proxy with no rules and fresh counters (like tests/s3server.py's fixture)."""
    assert shared_proxy.wait_until(lambda: shared_proxy.holding == 0, SAFETY_S)
    with shared_proxy.lock:
        shared_proxy.rules.clear()
    shared_proxy.reset_stats()
    yield shared_proxy
    clear_faults(shared_proxy)


def s3_buffer(s3, proxy, opened: list, mode: str, lanes: int = 1,
              retry: dr.RetryPolicy | None = None) -> tuple[dr.ReplayBuffer, dict]:
    """A writer through ``proxy`` with a small retry policy, holding S3_PREFILL committed and
    S3_STAGED staged steps per lane; and the storage options readers use (the server directly:
    the faults hit the writer only)."""
    buf = dr.ReplayBuffer.create(s3.new_url("faults"), S3_FIELDS, capacity=S3_CAP * lanes if mode == "ring" else None,
                                 num_envs=lanes, chunk_rows=CHUNK, compression="zstd", seed=0,
                                 storage_options=proxy_options(s3, proxy),
                                 retry=retry or dr.RetryPolicy(**S3_POLICY))
    opened.append(buf)
    buf.extend(steps(0, S3_PREFILL, lanes, s3_rows))
    buf.flush()
    buf.extend(steps(S3_PREFILL, S3_STAGED, lanes, s3_rows))
    return buf, s3.storage_options()


def give_up(url: str, what: str, tries: int, reason: str, last: str) -> str:
    """The message of `StoreUnavailableError` (a regex; ``what`` is one too)."""
    return (rf"^\[Errno {errno.EIO}\] {re.escape(repr(url))}: {what} failed after {tries} tr(y|ies) in [\d.]+ s "
            rf"\({reason}\); last error: {last}")


# how each S3 client reports a 503 ServiceUnavailable answer (s3fs maps the S3 error to an OSError)
UNAVAILABLE = {"s3fs": rf"OSError: \[Errno {errno.EBUSY}\] Service is unable to handle request\.$",
               "obstore": r"GenericError: HTTP 503 ServiceUnavailable: Service is unable to handle request\.$"}


@pytest.mark.parametrize("mode", ["dataset", "ring"])
def test_s3_chunk_put_failing_during_extend(s3, s3_client, opened, fault_proxy, faults, mode):
    """Every PUT of an obs chunk fails: extend raises StoreUnavailableError; the other fields'
    chunks it wrote are never seen; in a full ring, rows whose slots it reached are retired."""
    buf, so = s3_buffer(s3, fault_proxy, opened, mode)
    before = look(buf, so, s3_rows)
    start = before.total.copy()
    step = S3_PREFILL + S3_STAGED
    fault_proxy.reset_stats()
    fault_proxy.fail("503", "/obs/c.", times=10**6, method="PUT")
    _, error = outcome(lambda: buf.extend(steps(step, S3_EXTEND, 1, s3_rows)))
    assert isinstance(error, dr.StoreUnavailableError), repr(error)
    # the whole chunk (steps 24..31) is written first, straight from the arrays: its obs PUT
    # failed twice, its act PUT went through (unseen), the sealed chunk was never written
    whole = 3 if mode == "dataset" else 24 % S3_CAP // CHUNK
    assert re.search(give_up(buf.url, re.escape(f"write of 'obs/c.0.{whole}.0'"), 2, "all 2 attempts used",
                             UNAVAILABLE[s3_client]), str(error)), str(error)
    assert fault_proxy.faults["503"] == 2 and fault_proxy.count("/obs/c.", "PUT") == 2
    assert fault_proxy.count(f"/act/c.0.{whole}", "PUT") == 1 and fault_proxy.count("/c.", "PUT") == 3
    faults.injected("S3 HTTP error", 2)
    check_failed_call(buf, before, start, S3_EXTEND, so, s3_rows)
    clear_faults(fault_proxy)
    buf.extend(steps(step, S3_EXTEND, 1, s3_rows))  # the same call again: the same row ids
    step += S3_EXTEND
    np.testing.assert_array_equal(buf.row_ids()[-S3_EXTEND:], np.arange(step - S3_EXTEND, step))
    buf.extend(steps(step, S3_AFTER, 1, s3_rows))
    check_recovered(buf, step + S3_AFTER, so, s3_rows)
    buf.close()
    faults.survived()


@pytest.mark.parametrize("mode,lanes", [("dataset", 1), ("ring", 2)])
def test_s3_commit_put_failing_during_flush(s3, s3_client, opened, fault_proxy, faults, mode, lanes):
    """The commit PUT fails: nothing new is committed (readers see the previous commit), the
    rows stay staged, and the next flush commits them; its state object is collected."""
    buf, so = s3_buffer(s3, fault_proxy, opened, mode, lanes)
    before = look(buf, so, s3_rows)
    fault_proxy.reset_stats()
    fault_proxy.fail("503", "/" + OWN + "commit.json", times=10**6, method="PUT")
    _, error = outcome(buf.flush)
    assert isinstance(error, dr.StoreUnavailableError), repr(error)
    assert re.search(give_up(buf.url, f"conditional write of '{OWN}commit\\.json'", 2, "all 2 attempts used",
                             UNAVAILABLE[s3_client]),
                     str(error)), str(error)
    assert fault_proxy.faults["503"] == 2 and fault_proxy.count("/" + OWN + "commit.json", "PUT") == 2
    faults.injected("S3 HTTP error", 2)
    after = check_failed_call(buf, before, before.total.copy(), 0, so, s3_rows)
    assert after.commit == before.commit  # not even a retire commit landed
    np.testing.assert_array_equal(after.reader_ids, before.reader_ids)
    clear_faults(fault_proxy)
    buf.flush()
    check_recovered(buf, S3_PREFILL + S3_STAGED, so, s3_rows)
    buf.close()
    faults.survived()


@pytest.mark.parametrize("op", ["extend", "add"])
def test_s3_retire_commit_of_a_full_ring_failing(s3, s3_client, opened, fault_proxy, faults, op):
    """A full ring commits a raised first step before overwriting chunks; when that commit
    fails, no chunk is overwritten: readers keep every row of the last commit."""
    buf, so = s3_buffer(s3, fault_proxy, opened, "ring")
    step = S3_PREFILL + S3_STAGED
    if op == "extend":
        call, count = (lambda: buf.extend(steps(step, S3_EXTEND, 1, s3_rows))), S3_EXTEND
    else:  # the add that fills the staged chunk seals it: the chunk is written
        for _ in range(CHUNK - step % CHUNK - 1):
            buf.add(**one_step(step, 1, s3_rows))
            step += 1
        call, count = (lambda: buf.add(**one_step(step, 1, s3_rows))), 1
    before = look(buf, so, s3_rows)
    fault_proxy.reset_stats()
    fault_proxy.fail("503", "/" + OWN + "commit.json", times=10**6, method="PUT")
    if op == "add":  # it returns: the retire commit fails behind it, and the next add raises that
        call()
        step += 1
        before = look(buf, so, s3_rows)
        call = lambda: buf.add(**one_step(step, 1, s3_rows))  # noqa: E731
    _, error = outcome(call)
    assert isinstance(error, dr.StoreUnavailableError), repr(error)
    assert re.search(give_up(buf.url, f"conditional write of '{OWN}commit\\.json'", 2, "all 2 attempts used",
                             UNAVAILABLE[s3_client]),
                     str(error)), str(error)
    assert fault_proxy.faults["503"] == 2
    assert fault_proxy.count("/c.", "PUT") == 0  # no chunk was overwritten
    faults.injected("S3 HTTP error", 2)
    after = check_failed_call(buf, before, before.total.copy(), count, so, s3_rows)
    assert after.commit == before.commit
    np.testing.assert_array_equal(after.reader_ids, before.reader_ids)  # every committed row still readable
    clear_faults(fault_proxy)
    call()  # the same call again
    step += count
    np.testing.assert_array_equal(buf.row_ids()[-count:], np.arange(step - count, step))
    view = look(buf, so, s3_rows)  # a reader between the retire commit and the next flush: fewer rows, right ones
    assert set(view.reader_ids.tolist()) <= set(before.reader_ids.tolist())
    buf.extend(steps(step, S3_AFTER, 1, s3_rows))
    check_recovered(buf, step + S3_AFTER, so, s3_rows)
    buf.close()
    faults.survived()


def test_s3_blackholed_flush_fails_at_the_retry_deadline(s3, s3_client, opened, fault_proxy, faults):
    """An endpoint that never answers: the flush gives up at ``retry.budget_s`` (a RetryPolicy
    passed to create) with StoreUnavailableError. Its first request (reading the writer lock, to
    check it still holds it) is the only one sent: the proxy held it until the client abandoned
    it. Once the endpoint answers again the same writer flushes."""
    budget = 1.5
    buf, so = s3_buffer(s3, fault_proxy, opened, "dataset", retry=dr.RetryPolicy(budget_s=budget))
    assert buf.storage.store.retry.budget_s == budget  # create handed the policy to the store
    before = look(buf, so, s3_rows)
    prefix = object_path(s3, buf.url, "/")
    fault_proxy.reset_stats()
    fault_proxy.fail("blackhole", prefix, times=10**6)  # every request for the buffer
    _, error = outcome(buf.flush)
    assert isinstance(error, dr.StoreUnavailableError), repr(error)
    assert re.search(give_up(buf.url, rf"read of '{OWN}writer\.lock'", 1,
                             rf"the retry deadline of {budget:g} s was reached",
                             r"TimeoutError: no answer within [\d.]+ s: the request was cancelled$"),
                     str(error)), str(error)
    # the proxy held that one request until the client gave up on it and closed the connection
    assert fault_proxy.holds == 1
    assert fault_proxy.count(prefix) == 1 == fault_proxy.count(prefix + OWN + "writer.lock", "GET")
    assert fault_proxy.wait_until(lambda: fault_proxy.abandoned == 1, SAFETY_S), fault_proxy.abandoned
    faults.injected("S3 request held")
    after = check_failed_call(buf, before, before.total.copy(), 0, so, s3_rows)
    assert after.commit == before.commit
    clear_faults(fault_proxy)  # the endpoint answers again
    buf.flush()
    assert fault_proxy.holds == 1
    check_recovered(buf, S3_PREFILL + S3_STAGED, so, s3_rows)
    buf.close()
    faults.survived()


# ---- S3: open() through the retry layer -------------------------------------------------------

# which object open() reads: (its key, a request path suffix that names only it)
METADATA = {"group": ("zarr.json", "/zarr.json"), "array": ("obs/zarr.json", "/obs/zarr.json"),
            "commit": (OWN + "commit.json", "/" + OWN + "commit.json"), "state": (OWN + "state/", "/" + OWN + "state/")}
OPEN_ROWS = 20


@pytest.fixture(scope="module")
def committed_url(s3) -> str:
    """A closed buffer on S3 with committed rows and a state object (shared: opening it
    read-only changes nothing; a test that opens it for writing leaves the same rows)."""
    url = s3.new_url("open")
    buf = dr.ReplayBuffer.create(url, S3_FIELDS, chunk_rows=CHUNK, compression="zstd", seed=0,
                                 storage_options=s3.storage_options())
    buf.extend(steps(0, OPEN_ROWS, 1, s3_rows))
    buf.close()
    return url


def object_path(s3, url: str, suffix: str) -> str:
    return f"/{s3.bucket}/{url.split(f's3://{s3.bucket}/', 1)[1]}{suffix}"


def check_open_buffer(buf: dr.ReplayBuffer) -> None:
    np.testing.assert_array_equal(buf.row_ids(), np.arange(OPEN_ROWS))
    assert_rows(buf[np.arange(OPEN_ROWS)], np.arange(OPEN_ROWS), s3_rows)


@pytest.mark.parametrize("obj", list(METADATA))
def test_s3_open_retries_a_transient_503_on_each_metadata_object(s3, s3_client, fault_proxy, faults, committed_url,
                                                                  obj):
    path = object_path(s3, committed_url, METADATA[obj][1])
    fault_proxy.fail("503", path, times=2, method="GET")
    buf = dr.ReplayBuffer.open(committed_url, "r", storage_options=proxy_options(s3, fault_proxy),
                               retry=dr.RetryPolicy(attempts=3, base_delay=0.01))
    try:
        assert fault_proxy.faults["503"] == 2
        assert fault_proxy.count(path, "GET") == 3  # the two failures, then one successful GET
        assert fault_proxy.count(path) == 3  # and nothing else asked for it (no HEAD)
        assert buf.storage.store.retried == 2  # diskreplay's retry layer retried them
        faults.injected("S3 HTTP error", 2)
        check_open_buffer(buf)
    finally:
        buf.close()
    assert verify(committed_url, s3.storage_options()).ok
    faults.survived()


@pytest.mark.parametrize("obj,mode", [("group", "r"), ("array", "r"), ("commit", "r"), ("state", "r+")])
def test_s3_open_with_a_persistent_503_is_store_unavailable(s3, s3_client, fault_proxy, faults, committed_url, obj,
                                                            mode):
    """Never NotABufferError: the store did not say the object is missing. A writer (r+) reads
    the state object after taking the writer lock: it gives the lock back."""
    state = [k for k in s3.keys(committed_url) if k.startswith(OWN + "state/")]
    assert len(state) == 1, state
    key = state[0] if obj == "state" else METADATA[obj][0]
    path = object_path(s3, committed_url, METADATA[obj][1])
    fault_proxy.fail("503", path, times=10**6, method="GET")
    options = proxy_options(s3, fault_proxy)
    _, error = outcome(lambda: dr.ReplayBuffer.open(committed_url, mode, storage_options=options,
                                                    retry=dr.RetryPolicy(attempts=3, base_delay=0.01)))
    assert type(error) is dr.StoreUnavailableError, repr(error)
    assert re.search(give_up(committed_url, re.escape(f"read of {key!r}"), 3, "all 3 attempts used",
                             UNAVAILABLE[s3_client]),
                     str(error)), str(error)
    assert fault_proxy.faults["503"] == 3 and fault_proxy.count(path, "GET") == 3
    faults.injected("S3 HTTP error", 3)
    assert OWN + "writer.lock" not in s3.keys(committed_url)
    clear_faults(fault_proxy)
    buf = dr.ReplayBuffer.open(committed_url, mode, storage_options=options)
    try:
        check_open_buffer(buf)
    finally:
        buf.close()
    assert verify(committed_url, s3.storage_options()).ok
    faults.survived()
