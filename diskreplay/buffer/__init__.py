"""The buffer: `ReplayBuffer`, a thin composition of storage, sampler, episode index and the
sample-time transforms, and the parts it delegates to (setup, appending, batches, state)."""

from .replay_buffer import ReplayBuffer

__all__ = ["ReplayBuffer"]
