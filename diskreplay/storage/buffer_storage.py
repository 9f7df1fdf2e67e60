"""`BufferStorage`: one buffer's storage: the shared read side (`Storage`) over its `CommitLog`,
and, for its writer, a `StagingWriter` (staged rows, whole-chunk writes) that the writes go through."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.pins import PinIndex
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .commit_log import CommitLog
from .facade import Storage
from .file_maps import FileMaps
from .loading import ChunkLoader
from .outputs import Rows
from .pins import Pins, read_index
from .reader import ChunkReader
from .writer import StagingWriter


class BufferStorage(Storage):
    """The chunks, cache and commits of one buffer (`open_storage`, `create_storage`)."""

    _log: CommitLog

    def __init__(self, url: str, config: BufferConfig, log: CommitLog, io: ChunkIO, cache: ChunkCache,
                 loader: ChunkLoader, reader: ChunkReader, writer: StagingWriter | None, files: FileMaps,
                 storage_options: Mapping[str, Any] | None):
        super().__init__(url, config, log, io, cache, loader, reader, files, storage_options)
        self._log = log
        self.writer = writer
        """The writer's staged rows and chunk writes behind its appends (None: a reader); for
        tests and tools that wait for those writes or tune them."""

    @property
    def at_commit(self) -> int | None:
        """The commit a reader opened ``at_commit`` stays at (None: it follows the newest)."""
        return self._log.record.sequence if self._log.held is not None else None

    def shard_records(self, newest: bool = False, shards: Sequence[int] | None = None) -> list[CommitRecord]:
        """``[its commit]`` (or the newest in the store): one buffer is its own only shard."""
        if shards is not None and list(shards) != [0]:
            raise IndexError(f"{self.url!r} is one buffer (shard 0), not shards {list(shards)}")
        return [self._log.read_newest() if newest else self._log.record]

    def load_state(self, newest: bool) -> tuple[CommitRecord, dict[str, Any]]:
        """The commit this storage shows (or the store's ``newest``) and the state saved with it."""
        return self._log.load_state(newest)

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: Mapping[str, np.ndarray] | None = None) -> Rows:
        """`Storage.gather`; a writer first takes in the chunks its background thread read ahead."""
        if self.writer is not None and self.writer.reads.old and not self.closed:
            self.writer.reads.merge()
        return super().gather(lane, step, names, out)

    def close(self) -> None:
        """Stop the writer's background thread, then release as `Storage.close`. Nothing is written."""
        if self.writer is not None and not self.closed:
            self.writer.close()
        super().close()

    # ---- pins ------------------------------------------------------------------------------

    def pins(self) -> PinIndex:
        """The buffer's pins (`Pins`), as its store holds them now."""
        return read_index(self._log.objects, self.url)

    def pin(self, name: str | None, commit: Callable[[], object]) -> int:
        """Writer: ``commit()``, then keep the commit it made readable (`Pins.pin`); its sequence."""
        self._writable()
        return Pins(self._log, self._io).pin(name, commit)

    def unpin(self, at: int | str) -> None:
        """Writer: remove the pin of commit (or named) ``at`` and its copies (`Pins.unpin`)."""
        self._writable()
        Pins(self._log, self._io).unpin(at)

    # ---- writes ----------------------------------------------------------------------------

    def _writable(self) -> StagingWriter:
        self._log.require_writable()
        assert self.writer is not None
        return self.writer

    def append(self, lane: int, rows: Mapping[str, np.ndarray], count: int) -> tuple[int, int]:
        """Stage ``count`` steps for one lane; the steps stored ``[first, end)`` (`StagingWriter.append`)."""
        return self._writable().append(lane, rows, count)

    def unappend(self, lane: int, start: int, attempted_end: int) -> None:
        """Forget steps a failed call staged or wrote (`StagingWriter.unappend`)."""
        self._writable().unappend(lane, start, attempted_end)

    def update_rows(self, lane: int, first: int, values: Mapping[str, np.ndarray]) -> None:
        """Overwrite fields of steps already added (`StagingWriter.update_rows`)."""
        self._writable().update_rows(lane, first, values)

    def rewind(self, total: np.ndarray) -> None:
        """Writer, right after open: forget steps at or after ``total`` per lane."""
        self._writable().rewind(total)

    def retire_all(self) -> None:
        """Writer: every row added so far stops being readable (at once for this writer, for
        readers at the next commit). Steps go on counting."""
        self._writable().settle(wait=True)
        self._log.cursors.lower = self._log.cursors.total.copy()

    def write_behind(self) -> None:
        """Start writing the full chunks waiting on the background thread (`StagingWriter.write_behind`)."""
        self._writable().write_behind()

    def settle(self) -> None:
        """Raise the error of a failed background write, once (`StagingWriter.settle`)."""
        self._writable().settle()

    def flush(self, durable: bool = True, state: dict[str, Any] | None = None,
              side: BufferStorage | None = None) -> None:
        """Make everything added durable and visible, with ``state`` (None: keep the last).

        In this order: the state's arrays go to a new state object; the ``side`` storage (the
        ``derive_next`` store of final observations) commits; the sealed and every partial tail
        chunk are written (fsynced if ``durable``); a dataset's arrays grow; ``commit.json`` is
        replaced; the previous state object is deleted. If it raises, nothing new is committed
        and the rows stay staged."""
        writer = self._writable()
        writer.settle(wait=True)
        log = self._log
        staged = log.stage_state(state, durable) if state is not None else None
        try:
            if side is not None:
                side.flush(durable)
            writer.write_all(durable)
            log.grow_arrays(int(log.cursors.total.max(initial=0)))
            log.commit(log.cursors.total.copy(), log.cursors.first_kept(), durable, staged)
        except BaseException:
            if staged is not None:
                log.discard(staged)
            raise
        log.collect_garbage()
