"""Checkpointed training: the model, the optimizer and the data loader's position in ONE file.

    python examples/recipes/checkpointed_training.py --workdir runs/ckpt          # kill it, rerun: it resumes
    python examples/recipes/checkpointed_training.py --workdir runs/ckpt --rows 1000000 --steps 100000 --workers 4

``--workdir`` holds ``dataset/`` (a diskreplay buffer: made once, synthetic rows, unless
``--dataset URL`` names one) and ``checkpoint.pt``. Every ``--save-every`` steps the script
writes the networks, the optimizer, torch's generator and ``loader.state_dict()`` (a few ints)
to a temporary file, fsyncs it and renames it over ``checkpoint.pt``: a kill leaves the old
checkpoint or the new one, whole. On start it loads ``checkpoint.pt`` when there is one, and
the loader goes on with the batch after the checkpoint's: the resumed run sees exactly the
batches, and ends with exactly the parameters, of a run that was never stopped (on the same
torch threads and ``--workers``). A kill loses the steps since the last checkpoint, no more.

``--log FILE`` appends ``step <n>: <row ids of its batch>`` for every step (the recipe's test
compares these lines with an uninterrupted run's).
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from typing import Any

import numpy as np
import torch
from torch import nn

import diskreplay as dr


def make_synthetic(url: str, rows: int, seed: int = 0) -> None:
    """A dataset of ``rows`` (obs, action) pairs, actions from a fixed "expert" policy."""
    rng = np.random.default_rng(seed)
    expert = rng.normal(size=(8, 2)) / np.sqrt(8)
    obs = rng.normal(size=(rows, 8)).astype(np.float32)
    fields = {"obs": dr.Field((8,), "float32"), "action": dr.Field((2,), "float32")}
    with dr.ReplayBuffer.create(url, fields, capacity=None, chunk_rows=1024, overwrite=True) as buf:
        buf.extend({"obs": obs, "action": np.tanh(obs @ expert)})


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    """Write ``state`` to a temporary file beside ``path``, fsync it and rename it over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-checkpoint-")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)  # the rename itself survives a power loss
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def train(url: str, checkpoint: str, steps: int, save_every: int, batch_size: int = 256, workers: int = 0,
          seed: int = 0, log: str | None = None) -> nn.Module:
    """Behaviour cloning (obs -> action) on the buffer at ``url`` for ``steps`` steps in all,
    resuming from ``checkpoint`` when it exists. Returns the policy."""
    torch.manual_seed(seed)
    with dr.ReplayBuffer.open(url) as buf:
        obs_dim, act_dim = buf.fields["obs"].shape[0], buf.fields["action"].shape[0]
        policy = nn.Sequential(nn.Linear(obs_dim, 64), nn.ReLU(), nn.Linear(64, act_dim))
        optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
        # epoch mode: every row once per epoch, shuffled; each iter(loader) is the next epoch
        loader = dr.Loader(buf.as_dataset(batch_size, mode="epoch", shuffle=True, seed=seed), num_workers=workers)
        step = 0
        for leftover in glob.glob(os.path.join(os.path.dirname(os.path.abspath(checkpoint)), ".tmp-checkpoint-*")):
            os.unlink(leftover)  # from a save a kill interrupted
        if os.path.exists(checkpoint):
            state = torch.load(checkpoint, weights_only=True)
            policy.load_state_dict(state["policy"])
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
            loader.load_state_dict(state["loader"])  # the batch after the checkpoint's comes next
            step = state["step"]
            print(f"resumed at step {step}", flush=True)
        logfile = open(log, "a") if log else None
        try:
            while step < steps:
                for batch in loader:
                    loss = nn.functional.mse_loss(policy(batch["obs"]), batch["action"])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    step += 1
                    if logfile:
                        logfile.write(f"step {step}: {' '.join(map(str, batch['index'].tolist()))}\n")
                        logfile.flush()
                    if step % save_every == 0 or step == steps:
                        save_checkpoint(checkpoint, {
                            "step": step, "policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                            "torch_rng": torch.get_rng_state(), "loader": loader.state_dict()})
                        print(f"step {step}: loss {loss.item():.4f}, checkpoint saved", flush=True)
                    if step == steps:
                        break
        finally:
            if logfile:
                logfile.close()
    return policy


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The options of `train`, which the offline RL recipe shares."""
    p.add_argument("--steps", type=int, default=200, help="train until this many steps in all")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint period (steps)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (resume inside an epoch: the same)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log", help="append every step's batch row ids to this file")


def main(argv: list[str] | None = None) -> nn.Module:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/checkpointed_training", help="dataset and checkpoint.pt")
    p.add_argument("--dataset", help="a diskreplay buffer with 'obs' and 'action' (default: a synthetic one)")
    p.add_argument("--rows", type=int, default=4096, help="rows of the synthetic dataset")
    add_training_args(p)
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    url = args.dataset
    if url is None:
        url = os.path.join(args.workdir, "dataset")
        try:
            with dr.ReplayBuffer.open(url) as buf:
                made = len(buf) > 0  # its rows are committed at the end, all at once
        except dr.NotABufferError:
            made = False
        if not made:  # first run (or one killed while it made the dataset)
            make_synthetic(url, args.rows, args.seed)
    policy = train(url, os.path.join(args.workdir, "checkpoint.pt"), args.steps, args.save_every,
                   args.batch_size, args.workers, args.seed, args.log)
    print(f"done: {args.steps} steps", flush=True)
    return policy


if __name__ == "__main__":
    main()
