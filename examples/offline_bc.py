"""Behaviour cloning on an offline dataset imported into a diskreplay buffer.

    python examples/offline_bc.py                      # synthetic D4RL-style dataset, 2000 steps
    python examples/offline_bc.py --dataset hopper-medium-v2.hdf5 --steps 20000

The dataset (any format `diskreplay import` reads) is imported once into ``<workdir>/dataset.zarr``
and then iterated, epoch after epoch, through a torch DataLoader over `ReplayBuffer.as_dataset`.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np
import torch
from torch import nn

import diskreplay as dr
from diskreplay.importers import import_dataset


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


def minibatches(buf: dr.ReplayBuffer, batch_size: int, seed: int) -> torch.utils.data.DataLoader:
    """Every row once per epoch, shuffled chunk-aware, as collated batches of tensors."""
    dataset = buf.as_dataset(batch_size=batch_size, mode="epoch", shuffle=True, seed=seed)
    return torch.utils.data.DataLoader(dataset, batch_size=None)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", help="dataset to import (default: a synthetic D4RL-style file)")
    parser.add_argument("--workdir", help="where the buffer goes (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=2000, help="gradient steps")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    workdir = args.workdir or tempfile.mkdtemp(prefix="offline-bc-")
    os.makedirs(workdir, exist_ok=True)
    source = args.dataset
    if source is None:
        source = os.path.join(workdir, "synthetic.hdf5")
        make_synthetic(source, seed=args.seed)
    buf = import_dataset(source, os.path.join(workdir, "dataset.zarr"), overwrite=True)
    obs_dim, act_dim = buf.fields["obs"].shape[0], buf.fields["action"].shape[0]
    print(f"{len(buf):,} rows from {source}; obs {obs_dim}-d, action {act_dim}-d")

    torch.manual_seed(args.seed)
    policy = nn.Sequential(nn.Linear(obs_dim, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                           nn.Linear(256, act_dim), nn.Tanh())
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-4)
    loss = torch.tensor(float("nan"))
    for step, batch in enumerate(minibatches(buf, args.batch_size, args.seed), start=1):
        loss = nn.functional.mse_loss(policy(batch["obs"].float()), batch["action"].float())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % max(1, args.steps // 10) == 0 or step == args.steps:
            print(f"step {step:6d}  bc loss {loss.item():.4f}")
        if step >= args.steps:
            break
    buf.close()
    return float(loss.item())


if __name__ == "__main__":
    main()
