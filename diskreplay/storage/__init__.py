"""Storage: one buffer's chunks, cache and commits, behind the `Storage` facade.

`create_storage` and `open_storage` make one; the parts (`CommitLog`, `StagingWriter`,
`ChunkReader`, `ChunkCache`, `ChunkIO`) are its own and not used from above.
"""

from .facade import Storage, StorageStats
from .opening import (
    NewStorage,
    Options,
    check_location,
    create_storage,
    open_storage,
    open_union_storage,
    own_stores,
    plan_storage,
)
from .outputs import check_output
from .sizing import DEFAULT_CACHE_BYTES, cache_slots, default_chunk_rows
from .warm import physical_memory

__all__ = ["DEFAULT_CACHE_BYTES", "NewStorage", "Options", "Storage", "StorageStats", "cache_slots",
           "check_location", "create_storage", "default_chunk_rows", "open_storage", "check_output", "physical_memory",
           "open_union_storage", "own_stores", "plan_storage"]

