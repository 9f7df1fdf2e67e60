"""How many batches a dataset gathers in one read, and a `Loader`'s worker hands over at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..buffer import ReplayBuffer

READ_BATCHES = 8
"""Most batches a dataset gathers in one read when it yields them in new arrays (sample mode: each
drawn as `ReplayBuffer.sample_batches` draws them): a read's fixed cost spread over several small
batches."""
READ_BYTES = 2**20
"""Most bytes such a read gathers: larger batches are read one by one."""
BLOCK_BATCHES = 32
"""Most batches a `Loader`'s worker hands over in one DataLoader item (`Block`): the DataLoader's
cost per item (~0.2-0.4 ms) spread over them."""
BLOCK_BYTES = 4 * 2**20
"""Most bytes of such a block (the size of a worker-ring slot)."""


def batches_per_read(batch_size: int, buf: ReplayBuffer, most_rows: int | None = None) -> int:
    """Batches of ``buf``'s rows a dataset gathers in one read when they go to new arrays: up to
    `READ_BATCHES`, together at most `READ_BYTES` and ``most_rows`` rows (None: any)."""
    return _within_rows(_batches_within(batch_size, buf, READ_BATCHES, READ_BYTES), batch_size, most_rows)


def batches_per_block(batch_size: int, buf: ReplayBuffer, most_rows: int | None = None) -> int:
    """Batches of ``buf``'s rows in a `Loader`'s block: up to `BLOCK_BATCHES`, at most `BLOCK_BYTES`
    and ``most_rows`` rows (None: any)."""
    return _within_rows(_batches_within(batch_size, buf, BLOCK_BATCHES, BLOCK_BYTES), batch_size, most_rows)


def _batches_within(batch_size: int, buf: ReplayBuffer, most: int, most_bytes: int) -> int:
    batch_bytes = batch_size * (sum(f.row_bytes for f in buf.fields.values()) + 8)
    return max(1, min(most, most_bytes // batch_bytes))


def _within_rows(batches: int, batch_size: int, most_rows: int | None) -> int:
    return batches if most_rows is None else max(1, min(batches, most_rows // batch_size))
