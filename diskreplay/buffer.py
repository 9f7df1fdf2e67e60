"""`ReplayBuffer`: storage + sampler + a random generator, and the public API around them."""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import time
from typing import Any, Mapping

import numpy as np

from . import snapshot, zarr_layout
from .chunkstore import RetryPolicy, is_local, local_path, open_chunkstore
from .commit import COMMIT_KEY, Commit
from .episodes import HER, EpisodeIndex, EpisodeTable, EpisodicReturn, RowView, derived_next_fields
from .episodes import transforms as transitions
from .errors import (BufferExistsError, ClosedError, CorruptBufferError, EmptyBufferError, NotABufferError,
                     SchemaError, StaleReadError)
from .lanes import is_empty, row_ids, split_row_ids
from .lock import check_unlocked
from .sampling import (SAMPLER_TYPES, PrioritySampler, Sampler, SliceSampler, Uniform, check_sampler_state,
                       load_sampler_state, sampler_from_state)
from .schema import Field, Schema
from .storage import DEFAULT_CACHE_BYTES, Storage, default_chunk_rows, output_rows, physical_memory

BATCH_EXTRAS = {"index": Field((), "int64"), "weight": Field((), "float32")}
"""Arrays a batch holds besides the fields, which ``out=`` may also provide."""
FINALS_CHUNK_ROWS = 64
FINALS_CACHE_BYTES = 32 * 2**20
STATE_ATTEMPTS = 10
STALE_READ_PAUSE_S = 0.002


class ReplayBuffer:
    """A replay buffer whose rows live in a Zarr v3 group on disk or any fsspec URL.

    Rows are identified by *row ids*: ``step * num_envs + lane``, where ``step`` counts every step
    ever added to that env lane. With one lane, row id ``i`` is the ``i``-th row ever added. In a
    ring (``capacity`` set) a row id stays valid until its row is overwritten; reading an
    overwritten id raises IndexError. Use `create` or `open` to get one.
    """

    def __init__(self, storage: Storage, sampler: Sampler, rng: np.random.Generator,
                 finals: Storage | None = None, retry: RetryPolicy | None = None):
        """Internal: use `create` (a new buffer) or `open` (an existing one).

        Raises TypeError when called as ``ReplayBuffer(url, fields, capacity)``."""
        if not isinstance(storage, Storage):
            raise TypeError(f"ReplayBuffer({type(storage).__name__}, ...) is not how a buffer is made: use "
                            f"dr.ReplayBuffer.create(url, fields, capacity) for a new one, or "
                            f"dr.ReplayBuffer.open(url, mode) for an existing one")
        self.storage = storage
        self.sampler = sampler
        self.rng = rng
        self.retry = retry or RetryPolicy()
        config = storage.config
        self.episode_index = EpisodeIndex(storage.layout.num_envs, tuple(config.get("episode_end") or ()))
        derived = {f"next_{base}": base for base in config.get("derive_next") or ()}
        logical = dict(storage.schema.fields)
        logical.update({twin: storage.schema[base] for twin, base in derived.items()})
        spec = config.get("episodic_return")
        self.episodic_return = EpisodicReturn.from_json(spec) if spec else None
        self.view = RowView(storage, self.episode_index, Schema(logical), derived, finals, self.episodic_return)
        self._inputs = Schema({name: field for name, field in logical.items()
                               if not spec or name != spec["name"]})
        sampler.attach(storage.layout)
        self._cut: set[int] = set()
        self._garbage: list[str] = []  # state objects no commit refers to, deleted at the next flush
        self._closed = False

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def create(cls, url: str | os.PathLike, fields: Mapping[str, Field], capacity: int | None = None, *,
               num_envs: int = 1, chunk_rows: int | None = None, compression: str | None = "zstd",
               compression_level: int = 3, sampler: Sampler | None = None, seed: int | None = None,
               storage_options: dict | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
               io_threads: int | None = None, overwrite: bool = False,
               episode_end: str | tuple[str, ...] | None = "auto", derive_next: tuple[str, ...] = (),
               episodic_return: EpisodicReturn | None = None, commit: bool = True,
               memory_map: bool | None = None, break_lock: bool = False,
               retry: RetryPolicy | None = None) -> "ReplayBuffer":
        """Create an empty buffer at ``url`` (a local path, ``file://``, ``s3://``, ``memory://``...).

        Every argument is checked before anything at ``url`` is touched: a bad one raises and
        leaves an existing buffer there as it was, also with ``overwrite=True``.

        Args:
            fields: name -> `Field` (per-step shape and dtype).
            capacity: total rows kept (a ring over all lanes: ``capacity // num_envs`` per lane, must
                divide evenly); ``None`` grows without bound (dataset mode).
            num_envs: number of env lanes (at most 65,536); each is its own time-ordered stream.
            chunk_rows: steps per stored chunk (the unit of I/O and caching). ``None`` (default):
                sized by bytes, about 1 MiB per chunk of all fields (4,096 rows of small
                observations, 128 of 84x84 frames); a raw ring that would need more than 16,384
                chunk files gets longer chunks, so that every chunk stays memory-mapped (see
                `default_chunk_rows`).
            compression: ``"zstd"``, ``"lz4"`` (blosc) or ``None`` (raw chunks). Every chunk also
                carries a CRC32C checksum (zarr's ``crc32c`` codec). Compressed fields with rows
                of 1 KiB or more (images) are Zarr shards of inner chunks of about 8 KiB, each
                compressed alone, so that a sampled row is read and decoded alone.
            sampler: how `sample` picks rows; `Uniform` by default.
            seed: seed of the buffer's own ``numpy.random.Generator``.
            storage_options: passed to fsspec for remote URLs.
            cache_bytes: bound on chunks kept in RAM (bytes); a writer needs at least
                ``(2 * num_envs + 2)`` chunks for staging.
            io_threads: concurrent chunk reads/writes; default: the CPU count (at most 4) on local
                disk, 16 for remote stores (latency-bound).
            overwrite: replace an existing buffer at ``url``.
            episode_end: the bool field(s) whose OR ends an episode; ``"auto"`` takes ``done``, or
                ``terminated`` and ``truncated``, when present; ``None`` keeps no episode index.
            derive_next: fields ``f`` (e.g. ``("obs",)``) whose ``next_f`` twin is not stored but
                read from ``f`` at step t+1 of the same episode; each episode's final ``next_f`` is
                kept in a small side store. Halves the disk used by observations.
            episodic_return: store each step's discounted return-to-go as a field, computed when
                its episode ends (see `EpisodicReturn`); it is not passed to `add`/`extend`.
            commit: write the first commit now. ``False`` leaves the location unopenable until the
                first `flush` (bulk imports: an interrupted one never looks like a buffer).
            memory_map: on a local store without compression, read chunk files through memory
                maps (the OS page cache is the cache, a cold read costs pages, not whole chunks)
                instead of copying whole chunks into the chunk cache. ``None`` (default): map when
                the buffer's rows do not fit in ``cache_bytes``; rows that fit are read faster from
                the cache (huge pages), which the first read fills with every chunk at once.
            break_lock: remove any writer lock (also a live writer's) before taking it.
            retry: how remote I/O retries transient failures; ``retry.budget_s`` is a deadline
                per operation, and bounds how long `sample` keeps retrying stale reads.

        Raises:
            BufferExistsError: a buffer (or other files) exist at ``url`` and ``overwrite`` is False.
            LockedError: ``overwrite`` and a live writer holds the buffer at ``url``.
            ValueError: a non-positive or too large capacity, chunk_rows or num_envs, capacity not
                divisible by num_envs, an unknown compression or level, a ``cache_bytes`` too small
                for staging; SchemaError for bad fields (also a name a side store uses: ``state``,
                and ``final`` with ``derive_next``).
        """
        url = os.fspath(url)
        user = Schema(fields)
        end_fields = _episode_end_fields(user, episode_end)
        derived = derived_next_fields(tuple(derive_next), user.fields)
        stored = {name: field for name, field in user.items() if name not in derived}
        if (derived or episodic_return) and not end_fields:
            raise ValueError("derive_next and episodic_return need episode ends: name them with episode_end=")
        if episodic_return is not None:
            _check_episodic_return(episodic_return, user)
            stored[episodic_return.name] = episodic_return.field()
        stored_schema = Schema(stored)
        zarr_layout.check_schema_compatible(stored_schema, tuple(derived.values()))
        if chunk_rows is None:
            chunk_rows = default_chunk_rows(stored_schema, num_envs, capacity, cache_bytes, compression is None)
        lane_capacity = _lane_capacity(capacity, num_envs, chunk_rows)
        chunk_rows = min(chunk_rows, lane_capacity or chunk_rows)
        rng = np.random.default_rng(seed)
        common = dict(num_envs=num_envs, compression=compression, level=compression_level)
        options = {"episode_end": list(end_fields), "derive_next": list(derived.values()),
                   "episodic_return": episodic_return.to_json() if episodic_return else None}
        plans = [Storage.plan(url, stored_schema, lane_capacity=lane_capacity, chunk_rows=chunk_rows,
                              cache_bytes=cache_bytes, options=options, **common)]
        if derived:
            finals = Schema({base: user[base] for base in derived.values()})
            plans.append(Storage.plan(_finals_url(url), finals, lane_capacity=None, chunk_rows=FINALS_CHUNK_ROWS,
                                      cache_bytes=_finals_cache(finals, num_envs), options={}, **common))
        _check_open_options(io_threads, memory_map, retry, storage_options, sampler)
        _prepare_location(url, storage_options, overwrite, break_lock, retry)
        # the side store first: once the main commit exists, a reader finds everything it needs
        opened = [Storage.create(plan, storage_options=storage_options, io_threads=io_threads, extra={},
                                 memory_map=memory_map, break_lock=break_lock, retry=retry,
                                 commit=commit or plan is not plans[0]) for plan in reversed(plans)][::-1]
        buf = cls(opened[0], sampler or Uniform(), rng, opened[1] if derived else None, retry)
        if commit:
            buf.flush()
        return buf

    @classmethod
    def open(cls, url: str | os.PathLike, mode: str = "r", *, sampler: Sampler | None = None,
             storage_options: dict | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
             io_threads: int | None = None, memory_map: bool | None = None, break_lock: bool = False,
             retry: RetryPolicy | None = None, continue_episodes: bool = False) -> "ReplayBuffer":
        """Open an existing buffer: ``mode="r+"`` to resume writing, ``"r"`` read-only.

        The sampler and generator state saved with the last commit are restored, so a resumed run
        draws exactly what an uninterrupted one would have. ``sampler`` is only needed for sampler
        types the buffer cannot rebuild from its saved state. ``memory_map``, ``break_lock`` and
        ``retry``: as in `create`.

        Resuming after a crash: a writer lock left by a process that no longer runs on this host
        is taken over (with a warning). With ``mode="r+"``, the episode each lane had open is
        closed as truncated when that lane's next rows arrive: the episode index ends it (slices,
        n-step returns, ``derive_next`` and episodic returns stop there) and a ``truncated`` end
        field, if the buffer has one, is set on its last step; a ``done``-only buffer keeps its
        ``done`` values. The new episode never merges with the one the crash or the restart cut.
        ``continue_episodes=True`` keeps them open instead, for a writer that resumes the very
        env streams it was writing (their env state restored).

        Raises:
            NotABufferError: nothing (or something else, e.g. a plain file) is stored at ``url``.
            CorruptBufferError: the metadata, the commit record or the state object is damaged
                or contradicts the arrays (the message names the object and the field).
            LockedError: ``mode="r+"`` and another writer (alive, or on another host) holds the buffer.
            ValueError: ``mode`` is not "r" or "r+".
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        url = os.fspath(url)
        _check_open_options(io_threads, memory_map, retry, storage_options, sampler)
        options = dict(mode=mode, storage_options=storage_options, io_threads=io_threads,
                       memory_map=memory_map, break_lock=break_lock, retry=retry)
        storage = Storage.open(url, cache_bytes=cache_bytes, **options)
        finals = None
        try:
            record, state = _committed_state(storage, newest=False)
            if not record.same_as(storage.commit_record):  # a reader that raced the writer
                storage.adopt(record)
            bases = storage.config["derive_next"]
            if bases:
                finals_schema = Schema({base: storage.schema[base] for base in bases})
                finals = _open_finals(url, finals_schema, storage.layout.num_envs, options)
            buf = cls(storage, sampler or _sampler_for(storage, state), np.random.default_rng(), finals, retry)
            buf._apply_state(buf._parse_state(state, record.committed, _state_origin(url, record)), with_rng=True)
        except BaseException:
            for opened in (storage, finals):
                if opened is not None:
                    opened.close()
            raise
        if finals is not None and mode == "r+":
            finals.rewind(buf.episode_index.ended())
        if mode == "r+" and not continue_episodes:
            buf._cut = set(range(buf.num_envs))
        return buf

    # ---- properties ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Where the buffer lives: a local path or an fsspec URL (``s3://...``)."""
        return self.storage.url

    @property
    def fields(self) -> dict[str, Field]:
        """Every field a row has, derived ones included."""
        return dict(self.view.schema.fields)

    @property
    def capacity(self) -> int | None:
        """Rows the ring holds at most, over all lanes (None: a dataset that grows)."""
        cap = self.storage.layout.lane_capacity
        return None if cap is None else cap * self.num_envs

    @property
    def num_envs(self) -> int:
        """Env lanes: each has its own time axis (row id = ``step * num_envs + lane``)."""
        return self.storage.layout.num_envs

    @property
    def mode(self) -> str:
        """``"r"`` (a reader: committed rows), ``"r+"`` or ``"w"`` (the writer)."""
        return self.storage.mode

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def __len__(self) -> int:
        """Readable rows over all lanes: a writer's staged ones too, a reader's committed ones."""
        self._require_open()
        lo, hi = self.storage.window()
        return int((hi - lo).sum())

    def __repr__(self) -> str:
        if self._closed:
            return f"ReplayBuffer({self.url!r}, closed)"
        return (f"ReplayBuffer({self.url!r}, rows={len(self)}, capacity={self.capacity}, "
                f"num_envs={self.num_envs}, mode={self.mode!r})")

    def _require_open(self) -> None:
        if self._closed:
            raise ClosedError(f"buffer {self.url!r} is closed; open it again to use it")

    # ---- writing ---------------------------------------------------------------------------

    def add(self, env_ids: Any = None, **step: Any) -> None:
        """Add one step: every field given as a keyword, shaped ``field.shape``.

        With ``num_envs > 1`` each value has a leading env axis: ``(num_envs, *field.shape)``, or
        ``(len(env_ids), *field.shape)`` when ``env_ids`` names a subset of lanes. All or nothing:
        if it raises (bad input, a full disk, an unreachable store), the buffer is as before the
        call (in a ring, the oldest rows it would have overwritten may be retired).

        Raises:
            SchemaError: missing/unknown field, wrong shape, unsafe or lossy dtype, bad env_ids.
            ReadOnlyError: the buffer was opened with mode="r". ClosedError: it was closed.
            OSError / StoreUnavailableError: writing chunks failed; nothing of the call remains.
        """
        self._require_writer()
        if self.num_envs == 1 and env_ids is None:
            rows = self._inputs.rows(step, lead=())
            self._append(np.array([0]), {k: v[None, None] for k, v in rows.items()}, 1)
            return
        lanes = self._env_ids(env_ids)
        rows = self._inputs.rows(step, lead=(len(lanes),))
        self._append(lanes, {k: v[None] for k, v in rows.items()}, 1)

    def extend(self, data: Mapping[str, Any], env_ids: Any = None) -> None:
        """Add N steps at once. Each field is shaped ``(N, *field.shape)``; with several lanes,
        ``(N, num_envs or len(env_ids), *field.shape)`` (time-major). In a ring, an extend longer
        than the capacity keeps its last rows. All or nothing, as `add`.

        Raises:
            SchemaError: not a mapping, missing/unknown field, wrong shape, unsafe or lossy dtype,
                mismatched leading axes.
            ReadOnlyError: the buffer was opened with mode="r". ClosedError: it was closed.
            OSError / StoreUnavailableError: writing chunks failed; nothing of the call remains.
        """
        self._require_writer()
        if not isinstance(data, Mapping):
            raise SchemaError(f"extend expects a mapping of field name to array (fields {list(self._inputs.fields)}), "
                              f"got {type(data).__name__}")
        count = _leading(data, self._inputs)
        if self.num_envs == 1 and env_ids is None:
            rows = self._inputs.rows(data, lead=(count,))
            self._append(np.array([0]), {k: v[:, None] for k, v in rows.items()}, count)
            return
        lanes = self._env_ids(env_ids)
        rows = self._inputs.rows(data, lead=(count, len(lanes)))
        self._append(lanes, rows, count)

    def _append(self, lanes: np.ndarray, rows: dict[str, np.ndarray], count: int) -> None:
        """Store ``count`` steps of each lane, all or nothing: a failure undoes every lane."""
        finals, derived = self.view.finals, self.view.derived
        done: list[tuple[int, int, int, dict[str, np.ndarray]]] = []  # (lane, start, finals start, newest next_*)
        stored: list[tuple[int, int, int]] = []
        try:
            for j, lane in enumerate(lanes.tolist()):
                lane_rows = {k: v[:, j] for k, v in rows.items()}
                if lane in self._cut:
                    self._close_cut_episode(lane)
                if self.episodic_return is not None:  # may patch stored returns: masked until committed
                    self.episodic_return.fill(self.storage, self.episode_index, lane, lane_rows,
                                              self.episode_index.end_flags(lane_rows))
                done.append((lane, int(self.storage.total[lane]), int(finals.total[lane]) if finals else 0,
                              {twin: value[lane].copy() for twin, value in self.view.last_next.items()}
                              if derived else {}))
                first, end = self.storage.append(lane, {k: v for k, v in lane_rows.items() if k not in derived}
                                                 if derived else lane_rows, count)
                stored.append((lane, first, end))
                # all rows, also those a ring drops at once: an end just before the oldest kept step
                # tells that the kept steps start an episode
                self.episode_index.on_append(lane, end - count, lane_rows)
                self.view.record(lane, end - count, lane_rows)
            for storage in self._storages():
                if storage.sealed:
                    storage.write_sealed(durable=False)
        except BaseException:
            for lane, start, finals_start, newest in reversed(done):
                self.storage.unappend(lane, start, start + count)
                if finals is not None and finals.total[lane] > finals_start:
                    finals.unappend(lane, finals_start, int(finals.total[lane]))
                self.episode_index.rewind(lane, start)
                for twin, value in newest.items():
                    self.view.last_next[twin][lane] = value
            raise
        for lane, first, end in stored:
            self.sampler.on_append(lane, first, end)

    def _close_cut_episode(self, lane: int) -> None:
        """First rows of ``lane`` since this writer opened the buffer: end the episode the last
        writer left open, as truncated (episode index, a ``truncated`` flag, final next_* and
        returns). All or nothing."""
        last = int(self.storage.total[lane]) - 1
        ends = self.episode_index.ends(lane)
        if last >= 0 and not (len(ends) and ends[-1] == last) and self.episode_index.enabled:
            readable = last >= int(self.storage.window()[0][lane])
            if readable and self.episodic_return is not None:
                self.episodic_return.close(self.storage, self.episode_index, lane, last)
            flag = readable and "truncated" in self.episode_index.end_fields
            if flag:
                self.storage.update_rows(lane, last, {"truncated": np.ones(1, bool)})
            try:
                self.view.record_final(lane)
            except BaseException:
                if flag:  # the slot is pinned by the update above: no I/O, cannot fail
                    self.storage.update_rows(lane, last, {"truncated": np.zeros(1, bool)})
                raise
            self.episode_index.add_end(lane, last)
        self._cut.discard(lane)

    def _env_ids(self, env_ids: Any) -> np.ndarray:
        if env_ids is None:
            return np.arange(self.num_envs)
        ids = np.atleast_1d(np.asarray(env_ids))
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise SchemaError(f"env_ids: expected a 1-D array of ints, got {ids.dtype} shaped {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.num_envs)]
        if bad.size:
            raise SchemaError(f"env_ids: expected ids in [0, {self.num_envs}), got {bad.tolist()}")
        if np.unique(ids).size != ids.size:
            raise SchemaError(f"env_ids: expected distinct ids, got {ids.tolist()}")
        return ids.astype(np.int64)

    def _require_writer(self) -> None:
        self._require_open()
        self.storage._require_writable()

    def flush(self, durable: bool = True) -> None:
        """Write every staged row and commit: after it returns, a crash loses none of them.

        ``durable=True`` fsyncs data and metadata on local disk before the commit completes. If
        it raises, nothing new is committed and the rows stay staged: flush again.

        Raises:
            ReadOnlyError: the buffer was opened with mode="r". ClosedError: it was closed.
            LockedError: another writer took this buffer's lock (this one stops writing).
            OSError / StoreUnavailableError: writing failed.
        """
        self._require_writer()
        self.episode_index.prune(self.storage.window()[0])
        state_meta, arrays = snapshot.split(self._state())
        previous = self.storage.commit_record.state_arrays
        key = self.storage.put_state(snapshot.arrays_to_bytes(arrays), durable) if arrays else None
        try:
            if self.view.finals is not None:
                self.view.finals.flush(durable)
            self.storage.flush(durable, {"state": state_meta, "state_arrays": key})
        except BaseException:
            if key is not None:
                self._garbage.append(key)  # a commit may still name it if the failure hid a success
            raise
        if previous and previous != key:
            self._garbage.append(previous)
        self._collect_garbage()

    def _collect_garbage(self) -> None:
        """Delete state objects no commit refers to; a failure is retried at the next flush."""
        current = self.storage.commit_record.state_arrays
        keep = []
        for key in self._garbage:
            try:
                if key != current:
                    self.storage.delete_state(key)
            except OSError:
                keep.append(key)
        self._garbage = keep

    def refresh(self) -> bool:
        """Read-only buffers: adopt the newest commit with everything that belongs to it (rows,
        episode index, derived-field state, sampler state), all together or not at all.
        Returns True if there was a newer commit. A writer has nothing to adopt (False).

        Raises:
            CorruptBufferError: the newest commit or its state object is damaged (nothing changed).
            ClosedError: the buffer was closed.
        """
        self._require_open()
        if self.mode != "r":
            return False
        record, state = _committed_state(self.storage, newest=True)
        if record.same_as(self.storage.commit_record):
            return False
        finals_record = self.view.finals.read_commit() if self.view.finals is not None else None
        parsed = self._parse_state(state, record.committed, _state_origin(self.url, record))
        committed, last_ends = self.storage.committed.copy(), self.episode_index.last_ends()
        self.storage.adopt(record)
        if finals_record is not None:
            self.view.finals.adopt(finals_record)
        self._apply_state(parsed, with_rng=False)
        if self.episodic_return is not None:
            self._forget_patched_returns(committed, last_ends)
        return True

    def _forget_patched_returns(self, committed: np.ndarray, last_ends: np.ndarray) -> None:
        """After adopting a commit: the writer patched the returns of the steps of every episode
        that ended since (from just after the lane's previous end): cached copies are stale."""
        newest = self.episode_index.last_ends()
        for lane, (hi, last) in enumerate(zip(committed.tolist(), last_ends.tolist())):
            if newest[lane] > last:
                self.storage.forget_cached(lane, last + 1, hi)

    # ---- reading ---------------------------------------------------------------------------

    def sample(self, batch_size: int, *, seed: int | None = None, rng: np.random.Generator | None = None,
               seq_len: int | None = None, pad: bool = False, n_step: int | None = None,
               gamma: float = 0.99, stack: int | None = None, stack_fields: tuple[str, ...] = ("obs",),
               her: HER | None = None, out: dict[str, np.ndarray] | None = None, beta: float | None = None,
               recent_rows: int | None = None, **options: Any) -> dict[str, np.ndarray]:
        """A minibatch: ``{field: array [batch_size, *shape], "index": int64 row ids}``.

        Rows come from the buffer's sampler (uniform with replacement by default) over every row
        added so far, staged or committed (read-only buffers: committed rows). Random choices
        use ``rng``, else a generator seeded with ``seed``, else the buffer's own generator.
        Prioritized samplers add ``"weight"`` (float32 importance weights) and take ``beta=``
        (default: the sampler's). ``recent_rows=c`` (Uniform) draws from the newest ``c`` rows
        only (ERE). Other keyword ``options`` go to a sampler of your own.

        Trajectory slices: ``seq_len=L`` returns arrays ``[batch_size, L, *shape]`` of consecutive
        steps of one lane inside one episode, ``"index"`` ``[batch_size, L]`` and ``"start"`` (row
        id of each first step). Without ``pad``, only windows that fit wholly inside an episode
        are drawn (uniformly over such windows; episodes shorter than L are skipped). With
        ``pad=True`` any readable step may start a slice; steps past the episode end repeat its
        last step and ``"mask"`` ``[batch_size, L]`` is False there. With a prioritized sampler
        a slice's priority is its start row's.

        n-step returns: ``n_step=n, gamma=g`` replaces ``reward`` with the discounted sum of up to
        n rewards inside the episode, every ``next_*`` field with its value at the last step used
        (t+k-1), and adds ``"discount"`` = g^k * (1 - terminated) (a truncation bootstraps).
        Frame stacking: ``stack=k`` returns each of ``stack_fields`` (and its ``next_`` twin) as
        ``[batch_size, k, *shape]``, repeating the episode's first frame before its start.
        ``her=dr.HER(...)`` relabels goals from the same episode (see `HER`).

        ``out={name: array}``: preallocated C-contiguous arrays ``[batch_size, *shape]`` for some
        of the fields (and ``"index"``, ``"weight"``), e.g. views of a pinned host buffer: rows are
        gathered straight into them, and they are the arrays returned under those names. Plain
        transitions only (not with seq_len, n_step, stack or her).

        A reader whose rows the writer overwrote meanwhile (a ring) adopts the newest commit and
        draws again, until it succeeds or ``retry.budget_s`` seconds have passed; so does a reader
        whose commit retired every row (its writer is mid-way round the ring), waiting for rows.

        Raises:
            ValueError: batch_size <= 0 or a batch larger than this machine's memory; ``out`` with
                a name, dtype or shape that does not fit, or combined with seq_len/n_step/stack/her.
            EmptyBufferError: the buffer holds no rows (a reader: none for ``retry.budget_s`` s).
            StaleReadError: the writer kept overwriting the rows drawn for ``retry.budget_s`` s.
            ClosedError: the buffer was closed.
        """
        self._require_open()
        _check_batch_size(batch_size, self.view.schema.row_bytes)
        if out is not None:
            if seq_len is not None or n_step is not None or stack is not None or her is not None:
                raise ValueError("out= works for plain transitions only, not with seq_len, n_step, stack or her")
            self._check_out(out, int(batch_size))
        if rng is None:
            rng = self.rng if seed is None else np.random.default_rng(seed)
        options.update({k: v for k, v in (("beta", beta), ("recent_rows", recent_rows)) if v is not None})
        deadline = None
        while True:
            try:
                return self._sample_once(rng, int(batch_size), seq_len, pad, n_step, gamma, stack,
                                         stack_fields, her, out, options)
            except (StaleReadError, EmptyBufferError) as exc:
                if isinstance(exc, EmptyBufferError) and not self._behind_writer():
                    raise
                deadline = deadline if deadline is not None else time.monotonic() + self.retry.budget_s
                if time.monotonic() > deadline:
                    raise
                self._catch_up(deadline)

    def _behind_writer(self) -> bool:
        """A reader whose commit holds rows, every one retired by a writer going round its ring."""
        return self.mode == "r" and bool(self.storage.committed.any()) and len(self) == 0

    def _catch_up(self, deadline: float) -> None:
        """Reader behind its writer: adopt the newest commit; if that retired every row (the
        writer is mid-way round its ring), wait for rows until ``deadline``."""
        self.refresh()
        while len(self) == 0 and time.monotonic() < deadline:
            time.sleep(STALE_READ_PAUSE_S)
            self.refresh()

    def _sample_once(self, rng, batch_size, seq_len, pad, n_step, gamma, stack, stack_fields, her, out, options):
        lo, hi = self.storage.window()
        if is_empty(lo, hi):  # also a reader whose newest commit retired all its rows
            hint = "" if self.mode != "r" else "; a writer's rows become readable when it calls flush()"
            raise EmptyBufferError(f"cannot sample from an empty buffer ({self.url!r} holds 0 readable rows{hint})")
        if seq_len is not None:
            return self._sample_slices(rng, int(batch_size), seq_len, pad, lo, hi, options)
        if options:
            _check_options(self.sampler, options)
        draw = self.sampler.sample(rng, batch_size, lo, hi, **options)
        batch = self.view.gather(draw.lane, draw.step, self._unstacked(stack, stack_fields), out=out)
        if n_step is not None or stack is not None or her is not None:
            self._transform(batch, draw, rng, lo, hi, n_step, gamma, stack, stack_fields, her)
        batch["index"] = row_ids(draw.lane, draw.step, self.num_envs)
        if draw.weight is not None:
            batch["weight"] = draw.weight
        if draw.extra:
            batch.update(draw.extra)
        return batch if out is None else _placed(batch, out)

    def _unstacked(self, stack: int | None, stack_fields: tuple[str, ...]) -> tuple[str, ...] | None:
        """The fields a batch gathers before its frame stacks replace the stacked ones (None: all).

        Raises ValueError naming a stack field the buffer does not have."""
        if stack is None:
            return None
        fields = self.view.schema.fields
        for name in stack_fields:
            if name not in fields:
                raise ValueError(f"stack_fields: {name!r} is not a field; the buffer has {list(fields)}")
        stacked = {*stack_fields, *(f"next_{name}" for name in stack_fields)}
        return tuple(name for name in fields if name not in stacked)

    def _transform(self, batch, draw, rng, lo, hi, n_step, gamma, stack, stack_fields, her) -> None:
        """Relabel goals (HER), n-step returns, frame stacks: in place, in that order."""
        if not self.episode_index.enabled:
            raise ValueError("n_step, stack and her need episode ends: create the buffer with episode_end=")
        if her is not None and n_step is not None:
            raise ValueError("her and n_step cannot be combined: n-step rewards would ignore the relabelled goals")
        if her is not None:
            her.relabel(batch, self.view, self.episode_index, draw.lane, draw.step, lo, hi, rng)
        if n_step is not None:
            stacked = tuple(f"next_{name}" for name in stack_fields) if stack is not None else ()
            batch.update(transitions.nstep(self.view, self.episode_index, draw.lane, draw.step, hi, n_step, gamma,
                                           left_out=stacked))
        if stack is not None:
            next_step = None
            if n_step is not None:  # the next_ stack belongs to the last step of the n-step window
                next_step = np.minimum(draw.step + n_step - 1, transitions.episode_last_step(
                    self.episode_index, draw.lane, draw.step, hi))
            batch.update(transitions.frame_stack(self.view, self.episode_index, draw.lane, draw.step, lo,
                                                 stack, tuple(stack_fields), next_step=next_step))

    def _sample_slices(self, rng: np.random.Generator, batch_size: int, seq_len: int, pad: bool,
                       lo: np.ndarray, hi: np.ndarray, options: dict[str, Any]) -> dict[str, np.ndarray]:
        slices = SliceSampler(self.sampler, self.episode_index, seq_len, pad)
        if not self.episode_index.enabled:
            raise ValueError("seq_len needs episode ends: create the buffer with episode_end= naming a bool field")
        _check_batch_size(batch_size * seq_len, self.view.schema.row_bytes, "batch_size * seq_len")
        _check_options(self.sampler, options)
        draw = slices.sample(rng, batch_size, lo, hi, **options)
        steps, mask = slices.steps(draw, hi)
        lanes = np.repeat(draw.lane, seq_len)
        rows = self.view.gather(lanes, steps.reshape(-1))
        batch = {k: v.reshape(batch_size, seq_len, *v.shape[1:]) for k, v in rows.items()}
        batch["index"] = row_ids(lanes, steps.reshape(-1), self.num_envs).reshape(batch_size, seq_len)
        batch["start"] = row_ids(draw.lane, draw.step, self.num_envs)
        if pad:
            batch["mask"] = mask
        if draw.weight is not None:
            batch["weight"] = draw.weight
        return batch

    def as_dataset(self, batch_size: int, mode: str = "sample", **options: Any):
        """A torch ``IterableDataset`` of collated batches over this buffer's committed rows.

        ``mode="sample"``: endless batches from the buffer's sampler; ``"epoch"``: every row once
        per epoch. Options and resume semantics: `diskreplay.torch.data.make_dataset`.
        """
        from .torch.data import make_dataset

        self._require_open()
        return make_dataset(self, batch_size, mode, **options)

    def update_priorities(self, index: Any, td_errors: Any) -> int:
        """Set the priorities of rows (by row id, e.g. ``batch["index"]``) from TD errors.

        Priorities become ``(|td| + eps) ** alpha``. Ids of rows overwritten since they were
        sampled are ignored. Returns the number of rows updated.

        Raises:
            TypeError: the buffer's sampler has no priorities.
            ValueError: NaN/inf TD errors, priorities so large that their sum could overflow, or
                not one TD error per index.
            IndexError: a negative id. ClosedError: the buffer was closed.
        """
        self._require_open()
        if not _takes_priorities(type(self.sampler)):
            raise TypeError(f"update_priorities needs a prioritized sampler; this buffer uses "
                            f"{type(self.sampler).__name__}")
        ids = np.asarray(index).reshape(-1)
        if ids.dtype.kind not in "iu" or (ids < 0).any():
            raise IndexError(f"row ids must be non-negative integers, got {ids[:5]}... (dtype {ids.dtype})")
        lane, step = split_row_ids(ids.astype(np.int64), self.num_envs)
        lo, hi = self.storage.window()
        return self.sampler.update_priorities(lane, step, td_errors, lo, hi)

    def episodes(self) -> EpisodeTable:
        """Every episode with readable rows: lane, start step, length, complete (ended and its
        first step not overwritten). Rows of an episode are row ids ``(start + i) * num_envs + lane``."""
        self._require_open()
        if not self.episode_index.enabled:
            raise ValueError("this buffer keeps no episode index (created with episode_end=None)")
        return self.episode_index.table(*self.storage.window())

    def episode(self, k: int) -> dict[str, np.ndarray]:
        """The readable rows of episode ``k`` of `episodes` (negative k counts from the end)."""
        table = self.episodes()
        if not -len(table) <= k < len(table):
            raise IndexError(f"episode {k} out of range: the buffer lists {len(table)} episodes")
        lane, start, length = int(table.lane[k]), int(table.start[k]), int(table.length[k])
        steps = np.arange(start, start + length)
        rows = self._gather_or_refresh(np.full(length, lane), steps, None)
        rows["index"] = row_ids(lane, steps, self.num_envs)
        return rows

    def __getitem__(self, ids: Any) -> dict[str, np.ndarray]:
        """Rows by row id (an int or an int array): ``{field: array [*ids.shape, *shape]}``.

        Raises:
            IndexError: an id that is negative, not yet added, or already overwritten.
        """
        return self.rows(ids)

    def rows(self, ids: Any, out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """``buf[ids]``, optionally gathered straight into ``out`` (1-D ``ids``; as in `sample`).

        Raises:
            IndexError: an id that is negative, not yet added, or already overwritten
                (`StaleReadError` if the writer overwrote it after this reader's commit: the
                reader has then adopted the newest commit).
            ValueError: ``out`` with a name, dtype or shape that does not fit.
            ClosedError: the buffer was closed.
        """
        self._require_open()
        arr = np.asarray(ids)
        if out is not None:
            self._check_out(out, arr.size)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise IndexError(f"row ids must be integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
            raise IndexError(f"row id {int(arr.max())} is not in the buffer (larger than any row id)")
        flat = arr.reshape(-1).astype(np.int64)
        lane, step = split_row_ids(flat, self.num_envs)
        lo, hi = self.storage.window()
        bad = (flat < 0) | (step < lo[lane]) | (step >= hi[lane])
        if bad.any():
            first = int(flat[bad][0])
            raise IndexError(f"row id {first} is not in the buffer (readable ids per lane: steps "
                             f"{lo.tolist()} to {(hi - 1).tolist()}, id = step * {self.num_envs} + lane)")
        rows = self._gather_or_refresh(lane, step, out)
        if arr.ndim == 1:
            return rows
        return {k: v.reshape(arr.shape + v.shape[1:]) for k, v in rows.items()}

    def _gather_or_refresh(self, lane: np.ndarray, step: np.ndarray,
                           out: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        try:
            return self.view.gather(lane, step, out=out)
        except StaleReadError:
            self.refresh()  # the reader follows the newest commit, all of its state at once
            raise

    def _check_out(self, out: Mapping[str, np.ndarray], count: int) -> None:
        """Raise ValueError unless every ``out`` array fits ``count`` rows (before anything is drawn)."""
        fields = {**self.fields, **BATCH_EXTRAS}
        unknown = sorted(set(out) - set(fields))
        if unknown:
            raise ValueError(f"out: unknown names {unknown}; expected fields {sorted(self.fields)} "
                             f"or {', '.join(map(repr, BATCH_EXTRAS))}")
        for name, given in out.items():
            output_rows(name, fields[name], count, given)

    def latest(self, n: int) -> dict[str, np.ndarray]:
        """The newest ``n`` readable rows (fewer if the buffer holds fewer), oldest first:
        ``{field: array [n, *shape], "index": [n] int64 row ids}``. With several lanes, the
        rows of the ``n`` highest row ids (the newest steps, lanes side by side).

        Raises ValueError for ``n`` that is not an int >= 0; ClosedError."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        self._require_open()
        lo, hi = self.storage.window()
        ids = np.sort(np.concatenate([row_ids(lane, np.arange(max(int(lo[lane]), int(hi[lane]) - n), hi[lane]),
                                              self.num_envs) for lane in range(self.num_envs)]))
        ids = ids[max(len(ids) - n, 0):]  # each lane's newest n hold the n highest ids
        return {**self.rows(ids), "index": ids}

    def clear(self) -> None:
        """Forget every row: afterwards the buffer holds none, for this writer at once and for
        readers at the next `flush`. Row ids go on counting (an id never names two rows); each
        lane's open episode ends, cut, and the next row starts a new one. The old rows' bytes
        stay on disk until new rows overwrite them (a ring) or the buffer is deleted.

        Raises ReadOnlyError (a reader), ClosedError, LockedError."""
        self._require_writer()
        for lane in range(self.num_envs):
            if self.episode_index.enabled and int(self.storage.total[lane]):
                self._close_cut_episode(lane)
        self.storage.lower = self.storage.total.copy()
        self.episode_index.prune(self.storage.window()[0])

    def row_ids(self) -> np.ndarray:
        """Every readable row id, lane by lane in time order (int64)."""
        self._require_open()
        lo, hi = self.storage.window()
        return np.concatenate([row_ids(lane, np.arange(lo[lane], hi[lane]), self.num_envs)
                               for lane in range(self.num_envs)])

    # ---- state -----------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "sampler": self.sampler.state_dict(),
                "episodes": self.episode_index.state_dict(), "last_next": self.view.state_dict()}

    def _parse_state(self, state: Mapping[str, Any], total: np.ndarray, origin: str | None) -> dict[str, Any]:
        """``state`` checked against this buffer holding ``total`` steps per lane (every part,
        before any is used).

        Raises CorruptBufferError naming ``origin`` (the file it was read from), the part and what
        is wrong; ``ValueError`` for a state the caller gave (``origin=None``)."""
        if not state:
            return {}
        try:
            if not isinstance(state, Mapping):
                raise ValueError(f"expected a mapping, got {type(state).__name__}")
            for part in ("rng", "sampler", "episodes"):
                if part not in state:
                    raise ValueError(f"{part!r} is missing")
            _check_rng_state(state["rng"])
            check_sampler_state(self.sampler, state["sampler"], self.storage.layout, total)
            self.episode_index.check_state(state["episodes"], total)
            self.view.check_state(state.get("last_next") or {})
        except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
            if origin is None:
                raise ValueError(f"state for {self.url!r} does not fit this buffer: {exc}") from None
            raise CorruptBufferError(f"{origin}: {exc}") from None
        return dict(state)

    def _apply_state(self, state: Mapping[str, Any], with_rng: bool) -> None:
        """Load a state checked by `_parse_state` (nothing here can fail on its content)."""
        if not state:
            return
        if with_rng:
            self.rng.bit_generator.state = state["rng"]
        load_sampler_state(self.sampler, state["sampler"])
        self.episode_index.load_state_dict(state["episodes"])
        if state.get("last_next"):
            self.view.load_state_dict(state["last_next"])

    def state_dict(self) -> dict[str, Any]:
        """The small in-RAM state: cursors per lane, the generator and the sampler's state."""
        self._require_open()
        return {**self._state(), "total": self.storage.total.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore generator and sampler state saved by `state_dict` from this same buffer.

        Raises:
            ValueError: the state's cursors differ from the buffer's (rows were added or lost
                since), or any part of it does not fit this buffer (nothing is loaded then).
        """
        self._require_open()
        self._load_state(state, origin=None)

    def _load_state(self, state: Mapping[str, Any], origin: str | None) -> None:
        if not isinstance(state, Mapping) or "total" not in state:
            raise ValueError("state: expected the mapping ReplayBuffer.state_dict() returns (with 'total')")
        total = np.asarray(state["total"])
        if total.shape != self.storage.total.shape or not np.array_equal(total, self.storage.total):
            raise ValueError(f"state is for a buffer with {total.tolist()} steps per lane; this buffer "
                             f"has {self.storage.total.tolist()}")
        parts = {k: v for k, v in state.items() if k != "total"}
        self._apply_state(self._parse_state(parts, self.storage.total, origin), with_rng=True)

    def save_snapshot(self, directory: str | os.PathLike) -> None:
        """Write `state_dict` to ``directory``: ``state.safetensors`` (arrays) + ``state.json``."""
        state = self.state_dict()  # raises ClosedError before anything is written
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        meta, arrays = snapshot.split(state)
        with open(os.path.join(directory, "state.safetensors"), "wb") as f:
            f.write(snapshot.arrays_to_bytes(arrays))
        with open(os.path.join(directory, "state.json"), "w") as f:
            json.dump({"url": self.url, "state": meta}, f)

    @classmethod
    def load_snapshot(cls, directory: str | os.PathLike, mode: str = "r+", *, url: str | None = None,
                      **open_options: Any) -> "ReplayBuffer":
        """Open the buffer a snapshot was taken of (or ``url``) and restore the snapshot's state.

        Raises:
            CorruptBufferError: the snapshot's files are unreadable or do not fit (naming the file).
            ValueError: the snapshot is of another state of the buffer (see `load_state_dict`).
        """
        directory = os.fspath(directory)
        state, saved_url = snapshot.load_directory(directory)
        buf = cls.open(url or saved_url, mode, **open_options)
        try:
            buf._load_state(state, origin=f"snapshot {directory!r} (state.json, state.safetensors)")
        except BaseException:
            buf._closed = True  # nothing was written: release without flushing
            for storage in buf._storages():
                storage.close()
            raise
        return buf

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Flush (writers) and release threads, maps and the writer lock. Idempotent. If the
        final flush fails, everything is released all the same and the error is raised."""
        if self._closed:
            return
        try:
            if self.mode != "r":
                self.flush()
        finally:
            self._closed = True
            for storage in self._storages():
                storage.close()

    def _storages(self) -> list[Storage]:
        return [self.storage] + ([self.view.finals] if self.view.finals is not None else [])

    def __enter__(self) -> "ReplayBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_rng_state(state: Any) -> None:
    """Raise ValueError naming 'rng' unless ``state`` can be loaded into a generator."""
    try:
        np.random.default_rng().bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError) as exc:
        raise ValueError(f"'rng': not a generator state ({type(exc).__name__}: {exc})") from None


def _placed(batch: dict[str, np.ndarray], out: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Copy the batch's non-field arrays (index, weight) into their ``out`` arrays, if given."""
    for name, given in (out or {}).items():
        value = batch.get(name)
        if value is None or value is given:
            continue
        if given.shape != value.shape or given.dtype != value.dtype:
            raise ValueError(f"out[{name!r}]: expected a {value.dtype} array shaped {value.shape}, "
                             f"got {given.dtype} shaped {given.shape}")
        given[...] = value
        batch[name] = given
    return batch


def _check_batch_size(batch_size: Any, row_bytes: int, name: str = "batch_size") -> None:
    """Raise ValueError for a batch size that is not a positive int or whose rows could not fit
    in this machine's memory (before anything is allocated)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"{name} must be a positive int, got {batch_size!r}")
    need = int(batch_size) * (row_bytes + 8)
    memory = physical_memory()
    if need > memory:
        raise ValueError(f"{name}={int(batch_size):,} needs {need:,} bytes for one batch ({row_bytes + 8} per "
                         f"row), more than this machine's {memory:,} bytes of memory")


@functools.lru_cache(maxsize=None)
def _takes_priorities(sampler_type: type) -> bool:
    """Whether a sampler class satisfies `PrioritySampler` (checked once per class: the
    protocol check costs microseconds)."""
    return issubclass(sampler_type, PrioritySampler)


def _check_options(sampler: Sampler, options: Mapping[str, Any]) -> None:
    """Raise ValueError for a sampling option the sampler does not take, or a bad ``beta``."""
    taken = _sampling_options(type(sampler))
    unknown = [] if taken is None else sorted(set(options) - set(taken))
    if unknown:
        raise ValueError(f"{type(sampler).__name__} takes no sampling option {', '.join(map(repr, unknown))} "
                         f"(its options: {', '.join(taken) or 'none'})")
    _check_beta(options)


@functools.lru_cache(maxsize=None)
def _sampling_options(sampler_type: type) -> tuple[str, ...] | None:
    """The keyword options a sampler class's ``sample`` takes (None: any, it has ``**options``)."""
    params = list(inspect.signature(sampler_type.sample).parameters.values())[5:]  # self, rng, size, lo, hi
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params)


def _check_beta(options: Mapping[str, Any]) -> None:
    beta = options.get("beta")
    if beta is not None and (isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating))
                             or not math.isfinite(beta) or beta < 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")


SAMPLER_METHODS = ("attach", "on_append", "sample", "state_dict", "load_state_dict")


def _check_open_options(io_threads: Any, memory_map: Any, retry: Any, storage_options: Any,
                        sampler: Any = None) -> None:
    """Raise ValueError naming the first option of `create`/`open` that is not usable."""
    if io_threads is not None and (isinstance(io_threads, bool) or not isinstance(io_threads, (int, np.integer))
                                   or not 1 <= io_threads <= 256):
        raise ValueError(f"io_threads must be None or an int in [1, 256], got {io_threads!r}")
    if memory_map not in (None, True, False):
        raise ValueError(f"memory_map must be None, True or False, got {memory_map!r}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ValueError(f"retry must be a dr.RetryPolicy or None, got {type(retry).__name__}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ValueError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
    missing = [m for m in SAMPLER_METHODS if not callable(getattr(sampler, m, None))]
    if sampler is not None and missing:
        raise ValueError(f"sampler must be a dr.Sampler (dr.Uniform(), dr.Prioritized(), ...), got "
                         f"{type(sampler).__name__} without {missing}")


def _lane_capacity(capacity: int | None, num_envs: int, chunk_rows: int) -> int | None:
    if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or not 1 <= num_envs <= zarr_layout.MAX_LANES:
        raise ValueError(f"num_envs must be an int in [1, {zarr_layout.MAX_LANES}], got {num_envs!r}")
    if (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer))
            or not 1 <= chunk_rows <= zarr_layout.MAX_CHUNK_ROWS):
        raise ValueError(f"chunk_rows must be an int in [1, {zarr_layout.MAX_CHUNK_ROWS}], got {chunk_rows!r}")
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
    if capacity % num_envs:
        raise ValueError(f"capacity must be a multiple of num_envs={num_envs}, got {capacity}")
    lane_capacity = int(capacity // num_envs)
    chunks = num_envs * -(-lane_capacity // min(chunk_rows, lane_capacity))
    if lane_capacity > zarr_layout.MAX_STEPS or chunks > zarr_layout.MAX_CHUNKS:
        raise ValueError(f"capacity={capacity:,} with chunk_rows={chunk_rows} needs {chunks:,} chunks; at most "
                         f"{zarr_layout.MAX_CHUNKS:,} are kept: raise chunk_rows")
    return lane_capacity


def _leading(data: Mapping[str, Any], schema: Schema) -> int:
    """N, the steps in an extend: the leading size most fields with a step axis agree on."""
    sizes = {name: int(np.shape(data[name])[0]) for name, field in schema.items()
             if name in data and np.ndim(data[name]) > len(field.shape)}
    if not sizes:
        raise SchemaError(f"extend expects arrays with a leading step axis (N, *field.shape); got shapes "
                          f"{ {name: np.shape(value) for name, value in data.items()} }")
    counts = list(sizes.values())
    return max(counts, key=counts.count)  # the odd field out is then named by the schema check


def _prepare_location(url: str, storage_options: dict | None, overwrite: bool, break_lock: bool,
                      retry: RetryPolicy | None) -> None:
    """Make ``url`` ready for a new buffer: refuse an existing one unless ``overwrite`` (and never
    delete what is not a buffer, or one a live writer holds), then remove it (retried remotely)."""
    store = open_chunkstore(url, storage_options, retry=retry)
    if is_local(url):
        path = local_path(url)
        if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
            return
        if not overwrite:
            raise BufferExistsError(f"{url!r} already exists; pass overwrite=True to replace it")
        _require_buffer_or_empty(path)
    elif store.exists(COMMIT_KEY) or store.exists(zarr_layout.GROUP_KEY):
        if not overwrite:
            raise BufferExistsError(f"{url!r} already holds a buffer; pass overwrite=True to replace it")
    else:
        return
    check_unlocked(url, storage_options, break_lock)
    store.clear()


def _require_buffer_or_empty(path: str) -> None:
    if not os.path.isdir(path) or (not os.path.exists(os.path.join(path, COMMIT_KEY))
                                   and not os.path.exists(os.path.join(path, zarr_layout.GROUP_KEY))):
        raise BufferExistsError(f"{path!r} exists and is not a diskreplay buffer; refusing to delete it")


def _committed_state(storage: Storage, newest: bool) -> tuple[Commit, dict[str, Any]]:
    """A commit and the state saved with it (empty for a new buffer): the storage's own commit,
    or (``newest``) the store's newest.

    A reader may race the writer: the commit it read names a state object the writer has since
    replaced. It then reads the newer commit and that one's state.

    Raises CorruptBufferError: the state object is missing or unreadable (naming it).
    """
    record = storage.read_commit() if newest else storage.commit_record
    for attempt in range(STATE_ATTEMPTS):
        if attempt:
            record = storage.read_commit()
        key = record.state_arrays
        if "state" not in record.extra:
            return record, {}
        blob = storage.get_state(key) if key else b""
        if blob is not None:
            try:
                arrays = snapshot.arrays_from_bytes(blob) if key else {}
                return record, snapshot.join(record.extra["state"], arrays)
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptBufferError(f"{storage.url!r}: state object {key!r} does not load ({exc})") from None
        if storage.mode != "r":
            break
    raise CorruptBufferError(f"{storage.url!r}: state object {key!r} is missing (the last commit names it)")


def _state_origin(url: str, record: Commit) -> str:
    """How errors name the state saved with a commit."""
    return f"{url!r}: the state object {record.state_arrays!r} of commit {record.sequence}"


def _sampler_for(storage: Storage, state: Mapping[str, Any]) -> Sampler:
    """The sampler a buffer was saved with (raises CorruptBufferError for unreadable settings)."""
    saved = state.get("sampler")
    if isinstance(saved, dict) and saved.get("type") not in SAMPLER_TYPES:
        return sampler_from_state(saved)  # ValueError: a sampler type of the user's, pass sampler=
    try:
        if saved is not None and not isinstance(saved, dict):
            raise TypeError(f"expected an object, got {type(saved).__name__}")
        return sampler_from_state(saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptBufferError(f"{storage.url!r}: {COMMIT_KEY} field 'extra.state.sampler' (commit "
                                 f"{storage.commit_record.sequence}): the saved sampler settings are unreadable "
                                 f"({exc})") from None


def _episode_end_fields(schema: Schema, episode_end: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if episode_end is None:
        return ()
    if episode_end == "auto":
        names = ("done",) if "done" in schema.fields else ("terminated", "truncated")
        return tuple(n for n in names if n in schema.fields and schema[n].dtype == np.bool_ and schema[n].shape == ())
    names = (episode_end,) if isinstance(episode_end, str) else tuple(episode_end)
    for name in names:
        if name not in schema.fields or schema[name].dtype != np.bool_ or schema[name].shape != ():
            raise SchemaError(f"episode_end: expected scalar bool fields, got {name!r} "
                              f"({schema.fields.get(name)})")
    return names


def _finals_url(url: str) -> str:
    """Where a buffer with ``derive_next`` keeps each episode's final next observation."""
    return f"{url.rstrip('/')}/{zarr_layout.FINALS_DIR}"


def _open_finals(url: str, schema: Schema, num_envs: int, options: dict[str, Any]) -> Storage:
    try:
        return Storage.open(_finals_url(url), cache_bytes=_finals_cache(schema, num_envs), **options)
    except (NotABufferError, CorruptBufferError) as exc:
        raise CorruptBufferError(f"{url!r}: the side store {zarr_layout.FINALS_DIR}/ of derive_next, which "
                                 f"holds each episode's final {', '.join(schema.fields)}, is missing or damaged "
                                 f"({exc})") from None


def _finals_cache(schema: Schema, num_envs: int) -> int:
    """The side store's chunk cache: its default, or what staging needs if that is more."""
    return max(FINALS_CACHE_BYTES, (2 * num_envs + 2) * FINALS_CHUNK_ROWS * schema.row_bytes)


def _check_episodic_return(spec: EpisodicReturn, user: Schema) -> None:
    if spec.name in user.fields:
        raise SchemaError(f"episodic_return: field {spec.name!r} is computed by the buffer; "
                          f"remove it from fields or choose another name")
    if spec.reward not in user.fields or user[spec.reward].shape != ():
        raise SchemaError(f"episodic_return: expected a scalar reward field {spec.reward!r}, "
                          f"got {user.fields.get(spec.reward)}")
