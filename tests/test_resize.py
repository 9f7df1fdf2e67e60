"""Changing a ring's capacity at open (issue 45): ``ReplayBuffer.open(url, "r+", capacity=n)``.

Every check compares row by row: with a plain model of the ring (step ``t`` of lane ``e`` holds
``value(e, t)``; a lane keeps its newest ``lane_capacity`` steps, a shrink its newest
``n // num_envs``), and with a *twin*: a buffer created at the new capacity that got the same
adds and was reopened at the same moments. A shrunk ring holds exactly its twin's rows; a grown
one, once it has filled up again, too. Derived fields (``next_obs`` through ``final/``, episodic
returns), the episode table and priorities are compared with them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings

import numpy as np
import pytest
from format_v1 import downgrade
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from s3server import s3

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.buffer import resize as resize_module

FIELDS = {"obs": dr.Field((2,), "float32"), "next_obs": dr.Field((2,), "float32"), "reward": dr.Field((), "float32"),
          "done": dr.Field((), "bool")}
STORED = ("obs", "reward", "done")


def value(lane: np.ndarray, step: np.ndarray) -> dict[str, np.ndarray]:
    """The stored fields of step ``step`` of lane ``lane``."""
    lane, step = np.asarray(lane), np.asarray(step)
    done = (step + 2 * lane) % 5 == 4
    return {"obs": np.stack([step, lane + 0.5], -1).astype(np.float32),
            "next_obs": np.stack([step + np.where(done, 0.25, 1), lane + 0.5], -1).astype(np.float32),
            "reward": ((step % 3) + lane).astype(np.float32), "done": done}


def create(url: str, capacity: int, num_envs: int, **kwargs) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.create(url, FIELDS, capacity, num_envs=num_envs, chunk_rows=4, episode_end="done",
                                  derive_next=("obs",), episodic_return=dr.EpisodicReturn(0.9), **kwargs)


def add(bufs: list[dr.ReplayBuffer], counts: np.ndarray, lanes: list[int], steps: int) -> None:
    """``steps`` adds to ``lanes`` of every buffer in ``bufs``; ``counts``: steps per lane so far."""
    for _ in range(steps):
        rows = value(np.array(lanes), counts[lanes])
        for buf in bufs:
            buf.add(env_ids=lanes, **rows)
        counts[lanes] += 1


def assert_model(buf: dr.ReplayBuffer, first: np.ndarray, counts: np.ndarray) -> None:
    """``buf`` shows exactly steps ``[first[e], counts[e])`` of each lane ``e``, with their values."""
    envs = buf.num_envs
    want = np.concatenate([np.arange(first[e], counts[e]) * envs + e for e in range(envs)])
    np.testing.assert_array_equal(buf.row_ids(), want)
    rows = buf[want]
    for name, expected in value(want % envs, want // envs).items():
        np.testing.assert_array_equal(rows[name], expected, err_msg=name)  # next_obs too: derived right


def assert_same(buf: dr.ReplayBuffer, twin: dr.ReplayBuffer, ids: np.ndarray | None = None) -> None:
    """``buf`` reads as ``twin`` does at ``ids`` (default: every row of both, which must agree),
    derived fields too; without ``ids``, their episode tables are equal as well."""
    if ids is None:
        ids = twin.row_ids()
        np.testing.assert_array_equal(buf.row_ids(), ids)
        mine, theirs = buf.episodes(), twin.episodes()
        for name in ("lane", "start", "length", "complete"):
            np.testing.assert_array_equal(getattr(mine, name), getattr(theirs, name), err_msg=name)
    got, want = buf[ids], twin[ids]
    assert set(got) == set(want) == {"obs", "next_obs", "reward", "done", "return"}
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def resized(url: str, capacity: int, **kwargs) -> dr.ReplayBuffer:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning unless a test expects one
        return dr.ReplayBuffer.open(url, "r+", capacity=capacity, **kwargs)


@pytest.mark.parametrize("stage_bytes", [64 << 20, 1])
def test_grow_keeps_every_row_of_a_wrapped_multi_lane_ring(tmp_path, monkeypatch, stage_bytes):
    """3 lanes of 8 steps, wrapped (19 to 24 steps per lane), grown to 20 per lane: every row,
    derived field and episode reads as before, at the same row ids; added rows go to their new
    slots, and once the ring holds 20 steps per lane it reads as its twin (created at 60 rows).
    ``stage_bytes=1``: the new chunks are staged one at a time."""
    monkeypatch.setattr(resize_module, "STAGE_BYTES", stage_bytes)
    url, twin_url = str(tmp_path / "a"), str(tmp_path / "twin")
    counts = np.zeros(3, np.int64)
    a, twin = create(url, 24, 3), create(twin_url, 60, 3)
    add([a, twin], counts, [0, 1, 2], 19)
    add([a, twin], counts, [0], 5)
    add([a, twin], counts, [2], 2)
    a.close()
    twin.close()
    before = dr.ReplayBuffer.open(url)
    old_ids, old_rows, old_episodes = before.row_ids(), before[before.row_ids()], before.episodes()
    before.close()
    a, twin = resized(url, 60), dr.ReplayBuffer.open(twin_url, "r+")
    assert (a.capacity, a.layout.lane_capacity) == (60, 20)
    assert_model(a, counts - 8, counts)
    np.testing.assert_array_equal(a.row_ids(), old_ids)
    for name, column in a[old_ids].items():
        np.testing.assert_array_equal(column, old_rows[name], err_msg=name)
    np.testing.assert_array_equal(a.episodes().start, old_episodes.start)
    assert_same(a, twin, old_ids)
    first = counts - 8
    add([a, twin], counts, [0, 1, 2], 9)
    assert_model(a, first, counts)  # 17 to 20 steps per lane: nothing overwritten yet
    assert_same(a, twin, a.row_ids())
    add([a, twin], counts, [0, 1, 2], 5)
    assert_model(a, counts - 20, counts)
    assert_same(a, twin)
    a.close()
    twin.close()
    reopened, twin = dr.ReplayBuffer.open(url), dr.ReplayBuffer.open(twin_url)
    assert_model(reopened, counts - 20, counts)
    assert_same(reopened, twin)
    assert verify(url).ok, verify(url).problems


@pytest.mark.parametrize("stage_bytes", [64 << 20, 1])
def test_shrink_keeps_the_newest_rows_per_lane_and_warns(tmp_path, monkeypatch, stage_bytes):
    """3 lanes of 12 steps, unevenly filled (5 to 30 steps), shrunk to 4 per lane: each lane keeps
    its newest 4 rows (the warning says how many each dropped), episodes cut at the new first row,
    and the ring reads as its twin created at 12 rows, before and after more adds and a reopen."""
    monkeypatch.setattr(resize_module, "STAGE_BYTES", stage_bytes)
    url, twin_url = str(tmp_path / "a"), str(tmp_path / "twin")
    counts = np.zeros(3, np.int64)
    a, twin = create(url, 36, 3), create(twin_url, 12, 3)
    add([a, twin], counts, [0, 1, 2], 5)
    add([a, twin], counts, [0, 2], 4)
    add([a, twin], counts, [0], 21)
    a.close()
    twin.close()
    with pytest.warns(UserWarning, match=r"capacity=12 keeps the newest 4 rows per lane: dropped \[8, 1, 5\] rows "
                                         r"per lane \(14 in all\)"):
        a = dr.ReplayBuffer.open(url, "r+", capacity=12)
    twin = dr.ReplayBuffer.open(twin_url, "r+")
    assert a.capacity == 12
    assert_model(a, counts - 4, counts)
    assert_same(a, twin)
    add([a, twin], counts, [1, 2], 3)
    add([a, twin], counts, [0, 1, 2], 2)
    assert_model(a, counts - 4, counts)
    assert_same(a, twin)
    a.close()
    twin.close()
    a, twin = dr.ReplayBuffer.open(url, "r+"), dr.ReplayBuffer.open(twin_url, "r+")
    add([a, twin], counts, [0, 1, 2], 6)
    assert_same(a, twin)
    a.close()
    twin.close()
    assert_same(dr.ReplayBuffer.open(url), dr.ReplayBuffer.open(twin_url))
    report = verify(url)
    assert report.ok, report.problems
    assert report.episodes == verify(twin_url).episodes


def test_shrink_of_a_ring_that_never_wrapped_drops_nothing_and_says_nothing(tmp_path):
    url = str(tmp_path / "a")
    counts = np.zeros(2, np.int64)
    a = create(url, 40, 2)
    add([a], counts, [0, 1], 6)
    a.close()
    a = resized(url, 16)  # 8 per lane: the 6 rows of each lane stay, no warning
    assert_model(a, np.zeros(2, np.int64), counts)
    add([a], counts, [0, 1], 5)
    assert_model(a, counts - 8, counts)
    a.close()
    assert verify(url).ok


@pytest.mark.parametrize("new", [8, 24])
def test_priorities_move_with_their_rows(tmp_path, new):
    """A prioritized ring (2 lanes of 8, wrapped) with priorities set row by row keeps each kept
    row's priority at its new slot, nothing elsewhere, and its max priority (which new rows get)."""
    url = str(tmp_path / "a")
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2, sampler=dr.Prioritized(alpha=0.7))
    add([a], counts, [0, 1], 13)
    add([a], counts, [1], 2)
    ids = a.row_ids()
    assert a.update_priorities(ids, 0.5 + 0.25 * ids) == len(ids)
    before = a.sampler.state_dict()
    a.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = dr.ReplayBuffer.open(url, "r+", capacity=new, sampler=dr.Prioritized(alpha=0.7))
    lane_cap = new // 2
    after = a.sampler.state_dict()
    assert after["stride"] == lane_cap and after["max_priority"] == before["max_priority"]
    old_leaves, leaves = before["leaves"].reshape(2, 8), after["leaves"].reshape(2, lane_cap)
    want = np.zeros((2, lane_cap), np.float32)
    for lane in range(2):
        steps = np.arange(counts[lane] - min(8, lane_cap), counts[lane])
        want[lane, steps % lane_cap] = old_leaves[lane, steps % 8]
    np.testing.assert_array_equal(leaves, want)
    assert (want > 0).sum() == len(a.row_ids())
    add([a], counts, [0, 1], 3)
    a.flush()
    leaves = a.sampler.state_dict()["leaves"].reshape(2, lane_cap)
    newest = np.float32(before["max_priority"] ** 0.7)
    for lane in range(2):
        np.testing.assert_array_equal(leaves[lane, np.arange(counts[lane] - 3, counts[lane]) % lane_cap], newest)
    batch = a.sample(64)
    np.testing.assert_array_equal(batch["obs"], value(batch["index"] % 2, batch["index"] // 2)["obs"])
    a.close()
    reopened = dr.ReplayBuffer.open(url, sampler=dr.Prioritized(alpha=0.7))
    np.testing.assert_array_equal(reopened.sampler.state_dict()["leaves"].reshape(2, lane_cap), leaves)
    assert verify(url).ok


def test_same_capacity_changes_nothing(tmp_path):
    url = str(tmp_path / "a")
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2)
    add([a], counts, [0, 1], 11)
    a.close()
    sequence = dr.ReplayBuffer.open(url).stats().commit_sequence
    a = resized(url, 16)
    assert a.stats().commit_sequence == sequence
    assert_model(a, counts - 8, counts)
    a.close()


def test_bad_capacity_is_refused_and_changes_nothing(tmp_path):
    url = str(tmp_path / "a")
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2)
    add([a], counts, [0, 1], 11)
    a.close()
    with pytest.raises(ValueError, match=r"capacity=25 is not a multiple of num_envs=2 .*use e\.g\. 24"):
        dr.ReplayBuffer.open(url, "r+", capacity=25)
    with pytest.raises(ValueError, match=r"capacity=6 gives 3 rows per lane, fewer than chunk_rows=4: at least 8"):
        dr.ReplayBuffer.open(url, "r+", capacity=6)
    with pytest.raises(ValueError, match=r"capacity=268,435,464 with chunk_rows=4 needs 67,108,866 chunks; at most "
                                         r"67,108,864 are kept: raise chunk_rows"):
        dr.ReplayBuffer.open(url, "r+", capacity=2 * (2**27 + 4))
    with pytest.raises(ValueError, match=r"capacity must be an int >= 1, got 0"):
        dr.ReplayBuffer.open(url, "r+", capacity=0)
    with pytest.raises(ValueError, match=r"capacity= changes the buffer .*open it with mode='r\+', not 'r'"):
        dr.ReplayBuffer.open(url, "r", capacity=32)
    b = dr.ReplayBuffer.open(url, "r+")  # the lock was released each time
    assert b.capacity == 16
    assert_model(b, counts - 8, counts)
    b.close()
    dataset = str(tmp_path / "dataset")
    create(dataset, None, 2).close()
    with pytest.raises(ValueError, match=r"is a dataset \(it grows without a capacity\): capacity= applies to rings"):
        dr.ReplayBuffer.open(dataset, "r+", capacity=32)


def test_sharded_buffers_are_refused(tmp_path):
    url = str(tmp_path / "sharded")
    dr.ReplayBuffer.create(url, FIELDS, 16, num_envs=2, chunk_rows=4, shards=2).close()
    with pytest.raises(ValueError, match=r"is a sharded buffer: capacity= is not supported"):
        dr.ReplayBuffer.open(url, "r+", capacity=32)
    with pytest.raises(ValueError, match=r"capacity= is not supported for a shard"):
        dr.ReplayBuffer.open_shard(url, 0, capacity=32)


# ---- crash safety ------------------------------------------------------------------------------

KILL_CODE = """
import os, signal, sys
import diskreplay as dr
from diskreplay.io.local import LocalChunkStore

url, capacity, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
calls = []


def counted(method):
    def call(self, key, *args, **kwargs):
        calls.append(key)
        print(len(calls), key, flush=True)
        if len(calls) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return method(self, key, *args, **kwargs)
    return call


LocalChunkStore.put = counted(LocalChunkStore.put)
LocalChunkStore.delete = counted(LocalChunkStore.delete)
dr.ReplayBuffer.open(url, "r+", capacity=capacity)
print("done", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the new buffer stays as the change left it (no close)
"""


COMMIT = "diskreplay/objects/commit.json"


def run_resize(url: str, capacity: int, kill_at: int) -> list[str]:
    """Resize ``url`` in a subprocess SIGKILLed at its ``kill_at``-th store write or delete (0:
    after the change); the keys it wrote or deleted, in order."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", KILL_CODE, url, str(capacity), str(kill_at)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line != "done"]


@pytest.mark.slow
@pytest.mark.parametrize("new", [12, 40])
def test_a_resize_killed_anywhere_leaves_the_old_buffer_or_the_new_one(tmp_path, new):
    """A subprocess changing a 2-lane ring of 8 per lane (wrapped, derive_next, episodic returns)
    to ``new`` rows is SIGKILLed at one of its store writes or deletes, for points spread over the
    whole change (staging, the commit point: the marked commit record, the copy, the cleanup). Readers then
    open the old buffer or refuse (`ResizeInProgressError`); the next writer opens the old buffer
    with every old row, or the new one as its twin shows it; `verify` finds nothing wrong."""
    pristine, twin_url = str(tmp_path / "pristine"), str(tmp_path / "twin")
    counts = np.zeros(2, np.int64)
    a, twin = create(pristine, 16, 2), create(twin_url, new, 2)
    add([a, twin], counts, [0, 1], 13)
    add([a, twin], counts, [0], 2)
    a.close()
    twin.close()
    old = dr.ReplayBuffer.open(pristine)
    twin = dr.ReplayBuffer.open(twin_url)
    keys = run_resize(str(tmp_path / "probe"), new, 0) if shutil.copytree(pristine, tmp_path / "probe") else []
    commit_point = keys.index(COMMIT) + 1  # the marked record's put, then the record's without its mark
    done_point = commit_point + keys[commit_point:].index(COMMIT) + 1
    points = sorted({1, commit_point - 1, commit_point, commit_point + 1, done_point, done_point + 1,
                     *np.linspace(1, len(keys), 8).astype(int).tolist()})
    outcomes = set()
    for point in points:
        url = str(tmp_path / f"killed-{point}")
        shutil.copytree(pristine, url)
        run_resize(url, new, point)
        if commit_point < point <= done_point:
            with pytest.raises(dr.ResizeInProgressError, match=r"capacity is under way, or was interrupted"):
                dr.ReplayBuffer.open(url)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the killed writer's lock, taken over
            buf = dr.ReplayBuffer.open(url, "r+")
        outcomes.add(buf.capacity)
        reference = old if point <= commit_point else twin
        assert buf.capacity == reference.capacity, point
        assert_model(buf, counts - min(8, buf.capacity // 2), counts)
        assert_same(buf, reference, buf.row_ids())
        buf.close()
        report = verify(url)
        assert report.ok, (point, report.problems)
        if point > commit_point:  # the change was finished (by the next writer): its staged objects are gone
            assert not [f for _, _, files in os.walk(os.path.join(url, "diskreplay/objects/resize-staging"))
                        for f in files]
    assert outcomes == {16, new}


# ---- model ---------------------------------------------------------------------------------------

ADDS = st.lists(st.tuples(st.sets(st.integers(0, 2), min_size=1), st.integers(1, 9)), max_size=4)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(envs=st.integers(1, 3), old=st.integers(4, 10), new=st.integers(4, 12), before=ADDS, after=ADDS)
# a grown ring whose next step goes to a chunk that held no kept step: it was not written
@example(envs=1, old=4, new=7, before=[({0}, 11)], after=[({0}, 1)])
def test_resize_matches_a_model_of_the_ring(tmp_path_factory, envs, old, new, before, after):
    """Random adds (to random lanes), a change from ``old`` to ``new`` steps per lane, more adds,
    a reopen: every row read is the model's (a lane shows steps ``[max(lower, count - lane
    capacity), count)``; the change raises ``lower`` to ``count - min(old, new)``)."""
    url = str(tmp_path_factory.mktemp("model") / "a")
    counts = np.zeros(envs, np.int64)
    buf = create(url, old * envs, envs)
    for lanes, steps in before:
        add([buf], counts, sorted({lane % envs for lane in lanes}), steps)
    buf.close()
    lower = np.maximum(counts - min(old, new), 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        buf = dr.ReplayBuffer.open(url, "r+", capacity=new * envs)
    assert_model(buf, lower, counts)
    for lanes, steps in after:
        add([buf], counts, sorted({lane % envs for lane in lanes}), steps)
    assert_model(buf, np.maximum(lower, counts - new), counts)
    buf.close()
    assert_model(dr.ReplayBuffer.open(url), np.maximum(lower, counts - new), counts)
    assert verify(url).ok


def test_a_diskreplay_1_buffer_keeps_its_format(tmp_path):
    """A buffer of format ``diskreplay/1`` (its own objects at its root) is resized in place and
    stays ``diskreplay/1``."""
    url = str(tmp_path / "old")
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2)
    add([a], counts, [0, 1], 11)
    a.close()
    downgrade(url)
    with pytest.warns(UserWarning, match=r"dropped \[3, 3\] rows per lane"):
        a = dr.ReplayBuffer.open(url, "r+", capacity=10)
    assert_model(a, counts - 5, counts)
    add([a], counts, [0, 1], 2)
    a.close()
    assert json.loads((tmp_path / "old" / "zarr.json").read_text())["attributes"]["diskreplay"]["format"] == \
        "diskreplay/1"
    assert not (tmp_path / "old" / "diskreplay").exists()
    assert "resize" not in json.loads((tmp_path / "old" / "commit.json").read_text())["extra"]
    assert_model(dr.ReplayBuffer.open(url), counts - 5, counts)
    assert verify(url).ok


def test_a_ring_on_s3_grows(s3):
    url, options = s3.new_url("resize"), s3.storage_options()
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2, storage_options=options)
    add([a], counts, [0, 1], 11)
    a.close()
    a = dr.ReplayBuffer.open(url, "r+", capacity=24, storage_options=options)
    assert_model(a, counts - 8, counts)
    add([a], counts, [0, 1], 6)
    assert_model(a, counts - 12, counts)
    a.close()
    assert_model(dr.ReplayBuffer.open(url, storage_options=options), counts - 12, counts)
    assert not [key for key in s3.keys(url) if "resize" in key]
    assert verify(url, options).ok


def test_a_change_made_visible_but_not_finished_is_finished_by_the_next_writer(tmp_path, monkeypatch):
    """The change fails right after its commit point (the marked record written, nothing copied):
    readers refuse to open, naming the way out; the next writer finishes the change."""
    url = str(tmp_path / "a")
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2)
    add([a], counts, [0, 1], 11)
    a.close()
    finish = resize_module.finish
    calls = []

    def fails_after_the_commit_point(*args):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk gone")
        return finish(*args)

    monkeypatch.setattr(resize_module, "finish", fails_after_the_commit_point)
    with pytest.raises(OSError, match="disk gone"):
        dr.ReplayBuffer.open(url, "r+", capacity=40)
    monkeypatch.undo()
    with pytest.raises(dr.ResizeInProgressError, match=r"a change of its capacity is under way, or was interrupted "
                                                       r"\(commit.json has 'extra.resize'\); its writer finishes it"):
        dr.ReplayBuffer.open(url)
    assert not verify(url).ok
    with dr.ReplayBuffer.open(url, "r+") as b:
        assert b.capacity == 40
        assert_model(b, counts - 8, counts)
    assert_model(dr.ReplayBuffer.open(url), counts - 8, counts)
    assert verify(url).ok


def test_a_reader_open_across_a_change_refuses_to_read_on(tmp_path):
    url = str(tmp_path / "a")
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2)
    add([a], counts, [0, 1], 11)
    a.close()
    reader = dr.ReplayBuffer.open(url, "r")
    a = resized(url, 32)
    add([a], counts, [0, 1], 3)
    a.flush()
    # every later commit carries the new capacity: the old reader's slots would be wrong rows
    with pytest.raises(dr.StaleReadError, match=r"the ring's capacity was changed since this reader opened it "
                                                r"\(8 steps per lane\): open the buffer again"):
        reader.refresh()
    reader.close()
    with dr.ReplayBuffer.open(url, "r") as fresh:
        assert_model(fresh, np.full(2, 11 - 8), counts)  # the 8 rows per lane kept, and the 3 added
    a.close()


def test_a_buffer_with_pins_refuses_a_change(tmp_path):
    url = str(tmp_path / "a")
    counts = np.zeros(2, np.int64)
    a = create(url, 16, 2)
    add([a], counts, [0, 1], 11)
    n = a.pin()
    a.close()
    with pytest.raises(ValueError, match=rf"has pinned commits \[{n}\]: a change of capacity deletes what they keep; "
                                         r"unpin them first"):
        dr.ReplayBuffer.open(url, "r+", capacity=32)
    with dr.ReplayBuffer.open(url, "r", at_commit=n) as pinned:
        assert_model(pinned, counts - 8, counts)
