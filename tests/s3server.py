"""A real S3-compatible server for tests and benchmarks, and a fault-injecting HTTP proxy.

- `MotoS3`: moto's server (``ThreadedMotoServer``) on 127.0.0.1, a free port, one bucket. Clients
  talk to it over HTTP with s3fs/boto3 exactly as to S3; nothing is mocked in-process.
- `FaultProxy`: a threaded HTTP/1.1 proxy on 127.0.0.1 in front of it. Rules make the next N
  requests that match (method, path substring) fail: ``503`` (ServiceUnavailable), ``500``
  (InternalError), ``slowdown`` (503 SlowDown), ``403`` (AccessDenied), ``reset`` (TCP RST, no
  response), ``blackhole`` (the request is read and never answered: the connection is held open
  until the client closes it, counted in ``holds`` and ``abandoned``, or the proxy closes). It counts
  requests per (method, path), tracks the most GETs in flight at once and can add latency to
  every request (the benchmarks use that to stand in for a real network). With ``cache=True`` it
  answers repeated GETs of an object from its own copy (a ranged GET from the copy of the whole
  object, fetched once; a presigned URL's signature does not name another object), so moto's
  per-request CPU (one Python process) does not cap a benchmark of many concurrent GETs; a PUT or
  DELETE through the proxy drops the copy. ``bytes_out`` counts the body bytes of the GETs
  answered, ``presigned`` the requests signed in their URL's query.

Fixtures ``s3`` (one server per test session), ``fault_proxy`` (a fresh proxy per test) and
``s3_client`` (each test once per S3 client diskreplay has: s3fs and obstore) are defined here;
test modules import them (``from s3server import s3, fault_proxy``).
"""

from __future__ import annotations

import http.client
import importlib.util
import logging
import select
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

BUCKET = "diskreplay-test"
CREDENTIALS = {"key": "testing", "secret": "testing"}


class MotoS3:
    """A moto S3 server on loopback with one bucket."""

    def __init__(self, bucket: str = BUCKET):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.bucket = bucket
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.client().create_bucket(Bucket=bucket)

    def client(self, endpoint: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1",
                            aws_access_key_id=CREDENTIALS["key"], aws_secret_access_key=CREDENTIALS["secret"])

    def storage_options(self, endpoint: str | None = None, **extra: Any) -> dict[str, Any]:
        return {"endpoint_url": endpoint or self.endpoint, **CREDENTIALS, **extra}

    def new_url(self, name: str = "buf") -> str:
        return f"s3://{self.bucket}/{name}-{uuid.uuid4().hex[:12]}"

    def keys(self, url: str) -> dict[str, bytes]:
        """Every object under ``url`` (an s3:// prefix) with its bytes."""
        prefix = url.split(f"s3://{self.bucket}/", 1)[1].rstrip("/") + "/"
        client = self.client()
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                body = client.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
                out[item["Key"][len(prefix):]] = body
        return out

    def stop(self) -> None:
        self.server.stop()


_SERVER: MotoS3 | None = None
_SERVER_LOCK = threading.Lock()


def moto_server() -> MotoS3:
    """The process-wide server (started on first use, stopped at exit)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None:
            _SERVER = MotoS3()
    return _SERVER


@pytest.fixture(scope="session")
def s3() -> MotoS3:
    """A moto S3 server on 127.0.0.1 (shared by the whole session) with bucket `BUCKET`."""
    return moto_server()


# ---- the fault-injecting proxy --------------------------------------------------------------

_ERRORS = {
    "503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
    "403": (403, "AccessDenied", "Access Denied"),
}
_SIGNATURE_PARAMETERS = ("x-amz-", "awsaccesskeyid=", "signature=", "expires=")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class FaultProxy:
    """An HTTP proxy to ``upstream`` (``http://host:port``) that fails requests on demand."""

    def __init__(self, upstream: str, latency_s: float = 0.0, cache: bool = False):
        self.upstream = upstream.split("://", 1)[1]
        self.latency_s = latency_s
        self.cache: dict[str, tuple[int, str, list, bytes]] | None = {} if cache else None
        self.rules: list[dict[str, Any]] = []
        self.hits: Counter = Counter()
        self.faults: Counter = Counter()
        self.in_flight = 0
        self.max_in_flight = 0
        self.bytes_out = 0  # body bytes of the GETs answered (benchmarks: bytes fetched)
        self.presigned = 0  # requests signed in their query (a presigned URL), not in a header
        self.connections = 0  # client connections accepted
        self.holds = 0  # blackholed requests held so far
        self.abandoned = 0  # held connections the client closed
        self.holding = 0  # held right now
        self.held: dict[socket.socket, bool] = {}  # held connections -> counted out (the client closed it)
        self.max_holding = 0
        self.closing = threading.Event()
        self.lock = threading.Condition()  # guards the counters; notified when a hold starts or ends
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out as two writes

            def log_message(self, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with proxy.lock:
                    proxy.connections += 1

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.socket.listen(1024)  # socketserver's backlog of 5 drops bursts of connects (re-sent 1 s later)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def fail(self, action: str, contains: str, times: int = 1, method: str | None = None) -> None:
        """Make the next ``times`` requests whose path contains ``contains`` (and whose method is
        ``method``, if given) fail with ``action``: "503", "500", "slowdown", "reset" or
        "blackhole" (never answered)."""
        if action not in _ERRORS and action not in ("reset", "blackhole"):
            raise ValueError(f"unknown fault {action!r}")
        with self.lock:
            self.rules.append({"action": action, "contains": contains, "times": times, "method": method})

    def count(self, contains: str, method: str | None = None) -> int:
        """Requests seen (failed ones included) whose path contains ``contains``."""
        with self.lock:
            return sum(n for (m, p), n in self.hits.items() if contains in p and method in (None, m))

    def wait_until(self, condition: Any, timeout_s: float = 30.0) -> bool:
        """Wait until ``condition()`` (called under the lock) holds, for at most ``timeout_s``
        seconds (a safety bound, not a measurement); whether it holds."""
        with self.lock:
            return self.lock.wait_for(condition, timeout_s)

    def _fault_for(self, method: str, path: str) -> str | None:
        with self.lock:
            self.hits[(method, path)] += 1
            for rule in self.rules:
                if rule["times"] > 0 and rule["contains"] in path and rule["method"] in (None, method):
                    rule["times"] -= 1
                    self.faults[rule["action"]] += 1
                    return rule["action"]
        return None

    def _serve(self, req: BaseHTTPRequestHandler) -> None:
        body = _read_body(req)
        path = req.path.split("?", 1)[0]
        if "X-Amz-Signature=" in req.path:
            with self.lock:
                self.presigned += 1
        fault = "reset" if self.closing.is_set() else self._fault_for(req.command, path)
        if fault == "blackhole":
            self._hold(req)
            return
        if fault == "reset":
            req.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            req.close_connection = True
            req.connection.close()
            return
        if fault is not None:
            status, code, message = _ERRORS[fault]
            payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                       f"<Message>{message}</Message><RequestId>proxy</RequestId></Error>").encode()
            req.send_response(status)
            req.send_header("Content-Type", "application/xml")
            req.send_header("Content-Length", str(len(payload)))
            req.end_headers()
            if req.command != "HEAD":
                req.wfile.write(payload)
            return
        get = req.command == "GET"
        cacheable = get and self.cache is not None
        if self.cache is not None and req.command in ("PUT", "DELETE", "POST"):
            with self.lock:
                self.cache.clear()
        if get:
            with self.lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.latency_s:
                time.sleep(self.latency_s)
            key = _cache_key(req.path)
            hit = self.cache.get(key) if cacheable else None
            if hit is not None:
                status, reason, response_headers, data = _ranged(hit, req.headers.get("Range"))
            else:
                conn = http.client.HTTPConnection(self.upstream, timeout=60)
                headers = {k: v for k, v in req.headers.items()
                           if k.lower() not in ("connection", "proxy-connection", *(("range",) if cacheable else ()))}
                conn.request(req.command, req.path, body=body if body else None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                status, reason, response_headers = resp.status, resp.reason, resp.getheaders()
                if cacheable and status == 200:
                    with self.lock:
                        self.cache[key] = (status, reason, response_headers, data)
                    status, reason, response_headers, data = _ranged(self.cache[key], req.headers.get("Range"))
        finally:
            if get:
                with self.lock:
                    self.in_flight -= 1
        if get:
            with self.lock:
                self.bytes_out += len(data)
        req.send_response(status, reason)
        length_sent = False
        for name, value in response_headers:
            low = name.lower()
            if low in _HOP_HEADERS:
                continue
            if low == "content-length":
                length_sent = True
            req.send_header(name, value)
        if not length_sent:
            req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)

    def _hold(self, req: BaseHTTPRequestHandler) -> None:
        """Never answer: keep the connection open until the client closes it (``abandoned``) or
        the proxy closes. Whatever else the client sends is read and dropped.

        ``holding`` counts what the client holds open: a new hold first counts out the held
        connections the client has closed already (their end reached this host before the new
        request did), so a handler thread that has not woken up yet never inflates the count."""
        conn = req.connection
        with self.lock:
            self._count_out_closed()
            self.holds += 1
            self.holding += 1
            self.held[conn] = False
            self.max_holding = max(self.max_holding, self.holding)
            self.lock.notify_all()
        try:
            while not self.held[conn] and not self.closing.is_set():
                if select.select([conn], [], [], 0.05)[0] and not _recv_or_empty(conn):
                    with self.lock:
                        self._count_out(conn)
        finally:
            with self.lock:
                if not self.held.pop(conn):  # the proxy closed it
                    self.holding -= 1
                self.lock.notify_all()
            req.close_connection = True

    def _count_out_closed(self) -> None:
        """Count out every held connection whose client has closed it (caller holds the lock)."""
        for conn, out in list(self.held.items()):
            if not out and select.select([conn], [], [], 0)[0] and _peek_closed(conn):
                self._count_out(conn)

    def _count_out(self, conn: socket.socket) -> None:
        if not self.held[conn]:
            self.held[conn] = True
            self.holding -= 1
            self.abandoned += 1

    def reset_stats(self) -> None:
        with self.lock:
            self.hits.clear()
            self.faults.clear()
            self.max_in_flight = 0
            self.bytes_out = self.presigned = self.connections = 0
            self.holds = self.abandoned = 0
            self.max_holding = self.holding

    def close(self) -> None:
        """Stop serving: held connections are closed too (the handlers notice within 50 ms), and
        a request on a connection kept open is answered by a reset."""
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()
        self.wait_until(lambda: self.holding == 0, 5.0)


def _cache_key(path: str) -> str:
    """A GET's path and query without a presigned URL's signature parameters (they change with
    every request for the same object)."""
    base, _, query = path.partition("?")
    kept = [part for part in query.split("&") if part and not part.lower().startswith(_SIGNATURE_PARAMETERS)]
    return f"{base}?{'&'.join(kept)}" if kept else base


def _ranged(hit: tuple[int, str, list, bytes], spec: str | None) -> tuple[int, str, list, bytes]:
    """A cached whole object answered as the GET asked: all of it, or the ``bytes=a-b`` /
    ``bytes=a-`` / ``bytes=-n`` range of it (206 with Content-Range)."""
    status, reason, headers, data = hit
    if not spec or not spec.startswith("bytes=") or "," in spec:
        return hit
    first, _, last = spec[len("bytes="):].partition("-")
    size = len(data)
    lo, hi = (max(0, size - int(last)), size - 1) if not first else (int(first), min(size - 1, int(last or size - 1)))
    kept = [(k, v) for k, v in headers  # a range has no whole-object checksum: botocore would check it
            if k.lower() not in ("content-length", "content-range") and not k.lower().startswith("x-amz-checksum")]
    return 206, "Partial Content", [*kept, ("Content-Range", f"bytes {lo}-{hi}/{size}")], data[lo:hi + 1]


def _peek_closed(sock: socket.socket) -> bool:
    """Whether the peer closed or reset the connection (nothing is consumed)."""
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _recv_or_empty(sock: socket.socket) -> bytes:
    """Bytes the peer sent (b"" once it closed or reset the connection)."""
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _read_body(req: BaseHTTPRequestHandler) -> bytes:
    if "chunked" in req.headers.get("Transfer-Encoding", "").lower():
        parts = []
        while True:  # forward the chunked stream as sent (with its framing)
            line = req.rfile.readline()
            parts.append(line)
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:
                    trailer = req.rfile.readline()
                    parts.append(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        break
                break
            parts.append(req.rfile.read(size + 2))
        return b"".join(parts)
    length = int(req.headers.get("Content-Length") or 0)
    return req.rfile.read(length) if length else b""


SAFETY_S = 120.0
"""How long `outcome` waits for a call that could hang: a regression guard, never asserted on."""


def outcome(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``fn()``'s result and exception, run on a thread joined for at most `SAFETY_S` seconds (a
    call that does not return by then fails the test instead of hanging it)."""
    box: list[tuple[Any, BaseException | None]] = []

    def run() -> None:
        try:
            box.append((fn(), None))
        except BaseException as exc:
            box.append((None, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(SAFETY_S)
    assert box, f"the call was still blocked after {SAFETY_S} s: the retry deadline was not enforced"
    return box[0]


@pytest.fixture
def fault_proxy(s3):
    """A `FaultProxy` in front of the session's moto server (storage options: ``proxy_options``)."""
    proxy = FaultProxy(s3.endpoint)
    yield proxy
    proxy.close()


def proxy_options(s3: MotoS3, proxy: FaultProxy, **extra: Any) -> dict[str, Any]:
    """Storage options that go through ``proxy``, with botocore's own retries off (so the
    failures reach diskreplay's retry layer). Each proxy has its own port, hence its own s3fs
    instance (fsspec caches instances by their options)."""
    return s3.storage_options(proxy.endpoint, config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}},
                              **extra)


S3_CLIENTS = ["s3fs", pytest.param("obstore", marks=pytest.mark.skipif(
    importlib.util.find_spec("obstore") is None, reason="obstore is not installed"))]


@pytest.fixture(params=S3_CLIENTS)
def s3_client(request, monkeypatch) -> str:
    """The S3 client that serves ``s3://`` URLs in this test (and its subprocesses):
    ``DISKREPLAY_S3_CLIENT`` set to "s3fs" or "obstore"."""
    monkeypatch.setenv("DISKREPLAY_S3_CLIENT", request.param)
    return str(request.param)


def remote_store(url: str, storage_options: dict[str, Any], client: str, **kwargs: Any) -> Any:
    """The store of ``client`` for ``url``: an `FsspecChunkStore` with s3fs's own retry loop off
    (botocore's are off in `proxy_options`), or an `ObstoreChunkStore`."""
    if client == "obstore":
        from diskreplay.io.obstore_store import ObstoreChunkStore

        return ObstoreChunkStore(url, storage_options, **kwargs)
    from diskreplay.io import FsspecChunkStore

    store = FsspecChunkStore(url, storage_options, **kwargs)
    store.fs.retries = 1
    return store


def store_loop(store: Any) -> Any:
    """The event loop a remote store runs its requests on."""
    return store.fs.loop if hasattr(store, "fs") else store.loop
