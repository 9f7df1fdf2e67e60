"""Creating and opening a buffer's storages: every argument checked before anything at the URL is
touched, the location prepared, the ``derive_next`` side store of final observations beside it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checks import check_int
from ..episodes import EpisodicReturn, derived_next_fields, episode_end_fields
from ..errors import BufferExistsError, CorruptBufferError, NotABufferError, SchemaError
from ..format import keys
from ..format.codecs import default_level
from ..format.commit import CommitRecord
from ..format.config import MAX_CHUNK_ROWS, MAX_CHUNKS, MAX_LANES, MAX_STEPS, BufferConfig
from ..format.keys import BUFFER_MARKERS, FINALS_DIR, GROUP_KEY, MAX_METADATA_BYTES
from ..format.layout import check_schema_compatible
from ..format.schema import Field, Schema
from ..format.shards import ShardedRoot, read_root, shard_url
from ..io import ChunkStore, RetryPolicy, broken_path, is_local, local_path, open_chunkstore
from ..io.lock import check_unlocked
from ..storage import (
    BufferStorage,
    NewStorage,
    Options,
    Storage,
    create_storage,
    default_chunk_rows,
    open_storage,
    own_stores,
    plan_storage,
)
from .parts import ActorLimit, BufferOpening
from .rate_limit import RateLimiter
from .state import saved_sampler

if TYPE_CHECKING:
    from ..sampling import Sampler
    from .replay_buffer import ReplayBuffer

FINALS_CHUNK_ROWS = 64
FINALS_CACHE_BYTES = 32 * 2**20
SAMPLER_METHODS = ("attach", "on_append", "sample", "state_dict", "load_state_dict")

Opened = tuple[BufferStorage, BufferStorage | None, CommitRecord, dict[str, Any]]
"""An existing buffer's storage, its ``derive_next`` side store, the commit they show and its state."""


def plan_buffer(url: str, fields: Mapping[str, Field], capacity: int | None, num_envs: int, chunk_rows: int | None,
                compression: str | None, level: int | None, cache_bytes: int, episode_end: str | tuple[str, ...] | None,
                derive_next: tuple[str, ...], episodic_return: EpisodicReturn | None,
                row_shards: bool = False) -> list[NewStorage]:
    """The storages of a new buffer (the main one, then the side store of ``derive_next``),
    planned and checked; ``level`` None is the codec's default. Raises ValueError or SchemaError
    (see `ReplayBuffer.create`)."""
    level = default_level(compression) if level is None else level
    user = Schema(fields)
    end_fields = episode_end_fields(user.fields, episode_end)
    derived = derived_next_fields(tuple(derive_next), user.fields)
    stored = {name: field for name, field in user.items() if name not in derived}
    if (derived or episodic_return) and not end_fields:
        raise ValueError("derive_next and episodic_return need episode ends: name them with episode_end=")
    if episodic_return is not None:
        _check_episodic_return(episodic_return, user)
        stored[episodic_return.name] = episodic_return.field()
    declared = Schema(stored)
    check_ragged_uses(declared, end_fields, tuple(derived.values()), episodic_return)
    stored_schema = declared.storage()
    check_schema_compatible(stored_schema, tuple(derived.values()))
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(stored_schema, num_envs, capacity, cache_bytes, compression is None,
                                        remote=not is_local(url))
        if any(f.frames is not None and f.frames.video for f in declared.fields.values()):
            chunk_rows = min(chunk_rows, VIDEO_CHUNK_ROWS)  # a row chunk is a video's group of pictures
    lane_capacity = lane_capacity_of(capacity, num_envs, chunk_rows)
    chunk_rows = min(chunk_rows, lane_capacity or chunk_rows)
    config = BufferConfig(stored_schema, num_envs, lane_capacity, chunk_rows, compression, level,
                          chunk_key_separator=keys.CHUNK_KEY_SEPARATOR, row_shards=row_shards, episode_end=end_fields,
                          derive_next=tuple(derived.values()),
                          episodic_return=episodic_return.to_json() if episodic_return else None,
                          fields=declared if declared.ragged else None)
    plans = [plan_storage(url, config, cache_bytes)]
    if derived:
        finals = BufferConfig(Schema({base: user[base] for base in derived.values()}), num_envs, None,
                              FINALS_CHUNK_ROWS, compression, level, keys.CHUNK_KEY_SEPARATOR)
        plans.append(plan_storage(finals_url(url), finals, finals_cache(finals.schema, num_envs)))
    return plans


VIDEO_CHUNK_ROWS = 32
"""The default rows per chunk of a buffer with a video field: a random frame decodes at most
this many frames (about 10 ms of 480x640 frames on one core), and a keyframe is sent this often."""


def check_ragged_uses(declared: Schema, end_fields: tuple[str, ...], derived: tuple[str, ...],
                      episodic_return: EpisodicReturn | None) -> None:
    """Raises SchemaError naming a ragged field used where a fixed shape is needed (episode ends,
    ``derive_next``, an episodic return's reward)."""
    uses = [("episode_end", end_fields), ("derive_next", derived),
            ("episodic_return", (episodic_return.reward,) if episodic_return else ())]
    for option, names in uses:
        for name in names:
            if name in declared.fields and declared[name].ragged:
                kind = "stored encoded" if declared[name].codec is not None else "ragged"
                raise SchemaError(f"{option}: field {name!r} is {kind} ({declared[name]}); {option} needs a "
                                  f"field stored with a fixed shape per step")


def create_storages(plans: list[NewStorage], options: Options,
                    commit: bool) -> tuple[BufferStorage, BufferStorage | None]:
    """Create a planned buffer's storage and its ``derive_next`` side store. The side store
    first: once the main commit exists, a reader finds everything it needs."""
    finals = None
    if len(plans) > 1:
        config = plans[1].config
        finals = create_storage(plans[1], finals_options(options, config.schema, config.num_envs), commit=True)
    return create_storage(plans[0], options, commit=commit), finals


def check_open_options(io_threads: Any, memory_map: Any, retry: Any, storage_options: Any,
                       sampler: Any = None, rate_limiter: Any = None) -> None:
    """Raise ValueError naming the first option of `create`/`open` that is not usable."""
    if io_threads is not None and (isinstance(io_threads, bool) or not isinstance(io_threads, (int, np.integer))
                                   or not 1 <= io_threads <= 256):
        raise ValueError(f"io_threads must be None or an int in [1, 256], got {io_threads!r}")
    if memory_map not in (None, True, False):
        raise ValueError(f"memory_map must be None, True or False, got {memory_map!r}")
    if retry is not None and not isinstance(retry, RetryPolicy):
        raise ValueError(f"retry must be a dr.RetryPolicy or None, got {type(retry).__name__}")
    if rate_limiter is not None and not isinstance(rate_limiter, RateLimiter):
        raise ValueError(f"rate_limiter must be a dr.RateLimiter or None, got {type(rate_limiter).__name__}")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise ValueError(f"storage_options must be a dict or None, got {type(storage_options).__name__}")
    missing = [m for m in SAMPLER_METHODS if not callable(getattr(sampler, m, None))]
    if sampler is not None and missing:
        raise ValueError(f"sampler must be a dr.Sampler (dr.Uniform(), dr.Prioritized(), ...), got "
                         f"{type(sampler).__name__} without {missing}")


def lane_capacity_of(capacity: int | None, num_envs: int, chunk_rows: int) -> int | None:
    """Steps per lane of a ring of ``capacity`` rows (None: a dataset). Raises ValueError."""
    check_int(num_envs, "num_envs", 1, MAX_LANES)
    check_int(chunk_rows, "chunk_rows", 1, MAX_CHUNK_ROWS)
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
    if capacity % num_envs:
        raise ValueError(f"capacity must be a multiple of num_envs={num_envs}, got {capacity}")
    lane_capacity = int(capacity // num_envs)
    chunks = num_envs * -(-lane_capacity // min(chunk_rows, lane_capacity))
    if lane_capacity > MAX_STEPS or chunks > MAX_CHUNKS:
        raise ValueError(f"capacity={capacity:,} with chunk_rows={chunk_rows} needs {chunks:,} chunks; at most "
                         f"{MAX_CHUNKS:,} are kept: raise chunk_rows")
    return lane_capacity


def _check_episodic_return(spec: EpisodicReturn, user: Schema) -> None:
    if spec.name in user.fields:
        raise SchemaError(f"episodic_return: field {spec.name!r} is computed by the buffer; "
                          f"remove it from fields or choose another name")
    if spec.reward not in user.fields or user[spec.reward].shape != ():
        raise SchemaError(f"episodic_return: expected a scalar reward field {spec.reward!r}, "
                          f"got {user.fields.get(spec.reward)}")


def prepare_location(url: str, storage_options: Mapping[str, Any] | None, overwrite: bool, break_lock: bool,
                     retry: RetryPolicy | None) -> None:
    """Make ``url`` ready for a new buffer: refuse an existing one unless ``overwrite`` (and never
    delete what is not a buffer, or one a live writer holds: of a sharded buffer, any shard's),
    then remove it (retried remotely). What a failed distributed write left is removed whatever
    ``overwrite`` says. Raises NotABufferError for a local path that runs into a loop of symbolic
    links or ends in a link to nothing."""
    store = replaceable_location(url, storage_options, overwrite, break_lock, retry)
    if store is not None:
        store.clear()


def replaceable_location(url: str, storage_options: Mapping[str, Any] | None, overwrite: bool,
                         break_lock: bool, retry: RetryPolicy | None) -> ChunkStore | None:
    """The store at ``url`` when it holds a buffer (or what a failed distributed write left) that
    `prepare_location` would remove, None when there is nothing to remove; the checks of
    `prepare_location` (BufferExistsError, LockedError), nothing removed. Raises NotABufferError
    as `prepare_location`."""
    problem = broken_path(url)
    if problem is not None:
        raise NotABufferError(f"{url!r} cannot hold a buffer ({problem})")
    store = open_chunkstore(url, storage_options, retry=retry)
    if is_local(url):
        path = local_path(url)
        if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
            return None
        if failed_write(store):
            return store
        if not overwrite:
            raise BufferExistsError(f"{url!r} already exists; pass overwrite=True to replace it")
        _require_buffer_or_empty(path)
    elif any(store.exists(key) for key in BUFFER_MARKERS):
        if not overwrite:
            raise BufferExistsError(f"{url!r} already holds a buffer; pass overwrite=True to replace it")
    else:
        return store if store.exists(keys.FAILED_WRITE_KEY) else None
    root = read_sharded_root(store, url)
    for location in [url] if root is None else [shard_url(url, shard) for shard in range(root.count)]:
        check_unlocked(location, own_stores(location, storage_options), break_lock)
    return store


def failed_write(store: ChunkStore) -> bool:
    """Whether ``store`` holds what a failed distributed write left (`keys.FAILED_WRITE_KEY`) and no buffer."""
    return store.exists(keys.FAILED_WRITE_KEY) and not any(store.exists(key) for key in BUFFER_MARKERS)


def read_sharded_root(store: ChunkStore, url: str) -> ShardedRoot | None:
    """What the root group at ``url`` declares of its shards (None: not a sharded buffer).
    Raises CorruptBufferError for a damaged declaration."""
    return read_root(store.get(GROUP_KEY, limit=MAX_METADATA_BYTES + 1), url)


def _require_buffer_or_empty(path: str) -> None:
    if not os.path.isdir(path) or not any(os.path.exists(os.path.join(path, key))
                                          for key in BUFFER_MARKERS):
        raise BufferExistsError(f"{path!r} exists and is not a diskreplay buffer; refusing to delete it")


def finals_url(url: str) -> str:
    """Where a buffer with ``derive_next`` keeps each episode's final next observation."""
    return f"{url.rstrip('/')}/{FINALS_DIR}"


def open_storages(url: str, mode: str, options: Options, at_commit: int | str | None = None) -> Opened:
    """An existing buffer's storage, its ``derive_next`` side store (if any), the commit they
    show and the state saved with it. A reader that raced its writer shows the newest commit;
    one opened ``at_commit`` shows that one (its side store its newest: it reads only rows
    its commit names, which the writer never rewrites)."""
    storage = open_storage(url, mode, options, at_commit, with_state=True)
    finals = None
    try:
        record, state = storage.load_state(newest=False)
        if not record.same_as(storage.record):
            storage.adopt(record)
        if storage.config.derive_next:
            schema = Schema({base: storage.schema[base] for base in storage.config.derive_next})
            finals = open_finals(url, schema, storage.layout.num_envs, mode, options)
    except BaseException:
        close_all(storage, finals)
        raise
    return storage, finals, record, state


def open_single(cls: type[ReplayBuffer], url: str, mode: str, opened: Opened, sampler: Sampler | None,
                retry: RetryPolicy | None, continue_episodes: bool, seed: int | None,
                rate_limiter: RateLimiter | None, actor: ActorLimit | None) -> ReplayBuffer:
    """A buffer of one shard over its storages (`open_storages`), in the state saved with the
    commit they show, its generator's included; a writer closes each lane's open episode as cut
    unless ``continue_episodes``; ``actor``: a shard writer's rate limit. The storages closed if
    that fails."""
    storage, finals, record, state = opened
    try:
        if seed is not None or rate_limiter is not None:
            raise ValueError(f"seed= and rate_limiter= are for sharded buffers; {url!r} is not one "
                             f"(its generator is restored from its last commit)")
        cut = frozenset(range(storage.layout.num_envs)) if mode == "r+" and not continue_episodes else frozenset()
        opening = BufferOpening(storage, finals, (record, state), cut, actor)
        return cls(opening, sampler or saved_sampler(url, record, state), np.random.default_rng(), retry)
    except BaseException:
        close_all(storage, finals)
        raise


def close_all(*storages: Storage | None) -> None:
    """Release these storages (without writing anything)."""
    for storage in storages:
        if storage is not None:
            storage.close()


def open_finals(url: str, schema: Schema, num_envs: int, mode: str, options: Options) -> BufferStorage:
    """The side store of a ``derive_next`` buffer. Raises CorruptBufferError if it is missing or damaged."""
    try:
        return open_storage(finals_url(url), mode, finals_options(options, schema, num_envs))
    except (NotABufferError, CorruptBufferError) as exc:
        raise CorruptBufferError(f"{url!r}: the side store {FINALS_DIR}/ of derive_next, which "
                                 f"holds each episode's final {', '.join(schema.fields)}, is missing or damaged "
                                 f"({exc})") from None


def finals_options(options: Options, schema: Schema, num_envs: int) -> Options:
    """``options`` for the side store: its own cache (`finals_cache`), whatever the buffer's is;
    no announcer (a shard's announcements name its main commits: the side store's sequences are
    its own)."""
    return replace(options, cache_bytes=finals_cache(schema, num_envs), announcer=None)


def finals_cache(schema: Schema, num_envs: int) -> int:
    """The side store's chunk cache: its default, or what staging needs if that is more."""
    return max(FINALS_CACHE_BYTES, (2 * num_envs + 2) * FINALS_CHUNK_ROWS * schema.row_bytes)
