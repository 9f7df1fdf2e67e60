"""`Warmer`: the first read brings the whole window close.

A reader's window that fits its cache is loaded into it behind its reads (`start_fill`): chunk
``(lane, c)`` goes to slot ``lane * width + c``, so that once the fill is in (`settle`) reads
find rows from their steps alone (``resident_span``). The fill starts after the first read and
runs on a thread of its own, a group of chunks per job; until it is in, reads take what they
miss straight from the chunk objects (`PointReads`, raw fields) or load those chunks. A window
whose sharded fields are read row by row (it does not fit) brings the other fields' chunks into
the slots without room for those, where they fit there. On local
disk, a reader's rows that do not fit the cache but fit half this machine's RAM are memory-mapped
as read while a thread reads every file into the page cache, a piece at a time, giving way to
random reads (`page_in`; each batch asking for its own pages first meanwhile); bigger ones are read
page by page as sampled (`MappedChunks.read_randomly`). A local writer fills before its first
read returns (`fill_cache`, `MappedChunks.warm`). Best effort: a damaged chunk is reported by the
read that needs it. A ring reader whose writer retired rows meanwhile forgets what it filled.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from ..errors import CorruptBufferError
from ..io.mmap import cached as in_page_cache
from ..io.store import ChunkStore
from ..io.threads import Threads
from .loading import ChunkLoader
from .mapped import MappedChunks
from .stale import RetiredCheck, Window


@functools.cache
def physical_memory() -> int:
    """Bytes of RAM of this machine (2**40 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


FILL_JOB_BYTES = 16 * 2**20
"""Decoded bytes of the chunks one job of a background fill reads."""
REMOTE_FILL_JOBS = 4
"""Jobs of a fill from an object store at once (each keeps the store's requests in flight);
from local disk they run one after another."""


@dataclass
class _Fill:
    """A fill running behind the reads: the chunks, the slots reserved for them, and its jobs,
    each reading the chunks of its part; parts before ``placed`` are in place."""

    lanes: np.ndarray
    chunks: np.ndarray
    slots: np.ndarray
    width: int | None
    """Home slots per lane (None: the slots are not home)."""
    jobs: list[tuple[slice, Future[bool]]]
    pid: int
    """The process whose threads run the jobs (a forked child inherits the fill, not its threads)."""
    partial: bool = False
    """Whether it loads the fields not read row by row only (chunks cached meanwhile keep their copy)."""
    placed: int = 0
    whole: bool = True
    """Whether every part placed so far read all its chunks."""
    stale: list[tuple[int, np.ndarray]] = field(default_factory=list)
    """(lane, chunks) the writer rewrote since the fill started: forgotten as its parts land."""

    def finished(self, wait: bool) -> list[tuple[slice, bool]]:
        """The parts not placed yet whose jobs are done (``wait``: all, once done), in order,
        and whether each read all its chunks; they count as placed from now on."""
        out = []
        for part, job in self.jobs[self.placed:]:
            if not wait and not job.done():
                break
            error = job.exception()
            out.append((part, error is None and job.result()))
        self.placed += len(out)
        return out

    def unplaced(self) -> np.ndarray:
        """The slots of the parts not placed yet."""
        return self.slots[self.jobs[self.placed][0].start:] if self.placed < len(self.jobs) else self.slots[:0]


PAGE_IN_BYTES = 8 * 2**20
"""Bytes of chunk files a reader's page-in asks of the OS at a time (`page_in`)."""
READ_PAUSE_S = 0.002
"""How long the reads must have paused before a page-in reads its next piece of files."""


class ReadActivity:
    """A reader's reads as its page-in sees them: a piece of files being read in delays the
    reads queued behind it on the disk, so the page-in waits for a pause in them (`page_in`)."""

    def __init__(self) -> None:
        self.count = 0
        """Reads started so far."""
        self.active = False
        """Whether a read is running."""
        self.closed = False
        """Whether the reader closed (a page-in then stops)."""

    def start(self, waits: bool = True) -> None:
        """A read starts; unless it ``waits`` for its pages (reads in order, as the page-in does)."""
        if waits:
            self.count += 1
            self.active = True

    def end(self) -> None:
        self.active = False

    def pause(self, seen: int, most_s: float) -> int:
        """Wait until no read runs nor started within `READ_PAUSE_S` (``seen``: the reads
        started when this was last asked), at most ``most_s``, or until closed; the reads
        started by then."""
        deadline = time.monotonic() + most_s
        while not self.closed and (self.active or self.count != seen) and time.monotonic() < deadline:
            seen = self.count
            time.sleep(READ_PAUSE_S)
        return self.count


def page_in(store: ChunkStore, pieces: list[list[str]], reads: ReadActivity) -> None:
    """Bring the files of these pieces into the page cache, each piece once the reads pause or
    have run alone for as long as the piece before took (so it ends within about twice its own
    time); pieces in it already are passed over. A piece's files are asked of the OS at once,
    then each read through, so that they are in when this returns (unless the reader closed)."""
    seen, took = reads.count, 0.0
    for keys in pieces:
        if all(in_page_cache(store.path(key)) for key in keys):
            continue
        seen = reads.pause(seen, took)
        if reads.closed:
            return
        started = time.monotonic()
        store.prefetch(keys)
        for key in keys:
            store.get(key)
        took = time.monotonic() - started


class Warmer:
    """The first-read fill of a reader or local writer, and the lane-major layout it leaves."""

    def __init__(self, loader: ChunkLoader, mapped: MappedChunks | None, retired: RetiredCheck, window: Window,
                 forget_files: Callable[[int, np.ndarray], None], stored_bytes: int, reader: bool, local: bool):
        self.loader, self.cache, self.mapped, self.retired = loader, loader.cache, mapped, retired
        self.forget_files = forget_files
        self.window = window
        self.layout = retired.layout
        self.stored_bytes = stored_bytes
        self.reader = reader
        self.local = local
        self.pending = local or reader
        """Whether a fill is due: before the next read (a writer), after it (a reader)."""
        self.resident_span: int | None = None
        """Set while a reader's cache holds its window in lane-major order: slab rows per lane."""
        self.home_width: int | None = None
        self.fill: _Fill | None = None
        """A reader's fill running behind its reads."""
        self.paging: Future[None] | None = None
        """A reader's memory-mapped files being read into the page cache (by process ``paging_pid``)."""
        self.paging_pid = 0
        self.reads = ReadActivity()
        self.threads = Threads(1 if local else REMOTE_FILL_JOBS, "diskreplay-fill")
        self.found_damage = False
        """Whether a fill found a chunk missing or damaged: reads then read whole chunks (checked)."""

    @property
    def filling(self) -> bool:
        """Whether a fill is due or running behind the reads (reads miss until it is in)."""
        return self.reader and (self.pending or self.fill is not None)

    @property
    def _page_by_page(self) -> bool:
        """Whether mapped files are too big to read whole into the page cache (`read_randomly`)."""
        return self.mapped is not None and self.stored_bytes > physical_memory() // 2

    def reset(self, lane: int, chunks: np.ndarray) -> None:
        """The writer rewrote these chunks of ``lane`` (their cached copies are gone): forget the
        resident layout, and fill again after the next read (a reader), once a running fill is
        in; that one goes on (a remote one takes seconds, and a live learner refreshes more often),
        its copies of these chunks forgotten as they land."""
        if self.fill is not None:
            self.fill.stale.append((lane, chunks))
        self.resident_span = None
        self.pending = self.reader

    def before_read(self) -> None:
        """A writer's due fill; a reader's fill put in place if it is done (the cache is touched
        on the reading thread only). In a forked child, the parent's fill is forgotten and due again."""
        if self.fill is not None and self.fill.pid != os.getpid():
            self.cache.release(self.fill.unplaced())
            self.fill, self.pending = None, True
        if self.paging is not None and self.paging_pid != os.getpid():
            self.paging, self.pending = None, True
        if self.pending and (not self.reader or self._page_by_page):
            self.pending = False
            self._warm()
        elif self.pending and self.mapped is not None:
            self.mapped.prefetch_pages = True  # a reader's first read asks for its pages; the files follow
        self.settle(wait=False)
        if self.paging is not None and self.paging.done():
            self.paging = None
            assert self.mapped is not None
            self.mapped.prefetch_pages = False

    def wait(self) -> None:
        """Start a due fill, and wait until it is in place."""
        self.before_read()
        for _ in range(2):  # a fill due while another ran starts once that one is in
            self.after_read()
            self.settle()
        if self.paging is not None:
            self.paging.result()
        self.before_read()

    def after_read(self) -> None:
        """A reader's due fill, started behind its first read (once a running one is in)."""
        if self.pending and self.reader and self.fill is None:
            self.pending = False
            self._warm()

    def _warm(self) -> None:
        lanes, chunks = self.window_chunks()
        if self.mapped is None and self.reader:
            self.start_fill(lanes, chunks)
        elif self.mapped is None:
            self.fill_cache(lanes, chunks)
        elif self._page_by_page:
            self.mapped.read_randomly()
        elif self.reader:
            self._page_in(lanes, chunks)
        else:
            self.drop_if_moved(*self.mapped.warm(lanes, chunks))

    def _page_in(self, lanes: np.ndarray, chunks: np.ndarray) -> None:
        """Read these chunk files into the page cache on the fill's thread; until they are in,
        each mapped read asks for its own pages first."""
        assert self.mapped is not None
        io = self.loader.io
        per_piece = max(1, PAGE_IN_BYTES // (self.layout.chunk_rows * io.schema.row_bytes))
        keys = [[io.key(name, ln, ch) for name in io.schema.fields] for ln, ch in zip(lanes.tolist(), chunks.tolist())]
        pieces = [[key for chunk in keys[i:i + per_piece] for key in chunk] for i in range(0, len(keys), per_piece)]
        self.mapped.prefetch_pages = True
        self.paging, self.paging_pid = self.threads.submit(page_in, io.store, pieces, self.reads), os.getpid()

    def start_fill(self, lanes: np.ndarray, chunks: np.ndarray) -> None:
        """Load every chunk not cached behind the reads, if they fit the cache: into their home
        slots where those are free and every cached chunk is home, else into free slots; `settle`
        puts them in place. Where fields are read row by row, the other fields' chunks, into free
        slots without room for those (`ChunkCache.reserve_partial`), if there are enough."""
        cache = self.cache
        if cache.row_fields:
            missing = cache.slots_of(lanes, chunks) < 0
            lanes, chunks = lanes[missing], chunks[missing]
            slots = cache.reserve_partial(len(lanes)) if len(lanes) else None
            if slots is not None:
                self._start_jobs(lanes, chunks, slots, None, self.loader.cached_fields)
            return
        width = self._home_width()
        home = lanes * width + chunks
        at = cache.slots_of(lanes, chunks)
        missing = at < 0
        in_place = (len(home) > 0 and home.max() < cache.full_slots and (at[~missing] == home[~missing]).all()
                    and cache.free(home[missing]))
        if not in_place and (len(home) >= cache.full_slots or missing.sum() > cache.evictable() - 1):
            return  # a slot is left for reads
        lanes, chunks = lanes[missing], chunks[missing]
        slots = home[missing] if in_place else cache.reserve(len(lanes))
        self._start_jobs(lanes, chunks, slots, width if in_place else None, self.loader.all_fields)

    def _start_jobs(self, lanes: np.ndarray, chunks: np.ndarray, slots: np.ndarray, width: int | None,
                    names: tuple[str, ...]) -> None:
        """The fill of the fields ``names`` of these chunks into these slots, a job per part."""
        cache, io = self.cache, self.loader.io
        cache.pin(slots)
        chunk_bytes = self.layout.chunk_rows * sum(io.schema[name].row_bytes for name in names)
        group = max(1, FILL_JOB_BYTES // max(chunk_bytes, 1))
        parts = [slice(i, i + group) for i in range(0, len(slots), group)]

        def prefetch() -> None:  # every file asked of the OS at once
            io.store.prefetch([io.key(name, ln, ch) for ln, ch in zip(lanes.tolist(), chunks.tolist())
                               for name in names])

        def read(part: slice) -> bool:  # its keys made on the job's thread: none delays the read before
            return io.read_here([(io.key(name, ln, ch), io.codecs[name], cache.chunk_rows_of(name, slot))
                                 for ln, ch, slot in zip(lanes[part].tolist(), chunks[part].tolist(),
                                                         slots[part].tolist()) for name in names])
        self.threads.submit(prefetch)
        jobs = [(part, self.threads.submit(read, part)) for part in parts]
        self.loader.chunks_loaded += len(slots)
        self.fill = _Fill(lanes, chunks, slots, width, jobs, os.getpid(), len(names) < len(io.schema.fields))

    def homes(self, lanes: np.ndarray, chunks: np.ndarray) -> np.ndarray | None:
        """Where a reader whose fill is due loads these chunks: their free home slots (so that
        the fill can leave the window in lane-major order), or None (any slots)."""
        if not (self.pending and self.reader and self.mapped is None):
            return None
        home = lanes * self._home_width() + chunks
        return home if home.max(initial=0) < self.cache.full_slots and self.cache.free(home) else None

    def settle(self, wait: bool = True) -> None:
        """Put the chunks of the fill's finished parts in place (copies read meanwhile are
        dropped), waiting for every part unless not ``wait``; a part that failed frees its slots
        (the reads that need a damaged chunk report it)."""
        fill = self.fill
        if fill is None:
            return
        for part, whole in fill.finished(wait):
            lanes, chunks, slots = fill.lanes[part], fill.chunks[part], fill.slots[part]
            if not whole:
                self.cache.release(slots)
                fill.whole, self.found_damage = False, True
                continue
            if fill.partial:  # a chunk cached meanwhile (whole, by a read) keeps that copy
                held = self.cache.slots_of(lanes, chunks) >= 0
                self.cache.release(slots[held])
                lanes, chunks, slots = lanes[~held], chunks[~held], slots[~held]
            self.cache.unpin(self.cache.place(lanes, chunks, slots))
            for lane, stale in fill.stale:
                self.cache.invalidate(lane, stale)
            fill.whole &= not self.drop_if_moved(lanes, chunks)
        if fill.placed < len(fill.jobs):
            return
        self.fill = None
        lanes, chunks = self.window_chunks()
        if (fill.whole and fill.width is not None
                and (self.cache.slots_of(lanes, chunks) == lanes * fill.width + chunks).all()):
            self.resident_span = fill.width * self.layout.chunk_rows

    def window_chunks(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (lane, chunk) of the window: lanes and chunks, lane by lane."""
        lo, hi = self.window()
        spans = [self.layout.chunks_between(int(lo[ln]), int(hi[ln])) for ln in range(self.layout.num_envs)]
        return (np.concatenate([np.full(len(c), ln, dtype=np.int64) for ln, c in enumerate(spans)]),
                np.concatenate(spans))

    def _drop_fill(self) -> None:
        """Stop a fill running behind the reads and free the slots of its parts not in place."""
        fill, self.fill = self.fill, None
        if fill is None:
            return
        left = [job for _, job in fill.jobs[fill.placed:]]
        for job in left:
            job.cancel()
        for job in left:
            if not job.cancelled():
                job.exception()
        self.cache.release(fill.unplaced())

    def close(self) -> None:
        self.reads.closed = True
        self._drop_fill()
        self.threads.shutdown()

    def fill_cache(self, lanes: np.ndarray, chunks: np.ndarray) -> None:
        """A writer's fill: every chunk not cached loaded now, all files asked of the OS at once,
        if they fit beside its staging."""
        missing = self.cache.slots_of(lanes, chunks) < 0
        if missing.sum() > self.cache.evictable() - (2 * self.layout.num_envs + 2):
            return
        lanes, chunks = lanes[missing], chunks[missing]
        io = self.loader.io
        io.store.prefetch([io.key(name, ln, ch) for ln, ch in zip(lanes.tolist(), chunks.tolist())
                           for name in io.schema.fields])
        try:
            self.loader.load(lanes, chunks)
        except CorruptBufferError:
            return
        self.drop_if_moved(lanes, chunks)

    def _home_width(self) -> int:
        """Slots per lane of a reader's lane-major cache: the ring's chunks; in dataset mode the
        window's, with room to grow (a power of two, while the cache has the slots), kept while
        it suffices."""
        needed = self.layout.chunks_per_lane(int(self.window()[1].max(initial=0)))
        if self.layout.lane_capacity is None and (self.home_width or 0) < needed:
            roomy = 1 << (needed - 1).bit_length()
            self.home_width = roomy if self.layout.num_envs * roomy <= self.cache.full_slots else needed
        return self.home_width or needed

    def drop_if_moved(self, lanes: np.ndarray, chunks: np.ndarray) -> bool:
        """A ring reader that loaded or mapped chunks ahead of any read: forget those holding
        steps of its window the writer retired meanwhile. Returns whether it forgot any."""
        tainted = self.retired.check(lanes[:0], lanes[:0], lanes, chunks)
        for ln, stale in tainted:
            self.cache.invalidate(ln, stale)
            self.forget_files(ln, stale)
        return bool(tainted)
