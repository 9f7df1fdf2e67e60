"""Ray Data reads and writes of diskreplay buffers (``pip install "diskreplay[ray]"``).

`read_buffer` gives a buffer's committed rows as a ``ray.data.Dataset`` (`BufferDatasource`);
`write_buffer` writes a dataset into a new sharded buffer, one shard per write task
(`BufferDatasink`). The store stays the data plane (rows, commits, durability); Ray schedules
the tasks. Importing this package imports Ray; ``import diskreplay`` does not.
"""

from .datasink import BufferDatasink, write_buffer
from .datasource import BufferDatasource, read_buffer
from .limiter import EngineCounts, RateLimiterActor

__all__ = ["BufferDatasink", "BufferDatasource", "EngineCounts", "RateLimiterActor", "read_buffer", "write_buffer"]
