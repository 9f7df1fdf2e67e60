"""What SB3's replay buffers keep, as diskreplay fields, and the conversions both ways.

Pure numpy over the gymnasium spaces SB3 hands a buffer: the field names and dtypes of one
transition, the rows of one ``add`` call, SB3's ring slots as row ids, and a batch of rows as
the arrays of SB3's ``ReplayBufferSamples`` (before normalization and tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.preprocessing import get_action_dim, get_obs_shape

from ...format.schema import Field

Obs = np.ndarray | dict[str, np.ndarray]


@dataclass(frozen=True)
class Layout:
    """The fields of one SB3 transition: ``obs`` (or ``obs_<key>`` per key of a Dict space) and
    their ``next_`` twins, ``action``, ``reward`` (float32), ``done`` and ``timeout`` (bool)."""

    obs: dict[str, Field]
    """``"obs"`` -> field, or ``"obs_<key>"`` -> field for a Dict observation space."""
    keys: tuple[str, ...] | None
    """The Dict space's keys in order; None for an array observation."""
    action: Field

    def fields(self) -> dict[str, Field]:
        """Every stored field, in order."""
        out = dict(self.obs)
        out.update({f"next_{name}": field for name, field in self.obs.items()})
        out.update(action=self.action, reward=Field((), np.float32), done=Field((), bool), timeout=Field((), bool))
        return out

    def obs_name(self, key: str | None) -> str:
        """The field holding observation ``key`` (None: the array observation)."""
        return "obs" if key is None else f"obs_{key}"


def dtype_of(space: spaces.Space) -> np.dtype:
    """The dtype of a space's samples. Raises ValueError for a space without one."""
    if space.dtype is None:
        raise ValueError(f"{space} has no dtype: SB3's replay buffers cannot store it")
    return np.dtype(space.dtype)


def make_layout(observation_space: spaces.Space, action_space: spaces.Space) -> Layout:
    """The fields SB3's in-RAM buffer would allocate for these spaces, with the same dtypes.

    Raises ValueError for a Dict key that cannot be part of a field name (not an identifier)."""
    shape = get_obs_shape(observation_space)
    action_dtype = np.float32 if dtype_of(action_space) == np.float64 else dtype_of(action_space)
    action = Field((get_action_dim(action_space),), action_dtype)  # as SB3's ReplayBuffer._maybe_cast_dtype
    if not isinstance(shape, dict):
        return Layout({"obs": Field(shape, dtype_of(observation_space))}, None, action)
    assert isinstance(observation_space, spaces.Dict)
    bad = [key for key in shape if not f"obs_{key}".isidentifier()]
    if bad:
        raise ValueError(f"Dict observation keys must be identifiers to name fields, got {bad}")
    fields = {f"obs_{key}": Field(sub, dtype_of(observation_space[key])) for key, sub in shape.items()}
    return Layout(fields, tuple(shape), action)


def step_rows(layout: Layout, n_envs: int, obs: Obs, next_obs: Obs, action: np.ndarray, reward: np.ndarray,
              done: np.ndarray, timeouts: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of one SB3 ``add`` call: ``{field: [n_envs, *shape]}``, cast as SB3's arrays
    cast them on assignment (Discrete observations reshaped to ``(n_envs, 1)``)."""
    rows = {}
    for prefix, value in (("", obs), ("next_", next_obs)):
        for key in layout.keys or (None,):
            name = layout.obs_name(key)
            part = value[key] if isinstance(value, dict) and key is not None else value
            field = layout.obs[name]
            rows[prefix + name] = np.asarray(part).reshape(n_envs, *field.shape).astype(field.dtype)
    rows["action"] = np.asarray(action).reshape(n_envs, *layout.action.shape).astype(layout.action.dtype)
    rows["reward"] = np.asarray(reward, dtype=np.float32).reshape(n_envs)
    rows["done"] = np.asarray(done).reshape(n_envs).astype(bool)
    rows["timeout"] = np.asarray(timeouts).reshape(n_envs).astype(bool)
    return rows


def timeouts_of(infos: list[dict[str, Any]], n_envs: int, handle_timeout_termination: bool) -> np.ndarray:
    """Per env, whether its step ended by a time limit (``info["TimeLimit.truncated"]``); all
    False when timeouts are not handled (SB3's ``handle_timeout_termination=False``)."""
    if not handle_timeout_termination:
        return np.zeros(n_envs, dtype=bool)
    return np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos], dtype=bool)


def slot_rows(lo: np.ndarray, hi: np.ndarray, buffer_size: int, n_envs: int, slots: np.ndarray,
              env_indices: np.ndarray) -> np.ndarray:
    """Row ids of SB3's ring positions: slot ``p`` of env ``e`` holds the newest step ``s`` of
    lane ``e`` with ``s % buffer_size == p``.

    Raises IndexError for a slot that holds no readable row (not yet written, or cleared)."""
    slots, env_indices = np.asarray(slots, np.int64), np.asarray(env_indices, np.int64)
    newest = hi[env_indices] - 1
    steps = newest - (newest - slots) % buffer_size
    if np.any(steps < lo[env_indices]) or np.any(slots < 0) or np.any(slots >= buffer_size):
        raise IndexError(f"slots {slots[steps < lo[env_indices]].tolist()} hold no rows")
    ids: np.ndarray = steps * n_envs + env_indices
    return ids


def sample_arrays(layout: Layout, rows: dict[str, np.ndarray]) -> tuple[Obs, np.ndarray, Obs, np.ndarray, np.ndarray]:
    """``(obs, actions, next_obs, dones, rewards)`` of a batch of rows, as SB3 returns them:
    dones ``done * (1 - timeout)`` and rewards as float32 ``[batch, 1]``."""
    if layout.keys is None:
        obs: Obs = rows["obs"]
        next_obs: Obs = rows["next_obs"]
    else:
        obs = {key: rows[layout.obs_name(key)] for key in layout.keys}
        next_obs = {key: rows["next_" + layout.obs_name(key)] for key in layout.keys}
    dones = rows["done"].astype(np.float32) * (1 - rows["timeout"].astype(np.float32))
    return obs, rows["action"], next_obs, dones.reshape(-1, 1), rows["reward"].astype(np.float32).reshape(-1, 1)
