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
- the state object the commit references (sampler, generator, episode index) exists, matches
  the checksum the commit records and loads, and so does every object of the journals it names
  (priorities, episode ends), at its size and with its own checksum (buffers made before these
  checksums have none);
- the ``derive_next`` side store (``final/``) passes the same checks of its own objects;
- the buffer opens read-only and, if it keeps an episode index, lists its episodes.

A sharded buffer's root (``diskreplay_shards`` in its ``zarr.json``) has every shard it declares
checked as above (a missing one is a problem), every shard's config compared with the first's,
and ``learner.json``, if present, parsed. Each problem and note then names its shard.

Things that are harmless but worth knowing go to `VerifyReport.notes`: a writer lock left
behind, orphaned temporary files (``*.partial``) of a writer killed mid-write.
"""

from __future__ import annotations

import contextvars
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer
from ..buffer.setup import finals_url, read_sharded_root
from ..buffer.sharding import shard_link
from ..errors import CommitNotKeptError, CorruptBufferError, NotABufferError
from ..format import state as state_files
from ..format.codecs import Codec
from ..format.commit import CommitRecord
from ..format.config import BufferConfig
from ..format.journal import JournalRef
from ..format.keys import COMMIT_KEY, FINALS_DIR, GROUP_KEY, MAX_METADATA_BYTES, chunk_key, objects_prefix, read_json
from ..format.lanes import LaneLayout
from ..format.layout import ArrayMeta, buffer_codec, field_codecs, lane_rows, read_arrays
from ..format.pins import KEPT, pin_prefix
from ..format.schema import Schema
from ..format.shards import LearnerProgress, ShardedRoot, shard_name, shard_url
from ..io import ChunkStore, broken_path, objects_at, open_chunkstore
from ..io.lock import LOCK_KEY, LockInfo
from ..progress import NoBar, progress_bar
from ..storage.journal import Journal, MissingObject
from ..storage.pins import not_kept, pinned_record, read_index
from .verify_ragged import check_ragged
from .verify_tables import table_findings

BATCH_CHUNKS = 256  # chunk objects fetched (and held) at once
_BAR: contextvars.ContextVar[Any] = contextvars.ContextVar("verify_progress", default=None)


@dataclass
class VerifyReport:
    """The outcome of `verify`. ``ok`` is True when ``problems`` is empty. Of a sharded buffer:
    ``shards`` holds each shard's own report, and the counts, problems and notes are theirs
    together (each problem and note begins with the shard's name)."""

    url: str
    ok: bool = True
    rows: int = 0
    episodes: int | None = None
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    shards: list[VerifyReport] | None = None

    def problem(self, text: str) -> None:
        """Record one problem (a sentence for users); the report is then not ``ok``."""
        self.problems.append(text)
        self.ok = False

    def summary(self) -> str:
        """``OK`` or ``PROBLEMS``, then what was checked: shards, rows, chunks, episodes."""
        return (f"{'OK' if self.ok else 'PROBLEMS'} - "
                + (f"{len(self.shards)} shards, " if self.shards is not None else "")
                + f"{self.rows} rows, {self.chunks_checked} chunks checked"
                + (f", {self.episodes} episodes" if self.episodes is not None else ""))

    def __str__(self) -> str:
        lines = [f"{self.url}: {self.summary()}"]
        lines += [f"  {shard_name(s)}: {part.summary()}" for s, part in enumerate(self.shards or [])]
        lines += [f"  problem: {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def verify(url: str | os.PathLike, storage_options: dict | None = None, progress: bool = False,
           at_commit: int | str | None = None) -> VerifyReport:
    """Check the buffer at ``url``, or every shard of a sharded one (see the module docstring).
    Reads every committed chunk; ``progress``: a tqdm bar of the chunks checked on stderr (when
    tqdm is installed). ``at_commit``: check that commit instead of the newest (a sequence or a
    pin's name; a pinned one: its copy, ``pins/<n>/``, which must hold every chunk of its rows).
    Raises nothing for a damaged buffer (see the report's problems); OSError
    or StoreUnavailableError where the store cannot be read at all."""
    url = os.fspath(url)
    problem = broken_path(url)
    if problem is not None:
        report = VerifyReport(url)
        report.problem(f"not a diskreplay buffer ({problem})")
        return report
    with progress_bar(None, "verify", progress, unit=" chunks") as bar:
        token = _BAR.set(bar)
        try:
            return _verify(url, storage_options, at_commit)
        finally:
            _BAR.reset(token)


def _verify(url: str, storage_options: dict | None, at_commit: int | str | None) -> VerifyReport:
    report = VerifyReport(url)
    store = open_chunkstore(url, storage_options)
    try:
        root = read_sharded_root(store, url)
    except CorruptBufferError as exc:
        report.problem(_without_url(exc, url))
        return report
    if root is not None and at_commit is not None:
        report.problem(f"a sharded buffer has no commit {at_commit!r} of its own (its shards commit on their own): "
                       f"verify a shard's location at_commit")
    elif root is not None:
        _verify_shards(store, url, root, storage_options, report)
    else:
        _verify_buffer(store, url, storage_options, report, at_commit)
    return report


def _verify_buffer(store: ChunkStore, url: str, storage_options: dict | None,
                   report: VerifyReport, at_commit: int | str | None = None) -> BufferConfig | None:
    """Check the buffer (not sharded) in ``store`` (at its newest commit, or ``at_commit``); its
    config, or None when the metadata or the commit is missing or unusable."""
    checked = _verify_objects(store, url, report, at_commit)
    if checked is None:
        return None
    config, objects = checked
    if config.derive_next:
        _verify_side_store(url, storage_options, report)
    _notes(store, objects, report)
    if report.ok:
        _count_episodes(url, storage_options, report, at_commit)
    return config


def _verify_shards(store: ChunkStore, url: str, root: ShardedRoot, storage_options: dict | None,
                   report: VerifyReport) -> None:
    """Check each of the ``count`` shards under ``url`` (``store``: the root's), their configs
    against the first usable one's, and ``learner.json``; ``report`` gets the shards' together."""
    report.shards = []
    first: tuple[str, dict[str, Any]] | None = None
    count = root.count
    for shard in range(count):
        part, config = _verify_shard(url, shard, count, storage_options)
        report.shards.append(part)
        if config is not None and first is None:
            first = (shard_name(shard), config.to_json())
        elif config is not None and first is not None and config.to_json() != first[1]:
            differ = [key for key, value in config.to_json().items() if first[1].get(key) != value]
            part.problem(f"its config differs from {first[0]}'s ({', '.join(differ)})")
        _merge(report, part, shard_name(shard))
    episodes = [part.episodes for part in report.shards]
    report.episodes = None if None in episodes else sum(e or 0 for e in episodes)
    _check_learner(store, url, root, report)


def _verify_shard(url: str, shard: int, count: int,
                  storage_options: dict | None) -> tuple[VerifyReport, BufferConfig | None]:
    """The report of shard ``shard`` of the ``count`` under ``url``, and its config (None if
    unusable). A shard with no object at all is reported missing."""
    part_url = shard_url(url, shard)
    part = VerifyReport(part_url)
    link = shard_link(url, shard)
    if link is not None:
        part.problem(f"the shard {link}")
        return part, None
    store = open_chunkstore(part_url, storage_options)
    if not store.exists(GROUP_KEY) and not store.sizes():
        part.problem(f"the shard is missing ({url!r} declares {count} shards; {shard_name(shard)}/ holds nothing)")
        return part, None
    return part, _verify_buffer(store, part_url, storage_options, part)


def _merge(report: VerifyReport, part: VerifyReport, name: str) -> None:
    """Add shard ``name``'s report ``part`` to the sharded buffer's ``report``."""
    report.rows += part.rows
    report.chunks_checked += part.chunks_checked
    for problem in part.problems:
        report.problem(f"{name}: {_without_url_text(problem, part.url)}")
    report.notes += [f"{name}: {note}" for note in part.notes]


def _check_learner(store: ChunkStore, url: str, root: ShardedRoot, report: VerifyReport) -> None:
    """``learner.json`` of the sharded buffer at ``url`` (``store``: its root's), if present,
    parses (`LearnerProgress`)."""
    blob = store.get(root.learner_key, limit=MAX_METADATA_BYTES + 1)
    if blob is None:
        return
    try:
        LearnerProgress.from_bytes(blob, url, root.count)
    except CorruptBufferError as exc:
        report.problem(_without_url(exc, url))


def _verify_objects(store: ChunkStore, url: str, report: VerifyReport,
                    at_commit: int | str | None = None) -> tuple[BufferConfig, ChunkStore] | None:
    """Check the metadata, commit, chunks and state of the buffer in ``store`` (its newest
    commit, or ``at_commit``: `_pinned`); its config and own objects' store, or None when the
    metadata or the commit is missing or unusable."""
    layout_and_codec = _check_metadata(store, url, report)
    if layout_and_codec is None:
        return None
    config, arrays, codec = layout_and_codec
    layout = config.layout
    objects = objects_at(store, objects_prefix(config.format))
    commit_blob = objects.get(COMMIT_KEY)
    if commit_blob is None:
        report.problem(f"no {COMMIT_KEY}: not a diskreplay buffer (or its creation never finished)")
        return None
    try:
        commit = CommitRecord.from_bytes(commit_blob, url, layout.num_envs)
        if layout.lane_capacity is None:
            commit.check_covered(url, lane_rows(arrays))
    except CorruptBufferError as exc:
        report.problem(str(exc))
        return None
    chunks, state, prefix = store, objects, ""
    if at_commit is not None:
        pinned = _pinned(objects, url, layout.num_envs, at_commit, commit, report)
        if pinned is None:
            return None
        commit, prefix = pinned
        chunks, state = (store, objects) if not prefix else (objects, objects_at(objects, prefix))
    lo, hi = layout.visible(commit.lower, commit.committed)
    report.rows = int((hi - lo).sum())
    _check_chunks(chunks, config.schema, layout, field_codecs(codec, config), config.chunk_key_separator, lo, hi,
                  report, prefix)
    if config.user_schema.ragged:
        check_ragged(chunks, config, field_codecs(codec, config), lo, hi, report)
    _check_state(state, commit, report)
    problems, notes = table_findings(objects, chunks, url, commit, layout, field_codecs(codec, config),
                                     lambda name, lane, c: prefix + chunk_key(name, config.schema[name], lane, c,
                                                                              config.chunk_key_separator))
    for problem in problems:
        report.problem(problem)
    report.notes += notes
    return config, objects


def _pinned(objects: ChunkStore, url: str, num_envs: int, at: int | str, newest: CommitRecord,
            report: VerifyReport) -> tuple[CommitRecord, str] | None:
    """Commit ``at``: the record of its kept pin and where its copy lies, or the ``newest``
    unpinned (prefix ""); None if neither (a problem reported)."""
    try:
        index = read_index(objects, url)
        pin = index.find(at)
        if pin is not None and pin.status == KEPT:
            return pinned_record(objects, url, pin, num_envs), pin_prefix(pin.commit)
        if at == newest.sequence:
            return newest, ""
        raise not_kept(url, at, index, newest.sequence)
    except (CorruptBufferError, CommitNotKeptError) as exc:
        report.problem(_without_url(exc, url))
        return None


def _verify_side_store(url: str, storage_options: dict | None, report: VerifyReport) -> None:
    """Check the ``derive_next`` side store of the buffer at ``url`` as a buffer of its own; its
    problems join ``report``'s (naming it), its chunks are counted, its rows are not."""
    side_url = finals_url(url)
    side = VerifyReport(side_url)
    store = open_chunkstore(side_url, storage_options)
    if not store.exists(GROUP_KEY) and not store.sizes():
        side.problem(f"it is missing ({FINALS_DIR}/ holds nothing)")
    else:
        _verify_objects(store, side_url, side)
    report.chunks_checked += side.chunks_checked
    for problem in side.problems:
        report.problem(f"the side store {FINALS_DIR}/ of derive_next: {problem}")


def _check_metadata(store: ChunkStore, url: str,
                    report: VerifyReport) -> tuple[BufferConfig, dict[str, ArrayMeta], Codec] | None:
    """The config, array metadata and codec, every problem of the metadata reported (None if any)."""
    try:
        group = read_json(store.get, GROUP_KEY, url)
        if group is None:
            report.problem(f"no {GROUP_KEY}: not a diskreplay buffer (or its creation never finished)")
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
    """The message of ``exc`` without the leading ``'url': `` of diskreplay's errors."""
    return _without_url_text(str(exc), url)


def _without_url_text(text: str, url: str) -> str:
    return text.removeprefix(f"{url!r}: ")


def _check_chunks(store: ChunkStore, schema: Schema, layout: LaneLayout, codecs: dict[str, Codec], separator: str,
                  lo: np.ndarray, hi: np.ndarray, report: VerifyReport, prefix: str = "") -> None:
    """Every chunk holding steps ``[lo, hi)`` (per lane) exists and decodes (``prefix``: of
    their keys in ``store``: a pin's copy)."""
    work = [(lane, int(c)) for lane in range(layout.num_envs)
            for c in layout.chunks_between(int(lo[lane]), int(hi[lane]))]
    fields = list(schema.items())
    buffers = {name: np.empty((layout.chunk_rows, *f.shape), f.dtype) for name, f in fields}
    keys = [(prefix + chunk_key(name, f, lane, c, separator), name) for lane, c in work for name, f in fields]
    bar = _BAR.get()
    bar = NoBar() if bar is None else bar
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
        bar.update(len(batch))


def _check_state(store: ChunkStore, commit: CommitRecord, report: VerifyReport) -> None:
    """The state object and every journal object the commit names exist, have their sizes and
    pass their checksums."""
    key = commit.state_arrays
    arrays = {}
    if key:
        blob = store.get(key)
        if blob is None:
            report.problem(f"state object {key!r} referenced by {COMMIT_KEY} is missing")
            return
        try:
            commit.check_state_object(blob, report.url)
            arrays = state_files.arrays_from_bytes(blob)
        except CorruptBufferError as exc:
            report.problem(_without_url(exc, report.url))
            return
        except Exception as exc:
            report.problem(f"state object {key!r} does not load ({exc})")
            return

    def read_journal(path: str, value: Any) -> None:
        ref = JournalRef.from_json(path, value, commit.sequence)
        try:
            Journal(store, report.url, path).read(ref)
        except CorruptBufferError as exc:  # an object of the journal: named in the message
            report.problem(_without_url(exc, report.url))

    try:
        state_files.join(commit.state or {}, arrays, read_journal)
    except MissingObject as missing:
        report.problem(f"state object {str(missing)!r} referenced by {COMMIT_KEY} is missing")
    except (CorruptBufferError, ValueError, KeyError) as exc:
        what = f"state object {key!r}" if key else f"the state of commit {commit.sequence}"
        why = exc.args[0] if isinstance(exc, KeyError) else _without_url(exc, report.url)
        report.problem(f"{what} does not load ({why})")


def _notes(store: ChunkStore, objects: ChunkStore, report: VerifyReport) -> None:
    try:
        report.notes += read_index(objects, report.url).describe_unfinished()
    except CorruptBufferError as exc:
        report.problem(_without_url(exc, report.url))
    lock = objects.get(LOCK_KEY)
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


def _count_episodes(url: str, storage_options: dict | None, report: VerifyReport,
                    at_commit: int | str | None = None) -> None:
    try:
        buf = ReplayBuffer.open(url, "r", storage_options=storage_options, cache_bytes=1, at_commit=at_commit)
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
