"""Byte-level access to a buffer's objects: chunk files, the commit record, state files.

Two backends behind one small interface: `LocalChunkStore` (plain files: atomic temp+rename
writes, optional fsync, reads straight into preallocated memory) and `FsspecChunkStore` (any
fsspec URL: s3://, gs://, memory://, ...). `open_chunkstore` picks one from a URL.

Remote I/O. `FsspecChunkStore.get_many` runs one coroutine per key on the filesystem's event loop,
at most ``concurrency`` in flight (a semaphore), each a single GET (for s3fs, without the HEAD it
would otherwise send first). Every remote call (get, put, put_if_absent, delete, exists, clear)
retries *transient* failures — connection resets and timeouts, HTTP 5xx and 429, S3
``SlowDown``/throttling codes — with exponential backoff and jitter, bounded by `RetryPolicy`:
``attempts`` tries per object, and a deadline of ``budget_s`` seconds per object from its first
try. On an async filesystem (s3fs) every call is a coroutine on the filesystem's loop and a try
still running at the deadline is cancelled (a blackholed endpoint cannot block past it); then
`StoreUnavailableError` names the URL, the key and the operation. A missing object is never
retried and never an error here: ``get`` returns None and the caller decides (a chunk the commit
says exists is a `CorruptBufferError` in storage). Retries of the layers below (botocore, s3fs)
still apply first, inside each try; `RetryPolicy` bounds the whole.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import inspect
import logging
import math
import os
import random
import shutil
import time
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable, Iterable, Protocol, Sequence

import fsspec
import fsspec.asyn

from .errors import StoreUnavailableError

log = logging.getLogger(__name__)
SLOW_CALL_S = 5.0
"""A store call taking this many seconds or more (retries included) is logged at INFO."""


@dataclass
class RetryPolicy:
    """How transient remote failures are retried, per object (all times in seconds).

    ``attempts`` tries in all (an int >= 1), waiting ``base_delay * 2**k`` seconds between them
    (capped at ``max_delay`` seconds, with jitter). ``budget_s`` is a deadline: no operation on one
    object runs longer than ``budget_s`` seconds from its first try (on an async filesystem a try
    still running then is cancelled). Fields are checked when set: a bad value is a `ValueError`.
    """

    attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 2.0
    budget_s: float = 30.0

    def __setattr__(self, name: str, value: Any) -> None:
        _check_policy_field(name, value)
        super().__setattr__(name, value)

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure (jittered: 50-100 % of the backoff)."""
        return min(self.max_delay, self.base_delay * 2 ** (failures - 1)) * (0.5 + 0.5 * random.random())


def _check_policy_field(name: str, value: Any) -> None:
    """Raise `ValueError` naming the field, what it must be and what it got."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name == "attempts":
        ok, expected = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "an int >= 1"
    elif name in ("base_delay", "max_delay"):
        ok, expected = number and math.isfinite(value) and value >= 0, "a finite number of seconds >= 0"
    elif name == "budget_s":
        ok, expected = number and math.isfinite(value) and value > 0, "a finite number of seconds > 0"
    else:
        return
    if not ok:
        raise ValueError(f"RetryPolicy.{name} must be {expected}, got {value!r}")


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


Data = bytes | memoryview | Sequence[bytes | memoryview]
"""An object's bytes, whole or in parts that are stored one after the other."""


def _parts(data: Data) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(part).cast("B") for part in data]


class ChunkStore(Protocol):
    url: str

    def get(self, key: str, limit: int | None = None) -> bytes | None: ...
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...
    def put(self, key: str, data: Data, durable: bool = False) -> None: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...
    def clear(self) -> None: ...


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)


def open_chunkstore(url: str, storage_options: dict | None = None, *, concurrency: int = 16,
                    retry: RetryPolicy | None = None) -> ChunkStore:
    """The store for ``url``; ``concurrency`` bounds the requests in flight on a remote store,
    ``retry`` how its transient failures are retried (local files are not retried)."""
    if is_local(url):
        return LocalChunkStore(local_path(url))
    return FsspecChunkStore(url, storage_options or {}, concurrency=concurrency, retry=retry)


class LocalChunkStore:
    """Files under a directory. Writes are atomic (temp file in the same directory + rename)."""

    def __init__(self, root: str):
        self.root = root
        self.url = root

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes (at most ``limit`` of them), or None if it does not exist."""
        try:
            with open(self.path(key), "rb") as f:
                if limit is None:
                    return f.read()
                return f.read(min(limit, os.fstat(f.fileno()).st_size))  # read(n) would allocate n
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # no such file (a folder is none)
            return None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def prefetch(self, keys: list[str]) -> None:
        """Ask the OS to start reading these files into its page cache (in the background, all at
        once: many requests in flight); missing files are skipped."""
        for key in keys:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read_into(self, key: str, out: list[memoryview]) -> int | None:
        """Read the object into the buffers ``out``, one after the other; returns the bytes read
        (fewer than they hold if the object is shorter), or None if it does not exist."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.readv(fd, out)
        except IsADirectoryError:
            return None
        finally:
            os.close(fd)

    def put(self, key: str, data: Data, durable: bool = False) -> None: ...
    def delete(self, key: str) -> None: ...
    def exists(self, key: str) -> bool: ...
    def clear(self) -> None: ...


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return os.path.abspath(url[len("file://"):] if url.startswith("file://") else url)


def open_chunkstore(url: str, storage_options: dict | None = None, *, concurrency: int = 16,
                    retry: RetryPolicy | None = None) -> ChunkStore:
    """The store for ``url``; ``concurrency`` bounds the requests in flight on a remote store,
    ``retry`` how its transient failures are retried (local files are not retried)."""
    if is_local(url):
        return LocalChunkStore(local_path(url))
    return FsspecChunkStore(url, storage_options or {}, concurrency=concurrency, retry=retry)


class LocalChunkStore:
    """Files under a directory. Writes are atomic (temp file in the same directory + rename)."""

    def __init__(self, root: str):
        self.root = root
        self.url = root

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes (at most ``limit`` of them), or None if it does not exist."""
        try:
            with open(self.path(key), "rb") as f:
                if limit is None:
                    return f.read()
                return f.read(min(limit, os.fstat(f.fileno()).st_size))  # read(n) would allocate n
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # no such file (a folder is none)
            return None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def prefetch(self, keys: list[str]) -> None:
        """Ask the OS to start reading these files into its page cache (in the background, all at
        once: many requests in flight); missing files are skipped."""
        for key in keys:
            try:
                fd = os.open(self.path(key), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read_into(self, key: str, out: list[memoryview]) -> int | None:
        """Read the object into the buffers ``out``, one after the other; returns the bytes read
        (fewer than they hold if the object is shorter), or None if it does not exist."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.readv(fd, out)
        except IsADirectoryError:
            return None
        finally:
            os.close(fd)

    def read_indexed(self, key: str, index_bytes: int,
                     locate: Callable[[bytes], tuple[int, int] | None]) -> bytes | None:
        """Part of an object that starts with an index: its first ``index_bytes`` bytes are read
        and given to ``locate``, which returns the ``(offset, nbytes)`` to read (None: nothing,
        ``b""`` is returned). None if the object does not exist. Raises ValueError (from
        ``locate``, or for an object shorter than the index or the span)."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        try:
            index = os.pread(fd, index_bytes, 0)
            if len(index) != index_bytes:
                raise ValueError(f"{len(index)} bytes: too short to hold an index of {index_bytes} bytes")
            span = locate(index)
            if span is None:
                return b""
            blob = os.pread(fd, span[1], span[0])
            if len(blob) != span[1]:
                raise ValueError(f"span {span} runs past the end of the object")
            return blob
        except IsADirectoryError:
            return None
        finally:
            os.close(fd)

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        """Replace the object atomically: a new temp file beside it, then a rename. If writing
        fails (a full disk), the temp file is removed and the old object is untouched."""
        path = self.path(key)
        tmp = self._write_beside(path, data, durable)
        os.replace(tmp, path)
        if durable:
            fsync_dir(os.path.dirname(path))

    @staticmethod
    def _write_beside(path: str, data: Data, durable: bool) -> str:
        """Write ``data`` to a new temp file next to ``path`` (fsynced if ``durable``); its name."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, _parts(data))
            if durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.remove(tmp)
            raise
        os.close(fd)
        return tmp

    def delete(self, key: str) -> None:
        try:
            os.remove(self.path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def clear(self) -> None:
        """Remove every file under the root, and the root itself (a missing root is no error)."""
        try:
            shutil.rmtree(self.root)
        except FileNotFoundError:
            pass

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

    def put_in_place(self, key: str, data: Data) -> None:
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
            size = _write_all(fd, _parts(data))
            if os.fstat(fd).st_size > size:  # compressed chunks vary in size; raw ones never do
                os.ftruncate(fd, size)
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


def _write_all(fd: int, parts: list[memoryview]) -> int:
    """Write every part at the file's position (``writev``, repeated after a short write)."""
    size = sum(part.nbytes for part in parts)
    while parts:
        written = os.writev(fd, parts)
        while parts and written >= parts[0].nbytes:
            written -= parts[0].nbytes
            parts = parts[1:]
        if parts and written:
            parts[0] = parts[0][written:]
    return size


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
    transient failures and the time of each operation (both may be changed on a live store).
    On an async filesystem (s3fs, gcsfs, ...) each operation is a coroutine on ``fs.loop`` and a
    try still running at the policy's deadline is cancelled. On a sync filesystem (memory://) a
    call cannot be interrupted: the deadline is only checked between tries.
    """

    def __init__(self, url: str, storage_options: dict, *, concurrency: int = 16,
                 retry: RetryPolicy | None = None):
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        self.concurrency = max(1, int(concurrency))
        self.retry = retry or RetryPolicy()
        self.retried = 0  # transient failures retried so far (for tests and benchmarks)
        self._async = bool(getattr(self.fs, "async_impl", False))
        self._cat_kwargs: dict[str, Any] = {}
        if self._async:
            try:
                if "max_concurrency" in inspect.signature(self.fs._cat_file).parameters:
                    self._cat_kwargs = {"max_concurrency": 1}  # s3fs: one GET, no HEAD first
            except (TypeError, ValueError):
                pass

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    # ---- operations -------------------------------------------------------------------------

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes (at most ``limit`` of them: one ranged GET), or None if missing."""
        return self.get_many([key], limit)[0]

    def get_many(self, keys: list[str], limit: int | None = None) -> list[bytes | None]:
        """Every key's bytes (None where missing), at most ``concurrency`` requests in flight."""
        if not keys:
            return []
        if self._async:
            found = fsspec.asyn.sync(self.fs.loop, self._gather_bounded,
                                     [partial(self._get_async, k, limit) for k in keys], True)
        else:
            found = [self._get_sync(key, limit) for key in keys]
        for value in found:
            if isinstance(value, BaseException):
                raise value
        return found

    async def _get_async(self, key: str, limit: int | None = None) -> bytes | None:
        path, span = self.path(key), {} if limit is None else {"start": 0, "end": limit}
        try:
            return await self._call_async(f"read of {key!r}",
                                          lambda: self.fs._cat_file(path, **self._cat_kwargs, **span))
        except FileNotFoundError:
            return None

    def _get_sync(self, key: str, limit: int | None = None) -> bytes | None:
        span = {} if limit is None else {"start": 0, "end": limit}
        try:
            return self._run(f"read of {key!r}", "cat_file", self.path(key), **span)
        except FileNotFoundError:
            return None

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        data = b"".join(_parts(data))  # object-store clients want bytes
        self._run(f"write of {key!r}", "pipe_file", self.path(key), data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist. False if it did.

        A conditional PUT (``If-None-Match: *``) where the filesystem supports it (s3fs, memory);
        elsewhere write-then-read-back, which two racing creators can both pass.
        """
        try:
            self._run(f"conditional write of {key!r}", "pipe_file", self.path(key), data, mode="create")
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
        try:
            self._run(f"delete of {key!r}", "rm_file", self.path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return bool(self._run(f"existence check of {key!r}", "exists", self.path(key)))

    def clear(self) -> None:
        """Remove every object under the root (a missing root is no error); nothing outside it.
        One operation for the retry policy: a retry lists and deletes again."""
        what = f"clear of every object under {self.root!r}"
        self.fs.invalidate_cache(self.root)  # list the server's objects, not a cached listing
        try:
            if self._async:
                fsspec.asyn.sync(self.fs.loop, self._call_async, what, self._clear_async)
            else:
                self._call(what, lambda: self.fs.rm(self.root, recursive=True))
        except FileNotFoundError:
            pass
        finally:
            self.fs.invalidate_cache(self.root)

    async def _clear_async(self) -> None:
        """List the objects under the root, then delete them: s3fs's bulk delete (1000 keys a
        request) where the filesystem has one, else one request per object; ``concurrency``
        requests at once. Not ``fs._rm``: fsspec runs its requests in tasks that outlive a
        cancelled caller, so a delete could land after the deadline."""
        paths = await self.fs._find(self.root)
        bulk = getattr(self.fs, "_bulk_delete", None)
        if bulk is not None:
            makers = [partial(bulk, paths[i:i + 1000]) for i in range(0, len(paths), 1000)]
        else:
            makers = [partial(self.fs._rm_file, path) for path in paths]
        await self._gather_bounded(makers)

    async def _gather_bounded(self, makers: list[Callable[[], Awaitable[Any]]],
                              return_exceptions: bool = False) -> list[Any]:
        """Every ``maker()`` awaited, at most ``concurrency`` at once; results in order. With
        ``return_exceptions`` errors take their result's place; without, the first error is
        raised and the rest are cancelled (as all are when the caller is cancelled)."""
        gate = asyncio.Semaphore(self.concurrency)

        async def one(make: Callable[[], Awaitable[Any]]) -> Any:
            async with gate:
                return await make()

        tasks = [asyncio.ensure_future(one(make)) for make in makers]
        try:
            return await asyncio.gather(*tasks, return_exceptions=return_exceptions)
        finally:
            for task in tasks:
                task.cancel()  # a no-op for finished tasks

    # ---- retries under a deadline -------------------------------------------------------------

    def _run(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)`` with retries under the policy's deadline.

        On an async filesystem the coroutine ``fs._<method>`` runs on ``fs.loop`` and each try is
        cancelled at the deadline; on a sync one the plain method runs (it cannot be interrupted).
        ``what`` names the operation and its object in errors ("write of 'obs/c.0.1.0'").
        """
        if self._async:
            coroutine = getattr(self.fs, "_" + method)
            return fsspec.asyn.sync(self.fs.loop, self._call_async, what, lambda: coroutine(*args, **kwargs))
        function = getattr(self.fs, method)
        return self._call(what, lambda: function(*args, **kwargs))

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` retried as `_retry_delay` decides (sync: a try is never interrupted)."""
        started, failures = time.monotonic(), 0
        while True:
            try:
                result = fn()
            except Exception as exc:
                failures += 1
                time.sleep(self._retry_delay(what, failures, started, exc))
            else:
                self._log_if_slow(what, started, failures)
                return result

    async def _call_async(self, what: str, fn: Callable[[], Awaitable[Any]]) -> Any:
        """``await fn()`` retried as `_retry_delay` decides; a try still running at the deadline
        (``budget_s`` seconds after the first try started) is cancelled."""
        started, failures = time.monotonic(), 0
        deadline = started + self.retry.budget_s
        while True:
            try:
                result = await _cancel_at(fn, deadline)
            except Exception as exc:
                failures += 1
                await asyncio.sleep(self._retry_delay(what, failures, started, exc))
            else:
                self._log_if_slow(what, started, failures)
                return result

    def _log_if_slow(self, what: str, started: float, failures: int) -> None:
        seconds = time.monotonic() - started
        if seconds >= SLOW_CALL_S:
            log.info("%r: %s took %.1f s (%d %s)", self.url, what, seconds, failures + 1,
                     "try" if failures == 0 else "tries")

    def _retry_delay(self, what: str, failures: int, started: float, exc: Exception) -> float:
        """Seconds to wait before trying again after ``exc`` (the ``failures``-th failure of an
        operation first tried at monotonic time ``started``). Raises ``exc`` when it is not
        transient, `StoreUnavailableError` when the attempts are used up or the next try could
        not start before the deadline."""
        if not is_transient(exc):
            raise exc
        policy = self.retry
        wait = policy.delay(failures)
        if failures >= policy.attempts:
            raise self._give_up(what, failures, started, f"all {policy.attempts} attempts used", exc) from exc
        if time.monotonic() + wait >= started + policy.budget_s:
            raise self._give_up(what, failures, started,
                                f"the retry deadline of {policy.budget_s:g} s was reached", exc) from exc
        self.retried += 1
        log.info("%r: %s failed (%s: %s); try %d of %d in %.2f s", self.url, what, type(exc).__name__, exc,
                 failures + 1, policy.attempts, wait)
        return wait

    def _give_up(self, what: str, tries: int, started: float, reason: str,
                 exc: BaseException) -> StoreUnavailableError:
        return StoreUnavailableError(
            errno.EIO, f"{self.url!r}: {what} failed after {tries} {'try' if tries == 1 else 'tries'} "
            f"in {time.monotonic() - started:.1f} s ({reason}); last error: {type(exc).__name__}: {exc}")


async def _cancel_at(fn: Callable[[], Awaitable[Any]], deadline: float) -> Any:
    """``await fn()``, cancelled at monotonic time ``deadline`` (then a `TimeoutError` saying so)."""
    remaining = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(fn(), remaining)
    except asyncio.TimeoutError:
        if time.monotonic() < deadline:
            raise  # a timeout of the layers below, before ours
        raise TimeoutError(f"no answer within {max(remaining, 0):.2f} s: the request was cancelled") from None
