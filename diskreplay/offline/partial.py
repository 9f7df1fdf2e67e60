"""Where an import writes before it is done: a location next to its destination, swapped in at the end.

An import writes its buffer at `partial_url` (``<dest>.import-partial``), never at ``dest`` itself:
a failed import removes it, one killed hard leaves it (marked as an interrupted import, so it never
opens as a buffer), and the next import into the same ``dest`` replaces it. Only a finished import
is swapped in (`swap_in`): an existing buffer at ``dest`` stays as it was until then.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

from ..buffer.setup import replaceable_location
from ..format.keys import COMMIT_KEY, OWN_PREFIXES
from ..io import ChunkStore, is_local, local_path, open_chunkstore
from ..io.lock import break_lock, lock_holder
from ..storage import own_stores

PARTIAL_SUFFIX = ".import-partial"
ROOT_COMMITS = tuple(prefix + COMMIT_KEY for prefix in OWN_PREFIXES)


def partial_url(dest: str) -> str:
    """The location next to ``dest`` where an import into ``dest`` is written."""
    return dest.rstrip("/") + PARTIAL_SUFFIX


def claim_partial(partial: str, storage_options: Mapping[str, Any] | None) -> None:
    """Makes ``partial`` free for a new import: the stale writer lock of a killed import there is
    broken (its files are removed when the new buffer is created). Raises LockedError when a live
    import holds it, BufferExistsError when it holds other files than a buffer."""
    break_stale_lock(partial, storage_options)
    replaceable_location(partial, storage_options, True, False, None)


def break_stale_lock(url: str, storage_options: Mapping[str, Any] | None) -> None:
    """Breaks the writer lock at ``url`` if its holder is gone (an import killed hard); a live
    holder's lock stays."""
    stores = own_stores(url, dict(storage_options) if storage_options else None)
    holder = lock_holder(url, stores)
    if holder is not None and holder.stale_reason():
        break_lock(url, stores)


def remove_partial(partial: str, storage_options: Mapping[str, Any] | None) -> None:
    """Best effort: deletes everything at ``partial`` (a failed import's)."""
    try:
        open_chunkstore(partial, storage_options).clear()
    except Exception:
        pass


def swap_in(partial: str, dest: str, overwrite: bool, storage_options: Mapping[str, Any] | None) -> None:
    """Moves the finished buffer at ``partial`` to ``dest``, replacing the buffer there (only with
    ``overwrite``; never files that are not a buffer, nor a buffer a live writer holds). Local: two
    renames. Remote: the old objects are removed, then the new ones copied, commit records last."""
    old = replaceable_location(dest, storage_options, overwrite, False, None)
    if is_local(dest):
        _rename_over(local_path(partial), local_path(dest), old is not None)
        return
    if old is not None:
        old.clear()
    _copy_objects(open_chunkstore(partial, storage_options), open_chunkstore(dest, storage_options))
    remove_partial(partial, storage_options)


def _rename_over(partial: str, dest: str, replace: bool) -> None:
    """Renames ``partial`` to ``dest``; with ``replace``, the old ``dest`` is first renamed aside
    (into a fresh folder beside it), then deleted."""
    if not replace:
        os.rename(partial, dest)  # also replaces an empty folder
        return
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.replaced-", dir=os.path.dirname(dest))
    os.rename(dest, aside)
    os.rename(partial, dest)
    shutil.rmtree(aside, ignore_errors=True)


def _copy_objects(source: ChunkStore, target: ChunkStore) -> None:
    """Every object of ``source`` into ``target``, one at a time; commit records last (the
    target becomes a buffer with the last one)."""
    keys = sorted(source.sizes(), key=lambda key: (key.endswith(COMMIT_KEY), key in ROOT_COMMITS, key))
    for key in keys:
        blob = source.get(key)
        if blob is not None:
            target.put(key, blob, durable=key.endswith(COMMIT_KEY))
