"""`open_chunkstore`: the `ChunkStore` backend of a URL."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .local import LocalChunkStore
from .remote import FsspecChunkStore
from .retry import RetryPolicy
from .store import ChunkStore, is_local, local_path


def open_chunkstore(url: str, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 16,
                    retry: RetryPolicy | None = None) -> ChunkStore:
    """The store for ``url``; ``concurrency`` bounds the requests in flight on a remote store,
    ``retry`` how its transient failures are retried (local files are not retried)."""
    if is_local(url):
        return LocalChunkStore(local_path(url))
    return FsspecChunkStore(url, dict(storage_options or {}), concurrency=concurrency, retry=retry)
