"""`ReplayBuffer`: storage + sampler + episode index + a random generator, and the public API."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checks import check_int
from ..episodes import HER, EpisodeTable, EpisodicReturn, row_view
from ..errors import ClosedError
from ..format.lanes import LaneLayout, row_ids
from ..format.schema import Field
from ..io import RetryPolicy
from ..io.lock import check_lease
from ..sampling import Sampler, Uniform
from ..storage import DEFAULT_CACHE_BYTES, Options, Storage, StorageStats
from . import snapshot
from .appending import Appender
from .batches import (
    Batches,
    batch_generators,
    call_generator,
    check_batch_size,
    check_out,
    plain_request,
    sample_request,
    split_batches,
    takes_priorities,
)
from .learner import LearnerRank, ShardCommits
from .output_format import output_converter
from .parts import BufferOpening, LearnerOpening
from .pinning import Pinning
from .rate_limit import LearnerGate, RateLimiter
from .row_lookup import locate, newest_ids, readable_ids, readable_lane_steps, sampled_lane_steps
from .setup import check_open_options, close_all, create_storages, plan_buffer, prepare_location
from .sharding import create_sharded, open_buffer, open_writer
from .token_draws import token_request

if TYPE_CHECKING:
    from ..torch.datasets import EpochDataset, SampleDataset

Rows = dict[str, np.ndarray]


class ReplayBuffer(Pinning):
    """A replay buffer whose rows live in a Zarr v3 group on disk or any fsspec URL.

    Rows are identified by *row ids*: ``step * num_envs + lane``, where ``step`` counts every step
    ever added to that env lane. With one lane, row id ``i`` is the ``i``-th row ever added. In a
    ring (``capacity`` set) a row id stays valid until its row is overwritten; reading an
    overwritten id raises IndexError. Use `create` or `open` to get one.
    """

    def __init__(self, opening: BufferOpening | LearnerOpening, sampler: Sampler, rng: np.random.Generator,
                 retry: RetryPolicy | None = None):
        """Internal: use `create` (a new buffer) or `open` (an existing one). ``opening``: what its
        factory computed (storages, saved state, rate limits), all of it used here.

        Raises TypeError when called as ``ReplayBuffer(url, fields, capacity)``."""
        if not isinstance(opening, (BufferOpening, LearnerOpening)):
            raise TypeError(f"ReplayBuffer({type(opening).__name__}, ...) is not how a buffer is made: use "
                            f"dr.ReplayBuffer.create(url, fields, capacity) for a new one, or "
                            f"dr.ReplayBuffer.open(url, mode) for an existing one")
        storage, finals = opening.storage, opening.finals
        self.storage: Storage = storage
        """The `Storage` facade below this buffer (for tools: `diskreplay info`, importers)."""
        self.sampler, self.rng, self.retry = sampler, rng, retry or RetryPolicy()
        self.view = row_view(storage, storage.config, finals)
        self.episode_index, self.episodic_return = self.view.episodes, self.view.returns
        sampler.attach(storage.layout)
        hint = "" if storage.mode != "r" else "; a writer's rows become readable when it calls flush()"
        self._batches = Batches(sampler, self.view, storage.window, f"{storage.url!r} holds 0 readable rows{hint}")
        parts = opening.parts(sampler, rng, self.view, self.retry, self.flush)
        self._state, self._follower, self._appender = parts.state, parts.follower, parts.appender
        self._gate, self._actor_gate, self._finals = parts.gate, parts.actor, finals
        self._closed = False

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def create(cls, url: str | os.PathLike[str], fields: Mapping[str, Field], capacity: int | None = None, *,
               num_envs: int = 1, chunk_rows: int | None = None, compression: str | None = "zstd",
               compression_level: int | None = None, sampler: Sampler | None = None, seed: int | None = None,
               storage_options: Mapping[str, Any] | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
               io_threads: int | None = None, overwrite: bool = False,
               episode_end: str | tuple[str, ...] | None = "auto", derive_next: tuple[str, ...] = (),
               episodic_return: EpisodicReturn | None = None, commit: bool = True, memory_map: bool | None = None,
               break_lock: bool = False, retry: RetryPolicy | None = None, shards: int | None = None,
               lease_s: float | None = None, row_shards: bool = True) -> ReplayBuffer:
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
                observations, 128 of 84x84 frames), on an object store eight times that while a
                writer's staged chunks fit half of ``cache_bytes``; a raw ring that would need more than 16,384
                chunk files gets longer chunks, so that every chunk stays memory-mapped (see
                `diskreplay.storage.default_chunk_rows`).
            compression: ``"zstd"``, ``"lz4"`` (blosc), ``"lz4hc"`` (blosc LZ4-HC: 3-6x the
                encode time of ``"lz4"`` for about a quarter fewer bytes and 15-40% faster
                decodes; for datasets read many times) or ``None`` (raw chunks). Every chunk also
                carries a CRC32C checksum (zarr's ``crc32c`` codec). Compressed fields with rows
                of 1 KiB or more (images) are Zarr shards of inner chunks of about 8 KiB, each
                compressed alone, so that a sampled row is read and decoded alone.
            compression_level: the codec's level (zstd 0-22; lz4 and lz4hc 0-9, blosc's clevel).
                ``None``: 3, or 6 for lz4hc.
            sampler: how `sample` picks rows; `Uniform` by default.
            seed: seed of the buffer's own ``numpy.random.Generator``.
            storage_options: passed to fsspec for remote URLs.
            cache_bytes: bound on chunks kept in RAM (bytes); a writer needs at least
                ``(2 * num_envs + 2)`` chunks for staging. A reader whose rows fit fills it with
                every chunk behind its first read (`warm`).
            io_threads: concurrent chunk reads/writes; default: the CPU count (at most 4) on local
                disk, 16 for remote stores (latency-bound), where reading ahead keeps four times
                that many requests in flight and ranged reads of rows eight times.
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
            lease_s: the writer lock's lease in seconds (default 30), renewed every third of it
                while the buffer is open: a writer that stops renewing (killed, paused, its host
                lost) is taken over by the next writer from any host once it has expired.
            retry: how remote I/O retries transient failures; ``retry.budget_s`` is a deadline
                per operation, and bounds how long `sample` keeps retrying stale reads.
            shards: make a sharded buffer of this many shards, one per writer (actor): each is
                a buffer of ``capacity`` rows (``num_envs`` lanes) with its own writer lock and
                commits, written through `open_shard`. Returns the union of the shards, read-only
                (what `open` with ``mode="r"`` returns, with ``sampler`` and ``seed``).
            row_shards: store compressed fields of small rows as Zarr shards of inner chunks of
                about 8 KiB where a chunk holds four of them or more (the default), so that a cold
                random read (from an object store, or from disk before the cache has filled)
                costs a row its inner chunk, not its whole chunk. Decoding a whole chunk then
                costs about 1.3-1.8x the CPU of one frame (epochs, cache fills); False stores
                such chunks as one frame each. Fields of 1 KiB rows or more are sharded anyway.

        Raises:
            BufferExistsError: a buffer (or other files) exist at ``url`` and ``overwrite`` is False.
            LockedError: ``overwrite`` and a live writer holds the buffer at ``url``.
            ValueError: a non-positive or too large capacity, chunk_rows or num_envs, capacity not
                divisible by num_envs, an unknown compression or level, a ``cache_bytes`` too small
                for staging; SchemaError for bad fields (also a name a side store uses: ``state``,
                and ``final`` with ``derive_next``).
        """
        url = os.fspath(url)
        plans = plan_buffer(url, fields, capacity, num_envs, chunk_rows, compression, compression_level,
                            cache_bytes, episode_end, derive_next, episodic_return, row_shards)
        check_open_options(io_threads, memory_map, retry, storage_options, sampler)
        check_lease(lease_s)
        options = Options(storage_options, cache_bytes, io_threads, memory_map, break_lock, retry, lease_s)
        if shards is not None:
            return create_sharded(cls, plans, url, shards, commit, overwrite, options, sampler, seed)
        prepare_location(url, storage_options, overwrite, break_lock, retry)
        storage, finals = create_storages(plans, options, commit)
        buf = cls(BufferOpening(storage, finals), sampler or Uniform(), np.random.default_rng(seed), retry)
        if commit:
            buf.flush()
        return buf

    @classmethod
    def open(cls, url: str | os.PathLike[str], mode: str = "r", *, sampler: Sampler | None = None,
             storage_options: Mapping[str, Any] | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
             io_threads: int | None = None, memory_map: bool | None = None, break_lock: bool = False,
             retry: RetryPolicy | None = None, continue_episodes: bool = False, seed: int | None = None,
             rate_limiter: RateLimiter | None = None, lease_s: float | None = None,
             at_commit: int | str | None = None, capacity: int | None = None) -> ReplayBuffer:
        """Open an existing buffer: ``mode="r+"`` to resume writing, ``"r"`` read-only.

        The sampler and generator state saved with the last commit are restored, so a resumed run
        draws exactly what an uninterrupted one would have. ``sampler`` is only needed for sampler
        types the buffer cannot rebuild from its saved state. ``storage_options``,
        ``cache_bytes``, ``io_threads``, ``memory_map``, ``break_lock``, ``retry`` and
        ``lease_s``: as in `create`.

        Resuming after a crash: a writer lock whose lease has expired (from any host), or left by
        a process that no longer runs on this host, is taken over (with a warning naming the old
        holder); the old writer, should it come back, can no longer commit. With ``mode="r+"``,
        the episode each lane had open is closed as truncated when that lane's next rows arrive:
        the episode index ends it (slices, n-step returns, ``derive_next`` and episodic returns
        stop there) and a ``truncated`` end
        field, if the buffer has one, is set on its last step; a ``done``-only buffer keeps its
        ``done`` values. The new episode never merges with the one the crash or the restart cut.
        ``continue_episodes=True`` keeps them open instead, for a writer that resumes the very
        env streams it was writing (their env state restored).

        ``capacity`` (``mode="r+"``, a ring): first change the ring's capacity to ``capacity``
        rows, a multiple of ``num_envs`` (``capacity // num_envs`` per lane, at least
        ``chunk_rows``). Growing keeps every row; shrinking keeps the newest
        ``capacity // num_envs`` rows of each lane and warns (UserWarning) how many it dropped per
        lane. Row ids, episodes, priorities, episodic returns and ``next_*`` fields stay as they
        were for the rows kept. The change is atomic: a crash leaves the old buffer or the new
        one (a writer that opens the buffer finishes a change that was made visible; readers
        meanwhile get `ResizeInProgressError`; readers open during the change must open the buffer
        again: their rows moved). The capacity it has already: nothing changes.

        A sharded buffer (``create(..., shards=N)``) opens with ``mode="r"`` as the union of its
        shards, for a learner: lane ``e`` of shard ``s`` is lane ``s * num_envs + e`` (row ids
        say shard, lane and step: `locate`); `refresh` adopts every shard's newest commit. The
        learner owns the sampler over the union (``sampler``, e.g. `Prioritized`): its priorities
        are the learner's state (`state_dict`, `save_snapshot`), not the shards'; rows the
        shards commit reach it at `refresh` (prioritized: at the max priority). ``seed`` seeds the
        learner's generator. ``rate_limiter``: `sample` waits while the learner runs ahead of the
        actors (see `RateLimiter`), and publishes its progress for them.

        ``at_commit`` (``mode="r"``): read the buffer exactly as it was at that commit (a
        sequence, or a pin's name): its rows, ``len``, episodes and saved state (sampler,
        priorities, generator), while the writer goes on; `refresh` never moves it. Any commit
        the writer pinned (`pin`) opens; so does the newest commit unpinned, which stays readable
        only until the writer overwrites rows of it (its reads then raise CommitNotKeptError).

        Raises:
            NotABufferError: nothing (or something else, e.g. a plain file) is stored at ``url``.
            CorruptBufferError: the metadata, the commit record or the state object is damaged
                or contradicts the arrays (the message names the object and the field).
            LockedError: ``mode="r+"`` and another writer holds the buffer (its lease not expired).
            ValueError: ``mode`` is not "r" or "r+" (a sharded buffer: not "r"); ``seed`` or
                ``rate_limiter`` for a buffer that is not sharded; ``at_commit`` with ``mode="r+"``
                or for a sharded buffer's union (open one of its shards' locations instead);
                ``capacity`` with ``mode="r"``, for a dataset or a sharded buffer, not a multiple
                of ``num_envs``, too small, or while the buffer has pinned commits.
            CommitNotKeptError: ``at_commit`` is neither pinned nor the newest commit (the
                message lists those that are).
            ResizeInProgressError: ``mode="r"`` while a change of capacity is under way.
        """
        return open_buffer(cls, url, mode, None, sampler=sampler, storage_options=storage_options,
                           cache_bytes=cache_bytes, io_threads=io_threads, memory_map=memory_map, break_lock=break_lock,
                           retry=retry, continue_episodes=continue_episodes, seed=seed, rate_limiter=rate_limiter,
                           lease_s=lease_s, at_commit=at_commit, capacity=capacity)

    @classmethod
    def open_shard(cls, url: str | os.PathLike[str], shard: int, mode: str = "r+", *,
                   rate_limiter: RateLimiter | None = None, **open_options: Any) -> ReplayBuffer:
        """Open shard ``shard`` of the sharded buffer at ``url``: with ``mode="r+"`` (default) as
        its one writer, e.g. an actor. The shard is a buffer of its own (its lock, lanes, episode
        index and commits): what it commits is readable by learners at their next `refresh`, and
        a crash of its writer affects no other shard. ``rate_limiter``: the learner's, so that
        `insert_allowed` can tell this actor to slow down. ``open_options``: as in `open`.

        Raises:
            NotABufferError: ``url`` is not a sharded buffer. ValueError: ``shard`` out of range.
            LockedError: another writer holds this shard. And as `open`.
        """
        return open_writer(cls, os.fspath(url), shard, mode, rate_limiter, open_options)

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
    def layout(self) -> LaneLayout:
        """Lanes, ring capacity per lane and steps per chunk: the buffer's index arithmetic."""
        return self.storage.layout

    @property
    def mode(self) -> str:
        """``"r"`` (a reader: committed rows) or ``"r+"`` (the writer)."""
        return self.storage.mode

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    @property
    def storage_options(self) -> Mapping[str, Any] | None:
        """The fsspec options the buffer was opened with."""
        return self.storage.storage_options

    def __len__(self) -> int:
        """Readable rows over all lanes: a writer's staged ones too, a reader's committed ones."""
        self._require_open()
        lo, hi = self.storage.window()
        return int((hi - lo).sum())

    def __repr__(self) -> str:
        if self._closed:
            return f"ReplayBuffer({self.url!r}, closed)"
        shards = f", shards={self.shards}" if self.storage.sharded else ""
        return (f"ReplayBuffer({self.url!r}, rows={len(self)}, capacity={self.capacity}, "
                f"num_envs={self.num_envs}{shards}, mode={self.mode!r})")

    def window(self, committed: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the readable steps ``[lo, hi)`` (new int64 arrays ``[num_envs]``);
        ``committed``: those of the last commit only (a writer's staged rows left out)."""
        self._require_open()
        lo, hi = self.storage.committed_window() if committed else self.storage.window()
        return lo.copy(), hi.copy()

    def stats(self) -> StorageStats:
        """What the storage holds and did: cache slots, chunks loaded, maps, the commit shown
        (counts, not times). Also after `close`: the final counts."""
        return self.storage.stats()

    def warm(self) -> None:
        """Bring the window close now and wait: what a reader's first read starts behind it. A
        window that fits the cache is loaded into it (afterwards reads never touch the store);
        local raw files that fit half the RAM are read into the OS page cache. Reads before
        this returns are served as the fill proceeds: rows missing from the cache are read
        straight from their chunk objects. The store of a ``derive_next`` buffer's kept-apart
        final observations is warmed too. Raises ClosedError."""
        self._require_open()
        for storage in filter(None, (self.storage, self._finals)):
            storage.warm()

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

        A chunk the step fills is written behind the call, on the writer's background thread (with
        a full ring's retire commit): the call does not wait for the disk. If that write fails,
        the next `add`, `extend` or `flush` raises its error, once, before doing anything; the
        chunk stays staged and is written again with the next one.

        Raises:
            SchemaError: missing/unknown field, wrong shape, unsafe or lossy dtype, bad env_ids.
            ReadOnlyError: the buffer was opened with mode="r". ClosedError: it was closed.
            OSError / StoreUnavailableError / LockedError: writing chunks failed, in this call or
                behind an earlier one; nothing of the call remains.
        """
        self._writer().add(step, env_ids)

    def extend(self, data: Mapping[str, Any], env_ids: Any = None) -> None:
        """Add N steps at once. Each field is shaped ``(N, *field.shape)``; with several lanes,
        ``(N, num_envs or len(env_ids), *field.shape)`` (time-major). In a ring, an extend longer
        than the capacity keeps its last rows. All or nothing, as `add`.

        Raises:
            SchemaError: not a mapping, missing/unknown field, wrong shape, unsafe or lossy dtype,
                mismatched leading axes.
            ReadOnlyError: the buffer was opened with mode="r". ClosedError: it was closed.
            OSError / StoreUnavailableError / LockedError: writing chunks failed, in this call or
                behind an earlier one (see `add`); nothing of the call remains.
        """
        self._writer().extend(data, env_ids)

    def _writer(self) -> Appender:
        self._require_open()
        self.storage.require_writable()
        assert self._appender is not None  # a writable storage has an appender
        return self._appender

    def flush(self, durable: bool = True) -> None:
        """Write every staged row and commit: after it returns, a crash loses none of them.

        ``durable=True`` fsyncs data and metadata on local disk before the commit completes. If
        it raises, nothing new is committed and the rows stay staged: flush again.

        Raises:
            ReadOnlyError: the buffer was opened with mode="r". ClosedError: it was closed.
            LockedError: another writer took this buffer's lock (this one stops writing).
            OSError / StoreUnavailableError: writing failed (or a chunk write behind an earlier
                `add` or `extend` did).
        """
        self._writer().flush(durable)

    def refresh(self, commits: ShardCommits | None = None) -> bool:
        """Read-only buffers: adopt the newest commit with everything that belongs to it (rows,
        episode index, derived-field state, sampler state), all together or not at all.
        Returns True if there was a newer commit. A writer has nothing to adopt (False).

        ``commits``: a learner of a sharded buffer adopts exactly these shard commits (another
        learner's `shard_commits`; those not newer than what it shows are left out), reading none.

        Raises:
            CorruptBufferError: the newest commit or its state object is damaged (nothing changed).
            ClosedError: the buffer was closed. ValueError: ``commits`` for a buffer that is not
                a learner of a sharded buffer.
        """
        self._require_open()
        return self._follower.refresh() if commits is None else self.learner_rank().shards.adopt(commits)

    def shard_commits(self, shards: Sequence[int] | None = None) -> ShardCommits:
        """A learner of a sharded buffer: the commits of ``shards`` (default: all) it shows now,
        small and picklable, for other learners to adopt (`refresh` with ``commits``). Raises
        ValueError for a buffer that is not a learner of a sharded buffer; ClosedError."""
        return self.learner_rank().shards.commits(shards)

    def learner_rank(self) -> LearnerRank:
        """A learner of a sharded buffer: its sampling and refresh steps taken apart, for learner
        ranks that keep one sampling state together (``diskreplay.torch.DistributedLearner``).

        Raises ValueError for a buffer that is not a learner of a sharded buffer; ClosedError."""
        self._require_open()
        if not isinstance(self._gate, LearnerGate):
            raise ValueError(f"{self.url!r} is not a learner of a sharded buffer (dr.ReplayBuffer.open(url, 'r') "
                             f"of one made with shards=)")
        return LearnerRank(self._state, self._follower, self._gate, self.view)  # type: ignore[arg-type]

    # ---- reading ---------------------------------------------------------------------------

    def sample(self, batch_size: int, *, seed: int | None = None, rng: np.random.Generator | None = None,
               seq_len: int | None = None, pad: bool = False, n_step: int | None = None, format: str = "numpy",
               gamma: float = 0.99, stack: int | None = None, stack_fields: tuple[str, ...] = ("obs",),
               her: HER | None = None, out: dict[str, np.ndarray] | None = None, beta: float | None = None,
               recent_rows: int | None = None, as_tensordict: bool = False, **options: Any) -> Rows | Any:
        """A minibatch: ``{field: array [batch_size, *shape], "index": int64 row ids}``. A ragged
        field comes as a `dr.Ragged` of ``batch_size`` rows (with ``seq_len``: of
        ``batch_size * seq_len`` rows, slice after slice), a text field as a numpy object array
        of ``str``; ``format="torch"`` makes a ragged field a jagged ``torch.nested`` tensor.

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

        ``format="torch"``: the arrays as CPU tensors sharing their memory (``torch.from_numpy``,
        no copy); ``format="tensordict"`` or ``as_tensordict=True``: a ``tensordict.TensorDict``
        of batch size ``[batch_size]``, ``next_x`` fields under ``("next", "x")`` as TorchRL lays
        out transitions (see `diskreplay.torch.formats`). torch / tensordict are imported then.

        A reader whose rows the writer overwrote meanwhile (a ring) adopts the newest commit and
        draws again, until it succeeds or ``retry.budget_s`` seconds have passed; so does a reader
        whose commit retired every row (its writer is mid-way round the ring), waiting for rows.

        Raises:
            ValueError: an unknown ``format`` (before anything is drawn); batch_size <= 0 or a
                batch larger than this machine's memory; ``out`` with
                a name, dtype or shape that does not fit, or combined with seq_len/n_step/stack/her.
            EmptyBufferError: the buffer holds no rows (a reader: none for ``retry.budget_s`` s).
            StaleReadError: the writer kept overwriting the rows drawn for ``retry.budget_s`` s.
            RateLimitTimeout: a learner's `RateLimiter` held it back for its ``timeout_s``.
            ClosedError: the buffer was closed.
        """
        self._require_open()
        convert = output_converter(format, as_tensordict)
        check_batch_size(batch_size, self.view.schema.row_bytes)
        request = sample_request(options, beta, recent_rows, seq_len, pad, n_step, gamma, stack, stack_fields, her, out)
        if out is not None:
            request.check_out(int(batch_size), self.fields)
        generator = call_generator(seed, rng, self.rng)
        return convert(self._read_counted(int(batch_size), self._batches.sample, generator, int(batch_size), request))

    def sample_tokens(self, max_tokens: int, lengths_of: str | Sequence[str] = "tokens", **options: Any) -> Rows | Any:
        """A token-budgeted minibatch: rows drawn by the buffer's sampler, in draw order, as many
        as fit ``max_tokens``: the batch ends before the first row whose values of the ragged
        field(s) ``lengths_of`` (summed over the fields) would take the batch past the budget.
        Lengths come from the stored ends (no values read); no Python loop runs per row. Returns
        what `sample` returns for plain transitions (every field, ``"index"``, ``"weight"``...).

        Keyword options: ``where={"field": (low, high)}`` keeps only rows whose scalar numeric
        field lies in ``[low, high]`` (None: no bound), e.g. ``{"policy_version": (v - k, None)}``:
        rows at most k versions behind. Rows outside are drawn and dropped (a vectorized mask over
        each block of draws), so a filter that keeps a share p of the rows costs about 1/p draws
        per kept row. ``max_rows`` (default ``max_tokens``): the most rows a batch holds.
        ``max_draws`` (default ``max(4096, 16 * max_rows)``): the most rows drawn for one batch.
        ``packed=True``: each ragged field ``f`` as its values end to end with ``f_cu_seqlens``
        (int32 ``[B + 1]``) and ``f_max_seqlen`` (see `output_converter`). ``seed``, ``rng``,
        ``format`` (not ``"tensordict"`` with ``packed``), ``beta``, ``recent_rows`` and a
        sampler's own options as in `sample`.

        The rows are the sampler's draws in order, drawn in blocks (the first of 64 rows, or
        ``max_rows`` if fewer; later ones sized from the lengths seen): the same seed gives the
        same batch, and the buffer's generator is saved in `state_dict` as for `sample`. Rows
        drawn past the one that ends the batch are dropped (with `WithoutReplacement`, they are
        used up for that epoch). A batch is never empty: it ends after ``max_draws`` draws.

        Raises:
            SchemaError: a ``lengths_of`` field that is missing or not ragged; a ``where`` field
                that is missing or not a scalar number.
            ValueError: ``max_tokens``, ``max_rows``, ``max_draws`` not an int >= 1; bad ``where``
                bounds; the first matching row drawn is longer than ``max_tokens`` alone (the
                budget must hold the longest row); options as `sample`.
            EmptyBufferError: no readable row, or none of ``max_draws`` drawn matched ``where``.
            StaleReadError, RateLimitTimeout, ClosedError: as `sample`.
        """
        return sample_tokens(self, self._read_counted, self._batches, max_tokens, lengths_of, **options)

    def sample_batches(self, batch_size: int, count: int, *, seed: int | None = None,
                       rng: np.random.Generator | None = None, rngs: Sequence[np.random.Generator] | None = None,
                       format: str = "numpy", beta: float | None = None, recent_rows: int | None = None,
                       **options: Any) -> list[Rows | Any]:
        """``count`` minibatches, each as `sample` draws it, gathered in one read.

        The rows are those of ``count`` calls of ``sample(batch_size, ...)`` in a row with the
        same generator (the buffer's own, ``rng``, or one seeded with ``seed``), or of batch i
        drawn with ``rngs[i]`` (one generator per batch). One window, one gather and one
        conversion serve them all, so each batch costs less than a `sample` call when batches are
        small: for several gradient steps per environment step, or a loader of small batches.

        Plain transitions, as ``sample`` returns them (``"index"``, ``"weight"`` with a
        prioritized sampler and ``beta``); ``recent_rows`` and a sampler's own ``options`` as
        there. Returns a list of ``count`` batches in ``format``; their arrays are views of one
        block of ``count * batch_size`` rows, which a kept batch keeps alive.

        Raises:
            ValueError: ``count`` not an int >= 1; ``rngs`` not ``count`` generators, or given
                with ``seed``/``rng``; as ``sample`` for the batch size, ``format`` and options.
            EmptyBufferError, StaleReadError, RateLimitTimeout, ClosedError: as ``sample``.
        """
        self._require_open()
        convert = output_converter(format)
        row_bytes = self.view.schema.row_bytes
        check_batch_size(batch_size, row_bytes)
        check_int(count, "count", 1)
        size, count = int(batch_size), int(count)
        check_batch_size(size * count, row_bytes, "batch_size * count")
        generators = batch_generators(count, rngs, seed, rng, self.rng)
        request = plain_request(options, beta, recent_rows)
        block = self._read_counted(size * count, self._batches.sample_many, generators, size, request)
        return [convert(batch) for batch in split_batches(block, [size] * count)]

    def _read_counted(self, rows: int, read: Callable[..., Rows], *args: Any) -> Rows:
        """``read(*args)`` through the follower's retries, once the learner's rate limiter (if
        any) lets ``rows`` rows be sampled, counted as the rows the batch holds."""
        self._gate.before(rows)
        batch = self._follower.read_retrying(read, *args)
        self._gate.after(len(batch["index"]))
        return batch

    def as_dataset(self, batch_size: int, mode: str = "sample", **options: Any) -> SampleDataset | EpochDataset:
        """A torch ``IterableDataset`` of collated batches over this buffer's committed rows.

        ``mode="sample"``: endless batches from the buffer's sampler; ``"epoch"``: every row once
        per epoch. Options and resume semantics: `diskreplay.torch.data.make_dataset`.
        """
        from ..torch.data import make_dataset  # torch is imported only when first used

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
        if not takes_priorities(self.sampler):
            raise TypeError(f"update_priorities needs a prioritized sampler; this buffer uses "
                            f"{type(self.sampler).__name__}")
        lane, step = sampled_lane_steps(index, self.num_envs)
        return int(self.sampler.update_priorities(lane, step, td_errors, *self.storage.window()))

    def episodes(self) -> EpisodeTable:
        """Every episode with readable rows: lane, start step, length, complete (ended and its
        first step not overwritten). Rows of an episode are row ids ``(start + i) * num_envs + lane``."""
        self._require_open()
        if not self.episode_index.enabled:
            raise ValueError("this buffer keeps no episode index (created with episode_end=None)")
        return self.episode_index.table(*self.storage.window())

    def episode(self, k: int) -> Rows:
        """The readable rows of episode ``k`` of `episodes` (negative k counts from the end)."""
        lane, steps = self.episodes().steps_of(k)
        rows = self._follower.read_once(lambda: self.view.gather(np.full(len(steps), lane), steps))
        rows["index"] = row_ids(lane, steps, self.num_envs)
        return rows

    def __getitem__(self, ids: Any) -> Rows:
        """Rows by row id (an int or an int array): ``{field: array [*ids.shape, *shape]}``.

        Raises:
            IndexError: an id that is negative, not yet added, or already overwritten.
        """
        return self.rows(ids)

    def rows(self, ids: Any, out: dict[str, np.ndarray] | None = None, format: str = "numpy") -> Rows | Any:
        """``buf[ids]``, optionally gathered straight into ``out`` (1-D ``ids``; as in `sample`),
        returned as ``format`` says (``"numpy"``, ``"torch"``, ``"tensordict"``: as in `sample`;
        a TensorDict's batch size is the first dim of ``ids``).

        Raises:
            IndexError: an id that is negative, not yet added, or already overwritten
                (`StaleReadError` if the writer overwrote it after this reader's commit: the
                reader has then adopted the newest commit).
            ValueError: ``out`` with a name, dtype or shape that does not fit; an unknown ``format``.
            ClosedError: the buffer was closed.
        """
        self._require_open()
        convert = output_converter(format)
        if out is not None:
            check_out(out, np.size(ids), self.fields)
        shape, lane, step = readable_lane_steps(ids, *self.storage.window(), self.num_envs)
        rows = self._follower.read_once(lambda: self.view.gather(lane, step, out=out))
        return convert(rows if len(shape) == 1 else shaped(rows, shape))

    def latest(self, n: int) -> Rows:
        """The newest ``n`` readable rows (fewer if the buffer holds fewer), oldest first:
        ``{field: array [n, *shape], "index": [n] int64 row ids}``. With several lanes, the
        rows of the ``n`` highest row ids (the newest steps, lanes side by side).

        Raises ValueError for ``n`` that is not an int >= 0; ClosedError."""
        check_int(n, "n", 0)
        self._require_open()
        ids = newest_ids(*self.storage.window(), int(n), self.num_envs)
        return {**self.rows(ids), "index": ids}

    def clear(self) -> None:
        """Forget every row: afterwards the buffer holds none, for this writer at once and for
        readers at the next `flush`. Row ids go on counting (an id never names two rows); each
        lane's open episode ends, cut, and the next row starts a new one. The old rows' bytes
        stay on disk until new rows overwrite them (a ring) or the buffer is deleted.

        Raises ReadOnlyError (a reader), ClosedError, LockedError."""
        self._writer().clear()

    def locate(self, ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where row ids (e.g. ``batch["index"]``) come from: int64 arrays ``(shard, lane, step)``
        shaped as ``ids``: the shard (0 unless sharded), the env lane inside it, and the step
        counted in that lane. Raises IndexError for a negative id."""
        return locate(ids, self.num_envs, self.num_envs // self.shards)

    @property
    def shards(self) -> int:
        """Shards read together (1: a buffer that is not sharded, or one shard of one)."""
        return self.storage.shards

    def insert_allowed(self, rows: int = 1, wait: bool = False) -> bool:
        """An actor (`open_shard` with ``rate_limiter``): whether ``rows`` more rows may be added
        now, by the learner's published sample count and every shard's newest commit (see
        `RateLimiter`); ``wait=True`` blocks until they may (True),
        committing the rows added so far first if it must wait (the learner counts committed rows).

        Raises:
            ValueError: the shard was opened without a rate limiter.
            RateLimitTimeout: ``wait`` and the limiter's ``timeout_s`` passed.
            CorruptBufferError: a damaged ``learner.json``.
        """
        self._require_open()
        return self._actor_gate.wait(rows) if wait else self._actor_gate.allowed(rows)

    def row_ids(self) -> np.ndarray:
        """Every readable row id, lane by lane in time order (int64)."""
        self._require_open()
        return readable_ids(*self.storage.window(), self.num_envs)

    # ---- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The small in-RAM state: cursors per lane, the generator and the sampler's state."""
        self._require_open()
        return {**self._state.current(), "total": self.storage.total.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore generator and sampler state saved by `state_dict` from this same buffer.

        Raises:
            ValueError: the state's cursors differ from the buffer's (rows were added or lost
                since), or any part of it does not fit this buffer (nothing is loaded then).
        """
        self._require_open()
        self._state.load(state, origin=None)

    def save_snapshot(self, directory: str | os.PathLike[str]) -> None:
        """Write `state_dict` to the local ``directory``: ``state.json`` and the arrays file it
        names. The snapshot there is replaced only once the new one is durable: a save killed at
        any moment leaves the old snapshot or the new one, whole (`diskreplay.buffer.snapshot`)."""
        state = self.state_dict()  # raises ClosedError before anything is written
        snapshot.save(os.fspath(directory), self.url, state)

    @classmethod
    def load_snapshot(cls, directory: str | os.PathLike[str], mode: str = "r+", *, url: str | None = None,
                      **open_options: Any) -> ReplayBuffer:
        """Open the buffer a snapshot was taken of (or ``url``) and restore the snapshot's state.

        Raises:
            CorruptBufferError: the snapshot's files are unreadable or do not fit (naming the file).
            ValueError: the snapshot is of another state of the buffer (see `load_state_dict`).
        """
        directory = os.fspath(directory)
        state, saved_url, arrays = snapshot.load(directory)
        buf = cls.open(url or saved_url, mode, **open_options)
        try:
            buf._state.load(state, origin=f"snapshot {directory!r} (state.json, {arrays})")
        except BaseException:
            buf._release()  # nothing was written: release without flushing
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
                self._writer().flush(True, last=True)
            self._gate.close()  # a learner's last progress reaches the store
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        close_all(self.storage, self._finals)

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



def shaped(rows: Rows, shape: tuple[int, ...]) -> Rows:
    """``rows`` (gathered for the flat ids) with their ids' ``shape``."""
    return {k: v.reshape(shape + v.shape[1:]) if isinstance(v, np.ndarray) else v for k, v in rows.items()}


def sample_tokens(buf: ReplayBuffer, read_counted: Callable[..., Rows], batches: Batches, max_tokens: int,
                  lengths_of: str | Sequence[str], *, where: Mapping[str, tuple[Any, Any]] | None = None,
                  max_rows: int | None = None, max_draws: int | None = None, packed: bool = False,
                  seed: int | None = None, rng: np.random.Generator | None = None, format: str = "numpy",
                  beta: float | None = None, recent_rows: int | None = None, **options: Any) -> Rows | Any:
    """`ReplayBuffer.sample_tokens` of ``buf`` (see there), reading through ``read_counted``."""
    if buf.closed:
        raise ClosedError(f"buffer {buf.url!r} is closed; open it again to use it")
    convert = output_converter(format, packed=packed)
    request = token_request(buf.view.schema, max_tokens, lengths_of, where, max_rows, max_draws,
                            plain_request(options, beta, recent_rows).options)
    generator = call_generator(seed, rng, buf.rng)
    return convert(read_counted(1, batches.sample_tokens, generator, request, buf.storage.lengths))
