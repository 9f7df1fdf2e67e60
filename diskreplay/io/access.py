"""Why a remote store refused a request, when the cause is the caller's setup rather than the
store: no credentials, credentials it rejects, a bucket that does not exist."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec

_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})
_REJECTED = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                       "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled"})


def access_problem(exc: BaseException) -> str | None:
    """``"credentials"`` (none found), ``"rejected <code>"`` (refused by the store) or
    ``"bucket"`` (no such bucket) when ``exc`` or one of its causes says so; else None."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if any(cls.__name__ in _NO_CREDENTIALS for cls in type(cause).__mro__):
            return "credentials"
        response = getattr(cause, "response", None)
        code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
        if code in _REJECTED:
            return f"rejected {code}"
        if code == "NoSuchBucket":
            return "bucket"
        cause = cause.__cause__ or cause.__context__
    return None


def bucket_of(url: str) -> str:
    """The bucket (first path component) of a remote URL: ``s3://bucket/key`` -> ``bucket``."""
    return url.split("://", 1)[-1].split("/", 1)[0]


def bucket_missing(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether the bucket of remote ``url`` is known not to exist (False when that cannot be
    asked: any error asking)."""
    try:
        fs, _ = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        return not fs.exists(bucket_of(url))
    except Exception:  # only a clear "no" counts
        return False
