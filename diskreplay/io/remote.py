"""`FsspecChunkStore`: a buffer's objects under any fsspec URL (s3://, gs://, memory://, ...).

`get_many` runs one coroutine per key on the filesystem's event loop, at most ``concurrency`` in
flight (a semaphore), each a single GET (for s3fs, without the HEAD it would otherwise send
first); on ``s3://`` a whole object's first try is a plain GET on the store's threads instead
(`S3Gets`), its retries coroutines as above. Every call (get, put, put_if_absent, delete,
exists, clear) retries *transient* failures (connection resets and timeouts, HTTP 5xx and 429,
S3 ``SlowDown``/throttling codes) with exponential backoff and jitter, bounded by `RetryPolicy`:
``attempts`` tries per object, and a deadline of ``budget_s`` seconds per object from its first
try (a plain GET's socket times out then). On an async filesystem (s3fs)
every call is a coroutine on the filesystem's loop and a try still running at the deadline is
cancelled (a blackholed endpoint cannot block past it); then `StoreUnavailableError` names the
URL, the key and the operation. A missing object is never retried and never an error here:
``get`` returns None and the caller decides. Retries of the layers below (botocore, s3fs) still
apply first, inside each try; `RetryPolicy` bounds the whole.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import itertools
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import fsspec
import fsspec.asyn

from ..errors import StoreUnavailableError
from . import s3fs_session
from .retry import RetryPolicy, is_transient
from .s3_gets import S3Gets
from .store import Blob, Data, ParallelMap, Range, Ranged, as_bytes, digest, parts_of
from .threads import Threads

log = logging.getLogger(__name__)
_FILESYSTEMS: weakref.WeakSet[Any] = weakref.WeakSet()
"""The filesystems this process's stores were given."""
_INHERITED: list[Any] = []
"""In a forked child: the filesystems of its parents' stores, held for good and never used.
Collected on the child's event loop, one would close (its finalizer: s3fs, gcsfs) the parent's
pooled connections through the parent's loop, whose epoll set the child shares: the parent would
stop hearing from them, and its next request on one would wait for its deadline."""


def _after_fork_in_child() -> None:
    # older fsspecs (2024.12, the floor) keep their IO loop's thread in a forked child, where it does
    # not run: every call would wait on it forever (later fsspecs reset it themselves, as this does)
    fsspec.asyn.reset_lock()
    _INHERITED.extend(_FILESYSTEMS)
    _FILESYSTEMS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

RANGES_PER_REQUEST = 8
"""`get_ranges` keeps this many times ``concurrency`` ranged GETs in flight (and an s3fs store's
connection pool has room for them)."""
SLOW_CALL_S = 5.0
"""A store call taking this many seconds or more (retries included) is logged at INFO."""


@dataclass(frozen=True)
class FirstTry:
    """A first try made outside the event loop (a blocking call on a thread): when it started
    (monotonic seconds) and how it failed."""

    started: float
    error: Exception


class RemoteCalls:
    """What the remote stores share: their retry layer under `RetryPolicy` (``retry``; ``retried``
    counts the transient failures retried so far) and their bounded gathers on an event loop
    (``concurrency`` at once). ``retry`` and ``concurrency`` may be changed on a live store."""

    def __init__(self, url: str, concurrency: int, retry: RetryPolicy | None):
        self.url = url
        self.concurrency = max(1, int(concurrency))
        self.retry = retry or RetryPolicy()
        self.retried = 0

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes (at most ``limit`` of them: one ranged GET), or None if missing."""
        return as_bytes(self.get_many([key], limit)[0])

    @property
    def range_concurrency(self) -> int:
        """Ranged GETs in flight in `get_ranges`: small ones cost their latency, not bandwidth."""
        return RANGES_PER_REQUEST * self.concurrency

    def get_many(self, keys: list[str], limit: int | None = None) -> list[Blob | None]:
        raise NotImplementedError

    def get_ranges(self, ranges: Sequence[Range]) -> list[Ranged | None]:
        raise NotImplementedError

    def read_into(self, key: str, out: list[memoryview]) -> int | None:
        """The object read (one GET) into the buffers ``out``, one after the other; the bytes
        copied, or None if it does not exist."""
        blob = self.get_many([key])[0]
        if blob is None:
            return None
        done = 0
        for view in out:
            piece = blob[done:done + view.nbytes]
            view[:len(piece)] = piece
            done += len(piece)
        return done

    def prefetch(self, keys: list[str]) -> None:
        """Nothing: remote reads fetch what they need, many at once."""

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        raise NotImplementedError

    def put_in_place(self, key: str, data: Data) -> None:
        """A `put`: object stores have no cheaper write."""
        self.put(key, data)

    def sync(self, keys: Collection[str], parallel_map: ParallelMap = map) -> None:
        """Nothing: a PUT is durable when it returns."""

    def _event_loop(self) -> Any:
        """The event loop the store's coroutines run on."""
        raise NotImplementedError

    def _gather_all(self, makers: list[Any], concurrency: int) -> list[Any]:
        """Every ``maker()`` awaited on the store's event loop, ``concurrency`` at once; the
        first error raised."""
        if not makers:
            return []
        return self._results(fsspec.asyn.sync(self._event_loop(), self._gather_bounded, makers, True, concurrency))

    def _first_here(self, items: list[Any], width: int, threads: Threads, first: Callable[[Any], Any],
                    again: Callable[[Any, FirstTry], Any]) -> list[Any]:
        """``first(item)`` for every item on ``threads``, ``width`` at once; the items whose
        first try failed are tried again on the event loop (``again(item, first_try)`` makes the
        coroutine: the retry policy goes on from that failure). Raises as `_gather_all`."""
        found: list[Any] = [None] * len(items)
        order = itertools.count()

        def work() -> None:
            while (i := next(order)) < len(items):
                started = time.monotonic()
                try:
                    found[i] = first(items[i])
                except Exception as exc:
                    found[i] = FirstTry(started, self._first_error(exc, started))

        for job in [threads.submit(work) for _ in range(min(width, len(items)))]:
            job.result()
        retry = [i for i, value in enumerate(found) if isinstance(value, FirstTry)]
        for i, value in zip(retry, self._gather_all([again(items[i], found[i]) for i in retry], width)):
            found[i] = value
        return self._results(found)

    def _first_error(self, exc: Exception, started: float) -> Exception:
        """How a first try's error ``exc`` counts for the retries after it."""
        return exc

    @staticmethod
    def _results(found: list[Any]) -> list[Any]:
        """``found`` (a `_gather_bounded` with ``return_exceptions``), or its first error raised."""
        for value in found:
            if isinstance(value, BaseException):
                raise value
        return found

    async def _gather_bounded(self, makers: Sequence[Callable[[], Awaitable[Any]]],
                              return_exceptions: bool = False, concurrency: int | None = None) -> list[Any]:
        """Every ``maker()`` awaited, at most ``concurrency`` (default: the store's) at once; results in order. With
        ``return_exceptions`` errors take their result's place; without, the first error is
        raised and the rest are cancelled (as all are when the caller is cancelled)."""
        gate = asyncio.Semaphore(concurrency or self.concurrency)

        async def one(make: Callable[[], Awaitable[Any]]) -> Any:
            async with gate:
                return await make()

        tasks = [asyncio.ensure_future(one(make)) for make in makers]
        try:
            return await asyncio.gather(*tasks, return_exceptions=return_exceptions)
        finally:
            for task in tasks:
                task.cancel()  # a no-op for finished tasks

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

    async def _call_async(self, what: str, fn: Callable[[], Awaitable[Any]], first: FirstTry | None = None) -> Any:
        """``await fn()`` retried as `_retry_delay` decides (after ``first``, a failed first try
        made elsewhere, if given); a try still running at the deadline (``budget_s`` seconds
        after the first try started) is cancelled."""
        started, failures = (time.monotonic(), 0) if first is None else (first.started, 1)
        deadline = started + self.retry.budget_s
        if first is not None:
            await asyncio.sleep(self._retry_delay(what, failures, started, first.error))
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
        if not self._is_transient(exc):
            raise exc
        policy = self.retry
        wait = policy.delay(failures)
        if failures >= policy.attempts:
            raise self._give_up(what, failures, started, f"all {policy.attempts} attempts used", exc) from exc
        if time.monotonic() + wait >= started + policy.budget_s:
            raise self._give_up(what, failures, started,
                                f"the retry deadline of {policy.budget_s:g} s was reached", exc) from exc
        self.retried += 1
        log.info("%r: %s failed (%s); try %d of %d in %.2f s", self.url, what, self._describe(exc),
                 failures + 1, policy.attempts, wait)
        return wait

    def _give_up(self, what: str, tries: int, started: float, reason: str,
                 exc: BaseException) -> StoreUnavailableError:
        return StoreUnavailableError(
            errno.EIO, f"{self.url!r}: {what} failed after {tries} {'try' if tries == 1 else 'tries'} "
            f"in {time.monotonic() - started:.1f} s ({reason}); last error: {self._describe(exc)}")

    def _is_transient(self, exc: BaseException) -> bool:
        return is_transient(exc)

    def _describe(self, exc: BaseException) -> str:
        """How errors and logs name ``exc``."""
        return f"{type(exc).__name__}: {exc}"


class FsspecChunkStore(RemoteCalls):
    """Objects under an fsspec URL. A PUT of one object is atomic on object stores.

    ``concurrency`` bounds the GETs in flight in `get_many`; ``retry`` bounds the retries of
    transient failures and the time of each operation (both may be changed on a live store).
    With ``plain_gets`` (the default), the first try of each GET of an ``s3://`` URL (of a whole
    object, or of a small one bounded by ``limit``) is a plain GET (`S3Gets`: a third to a half
    of s3fs's CPU per byte; it survives ``fork``) where the storage options allow it;
    ``plain_gets`` is then that `S3Gets`, else None (after S3 refused one, s3fs makes every GET
    of the store).
    On an async filesystem (s3fs, gcsfs, ...) each operation is a coroutine on ``fs.loop`` and a
    try still running at the policy's deadline is cancelled; a store inherited through a fork
    makes a filesystem of its own in the child. On a sync filesystem (memory://) a
    call cannot be interrupted: the deadline is only checked between tries.
    """

    supports_mmap = False
    needs_sync = False
    request_bytes = 1 << 19
    """About what a GET costs beside its bytes (s3fs in ``tools/bench_client.py`` here: 393 ranged
    GETs a second, 264 MB/s in large objects: 670 KB)."""

    def __init__(self, url: str, storage_options: dict[str, Any], *, concurrency: int = 16,
                 retry: RetryPolicy | None = None, plain_gets: bool = True):
        super().__init__(url, concurrency, retry)
        self.plain_gets = S3Gets.for_options(url, storage_options) if plain_gets else None
        self._threads = Threads(self.range_concurrency, "diskreplay-get")
        self._fs_options = pool_options(url, storage_options, self.range_concurrency)
        self._fs, root = fsspec.core.url_to_fs(url, **self._fs_options)
        self._fs_pid = os.getpid()
        _FILESYSTEMS.add(self._fs)
        self.root = root.rstrip("/")
        self._async = bool(getattr(self.fs, "async_impl", False))
        self._cat_kwargs: dict[str, Any] = {}
        if self._async:
            try:
                if "max_concurrency" in inspect.signature(self.fs._cat_file).parameters:
                    self._cat_kwargs = {"max_concurrency": 1}  # s3fs: one GET, no HEAD first
            except (TypeError, ValueError):
                pass

    @property
    def fs(self) -> Any:
        """The store's filesystem; in a forked child, one of its own (an async filesystem's loop
        and connections are its parent's: fsspec refuses to use them there)."""
        if self._fs_pid != os.getpid():
            self._fs, _ = fsspec.core.url_to_fs(self.url, **self._fs_options)
            self._fs_pid = os.getpid()
            _FILESYSTEMS.add(self._fs)
        return self._fs

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    # ---- operations -------------------------------------------------------------------------

    def get_many(self, keys: list[str], limit: int | None = None) -> list[Blob | None]:
        """Every key's bytes (at most ``limit`` of each: a bound for small objects; None where
        missing), at most ``concurrency`` requests in flight. The first try is a plain GET
        (`S3Gets`) where ``plain_gets`` is set."""
        if not self._async:
            return [self._get_sync(key, limit) for key in keys]
        gets = self.plain_gets
        if gets is not None and keys:
            return self._first_here(keys, self.concurrency, self._threads,
                                    lambda key: gets.get(key, self.retry.budget_s, limit),
                                    lambda key, first: self._get_again(key, limit, first))
        return self._gather_all([partial(self._get_async, key, limit) for key in keys], self.concurrency)

    def _get_again(self, key: str, limit: int | None, first: FirstTry) -> Callable[[], Awaitable[Blob | None]]:
        """The GET after a failed first try: the policy's next try if the failure was transient;
        else s3fs's first, and no more plain GETs in this store (S3 refused one: s3fs's client
        is the reference for what that means)."""
        if self._is_transient(first.error):
            return partial(self._get_async, key, limit, first)
        if self.plain_gets is not None:
            log.info("%r: s3fs serves every GET from now on (a plain GET failed: %s)", self.url,
                     self._describe(first.error))
            self.plain_gets = None
        return partial(self._get_async, key, limit)

    def get_ranges(self, ranges: Sequence[Range]) -> list[Ranged | None]:
        """Each range's bytes and its object's size (None where missing), at most
        ``range_concurrency`` ranged GETs in flight."""
        if self._async:
            return self._gather_all([partial(self._range_async, *one) for one in ranges], self.range_concurrency)
        return [self._range_sync(*one) for one in ranges]

    def _event_loop(self) -> Any:
        return self.fs.loop

    async def _get_async(self, key: str, limit: int | None = None, first: FirstTry | None = None) -> bytes | None:
        try:
            blob: bytes = await self._call_async(f"read of {key!r}", partial(self._cat_async, self.path(key), limit),
                                                 first)
            return blob
        except FileNotFoundError:
            return None

    async def _cat_async(self, path: str, limit: int | None) -> bytes:
        """One GET of the object (its first ``limit`` bytes: a ranged GET)."""
        if limit is not None:
            try:
                ranged: bytes = await self.fs._cat_file(path, start=0, end=limit, **self._cat_kwargs)
                return ranged
            except OSError as exc:
                if not _unsatisfiable(exc):
                    raise
                # an empty object has no byte 0 to range over (HTTP 416): it is shorter than limit
        blob: bytes = await self.fs._cat_file(path, **self._cat_kwargs)
        return blob

    def _get_sync(self, key: str, limit: int | None = None) -> bytes | None:
        span = {} if limit is None else {"start": 0, "end": limit}
        try:
            blob: bytes = self._run(f"read of {key!r}", "cat_file", self.path(key), **span)
            return blob
        except FileNotFoundError:
            return None

    async def _range_async(self, key: str, start: int, stop: int) -> Ranged | None:
        try:
            ranged: Ranged = await self._call_async(f"read of {key!r}",
                                                    partial(self._ranged_get, self.path(key), start, stop))
            return ranged
        except FileNotFoundError:
            return None

    async def _ranged_get(self, path: str, start: int, stop: int) -> Ranged:
        """One ranged GET on S3 (the object's size from its ``Content-Range``); elsewhere the
        object's size (a HEAD), then the range."""
        if stop <= start:
            return b"", -1
        try:
            if not hasattr(self.fs, "_call_s3"):
                size = int((await self.fs._info(path))["size"])
                return await self.fs._cat_file(path, start=start, end=stop), size
            bucket, key, _ = self.fs.split_path(path)
            answer = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}")
            try:
                return await answer["Body"].read(), int(answer["ContentRange"].rsplit("/", 1)[1])
            finally:
                answer["Body"].close()
        except OSError as exc:
            if not _unsatisfiable(exc):
                raise
            return b"", -1  # HTTP 416: the object ends before ``start``

    def _range_sync(self, key: str, start: int, stop: int) -> Ranged | None:
        try:
            size = int(self._run(f"read of {key!r}", "info", self.path(key))["size"])
            return self._run(f"read of {key!r}", "cat_file", self.path(key), start=start, end=stop), size
        except FileNotFoundError:
            return None

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        """One PUT (atomic and durable on object stores, whatever ``durable`` says)."""
        data = b"".join(parts_of(data))  # object-store clients want bytes
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

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        """The object's bytes and its ETag: one GET on S3; elsewhere a HEAD, then a GET
        (`put_if_version` with that ETag fails if the object changed in between), or a digest of
        its bytes where there is no ETag."""
        if hasattr(self.fs, "_call_s3"):
            try:
                found: tuple[bytes, str] = fsspec.asyn.sync(self.fs.loop, self._call_async, f"read of {key!r}",
                                                            partial(self._get_with_etag, self.path(key), limit))
                return found
            except FileNotFoundError:
                return None
        try:
            etag = self._run(f"read of {key!r}", "info", self.path(key)).get("ETag")
        except FileNotFoundError:
            return None
        blob = self.get(key, limit)
        return None if blob is None else (blob, etag if isinstance(etag, str) and etag else digest(blob))

    def put_if_version(self, key: str, data: bytes, version: str | None, durable: bool = False) -> str | None:
        """A conditional PUT: ``If-Match: <version>`` (``If-None-Match: *`` for None) on S3.
        Where the filesystem keeps no ETags (memory://): read, compare, write, which two racing
        writers can both pass."""
        if version is not None and version.startswith("sha256:"):
            found = self.get_versioned(key)
            return None if found is None or found[1] != version else self._put_versioned(key, data)
        try:
            match: dict[str, Any] = {"mode": "create"} if version is None else {"IfMatch": version}
            out = self._run(f"conditional write of {key!r}", "pipe_file", self.path(key), data, **match)
        except (FileExistsError, OSError) as exc:
            if not isinstance(exc, FileExistsError) and "pre-condition" not in str(exc):
                raise
            found = self.get_versioned(key)  # our PUT may have landed with its reply lost
            return found[1] if found is not None and found[0] == data else None
        etag = out.get("ETag") if isinstance(out, dict) else None
        return etag if isinstance(etag, str) and etag else digest(data)

    async def _get_with_etag(self, path: str, limit: int | None) -> tuple[bytes, str]:
        bucket, key, _ = self.fs.split_path(path)
        answer = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
        try:
            body: bytes = await (answer["Body"].read() if limit is None else answer["Body"].read(limit))
        finally:
            answer["Body"].close()
        etag = answer.get("ETag")
        return body, etag if isinstance(etag, str) and etag else digest(body)

    def _put_versioned(self, key: str, data: bytes) -> str:
        self.put(key, data)
        found = self.get_versioned(key)
        return found[1] if found is not None else digest(data)

    def delete(self, key: str) -> None:
        try:
            self._run(f"delete of {key!r}", "rm_file", self.path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return bool(self._run(f"existence check of {key!r}", "exists", self.path(key)))

    def sizes(self) -> dict[str, int]:
        """Every object under the root (one listing): its key and its size in bytes."""
        self.fs.invalidate_cache(self.root)
        found = self._run(f"listing of {self.root!r}", "find", self.root, detail=True)
        return {path[len(self.root):].strip("/"): int(meta.get("size") or 0) for path, meta in found.items()}

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

def pool_options(url: str, storage_options: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """``storage_options`` with, for s3fs, a botocore connection pool of at least ``concurrency``
    connections (botocore's default of 10 would cap the requests in flight), unless the options
    set ``max_pool_connections`` themselves, and the process's shared session
    (`diskreplay.io.s3fs_session`)."""
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return storage_options
    storage_options = s3fs_session.with_session(storage_options)
    config = dict(storage_options.get("config_kwargs") or {})
    if "max_pool_connections" in config:
        return storage_options
    config["max_pool_connections"] = max(concurrency, 10)
    return {**storage_options, "config_kwargs": config}


def _unsatisfiable(exc: OSError) -> bool:
    """Whether s3fs reports HTTP 416: a range starting past the object's end."""
    return "range is not satisfiable" in str(exc)


async def _cancel_at(fn: Callable[[], Awaitable[Any]], deadline: float) -> Any:
    """``await fn()``, cancelled at monotonic time ``deadline`` (then a `TimeoutError` saying so)."""
    remaining = deadline - time.monotonic()
    try:
        return await asyncio.wait_for(fn(), remaining)
    except TimeoutError:
        if time.monotonic() < deadline:
            raise  # a timeout of the layers below, before ours
        raise TimeoutError(f"no answer within {max(remaining, 0):.2f} s: the request was cancelled") from None

