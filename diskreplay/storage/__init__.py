"""Storage: one buffer's chunks, cache and commits, behind the `Storage` facade.

`create_storage` and `open_storage` make one; the parts (`CommitLog`, `StagingWriter`,
`ChunkReader`, `ChunkCache`, `ChunkIO`) are its own and not used from above.
"""

from .facade import Storage, StorageStats
from .opening import NewStorage, Options, create_storage, open_storage, plan_storage
from .outputs import output_rows
from .sizing import DEFAULT_CACHE_BYTES, cache_slots, default_chunk_rows
from .union import StorageUnion, describe, shard_lanes
from .warm import physical_memory

__all__ = ["DEFAULT_CACHE_BYTES", "NewStorage", "Options", "Storage", "StorageStats", "StorageUnion", "cache_slots",
           "create_storage", "default_chunk_rows", "describe", "open_storage", "output_rows", "physical_memory",
           "plan_storage", "shard_lanes"]
