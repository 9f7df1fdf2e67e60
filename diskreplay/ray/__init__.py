"""Ray Data reads and writes of diskreplay buffers (``pip install "diskreplay[ray]"``).

`read_buffer` gives a buffer's committed rows as a ``ray.data.Dataset`` (`BufferDatasource`);
`write_buffer` writes a dataset into a new sharded buffer, one shard per write task
(`BufferDatasink`). The store stays the data plane (rows, commits, durability); Ray schedules
the tasks. `ShardWriter` (`start_shard_writer`) is a Ray actor that owns one shard of a sharded
buffer and reopens it when Ray restarts it; `EngineCounts` keeps a rate limiter's counts in one
Ray actor (`RateLimiterActor`). Importing this package imports Ray; ``import diskreplay`` does not.
"""

from .datasink import BufferDatasink, write_buffer
from .datasource import BufferDatasource, read_buffer
from .limiter import EngineCounts, RateLimiterActor
from .shard_writer import ShardOwner, ShardWriter, start_shard_writer

__all__ = ["BufferDatasink", "BufferDatasource", "EngineCounts", "RateLimiterActor", "ShardOwner", "ShardWriter",
           "read_buffer", "start_shard_writer", "write_buffer"]
