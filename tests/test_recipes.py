"""The recipes (examples/recipes/*.py, docs/recipes/*.md): each script run with small flags, killed
with SIGKILL where the recipe is about surviving one, and its promises checked exactly."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from s3server import s3

import diskreplay as dr

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "recipes"
torch = pytest.importorskip("torch")


def recipe_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A recipe's environment: this checkout's diskreplay, one torch thread (runs compared bit
    for bit must use the same), unbuffered output, temp files under ``tmp_path``."""
    os.makedirs(tmp_path / "tmp", exist_ok=True)
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp"), **extra}


def run_recipe(name: str, *args: str, env: dict[str, str], timeout: float = 300) -> str:
    """Run ``examples/recipes/<name>`` to completion; its stdout (it must exit 0)."""
    proc = subprocess.run([sys.executable, str(RECIPES / name), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def start_recipe(name: str, *args: str, env: dict[str, str]) -> subprocess.Popen:
    """``examples/recipes/<name>`` in a process group of its own (with its DataLoader workers), stdout piped."""
    return subprocess.Popen([sys.executable, str(RECIPES / name), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)


def kill_after_line(proc: subprocess.Popen, starts_with: str) -> list[str]:
    """SIGKILL the recipe's process group once it printed a line starting with ``starts_with``
    (or ended); the lines it printed."""
    lines = []
    try:
        while line := proc.stdout.readline():
            lines.append(line)
            if line.startswith(starts_with):
                break
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        proc.stdout.close()
    assert lines and lines[-1].startswith(starts_with), "".join(lines)
    return lines


def load_recipe(name: str):
    """``examples/recipes/<name>`` as a module (its ``main`` called in this process)."""
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), RECIPES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def same_state(a: dict, b: dict) -> bool:
    """Whether two checkpoint dicts hold bit-identical tensors and equal values, key by key."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            if not (isinstance(y, dict) and same_state(x, y)):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, list):
            if len(x) != len(y) or not all(same_state({0: u}, {0: v}) for u, v in zip(x, y)):
                return False
        elif x != y:
            return False
    return True


PAGES = {"examples/recipes/checkpointed_training.py": "docs/recipes/checkpointed-training.md",
         "examples/recipes/sb3_checkpoint.py": "docs/recipes/sb3.md",
         "examples/recipes/pixels.py": "docs/recipes/pixels.md",
         "examples/recipes/s3.py": "docs/recipes/s3.md",
         "examples/recipes/actors.py": "docs/recipes/actors.md",
         "examples/recipes/offline_rl.py": "docs/recipes/offline-rl.md"}


def test_every_recipe_is_embedded_by_its_page_and_listed_in_the_index():
    assert sorted(str(p.relative_to(ROOT)) for p in RECIPES.glob("*.py")) == sorted(PAGES)
    index = (ROOT / "docs" / "recipes" / "index.md").read_text()
    for script, page in PAGES.items():
        lines = (ROOT / page).read_text().splitlines()
        assert f'--8<-- "{script}"' in lines, page
        assert f"]({Path(page).name})" in index, page


# ---- checkpointed_training.py ----------------------------------------------------------------------


@pytest.mark.slow
def test_checkpointed_training_resumes_after_sigkill_with_the_batches_and_weights_of_an_unstopped_run(tmp_path):
    env = recipe_env(tmp_path)
    flags = ["--rows", "8192", "--batch-size", "128", "--save-every", "20", "--workers", "2"]  # 64 batches an epoch
    run, log = tmp_path / "run", tmp_path / "run" / "log.txt"
    proc = start_recipe("checkpointed_training.py", "--workdir", str(run), "--log", str(log), *flags,
                        "--steps", "100000", env=env)
    kill_after_line(proc, "step 20: ")  # a checkpoint is on disk (how many steps later the kill lands varies)
    saved = torch.load(run / "checkpoint.pt", weights_only=True)["step"]
    assert saved >= 20 and saved % 20 == 0, saved
    logged_before_kill = len(log.read_text().splitlines())
    assert logged_before_kill >= saved
    steps = saved + 100  # past the next epoch boundary whatever the checkpoint's place in its epoch
    ref = tmp_path / "reference"
    run_recipe("checkpointed_training.py", "--workdir", str(ref), "--log", str(ref / "log.txt"), *flags,
               "--steps", str(steps), env=env)

    out = run_recipe("checkpointed_training.py", "--workdir", str(run), "--log", str(log), *flags,
                     "--steps", str(steps), env=env)
    assert out.splitlines()[0] == f"resumed at step {saved}"
    assert out.splitlines()[-1] == f"done: {steps} steps"
    reference = ref.joinpath("log.txt").read_text().splitlines()
    resumed = log.read_text().splitlines()[logged_before_kill:]
    assert resumed == reference[saved:]  # steps saved+1 .. steps: the same rows, batch by batch
    final, expected = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (run, ref))
    assert final["step"] == expected["step"] == steps
    assert same_state(final, expected)  # policy, optimizer, torch generator and loader state, bit for bit
    assert sorted(os.listdir(run)) == ["checkpoint.pt", "dataset", "log.txt"]  # no temporary file left


# ---- sb3_checkpoint.py -----------------------------------------------------------------------------


@pytest.mark.slow
def test_sb3_checkpoint_after_sigkill_the_buffer_holds_the_checkpoints_steps_but_its_last(tmp_path):
    pytest.importorskip("stable_baselines3")
    env, run = recipe_env(tmp_path), tmp_path / "run"
    proc = start_recipe("sb3_checkpoint.py", "--workdir", str(run), "--steps", "100000", "--save-every", "200",
                        env=env)
    kill_after_line(proc, "checkpoint at step 200")  # printed once the buffer committed with the model
    saved = max(int(p.name.split("_")[2]) for p in (run / "models").glob("rl_model_*_steps.zip"))
    assert saved >= 200 and saved % 200 == 0
    with dr.ReplayBuffer.open(run / "buffer") as buf:
        rows = len(buf)
    # Never ahead of the model: the checkpoint's steps but its last one (SB3 stores a step after its
    # callbacks), or, if the kill fell between a model save and its commit, one checkpoint fewer.
    assert rows == saved - 1 or rows == saved - 201, (rows, saved)

    out = run_recipe("sb3_checkpoint.py", "--workdir", str(run), "--steps", str(saved + 300), "--save-every", "200",
                     env=env).splitlines()
    assert out[0] == f"resumed from rl_model_{saved}_steps.zip: {saved} steps, {rows} rows in the buffer"
    assert out[-1] == f"done: {saved + 300} steps, {rows + 300} rows in the buffer"
    with dr.ReplayBuffer.open(run / "buffer") as buf:
        episodes = buf.episodes()
        ends = episodes.start + episodes.length
        assert np.flatnonzero(ends == rows).size == 1  # the episode the kill cut ends there...
        assert np.flatnonzero(episodes.start == rows).size == 1  # ...and the resumed run starts a new one


# ---- pixels.py -------------------------------------------------------------------------------------


def test_pixels_prints_what_each_codec_stores_and_what_the_cache_did(capsys):
    load_recipe("pixels.py").main([])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "2,000 steps of 84x84 uint8 frames: 14,112,000 bytes raw"
    assert out[1] == "none   obs stored in   14,451,372 bytes ( 0.98x)"  # 16 whole chunks of 128 frames
    sizes = [int(line.split()[4].replace(",", "")) for line in out[1:5]]
    assert [line.split()[0] for line in out[1:5]] == ["none", "lz4", "lz4hc", "zstd"]
    assert sizes[0] > sizes[1] > sizes[2] > sizes[3]  # codec output may vary by version: its order does not
    shapes = "stack batch obs (32, 4, 84, 84), next_obs (32, 4, 84, 84); resident False, "
    assert out[5] == "none   " + shapes + ("mapped True (16 files), frames row by row False, chunks loaded 0, "
                                           "cached 0")
    for codec, line in zip(["lz4", "lz4hc", "zstd"], out[6:9]):  # 4 MiB: frames decoded row by row
        assert line == f"{codec:6s} " + shapes + ("mapped False (0 files), frames row by row True, chunks loaded 16, "
                                                  "cached 16")
    assert len(out) == 9


def test_pixels_with_a_cache_that_holds_them_reads_every_chunk_once(capsys):
    load_recipe("pixels.py").main(["--frames", "257", "--cache-mib", "64"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "256 steps of 84x84 uint8 frames: 1,806,336 bytes raw"
    for codec, line in zip(["none", "lz4", "lz4hc", "zstd"], out[5:]):
        assert line == (f"{codec:6s} stack batch obs (32, 4, 84, 84), next_obs (32, 4, 84, 84); resident True, "
                        f"mapped False (0 files), frames row by row False, chunks loaded 2, cached 2")


# ---- s3.py and the CLI against S3 ------------------------------------------------------------------


@pytest.mark.slow
def test_s3_recipe_and_the_cli_with_storage_options_or_aws_variables(s3, tmp_path):
    from s3server import CREDENTIALS

    url = s3.new_url("recipe")
    aws = {"AWS_ACCESS_KEY_ID": CREDENTIALS["key"], "AWS_SECRET_ACCESS_KEY": CREDENTIALS["secret"]}
    out = run_recipe("s3.py", url, "--endpoint-url", s3.endpoint, "--rows", "5000",
                     env=recipe_env(tmp_path, **aws))  # key and secret from the environment
    assert out.splitlines() == [f"wrote 5,000 rows to {url}",
                                "read back: 5,000 rows, 5 episodes, a batch of obs (256, 17), 2 chunks fetched"]
    assert "commit.json" in s3.keys(url + "/diskreplay/objects")  # the one PUT that made the rows visible

    def cli(*args: str, **extra: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in recipe_env(tmp_path).items() if not k.startswith("AWS_")}  # only those given
        return subprocess.run([sys.executable, "-m", "diskreplay", *args], capture_output=True, text=True,
                              env={**env, **extra}, timeout=120)

    options = ["--storage-option", f"endpoint_url={s3.endpoint}", "--storage-option", f"key={CREDENTIALS['key']}",
               "--storage-option", f"secret={CREDENTIALS['secret']}"]
    for done in (cli("info", url, *options), cli("info", url, AWS_ENDPOINT_URL=s3.endpoint, **aws)):
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[:2] == [f"buffer      {url}",
                                                "rows        5,000 in 1 lane; dataset mode (grows)"]
    verified = cli("verify", url, *options)
    assert verified.returncode == 0, verified.stderr
    missing = cli("info", url, AWS_ENDPOINT_URL=s3.endpoint)
    assert missing.returncode == 1
    assert f"{url}: no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in missing.stderr


# ---- actors.py: examples/actors_learner.py as one command per host ---------------------------------


@pytest.mark.slow
def test_actors_recipe_runs_create_then_two_actor_processes_and_a_learner(tmp_path):
    pytest.importorskip("gymnasium")
    env, run = recipe_env(tmp_path), tmp_path / "run"
    flags = ["--run-dir", str(run), "--actors", "2", "--batch-size", "64", "--learning-starts", "200",
             "--checkpoint-every", "50"]
    assert run_recipe("actors.py", "create", *flags, env=env) == f"{run / 'buffer'}: 2 shards\n"
    actors = [subprocess.Popen([sys.executable, str(RECIPES / "actors.py"), "actor", *flags, "--shard", str(i)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
              for i in range(2)]
    try:
        out = run_recipe("actors.py", "learner", *flags, "--updates", "100", env=env)
        actor_out = [proc.communicate(timeout=120)[0] for proc in actors]  # they stop at the stop file
    finally:
        for proc in actors:
            proc.kill()
            proc.wait()
    assert out.splitlines()[0] == "starting at update 0 with 2 shards"
    assert out.splitlines()[-1] == "learner done: 100 updates (this run from update 0)"
    assert [proc.returncode for proc in actors] == [0, 0]
    added = [int(text.splitlines()[-1].split()[3]) for text in actor_out]
    assert [text.splitlines()[-1] for text in actor_out] == [f"actor {i} done: {n} steps added"
                                                             for i, n in enumerate(added)]
    with dr.ReplayBuffer.open(run / "buffer") as union:
        assert union.window()[1].tolist() == added  # every step each actor added is committed, in its shard
    assert sorted(os.listdir(run / "checkpoints")) == ["update-00000050", "update-00000100"]


# ---- offline_rl.py ---------------------------------------------------------------------------------


def test_offline_rl_imports_once_and_resumes_exactly(tmp_path, capsys):
    pytest.importorskip("h5py")
    from test_docs import make_d4rl_file

    make_d4rl_file(tmp_path / "hopper.hdf5")  # 4 episodes of 250 steps, D4RL layout
    recipe = load_recipe("offline_rl.py")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        common = ["--dataset", str(tmp_path / "hopper.hdf5"), "--batch-size", "64", "--save-every", "10"]
        recipe.main(["--workdir", str(tmp_path / "whole"), "--log", str(tmp_path / "whole.txt"), "--steps", "40",
                     *common])
        recipe.main(["--workdir", str(tmp_path / "parts"), "--log", str(tmp_path / "parts.txt"), "--steps", "23",
                     *common])
        recipe.main(["--workdir", str(tmp_path / "parts"), "--log", str(tmp_path / "parts.txt"), "--steps", "40",
                     *common])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    dest = tmp_path / "parts" / "dataset.zarr"
    assert f"{dest}: 1,000 rows imported from {tmp_path / 'hopper.hdf5'} (4 episodes)\n" in out
    assert f"{dest}: 1,000 rows, imported before\nresumed at step 23\n" in out
    assert (tmp_path / "parts.txt").read_text() == (tmp_path / "whole.txt").read_text()  # 16 batches an epoch
    final, expected = (torch.load(tmp_path / d / "checkpoint.pt", weights_only=True) for d in ("parts", "whole"))
    assert final["step"] == 40 and same_state(final, expected)
