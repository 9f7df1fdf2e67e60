"""`StorageUnion`: the shards of a sharded buffer read as one storage, their lanes side by side.

Lane ``e`` of shard ``s`` is lane ``s * num_envs + e`` of the union, so samplers, the episode
index and the transforms work on the union unchanged, and a slice or an n-step window never leaves
one shard. Read-only: each shard has its own writer (`ReplayBuffer.open_shard`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from ..errors import ClosedError, ReadOnlyError
from ..format.commit import CommitRecord
from .facade import Storage, StorageStats
from .outputs import Rows, output_rows


class StorageUnion:
    """The storages of every shard (each opened read-only), as one `RowSource`."""

    mode = "r"

    def __init__(self, url: str, parts: Sequence[Storage]):
        """``parts``: shard ``s``'s storage at index ``s``, all with the same config."""
        self.url, self.parts = url, list(parts)
        self.shard_envs = self.parts[0].layout.num_envs
        self.config = replace(self.parts[0].config, num_envs=len(self.parts) * self.shard_envs)
        self.schema, self.layout = self.config.schema, self.config.layout
        self.storage_options = self.parts[0].storage_options
        self._update_window()

    @property
    def closed(self) -> bool:
        return self.parts[0].closed

    @property
    def total(self) -> np.ndarray:
        """Per union lane, steps committed in the commit each shard shows."""
        return self._total

    def require_writable(self) -> None:
        """Always raises: ClosedError, or ReadOnlyError (actors write through their shard)."""
        if self.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        raise ReadOnlyError(f"{self.url!r} is a sharded buffer, read here as the union of its {len(self.parts)} "
                            f"shards (read-only); write with dr.ReplayBuffer.open_shard(url, shard=i)")

    def append(self, lane: int, rows: Mapping[str, np.ndarray], count: int) -> tuple[int, int]:
        """Raises ReadOnlyError (see `require_writable`)."""
        self.require_writable()
        raise AssertionError("unreachable")

    def update_rows(self, lane: int, first: int, values: Mapping[str, np.ndarray]) -> None:
        """Raises ReadOnlyError (see `require_writable`)."""
        self.require_writable()

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per union lane, the readable steps ``[lo, hi)`` of the commits the shards show."""
        return self._lo, self._hi

    committed_window = window

    def adopt(self, records: Mapping[int, CommitRecord]) -> None:
        """Show ``records[s]``, a newer commit of shard ``s`` (see `Storage.adopt`)."""
        for shard, record in records.items():
            self.parts[shard].adopt(record)
        self._update_window()

    def _update_window(self) -> None:
        windows = [part.window() for part in self.parts]
        self._lo = np.concatenate([lo for lo, _ in windows])
        self._hi = np.concatenate([hi for _, hi in windows])
        self._total = np.concatenate([part.total for part in self.parts])

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: Mapping[str, np.ndarray] | None = None) -> Rows:
        """Rows at (union lane, step), as `Storage.gather`: each shard gathers its own rows."""
        if self.closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")
        shard, local = np.divmod(lane, self.shard_envs)
        if len(self.parts) == 1 or (len(shard) and (shard == shard[0]).all()):
            return self.parts[int(shard[0]) if len(shard) else 0].gather(local, step, names, out)
        names = names or tuple(self.schema.fields)
        given = out or {}
        rows = {name: output_rows(name, self.schema[name], len(step), given.get(name)) for name in names}
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(len(self.parts) + 1))
        for s in np.flatnonzero(np.diff(bounds)).tolist():
            where = order[bounds[s]:bounds[s + 1]]
            for name, values in self.parts[s].gather(local[where], step[where], names).items():
                rows[name][where] = values
        return rows

    def forget_cached(self, lane: int, first: int, end: int) -> None:
        """Cached copies of steps ``[first, end)`` of a union lane are out of date."""
        shard, local = divmod(lane, self.shard_envs)
        self.parts[shard].forget_cached(local, first, end)

    def stats(self) -> StorageStats:
        """Every shard's `StorageStats` summed (``commit_sequence``: the sum of the shards')."""
        each = [part.stats() for part in self.parts]
        counts = ("cache_slots", "cached_chunks", "chunks_loaded", "maps", "commit_sequence", "stale_reads")
        total = {name: sum(getattr(s, name) for s in each) for name in counts}
        return StorageStats(chunk_rows=each[0].chunk_rows, mapped=all(s.mapped for s in each),
                            row_fields=each[0].row_fields, resident=all(s.resident for s in each), **total)

    def close(self) -> None:
        """Release every shard's storage (idempotent)."""
        for part in self.parts:
            part.close()


def shard_lanes(shard: int, shard_envs: int) -> slice:
    """The union lanes of shard ``shard``."""
    return slice(shard * shard_envs, (shard + 1) * shard_envs)


def describe(parts: Sequence[Storage]) -> list[dict[str, Any]]:
    """Per shard: rows readable now and the time of the commit it shows (for `diskreplay info`)."""
    out = []
    for s, part in enumerate(parts):
        lo, hi = part.window()
        out.append({"shard": s, "rows": int((hi - lo).sum()), "added": int(part.total.sum()),
                    "commit": part.record.sequence, "time": part.record.time})
    return out
