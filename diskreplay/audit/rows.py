"""A chunk-level reader of a buffer's committed rows, without the hot path: what `info` and the
exporters read a buffer with.

Everything here reads *committed* rows straight from their chunk objects (one field at a time if
wanted), so scanning a big buffer touches only the fields asked for and keeps memory bounded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..buffer import ReplayBuffer
from ..episodes import episode_end_fields
from ..errors import NotABufferError
from ..sampling import Uniform
from .status import describe_incomplete, import_status


def open_readonly(url: str, storage_options: dict | None = None, cache_bytes: int = 8 * 2**20) -> ReplayBuffer:
    """Open for inspection: read-only, any saved sampler (its state is not needed here).

    Raises NotABufferError with a clear message for an interrupted import.
    """
    try:
        return ReplayBuffer.open(url, "r", sampler=Uniform(), storage_options=storage_options,
                                 cache_bytes=cache_bytes)
    except NotABufferError:
        marker = import_status(url, storage_options)
        if marker is not None:
            raise NotABufferError(describe_incomplete(url, marker)) from None
        raise


def read_chunk(buf: ReplayBuffer, name: str, lane: int, chunk: int) -> np.ndarray:
    """One whole stored chunk of one field of lane ``lane`` (a lane of the union, for a sharded
    buffer), decoded. Raises CorruptBufferError if missing/undecodable."""
    return buf.storage.read_chunk(name, lane, chunk)


def iter_rows(buf: ReplayBuffer, names: Sequence[str], lane: int, lo: int, hi: int,
              batch_rows: int = 65536) -> Iterator[dict[str, np.ndarray]]:
    """Steps ``[lo, hi)`` of one lane, for the fields ``names``, in slices of about batch_rows rows,
    with the values ``buf[ids]`` reads: stored fields from their chunks, derived ``next_*`` fields
    (``derive_next``) rebuilt, episodic returns of episodes not ended in the commit as their default;
    ragged and text fields (values delimited by their stored ends) as `ReplayBuffer.rows` reads them."""
    layout = buf.layout
    twins = tuple(n for n in names if n in buf.view.derived or getattr(buf.fields.get(n), "ragged", False))
    stored = [n for n in names if n not in twins]
    step = first = lo
    parts: list[dict[str, np.ndarray]] = []
    count = 0
    while step < hi:
        chunk, offset = divmod(int(layout.slot(step)), layout.chunk_rows)
        piece = layout.piece_length(step, hi - step)
        parts.append({n: read_chunk(buf, n, lane, chunk)[offset:offset + piece] for n in stored})
        count += piece
        step += piece
        if count >= batch_rows or step >= hi:
            steps = np.arange(first, step)
            rows = {n: np.concatenate([p[n] for p in parts]) for n in stored}
            if twins:
                rows.update(buf.view.gather(np.full(len(steps), lane), steps, twins))
            returns = buf.episodic_return
            if returns is not None and returns.name in rows:
                returns.mask(rows[returns.name], buf.episode_index, np.full(len(steps), lane), steps)
            yield {n: rows[n] for n in names}
            parts, count, first = [], 0, step


def readable(buf: ReplayBuffer) -> list[tuple[int, int, int]]:
    """(lane, lo, hi) of every lane's committed readable steps."""
    lo, hi = buf.window()
    return [(lane, int(lo[lane]), int(hi[lane])) for lane in range(buf.num_envs)]


def episode_fields(buf: ReplayBuffer) -> tuple[str, ...]:
    """The scalar bool fields that end an episode: the buffer's own, else (a buffer that keeps no
    episode index) those the ``"auto"`` rule finds: ``done``, else ``terminated`` and ``truncated``."""
    return buf.episode_index.end_fields or episode_end_fields(buf.fields)
