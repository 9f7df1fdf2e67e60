"""Stored zstd frames: how a zstd field keeps a chunk that zstd cannot shrink.

A zstd frame may hold its content as raw blocks (RFC 8878, section 3.1.1.2): the bytes
themselves, each block of at most 128 KiB after a 3-byte header. A chunk (or inner chunk) whose
zstd frame would save less than `MIN_SAVING` of its bytes is written as such a *stored frame*
instead: any zstd decoder reads it (zarr-python's included) and it costs a copy to read, where
zstd's entropy-coded blocks of poorly compressible data (random floats, noisy observations)
decode at about 1 GB/s per core. The stored frames this module writes are found in a few array
operations (`stored_mask`) and copied out without calling zstd (`copy_stored`); any other frame
is left to the zstd decoder.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..build import load_extension

MIN_SAVING = 1 / 8
"""A zstd frame is kept when it saves at least this fraction of the bytes, else stored."""
BLOCK_BYTES = 128 * 1024
"""Content bytes per raw block (zstd's largest block), all but the last block full."""
_HEAD = np.frombuffer(bytes.fromhex("28b52ffd") + bytes([0xE0]), np.uint8)
"""The magic number, then a frame header descriptor: single segment, an 8-byte content size,
no content checksum, no dictionary."""
_HEAD_BYTES = len(_HEAD) + 8
_BLOCK_HEAD = 3
_COPY_RUNS = getattr(load_extension("diskreplay.format._batch"), "copy_runs", None)


def keeps_frame(frame_bytes: int, content_bytes: int) -> bool:
    """Whether a zstd frame of ``frame_bytes`` saves enough of ``content_bytes`` to be kept."""
    return frame_bytes <= content_bytes - content_bytes * MIN_SAVING


def stored_frame(content: np.ndarray) -> bytes:
    """A zstd frame holding ``content`` (uint8, 1-D, at least one byte) in raw blocks."""
    heads, values, offsets, sizes = _layout(len(content))
    out = np.empty(_HEAD_BYTES + _BLOCK_HEAD * len(sizes) + len(content), np.uint8)
    out[heads] = values
    for offset, size, start in zip(offsets.tolist(), sizes.tolist(), range(0, len(content), BLOCK_BYTES)):
        out[offset:offset + size] = content[start:start + size]
    return out.tobytes()


def stored_mask(data: np.ndarray, begin: np.ndarray, length: np.ndarray, n: int) -> np.ndarray:
    """Which of the frames ``data[begin[i]:begin[i] + length[i]]`` (uint8; int64 spans) are
    stored frames of exactly ``n`` content bytes as `stored_frame` writes them (every header as
    it must be), in a few array operations: a bool per frame."""
    stored: np.ndarray = (np.asarray(length) == _HEAD_BYTES + _BLOCK_HEAD * _blocks(n) + n) & (n > 0)
    if stored.any():
        heads, values, _, _ = _layout(n)
        stored[stored] = (data[begin[stored][:, None] + heads] == values).all(axis=1)
    return stored


def copy_stored(data: np.ndarray, begin: np.ndarray, flat: np.ndarray, rows: np.ndarray) -> None:
    """Copy the content of the stored frames at ``data[begin[i]:]`` (uint8; ones `stored_mask`
    found, of ``flat.shape[1]`` bytes) into ``flat[rows[i]]`` (uint8 rows): one call without the
    GIL per run of consecutive rows where the `_batch` extension was built, else a copy per block."""
    n = flat.shape[1]
    _, _, offsets, sizes = _layout(n)
    if _COPY_RUNS is None or not flat.flags.c_contiguous:
        for at, row in zip(begin.tolist(), rows.tolist()):
            for offset, size, start in zip(offsets.tolist(), sizes.tolist(), range(0, n, BLOCK_BYTES)):
                flat[row, start:start + size] = data[at + offset:at + offset + size]
        return
    if not len(rows):
        return
    steps = np.diff(rows)
    if not (steps == 1).all():  # sorted into runs (a whole shard's frames come as one, in order)
        order = np.argsort(rows, kind="stable")
        rows, begin = rows[order], begin[order]
        steps = np.diff(rows)
    cuts = [0, *(np.flatnonzero(steps != 1) + 1).tolist(), len(rows)]
    lengths = np.empty((len(rows), len(sizes)), np.int64)
    lengths[:] = sizes
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        first = int(rows[lo])
        _COPY_RUNS(data, flat[first:first + hi - lo].reshape(-1), (begin[lo:hi, None] + offsets).reshape(-1),
                   lengths[lo:hi].reshape(-1))


def _blocks(n: int) -> int:
    return -(-n // BLOCK_BYTES)


@lru_cache(maxsize=64)
def _layout(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where a stored frame of ``n`` (> 0) content bytes puts what: the offsets of its header
    bytes (the frame's, then each block's) and the bytes there, then each block's content offset
    and size (read-only: kept for the next frame of ``n`` bytes, a field's inner chunks all are).
    A block header is 3 bytes little-endian: the last-block bit, the block type 0 (raw) in bits
    1-2, the size from bit 3."""
    sizes = np.minimum(BLOCK_BYTES, n - BLOCK_BYTES * np.arange(_blocks(n), dtype=np.int64))
    starts = _HEAD_BYTES + (BLOCK_BYTES + _BLOCK_HEAD) * np.arange(len(sizes), dtype=np.int64)
    words = (sizes << 3).astype("<u4")
    words[-1] |= 1
    heads = np.concatenate([np.arange(_HEAD_BYTES), (starts[:, None] + np.arange(_BLOCK_HEAD)).reshape(-1)])
    values = np.concatenate([_HEAD, np.frombuffer(n.to_bytes(8, "little"), np.uint8),
                             words.view(np.uint8).reshape(-1, 4)[:, :_BLOCK_HEAD].reshape(-1)])
    layout = heads, values, starts + _BLOCK_HEAD, sizes
    for array in layout:
        array.setflags(write=False)
    return layout
