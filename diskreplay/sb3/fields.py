"""Compatibility: `diskreplay.integrations.sb3.fields` under its former path (a pickled
`DiskReplayBuffer` holds its `Layout`)."""

from ..integrations.sb3.fields import Layout, make_layout

__all__ = ["Layout", "make_layout"]
