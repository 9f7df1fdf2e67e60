"""Stable-Baselines3 replay buffers on disk: a one-line switch for off-policy algorithms.

``DQN("MlpPolicy", env, replay_buffer_class=dr.sb3.DiskReplayBuffer,
replay_buffer_kwargs={"url": "runs/dqn.zarr"})``; for goal envs, `DiskHerReplayBuffer` in place
of SB3's ``HerReplayBuffer``. Importing this package imports stable_baselines3 (and torch);
``import diskreplay`` alone does not. Modules: `fields` (SB3's arrays as fields, pure numpy),
`buffer` (`DiskReplayBuffer`), `her` (`DiskHerReplayBuffer`), `checkpoints` (`CheckpointCallback`:
the buffer commits with each model checkpoint).
"""

from .buffer import DiskReplayBuffer, moved_buffers
from .checkpoints import CheckpointCallback
from .fields import Layout, make_layout
from .her import DiskHerReplayBuffer

DiskDictReplayBuffer = DiskReplayBuffer
"""The same class: it serves Dict observation spaces (SB3's ``DictReplayBuffer`` API) too."""

__all__ = ["CheckpointCallback", "DiskReplayBuffer", "DiskDictReplayBuffer", "DiskHerReplayBuffer", "Layout",
           "make_layout", "moved_buffers"]
