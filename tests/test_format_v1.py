"""Buffers of format ``diskreplay/1`` (diskreplay's own objects at the root, docs/format.md
section 11) open, read, sample, write, lock, verify and rate-limit as before, and keep their
format; an unknown format is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from format_v1 import downgrade

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.cli import main as cli

FIELDS = {"obs": dr.Field((3,), "float32"), "next_obs": dr.Field((3,), "float32"), "reward": dr.Field((), "float32"),
          "done": dr.Field((), "bool")}
OWN = ("commit.json", "state", "writer.lock")


def steps(n: int, start: int) -> dict[str, np.ndarray]:
    t = np.arange(start, start + n, dtype=np.float32)[:, None] * 10 + np.arange(2)[None, :]
    obs = np.stack([t, -t, t / 4], -1)
    return {"obs": obs, "next_obs": obs + 1, "reward": t, "done": (np.arange(start, start + n) % 5 == 4)[:, None]
            .repeat(2, 1)}


def make_pair(tmp_path: Path) -> tuple[Path, Path]:
    """The same prioritized ``derive_next`` ring twice: as made (``diskreplay/2``) and downgraded."""
    new, old = tmp_path / "new", tmp_path / "old"
    with dr.ReplayBuffer.create(new, FIELDS, capacity=40, num_envs=2, chunk_rows=4, sampler=dr.Prioritized(),
                                derive_next=("obs",), episode_end="done", seed=3) as buf:
        buf.extend(steps(27, 0))
        buf.update_priorities(np.arange(0, 40, 3), np.linspace(0.5, 4.0, 14))
    shutil.copytree(new, old)
    downgrade(old)
    return new, old


def own_names(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} & {*OWN, "diskreplay"}


def assert_same_batches(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_a_diskreplay_1_buffer_reads_samples_and_writes_as_before_and_keeps_its_format(tmp_path):
    new, old = make_pair(tmp_path)
    assert own_names(old) == {"commit.json", "state"} and (old / "final" / "commit.json").is_file()
    assert json.loads((old / "zarr.json").read_text())["attributes"]["diskreplay"]["format"] == "diskreplay/1"
    with dr.ReplayBuffer.open(new, "r") as a, dr.ReplayBuffer.open(old, "r") as b:
        assert_same_batches(a[a.row_ids()], b[b.row_ids()])
        assert_same_batches(a.sample(16), b.sample(16))
        assert_same_batches(a.sample(8, n_step=3, gamma=0.9), b.sample(8, n_step=3, gamma=0.9))
    for path in (new, old):
        with dr.ReplayBuffer.open(path, "r+") as buf:
            buf.extend(steps(30, 27))  # wraps the ring: retire commits, a new journal base
            buf.update_priorities(np.arange(60, 100, 7), np.full(6, 9.0))
    assert own_names(old) == {"commit.json", "state"} and own_names(new) == {"diskreplay"}
    with dr.ReplayBuffer.open(new, "r") as a, dr.ReplayBuffer.open(old, "r") as b:
        assert_same_batches(a[a.row_ids()], b[b.row_ids()])
        assert_same_batches(a.sample(32), b.sample(32))
        assert len(b.episodes()) == len(a.episodes()) > 0
    report = verify(old)
    assert report.ok and report.rows == 40, report.problems


def test_a_diskreplay_1_writer_lock_is_held_found_and_broken_at_the_root(tmp_path, capsys):
    _, old = make_pair(tmp_path)
    writer = dr.ReplayBuffer.open(old, "r+")
    assert own_names(old) == {"commit.json", "state", "writer.lock"}
    with pytest.raises(dr.LockedError, match="is already open for writing by this process"):
        dr.ReplayBuffer.open(old, "r+")
    with pytest.raises(dr.LockedError, match="is already open for writing by this process"):
        dr.ReplayBuffer.create(old, FIELDS, capacity=40, overwrite=True)
    assert verify(old).notes[0].startswith("writer.lock present: held by this process")
    assert cli(["unlock", str(old)]) != 0 and "which looks alive; pass --force" in capsys.readouterr().err
    assert cli(["unlock", "--force", str(old)]) == 0
    assert "removed the writer lock held by this process" in capsys.readouterr().out
    assert own_names(old) == {"commit.json", "state"}
    with pytest.raises(dr.LockedError, match="this writer no longer holds the writer lock"):
        writer.close()


def test_a_diskreplay_1_sharded_buffer_keeps_learner_json_at_its_root(tmp_path):
    path = tmp_path / "sharded"
    dr.ReplayBuffer.create(path, FIELDS, capacity=40, num_envs=2, chunk_rows=4, shards=2).close()
    downgrade(path)
    assert "format" not in json.loads((path / "zarr.json").read_text())["attributes"]["diskreplay_shards"]
    limiter = dr.RateLimiter(samples_per_insert=2.0, error_buffer=40.0, timeout_s=0.2)
    with dr.ReplayBuffer.open_shard(path, shard=1, rate_limiter=limiter) as actor:
        actor.extend(steps(10, 0))
        actor.flush()
        with dr.ReplayBuffer.open(path, "r", rate_limiter=limiter) as learner:
            assert learner.sample(8)["index"].shape == (8,)
        assert (path / "learner.json").is_file() and not (path / "diskreplay").exists()
        assert actor.insert_allowed(2, wait=False)
    assert own_names(path / "shard-00001") == {"commit.json", "state"}
    report = verify(path)
    assert report.ok and report.rows == 20, report.problems


def test_an_unknown_format_is_refused_naming_it(tmp_path):
    path = tmp_path / "future"
    dr.ReplayBuffer.create(path, FIELDS, capacity=8).close()
    group = json.loads((path / "zarr.json").read_text())
    group["attributes"]["diskreplay"]["format"] = "diskreplay/3"
    (path / "zarr.json").write_text(json.dumps(group))
    with pytest.raises(dr.NotABufferError, match=r"a buffer of format 'diskreplay/3', this diskreplay reads "
                                                 r"\['diskreplay/1', 'diskreplay/2'\] \(upgrade diskreplay\)"):
        dr.ReplayBuffer.open(path)


def test_a_field_may_be_named_state_now(tmp_path):
    """``diskreplay/1`` kept its state objects in ``state/`` beside the fields; now ``state`` is a
    field name like any other (robot state vectors are often called so)."""
    fields = {"state": dr.Field((2,), "float32"), "done": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(tmp_path / "b", fields, capacity=8, sampler=dr.Prioritized()) as buf:
        buf.extend({"state": np.arange(12, dtype=np.float32).reshape(6, 2), "done": np.zeros(6, bool)})
        buf.update_priorities(np.arange(6), np.arange(1.0, 7.0))
    with dr.ReplayBuffer.open(tmp_path / "b", "r") as buf:
        np.testing.assert_array_equal(buf[np.arange(6)]["state"], np.arange(12).reshape(6, 2))
    assert verify(tmp_path / "b").ok
