"""Behavior cloning with RLlib's offline API, reading a diskreplay buffer through Ray Data.

    python examples/rllib_offline.py                      # a local Ray instance
    python examples/rllib_offline.py --address auto       # the Ray cluster this machine belongs to

1. CartPole steps of a simple expert (push the cart the way the pole falls) are written into a
   diskreplay buffer: ``obs``, ``action``, ``reward``, ``next_obs``, ``terminated``, ``truncated``.
2. RLlib's BC (new API stack) trains on it: its `OfflineData` reads the buffer with
   `diskreplay.ray.read_buffer` (`BufferOfflineData`), and ``input_read_schema`` maps the buffer's
   field names onto RLlib's columns. Each training iteration prints the BC loss.
3. RLlib evaluates the learned policy in CartPole after the last iteration (mean episode return).

On a cluster the buffer must be where every node reaches it (a shared file system, or s3://...:
``--buffer s3://bucket/cartpole`` with credentials in the environment). Needs ``pip install
"diskreplay[ray]" "ray[rllib]" torch``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import ray
from ray.rllib.algorithms.bc import BCConfig
from ray.rllib.core.columns import Columns
from ray.rllib.offline.offline_data import OfflineData

import diskreplay as dr
from diskreplay.ray import read_buffer

FIELDS = {"obs": dr.Field((4,), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "next_obs": dr.Field((4,), "float32"), "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
SCHEMA = {Columns.OBS: "obs", Columns.ACTIONS: "action", Columns.REWARDS: "reward", Columns.NEXT_OBS: "next_obs",
          Columns.TERMINATEDS: "terminated", Columns.TRUNCATEDS: "truncated"}


def expert(obs: np.ndarray) -> int:
    """Push the cart the way the pole falls: right (1) when angle + angular velocity lean right."""
    return int(obs[2] + 0.5 * obs[3] > 0)


def record(url: str, steps: int, seed: int) -> dr.ReplayBuffer:
    """``steps`` CartPole steps of `expert` in a new buffer at ``url`` (its writer, committed)."""
    env = gym.make("CartPole-v1", max_episode_steps=200)
    buf = dr.ReplayBuffer.create(url, FIELDS, overwrite=True, chunk_rows=1024)
    obs, _ = env.reset(seed=seed)
    for _ in range(steps):
        action = expert(obs)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        buf.add(obs=obs, action=action, reward=reward, next_obs=next_obs, terminated=terminated, truncated=truncated)
        obs = env.reset()[0] if terminated or truncated else next_obs
    buf.flush()
    env.close()
    return buf


class BufferOfflineData(OfflineData):  # type: ignore[misc]
    """RLlib's offline data read from a diskreplay buffer: ``config.input_`` is the buffer's
    location, ``input_read_method_kwargs`` are `read_buffer`'s keyword arguments."""

    def __init__(self, config: Any):
        # OfflineData reads ``ray.data.<input_read_method>(input_)``: let it read nothing (an empty
        # list of items), keep the rest of its set-up, then read the buffer instead.
        empty = config.copy(copy_frozen=False)
        empty.input_, empty.input_read_method, empty.input_read_method_kwargs = [], "from_items", {}
        super().__init__(empty)
        self.config, self.path = config, config.input_
        self.data = read_buffer(config.input_, **config.input_read_method_kwargs)


def train(url: str, iterations: int, batch_size: int, episodes: int, seed: int) -> float:
    """BC on the buffer at ``url``; returns the mean return of the last evaluation (the policy
    RLlib learned, run greedily in CartPole for ``episodes`` episodes)."""
    config = (
        BCConfig()
        .environment("CartPole-v1")  # its spaces, and the evaluation's env; the data come from the buffer
        .offline_data(input_=url, offline_data_class=BufferOfflineData, input_read_schema=SCHEMA,
                      input_read_method_kwargs={"override_num_blocks": 2},
                      map_batches_kwargs={"concurrency": 1, "num_cpus": 1},
                      iter_batches_kwargs={"prefetch_batches": 1}, dataset_num_iters_per_learner=1)
        .training(train_batch_size_per_learner=batch_size, lr=3e-3)
        .learners(num_learners=0)
        .env_runners(num_env_runners=0)
        .evaluation(evaluation_interval=iterations, evaluation_num_env_runners=0, evaluation_duration=episodes,
                    evaluation_config=BCConfig.overrides(explore=False))
        .debugging(seed=seed)
    )
    algo = config.build_algo()
    try:
        for i in range(iterations):
            result = algo.train()
            print(f"iteration {i + 1}: bc loss {float(result['learners']['default_policy']['policy_loss']):.4f}",
                  flush=True)
        return float(result["evaluation"]["env_runners"]["episode_return_mean"])
    finally:
        algo.stop()


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default=None, help="a Ray cluster's address (default: a local Ray instance)")
    parser.add_argument("--buffer", default=None, help="where the buffer goes (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=5000, help="CartPole steps recorded")
    parser.add_argument("--iterations", type=int, default=20, help="BC training iterations")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--eval-episodes", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        url = args.buffer or str(Path(tmp) / "cartpole")
        record(url, args.steps, args.seed).close()
        print(f"{args.steps:,} expert steps in {url}", flush=True)
        ray.init(address=args.address or "local", num_cpus=None if args.address else 2, include_dashboard=False,
                 log_to_driver=False)
        try:
            score = train(url, args.iterations, args.batch_size, args.eval_episodes, args.seed)
        finally:
            ray.shutdown()
    print(f"done: mean return {score:.1f} over {args.eval_episodes} episodes")
    return score


if __name__ == "__main__":
    main()
