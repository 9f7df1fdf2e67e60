"""Compatibility: `diskreplay.integrations.sb3.her` under its former path."""

from ..integrations.sb3.her import DiskHerReplayBuffer

__all__ = ["DiskHerReplayBuffer"]
