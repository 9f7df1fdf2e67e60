"""How big a buffer's chunks and cache are, and what the cache holds: `default_chunk_rows`,
`cache_slots`, `fields_read_by_rows`."""

from __future__ import annotations

import numpy as np

from ..checks import check_int
from ..format.codecs import Codec
from ..format.lanes import LaneLayout
from ..format.schema import Schema
from .cache import ChunkCache

DEFAULT_CACHE_BYTES = 512 * 2**20
DEFAULT_CHUNK_ROWS = 4096
CHUNK_BYTES = 1 << 20
"""Bytes of one chunk (all fields of its rows) that `default_chunk_rows` aims at: whole-chunk
reads, decodes and writes stay around a millisecond, so rows of 84x84 frames get 128-row chunks
where small rows get `DEFAULT_CHUNK_ROWS`."""
CHUNK_FILES_MAPPED = 1 << 14
"""Chunk files (chunks x fields) past which `default_chunk_rows` lengthens the chunks of raw
buffers: a quarter of Linux's default ``vm.max_map_count``, so every chunk can stay memory-mapped."""
REMOTE_CHUNK_FACTOR = 8
"""On an object store `default_chunk_rows` makes chunks this many times longer (about 8 MiB of
small rows): a request costs tens of milliseconds and a third of a millisecond of the client's
CPU whatever its size, so an epoch read in 1 MiB chunks spends its time on requests."""


def default_chunk_rows(schema: Schema, num_envs: int, capacity: int | None, cache_bytes: int,
                       mappable: bool = True, remote: bool = False) -> int:
    """Steps per chunk for a buffer of ``capacity`` rows over ``num_envs`` lanes (None: unknown).

    The largest power of two up to `DEFAULT_CHUNK_ROWS` whose chunk holds at most `CHUNK_BYTES`
    (at least one row). On an object store (``remote``), then doubled up to `REMOTE_CHUNK_FACTOR`
    times while a writer's staging (``2 * num_envs + 2`` chunks) stays within half of
    ``cache_bytes``. For a ``mappable`` (raw) buffer, then doubled while there would be more than
    `CHUNK_FILES_MAPPED` chunk files and that staging still fits. Arguments that are not
    positive ints leave out the doubling (`create` rejects them)."""
    rows = min(DEFAULT_CHUNK_ROWS, 1 << max(CHUNK_BYTES // max(schema.row_bytes, 1), 1).bit_length() - 1)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1
               for v in (num_envs, cache_bytes) + (() if capacity is None else (capacity,))):
        return rows
    staging_chunks = 2 * int(num_envs) + 2
    most = REMOTE_CHUNK_FACTOR * rows if remote else rows
    while rows < most and staging_chunks * 4 * rows * schema.row_bytes <= cache_bytes:  # doubled: half the cache
        rows *= 2
    if capacity is None or not mappable:
        return rows
    lane_rows = int(capacity) // int(num_envs)
    while (num_envs * -(-lane_rows // rows) * len(schema.fields) > CHUNK_FILES_MAPPED and rows < lane_rows
           and staging_chunks * 2 * rows * schema.row_bytes <= cache_bytes):
        rows *= 2
    return rows


BEHIND_CHUNKS = 128
"""Chunks per lane with room for row-read fields that a writer keeps besides its staging: sealed
chunks waiting to be written behind the appends, and chunks read ahead (`storage.write_behind`)."""


def cache_slots(schema: Schema, layout: LaneLayout, cache_bytes: int, writer: bool,
                row_fields: tuple[str, ...] = ()) -> tuple[int, int]:
    """Chunk slots that fit ``cache_bytes``: ``(slots, full_slots)``. A writer stages a chunk per
    lane and seals as many again, so it needs ``2 * num_envs + 2`` slots; a reader gets at least
    one. With ``row_fields`` (read row by row) only the first ``full_slots`` have room for them,
    within half the budget: a writer's staging and `BEHIND_CHUNKS` per lane; a reader's whole
    half, for the chunks an epoch reads ahead. The other slots, sized by the remaining fields,
    cache those.

    Raises ValueError (naming ``cache_bytes``) when a writer's staging does not fit the budget.
    """
    chunk_bytes = layout.chunk_rows * schema.row_bytes
    check_int(cache_bytes, "cache_bytes", 0)
    need = 2 * layout.num_envs + 2 if writer else 1
    if writer and need * chunk_bytes > cache_bytes:
        raise ValueError(f"cache_bytes={cache_bytes:,} is too small for a writer: staging needs {need} chunks "
                         f"(2 per env lane + 2) of {chunk_bytes:,} bytes = {need * chunk_bytes:,} bytes; raise "
                         f"cache_bytes or lower chunk_rows")
    slots = max(need, min(cache_bytes // chunk_bytes, ChunkCache.MAX_SLOTS))
    ring_chunks = layout.num_envs * layout.chunks_per_lane() if layout.lane_capacity is not None else None
    full = need if writer else 0
    if row_fields:  # whole chunks within half the budget: written behind a writer's appends, or an epoch's read ahead
        half = cache_bytes // 2 // chunk_bytes
        full = max(need, min(need + BEHIND_CHUNKS * layout.num_envs, half)) if writer else half
        small_bytes = layout.chunk_rows * sum(f.row_bytes for n, f in schema.items() if n not in row_fields)
        slots = full + max(cache_bytes - full * chunk_bytes, 0) // max(small_bytes, 1)
        slots = max(need, min(slots, ChunkCache.MAX_SLOTS))
    if ring_chunks is not None:  # more slots than a ring has chunks are dead weight
        slots = min(slots, max(need, ring_chunks))
    return int(slots), int(min(full, slots) if row_fields else slots)


def fields_read_by_rows(schema: Schema, codecs: dict[str, Codec], chunks: int, chunk_rows: int, cache_bytes: int,
                        reader: bool) -> tuple[str, ...]:
    """The sharded fields of a buffer of ``chunks`` chunks larger than ``cache_bytes`` that are
    read row by row (`cache_slots`' ``row_fields``). A writer reads all of them so. A reader keeps
    the chunks of some whole in its cache's other slots: those of the smallest rows whose every
    chunk fits half of ``cache_bytes`` beside the fields not sharded (loaded behind its first
    read, `Warmer`), so that rows sampled after it cost requests for the large fields only; where
    that would keep them all (the fields not sharded being what does not fit), none."""
    sharded = [name for name in schema.fields if codecs[name].inner_rows is not None]
    if not reader:
        return tuple(sharded)
    whole = sum(f.row_bytes for name, f in schema.items() if name not in sharded)
    kept: set[str] = set()
    for name in sorted(sharded, key=lambda n: schema[n].row_bytes):
        whole += schema[name].row_bytes
        if chunks * chunk_rows * whole > cache_bytes // 2:
            break
        kept.add(name)
    return tuple(name for name in sharded if name not in kept) if len(kept) < len(sharded) else tuple(sharded)
