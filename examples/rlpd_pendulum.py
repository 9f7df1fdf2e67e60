"""RLPD-style SAC on Pendulum-v1: every batch half offline data, half the live online buffer.

    python examples/rlpd_pendulum.py --steps 5000 --workdir runs/rlpd

Offline-to-online RL as RLPD (Ball et al. 2023) does it: a fixed offline dataset is imported once
(here collected first by a noisy swing-up controller and written as a D4RL-style ``.npz``,
then ``dr.import_dataset``), and SAC trains from the first environment step on batches that a
``dr.Mixture`` draws half from the offline buffer and half from the online ring buffer the agent
writes (symmetric sampling), with LayerNorm critics and several updates per step (``--utd``).
Without ``--workdir`` everything goes to a temp dir, removed at the end.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import gymnasium as gym
import numpy as np
import torch
from torch import nn

import diskreplay as dr

OBS, ACT = 3, 1


def collect_offline(path: str, steps: int, seed: int) -> float:
    """``steps`` steps of a noisy swing-up controller (energy pumping, then balancing), written to ``path`` (.npz, D4RL
    column names); returns its mean episode return."""
    env = gym.make("Pendulum-v1")
    rng = np.random.default_rng(seed)
    cols: dict[str, list] = {k: [] for k in ("observations", "actions", "rewards", "next_observations",
                                            "terminals", "timeouts")}
    obs, _ = env.reset(seed=seed)
    returns, ret = [], 0.0
    for _ in range(steps):
        cos, sin, speed = obs
        energy = 0.5 * speed**2 + 15 * (cos - 1)  # 0 at rest upright (theta'' = 15 sin(theta) + 3 u)
        swing = 2.0 * np.sign(speed or 1.0) * np.sign(-energy or 1.0)  # pump energy in, or out
        torque = -(10 * np.arctan2(sin, cos) + 2 * speed) if cos > 0.9 else swing  # balance near the top
        action = np.clip(np.array([torque + rng.normal(0, 1.0)], np.float32), -2, 2)
        nxt, reward, terminated, truncated, _ = env.step(action)
        for key, value in zip(cols, (obs, action, reward, nxt, terminated, truncated)):
            cols[key].append(value)
        ret += float(reward)
        obs = nxt
        if terminated or truncated:
            returns.append(ret)
            ret, (obs, _) = 0.0, env.reset()
    np.savez(path, **{k: np.asarray(v, np.float32 if k not in ("terminals", "timeouts") else bool)
                      for k, v in cols.items()})
    return float(np.mean(returns)) if returns else ret


def mlp(inp: int, out: int, layer_norm: bool = False, hidden: int = 128) -> nn.Sequential:
    norm = [nn.LayerNorm(hidden)] if layer_norm else []
    return nn.Sequential(nn.Linear(inp, hidden), *norm, nn.ReLU(), nn.Linear(hidden, hidden), *norm, nn.ReLU(),
                         nn.Linear(hidden, out))


class Agent(nn.Module):
    """SAC: a tanh-Gaussian actor, two LayerNorm critics (RLPD's choice) and their targets."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = mlp(OBS, 2 * ACT)
        self.critics = nn.ModuleList([mlp(OBS + ACT, 1, layer_norm=True) for _ in range(2)])
        self.targets = nn.ModuleList([mlp(OBS + ACT, 1, layer_norm=True) for _ in range(2)])
        self.targets.load_state_dict(self.critics.state_dict())
        self.log_alpha = nn.Parameter(torch.zeros(()))

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        mean, log_std = self.actor(obs).chunk(2, dim=-1)
        std = log_std.clamp(-5, 2).exp()
        u = mean if deterministic else mean + std * torch.randn_like(mean)
        squash = 2 * (np.log(2) - u - nn.functional.softplus(-2 * u))  # log(1 - tanh(u)^2)
        logp = torch.distributions.Normal(mean, std).log_prob(u).sum(-1) - squash.sum(-1)
        return 2.0 * torch.tanh(u), logp

    def q(self, nets: nn.ModuleList, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, action / 2.0], -1)
        return torch.stack([net(x).squeeze(-1) for net in nets])


def update(agent: Agent, optims: list[torch.optim.Optimizer], batch: dict[str, torch.Tensor],
           gamma: float = 0.99, tau: float = 0.005) -> float:
    """One SAC update on a batch; returns the critic loss."""
    obs, action, reward, nxt = batch["obs"], batch["action"], batch["reward"], batch["next_obs"]
    alpha = agent.log_alpha.exp().detach()
    with torch.no_grad():
        next_action, next_logp = agent.act(nxt)
        target_q = agent.q(agent.targets, nxt, next_action).min(0).values - alpha * next_logp
        target = reward + gamma * (1.0 - batch["terminated"].float()) * target_q
    critic_loss = ((agent.q(agent.critics, obs, action) - target) ** 2).mean()
    optims[0].zero_grad()
    critic_loss.backward()
    optims[0].step()
    new_action, logp = agent.act(obs)
    actor_loss = (alpha * logp - agent.q(agent.critics, obs, new_action).min(0).values).mean()
    optims[1].zero_grad()
    actor_loss.backward()
    optims[1].step()
    alpha_loss = -(agent.log_alpha * (logp.detach() - ACT).mean())  # target entropy: -|A|
    optims[2].zero_grad()
    alpha_loss.backward()
    optims[2].step()
    with torch.no_grad():
        for p, tp in zip(agent.critics.parameters(), agent.targets.parameters()):
            tp.lerp_(p, tau)
    return critic_loss.item()


def train(args: argparse.Namespace, offline: dr.ReplayBuffer, online: dr.ReplayBuffer) -> dict[str, float]:
    """Online SAC on batches mixed 50/50 from both buffers; returns a summary."""
    torch.manual_seed(args.seed)
    agent = Agent()
    optims = [torch.optim.Adam(agent.critics.parameters(), lr=1e-3), torch.optim.Adam(agent.actor.parameters(),
              lr=1e-3), torch.optim.Adam([agent.log_alpha], lr=1e-3)]
    mix = dr.Mixture({"offline": offline, "online": online}, weights={"offline": 0.5, "online": 0.5}, seed=args.seed)
    rows = np.zeros(2, np.int64)  # rows sampled from each source
    env = gym.make("Pendulum-v1")
    obs, _ = env.reset(seed=args.seed)
    returns, ret, loss = [], 0.0, float("nan")
    for step in range(1, args.steps + 1):
        with torch.no_grad():
            action = agent.act(torch.as_tensor(obs, dtype=torch.float32))[0].numpy()
        nxt, reward, terminated, truncated, _ = env.step(action)
        online.add(obs=obs, action=action, reward=reward, next_obs=nxt, terminated=terminated, truncated=truncated)
        ret, obs = ret + float(reward), nxt
        if terminated or truncated:
            returns.append(ret)
            ret, (obs, _) = 0.0, env.reset()
            print(f"step {step:6d}  episode {len(returns):3d}  return {returns[-1]:8.1f}  critic loss {loss:.3f}")
        for _ in range(args.utd):
            batch = mix.sample(args.batch_size, format="torch")  # half offline, half online rows
            rows += np.bincount(batch["source"].numpy(), minlength=2)
            loss = update(agent, optims, batch)
    online.flush()
    return {"steps": args.steps, "updates": args.steps * args.utd, "offline_rows": int(rows[0]),
            "online_rows": int(rows[1]), "mean_return": float(np.mean(returns[-3:])) if returns else ret}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000, help="environment steps (an episode: 200)")
    parser.add_argument("--offline-steps", type=int, default=4000, help="steps of the offline dataset")
    parser.add_argument("--utd", type=int, default=1, help="updates per environment step")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the dataset and buffers go, kept (default: a temp dir, removed)")
    args = parser.parse_args(argv)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        return run(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="rlpd-") as workdir:
        return run(args, workdir)


def run(args: argparse.Namespace, workdir: str) -> int:
    """Collect and import the offline dataset, then train; returns the updates done."""
    source = os.path.join(workdir, "pendulum-offline.npz")
    behaviour = collect_offline(source, args.offline_steps, args.seed)
    with dr.import_dataset(source, os.path.join(workdir, "offline"), progress=False, overwrite=True) as offline:
        print(f"offline: {len(offline):,} rows imported from {source} (behaviour return {behaviour:.1f})")
        with dr.ReplayBuffer.create(os.path.join(workdir, "online"), offline.fields, capacity=100_000,
                                    seed=args.seed, overwrite=True) as online:
            summary = train(args, offline, online)
    print(f"done: {summary['steps']} steps, {summary['updates']} updates on {summary['offline_rows']:,} offline + "
          f"{summary['online_rows']:,} online rows, mean return of the last episodes {summary['mean_return']:.1f}")
    return int(summary["updates"])


if __name__ == "__main__":
    main()
