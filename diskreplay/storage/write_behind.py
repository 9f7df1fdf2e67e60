"""`WriteBehind`: a writer's sealed chunks written on a background thread, one batch at a time.

The call that fills a chunk only hands it over: encoding it, the retire commit a full ring needs
before overwriting old rows (an fsync) and the chunk's write happen on this thread, so a single
``add`` never waits for them, nor for the disk's stalls. One batch is in flight at a time; chunks
sealed meanwhile wait in the cache, pinned, and go with a later batch (the writer starts one as an
append ends with none in flight).

A thread of its own reads ahead: a ring keeps the old rows of the chunk it is about to overwrite
(they stay readable until then), so as a lane starts a chunk, the next few it will overwrite are
read (from disk if the page cache let them go) and decoded there, to be taken when the lane
reaches them instead of reading them in that add. A read the disk holds up longer than that is
not waited for either (`diskreplay.storage.ring_reads`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import wait as wait_for

import numpy as np

from ..io.threads import Threads
from .chunk_io import ChunkIO

Sealed = tuple[int, int, int]
"""``(lane, chunk, slot)``: a staged chunk complete (or patched) and waiting to be written."""
Rows = dict[str, np.ndarray]


def read_rows(io: ChunkIO, lane: int, chunk: int, like: Mapping[str, np.ndarray], must_exist: bool) -> Rows:
    """A stored chunk's rows of every field, read into new arrays shaped as ``like`` (`ChunkIO.read`)."""
    rows = {name: np.empty_like(template) for name, template in like.items()}
    io.read([(io.key(name, lane, chunk), io.codecs[name], rows[name]) for name in rows], must_exist)
    return rows


class WriteBehind:
    """The background threads of one writer: the batch it is writing, and its reads ahead."""

    def __init__(self) -> None:
        self._writer = Threads(1, "diskreplay-write-behind")
        self._job: Future[None] | None = None
        self.in_flight: list[Sealed] = []
        self._reader = Threads(1, "diskreplay-read-ahead")
        self._reads: dict[tuple[int, int], Future[Rows]] = {}  # (lane, chunk): its rows read ahead

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
        self.in_flight = chunks
        self._job = self._writer.submit(write)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the batch in flight to end (it is not taken back)."""
        if self._job is not None:
            wait_for([self._job], timeout)

    def read_ahead(self, io: ChunkIO, lane: int, chunks: Mapping[int, bool], like: Mapping[str, np.ndarray]) -> None:
        """Read stored chunks' rows (``chunks``: chunk -> whether its file must exist) into new
        arrays shaped as ``like`` (every field) on the read-ahead thread (`ChunkIO.read`), those
        not read ahead already; the lane's other reads ahead are dropped."""
        self.forget_reads(lane, [c for ln, c in self._reads if ln == lane and c not in chunks])
        for chunk, must_exist in chunks.items():
            if (lane, chunk) not in self._reads:
                self._reads[(lane, chunk)] = self._reader.submit(read_rows, io, lane, chunk, like, must_exist)

    def take_read(self, lane: int, chunk: int) -> Future[Rows] | None:
        """The read ahead of this chunk (it may still run), or None: none was started or it was
        forgotten."""
        return self._reads.pop((lane, chunk), None)

    def forget_reads(self, lane: int, chunks: Iterable[int]) -> None:
        """These chunks were rewritten: drop their reads ahead."""
        for chunk in chunks:
            self._reads.pop((lane, chunk), None)

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
        self._reads.clear()
        self._writer.shutdown()
        self._reader.shutdown()
