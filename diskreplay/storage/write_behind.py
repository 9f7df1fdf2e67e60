"""`WriteBehind`: a writer's sealed chunks written on a background thread, one batch at a time.

The call that fills a chunk only hands it over: encoding it, the retire commit a full ring needs
before overwriting old rows (an fsync) and the chunk's write happen on this thread, so a single
``add`` never waits for them, nor for the disk's stalls. One batch is in flight at a time; chunks
sealed meanwhile wait in the cache, pinned, and go with the next batch.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

Sealed = tuple[int, int, int]
"""``(lane, chunk, slot)``: a staged chunk complete (or patched) and waiting to be written."""


class WriteBehind:
    """The background thread of one writer and the batch it is writing."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._job: Future[None] | None = None
        self.in_flight: list[Sealed] = []

    @property
    def busy(self) -> bool:
        """Whether a batch was started and not yet taken back with `finish`."""
        return self._job is not None

    def holds(self, lane: int, chunk: int) -> bool:
        """Whether this chunk is in the batch being written."""
        return any(ln == lane and c == chunk for ln, c, _ in self.in_flight)

    def start(self, chunks: list[Sealed], write: Callable[[], None]) -> None:
        """Run ``write`` (which writes ``chunks``) on the background thread. Not while `busy`."""
        assert self._job is None, "a batch is in flight"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="diskreplay-write-behind")
        self.in_flight = chunks
        self._job = self._pool.submit(write)

    def finish(self, wait: bool) -> tuple[list[Sealed], BaseException | None] | None:
        """The batch's chunks and its error (None: written), once it ended; None while it runs
        (``wait``: it is waited for) or if none was started."""
        job = self._job
        if job is None or not (wait or job.done()):
            return None
        error = job.exception()
        chunks, self._job, self.in_flight = self.in_flight, None, []
        return chunks, error

    def close(self) -> None:
        """Wait for the batch in flight (its outcome is dropped) and end the thread."""
        self.finish(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
