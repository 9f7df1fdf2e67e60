"""`S3Gets`: whole-object GETs from S3 on plain HTTP connections, signed by botocore.

s3fs (aiobotocore on aiohttp) spends two to four times obstore's CPU per byte, and obstore's
runtime does not survive ``fork``: DataLoader workers read S3 through s3fs. Here a GET is a URL
presigned by a botocore client made from the same storage options (botocore's credential chain,
endpoint rules and addressing style), sent on a keep-alive `http.client` connection of the
calling thread, its body read with ``readinto`` into one buffer of the answer's length: plain
sockets, so a forked child opens its own connections and goes on, for a third (large objects)
to a half (small ones) of s3fs's CPU per byte (``tools/bench_client.py``).

`FsspecChunkStore` makes its whole-object GETs' first tries here (`S3Gets.for_options` says
whether the options allow it) and retries through s3fs. An answer other than 200 or 404 raises
`S3AnswerError`, which `is_transient` judges as it judges botocore's errors; a network error is
the plain one (``ConnectionError``, ``TimeoutError``, ``http.client.IncompleteRead``).
"""

from __future__ import annotations

import functools
import http.client
import logging
import os
import re
import ssl
import threading
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import numpy as np

log = logging.getLogger(__name__)
PRESIGNED_S = 900
"""How long a presigned URL is valid (seconds): it is used at once."""
_FSSPEC_KWARGS = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}
_OPTIONS = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs"} | _FSSPEC_KWARGS
_CLIENT_KWARGS = {"endpoint_url", "region_name"}
_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")
_XML_CODE, _XML_MESSAGE = re.compile(rb"<Code>([^<]*)</Code>"), re.compile(rb"<Message>([^<]*)</Message>")
_ERROR_BODY_BYTES = 1 << 16
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
"""How a kept-alive connection the server has closed meanwhile fails its next request."""


class S3AnswerError(OSError):
    """S3 answered a GET with neither the object nor 404: its HTTP status and error code, in
    ``response`` as botocore's errors carry them."""

    def __init__(self, key: str, status: int, code: str, message: str):
        super().__init__(f"GET of {key!r}: HTTP {status} {code}: {message}")
        self.status = status
        self.response = {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}


class S3Gets:
    """Whole-object GETs of ``bucket/prefix/<key>``, each presigned by ``client`` (a botocore S3
    client) and sent on the calling thread's connection (one per thread and process)."""

    def __init__(self, client: Any, bucket: str, prefix: str):
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self._local = threading.local()

    @classmethod
    def for_options(cls, url: str, storage_options: Mapping[str, Any]) -> S3Gets | None:
        """The GETs of an ``s3://`` URL with these s3fs ``storage_options``; None where a plain GET
        might not mean what s3fs's would: an option this module does not know (it would change
        the request: ``requester_pays``, ``s3_additional_kwargs``, ``profile``, ``verify``,
        ``config_kwargs["proxies"]``...), an HTTP proxy in the environment, or options botocore
        does not take."""
        scheme, _, path = url.partition("://")
        options = dict(storage_options)
        client_kwargs = dict(options.get("client_kwargs") or {})
        config_kwargs = dict(options.get("config_kwargs") or {})
        if (scheme not in ("s3", "s3a") or not set(options) <= _OPTIONS or not set(client_kwargs) <= _CLIENT_KWARGS
                or "proxies" in config_kwargs or any(os.environ.get(name) for name in _PROXY_VARIABLES)):
            return None
        try:
            client = _client(options, client_kwargs, config_kwargs)
        except Exception as exc:  # s3fs's client, made from the same options, will say what is wrong
            log.debug("%r: no plain GETs (%s: %s)", url, type(exc).__name__, exc)
            return None
        bucket, _, prefix = path.partition("/")
        return cls(client, bucket, prefix.strip("/"))

    def get(self, key: str, timeout_s: float, limit: int | None = None) -> memoryview | None:
        """The object's bytes, at most ``limit`` of them (None if S3 answers 404), within
        ``timeout_s`` seconds (else a `TimeoutError`, the request dropped with its connection).
        Raises `S3AnswerError` for any other answer, the network's errors as they come (the
        connection dropped too). A body cut at ``limit`` drops the connection: the rest of it is
        never read, so ``limit`` is for bounding small objects, not for reading a large one's head."""
        deadline = time.monotonic() + timeout_s
        full = f"{self.prefix}/{key}" if self.prefix else key
        target = urlsplit(self.client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": full}, ExpiresIn=PRESIGNED_S))
        try:
            return self._body(key, self._send(target, timeout_s), deadline, limit)
        except TimeoutError:
            self._drop()
            raise TimeoutError(f"no answer within {timeout_s:.2f} s: the request was cancelled") from None
        except BaseException:
            self._drop()
            raise

    def _send(self, target: Any, timeout_s: float) -> http.client.HTTPResponse:
        """The answer to a GET of ``target`` (a split URL): on the thread's kept connection, or on a
        new one where the server had closed the kept one."""
        path = f"{target.path}?{target.query}" if target.query else target.path
        connection, kept = self._connection(target, timeout_s)
        try:
            connection.request("GET", path)
            return connection.getresponse()
        except _STALE:
            if not kept:
                raise
        self._drop()
        connection, _ = self._connection(target, timeout_s)
        connection.request("GET", path)
        return connection.getresponse()

    def _connection(self, target: Any, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
        """The calling thread's connection to ``target``'s host (made if there is none), and
        whether it was kept from an earlier GET."""
        held = getattr(self._local, "held", None)
        if held is not None and held[0] == (os.getpid(), target.scheme, target.netloc):
            held[1].timeout = timeout_s
            if held[1].sock is not None:
                held[1].sock.settimeout(timeout_s)
            return held[1], True
        self._drop()
        if target.scheme == "https":
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                target.netloc, timeout=timeout_s, context=_tls_context())
        else:
            connection = http.client.HTTPConnection(target.netloc, timeout=timeout_s)
        self._local.held = ((os.getpid(), target.scheme, target.netloc), connection)
        return connection, False

    def _drop(self) -> None:
        """Close the calling thread's connection (one inherited through a fork is only forgotten:
        its socket is the parent's too)."""
        held = getattr(self._local, "held", None)
        self._local.held = None
        if held is not None and held[0][0] == os.getpid():
            held[1].close()

    def _body(self, key: str, answer: http.client.HTTPResponse, deadline: float,
              limit: int | None) -> memoryview | None:
        if answer.status == 404:
            answer.read(_ERROR_BODY_BYTES)
            if not answer.isclosed():  # a body longer than an error's: the connection cannot go on
                self._drop()
            return None
        if answer.status != 200:
            raise _answer_error(key, answer)
        length = answer.getheader("Content-Length")
        if length is None:
            data = answer.read() if limit is None else answer.read(limit)
            if not answer.isclosed():
                self._drop()
            return memoryview(data)
        size = int(length) if limit is None else min(int(length), limit)
        body = np.empty(size, np.uint8).data  # not zeroed: every byte is read into
        done = 0
        while done < len(body):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{done} of {len(body)} bytes read by the deadline")
            got = answer.readinto(body[done:])
            if not got:
                raise http.client.IncompleteRead(bytes(body[:done]), len(body) - done)
            done += got
        if size < int(length):
            self._drop()  # the body's end stays unread: the connection cannot serve the next GET
        elif not answer.isclosed():
            answer.read()  # an empty body: no read ended the answer, which would block the connection's next GET
        return body


def _answer_error(key: str, answer: http.client.HTTPResponse) -> S3AnswerError:
    """The error an answer of status other than 200 and 404 reports (its XML's code and message)."""
    text = answer.read(_ERROR_BODY_BYTES)
    answer.close()
    code, message = _XML_CODE.search(text), _XML_MESSAGE.search(text)
    return S3AnswerError(key, answer.status, code.group(1).decode(errors="replace") if code else str(answer.status),
                         message.group(1).decode(errors="replace") if message else answer.reason)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """Certificates checked against botocore's bundle (``AWS_CA_BUNDLE``, else its default)."""
    from botocore.httpsession import get_cert_path

    return ssl.create_default_context(cafile=os.environ.get("AWS_CA_BUNDLE") or get_cert_path(True))


def _client(options: Mapping[str, Any], client_kwargs: Mapping[str, Any], config_kwargs: Mapping[str, Any]) -> Any:
    """A botocore S3 client presigning as s3fs's client would sign: the same endpoint, region,
    credentials (given, anonymous, or botocore's chain) and config (SigV4 unless it says)."""
    from botocore import UNSIGNED
    from botocore.config import Config

    from . import s3fs_session

    config = dict(config_kwargs)
    config.pop("max_pool_connections", None)
    if options.get("anon"):
        config["signature_version"] = UNSIGNED
    config.setdefault("signature_version", "s3v4")
    return s3fs_session.botocore_session().create_client(
        "s3", endpoint_url=options.get("endpoint_url") or client_kwargs.get("endpoint_url"),
        region_name=client_kwargs.get("region_name") or config_kwargs.get("region_name"),
        aws_access_key_id=options.get("key"), aws_secret_access_key=options.get("secret"),
        aws_session_token=options.get("token"), config=Config(**config))
