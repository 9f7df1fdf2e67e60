"""The byte store under a buffer: one `ChunkStore` protocol, two backends, chosen by URL.

Every object of a buffer (chunk files, ``zarr.json`` documents, the commit record, state objects,
the writer lock) is read and written through a `ChunkStore`. Both backends implement every method;
two capability flags say where they differ, so that callers ask the store instead of checking its
type:

- ``supports_mmap``: objects are plain files at `path` (`LocalChunkStore`): they can be
  memory-mapped, they sit in the OS page cache, and `prefetch` asks the OS to read them ahead.
- ``needs_sync``: writes made with ``durable=False`` (and `put_in_place`) are durable only after
  `sync`. An object store's PUT is durable when it returns (`FsspecChunkStore`): there `sync`
  does nothing.

and one number says what a request costs: ``request_bytes``, the bytes whose transfer takes about
as long as one more request (on an object store, its client's request rate against its bandwidth
with many requests in flight; locally 1: a ``pread`` costs its pages): a read of many small ranges
of an object costs more than a read of it whole beyond that many bytes per range.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Protocol, runtime_checkable

Data = bytes | memoryview | Sequence[bytes | memoryview]
"""An object's bytes, whole or in parts that are stored one after the other."""

Blob = bytes | memoryview
"""An object's bytes as a store read them: ``bytes``, or a read-only view of the client's own
buffer (no copy)."""

Range = tuple[str, int, int]
"""``(key, start, stop)``: the bytes ``[start, stop)`` of an object."""

Ranged = tuple[bytes, int]
"""A range's bytes, and the size of its whole object (-1 where the store did not say)."""

ParallelMap = Callable[[Callable[[str], None], Iterable[str]], Iterable[None]]
"""``map``, or an executor's ``map``: how `ChunkStore.sync` runs its per-file syncs."""


def as_bytes(blob: Blob | None) -> bytes | None:
    """``blob`` as ``bytes`` (``bytes`` as they are, a view copied)."""
    return None if blob is None else bytes(blob)


def parts_of(data: Data) -> list[memoryview]:
    """``data`` as a list of byte views, in order."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(part).cast("B") for part in data]


@runtime_checkable
class ChunkStore(Protocol):
    """Objects under one root (a directory or an fsspec URL), named by ``/``-separated keys."""

    url: str
    supports_mmap: bool
    needs_sync: bool
    request_bytes: int

    def path(self, key: str) -> str:
        """Where the object lives: a file path (``supports_mmap``) or the URL path of the object."""
        ...

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes (at most ``limit`` of them), or None if it does not exist."""
        ...

    def get_many(self, keys: list[str], limit: int | None = None) -> list[Blob | None]:
        """Every key's bytes (at most ``limit`` of each), None where missing (remote: many
        requests in flight)."""
        ...

    def get_ranges(self, ranges: Sequence[Range]) -> list[Ranged | None]:
        """The bytes ``[start, stop)`` of each ``(key, start, stop)`` (fewer where the object ends
        before ``stop``, none where it ends before ``start``) and the object's size; None where
        it does not exist (remote: one ranged GET each, many in flight)."""
        ...

    def read_into(self, key: str, out: list[memoryview]) -> int | None:
        """The object's bytes read into the buffers ``out``, one after the other; the bytes read
        (fewer than they hold if the object is shorter), or None if it does not exist."""
        ...

    def prefetch(self, keys: list[str]) -> None:
        """Ask for these objects ahead of their reads (a no-op where reads cannot be ahead)."""
        ...

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        """Replace the object atomically (``durable``: on stable storage when this returns)."""
        ...

    def put_in_place(self, key: str, data: Data) -> None:
        """Write the object, perhaps not atomically: only for objects no commit refers to yet."""
        ...

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist, whole or not at all. False if it did."""
        ...

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        """The object's bytes (at most ``limit``) and its version (an S3 ETag; elsewhere a digest
        of its bytes), or None if it does not exist."""
        ...

    def put_if_version(self, key: str, data: bytes, version: str | None, durable: bool = False) -> str | None:
        """Replace the object only if it is still at ``version`` (None: only if it does not exist),
        atomically against every other `put_if_version`: a compare-and-swap. Its new version, or
        None if the object had another version (nothing written)."""
        ...

    def sync(self, keys: Collection[str], parallel_map: ParallelMap = map) -> None:
        """Make these objects, written with ``durable=False``, durable (``needs_sync`` stores)."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object (a missing one is no error)."""
        ...

    def exists(self, key: str) -> bool:
        ...

    def sizes(self) -> dict[str, int]:
        """Every object under the root: its key and its size in bytes."""
        ...

    def clear(self) -> None:
        """Remove every object under the root (a missing root is no error); nothing outside it."""
        ...


def digest(data: bytes) -> str:
    """The version of an object where the store keeps none: a digest of its bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()[:32]


def is_local(url: str) -> bool:
    """Whether ``url`` names a local path (plain, or ``file://``)."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The absolute local path of a local ``url``."""
    return os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)


def broken_path(url: str) -> str | None:
    """Why the local ``url`` can hold nothing although its path names something: the path runs
    into a loop of symbolic links, or ends in a symbolic link to nothing. None for any other URL."""
    if not is_local(url):
        return None
    path = local_path(url)
    try:
        os.stat(path)
    except FileNotFoundError:
        return f"a symbolic link to {os.readlink(path)!r}, which does not exist" if os.path.islink(path) else None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "its path runs into a loop of symbolic links"
        raise
    return None


def link_target(url: str) -> str | None:
    """Where the local ``url`` leads when it is a symbolic link itself (None: it is not, or not local)."""
    path = local_path(url.rstrip("/")) if is_local(url) else None
    return os.readlink(path) if path is not None and os.path.islink(path) else None


class PrefixedStore:
    """The objects of ``store`` whose keys start with ``prefix`` (``"a/b/"``), keyed without it: a
    `ChunkStore` for one directory of another."""

    def __init__(self, store: ChunkStore, prefix: str):
        self.store, self.prefix = store, prefix
        self.url = f"{store.url.rstrip('/')}/{prefix.rstrip('/')}"
        self.supports_mmap, self.needs_sync = store.supports_mmap, store.needs_sync
        self.request_bytes = store.request_bytes

    def path(self, key: str) -> str:
        return self.store.path(self.prefix + key)

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        return self.store.get(self.prefix + key, limit)

    def get_many(self, keys: list[str], limit: int | None = None) -> list[Blob | None]:
        return self.store.get_many([self.prefix + key for key in keys], limit)

    def get_ranges(self, ranges: Sequence[Range]) -> list[Ranged | None]:
        return self.store.get_ranges([(self.prefix + key, start, stop) for key, start, stop in ranges])

    def read_into(self, key: str, out: list[memoryview]) -> int | None:
        return self.store.read_into(self.prefix + key, out)

    def prefetch(self, keys: list[str]) -> None:
        self.store.prefetch([self.prefix + key for key in keys])

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        self.store.put(self.prefix + key, data, durable)

    def put_in_place(self, key: str, data: Data) -> None:
        self.store.put_in_place(self.prefix + key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        return self.store.put_if_absent(self.prefix + key, data)

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        return self.store.get_versioned(self.prefix + key, limit)

    def put_if_version(self, key: str, data: bytes, version: str | None, durable: bool = False) -> str | None:
        return self.store.put_if_version(self.prefix + key, data, version, durable)

    def sync(self, keys: Collection[str], parallel_map: ParallelMap = map) -> None:
        self.store.sync([self.prefix + key for key in keys], parallel_map)

    def delete(self, key: str) -> None:
        self.store.delete(self.prefix + key)

    def exists(self, key: str) -> bool:
        return self.store.exists(self.prefix + key)

    def sizes(self) -> dict[str, int]:
        return {key[len(self.prefix):]: size for key, size in self.store.sizes().items() if key.startswith(self.prefix)}

    def clear(self) -> None:
        for key in self.sizes():
            self.delete(key)


def objects_at(store: ChunkStore, prefix: str) -> ChunkStore:
    """``store`` itself for an empty ``prefix``, else the `PrefixedStore` of ``prefix``."""
    return PrefixedStore(store, prefix) if prefix else store
