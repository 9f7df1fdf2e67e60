"""A buffer's fields from gymnasium spaces and envs: `fields_from_spaces`, `fields_from_env`,
`spec_from_env`, and `flatten_fields` for the values of Dict spaces.

Fields: ``obs`` (and ``next_obs``), ``action``, ``reward`` (float32), ``terminated`` and
``truncated`` (bool), shaped and typed as the spaces' samples: Box -> its shape and dtype,
Discrete -> an int64 scalar, MultiDiscrete -> its shape and dtype (int64), MultiBinary -> its
shape as int8 (what gymnasium samples). A Dict space is flattened into one field per leaf,
named as the importers name them (Minari's dict spaces): ``obs_<key>``, ``obs_<key>_<subkey>``,
``next_obs_<key>``, ``action_<key>`` (keys made valid names by `field_name`).

gymnasium is imported only when one of these is called: ``import diskreplay`` never loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..buffer.spec import BufferSpec
from ..errors import SchemaError
from ..format.schema import Field
from ..offline.naming import field_name

SUPPORTED = ("Box", "Discrete", "MultiDiscrete", "MultiBinary", "Dict")


def fields_from_spaces(observation_space: Any, action_space: Any, *, next_obs: bool = True,
                       reward_dtype: str = "float32") -> dict[str, Field]:
    """The fields of one env step with these (single-env) spaces.

    Returns ``{"obs"..., ["next_obs"...], "action"..., "reward", "terminated", "truncated"}``:
    Dict spaces as one field per leaf (``obs_<key>``...). ``next_obs=False`` leaves the
    ``next_obs`` fields out. ``reward_dtype``: the reward's dtype (float32).

    Raises:
        ValueError: a space that is not Box, Discrete, MultiDiscrete, MultiBinary or a Dict of
            them (Tuple, Graph, Text, Sequence, OneOf...), or whose dtype a buffer does not store;
            the message names the space and where it sits (``observation_space['goal']``).
        ImportError: gymnasium is not installed.
    """
    spaces = _gymnasium_spaces()
    obs = _space_fields(spaces, observation_space, "obs", "observation_space")
    fields = dict(obs)
    if next_obs:
        fields.update({"next_" + name: f for name, f in obs.items()})
    fields.update(_space_fields(spaces, action_space, "action", "action_space"))
    fields.update(reward=Field((), reward_dtype), terminated=Field((), "bool"), truncated=Field((), "bool"))
    return fields


def fields_from_env(env: Any, *, next_obs: bool = True, reward_dtype: str = "float32") -> dict[str, Field]:
    """`fields_from_spaces` of ``env``'s spaces: a ``gymnasium.Env``, or a vector env
    (``gymnasium.vector.VectorEnv``: its ``single_observation_space`` and
    ``single_action_space``; pass ``num_envs=env.num_envs`` to `create`, or use `spec_from_env`).

    Raises ValueError for a space `fields_from_spaces` refuses or an object without spaces."""
    observation_space, action_space, _ = _env_spaces(env)
    return fields_from_spaces(observation_space, action_space, next_obs=next_obs, reward_dtype=reward_dtype)


def spec_from_env(env: Any, capacity: int | None = None, *, next_obs: bool = True, reward_dtype: str = "float32",
                  **settings: Any) -> BufferSpec:
    """A `BufferSpec` for ``env``: its fields (`fields_from_env`), ``num_envs`` from a vector
    env (1 otherwise), ``capacity`` and any other spec ``settings`` (``chunk_rows``,
    ``derive_next``...). One line makes the buffer::

        buf = dr.ReplayBuffer.create(url, **dr.spec_from_env(envs, capacity=1_000_000))

    Raises ValueError as `fields_from_env` and `BufferSpec` (``capacity`` not a multiple of
    the env count, an unknown setting...)."""
    observation_space, action_space, num_envs = _env_spaces(env)
    fields = fields_from_spaces(observation_space, action_space, next_obs=next_obs, reward_dtype=reward_dtype)
    settings.setdefault("num_envs", num_envs)
    try:
        return BufferSpec(fields, capacity, **settings)
    except TypeError as exc:  # an unknown setting
        raise ValueError(f"spec_from_env: {exc}") from None


def flatten_fields(prefix: str, value: Any) -> dict[str, Any]:
    """A value of a space as fields: ``{prefix: value}``, or for a dict (a Dict space's sample,
    nested or not; vector envs give dicts of arrays) one entry per leaf, named as
    `fields_from_spaces` names them. ``buf.add(**flatten_fields("obs", obs), ...)``."""
    if not isinstance(value, Mapping):
        return {prefix: value}
    out: dict[str, Any] = {}
    for key, item in value.items():
        out.update(flatten_fields(f"{prefix}_{field_name(str(key))}", item))
    return out


def _gymnasium_spaces() -> Any:
    try:
        import gymnasium.spaces
    except ImportError:
        raise ImportError("fields from spaces need the 'gymnasium' package: pip install gymnasium") from None
    return gymnasium.spaces


def _env_spaces(env: Any) -> tuple[Any, Any, int]:
    """``(observation space, action space, env count)`` of one env (count 1) or a vector env."""
    if hasattr(env, "single_observation_space") and hasattr(env, "single_action_space"):
        num_envs = getattr(env, "num_envs", None)
        if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
            raise ValueError(f"{type(env).__name__}: a vector env needs a positive num_envs, got {num_envs!r}")
        return env.single_observation_space, env.single_action_space, int(num_envs)
    if hasattr(env, "observation_space") and hasattr(env, "action_space"):
        return env.observation_space, env.action_space, 1
    raise ValueError(f"expected a gymnasium Env or VectorEnv (with observation_space and action_space), "
                     f"got {type(env).__name__}")


def _space_fields(spaces: Any, space: Any, prefix: str, where: str) -> dict[str, Field]:
    """``{name: Field}`` for ``space`` named ``prefix`` (a Dict: one per leaf, flattened)."""
    if isinstance(space, spaces.Dict):
        out: dict[str, Field] = {}
        for key, sub in space.spaces.items():
            out.update(_space_fields(spaces, sub, f"{prefix}_{field_name(str(key))}", f"{where}[{key!r}]"))
        if not out:
            raise ValueError(f"{where}: an empty Dict space has no fields to store")
        return out
    try:
        if isinstance(space, spaces.Discrete):
            return {prefix: Field((), "int64")}
        if isinstance(space, (spaces.Box, spaces.MultiDiscrete)):
            return {prefix: Field(space.shape, space.dtype)}
        if isinstance(space, spaces.MultiBinary):
            return {prefix: Field(space.shape, "int8")}
    except SchemaError as exc:
        raise ValueError(f"{where}: {space!r} cannot be stored ({exc})") from None
    raise ValueError(f"{where}: {type(space).__name__} spaces are not supported ({space!r:.200}); supported: "
                     f"{', '.join(SUPPORTED)} (flatten others, e.g. with gymnasium.wrappers.FlattenObservation)")
