"""`verify`: check a buffer's stored objects against its last commit, reading every chunk.

What it checks (each failure is one line in `VerifyReport.problems`; it never raises for a bad
buffer and never writes):

- ``commit.json`` exists and parses, with cursors for every lane and ``lower <= committed``;
- the Zarr group is a diskreplay buffer, and each field's array metadata (``zarr.json``: data
  type, shape, chunk shape, codecs, byte order) matches the buffer's recorded config;
- every chunk that holds a committed, visible row exists, passes its CRC32C checksum (buffers
  made before checksums have none) and decodes to exactly one chunk's bytes (diskreplay writes
  every chunk it fills, whatever its values, so a missing one is an error, never "all fill
  value");
- the state object the commit references (sampler, generator, episode index) exists and loads,
  and so does every object of the journals it names (priorities, episode ends), at its size;
- the buffer opens read-only and, if it keeps an episode index, lists its episodes.

Things that are harmless but worth knowing go to `VerifyReport.notes`: a writer lock left
behind, orphaned temporary files (``*.partial``) of a writer killed mid-write.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer
from ..errors import CorruptBufferError, NotABufferError
from ..format import state as state_files
from ..format.codecs import Codec
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.journal import JournalRef
from ..format.keys import COMMIT_KEY, GROUP_KEY, chunk_key, read_json
from ..format.lanes import LaneLayout
from ..format.layout import ArrayMeta, buffer_codec, field_codecs, lane_rows, read_arrays
from ..format.schema import Schema
from ..io import ChunkStore, open_chunkstore
from ..io.lock import LOCK_KEY, LockInfo
from ..storage.journal import Journal, MissingObject

BATCH_CHUNKS = 256  # chunk objects fetched (and held) at once


@dataclass
class VerifyReport:
    """The outcome of `verify`. ``ok`` is True when ``problems`` is empty."""

    url: str
    ok: bool = True
    rows: int = 0
    episodes: int | None = None
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        """Record one problem (a sentence for users); the report is then not ``ok``."""
        self.problems.append(text)
        self.ok = False

    def __str__(self) -> str:
        head = (f"{self.url}: {'OK' if self.ok else 'PROBLEMS'} - {self.rows} rows, "
                f"{self.chunks_checked} chunks checked"
                + (f", {self.episodes} episodes" if self.episodes is not None else ""))
        lines = [head] + [f"  problem: {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def verify(url: str | os.PathLike, storage_options: dict | None = None) -> VerifyReport:
    """Check the buffer at ``url`` (see the module docstring). Reads every committed chunk."""
    url = os.fspath(url)
    report = VerifyReport(url)
    store = open_chunkstore(url, storage_options)
    commit_blob = store.get(COMMIT_KEY)
    if commit_blob is None:
        report.problem(f"no {COMMIT_KEY}: not a diskreplay buffer (or its creation never finished)")
        return report
    layout_and_codec = _check_metadata(store, url, report)
    if layout_and_codec is None:
        return report
    config, arrays, codec = layout_and_codec
    layout = config.layout
    try:
        commit = CommitRecord.from_bytes(commit_blob, url, layout.num_envs)
        if layout.lane_capacity is None:
            commit.check_covered(url, lane_rows(arrays))
    except CorruptBufferError as exc:
        report.problem(str(exc))
        return report
    lo, hi = layout.visible(commit.lower, commit.committed)
    report.rows = int((hi - lo).sum())
    _check_chunks(store, config.schema, layout, field_codecs(codec, config), config.chunk_key_separator, lo, hi,
                  report)
    _check_state(store, commit, report)
    _notes(store, report)
    if report.ok:
        _count_episodes(url, storage_options, report)
    return report


def _check_metadata(store: ChunkStore, url: str,
                    report: VerifyReport) -> tuple[BufferConfig, dict[str, ArrayMeta], Codec] | None:
    """The config, array metadata and codec, every problem of the metadata reported (None if any)."""
    try:
        group = read_json(store.get, GROUP_KEY, url)
        if group is None:
            report.problem(f"{GROUP_KEY} is missing")
            return None
        config = BufferConfig.from_group(group, url)
    except (CorruptBufferError, NotABufferError) as exc:
        report.problem(_without_url(exc, url))
        return None
    arrays, problems = read_arrays(store.get, url, config)
    for problem in problems:
        report.problem(problem)
    if problems:
        return None
    try:
        return config, arrays, buffer_codec(arrays, url)
    except CorruptBufferError as exc:
        report.problem(_without_url(exc, url))
        return None


def _without_url(exc: Exception, url: str) -> str:
    return str(exc).removeprefix(f"{url!r}: ")


def _check_chunks(store: ChunkStore, schema: Schema, layout: LaneLayout, codecs: dict[str, Codec], separator: str,
                  lo: np.ndarray, hi: np.ndarray, report: VerifyReport) -> None:
    work = [(lane, int(c)) for lane in range(layout.num_envs)
            for c in layout.chunks_between(int(lo[lane]), int(hi[lane]))]
    fields = list(schema.items())
    buffers = {name: np.empty((layout.chunk_rows, *f.shape), f.dtype) for name, f in fields}
    keys = [(chunk_key(name, f, lane, c, separator), name) for lane, c in work for name, f in fields]
    for start in range(0, len(keys), BATCH_CHUNKS):
        batch = keys[start:start + BATCH_CHUNKS]
        blobs = store.get_many([k for k, _ in batch])
        for (key, name), blob in zip(batch, blobs):
            report.chunks_checked += 1
            if blob is None:
                report.problem(f"chunk {key!r} is missing, but {COMMIT_KEY} says it holds rows")
                continue
            try:
                codecs[name].decode_into(blob, buffers[name])
            except Exception as exc:
                report.problem(f"chunk {key!r} does not decode to {buffers[name].nbytes} bytes ({exc})")


def _check_state(store: ChunkStore, commit: CommitRecord, report: VerifyReport) -> None:
    """The state object and every journal object the commit names exist and have their sizes."""
    key = commit.state_arrays
    arrays = {}
    if key:
        blob = store.get(key)
        if blob is None:
            report.problem(f"state object {key!r} referenced by {COMMIT_KEY} is missing")
            return
        try:
            arrays = state_files.arrays_from_bytes(blob)
        except Exception as exc:
            report.problem(f"state object {key!r} does not load ({exc})")
            return

    def read_journal(path: str, value: Any) -> None:
        Journal(store, report.url, path).read(JournalRef.from_json(path, value, commit.sequence))

    try:
        state_files.join(commit.state or {}, arrays, read_journal)
    except MissingObject as missing:
        report.problem(f"state object {str(missing)!r} referenced by {COMMIT_KEY} is missing")
    except (CorruptBufferError, ValueError, KeyError) as exc:
        what = f"state object {key!r}" if key else f"the state of commit {commit.sequence}"
        why = exc.args[0] if isinstance(exc, KeyError) else _without_url(exc, report.url)
        report.problem(f"{what} does not load ({why})")


def _notes(store: ChunkStore, report: VerifyReport) -> None:
    lock = store.get(LOCK_KEY)
    if lock is not None:
        holder = LockInfo.from_bytes(lock)
        stale = holder.stale_reason()
        report.notes.append(f"{LOCK_KEY} present: held by {holder.describe()}"
                            + (f" (stale: {stale})" if stale else ""))
    if store.supports_mmap:  # plain files: a killed writer may have left temp files
        partial = []
        for root, _, files in os.walk(store.url):
            partial += [os.path.relpath(os.path.join(root, f), store.url) for f in files if f.endswith(".partial")]
        if partial:
            report.notes.append(f"{len(partial)} orphaned temporary file(s) from an interrupted write, "
                                f"e.g. {sorted(partial)[0]!r} (harmless; safe to delete when no writer runs)")


def _count_episodes(url: str, storage_options: dict | None, report: VerifyReport) -> None:
    try:
        buf = ReplayBuffer.open(url, "r", storage_options=storage_options, cache_bytes=1)
    except Exception as exc:
        report.problem(f"the buffer does not open read-only: {type(exc).__name__}: {exc}")
        return
    try:
        if buf.episode_index.enabled:
            report.episodes = len(buf.episodes())
    except Exception as exc:
        report.problem(f"the episode index is unreadable: {type(exc).__name__}: {exc}")
    finally:
        buf.close()
