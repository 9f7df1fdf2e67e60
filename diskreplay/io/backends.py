"""`open_chunkstore`: the `ChunkStore` backend of a URL.

``s3://`` URLs go to `ObstoreChunkStore` when obstore is installed and every storage option has
an obstore equivalent, else to s3fs (`FsspecChunkStore`). The environment variable
``DISKREPLAY_S3_CLIENT`` overrides the choice: ``s3fs``, or ``obstore`` (then an option obstore
cannot take, or obstore missing, is an error instead of a quiet fallback). In a child forked
after its parent used obstore, s3fs serves (see `diskreplay.io.obstore_store`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from .local import LocalChunkStore
from .remote import FsspecChunkStore
from .retry import RetryPolicy
from .store import ChunkStore, is_local, local_path

log = logging.getLogger(__name__)
CLIENT_VARIABLE = "DISKREPLAY_S3_CLIENT"
CLIENTS = ("auto", "obstore", "s3fs")


def open_chunkstore(url: str, storage_options: Mapping[str, Any] | None = None, *, concurrency: int = 16,
                    retry: RetryPolicy | None = None) -> ChunkStore:
    """The store for ``url``; ``concurrency`` bounds the requests in flight on a remote store,
    ``retry`` how its transient failures are retried (local files are not retried)."""
    if is_local(url):
        return LocalChunkStore(local_path(url))
    options = dict(storage_options or {})
    if url.startswith("s3://"):
        store = _obstore_store(url, options, concurrency, retry)
        if store is not None:
            return store
    return FsspecChunkStore(url, options, concurrency=concurrency, retry=retry)


def _obstore_store(url: str, options: dict[str, Any], concurrency: int,
                   retry: RetryPolicy | None) -> ChunkStore | None:
    """The obstore store of an ``s3://`` URL, or None where s3fs serves it (see the module)."""
    choice = os.environ.get(CLIENT_VARIABLE, "").strip().lower() or "auto"
    if choice not in CLIENTS:
        raise ValueError(f"{CLIENT_VARIABLE} must be one of {', '.join(CLIENTS)}, got {choice!r}")
    if choice == "s3fs":
        return None
    try:
        from .obstore_store import ObstoreChunkStore, UntranslatableOptionError, obstore_usable
    except ImportError:
        if choice == "obstore":
            raise ImportError(f"{CLIENT_VARIABLE}=obstore, but obstore is not installed "
                              "(pip install 'diskreplay[s3]')") from None
        return None
    if not obstore_usable():  # a forked child of a process that used obstore: its runtime is gone
        log.debug("%r: s3fs serves this URL in a forked child", url)
        return None
    try:
        return ObstoreChunkStore(url, options, concurrency=concurrency, retry=retry)
    except UntranslatableOptionError as exc:
        if choice == "obstore":
            raise UntranslatableOptionError(f"{CLIENT_VARIABLE}=obstore, but {exc}") from None
        log.debug("%r: s3fs serves this URL: %s", url, exc)
        return None
