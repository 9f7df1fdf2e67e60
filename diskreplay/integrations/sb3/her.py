"""`DiskHerReplayBuffer`: SB3's ``HerReplayBuffer`` API, goals relabelled by `diskreplay.HER`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.vec_env import VecEnv
from stable_baselines3.her.goal_selection_strategy import KEY_TO_GOAL_STRATEGY, GoalSelectionStrategy
from stable_baselines3.her.her_replay_buffer import HerReplayBuffer

from ...episodes import HER
from .buffer import DiskReplayBuffer

if TYPE_CHECKING:
    import torch as th


class DiskHerReplayBuffer(DiskReplayBuffer, HerReplayBuffer):
    """A drop-in for SB3's ``HerReplayBuffer`` (``replay_buffer_class=DiskHerReplayBuffer,
    replay_buffer_kwargs={"url": ..., "n_sampled_goal": 4, "goal_selection_strategy": "future"}``)
    whose rows live on disk, as `DiskReplayBuffer`'s.

    A share ``n_sampled_goal / (n_sampled_goal + 1)`` of each batch (rounded) gets a new desired
    goal (in the observation and the next observation): the next achieved goal at a step of the
    same episode, ``"future"`` (this step or a later one), ``"final"`` or ``"episode"``, and the
    reward ``env.compute_reward(next_achieved_goal, new_goal, {})`` of the env's first copy.
    Episodes are the disk buffer's (ended by ``done``); unlike SB3's, rows of an episode still
    running are sampled too, but never relabelled (as SB3 never relabels them). ``copy_info_dict``
    is not supported.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Dict, action_space: spaces.Space,
                 env: VecEnv | None, device: th.device | str = "auto", n_envs: int = 1,
                 optimize_memory_usage: bool = False, handle_timeout_termination: bool = True,
                 n_sampled_goal: int = 4, goal_selection_strategy: GoalSelectionStrategy | str = "future",
                 copy_info_dict: bool = False, *, url: str | os.PathLike[str], **options: Any):
        """Raises ValueError for ``copy_info_dict=True``, an unknown strategy, or a space without
        ``achieved_goal`` and ``desired_goal``; and as `DiskReplayBuffer`."""
        if copy_info_dict:
            raise ValueError("DiskHerReplayBuffer does not store info dicts (copy_info_dict=True)")
        if not {"achieved_goal", "desired_goal"} <= set(getattr(observation_space, "spaces", {})):
            raise ValueError("HER needs a Dict observation space with 'achieved_goal' and 'desired_goal'")
        if isinstance(goal_selection_strategy, str):
            goal_selection_strategy = KEY_TO_GOAL_STRATEGY[goal_selection_strategy.lower()]
        self.goal_selection_strategy = GoalSelectionStrategy(goal_selection_strategy)
        self.n_sampled_goal = n_sampled_goal
        self.her = self._relabelling()
        self.her_ratio = 1 - (1.0 / (n_sampled_goal + 1))
        self.copy_info_dict = False
        DiskReplayBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs,
                                  optimize_memory_usage, handle_timeout_termination, url=url, **options)
        self.env = env

    def compute_reward(self, achieved_goal: np.ndarray, desired_goal: np.ndarray) -> np.ndarray:
        """Rewards for relabelled goals: the env's ``compute_reward`` (its first copy), as float32."""
        assert self.env is not None, "call set_env(env) after unpickling a DiskHerReplayBuffer"
        infos: list[dict[str, Any]] = [{} for _ in range(len(achieved_goal))]
        rewards = self.env.env_method("compute_reward", achieved_goal, desired_goal, infos, indices=[0])[0]
        return np.asarray(rewards).astype(np.float32)

    def _relabelling(self) -> HER:
        """The disk buffer's HER for these settings (it relabels ``next_obs_desired_goal`` too)."""
        return HER(self.compute_reward, self.goal_selection_strategy.name.lower(), int(self.n_sampled_goal),
                   goal="obs_desired_goal", achieved_goal="obs_achieved_goal")

    def _draw(self, batch_size: int) -> dict[str, np.ndarray]:
        return self.disk.sample(batch_size, her=self.her)

    def truncate_last_trajectory(self) -> None:
        """Nothing to do: reopening the disk buffer (``mode="r+"``) already ends the episode each
        env had open when its next step arrives (see `diskreplay.ReplayBuffer.open`)."""

    def __getstate__(self) -> dict[str, Any]:
        """As `DiskReplayBuffer`'s, without the env (call ``set_env`` after unpickling)."""
        state = super().__getstate__()
        state["env"] = None
        state["her"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restores the pickled state; the env is set by ``set_env``."""
        super().__setstate__(state)
        self.her = self._relabelling()
