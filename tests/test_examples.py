"""The examples: short runs with small flags (offline BC over several epochs, DQN killed and resumed, RLPD's
mixed batches, the LLM-RL generator and learner killed and resumed)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import logged
from ray_cluster import ray_cluster  # a fixture
from s3server import s3  # a fixture

import diskreplay as dr

ROOT = Path(__file__).resolve().parents[1]
torch = pytest.importorskip("torch")
pytest.importorskip("h5py")


@pytest.fixture
def one_torch_thread():
    """Tiny networks: one intra-op thread is faster, and much faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_env(tmp_path: Path) -> dict[str, str]:
    """The examples' environment, with temp files under ``tmp_path / "tmp"`` (torch's compile
    cache, which is not a temp dir of the example, elsewhere)."""
    os.makedirs(tmp_path / "tmp")
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "torch-cache")}


def test_offline_bc_trains_the_steps_asked_over_several_epochs(tmp_path, capsys, one_torch_thread):
    # 1,000 rows in batches of 64: 16 batches an epoch, so 40 steps take 3 epochs
    steps = load_example("offline_bc").main(["--rows", "1000", "--batch-size", "64", "--steps", "40",
                                             "--workdir", str(tmp_path)])
    assert steps == 40
    out = capsys.readouterr().out
    assert out.startswith("1,000 rows from ")
    assert "step     16  epoch 0" in out and "step     20  epoch 1" in out and "step     36  epoch 2" in out
    assert out.splitlines()[-1].startswith("done: 40 steps in 3 epochs, bc loss ")
    assert (tmp_path / "dataset.zarr").is_dir()  # --workdir is kept


def test_offline_bc_without_workdir_removes_its_temp_dir(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "offline_bc.py"), "--rows", "300",
                           "--batch-size", "64", "--steps", "7"], capture_output=True, text=True,
                          env=example_env(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("done: 7 steps in 2 epochs")
    assert f"from {tmp_path / 'tmp'}" in proc.stdout
    assert os.listdir(tmp_path / "tmp") == []


def test_online_dqn_resume_after_sigkill_cuts_the_episode(tmp_path, capsys, caplog, one_torch_thread):
    pytest.importorskip("gymnasium")
    args = ["--workdir", str(tmp_path / "run"), "--learning-starts", "50", "--save-every", "100"]
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "online_dqn.py"), *args, "--steps", "100000"],
                            stdout=subprocess.PIPE, text=True, env=example_env(tmp_path))
    try:
        assert proc.stdout.readline().startswith("step    100")  # a checkpoint was written...
    finally:
        proc.send_signal(signal.SIGKILL)  # ...and the run dies without closing anything
        proc.wait()
        proc.stdout.close()
    saved = int(torch.load(tmp_path / "run" / "checkpoint.pt")["step"])
    with dr.ReplayBuffer.open(tmp_path / "run" / "buffer") as buf:
        assert len(buf) == saved
        episodes_before = buf.episodes()
        open_episode = bool(len(episodes_before)) and not episodes_before.complete[-1]
    dqn = load_example("online_dqn")
    with logged(caplog, rf"took over the writer lock left by pid {proc.pid} .*no longer running"):
        assert dqn.main(args + ["--steps", str(saved + 150)]) == saved + 150
    assert f"resumed at step {saved} with {saved} rows in the buffer; a new episode starts" in capsys.readouterr().out
    with dr.ReplayBuffer.open(tmp_path / "run" / "buffer") as buf:
        assert len(buf) == saved + 150
        episodes = buf.episodes()
        ends = episodes.start + episodes.length
        assert np.flatnonzero(ends == saved).size == 1  # an episode ends at the last row before the kill...
        assert np.flatnonzero(episodes.start == saved).size == 1  # ...and the resumed run starts a new one
        assert not ((episodes.start < saved) & (ends > saved)).any()  # none spans the resume point
        last = buf[[saved - 1]]
        if open_episode:  # the kill cut it: closed as truncated, not terminated
            assert (bool(last["truncated"][0]), bool(last["terminated"][0])) == (True, False)
        else:
            assert bool(last["truncated"][0]) or bool(last["terminated"][0])


def test_rlpd_pendulum_trains_on_half_offline_half_online_batches(tmp_path, capsys, one_torch_thread):
    pytest.importorskip("gymnasium")
    updates = load_example("rlpd_pendulum").main(["--steps", "400", "--offline-steps", "1000", "--utd", "2",
                                                  "--batch-size", "32", "--workdir", str(tmp_path)])
    assert updates == 800
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"offline: 1,000 rows imported from {tmp_path / 'pendulum-offline.npz'} ")
    assert [line.split("  return")[0] for line in out[1:3]] == ["step    200  episode   1", "step    400  episode   2"]
    assert out[-1].startswith("done: 400 steps, 800 updates on 12,800 offline + 12,800 online rows, ")
    with dr.ReplayBuffer.open(tmp_path / "online") as online, dr.ReplayBuffer.open(tmp_path / "offline") as offline:
        assert (len(online), len(offline)) == (400, 1000)
        assert online.fields == offline.fields


# ---- actors_learner.py: actor processes and a learner sharing one sharded buffer ------------------

ACTORS_LEARNER = ROOT / "examples" / "actors_learner.py"
SHORT_RUN = ["--actors", "2", "--batch-size", "64", "--learning-starts", "200", "--checkpoint-every", "50"]


def start_actors_learner(run: Path, env: dict[str, str], stderr, *flags: str) -> subprocess.Popen:
    """The example in a process group of its own (its actors are spawned into it), stdout piped."""
    return subprocess.Popen([sys.executable, str(ACTORS_LEARNER), "--run-dir", str(run), *SHORT_RUN, *flags],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the example and every process it started that is still running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while any member runs
    except ProcessLookupError:
        pass
    proc.wait()


def run_with_ray(tmp_path: Path, start) -> tuple[subprocess.Popen, str]:
    """``start(env)``, an example that starts Ray, run to its end: the process and its stdout. Ray's
    unix sockets live under its temp dir, kept short (pytest's tmp_path can be too long)."""
    import shutil
    import tempfile

    env = example_env(tmp_path)
    env["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        proc = start(env)
        try:
            return proc, proc.communicate(timeout=600)[0]
        finally:
            kill_group(proc)  # the Ray processes too, if any outlived the run
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def run_summary(run: Path) -> dict:
    import json

    return json.loads((run / "summary.json").read_text())


def committed_rows(run: Path, proc: subprocess.Popen, shard: int, more_than: int) -> int:
    """Wait until ``shard`` holds more than ``more_than`` committed rows (as a learner sees them)."""
    import time

    with dr.ReplayBuffer.open(run / "buffer") as union:
        deadline = time.monotonic() + 600  # only so that a hung run fails instead of hanging the suite
        while (rows := int(union.window()[1][shard])) <= more_than:
            assert proc.poll() is None, f"the run ended with {rows} rows in shard {shard}"
            assert time.monotonic() < deadline, f"shard {shard} kept {rows} rows"
            time.sleep(0.02)
            union.refresh()
    return rows


def wait_for_line(proc: subprocess.Popen, pattern: str, out: list[str]):
    """Read the example's output (into ``out``) up to a line holding ``pattern``: its match. Its
    processes share one unbuffered stdout, where ``print`` writes the text and its newline
    separately: two processes' lines can come out as one, so the pattern is searched, not matched."""
    import re

    while line := proc.stdout.readline():
        out.append(line)
        if found := re.search(pattern, line):
            return found
    raise AssertionError(f"the run ended without printing a line matching {pattern!r}:\n{''.join(out)}")


def test_actors_learner_trains_the_updates_asked_from_every_shard(tmp_path):
    pytest.importorskip("gymnasium")
    run = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = start_actors_learner(run, example_env(tmp_path), err, "--updates", "300")
        try:
            out = proc.communicate(timeout=600)[0]
        finally:
            kill_group(proc)
    assert proc.returncode == 0, out + (tmp_path / "stderr.txt").read_text()
    assert out.startswith("starting at update 0 with 2 shards\n")
    assert out.splitlines()[-1].startswith("done: 300 updates (this run from update 0), rows per shard [")
    summary = run_summary(run)
    assert (summary["updates"], summary["start_update"], summary["stopped_by_signal"]) == (300, 0, None)
    assert summary["rows_sampled"] == 300 * 64  # the learner's own count, in its buffer state
    assert len(summary["rows_per_shard"]) == 2 and min(summary["rows_per_shard"]) > 0, summary
    assert summary["episodes"] > 0 and summary["mean_recent_return"] > 0
    assert summary["actor_restarts"] == 0
    with dr.ReplayBuffer.open(run / "buffer") as union:
        assert union.shards == 2
        assert union.window()[1].tolist() == summary["rows_per_shard"]  # what the actors committed
    assert sorted(os.listdir(run / "checkpoints")) == ["update-00000250", "update-00000300"]  # the newest two


def test_actors_learner_restarts_a_killed_actor_and_stops_on_sigterm(tmp_path):
    pytest.importorskip("gymnasium")
    run, out = tmp_path / "run", []
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = start_actors_learner(run, example_env(tmp_path), err, "--updates", "100000")
        try:
            pid = int(wait_for_line(proc, r"actor 0 \(pid (\d+)\) opened shard 0 ", out)[1])
            committed_rows(run, proc, 0, more_than=0)
            os.kill(pid, signal.SIGKILL)  # actor 0 dies in the midst of writing: the main process restarts it
            wait_for_line(proc, rf"actor 0 \(pid {pid}\) exited with code -9: restarting it", out)
            reopened = wait_for_line(proc, r"actor 0 \(pid (\d+)\) opened shard 0 \((\d+) rows were committed", out)
            assert int(reopened[1]) != pid and int(reopened[2]) > 0  # the killed actor's commits are kept
            committed_rows(run, proc, 0, more_than=int(reopened[2]))  # the new actor 0 writes
            proc.send_signal(signal.SIGTERM)  # the main process only: it stops the learner, then the actors
            out.append(proc.communicate(timeout=600)[0])
        finally:
            kill_group(proc)
    out, stderr = "".join(out), (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 1, out + stderr
    assert f"took over the writer lock left by pid {pid} " in stderr
    summary = run_summary(run)
    assert (summary["stopped_by_signal"], summary["actor_restarts"]) == ("SIGTERM", 1)
    assert f"SIGTERM: stopped at update {summary['updates']}, checkpoint saved; run again to resume" in out
    assert sorted(os.listdir(run / "checkpoints"))[-1] == f"update-{summary['updates']:08d}"
    assert summary["rows_sampled"] == summary["updates"] * 64
    assert min(summary["rows_per_shard"]) > 0


def test_actors_learner_resumes_from_its_checkpoint_after_sigkill(tmp_path):
    pytest.importorskip("gymnasium")
    import time

    run, env, first_out = tmp_path / "run", example_env(tmp_path), []
    proc = start_actors_learner(run, env, subprocess.DEVNULL, "--updates", "100000")
    try:
        opened = set()
        while len(opened) < 2:  # every actor has its shard open (and its writer lock)...
            opened.add(wait_for_line(proc, r"actor \d+ \(pid \d+\) opened shard (\d+) ", first_out)[1])
        deadline = time.monotonic() + 600  # only so that a hung run fails instead of hanging the suite
        while not list((run / "checkpoints").glob("update-*")):  # ...and the learner checkpointed
            assert proc.poll() is None, "the run ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.05)
    finally:
        kill_group(proc)  # learner, actors and all, at no point in particular
        proc.stdout.close()
    saved = max(int(p.name.removeprefix("update-")) for p in (run / "checkpoints").glob("update-*"))
    assert saved > 0 and saved % 50 == 0
    with dr.ReplayBuffer.open(run / "buffer") as union:
        committed = union.window()[1]  # the rows the actors had committed when killed

    with open(tmp_path / "stderr.txt", "w") as err:
        restarted = start_actors_learner(run, env, err, "--updates", str(saved + 100))
        try:
            out = restarted.communicate(timeout=600)[0]
        finally:
            kill_group(restarted)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert restarted.returncode == 0, out + stderr
    assert f"resumed from checkpoint update-{saved:08d} at update {saved} " in out
    summary = run_summary(run)
    assert (summary["start_update"], summary["updates"]) == (saved, saved + 100)
    # the learner's buffer state came back with the networks: its rows-sampled count goes on from the checkpoint's
    assert summary["rows_sampled"] == (saved + 100) * 64
    # every actor reopened its shard (the killed one's lock taken over) and kept its committed rows
    assert stderr.count("took over the writer lock left by pid") == 2
    assert (np.asarray(summary["rows_per_shard"]) >= committed).all(), (summary, committed)
    assert sorted(os.listdir(run / "checkpoints"))[-1] == f"update-{saved + 100:08d}"
    assert not [name for name in os.listdir(run / "checkpoints") if name.startswith(".tmp-")]


def test_actors_learner_with_ray_actors(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("ray")
    run = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w") as err:
        proc, out = run_with_ray(tmp_path, lambda env: start_actors_learner(
            run, env, err, "--launcher", "ray", "--updates", "100"))
    assert proc.returncode == 0, out + (tmp_path / "stderr.txt").read_text()
    assert "actor 0 started (ray actor)" in out and "actor 1 started (ray actor)" in out
    summary = run_summary(run)
    assert (summary["updates"], summary["start_update"], summary["rows_sampled"]) == (100, 0, 100 * 64)
    assert len(summary["rows_per_shard"]) == 2 and min(summary["rows_per_shard"]) > 0, summary


def test_actors_learner_on_s3_keeps_the_buffer_across_runs(tmp_path, s3):
    """Rows on S3, weights, stop signal and returns through the launcher: the run folder holds only
    the learner's own files, and a second run resumes the first's buffer instead of creating one."""
    pytest.importorskip("gymnasium")
    run, url, options = tmp_path / "run", s3.new_url("apex"), s3.storage_options()
    flags = ["--url", url, "--storage-options", json.dumps(options)]
    rows = []
    for updates in (100, 150):
        with open(tmp_path / "stderr.txt", "w") as err:
            proc = start_actors_learner(run, example_env(tmp_path / str(updates)), err, *flags,
                                        "--updates", str(updates))
            try:
                out = proc.communicate(timeout=600)[0]
            finally:
                kill_group(proc)
        assert proc.returncode == 0, out + (tmp_path / "stderr.txt").read_text()
        summary = run_summary(run)
        assert summary["updates"] == updates and min(summary["rows_per_shard"]) > 0, summary
        rows.append(summary["rows_per_shard"])
    assert "resumed from checkpoint update-00000100 at update 100 " in out
    assert all(b > a for a, b in zip(*rows)), rows  # the second run added to the first run's rows
    assert sorted(os.listdir(run)) == ["checkpoints", "returns.txt", "summary.json"]
    with dr.ReplayBuffer.open(url, storage_options=options) as union:
        assert union.window()[1].tolist() == rows[-1]


def test_actors_learner_on_a_ray_cluster_with_rows_on_s3(tmp_path, s3, ray_cluster):
    """The actors run on a two-node Ray cluster; the rate limiter's counts live in a Ray actor, so
    no one writes or reads the learner's progress object in the store."""
    pytest.importorskip("gymnasium")
    run, url, options = tmp_path / "run", s3.new_url("apex"), s3.storage_options()
    env = {**example_env(tmp_path), **ray_cluster.auth, "RAY_ADDRESS": ray_cluster.address}
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = start_actors_learner(run, env, err, "--launcher", "ray", "--url", url, "--storage-options",
                                    json.dumps(options), "--updates", "100")
        try:
            out = proc.communicate(timeout=600)[0]
        finally:
            kill_group(proc)
    assert proc.returncode == 0, out + (tmp_path / "stderr.txt").read_text()
    assert "actor 0 started (ray actor)" in out and "actor 1 started (ray actor)" in out
    summary = run_summary(run)
    assert (summary["updates"], summary["rows_sampled"]) == (100, 100 * 64)
    # both actors ran (on a cluster one may start late and commit nothing before the stop)
    assert "opened shard 0 (0 rows" in out and "opened shard 1 (0 rows" in out
    assert sum(summary["rows_per_shard"]) >= 200 + 100 * 64 // 8 - 64 - 8 * 32, summary  # the limiter's bound
    assert sorted(os.listdir(run)) == ["checkpoints", "returns.txt", "summary.json"]
    keys = s3.keys(url)
    assert "zarr.json" in keys and not [key for key in keys if "learner" in key], sorted(keys)


def test_rllib_offline_trains_bc_from_a_buffer_through_ray_data(tmp_path):
    pytest.importorskip("gymnasium")
    pytest.importorskip("ray.rllib.algorithms.bc", exc_type=ImportError)  # not in .ci/lowest
    proc, out = run_with_ray(tmp_path, lambda env: subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "rllib_offline.py"), "--steps", "1000", "--iterations", "2",
         "--batch-size", "128", "--eval-episodes", "1", "--buffer", str(tmp_path / "cartpole")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True))
    assert proc.returncode == 0, out
    lines = [line for line in out.splitlines() if line.startswith(("1,000 expert", "iteration", "done"))]
    assert [line.split(":")[0] for line in lines] == [f"1,000 expert steps in {tmp_path / 'cartpole'}",
                                                      "iteration 1", "iteration 2", "done"]
    assert lines[-1].endswith(" over 1 episodes")
    with dr.ReplayBuffer.open(tmp_path / "cartpole") as buf:
        assert len(buf) == 1000 and buf.fields["obs"].shape == (4,)


def test_llm_rl_replay_survives_sigkill_of_generator_and_learner(tmp_path):
    script, run_dir = str(ROOT / "examples" / "llm_rl_replay.py"), tmp_path / "run"
    flags = ["--run-dir", str(run_dir), "--max-tokens", "200", "--max-lag", "3", "--group", "4"]
    env = example_env(tmp_path)

    def start(role, *more):
        return subprocess.Popen([sys.executable, script, role, *flags, *more], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def summary():
        try:
            return json.loads((run_dir / "summary.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    generator, learner = start("generator"), start("learner", "--steps", "100000")
    try:
        deadline = time.monotonic() + 240
        while summary().get("steps", 0) < 10:
            assert generator.poll() is None and learner.poll() is None, learner.stderr.read()
            assert time.monotonic() < deadline, "the learner took no 10 steps"
            time.sleep(0.05)
    finally:
        generator.send_signal(signal.SIGKILL)  # a kill -9 of each, at any point of its loop
        generator.wait()
        learner.send_signal(signal.SIGKILL)
        learner.wait()
    with dr.ReplayBuffer.open(run_dir / "buffer", "r") as buf:
        committed = len(buf)
        before = buf[np.arange(committed)]
    checkpoint = json.loads((run_dir / "learner.json").read_text())
    killed_at = checkpoint["step"]
    assert committed >= 4 and killed_at >= 10

    generator = start("generator")
    learner = start("learner", "--steps", str(killed_at + 15))
    assert learner.wait(timeout=240) == 0, learner.stderr.read()
    assert generator.wait(timeout=60) == 0, generator.stderr.read()  # it stops when the learner is done
    with dr.ReplayBuffer.open(run_dir / "buffer", "r") as buf:
        assert len(buf) > committed  # every committed rollout is still there, and new ones follow
        after = buf[np.arange(committed)]
    for name in ("prompt", "response", "logprobs"):
        assert after[name].offsets.tolist() == before[name].offsets.tolist()
        assert after[name].values.tolist() == before[name].values.tolist()
    assert after["version"].tolist() == before["version"].tolist()
    stats = summary()
    assert stats["starts"] == [0, killed_at]  # the learner resumed from its checkpoint
    assert stats["steps"] == stats["batches"] == killed_at + 15
    assert 0 < stats["max_batch_tokens"] <= stats["max_tokens"] == 200
    assert 0 <= stats["max_version_lag"] <= stats["max_lag"] == 3
