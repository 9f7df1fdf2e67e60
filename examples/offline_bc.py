"""Behaviour cloning on an offline dataset imported into a diskreplay buffer.

    python examples/offline_bc.py                      # synthetic D4RL-style dataset, 2000 steps
    python examples/offline_bc.py --dataset hopper-medium-v2.hdf5 --steps 20000

The dataset (any format `diskreplay import` reads) is imported once into ``<workdir>/dataset.zarr``
and then iterated, epoch after epoch (``set_epoch`` before each), through a torch DataLoader over
`ReplayBuffer.as_dataset`, until ``--steps`` gradient steps are done. Without ``--workdir`` the
buffer goes to a temp dir that is removed at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile

import numpy as np
import torch
from torch import nn

import diskreplay as dr
from diskreplay.offline import import_dataset


def make_synthetic(path: str, rows: int = 20_000, obs_dim: int = 11, act_dim: int = 3, seed: int = 0) -> None:
    """A D4RL-layout HDF5 file whose actions come from a fixed nonlinear "expert" policy."""
    import h5py

    rng = np.random.default_rng(seed)
    expert = rng.normal(size=(obs_dim, act_dim)) / np.sqrt(obs_dim)
    obs = rng.normal(size=(rows, obs_dim)).astype(np.float32)
    actions = np.tanh(obs @ expert + 0.05 * rng.normal(size=(rows, act_dim))).astype(np.float32)
    terminals = rng.random(rows) < 0.002
    timeouts = (np.arange(rows) % 1000 == 999) & ~terminals
    with h5py.File(path, "w") as f:
        f["observations"], f["actions"] = obs, actions
        f["rewards"] = -np.square(actions).sum(1).astype(np.float32)
        f["terminals"], f["timeouts"] = terminals, timeouts


def train(buf: dr.ReplayBuffer, steps: int, batch_size: int, seed: int) -> tuple[int, int, float]:
    """``steps`` gradient steps of behaviour cloning, epoch after epoch over every row (shuffled
    chunk-aware). Returns (steps done, epochs started, last loss)."""
    if len(buf) == 0:
        raise ValueError(f"the dataset at {buf.url!r} has no rows to train on")
    obs_dim, act_dim = buf.fields["obs"].shape[0], buf.fields["action"].shape[0]
    torch.manual_seed(seed)
    policy = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                           nn.Linear(256, act_dim), nn.Tanh())
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
    dataset = buf.as_dataset(batch_size=batch_size, mode="epoch", shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None)
    step, epoch, loss = 0, 0, torch.tensor(float("nan"))
    while step < steps:
        dataset.set_epoch(epoch)
        for batch in itertools.islice(loader, steps - step):
            loss = nn.functional.mse_loss(policy(batch["obs"].float()), batch["action"].float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % max(1, steps // 10) == 0:
                print(f"step {step:6d}  epoch {epoch}  bc loss {loss.item():.4f}")
        epoch += 1
    return step, epoch, float(loss.item())


def main(argv: list[str] | None = None) -> int:
    """Run the example; returns the number of gradient steps done (``--steps``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", help="dataset to import (default: a synthetic D4RL-style file)")
    parser.add_argument("--rows", type=int, default=20_000, help="rows of the synthetic dataset")
    parser.add_argument("--workdir", help="where the buffer goes, kept (default: a temp dir, removed at the end)")
    parser.add_argument("--steps", type=int, default=2000, help="gradient steps")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        return run(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="offline-bc-") as workdir:
        return run(args, workdir)


def run(args: argparse.Namespace, workdir: str) -> int:
    """Import the dataset into ``<workdir>/dataset.zarr`` and train on it; returns the steps done."""
    source = args.dataset
    if source is None:
        source = os.path.join(workdir, "synthetic.hdf5")
        make_synthetic(source, rows=args.rows, seed=args.seed)
    with import_dataset(source, os.path.join(workdir, "dataset.zarr"), overwrite=True) as buf:
        print(f"{len(buf):,} rows from {source}; obs {buf.fields['obs'].shape[0]}-d, "
              f"action {buf.fields['action'].shape[0]}-d")
        steps, epochs, loss = train(buf, args.steps, args.batch_size, args.seed)
    print(f"done: {steps} steps in {epochs} epochs, bc loss {loss:.4f}")
    return steps


if __name__ == "__main__":
    main()
