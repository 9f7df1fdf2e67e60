"""Bytes: the stores a buffer's objects live in, the writer lock, memory maps of local files.

`open_chunkstore` picks the backend of a URL: `LocalChunkStore` for paths and ``file://``,
`ObstoreChunkStore` (``io.obstore_store``, imported only when used) for ``s3://`` when obstore is
installed and takes the storage options, `FsspecChunkStore` for every other fsspec URL. All
satisfy `ChunkStore`.
"""

from __future__ import annotations

from .backends import open_chunkstore
from .local import LocalChunkStore, open_for_reading
from .remote import FsspecChunkStore
from .retry import RetryPolicy, is_transient
from .store import ChunkStore, Data, PrefixedStore, broken_path, is_local, link_target, local_path, objects_at

__all__ = ["ChunkStore", "Data", "FsspecChunkStore", "LocalChunkStore", "PrefixedStore", "RetryPolicy", "broken_path",
           "is_local", "is_transient", "link_target", "local_path", "objects_at", "open_chunkstore",
           "open_for_reading"]
