"""One aiobotocore session per process for the s3fs stores, on botocore data parsed once.

Each s3fs filesystem makes its own aiobotocore session by default, and each session parses the
S3 service model, its endpoint rules and the partitions from botocore's JSON files before its
first request: about 60 ms of CPU, paid again by every DataLoader worker that opens a store. Here
the parsed files live in one botocore data loader per process, which a forked child inherits
already filled (`warm` fills it before a fork), and the s3fs stores of a process share one
session on it (and the clients that presign their plain GETs, `botocore_session`, another).
Credentials and connections stay per session and per client: a forked child makes its own
session (on the inherited loader) and its own clients.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

_S3_DATA = ("endpoints", "sdk-default-configuration", "partitions", "_retry")
_S3_MODELS = ("service-2", "endpoint-rule-set-1")
_FSSPEC_KWARGS = {"use_listings_cache", "listings_expiry_time", "max_paths", "skip_instance_cache"}

_loader: Any = None
_session: tuple[int, Any] | None = None  # (the pid it was made in, the session)
_botocore_session: Any = None
_presigner_warm = False


def _data_loader() -> Any:
    """This process's botocore data loader (a forked child's is its parent's, with what it parsed)."""
    global _loader
    if _loader is None:
        from aiobotocore.session import AioSession

        _loader = AioSession().get_component("data_loader")
    return _loader


def warm() -> None:
    """Import s3fs and parse what an S3 client needs from botocore's data into the shared loader
    (once per process: later calls find it parsed); does nothing without s3fs. Called before a
    fork by a process that used obstore, whose forked children read S3 through s3fs and would
    otherwise each import it (about 0.6 s) and parse the data (about 60 ms); and makes a first
    client of `botocore_session`, so that a child's own presigning client costs less."""
    try:
        import s3fs  # noqa: F401  (and aiobotocore with it)
    except ImportError:
        return
    loader = _data_loader()
    for name in _S3_DATA:
        loader.load_data(name)
    for kind in _S3_MODELS:
        loader.load_service_model("s3", kind, api_version=None)
    global _presigner_warm
    if not _presigner_warm:  # a first client fills the session's caches (a child's first: 24 ms -> 13 ms)
        botocore_session().create_client("s3", region_name="us-east-1", aws_access_key_id="-",
                                         aws_secret_access_key="-")
        _presigner_warm = True


def session() -> Any:
    """This process's aiobotocore session on the shared data loader."""
    global _session
    if _session is None or _session[0] != os.getpid():
        from aiobotocore.session import AioSession

        made = AioSession()
        made.register_component("data_loader", _data_loader())
        _session = (os.getpid(), made)
    return _session[1]


def botocore_session() -> Any:
    """The (synchronous) botocore session on the shared data loader: it makes the clients that
    presign plain GETs, which open no connection, so a forked child keeps its parent's."""
    global _botocore_session
    if _botocore_session is None:
        import botocore.session

        _botocore_session = botocore.session.Session()
        _botocore_session.register_component("data_loader", _data_loader())
    return _botocore_session


def with_session(storage_options: Mapping[str, Any]) -> dict[str, Any]:
    """s3fs ``storage_options`` with the shared `session`, unless they configure a session of
    their own (``session``, or options s3fs passes to one, such as ``profile``)."""
    import s3fs

    known = set(inspect.signature(s3fs.S3FileSystem.__init__).parameters) | _FSSPEC_KWARGS
    if "session" in storage_options or not set(storage_options) <= known:
        return dict(storage_options)
    return {**storage_options, "session": session()}
