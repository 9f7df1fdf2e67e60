"""The examples: short runs with small flags (offline BC over several epochs, DQN killed and resumed)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import logged

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
