"""Compatibility: Stable-Baselines3's buffers live in `diskreplay.integrations.sb3`; this package
keeps the paths they had (``from diskreplay.sb3 import DiskReplayBuffer``, and the class paths in
SB3 models and replay buffers pickled before they moved: `buffer`, `her`, `fields`, `checkpoints`).
``dr.sb3`` is `diskreplay.integrations.sb3` itself."""

from ..integrations.sb3 import (
    CheckpointCallback,
    DiskDictReplayBuffer,
    DiskHerReplayBuffer,
    DiskReplayBuffer,
    Layout,
    make_layout,
    moved_buffers,
)

__all__ = ["CheckpointCallback", "DiskReplayBuffer", "DiskDictReplayBuffer", "DiskHerReplayBuffer", "Layout",
           "make_layout", "moved_buffers"]
