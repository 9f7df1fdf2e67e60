"""Why a remote store refused a request, when the cause is the caller's setup rather than the
store: no credentials, credentials it rejects, a bucket that does not exist."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import fsspec

_NO_CREDENTIALS = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})
_XML_CODE = re.compile(r"<Code>([^<]*)</Code>")
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
        code = _error_code(cause)
        if code in _REJECTED:
            return f"rejected {code}"
        if code == "NoSuchBucket":
            return "bucket"
        cause = cause.__cause__ or cause.__context__
    return None


def _error_code(exc: BaseException) -> str:
    """S3's error code in ``exc``: botocore's parsed response, or the XML answer that obstore's
    errors quote; "" if none."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    found = _XML_CODE.search(str(exc))
    return found.group(1) if found else ""


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
