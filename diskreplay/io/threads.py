"""`Threads`: a named pool of worker threads, started at its first job and started afresh in a
forked child. A child inherits the pool's bookkeeping but none of its threads: work handed to the
parent's pool there would wait forever."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class Threads:
    """Up to ``count`` threads named ``name-N``, started when first given work."""

    def __init__(self, count: int, name: str):
        self.count, self.name = count, name
        self._pool: ThreadPoolExecutor | None = None
        self._pid = -1

    def _running(self) -> ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():
            self._pool = ThreadPoolExecutor(max_workers=self.count, thread_name_prefix=self.name)
            self._pid = os.getpid()
        return self._pool

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn(*args)`` on a thread."""
        return self._running().submit(fn, *args)

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any]) -> Iterator[T]:
        """``map(fn, *iterables)`` on the threads, results in order."""
        return self._running().map(fn, *iterables)

    def shutdown(self) -> None:
        """Wait for the jobs given in this process, then stop its threads (started again by
        the next job)."""
        if self._pool is not None and self._pid == os.getpid():
            self._pool.shutdown(wait=True)
        self._pool = None
