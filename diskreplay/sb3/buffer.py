"""Compatibility: `diskreplay.integrations.sb3.buffer` under its former path."""

from ..integrations.sb3.buffer import DiskReplayBuffer, moved_buffers

__all__ = ["DiskReplayBuffer", "moved_buffers"]
