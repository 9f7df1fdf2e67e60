"""diskreplay: RL replay buffers on chunked Zarr arrays, served at in-memory speed."""

from .buffer import ReplayBuffer
from .errors import (BufferExistsError, CorruptBufferError, DiskReplayError, EmptyBufferError,
                     LockedError, NotABufferError, ReadOnlyError, SchemaError)
from .sampling import Draw, Sampler, Uniform
from .schema import Field

__version__ = "0.1.0"

__all__ = [
    "ReplayBuffer", "Field", "Uniform", "Sampler", "Draw",
    "DiskReplayError", "SchemaError", "NotABufferError", "BufferExistsError", "ReadOnlyError",
    "EmptyBufferError", "CorruptBufferError", "LockedError",
]
