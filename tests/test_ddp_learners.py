"""Data-parallel learner ranks over a sharded buffer keep one sampling state
(`diskreplay.torch.DistributedLearner`): gloo ranks in real processes, a DDP-wrapped model, actor
processes writing shards.

Run as a script, this file is one of those processes (``actor`` or ``learner``, see `main`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch")

import diskreplay as dr

FIELDS = {"obs": dr.Field((4,), "float32"), "reward": dr.Field((), "float32")}
SPI, ERROR_BUFFER, MIN_SIZE = 4.0, 256.0, 64
ACTORS, ACTOR_ROWS, ROWS_PER_INSERT = 2, 600, 20
BATCH = 64
STEPS = 70
"""Learner steps: BATCH * STEPS is within ERROR_BUFFER of SPI * (ACTORS * ACTOR_ROWS - MIN_SIZE),
so that the actors' last inserts and the learners' last batches are all allowed."""
WAIT_S = 600


def limiter() -> dr.RateLimiter:
    return dr.RateLimiter(samples_per_insert=SPI, error_buffer=ERROR_BUFFER, min_size=MIN_SIZE, timeout_s=300,
                          poll_s=0.01)


def actor_rows(shard: int, first: int, count: int) -> dict[str, np.ndarray]:
    """Rows ``[first, first + count)`` of actor ``shard``: the same in every run."""
    t = np.arange(first, first + count, dtype=np.float32)
    obs = np.stack([np.full_like(t, shard), t / 100, np.sin(t), np.ones_like(t)], axis=1)
    return {"obs": obs, "reward": ((t + shard) % 7 / 7).astype(np.float32)}


def run_actor(url: str, shard: int, limited: bool) -> None:
    """Write ``ACTOR_ROWS`` rows to ``shard``, committing every ``ROWS_PER_INSERT`` (asking the
    rate limiter first if ``limited``)."""
    with dr.ReplayBuffer.open_shard(url, shard, rate_limiter=limiter() if limited else None) as w:
        for first in range(0, ACTOR_ROWS, ROWS_PER_INSERT):
            if limited:
                w.insert_allowed(ROWS_PER_INSERT, wait=True)
            w.extend(actor_rows(shard, first, ROWS_PER_INSERT))
            w.flush()


def run_learner(rank: int, world: int, args: dict) -> None:
    """One learner rank: ``args["steps"]`` DDP steps through a `DistributedLearner`; writes what
    it saw to ``{out}/rank-{rank}.npz``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from diskreplay.torch import DistributedLearner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{args['out']}/rendezvous", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opened = {"sampler": dr.Prioritized(alpha=0.6), "rate_limiter": limiter()}
    snapshot = os.path.join(args["out"], "..", "snapshot")
    if args["resume"]:
        model.load_state_dict(torch.load(os.path.join(snapshot, "model.pt")))
    if args["resume"] and rank == 0:  # rank 0 alone loads the snapshot: the others get its state
        buf = dr.ReplayBuffer.load_snapshot(snapshot, mode="r", **opened)
    else:
        buf = dr.ReplayBuffer.open(args["url"], "r", seed=100 + rank, **opened)  # seeds differ on purpose
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    learner = DistributedLearner(buf)
    seen: dict[str, list] = {"index": [], "samples": [], "inserts": []}
    for step in range(args["first"], args["first"] + args["steps"]):
        if step == args["save_at"]:
            if rank == 0:
                os.makedirs(snapshot, exist_ok=True)
                torch.save(model.state_dict(), os.path.join(snapshot, "model.pt"))
            learner.save_snapshot(snapshot)
        if step % 5 == 0:
            learner.refresh()
        batch = learner.sample(BATCH, beta=0.4, format="torch")
        td = batch["reward"] - ddp(batch["obs"]).squeeze(-1)
        loss = (batch["weight"] * td ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        learner.update_priorities(batch["index"], td.detach())
        state = learner.state_dict()
        seen["index"].append(batch["index"].numpy())
        seen["samples"].append(state["samples"])
        seen["inserts"].append(int(state["total"].sum()))
    learner.publish()  # the last count, for actors waiting on it
    while int(learner.state_dict()["total"].sum()) < ACTORS * ACTOR_ROWS:  # every rank sees the last rows
        time.sleep(0.01)
        learner.refresh()
    table = buf.sampler.table  # type: ignore[attr-defined]
    np.savez(os.path.join(args["out"], f"rank-{rank}.npz"), index=np.stack(seen["index"]),
             samples=np.array(seen["samples"]), inserts=np.array(seen["inserts"]), leaves=table.leaves,
             sums=table.sums.state_dict()["leaves"], mins=table.mins.state_dict()["leaves"],
             total=int(learner.state_dict()["total"].sum()),
             weights=torch.cat([p.detach().ravel() for p in model.parameters()]).numpy(),
             rng=np.array(json.dumps(buf.rng.bit_generator.state)))
    dist.destroy_process_group()
    buf.close()


def main() -> None:
    role, *rest = sys.argv[1:]
    if role == "actor":
        run_actor(rest[0], int(rest[1]), rest[2] == "limited")
    else:
        run_learner(int(rest[0]), int(rest[1]), json.loads(rest[2]))


def spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait for every process; fail with the output of any that failed."""
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=WAIT_S)
            outputs.append((proc.returncode, out.decode(errors="replace")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    failed = [out for code, out in outputs if code != 0]
    assert not failed, "\n----\n".join(failed)


def learners(url: str, world: int, out: str, steps: int, first: int = 0, save_at: int = -1,
             resume: bool = False) -> list[subprocess.Popen[bytes]]:
    os.makedirs(out)
    args = json.dumps({"url": url, "out": out, "steps": steps, "first": first, "save_at": save_at, "resume": resume})
    return [spawn("learner", str(rank), str(world), args) for rank in range(world)]


def results(out: str, world: int) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(os.path.join(out, f"rank-{rank}.npz"))) for rank in range(world)]


def make_buffer(tmp_path) -> str:
    url = str(tmp_path / "buf")
    dr.ReplayBuffer.create(url, FIELDS, shards=ACTORS, episode_end=None).close()
    return url


def check_one_state(ranks: list[dict[str, np.ndarray]]) -> None:
    """Every rank ends with the same priorities (leaves and both trees, bit for bit), generator,
    counts and model weights."""
    first = ranks[0]
    for other in ranks[1:]:
        for name in ("leaves", "sums", "mins", "weights", "rng", "samples", "inserts", "total"):
            np.testing.assert_array_equal(other[name], first[name], err_msg=name)
    assert (first["leaves"] > 0).sum() == ACTORS * ACTOR_ROWS


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ddp_ranks_keep_one_sampling_state_while_actors_write(tmp_path, world):
    url = make_buffer(tmp_path)
    actors = [spawn("actor", url, str(shard), "limited") for shard in range(ACTORS)]
    finish(learners(url, world, str(tmp_path / "run"), STEPS) + actors)
    ranks = results(str(tmp_path / "run"), world)
    check_one_state(ranks)
    # the ranks drew disjoint parts of one global batch per step: 'samples' counts all of them once
    samples, inserts = ranks[0]["samples"], ranks[0]["inserts"]
    np.testing.assert_array_equal(samples, BATCH * np.arange(1, STEPS + 1))
    assert (samples <= SPI * (inserts - MIN_SIZE) + ERROR_BUFFER).all()  # never ahead by more than error_buffer
    assert ranks[0]["total"] == ACTORS * ACTOR_ROWS  # the actors inserted every row: none waited for good
    assert abs(samples[-1] - SPI * (ranks[0]["total"] - MIN_SIZE)) <= ERROR_BUFFER
    global_batches = np.concatenate([r["index"] for r in ranks], axis=1)
    assert global_batches.shape == (STEPS, BATCH)


@pytest.mark.slow
def test_ddp_resume_from_rank0_snapshot_is_exact(tmp_path):
    url = make_buffer(tmp_path)
    finish([spawn("actor", url, str(shard), "free") for shard in range(ACTORS)])
    steps, save_at = 12, 6
    finish(learners(url, 2, str(tmp_path / "whole"), steps, save_at=save_at))
    finish(learners(url, 2, str(tmp_path / "resumed"), steps - save_at, first=save_at, resume=True))
    whole, resumed = results(str(tmp_path / "whole"), 2), results(str(tmp_path / "resumed"), 2)
    check_one_state(resumed)
    for rank in range(2):
        for name in ("index", "samples", "inserts"):  # per step
            np.testing.assert_array_equal(resumed[rank][name], whole[rank][name][save_at:], err_msg=name)
        for name in ("leaves", "sums", "mins", "weights", "rng"):  # at the end
            np.testing.assert_array_equal(resumed[rank][name], whole[rank][name], err_msg=name)


def write(url: str, shard: int, first: int, count: int) -> None:
    with dr.ReplayBuffer.open_shard(url, shard) as w:
        w.extend(actor_rows(shard, first, count))


def test_refresh_adopts_exactly_the_commits_another_learner_shows(tmp_path):
    url = make_buffer(tmp_path)
    write(url, 0, 0, 10)
    reading = dr.ReplayBuffer.open(url, "r", sampler=dr.Prioritized(alpha=0.6), seed=0)
    adopting = dr.ReplayBuffer.open(url, "r", sampler=dr.Prioritized(alpha=0.6), seed=0)
    write(url, 0, 10, 5)
    write(url, 1, 0, 7)
    assert reading.refresh()
    write(url, 1, 7, 3)  # newer than what `reading` adopted: `adopting` must not see it
    commits = reading.shard_commits()
    assert adopting.refresh(commits=commits)
    assert len(adopting) == len(reading) == 22
    assert not adopting.refresh(commits=reading.shard_commits([1]))  # nothing newer than what it shows
    for name in ("rng", "samples"):
        assert adopting.state_dict()[name] == reading.state_dict()[name]
    np.testing.assert_array_equal(adopting.state_dict()["sampler"]["leaves"], reading.state_dict()["sampler"]["leaves"])
    np.testing.assert_array_equal(adopting.sample(16)["index"], reading.sample(16)["index"])
    assert adopting.refresh() and len(adopting) == 25  # its own refresh reads the newest again
    reading.close()
    adopting.close()


def test_shard_commits_need_a_learner_of_a_sharded_buffer(tmp_path):
    with dr.ReplayBuffer.create(tmp_path / "plain", FIELDS, episode_end=None) as buf:
        with pytest.raises(ValueError, match="is not a learner of a sharded buffer"):
            buf.shard_commits()
        with pytest.raises(ValueError, match="is not a learner of a sharded buffer"):
            buf.learner_rank()


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_rank_waits_for_the_rate_limiter_and_checks_the_batch_size(tmp_path, one_rank):
    from diskreplay.torch import DistributedLearner

    url = make_buffer(tmp_path)
    write(url, 0, 0, 10)
    short = dr.RateLimiter(samples_per_insert=1, error_buffer=4, min_size=10, timeout_s=0.05)
    with dr.ReplayBuffer.open(url, "r", rate_limiter=short) as buf:
        learner = DistributedLearner(buf)
        assert learner.sample(4)["index"].shape == (4,)
        with pytest.raises(dr.RateLimitTimeout, match=r"sample\(4\) waited 0.05 s for the rate limiter"):
            learner.sample(4)
        assert learner.state_dict()["samples"] == 4
        with pytest.raises(ValueError, match="batch_size: expected a multiple of the world size 1, got 0"):
            learner.sample(0)


def test_one_rank_draws_again_after_a_stale_read(tmp_path, one_rank):
    from diskreplay.torch import DistributedLearner

    url = str(tmp_path / "ring")
    dr.ReplayBuffer.create(url, FIELDS, capacity=16, chunk_rows=4, shards=2, episode_end=None).close()
    for shard in range(2):
        write(url, shard, 0, 16)
    with dr.ReplayBuffer.open(url, "r", seed=0) as buf:
        learner = DistributedLearner(buf)
        write(url, 0, 16, 16)  # shard 0 goes round its ring: every row the learner knows there is gone
        batch = learner.sample(16)
        assert buf.window()[0].tolist() == [16, 0]  # the ranks adopted the newest commits, then drew again
        shard, step = batch["index"] % 2, batch["index"] // 2  # one lane per shard
        assert ((shard == 1) | (step >= 16)).all()
        np.testing.assert_array_equal(batch["obs"][:, 0], shard)  # the rows of the ids drawn
        np.testing.assert_array_equal(batch["obs"][:, 1], step.astype(np.float32) / 100)
        assert learner.state_dict()["samples"] == 16


if __name__ == "__main__":
    main()
