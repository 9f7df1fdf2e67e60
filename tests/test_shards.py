"""Sharded buffers (issue 17): one schema, a shard per writer, learners read the union.

Row contents are a pure function of (shard, lane, step), so every returned row is checked
against where `ReplayBuffer.locate` says it comes from."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from conftest import OWN
from s3server import s3, s3_client

import diskreplay as dr
from diskreplay.buffer.rate_limit import PUBLISH_EVERY_S
from diskreplay.format.shards import LEARNER_KEY, shard_url

FIELDS = {"obs": dr.Field((2,), "float64"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
EPISODE = 5


def content(shard, lane, step) -> np.ndarray:
    return np.stack([shard * 1e6 + lane * 1e4 + step, -(shard * 1e6 + lane * 1e4 + step)], -1).astype(np.float64)


def write(url, shard: int, steps: int, num_envs: int = 1, first: int = 0, **options) -> None:
    """``steps`` steps of every lane of ``shard``, content from (shard, lane, step)."""
    with dr.ReplayBuffer.open_shard(url, shard=shard, **options) as w:
        t = np.arange(first, first + steps)[:, None] + np.zeros(num_envs, np.int64)
        lanes = np.zeros_like(t) + np.arange(num_envs)
        data = {"obs": content(shard, lanes, t), "reward": (t % 3).astype(np.float32),
                "done": t % EPISODE == EPISODE - 1}
        w.extend(data if num_envs > 1 else {k: v[:, 0] for k, v in data.items()})


def check_rows(buf, batch) -> None:
    shard, lane, step = buf.locate(batch["index"])
    np.testing.assert_array_equal(batch["obs"], content(shard, lane, step))


@pytest.fixture
def sharded(tmp_path):
    """3 shards of 2 lanes, ring of 200 rows each; shard s holds 30 + 10*s steps per lane."""
    url = str(tmp_path / "buf")
    dr.ReplayBuffer.create(url, FIELDS, capacity=200, num_envs=2, shards=3, chunk_rows=16).close()
    for s in range(3):
        write(url, s, 30 + 10 * s, num_envs=2)
    return url


def test_create_lays_out_a_zarr_group_of_complete_shard_buffers(sharded):
    root = json.load(open(os.path.join(sharded, "zarr.json")))
    assert root["node_type"] == "group"
    assert root["attributes"]["diskreplay_shards"] == {"count": 3, "format": "diskreplay/2", "commit_index": True}
    assert sorted(os.listdir(sharded)) == ["diskreplay", "shard-00000", "shard-00001", "shard-00002", "zarr.json"]
    with dr.ReplayBuffer.open(shard_url(sharded, 1)) as one:  # a shard is a buffer of its own
        assert len(one) == 80 and one.num_envs == 2 and one.capacity == 200


def test_union_rows_ids_and_locate(sharded):
    with dr.ReplayBuffer.open(sharded, "r", seed=0) as buf:
        assert (buf.shards, buf.num_envs, buf.capacity, len(buf)) == (3, 6, 600, 60 + 80 + 100)
        lo, hi = buf.window()
        np.testing.assert_array_equal(hi, [30, 30, 40, 40, 50, 50])
        ids = buf.row_ids()
        assert len(ids) == 240
        np.testing.assert_array_equal(buf[ids]["obs"], content(*buf.locate(ids)))
        shard, lane, step = buf.locate([5 * 6 + 2 * 2 + 1])  # step 5 of lane 1 of shard 2
        assert (shard.tolist(), lane.tolist(), step.tolist()) == ([2], [1], [5])
        check_rows(buf, buf.sample(64))
        check_rows(buf, buf.latest(12))
        with pytest.raises(dr.ReadOnlyError, match="sharded buffer.*open_shard"):
            buf.add(obs=np.zeros((6, 2)), reward=np.zeros(6), done=np.zeros(6, bool))


def test_uniform_sampling_covers_the_union_in_proportion(sharded):
    with dr.ReplayBuffer.open(sharded, "r", seed=1) as buf:
        shard = buf.locate(buf.sample(24_000)["index"])[0]
    counts = np.bincount(shard, minlength=3)
    expected = 24_000 * np.array([60, 80, 100]) / 240
    chi2 = (((counts - expected) ** 2) / expected).sum()
    assert chi2 < 13.8  # chi-square, 2 degrees of freedom, p = 0.001


def test_slices_and_n_step_stay_inside_one_shard_lane(sharded):
    with dr.ReplayBuffer.open(sharded, "r", seed=2) as buf:
        s = buf.sample(200, seq_len=4)
        shard, lane, step = buf.locate(s["index"])
        assert (shard == shard[:, :1]).all() and (lane == lane[:, :1]).all()
        np.testing.assert_array_equal(step - step[:, :1], np.broadcast_to(np.arange(4), step.shape))
        assert (step[:, 0] // EPISODE == step[:, -1] // EPISODE).all()  # inside one episode
        b = buf.sample(300, n_step=3, gamma=0.5)
        _, _, step = buf.locate(b["index"])
        left = np.minimum(EPISODE - 1 - step % EPISODE, 2) + 1  # steps used before the episode ends
        want = sum(np.where(k < left, 0.5 ** k * ((step + k) % 3), 0) for k in range(3))
        np.testing.assert_allclose(b["reward"], want, rtol=1e-6)
        assert len(buf.episodes()) == 2 * (6 + 8 + 10)


def test_refresh_adopts_each_shards_newest_commit_and_keeps_the_others_cached(sharded):
    with dr.ReplayBuffer.open(sharded, "r", seed=3) as buf:
        buf[buf.row_ids()]  # everything cached
        loaded = buf.stats().chunks_loaded
        assert not buf.refresh()
        write(sharded, 1, 20, num_envs=2, first=40)
        assert buf.refresh()
        np.testing.assert_array_equal(buf.window()[1], [30, 30, 60, 60, 50, 50])
        ids = buf.row_ids()
        np.testing.assert_array_equal(buf[ids]["obs"], content(*buf.locate(ids)))
        # only shard 1's tail chunks (steps 32..59 of its 2 lanes) were read again
        assert buf.stats().chunks_loaded - loaded == 2 * 2


def test_a_learner_refresh_finds_the_commits_of_a_derive_next_shard_after_its_writer_reopens(tmp_path):
    # found by the sharded model test: the side store of a derive_next shard announced its own
    # commit sequences as the shard's, so a reopened writer's index name fell behind the commit a
    # learner had adopted, and the learner's refresh skipped that shard's newest commit
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, {**FIELDS, "next_obs": FIELDS["obs"]}, capacity=5, shards=2, chunk_rows=2,
                           derive_next=("obs",)).close()
    def steps(t: np.ndarray) -> dict[str, np.ndarray]:
        return {"obs": content(0, 0, t), "next_obs": content(0, 0, t + 1), "reward": np.zeros(len(t), np.float32),
                "done": np.zeros(len(t), bool)}

    with dr.ReplayBuffer.open_shard(url, 0) as w:
        w.extend(steps(np.arange(1)))
    with dr.ReplayBuffer.open(url, "r") as learner:
        with dr.ReplayBuffer.open_shard(url, 0) as w:
            w.extend(steps(np.arange(1, 6)))  # round the ring: the writer commits row 0's retirement first
            assert learner.refresh() and learner.window()[1].tolist() == [1, 0]
        with dr.ReplayBuffer.open_shard(url, 0):  # the shard's writer opens again, side store and all
            sequence = learner.storage.shard_records(newest=True)[0].sequence
            assert os.listdir(os.path.join(url, "diskreplay", "objects", "commits")) == [f"00000-{sequence:012d}"]
            assert learner.refresh()
            np.testing.assert_array_equal(learner.window()[1], [6, 0])
            check_rows(learner, learner.sample(16))


def test_derive_next_and_episodic_returns_across_shards(tmp_path):
    url = str(tmp_path / "b")
    fields = {**FIELDS, "next_obs": FIELDS["obs"]}
    dr.ReplayBuffer.create(url, fields, capacity=100, shards=2, derive_next=("obs",),
                           episodic_return=dr.EpisodicReturn(gamma=0.5)).close()
    for s in range(2):
        with dr.ReplayBuffer.open_shard(url, s) as w:
            for t in range(12 + s):
                w.add(obs=content(s, 0, t), next_obs=content(s, 0, t + 1) + (t % EPISODE == EPISODE - 1) * 0.5,
                      reward=np.float32(1), done=t % EPISODE == EPISODE - 1)
    with dr.ReplayBuffer.open(url, "r") as buf:
        ids = buf.row_ids()
        rows = buf[ids]
        shard, lane, step = buf.locate(ids)
        ends = step % EPISODE == EPISODE - 1
        np.testing.assert_array_equal(rows["next_obs"], content(shard, lane, step + 1) + ends[:, None] * 0.5)
        complete = step < 10  # the episodes that ended: returns 1 + 0.5 + 0.25 ... to their end
        remaining = EPISODE - step % EPISODE
        np.testing.assert_allclose(rows["return"][complete], (2 - 2 * 0.5 ** remaining)[complete], rtol=1e-6)


def test_learner_state_resumes_exactly_and_rejects_a_future_state(sharded, tmp_path):
    sampler = dr.Prioritized(alpha=0.6, beta=0.4)
    with dr.ReplayBuffer.open(sharded, "r", sampler=sampler, seed=4) as buf:
        for _ in range(5):
            b = buf.sample(32)
            buf.update_priorities(b["index"], np.arange(32.0))
        buf.save_snapshot(tmp_path / "snap")
        state = buf.state_dict()
        want = [buf.sample(16) for _ in range(3)]
    assert state["samples"] == 5 * 32 and state["total"].tolist() == [30, 30, 40, 40, 50, 50]
    again = dr.ReplayBuffer.load_snapshot(tmp_path / "snap", mode="r", sampler=dr.Prioritized(alpha=0.6, beta=0.4))
    with again:
        for w in want:
            got = again.sample(16)
            np.testing.assert_array_equal(got["index"], w["index"])
            np.testing.assert_array_equal(got["weight"], w["weight"])
        future = {**state, "total": state["total"] + 1}
        with pytest.raises(ValueError, match="'total': expected at most"):
            again.load_state_dict(future)


def test_rows_committed_after_a_learner_state_reach_its_sampler_at_max_priority(sharded):
    with dr.ReplayBuffer.open(sharded, "r", sampler=dr.Prioritized(alpha=1.0, beta=0.0), seed=5) as buf:
        ids = buf.row_ids()
        buf.update_priorities(ids, np.full(len(ids), 1e-6))
        buf.update_priorities(ids[:1], np.array([4.0]))  # the max priority is now 4
        write(sharded, 2, 10, num_envs=2, first=50)
        buf.refresh()
        shard, _, step = buf.locate(buf.sample(2000)["index"])
    new = (shard == 2) & (step >= 50)
    # 20 new rows at priority 4 and one old row at 4, against 240 rows at 1e-6: all but ~0 draws
    assert new.sum() + (~new).sum() == 2000 and 1800 < new.sum() < 2000


def test_arguments_and_hostile_roots(tmp_path, sharded):
    url = str(tmp_path / "new")
    for bad, message in ((0, "shards must be None or an int in"), ("2", "shards must be"), (5000, "in \\[1, 4096\\]")):
        with pytest.raises(ValueError, match=message):
            dr.ReplayBuffer.create(url, FIELDS, capacity=10, shards=bad)
        assert not os.path.exists(url)
    with pytest.raises(ValueError, match="commit=False"):
        dr.ReplayBuffer.create(url, FIELDS, capacity=10, shards=2, commit=False)
    with pytest.raises(ValueError, match=r"shard must be an int in \[0, 3\)"):
        dr.ReplayBuffer.open_shard(sharded, shard=3)
    with pytest.raises(ValueError, match="mode='r'"):
        dr.ReplayBuffer.open(sharded, "r+")
    with pytest.raises(dr.NotABufferError, match="not a sharded buffer"):
        dr.ReplayBuffer.open_shard(shard_url(sharded, 0), shard=0)
    with pytest.raises(ValueError, match="seed= and rate_limiter= are for sharded buffers"):
        dr.ReplayBuffer.open(shard_url(sharded, 0), "r", seed=1)
    w = dr.ReplayBuffer.open_shard(sharded, shard=0)
    with pytest.raises(dr.LockedError):
        dr.ReplayBuffer.open_shard(sharded, shard=0)
    dr.ReplayBuffer.open_shard(sharded, shard=1).close()  # another shard: its own lock
    with pytest.raises(dr.LockedError, match="shard-00000"):
        dr.ReplayBuffer.create(sharded, FIELDS, capacity=10, shards=2, overwrite=True)
    w.close()
    root = os.path.join(sharded, "zarr.json")
    document = json.load(open(root))
    for count in ("3", 0, 10**6, None):
        document["attributes"]["diskreplay_shards"] = {"count": count}
        json.dump(document, open(root, "w"))
        with pytest.raises(dr.CorruptBufferError, match="zarr.json field 'attributes.diskreplay_shards.count'"):
            dr.ReplayBuffer.open(sharded, "r")


def test_a_missing_or_different_shard_is_named(tmp_path):
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=10, shards=3).close()
    other = str(tmp_path / "other")
    dr.ReplayBuffer.create(other, {**FIELDS, "extra": dr.Field((), "int8")}, capacity=10).close()
    os.rename(shard_url(url, 1), str(tmp_path / "gone"))
    with pytest.raises(dr.NotABufferError, match="shard-00001"):
        dr.ReplayBuffer.open(url, "r")
    os.rename(other, shard_url(url, 1))
    with pytest.raises(dr.CorruptBufferError, match="shard-00001.*config differs"):
        dr.ReplayBuffer.open(url, "r")


@pytest.mark.parametrize("target", ["shard-00000", "elsewhere"])
def test_a_shard_directory_that_is_a_symbolic_link_is_refused_and_reported(sharded, tmp_path, target):
    """Each shard must be a directory of its own: a shard replaced by a link to another shard
    (whose rows would be read twice) or to a copy elsewhere is refused by open and open_shard,
    and reported by verify, naming the shard and the link."""
    from diskreplay.audit import verify

    shard = shard_url(sharded, 2)
    os.rename(shard, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere" if target == "elsewhere" else shard_url(sharded, 0), shard)
    linked = rf"is a symbolic link \(to '[^']*/{target}'\); each shard must be a directory of its own"
    with pytest.raises(dr.CorruptBufferError, match=r"buf': shard-00002 " + linked):
        dr.ReplayBuffer.open(sharded, "r")
    with pytest.raises(dr.CorruptBufferError, match=r"buf': shard-00002 " + linked):
        dr.ReplayBuffer.open_shard(sharded, shard=2)
    dr.ReplayBuffer.open_shard(sharded, shard=1).close()  # the others still open
    report = verify(sharded)
    assert not report.ok and len(report.problems) == 1, report.problems
    assert re.fullmatch(r"shard-00002: the shard " + linked, report.problems[0]), report.problems


def test_rate_limiter_arithmetic_and_validation():
    lim = dr.RateLimiter(samples_per_insert=4, error_buffer=100, min_size=50)
    assert not lim.sample_allowed(inserts=49, samples=0, count=1)
    assert lim.sample_allowed(50, 0, 100) and not lim.sample_allowed(50, 0, 101)
    assert lim.sample_allowed(60, 100, 40) and not lim.sample_allowed(60, 100, 41)  # 4 * 10 + 100 = 140
    assert lim.insert_allowed(inserts=0, samples=0, count=75) and not lim.insert_allowed(0, 0, 76)  # 4*(76-50) > 100
    assert lim.insert_allowed(100, 100, 0) and not lim.insert_allowed(100, 100, 1)  # 4 * 51 - 100 > 100
    for kwargs, field in (({"samples_per_insert": 0}, "samples_per_insert"), ({"error_buffer": -1}, "error_buffer"),
                          ({"min_size": 0}, "min_size"), ({"timeout_s": float("inf")}, "timeout_s")):
        with pytest.raises(ValueError, match=f"RateLimiter: {field} must be"):
            dr.RateLimiter(**{"samples_per_insert": 1, "error_buffer": 1, **kwargs})


def test_rate_limited_learner_waits_and_actors_read_its_progress(sharded):
    lim = dr.RateLimiter(samples_per_insert=2, error_buffer=40, min_size=200, timeout_s=0.05)
    with dr.ReplayBuffer.open(sharded, "r", rate_limiter=lim) as buf:  # 240 inserted: 2 * 40 + 40 = 120 samples
        buf.sample(100)
        with pytest.raises(dr.RateLimitTimeout, match=r"sample\(30\) waited 0.05 s.*samples_per_insert=2"):
            buf.sample(30)
        buf.sample(20)
        progress = json.load(open(os.path.join(sharded, OWN, LEARNER_KEY)))
        assert progress["samples"] in (100, 120) and progress["inserts"] == [60, 80, 100]
        with dr.ReplayBuffer.open_shard(sharded, 0, rate_limiter=lim) as actor:
            buf._gate.publish(force=True)
            # 120 >= 2 * (240 + k - 200) - 40  <=>  k <= 40
            assert actor.insert_allowed(40) and not actor.insert_allowed(41)
            with pytest.raises(dr.RateLimitTimeout, match="inserting 41 rows into shard 0"):
                actor.insert_allowed(41, wait=True)
        with dr.ReplayBuffer.open_shard(sharded, 1) as plain:
            with pytest.raises(ValueError, match="no rate limiter"):
                plain.insert_allowed(1)
    assert PUBLISH_EVERY_S > 0
    with open(os.path.join(sharded, OWN, LEARNER_KEY), "w") as fh:
        fh.write('{"samples": -1, "inserts": [0, 0, 0], "time": 0}')
    with dr.ReplayBuffer.open_shard(sharded, 0, rate_limiter=lim) as actor:
        with pytest.raises(dr.CorruptBufferError, match="learner.json field 'samples'"):
            actor.insert_allowed(1)


def test_an_actor_that_must_wait_commits_first(tmp_path):
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=1).close()
    lim = dr.RateLimiter(samples_per_insert=1, error_buffer=10, min_size=1, timeout_s=0.05)
    with dr.ReplayBuffer.open_shard(url, 0, rate_limiter=lim) as actor:
        actor.extend({"obs": np.zeros((11, 2)), "reward": np.zeros(11), "done": np.zeros(11, bool)})
        with dr.ReplayBuffer.open(url, "r", rate_limiter=lim) as learner:
            assert actor.insert_allowed(1) is False  # 0 >= 1 * (11 + 1 - 1) - 10 is False: ask before committing
            assert len(learner) == 0 and not learner.refresh()
            with pytest.raises(dr.RateLimitTimeout):
                actor.insert_allowed(1, wait=True)
            assert learner.refresh() and len(learner) == 11  # committed before waiting: the learner can go on
            learner.sample(20)
            learner._gate.publish(force=True)
            assert actor.insert_allowed(1, wait=True)


def test_epoch_dataset_reads_every_row_of_the_union_once_and_resumes_in_workers(sharded):
    pytest.importorskip("torch")
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(ds):
        return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")

    with dr.ReplayBuffer.open(sharded, "r") as buf:
        whole = [b["index"].numpy() for b in loader(buf.as_dataset(16, mode="epoch", seed=1, rank=1, world_size=2))]
        other = [b["index"].numpy() for b in buf.as_dataset(16, mode="epoch", seed=1, rank=0, world_size=2)]
        np.testing.assert_array_equal(np.sort(np.concatenate(whole + other)), np.sort(buf.row_ids()))
        it = iter(first := loader(buf.as_dataset(16, mode="epoch", seed=1, rank=1, world_size=2)))
        head = [next(it)["index"].numpy() for _ in range(3)]
        resumed = loader(buf.as_dataset(16, mode="epoch", seed=1, rank=1, world_size=2))
        resumed.load_state_dict(first.state_dict())
        tail = [b["index"].numpy() for b in resumed]
        for got, want in zip(head + tail, whole, strict=True):
            np.testing.assert_array_equal(got, want)
        batch = next(iter(buf.as_dataset(64, mode="sample", seed=2)))
        check_rows(buf, {k: v.numpy() for k, v in batch.items()})


def test_sharded_buffer_on_s3(s3, s3_client):
    url, so = s3.new_url("sharded"), s3.storage_options()
    dr.ReplayBuffer.create(url, FIELDS, capacity=64, shards=2, chunk_rows=8, storage_options=so).close()
    for s in range(2):
        write(url, s, 20 + s, storage_options=so)
    with dr.ReplayBuffer.open(url, "r", sampler=dr.Prioritized(), storage_options=so, seed=0) as buf:
        assert len(buf) == 41
        batch = buf.sample(32)
        check_rows(buf, batch)
        assert buf.update_priorities(batch["index"], np.ones(32)) == 32
        write(url, 0, 5, first=20, storage_options=so)
        assert buf.refresh() and len(buf) == 46
