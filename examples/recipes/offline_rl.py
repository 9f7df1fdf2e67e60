"""Offline RL: import a D4RL / Minari / LeRobot dataset once, train behaviour cloning on it with exact resume.

    python examples/recipes/offline_rl.py                                   # a small synthetic D4RL file
    python examples/recipes/offline_rl.py --dataset hopper-medium-v2.hdf5 --workdir runs/hopper --steps 100000
    python examples/recipes/offline_rl.py --dataset ~/.minari/datasets/D4RL/pen/human-v2 --workdir runs/pen
    python examples/recipes/offline_rl.py --dataset pusht/ --workdir runs/pusht    # pip install "diskreplay[parquet]"

The dataset (any source `dr.import_dataset` reads: a D4RL-layout HDF5 file, a Minari dataset
folder, LeRobot / Hugging Face Parquet, ``.npz``...) is imported once into
``<workdir>/dataset.zarr``; a rerun opens it instead (an import that was killed left nothing
there, and runs again). Training is `checkpointed_training.train` (the recipe beside this one):
behaviour cloning, ``obs`` -> ``action``, through a `dr.Loader` with ``--workers`` DataLoader
workers, checkpointed with the loader's position every ``--save-every`` steps. Kill it and run
it again: it goes on with the batch after the last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import diskreplay as dr

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpointed_training import add_training_args, train


def make_d4rl_file(path: str, rows: int = 5000, seed: int = 0) -> None:
    """A D4RL-layout HDF5 file (hopper-sized: 11-d observations, 3-d actions in [-1, 1])."""
    import h5py

    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((rows, 11)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["observations"] = obs
        f["actions"] = np.tanh(obs[:, :3] - obs[:, 3:6]).astype(np.float32)  # the "expert"
        f["rewards"] = rng.random(rows).astype(np.float32)
        f["terminals"] = np.arange(rows) % 1000 == 999
        f["timeouts"] = np.zeros(rows, bool)


def imported(source: str, dest: str) -> str:
    """``dest``, importing ``source`` there unless a finished import is there already."""
    try:
        with dr.ReplayBuffer.open(dest) as buf:
            print(f"{dest}: {len(buf):,} rows, imported before")
    except dr.NotABufferError:
        with dr.import_dataset(source, dest, compression="zstd", progress=False, overwrite=True) as buf:
            print(f"{dest}: {len(buf):,} rows imported from {source} ({len(buf.episodes())} episodes)")
    return dest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", help="what to import (default: a synthetic D4RL-layout file in --workdir)")
    p.add_argument("--workdir", default="runs/offline_rl", help="dataset.zarr and checkpoint.pt")
    add_training_args(p)
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    source = args.dataset
    if source is None:
        source = os.path.join(args.workdir, "synthetic-d4rl.hdf5")
        if not os.path.exists(source):
            make_d4rl_file(source)
    url = imported(source, os.path.join(args.workdir, "dataset.zarr"))
    train(url, os.path.join(args.workdir, "checkpoint.pt"), args.steps, args.save_every, args.batch_size,
          args.workers, args.seed, args.log)
    print(f"done: {args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
