"""`ObstoreChunkStore`: a buffer's objects under an ``s3://`` URL through obstore (Rust ``object_store``).

The same store as `FsspecChunkStore` on s3fs (the same `RetryPolicy` layer, deadlines and errors,
shared through `RemoteCalls`), on a client that keeps more GETs in flight for a fraction of the
CPU (``tools/bench_client.py``). `open_chunkstore` picks it for ``s3://`` URLs when obstore is
installed and `s3store_config` can translate every storage option; otherwise s3fs serves them.

The first try of each GET runs on a thread of the store's own (``range_concurrency`` of them),
a blocking call of obstore's client (which releases the GIL), whose own timeout is the policy's
deadline: an event loop costs more CPU per request than the request itself. Every other call,
and every later try of a GET, runs on fsspec's I/O event loop, where a try still running at the
policy's deadline is cancelled, which drops its request (the connection is closed).

obstore's runtime (Rust threads, started once per process) does not survive ``fork``: in a child
forked after its parent used obstore, any request would hang. There s3fs serves instead: a store
inherited through a fork hands every call to an `FsspecChunkStore` of the same URL and options
(whose whole-object GETs are plain ones, `S3Gets`, on the child's own connections), and
`obstore_usable` tells `open_chunkstore` to open s3fs stores.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import fsspec.asyn
import obstore
from obstore.exceptions import AlreadyExistsError, GenericError, NotFoundError, PreconditionError
from obstore.store import S3Store

from . import s3fs_session
from .remote import FirstTry, FsspecChunkStore, RemoteCalls
from .retry import RetryPolicy, is_transient
from .store import Blob, Data, Range, Ranged, parts_of
from .threads import Threads

_STATUS = re.compile(r"status code: (\d{3})")
_XML_CODE, _XML_MESSAGE = re.compile(r"<Code>([^<]*)</Code>"), re.compile(r"<Message>([^<]*)</Message>")
_NETWORK = ("error sending request", "connection", "timed out", "timeout", "error decoding response body",
            "incomplete", "broken pipe", "reset by peer")
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_CONFIG_KWARGS = {"retries", "connect_timeout", "read_timeout", "max_pool_connections", "region_name"}
_CREDENTIALS = ("key", "secret", "token", "anon")
_CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                         "AWS_CONTAINER_CREDENTIALS_FULL_URI")


_RUNTIME_PID: int | None = None
"""The process whose obstore runtime is live (None: no obstore store was made yet)."""


def obstore_usable() -> bool:
    """Whether obstore works in this process: not in a child forked after its parent used it."""
    return _RUNTIME_PID in (None, os.getpid())


class UntranslatableOptionError(ValueError):
    """A storage option obstore has no equivalent for (s3fs serves such a URL)."""


class ObstoreChunkStore(RemoteCalls):
    """Objects under an ``s3://`` URL, through obstore's `S3Store`. A PUT is atomic and durable.

    ``storage_options`` are s3fs's (see `s3store_config`); ``concurrency`` bounds the requests in
    flight in `get_many` and `clear` (and ``config_kwargs["max_pool_connections"]`` bounds it);
    ``retry`` bounds the retries of transient failures and the time of each operation.
    """

    supports_mmap = False
    needs_sync = False
    request_bytes = 1 << 18
    """About what a GET costs beside its bytes (``tools/bench_client.py`` here: 1,800 ranged GETs a
    second, 612 MB/s in large objects: 340 KB)."""

    def __init__(self, url: str, storage_options: Mapping[str, Any], *, concurrency: int = 16,
                 retry: RetryPolicy | None = None):
        global _RUNTIME_PID
        if not obstore_usable():
            raise RuntimeError(f"{url!r}: obstore cannot run in a child forked after its parent used it")
        config, cap = s3store_config(storage_options)
        super().__init__(url, concurrency if cap is None else min(concurrency, cap), retry)
        bucket, _, prefix = url.split("://", 1)[1].partition("/")
        self.root = f"{bucket}/{prefix}".rstrip("/")
        self.s3 = _client(bucket, prefix.strip("/") or None, config)
        self._first_timeout_s = self.retry.budget_s
        self._s3_first = _client(bucket, prefix.strip("/") or None, _first_try_config(config, self.retry))
        self._threads = Threads(self.range_concurrency, "diskreplay-s3")
        self.loop = fsspec.asyn.get_loop()
        self._options, self._pid = dict(storage_options), os.getpid()
        self._forked: FsspecChunkStore | None = None
        if _RUNTIME_PID is None:
            os.register_at_fork(before=s3fs_session.warm)  # a forked child serves S3 through s3fs
            atexit.register(_runtime_out_of_python)
        _RUNTIME_PID = _RUNTIME_PID or self._pid

    def _after_fork(self) -> FsspecChunkStore | None:
        """The s3fs store that serves this one's calls in a forked child (None in its own process)."""
        if self._pid == os.getpid():
            return None
        if self._forked is None:
            self._forked = FsspecChunkStore(self.url, self._options, concurrency=self.concurrency, retry=self.retry)
        self._forked.retry, self._forked.concurrency = self.retry, self.concurrency
        return self._forked

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def _sync(self, fn: Any, *args: Any) -> Any:
        """``await fn(*args)`` on the store's event loop."""
        return fsspec.asyn.sync(self.loop, fn, *args)

    def _op(self, what: str, make: Any) -> Any:
        """``await make()`` on the event loop, under the retry policy."""
        return self._sync(self._call_async, what, make)

    # ---- operations -------------------------------------------------------------------------

    def get_many(self, keys: list[str], limit: int | None = None) -> list[Blob | None]:
        """Every key's bytes (None where missing), at most ``concurrency`` requests in flight:
        views of obstore's buffers (no copy)."""
        if (forked := self._after_fork()) is not None:
            return forked.get_many(keys, limit)
        if limit is None and self._first_tries_here():
            return self._first_here(keys, self.concurrency, self._threads, self._get_here,
                                    lambda key, first: partial(self._get_async, key, None, first))
        return self._gather_all([partial(self._get_async, key, limit) for key in keys], self.concurrency)

    def get_ranges(self, ranges: Sequence[Range]) -> list[Ranged | None]:
        """Each range's bytes and its object's size (None where missing), at most
        ``range_concurrency`` ranged GETs in flight."""
        if (forked := self._after_fork()) is not None:
            return forked.get_ranges(ranges)
        if self._first_tries_here():
            return self._first_here(list(ranges), self.range_concurrency, self._threads, self._range_here,
                                    lambda one, first: partial(self._range_async, one[0], one[1], one[2], first))
        return self._gather_all([partial(self._range_async, *one) for one in ranges], self.range_concurrency)

    def _event_loop(self) -> Any:
        return self.loop

    def _first_tries_here(self) -> bool:
        """Whether first tries may block a thread: the client's timeout is within the deadline
        (a policy made stricter on a live store leaves every try to the event loop)."""
        return self._first_timeout_s <= self.retry.budget_s

    def _first_error(self, exc: Exception, started: float) -> Exception:
        """``exc``, or the `TimeoutError` a try on the event loop reports where the client's
        timeout ended the try."""
        if time.monotonic() - started < self._first_timeout_s:
            return exc
        return TimeoutError(f"no answer within {self._first_timeout_s:.2f} s: the request was cancelled")

    def _get_here(self, key: str) -> Blob | None:
        try:
            return memoryview(obstore.get(self._s3_first, key).bytes())
        except (FileNotFoundError, NotFoundError):
            return None

    def _range_here(self, one: Range) -> Ranged | None:
        key, start, stop = one
        if stop <= start:
            return b"", -1
        try:
            return _ranged(obstore.get(self._s3_first, key, options={"range": (start, stop)}))
        except (FileNotFoundError, NotFoundError):
            return None
        except GenericError as exc:
            if _status(exc) != 416:
                raise
            return b"", -1  # the object ends before ``start``

    async def _get_async(self, key: str, limit: int | None, first: FirstTry | None = None) -> Blob | None:
        try:
            blob: Blob = await self._call_async(f"read of {key!r}", partial(self._fetch, key, limit), first)
            return blob
        except (FileNotFoundError, NotFoundError):
            return None

    async def _fetch(self, key: str, limit: int | None) -> Blob:
        """One GET of the object (its first ``limit`` bytes: a ranged GET)."""
        if limit is not None:
            try:
                return memoryview(await obstore.get_range_async(self.s3, key, start=0, end=limit))
            except GenericError as exc:
                if _status(exc) != 416:
                    raise
                # an empty object has no byte 0 to range over: the whole object is shorter than limit
        result = await obstore.get_async(self.s3, key)
        return memoryview(await result.bytes_async())

    async def _range_async(self, key: str, start: int, stop: int, first: FirstTry | None = None) -> Ranged | None:
        try:
            ranged: Ranged = await self._call_async(f"read of {key!r}", partial(self._ranged_get, key, start, stop),
                                                    first)
            return ranged
        except (FileNotFoundError, NotFoundError):
            return None

    async def _ranged_get(self, key: str, start: int, stop: int) -> Ranged:
        """One ranged GET: the bytes, and the object's size its answer gives."""
        if stop <= start:
            return b"", -1
        try:
            result = await obstore.get_async(self.s3, key, options={"range": (start, stop)})
            return bytes(await result.bytes_async()), _size(result)
        except GenericError as exc:
            if _status(exc) != 416:
                raise
            return b"", -1  # the object ends before ``start``

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        """One PUT (atomic and durable, whatever ``durable`` says)."""
        if (forked := self._after_fork()) is not None:
            forked.put(key, data)
            return
        blob = b"".join(parts_of(data))
        self._op(f"write of {key!r}", lambda: obstore.put_async(self.s3, key, blob, use_multipart=False))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist (a PUT with ``If-None-Match: *``). False if it did."""
        if (forked := self._after_fork()) is not None:
            return forked.put_if_absent(key, data)
        try:
            self._op(f"conditional write of {key!r}",
                     lambda: obstore.put_async(self.s3, key, bytes(data), mode="create", use_multipart=False))
            return True
        except AlreadyExistsError:
            return False

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        """The object's bytes (at most ``limit``) and its ETag, from one GET."""
        if (forked := self._after_fork()) is not None:
            return forked.get_versioned(key, limit)

        async def fetch() -> tuple[bytes, str]:
            try:
                result = await obstore.get_async(self.s3, key, options={"range": (0, limit)} if limit else None)
            except GenericError as exc:  # 416: an empty object has no byte 0 to range over
                if _status(exc) != 416:
                    raise
                result = await obstore.get_async(self.s3, key)
            return bytes(await result.bytes_async()), str(result.meta["e_tag"])
        try:
            return self._op(f"read of {key!r}", fetch)  # type: ignore[no-any-return]
        except (FileNotFoundError, NotFoundError):
            return None

    def put_if_version(self, key: str, data: bytes, version: str | None, durable: bool = False) -> str | None:
        """A conditional PUT: ``If-Match: <version>`` (``If-None-Match: *`` for None)."""
        if (forked := self._after_fork()) is not None:
            return forked.put_if_version(key, data, version)
        mode: Any = "create" if version is None else {"e_tag": version}
        try:
            result = self._op(f"conditional write of {key!r}",
                              lambda: obstore.put_async(self.s3, key, bytes(data), mode=mode, use_multipart=False))
        except (AlreadyExistsError, PreconditionError):
            found = self.get_versioned(key)  # our PUT may have landed with its reply lost
            return found[1] if found is not None and found[0] == data else None
        return str(result["e_tag"])

    def delete(self, key: str) -> None:
        if (forked := self._after_fork()) is not None:
            forked.delete(key)
            return
        self._op(f"delete of {key!r}", lambda: obstore.delete_async(self.s3, key))

    def exists(self, key: str) -> bool:
        if (forked := self._after_fork()) is not None:
            return forked.exists(key)
        try:
            self._op(f"existence check of {key!r}", lambda: obstore.head_async(self.s3, key))
            return True
        except (FileNotFoundError, NotFoundError):
            return False

    def sizes(self) -> dict[str, int]:
        """Every object under the root (one listing): its key and its size in bytes."""
        if (forked := self._after_fork()) is not None:
            return forked.sizes()
        found = self._op(f"listing of {self.root!r}", self._list)
        return {meta["path"]: int(meta["size"]) for meta in found}

    async def _list(self) -> list[Any]:
        return list(await obstore.list(self.s3).collect_async())

    def clear(self) -> None:
        """Remove every object under the root (a missing root is no error); nothing outside it.
        One operation for the retry policy: a retry lists and deletes again."""
        if (forked := self._after_fork()) is not None:
            return forked.clear()
        self._op(f"clear of every object under {self.root!r}", self._clear_async)

    async def _clear_async(self) -> None:
        """List, then bulk-delete 1000 keys a request, ``concurrency`` requests at once."""
        paths = [meta["path"] for meta in await self._list()]
        await self._gather_bounded([partial(obstore.delete_async, self.s3, paths[i:i + 1000])
                                    for i in range(0, len(paths), 1000)])

    # ---- errors -----------------------------------------------------------------------------

    def _is_transient(self, exc: BaseException) -> bool:
        """`is_transient`, and obstore's generic errors: HTTP 5xx and 429, and network failures."""
        if not isinstance(exc, GenericError):
            return is_transient(exc)
        status = _status(exc)
        if status is not None:
            return status >= 500 or status == 429
        text = str(exc).lower()
        return any(word in text for word in _NETWORK)

    def _describe(self, exc: BaseException) -> str:
        """The error in one line: an HTTP error as its status and S3's code and message (obstore's
        own text repeats the request and appends a debug dump)."""
        text = str(exc)
        status, code, message = _status(exc), _XML_CODE.search(text), _XML_MESSAGE.search(text)
        if status is not None and code and message:
            return f"{type(exc).__name__}: HTTP {status} {code.group(1)}: {message.group(1)}"
        return f"{type(exc).__name__}: {text.split(chr(10) + chr(10), 1)[0]}"


def _runtime_out_of_python(timeout_s: float = 1.0) -> None:
    """At exit, wait (at most ``timeout_s``) until no thread unknown to `threading` runs Python
    code. obstore's runtime threads complete a request by waking the event loop from Python
    (``call_soon_threadsafe``, which releases the GIL while it writes to the loop's pipe); one
    still doing so when the interpreter finalizes cannot take the GIL back and aborts the process."""
    known = {thread.ident for thread in threading.enumerate() if not isinstance(thread, threading._DummyThread)}
    deadline = time.monotonic() + timeout_s
    while set(sys._current_frames()) - known and time.monotonic() < deadline:
        time.sleep(0.001)


def _ranged(result: Any) -> Ranged:
    return bytes(result.bytes()), _size(result)


def _size(result: Any) -> int:
    return int(result.meta["size"])


_CLIENTS: dict[str, S3Store] = {}
"""Clients made so far, by bucket, prefix and config: a store opened again at the same place
reuses its client (no setup, and the connections its pool keeps open)."""
CLIENTS_KEPT = 64
_CLIENTS_LOCK = threading.Lock()


def _client(bucket: str, prefix: str | None, config: Mapping[str, Any]) -> S3Store:
    """An `S3Store` of these settings, made once (`_CLIENTS`; the oldest dropped past `CLIENTS_KEPT`)."""
    key = repr((bucket, prefix, sorted(config.items())))
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            client = _CLIENTS[key] = S3Store(bucket, prefix=prefix, **config)
            if len(_CLIENTS) > CLIENTS_KEPT:
                del _CLIENTS[next(iter(_CLIENTS))]
        return client


def _first_try_config(config: Mapping[str, Any], retry: RetryPolicy) -> dict[str, Any]:
    """``config`` for the client of first tries: each request ends (a timeout error) at the
    retry policy's deadline, and obstore retries nothing itself (`RemoteCalls` does)."""
    client = {**config.get("client_options", {}), "timeout": timedelta(seconds=retry.budget_s)}
    return {**config, "client_options": client, "retry_config": {"max_retries": 0}}


def _status(exc: BaseException) -> int | None:
    """The HTTP status an obstore error reports, if any."""
    found = _STATUS.search(str(exc))
    return int(found.group(1)) if found else None


def s3store_config(storage_options: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """`S3Store` keyword arguments meaning what s3fs's ``storage_options`` mean, and the cap on
    connections they set (``config_kwargs["max_pool_connections"]``, else None).

    Translated: ``endpoint_url`` (also in ``client_kwargs``; ``http://`` allows plain HTTP),
    ``key``, ``secret``, ``token``, ``anon``, ``client_kwargs["region_name"]`` and
    ``config_kwargs`` ``region_name``, ``retries`` (``total_max_attempts`` / ``max_attempts``;
    mode standard or legacy), ``connect_timeout``, ``read_timeout`` and ``max_pool_connections``.
    Anything else raises `UntranslatableOptionError` naming it, as do settings that botocore would
    look for where obstore does not: credentials neither given nor in the environment (botocore
    reads AWS profiles and instance metadata), and no region at all (s3fs looks the bucket's
    region up).
    """
    options = dict(storage_options)
    client = _known(options.pop("client_kwargs", None) or {}, _CLIENT_KWARGS, "client_kwargs")
    config = _known(options.pop("config_kwargs", None) or {}, _CONFIG_KWARGS, "config_kwargs")
    credentials = {name: options.pop(name) for name in _CREDENTIALS if name in options}
    endpoint = options.pop("endpoint_url", None) or client.get("endpoint_url")
    if options:
        raise UntranslatableOptionError(f"storage option {sorted(options)[0]!r} has no obstore equivalent")
    retries = _retries(config.get("retries"))  # every option first, then what they leave to the environment
    out: dict[str, Any] = {**_credentials(credentials), **retries}
    region = client.get("region_name") or config.get("region_name") or _env_region()
    if region is None and endpoint is None:
        raise UntranslatableOptionError("no region is set (AWS_REGION, client_kwargs['region_name']): "
                                        "s3fs looks the bucket's region up")
    out["region"] = region or "us-east-1"
    client_options: dict[str, Any] = {}
    if endpoint is not None:
        out["endpoint"] = str(endpoint)
        client_options["allow_http"] = str(endpoint).startswith("http://")
    for name in ("connect_timeout", "read_timeout"):
        if config.get(name) is not None:
            client_options[name] = timedelta(seconds=float(config[name]))
    out["client_options"] = client_options
    cap = config.get("max_pool_connections")
    return out, None if cap is None else int(cap)


def _known(section: Mapping[str, Any], allowed: set[str], name: str) -> dict[str, Any]:
    unknown = sorted(set(section) - allowed)
    if unknown:
        raise UntranslatableOptionError(f"storage option {name}[{unknown[0]!r}] has no obstore equivalent")
    return dict(section)


def _credentials(given: Mapping[str, Any]) -> dict[str, Any]:
    if given.get("anon"):
        return {"skip_signature": True}
    names = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
    out = {names[k]: str(v) for k, v in given.items() if k in names and v is not None}
    if not out and not any(os.environ.get(name) for name in _CREDENTIAL_VARIABLES):
        raise UntranslatableOptionError("no credentials are given (no key/secret or anon option, no "
                                        "AWS_ACCESS_KEY_ID): s3fs looks for them in AWS profiles and instance metadata")
    return out


def _env_region() -> str | None:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None


def _retries(retries: Mapping[str, Any] | None) -> dict[str, Any]:
    """obstore's retry config for botocore's ``retries`` (its default when None)."""
    if not retries:
        return {}
    unknown = sorted(set(retries) - {"total_max_attempts", "max_attempts", "mode"})
    if unknown or retries.get("mode", "standard") not in ("standard", "legacy"):
        what = repr(unknown[0]) if unknown else f"mode {retries.get('mode')!r}"
        raise UntranslatableOptionError(f"storage option config_kwargs['retries'] {what} has no obstore equivalent")
    if "total_max_attempts" in retries:
        return {"retry_config": {"max_retries": max(0, int(retries["total_max_attempts"]) - 1)}}
    if "max_attempts" in retries:
        return {"retry_config": {"max_retries": max(0, int(retries["max_attempts"]))}}
    return {}
