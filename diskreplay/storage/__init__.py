"""Storage: a buffer's chunks, cache and commits, behind the `Storage` facade.

`create_storage` and `open_storage` make one buffer's (`BufferStorage`); `open_union_storage`
makes a learner's over a sharded buffer's shards (`UnionStorage`). Both share the read side of
`Storage`; the parts (`CommitLog`, `StagingWriter`, `ChunkReader`, `ChunkCache`, `ChunkIO`) are
theirs and not used from above.
"""

from .buffer_storage import BufferStorage
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
from .read_ahead import READ_AHEAD_BYTES
from .sizing import DEFAULT_CACHE_BYTES, cache_slots, default_chunk_rows
from .union import UnionStorage
from .warm import physical_memory

__all__ = ["BufferStorage", "DEFAULT_CACHE_BYTES", "READ_AHEAD_BYTES",
           "NewStorage", "Options", "Storage", "StorageStats", "UnionStorage",
           "cache_slots", "check_location", "create_storage", "default_chunk_rows", "open_storage", "check_output",
           "physical_memory", "open_union_storage", "own_stores", "plan_storage"]

