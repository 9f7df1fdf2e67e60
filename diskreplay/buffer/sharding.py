"""A sharded buffer's location: its root group declared after every shard exists, its shards
opened together as one read-only storage (a learner's), the shard a writer opens."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CorruptBufferError, NotABufferError
from ..format.commit import CommitRecord
from ..format.schema import Schema
from ..format.shards import ShardedRoot, check_shards, root_documents, shard_name, shard_url
from ..io import ChunkStore, RetryPolicy, is_local, link_target, local_path, open_chunkstore
from ..sampling import Sampler, Uniform
from ..storage import DEFAULT_CACHE_BYTES, NewStorage, Options, UnionStorage, check_location, open_union_storage
from ..storage.commit_log import Announcer
from ..storage.union import CommitIndex
from .parts import ActorLimit, BufferOpening, LearnerOpening
from .rate_limit import Progress, RateLimiter
from .resize import resize
from .setup import (
    check_open_options,
    close_all,
    create_storages,
    finals_cache,
    finals_url,
    open_single,
    open_storages,
    prepare_location,
    read_sharded_root,
)

if TYPE_CHECKING:
    from .replay_buffer import ReplayBuffer

UnionParts = tuple[UnionStorage, UnionStorage | None, list[tuple[CommitRecord, Mapping[str, Any]]]]


def root_store(url: str, storage_options: Mapping[str, Any] | None, retry: RetryPolicy | None) -> ChunkStore:
    return open_chunkstore(url, storage_options, retry=retry)


def commit_index(url: str, declared: ShardedRoot, storage_options: Mapping[str, Any] | None,
                 retry: RetryPolicy | None) -> CommitIndex | None:
    """The commit index of the sharded buffer at ``url`` (None: its root declares none)."""
    if not declared.index:
        return None
    return CommitIndex(root_store(f"{url.rstrip('/')}/{declared.index_prefix}", storage_options, retry), declared.count)


def declare_shards(store: ChunkStore, count: int) -> None:
    """Write the root group: from now on the location opens as a buffer of ``count`` shards."""
    for key, blob in root_documents(count).items():
        store.put(key, blob, durable=True)


def check_shard(shard: Any, count: int, url: str) -> int:
    """``shard`` as an int in ``[0, count)``; else ValueError naming it."""
    if isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < count:
        raise ValueError(f"shard must be an int in [0, {count}) ({url!r} has {count} shards), got {shard!r}")
    return shard


def shard_link(url: str, shard: int) -> str | None:
    """What is wrong with shard ``shard`` of ``url`` if its directory is a symbolic link (None:
    it is not). Each shard must be a directory of its own: a link to another shard would show
    that shard's rows twice, and let two writers write it."""
    target = link_target(shard_url(url, shard))
    return None if target is None else f"is a symbolic link (to {target!r}); each shard must be a directory of its own"


def check_shard_directory(url: str, shard: int) -> None:
    """Raise CorruptBufferError naming shard ``shard`` of ``url`` if it is a symbolic link (`shard_link`)."""
    problem = shard_link(url, shard)
    if problem is not None:
        raise CorruptBufferError(f"{url!r}: {shard_name(shard)} {problem}")


def open_union(url: str, declared: ShardedRoot, options: Options) -> UnionParts:
    """Every shard opened read-only as one storage (and their ``derive_next`` side stores as
    another), with the commit each shard shows and its state.

    Raises NotABufferError / CorruptBufferError naming the shard (a missing one, one that is a
    symbolic link, or one whose config differs from shard 0's)."""
    count = declared.count
    for shard in range(count):
        check_shard_directory(url, shard)
    shards = [shard_url(url, shard) for shard in range(count)]
    index = commit_index(url, declared, options.storage_options, options.retry)
    union = open_union_storage(url, shards, options, index)
    finals = None
    try:
        states: list[tuple[CommitRecord, Mapping[str, Any]]] = list(union.shard_states(range(count)))
        if union.config.derive_next:
            bases = Schema({base: union.schema[base] for base in union.config.derive_next})
            finals = open_union_storage(url, [finals_url(shard) for shard in shards],
                                        replace(options, cache_bytes=finals_cache(bases, union.layout.num_envs)))
    except BaseException:
        close_all(union, finals)
        raise
    return union, finals, states


def sharded_root(url: str, storage_options: Mapping[str, Any] | None,
                 retry: RetryPolicy | None) -> tuple[ShardedRoot, ChunkStore] | None:
    """``(its declaration, root store)`` when ``url`` is a sharded buffer's root, else None.
    Raises CorruptBufferError for a damaged declaration."""
    check_location(url)
    if is_local(url) and not os.path.isdir(local_path(url)):
        return None
    store = root_store(url, storage_options, retry)
    root = read_sharded_root(store, url)
    return None if root is None else (root, store)


def shard_plans(plans: list[NewStorage], url: str, shard: int) -> list[NewStorage]:
    """The storages of a new buffer planned at ``url``, placed in shard ``shard`` instead."""
    root, inside = url.rstrip("/"), shard_url(url, shard)
    return [replace(plan, url=inside + plan.url[len(root):]) for plan in plans]


def open_learner(cls: type[ReplayBuffer], url: str, mode: str, root: tuple[ShardedRoot, ChunkStore],
                 options: Options, sampler: Sampler | None, seed: int | None,
                 limiter: RateLimiter | None) -> ReplayBuffer:
    """The union of every shard of the sharded buffer at ``url``, for a learner (`ReplayBuffer.open`)."""
    declared, store = root
    if mode != "r":
        raise ValueError(f"{url!r} is a sharded buffer: open it with mode='r' (the union of its shards) "
                         f"or write one shard with dr.ReplayBuffer.open_shard(url, shard=i)")
    union, finals, states = open_union(url, declared, options)
    try:
        opening = LearnerOpening(union, finals, states, Progress(store, url, declared), limiter)
        return cls(opening, sampler or Uniform(), np.random.default_rng(seed), options.retry)
    except BaseException:
        close_all(union, finals)
        raise


def open_writer(cls: type[ReplayBuffer], url: str, shard: int, mode: str, limiter: RateLimiter | None,
                open_options: Mapping[str, Any]) -> ReplayBuffer:
    """Shard ``shard`` of the sharded buffer at ``url`` (`ReplayBuffer.open_shard`)."""
    if open_options.get("capacity") is not None:
        raise ValueError(f"{url!r}: capacity= is not supported for a shard (the shards of a buffer share one config)")
    root = sharded_root(url, open_options.get("storage_options"), open_options.get("retry"))
    if root is None:
        raise NotABufferError(f"{url!r} is not a sharded buffer (made by dr.ReplayBuffer.create(..., shards=N))")
    declared, store = root
    check_shard(shard, declared.count, url)
    check_shard_directory(url, shard)
    actor = None if limiter is None else ActorLimit(limiter, Progress(store, url, declared), shard)
    index = commit_index(url, declared, open_options.get("storage_options"), open_options.get("retry"))
    announcer = index.of_shard(shard) if index is not None and mode == "r+" else None
    return open_buffer(cls, shard_url(url, shard), mode, actor, announcer=announcer, **open_options)


def open_buffer(cls: type[ReplayBuffer], path: str | os.PathLike[str], mode: str, actor: ActorLimit | None, *,
                sampler: Sampler | None = None, storage_options: Mapping[str, Any] | None = None,
                cache_bytes: int = DEFAULT_CACHE_BYTES, io_threads: int | None = None,
                memory_map: bool | None = None, break_lock: bool = False, retry: RetryPolicy | None = None,
                continue_episodes: bool = False, seed: int | None = None,
                rate_limiter: RateLimiter | None = None, lease_s: float | None = None,
                at_commit: int | str | None = None, capacity: int | None = None,
                announcer: Announcer | None = None) -> ReplayBuffer:
    """The buffer at ``path`` (`ReplayBuffer.open`), or the union of its shards if it is a sharded
    buffer; ``actor`` and ``announcer``: a shard writer's rate limit and commit index
    (`open_writer`); ``at_commit``: read-only, held at that commit (not for a sharded buffer's
    union: its shards commit on their own); ``capacity``: a ring's new capacity, changed first
    (`resize`)."""
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    if at_commit is not None and mode != "r":
        raise ValueError(f"at_commit= opens a buffer read-only, as of that commit: use mode='r', not {mode!r}")
    url = os.fspath(path)
    check_open_options(io_threads, memory_map, retry, storage_options, sampler, rate_limiter)
    options = Options(storage_options, cache_bytes, io_threads, memory_map, break_lock, retry, lease_s, announcer)
    if capacity is not None:
        resize(cls, url, mode, capacity, options, sampler)
    root = None
    try:
        opened = open_storages(url, mode, options, at_commit)
    except NotABufferError:  # perhaps the root of a sharded buffer (it has no commit of its own)
        root = sharded_root(url, storage_options, retry)
        if root is None:
            raise
    if root is not None and at_commit is not None:
        raise ValueError(f"{url!r} is a sharded buffer: its shards commit on their own, so it has no commit "
                         f"{at_commit!r}; open a shard's location ({shard_url(url, 0)!r}, ...) with at_commit=")
    if root is not None:
        return open_learner(cls, url, mode, root, options, sampler, seed, rate_limiter)
    return open_single(cls, url, mode, opened, sampler, retry, continue_episodes, seed, rate_limiter, actor)


def create_sharded(cls: type[ReplayBuffer], plans: list[NewStorage], url: str, shards: Any, commit: bool,
                   overwrite: bool, options: Options, sampler: Sampler | None, seed: int | None) -> ReplayBuffer:
    """Create every shard of a buffer planned at ``url``, then declare the root; return the
    union, read-only (`ReplayBuffer.create` with ``shards``). Raises ValueError for ``shards``
    (or ``commit=False``) before anything is touched; BufferExistsError, LockedError."""
    count = check_shards(shards, commit)
    prepare_location(url, options.storage_options, overwrite, options.break_lock, options.retry)
    for shard in range(count):
        storage, finals = create_storages(shard_plans(plans, url, shard), options, True)
        cls(BufferOpening(storage, finals), Uniform(), np.random.default_rng(), options.retry).close()
    store = root_store(url, options.storage_options, options.retry)
    declare_shards(store, count)
    return open_learner(cls, url, "r", (ShardedRoot(count, index=True), store), options, sampler, seed, None)
