"""How transient failures of a remote store are retried: `RetryPolicy` and `is_transient`."""

from __future__ import annotations

import asyncio
import errno
import math
import random
from dataclasses import dataclass
from typing import Any


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
        backoff = min(self.max_delay, self.base_delay * 2 ** (failures - 1))
        return float(backoff * (0.5 + 0.5 * random.random()))


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

