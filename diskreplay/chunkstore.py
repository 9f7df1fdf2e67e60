"""Byte-level access to a buffer's objects: chunk files, the commit record, state files.

Two backends behind one small interface: `LocalChunkStore` (plain files: atomic temp+rename
writes, optional fsync, reads straight into preallocated memory) and `FsspecChunkStore` (any
fsspec URL: s3://, gs://, memory://, ...). `open_chunkstore` picks one from a URL.

Remote I/O. `FsspecChunkStore.get_many` runs one coroutine per key on the filesystem's event loop,
at most ``concurrency`` in flight (a semaphore), each a single GET (for s3fs, without the HEAD it
would otherwise send first). Every remote call (get, put, delete) retries *transient* failures —
connection resets and timeouts, HTTP 5xx and 429, S3 ``SlowDown``/throttling codes — with
exponential backoff and jitter, bounded by `RetryPolicy` (attempts per object and seconds per
object), then raises `StoreUnavailableError` naming the key. A missing object is never retried
and never an error here: ``get`` returns None and the caller decides (a chunk the commit says
exists is a `CorruptBufferError` in storage). Retries of the layers below (botocore, s3fs)
still apply first; `RetryPolicy` bounds what diskreplay adds on top.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import inspect
import os
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import fsspec
import fsspec.asyn

from .errors import StoreUnavailableError


@dataclass
class RetryPolicy:
    """How transient remote failures are retried: per object, ``attempts`` tries in all, waiting
    ``base_delay * 2**k`` (capped at ``max_delay``, with jitter) between them, and no new try once
    ``budget_s`` seconds have passed since the first."""

    attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 2.0
    budget_s: float = 30.0

    def delay(self, failures: int) -> float:
        return min(self.max_delay, self.base_delay * 2 ** (failures - 1)) * (0.5 + 0.5 * random.random())


_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "TooManyRequests",
    "TooManyRequestsException", "RequestLimitExceeded", "RequestThrottled", "BandwidthLimitExceeded",
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "500", "502", "503", "504",
})
_TRANSIENT_TYPES = frozenset({
    "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError", "ReadTimeoutError",
    "ConnectTimeoutError", "IncompleteReadError", "ResponseStreamingError", "ResponseParserError",
    "ClientConnectionError", "ClientOSError", "ServerDisconnectedError", "ClientPayloadError",
    "ServerTimeoutError", "FSTimeoutError", "IncompleteRead", "RemoteDisconnected", "ProtocolError",
})
_TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EPIPE,
                               errno.ETIMEDOUT, errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH})


def is_transient(exc: BaseException | None) -> bool:
    """Whether an error from a remote store is worth retrying (walks the exception's causes)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                            NotADirectoryError)):
            return False
        if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        if any(cls.__name__ in _TRANSIENT_TYPES for cls in type(exc).__mro__):
            return True
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _TRANSIENT_CODES or (isinstance(status, int) and (status >= 500 or status == 429)):
                return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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


def open_chunkstore(url: str, storage_options: dict | None = None, *, concurrency: int = 16) -> ChunkStore:
    """The store for ``url``; ``concurrency`` bounds the requests in flight on a remote store."""
    if is_local(url):
        return LocalChunkStore(local_path(url))
    return FsspecChunkStore(url, storage_options or {}, concurrency=concurrency)


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
        tmp = self._write_beside(path, data, durable)
        os.replace(tmp, path)
        if durable:
            fsync_dir(os.path.dirname(path))

    @staticmethod
    def _write_beside(path: str, data: bytes, durable: bool) -> str:
        """Write ``data`` to a new temp file next to ``path`` (fsynced if ``durable``); its name."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.partial"
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def delete(self, key: str) -> None:
        try:
            os.remove(self.path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist, complete or not at all. False if it did.

        The bytes go to a fsynced temp file that is then hard-linked to the key (``link`` fails if
        the name exists, atomically), so a process killed half-way never leaves an empty or
        partial object behind. Where hard links are not supported, ``O_CREAT | O_EXCL``.
        """
        path = self.path(key)
        tmp = self._write_beside(path, data, durable=True)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            return self._create_exclusive(path, data)
        finally:
            os.remove(tmp)
        fsync_dir(os.path.dirname(path))
        return True

    @staticmethod
    def _create_exclusive(path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(os.path.dirname(path))
        return True

    def put_in_place(self, key: str, data: bytes) -> None:
        """Write the object's bytes over the existing file (or a new one), without truncating.

        Not atomic: only for objects no commit refers to yet (a torn write is then invisible).
        Far cheaper than `put`: no temp file, no rename, the file's pages are reused. A file is
        cut only when the new bytes are shorter (compressed chunks, which are never mapped).
        """
        path = self.path(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if os.fstat(fd).st_size > len(data):  # compressed chunks vary in size; raw ones never do
                os.ftruncate(fd, len(data))
        finally:
            os.close(fd)

    def sync_all(self) -> None:
        """Make everything written on this store's filesystem durable: one ``syncfs`` (Linux),
        far cheaper than an fsync per file when many files were written."""
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

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


def _syncfs(fd: int) -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syncfs(fd)
    except (OSError, AttributeError):
        return -1


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecChunkStore:
    """Objects under an fsspec URL. A PUT of one object is atomic on object stores.

    ``concurrency`` bounds the GETs in flight in `get_many`; ``retry`` bounds the retries of
    transient failures (both may be changed on a live store).
    """

    def __init__(self, url: str, storage_options: dict, *, concurrency: int = 16,
                 retry: RetryPolicy | None = None):
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.concurrency = max(1, int(concurrency))
        self.retry = retry or RetryPolicy()
        self.retried = 0  # transient failures retried so far (for tests and benchmarks)
        self._cat_kwargs: dict[str, Any] = {}
        if getattr(self.fs, "async_impl", False):
            try:
                if "max_concurrency" in inspect.signature(self.fs._cat_file).parameters:
                    self._cat_kwargs = {"max_concurrency": 1}  # s3fs: one GET, no HEAD first
            except (TypeError, ValueError):
                pass

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Every key's bytes (None where missing), at most ``concurrency`` requests in flight."""
        if not keys:
            return []
        paths = [self.path(k) for k in keys]
        if getattr(self.fs, "async_impl", False):
            found = fsspec.asyn.sync(self.fs.loop, self._get_all, keys, paths)
        else:
            found = [self._call(key, "read", lambda p=p: self._cat_or_none(p)) for key, p in zip(keys, paths)]
        for value in found:
            if isinstance(value, BaseException):
                raise value
        return found

    async def _get_all(self, keys: list[str], paths: list[str]) -> list[Any]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(key: str, path: str) -> bytes | None:
            async with gate:
                return await self._call_async(key, "read", lambda: self._cat_or_none_async(path))

        return await asyncio.gather(*(one(k, p) for k, p in zip(keys, paths)), return_exceptions=True)

    async def _cat_or_none_async(self, path: str) -> bytes | None:
        try:
            return await self.fs._cat_file(path, **self._cat_kwargs)
        except FileNotFoundError:
            return None

    def _cat_or_none(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def _give_up(self, key: str, what: str, tries: int, started: float, exc: BaseException) -> StoreUnavailableError:
        return StoreUnavailableError(
            errno.EIO, f"{self.url!r}: {what} of {key!r} failed after {tries} tries in "
            f"{time.monotonic() - started:.1f} s; last error: {type(exc).__name__}: {exc}")

    def _retry_delay(self, key: str, what: str, failures: int, started: float, exc: Exception) -> float:
        """Seconds to wait before trying again after ``exc``; raises it when it is not transient,
        or `StoreUnavailableError` when the retry budget is spent."""
        if not is_transient(exc):
            raise exc
        policy = self.retry
        wait = policy.delay(failures)
        if failures >= policy.attempts or time.monotonic() + wait - started > policy.budget_s:
            raise self._give_up(key, what, failures, started, exc) from exc
        self.retried += 1
        return wait

    def _call(self, key: str, what: str, fn: Callable[[], Any]) -> Any:
        started, failures = time.monotonic(), 0
        while True:
            try:
                return fn()
            except Exception as exc:
                failures += 1
                time.sleep(self._retry_delay(key, what, failures, started, exc))

    async def _call_async(self, key: str, what: str, fn: Callable[[], Any]) -> Any:
        started, failures = time.monotonic(), 0
        while True:
            try:
                return await fn()
            except Exception as exc:
                failures += 1
                await asyncio.sleep(self._retry_delay(key, what, failures, started, exc))

    def put(self, key: str, data: bytes | memoryview, durable: bool = False) -> None:
        data = bytes(data)  # object-store clients want bytes
        self._call(key, "write", lambda: self.fs.pipe_file(self.path(key), data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist. False if it did.

        A conditional PUT (``If-None-Match: *``) where the filesystem supports it (s3fs, memory);
        elsewhere write-then-read-back, which two racing creators can both pass.
        """
        path = self.path(key)
        try:
            self._call(key, "write", lambda: self.fs.pipe_file(path, data, mode="create"))
            return True
        except FileExistsError:
            return False
        except (TypeError, NotImplementedError, ValueError):
            pass
        if self.get(key) is not None:
            return False
        self.put(key, data)
        return self.get(key) == data

    def delete(self, key: str) -> None:
        def rm() -> None:
            try:
                self.fs.rm_file(self.path(key))
            except FileNotFoundError:
                pass
        self._call(key, "delete", rm)

    def exists(self, key: str) -> bool:
        return self._call(key, "check", lambda: self.fs.exists(self.path(key)))
