"""DQN on CartPole-v1 with its replay buffer on disk: kill it at any time, run it again to resume.

    python examples/online_dqn.py --workdir runs/dqn --steps 20000     # Ctrl-C / kill, then rerun

State lives in ``--workdir``: ``buffer/`` (a diskreplay ring buffer) and ``checkpoint.pt`` (networks,
optimizer, step counter). A checkpoint first flushes the buffer (a durable commit), then atomically
replaces checkpoint.pt. On restart the buffer is reopened with ``mode="r+"`` (its rows, sampler and
generator state come back; the writer lock a killed run left is taken over, with a warning) and
training continues from the checkpoint's step in a fresh episode. The episode the kill cut is
closed as truncated (``continue_episodes=False``): its last stored step gets ``truncated=True`` and
the episode index ends it there, so the fresh episode never merges with it.
"""

from __future__ import annotations

import argparse
import os

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import diskreplay as dr

FIELDS = {"obs": dr.Field((4,), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "next_obs": dr.Field((4,), "float32"), "terminated": dr.Field((), "bool"),
          "truncated": dr.Field((), "bool")}


def qnet() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/online_dqn", help="buffer + checkpoint folder")
    p.add_argument("--steps", type=int, default=2000, help="train until this many env steps in total")
    p.add_argument("--learning-starts", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=1000, help="checkpoint period (env steps)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    os.makedirs(args.workdir, exist_ok=True)
    buffer_path = os.path.join(args.workdir, "buffer")
    ckpt_path = os.path.join(args.workdir, "checkpoint.pt")
    torch.manual_seed(args.seed)
    q, target = qnet(), qnet()
    optimizer = torch.optim.Adam(q.parameters(), lr=5e-4)
    step, returns = 0, []
    try:
        buf = dr.ReplayBuffer.open(buffer_path, mode="r+", continue_episodes=False)
    except dr.NotABufferError:
        buf = dr.ReplayBuffer.create(buffer_path, FIELDS, capacity=100_000, chunk_rows=1024, seed=args.seed)
        target.load_state_dict(q.state_dict())
    else:
        if os.path.exists(ckpt_path):
            ckpt = torch.load(ckpt_path)
            q.load_state_dict(ckpt["q"]), target.load_state_dict(ckpt["target"])
            optimizer.load_state_dict(ckpt["optimizer"])
            step, returns = ckpt["step"], ckpt["returns"]
        print(f"resumed at step {step} with {len(buf):,} rows in the buffer; a new episode starts "
              f"(the one the stop cut is closed as truncated)")

    def checkpoint() -> None:
        buf.flush()  # rows first: a checkpoint never refers to rows the buffer lost
        torch.save({"q": q.state_dict(), "target": target.state_dict(), "optimizer": optimizer.state_dict(),
                    "step": step, "returns": returns}, ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)

    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=args.seed + step)
    rng = np.random.default_rng(args.seed + step)
    episode_return = 0.0
    try:
        while step < args.steps:
            epsilon = max(0.05, 1.0 - step / 5000)
            if rng.random() < epsilon:
                action = int(rng.integers(2))
            else:
                with torch.no_grad():
                    action = int(q(torch.as_tensor(obs)).argmax())
            next_obs, reward, terminated, truncated, _ = env.step(action)
            buf.add(obs=obs, action=action, reward=reward, next_obs=next_obs, terminated=terminated,
                    truncated=truncated)
            episode_return += reward
            obs = next_obs
            if terminated or truncated:
                returns.append(episode_return)
                obs, episode_return = env.reset()[0], 0.0
            step += 1

            if step >= args.learning_starts and len(buf) >= args.batch_size:
                b = {k: torch.as_tensor(v) for k, v in buf.sample(args.batch_size).items()}
                with torch.no_grad():
                    best_next = target(b["next_obs"]).max(1).values
                    y = b["reward"] + 0.99 * (~b["terminated"]).float() * best_next
                q_taken = q(b["obs"]).gather(1, b["action"][:, None]).squeeze(1)
                loss = nn.functional.smooth_l1_loss(q_taken, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            if step % 250 == 0:
                target.load_state_dict(q.state_dict())
            if step % args.save_every == 0:
                checkpoint()
                recent = np.mean(returns[-20:]) if returns else float("nan")
                print(f"step {step:6d}  episodes {len(returns):4d}  mean return (last 20) {recent:6.1f}  "
                      f"buffer rows {len(buf):,}")
    except KeyboardInterrupt:
        print(f"interrupted at step {step}: saving; run again to resume")
    checkpoint()
    buf.close()
    print(f"done: step {step}, {len(returns)} episodes, buffer at {buffer_path}")
    return step


if __name__ == "__main__":
    main()
