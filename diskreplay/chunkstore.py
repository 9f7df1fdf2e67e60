"""Byte-level access to a buffer's objects: chunk files, the commit record, state files.

Two backends behind one small interface: `LocalChunkStore` (plain files: atomic temp+rename
writes, optional fsync, reads straight into preallocated memory) and `FsspecChunkStore` (any
fsspec URL: s3://, gs://, memory://, ...; many keys fetched concurrently by fsspec's async
gather). `open_chunkstore` picks one from a URL.
"""

from __future__ import annotations

import os
import uuid
from typing import Iterable, Protocol

import fsspec


class ChunkStore(Protocol):
    url: str

    def get(self, key: str) -> bytes | None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def put(self, key: str, data: bytes, durable: bool = False) -> None: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)


def open_chunkstore(url: str, storage_options: dict | None = None) -> ChunkStore:
    if is_local(url):
        return LocalChunkStore(local_path(url))
    return FsspecChunkStore(url, storage_options or {})


class LocalChunkStore:
    """Files under a directory. Writes are atomic (temp file in the same directory + rename)."""

    def __init__(self, root: str):
        self.root = root
        self.url = root

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def get(self, key: str) -> bytes | None:
        try:
            with open(self.path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def read_into(self, key: str, out: memoryview) -> int | None:
        """Read the object into ``out``; returns the bytes read, or None if it does not exist."""
        try:
            with open(self.path(key), "rb", buffering=0) as f:
                return f.readinto(out)
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes, durable: bool = False) -> None:
        path = self.path(key)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.partial"
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(directory)

    def delete(self, key: str) -> None:
        try:
            os.remove(self.path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def sync_file(self, key: str) -> None:
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_dirs(self, keys: Iterable[str]) -> None:
        for directory in {os.path.dirname(self.path(k)) for k in keys}:
            fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecChunkStore:
    """Objects under an fsspec URL. A PUT of one object is atomic on object stores."""

    def __init__(self, url: str, storage_options: dict):
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        paths = [self.path(k) for k in keys]
        found = self.fs.cat(paths, on_error="return")
        out: list[bytes | None] = []
        for p in paths:
            value = found.get(p) if isinstance(found, dict) else found
            if isinstance(value, FileNotFoundError) or value is None:
                out.append(None)
            elif isinstance(value, BaseException):
                raise value
            else:
                out.append(value)
        return out

    def put(self, key: str, data: bytes, durable: bool = False) -> None:
        self.fs.pipe_file(self.path(key), data)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))
