"""`BufferStorage`: one buffer's storage: the shared read side (`Storage`) over its `CommitLog`,
and, for its writer, a `StagingWriter` (staged rows, whole-chunk writes) that the writes go through."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import CorruptBufferError
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.keys import FORMAT
from ..format.layout import values_codec
from ..format.pins import PinIndex
from .cache import ChunkCache
from .chunk_io import ChunkIO
from .commit_log import CommitLog
from .facade import Storage
from .file_maps import FileMaps
from .frames import FrameWrites
from .loading import ChunkLoader
from .outputs import Rows
from .pins import Pins, read_index
from .ragged_reads import RaggedReads
from .ragged_values import HELD_BYTES, ValueStaging, values_key_of
from .reader import ChunkReader
from .shard_tables import inner_chunks, read_tables, sharded_fields, write_tables
from .writer import StagingWriter


class BufferStorage(Storage):
    """The chunks, cache and commits of one buffer (`open_storage`, `create_storage`)."""

    _log: CommitLog

    def __init__(self, url: str, config: BufferConfig, log: CommitLog, io: ChunkIO, cache: ChunkCache,
                 loader: ChunkLoader, reader: ChunkReader, writer: StagingWriter | None, files: FileMaps,
                 ragged: RaggedReads | None, storage_options: Mapping[str, Any] | None):
        super().__init__(url, config, log, io, cache, loader, reader, files, ragged, storage_options)
        self._log = log
        self._opened = log.record
        """The commit this storage opened at (a writer's shard index tables of it serve its own)."""
        self.writer = writer
        """The writer's staged rows and chunk writes behind its appends (None: a reader); for
        tests and tools that wait for those writes or tune them."""
        self._values = ValueStaging(config, io, self._read_value_chunk) if writer and self._ragged else None
        encoded = {name: f for name, f in config.user_schema.items() if f.codec is not None}
        self._encoders = FrameWrites(encoded, self.layout) if writer and encoded else None
        if self._ragged is not None:
            self._ragged.staging = self._values

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

    def newer_state(self) -> tuple[CommitRecord, dict[str, Any]] | None:
        """The store's newest commit and its state, or None where it is the one shown (`CommitLog.newer_state`)."""
        return self._log.newer_state()

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
        if self._encoders is not None:
            self._encoders.close()
        super().close()

    def write_shard_tables(self) -> None:
        """Writer, after its last commit: the shard index tables of its sharded fields
        (`shard_tables`), for readers' first point reads. A store that fails to take them gets
        a warning, not an error: the commit stands, and readers read each shard's own index."""
        self._writable()
        names, inner = sharded_fields(self._io), inner_chunks(self._io, self.layout)
        if not names or self.config.format != FORMAT:  # not among the objects at a diskreplay/1 buffer's root
            return
        self._log.check_lock()
        try:
            try:
                opened = read_tables(self._log.objects, self.url, self._opened, names, inner, self.config.num_envs)
            except CorruptBufferError:
                opened = {}  # read from the shards instead
            write_tables(self._io, self._log.objects, self.layout, self._log.record, opened)
        except OSError as exc:
            warnings.warn(f"{self.url!r}: the shard index tables were not written ({exc}); readers read each "
                          f"shard's own index", stacklevel=2)

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
        """Stage ``count`` steps for one lane; the steps stored ``[first, end)`` (`StagingWriter.append`).
        Ragged fields' values are staged apart (`ValueStaging`), their ends with the fixed fields."""
        writer = self._writable()
        if self._values is None:
            return writer.append(lane, rows, count)
        start = int(self.total[lane])
        self._retire_wrapped(lane, start + count)
        if self._encoders is not None:
            rows = {**rows, **self._encoders.encode(lane, start, rows)}  # type: ignore[dict-item]
        fixed = {name: value for name, value in rows.items() if name not in self._values.fields}
        columns: dict[str, Any] = {name: rows[name] for name in self._values.fields}
        fixed.update(self._values.stage(lane, start, columns, self._prev_end))
        stored = writer.append(lane, fixed, count)
        if self._values.held_bytes > HELD_BYTES:
            self._write_values(tails=True)
        return stored

    def _retire_wrapped(self, lane: int, end: int) -> None:
        """A ring with ragged fields: the old rows of the row chunk that step ``end - 1`` lands in
        are retired (new rows' values start at the chunk's first value, over theirs)."""
        cap, rows = self.layout.lane_capacity, self.layout.chunk_rows
        if cap is None:
            return
        slot = (end - 1) % cap
        first_old = end - 1 - slot % rows - cap + min(rows, cap - slot // rows * rows)
        cursors = self._log.cursors
        if first_old > cursors.lower[lane]:
            cursors.lower[lane] = min(first_old, end - 1)

    def _prev_end(self, ends: str, lane: int, step: int) -> int:
        return int(self.gather(np.array([lane]), np.array([step]), (ends,))[ends][0])

    def _read_value_chunk(self, name: str, lane: int, chunk: int, k: int) -> np.ndarray:
        assert self._ragged is not None
        f = self.config.user_schema.ragged[name]
        out = np.zeros((self._ragged.vc[name], *f.shape), f.dtype)
        self._io.read([(values_key_of(self._io, f, name, lane, chunk, k), values_codec(self.config), out)], True)
        return out

    def _write_values(self, tails: bool) -> None:
        """Write the pending value chunks (and staged tails), after the writer's background
        writes ended and a retire commit covers the rows they overwrite."""
        assert self._values is not None and self._ragged is not None and self.writer is not None
        self.writer.settle(wait=True)
        self._log.retire(self._log.cursors.first_kept())
        work, keys = self._values.work(tails)
        if work:
            self.writer._put(work, durable=False)
        for name in self._values.fields:
            self._ragged.forget(name, [(ln, c, k) for n, ln, c, k in keys if n == name])

    def unappend(self, lane: int, start: int, attempted_end: int) -> None:
        """Forget steps a failed call staged or wrote (`StagingWriter.unappend`)."""
        self._writable().unappend(lane, start, attempted_end)
        if self._encoders is not None and self._frames is not None:
            self._encoders.reset(lane)
            self._frames.forget()

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
            if self._values is not None:
                self._write_values(tails=True)
            writer.write_all(durable)
            log.grow_arrays(int(log.cursors.total.max(initial=0)))
            if self._values is not None:
                for key, document in self._values.grown_documents(log.lane_rows).items():
                    log.check_lock()
                    self.store.put(key, document, durable=True)
            log.commit(log.cursors.total.copy(), log.cursors.first_kept(), durable, staged)
        except BaseException:
            if staged is not None:
                log.discard(staged)
            raise
        log.collect_garbage()
