"""The buffer: `ReplayBuffer`, a thin composition of storage, sampler, episode index and the
sample-time transforms, and the parts it delegates to (setup, appending, batches, state)."""

from .mixture import Mixture
from .rate_limit import RateLimiter
from .replay_buffer import ReplayBuffer
from .spec import BufferSpec

__all__ = ["BufferSpec", "Mixture", "RateLimiter", "ReplayBuffer"]
