"""`save_snapshot` replaces a snapshot whole: a save killed with SIGKILL at any moment leaves the
previous snapshot or the new one, never a mix or a damaged one; one arrays file remains after a
save; snapshots from before tokened arrays files still load."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

import diskreplay as dr

FIELDS = {"obs": dr.Field((4,), "float32"), "done": dr.Field((), "bool")}
ARRAYS = re.compile(r"state-[0-9a-f]{16}\.safetensors")

SAVER = """
import hashlib, json, sys
import numpy as np
import diskreplay as dr

url, snap = sys.argv[1], sys.argv[2]
buf = dr.ReplayBuffer.open(url, "r", sampler=dr.Prioritized())
k = 0
while True:
    k += 1
    buf.sample(1)  # every snapshot differs: in its JSON part (the generator) and in its arrays
    buf.update_priorities(np.array([k % 3000]), np.array([1.0 + k]))
    state = buf.state_dict()
    leaves = hashlib.sha256(state["sampler"]["leaves"].tobytes()).hexdigest()
    print(json.dumps({"saving": k, "rng": state["rng"], "leaves": leaves}), flush=True)
    buf.save_snapshot(snap)
    print(json.dumps({"saved": k}), flush=True)
"""


def make_buffer(path) -> str:
    url = os.fspath(path)
    with dr.ReplayBuffer.create(url, FIELDS, capacity=4096, sampler=dr.Prioritized(), seed=4) as buf:
        buf.extend({"obs": np.random.default_rng(0).random((3000, 4), np.float32),
                    "done": np.arange(3000) % 50 == 49})
        buf.update_priorities(np.arange(0, 3000, 7), np.linspace(0.1, 5.0, 429))
    return url


def snapshot_state(snap) -> dict:
    """The generator and a digest of the priorities of the snapshot in ``snap``."""
    with dr.ReplayBuffer.load_snapshot(snap, mode="r") as buf:
        state = buf.state_dict()
    return {"rng": state["rng"], "leaves": hashlib.sha256(state["sampler"]["leaves"].tobytes()).hexdigest()}


def test_a_save_killed_at_any_moment_leaves_the_old_snapshot_or_the_new_one(tmp_path):
    url, snap = make_buffer(tmp_path / "buf"), tmp_path / "snap"
    rng = np.random.default_rng(11)
    for round_ in range(12):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, url, str(snap)], stdout=subprocess.PIPE, text=True)
        lines = []
        deadline = time.monotonic() + 60
        while len([line for line in lines if "saved" in line]) < 2 and time.monotonic() < deadline:
            lines.append(proc.stdout.readline())
        time.sleep(rng.uniform(0, 0.05))  # into a later save, at a random moment
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate()
        events = [json.loads(line) for line in lines + rest.splitlines() if line.strip()]
        saved = [e["saved"] for e in events if "saved" in e]
        states = {e["saving"]: {"rng": e["rng"], "leaves": e["leaves"]} for e in events if "saving" in e}
        last, in_flight = saved[-1], max(states)
        got = snapshot_state(snap)
        assert got in (states[last], states[in_flight]), f"round {round_}: neither save {last} nor {in_flight}"
        arrays = [name for name in os.listdir(snap) if name.endswith(".safetensors")]
        assert 1 <= len(arrays) <= 2 and all(ARRAYS.fullmatch(name) for name in arrays), arrays


def test_a_save_keeps_one_arrays_file_and_loads_exactly(tmp_path):
    url, snap = make_buffer(tmp_path / "buf"), tmp_path / "snap"
    with dr.ReplayBuffer.open(url, "r", sampler=dr.Prioritized()) as buf:
        buf.sample(3)
        buf.save_snapshot(snap)
        first = sorted(os.listdir(snap))
        buf.sample(3)
        buf.save_snapshot(snap)
        names = sorted(os.listdir(snap))
        want = [buf.sample(16)["index"] for _ in range(3)]
    assert len(names) == 2 and ARRAYS.fullmatch(names[0]) and names[1] == "state.json" and names != first
    assert json.loads((snap / "state.json").read_text())["arrays"] == names[0]
    with dr.ReplayBuffer.load_snapshot(snap, mode="r") as restored:
        for expected in want:
            np.testing.assert_array_equal(restored.sample(16)["index"], expected)


def test_a_snapshot_from_before_tokened_arrays_files_loads_and_is_replaced(tmp_path):
    url, snap = make_buffer(tmp_path / "buf"), tmp_path / "snap"
    with dr.ReplayBuffer.open(url, "r", sampler=dr.Prioritized()) as buf:
        buf.save_snapshot(snap)
        want = buf.sample(16)["index"]
    meta = json.loads((snap / "state.json").read_text())
    os.rename(snap / meta.pop("arrays"), snap / "state.safetensors")  # the layout before tokens
    (snap / "state.json").write_text(json.dumps(meta))
    with dr.ReplayBuffer.load_snapshot(snap, mode="r") as restored:
        np.testing.assert_array_equal(restored.sample(16)["index"], want)
        restored.save_snapshot(snap)
    assert not (snap / "state.safetensors").exists() and len(os.listdir(snap)) == 2
    shutil.rmtree(snap)
