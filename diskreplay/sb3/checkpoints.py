"""Compatibility: `diskreplay.integrations.sb3.checkpoints` under its former path."""

from ..integrations.sb3.checkpoints import CheckpointCallback

__all__ = ["CheckpointCallback"]
