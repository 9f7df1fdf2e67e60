"""`RolloutBuffer`: on-policy rollouts with GAE-lambda advantages and shuffled minibatches.

A rollout is ``num_steps`` steps of each of ``num_envs`` envs. Rows live in a `ReplayBuffer`
ring of exactly one rollout per lane (``memory://`` by default, or any URL to keep rollouts on
disk), so a new rollout simply overwrites the last. Advantages and returns are small
(``num_steps x num_envs`` floats) and stay in RAM.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from .buffer import ReplayBuffer
from .build import missing_extra
from .episodes.returns import gae_advantages, normalize_advantages
from .format.lanes import row_ids
from .format.schema import Field

REQUIRED = ("reward", "value", "log_prob")


class RolloutBuffer:
    """Collect ``num_steps`` steps of ``num_envs`` envs, then compute GAE and iterate minibatches.

    Args:
        fields: per-step fields; must include float ``reward``, ``value`` and ``log_prob`` and
            bool ``terminated`` and ``truncated`` (or a single bool ``done``, read as terminated).
        num_steps: steps per env in one rollout (T).
        num_envs: parallel envs (E).
        url: where rows are stored; default an in-process ``memory://`` store.
    """

    def __init__(self, fields: Mapping[str, Field], num_steps: int, num_envs: int = 1,
                 url: str | None = None, **create_options: Any):
        missing = [name for name in REQUIRED if name not in fields]
        if missing or not ({"terminated", "truncated"} <= set(fields) or "done" in fields):
            raise ValueError(f"RolloutBuffer fields must include {list(REQUIRED)} and terminated+truncated "
                             f"(or done); missing {missing or ['terminated/truncated or done']}")
        self.num_steps, self.num_envs = num_steps, num_envs
        self.buffer = ReplayBuffer.create(
            url or f"memory://diskreplay-rollout-{uuid.uuid4().hex}", fields, capacity=num_steps * num_envs,
            num_envs=num_envs, chunk_rows=min(num_steps, 4096), episode_end=None, **create_options)
        self.advantages: np.ndarray | None = None
        self.returns: np.ndarray | None = None
        self._added = 0

    def add(self, **step: Any) -> None:
        """Add one step of every env: each field shaped ``(num_envs, *field.shape)``.

        Raises:
            RuntimeError: the rollout already holds ``num_steps`` steps (call `reset`).
        """
        if self._added == self.num_steps:
            raise RuntimeError(f"rollout is full ({self.num_steps} steps); call reset() first")
        self.buffer.add(env_ids=np.arange(self.num_envs), **step)  # leading env axis even when num_envs == 1
        self._added += 1

    @property
    def full(self) -> bool:
        """Whether every lane holds ``n_steps`` rows of this rollout."""
        return self._added == self.num_steps

    def reset(self) -> None:
        """Start the next rollout (its steps overwrite this one's)."""
        self._added = 0
        self.advantages = self.returns = None

    def rows(self) -> dict[str, np.ndarray]:
        """This rollout's rows, time-major: ``{field: [num_steps, num_envs, *shape]}``."""
        _, hi = self.buffer.window()
        steps = (hi[:, None] - self._added + np.arange(self._added)[None, :]).T.reshape(-1)
        lanes = np.tile(np.arange(self.num_envs), self._added)
        rows = self.buffer.rows(row_ids(lanes, steps, self.num_envs))
        return {k: v.reshape(self._added, self.num_envs, *v.shape[1:]) for k, v in rows.items()}

    def compute_returns_and_advantages(self, last_values: np.ndarray, last_dones: np.ndarray,
                                       gamma: float = 0.99, gae_lambda: float = 0.95,
                                       next_values: np.ndarray | None = None) -> None:
        """GAE-lambda over the rollout (see `diskreplay.episodes.returns.gae_advantages`).

        Args:
            last_values: V(s_T) per env, shape ``(num_envs,)``: the value after the last step.
            last_dones: whether s_T is terminal per env, shape ``(num_envs,)``.
            next_values: optional ``[num_steps, num_envs]`` V of each step's real next
                observation; at truncated steps it gives the exact bootstrap (without it, the
                step's own value is used there).
        """
        rows = self.rows()
        terminated = rows["terminated"] if "terminated" in rows else rows["done"]
        truncated = rows["truncated"] if "truncated" in rows else np.zeros_like(terminated)
        self.advantages, self.returns = gae_advantages(
            rows["reward"], rows["value"], terminated, truncated, last_values, last_dones,
            gamma, gae_lambda, next_values=next_values)

    def minibatches(self, num_minibatches: int, epochs: int = 1, seed: int | None = None,
                    normalize: bool = True, device: Any = "cpu") -> Iterator[dict[str, Any]]:
        """Shuffled minibatches of torch tensors over ``epochs`` passes of the rollout.

        Each batch holds every field plus ``advantages`` (normalized per minibatch when
        ``normalize``) and ``returns``, flattened to ``[num_steps * num_envs / num_minibatches,
        *shape]``. The order is a pure function of ``seed``.

        Raises:
            RuntimeError: `compute_returns_and_advantages` was not called for this rollout.
            ValueError: num_minibatches does not divide num_steps * num_envs.
        """
        try:
            import torch
        except ImportError as error:
            raise missing_extra("torch", "torch", "RolloutBuffer.minibatches") from error
        if self.advantages is None:
            raise RuntimeError("call compute_returns_and_advantages() before minibatches()")
        assert self.returns is not None  # computed together with the advantages
        size = self._added * self.num_envs
        if num_minibatches < 1 or size % num_minibatches:
            raise ValueError(f"num_minibatches must divide the rollout's {size} rows, got {num_minibatches}")
        flat = {k: v.reshape(size, *v.shape[2:]) for k, v in self.rows().items()}
        flat["advantages"] = self.advantages.reshape(size)
        flat["returns"] = self.returns.reshape(size)
        rng = np.random.default_rng(seed)
        per = size // num_minibatches
        for _ in range(epochs):
            order = rng.permutation(size)
            for start in range(0, size, per):
                idx = order[start:start + per]
                batch = {k: v[idx] for k, v in flat.items()}
                if normalize:
                    batch["advantages"] = normalize_advantages(batch["advantages"])
                yield {k: torch.as_tensor(v, device=device) for k, v in batch.items()}

    def close(self) -> None:
        """Close the underlying buffer (the rows stay on disk)."""
        self.buffer.close()
