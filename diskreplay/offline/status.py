"""The marker of an unfinished import: until an import ends, ``dest``'s own objects hold
`INCOMPLETE_KEY` instead of ``commit.json``, so it does not open as a buffer."""

from __future__ import annotations

import json
import time
from typing import Any

from ..format.keys import COMMIT_KEY, INCOMPLETE_IMPORT_KEY
from ..io import broken_path
from ..storage import own_stores

INCOMPLETE_KEY = INCOMPLETE_IMPORT_KEY


def import_status(url: str, storage_options: dict | None = None) -> dict[str, Any] | None:
    """The marker of an interrupted import at ``url`` (source, format, started, pid, host), or None."""
    if broken_path(url) is not None:  # a loop of symbolic links, a link to nothing: no marker there
        return None
    stores = own_stores(url, storage_options)
    if any(store.exists(COMMIT_KEY) for store in stores):
        return None
    blob = next((blob for blob in (store.get(INCOMPLETE_KEY) for store in stores) if blob is not None), None)
    if blob is None:
        return None
    try:
        marker: dict[str, Any] = json.loads(blob)  # written by the import as a JSON object
    except ValueError:
        return {"source": "?"}
    return marker


def describe_incomplete(url: str, marker: dict[str, Any]) -> str:
    """One sentence for users: ``url`` holds the interrupted import `import_status` returned as ``marker``."""
    started = marker.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return (f"{url!r} holds an interrupted import (from {marker.get('source')!r}, started {when}, "
            f"pid {marker.get('pid', '?')}); it is not a usable buffer: import again with overwrite=True")
