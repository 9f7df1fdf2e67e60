"""Stable-Baselines3 DQN with its replay buffer on disk, checkpointed together: kill it, rerun it.

    python examples/recipes/sb3_checkpoint.py --workdir runs/sb3            # kill it at any time, rerun
    python examples/recipes/sb3_checkpoint.py --workdir runs/sb3 --steps 100000 --save-every 10000

``--workdir`` holds ``buffer/`` (the `dr.sb3.DiskReplayBuffer`'s rows) and
``models/rl_model_<steps>_steps.zip`` (SB3's checkpoints). `dr.sb3.CheckpointCallback` saves the
model every ``--save-every`` steps and only then commits the buffer, which commits at no other
time: after a kill the buffer holds the newest checkpoint's steps but its last one (SB3 stores a
step after its callbacks ran), never rows the model has not seen. On start the newest checkpoint
is loaded; the model reopens its buffer from the url saved in it (the writer lock the killed run
left is taken over, with a warning) and goes on in a fresh episode. A kill loses the steps since
the newest checkpoint.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import gymnasium as gym
from stable_baselines3 import DQN
from stable_baselines3.common.callbacks import BaseCallback, CallbackList

import diskreplay as dr


class SayCheckpoint(BaseCallback):
    """Print a line after each checkpoint (after `dr.sb3.CheckpointCallback`, which runs first)."""

    def __init__(self, save_every: int):
        super().__init__()
        self.save_every = save_every

    def _on_step(self) -> bool:
        if self.n_calls % self.save_every == 0:
            print(f"checkpoint at step {self.num_timesteps}", flush=True)
        return True


def newest_checkpoint(models: str) -> str | None:
    found = glob.glob(os.path.join(models, "rl_model_*_steps.zip"))
    return max(found, key=lambda p: int(re.findall(r"(\d+)_steps", p)[-1])) if found else None


def main(argv: list[str] | None = None) -> DQN:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/sb3_checkpoint", help="buffer/ and models/")
    p.add_argument("--steps", type=int, default=2000, help="train until this many env steps in all")
    p.add_argument("--save-every", type=int, default=500, help="checkpoint period (env steps)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    models, env = os.path.join(args.workdir, "models"), gym.make("CartPole-v1")
    saved = newest_checkpoint(models)
    if saved:
        model = DQN.load(saved, env=env)  # its replay buffer reopens the rows at the url saved in it
        with dr.ReplayBuffer.open(model.replay_buffer_kwargs["url"]) as rows:
            print(f"resumed from {os.path.basename(saved)}: {model.num_timesteps} steps, "
                  f"{len(rows)} rows in the buffer", flush=True)
    else:
        model = DQN("MlpPolicy", env, learning_starts=200, train_freq=4, buffer_size=100_000,
                    policy_kwargs=dict(net_arch=[64, 64]), seed=args.seed,
                    replay_buffer_class=dr.sb3.DiskReplayBuffer,
                    replay_buffer_kwargs={"url": os.path.abspath(os.path.join(args.workdir, "buffer"))})
    callback = CallbackList([dr.sb3.CheckpointCallback(save_freq=args.save_every, save_path=models),
                             SayCheckpoint(args.save_every)])
    model.learn(max(0, args.steps - model.num_timesteps), callback=callback, reset_num_timesteps=False)
    model.save(os.path.join(models, f"rl_model_{model.num_timesteps}_steps"))
    model.replay_buffer.close()  # commits the rows since the last checkpoint
    with dr.ReplayBuffer.open(model.replay_buffer_kwargs["url"]) as rows:
        print(f"done: {model.num_timesteps} steps, {len(rows)} rows in the buffer", flush=True)
    return model


if __name__ == "__main__":
    main()
