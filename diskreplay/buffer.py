"""`ReplayBuffer`: storage + sampler + a random generator, and the public API around them."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import fsspec
import numpy as np

from . import snapshot, transitions
from .chunkstore import is_local, local_path
from .derived import EpisodicReturn, RowView, derived_next_fields
from .episodes import EpisodeIndex, EpisodeTable
from .errors import BufferExistsError, CorruptBufferError, EmptyBufferError, SchemaError, StaleReadError
from .lanes import flat_to_lane_step, row_ids, split_row_ids
from .lock import check_unlocked
from .sampling import Draw, Sampler, Uniform, sampler_from_state
from .schema import Field, Schema
from .storage import COMMIT_KEY, DEFAULT_CACHE_BYTES, Storage
from .transitions import HER

STATE_PREFIX = "state/"
STALE_READ_RETRIES = 3
BATCH_EXTRAS = ("index", "weight")
"""Arrays a batch holds besides the fields, which ``out=`` may also provide."""
FINALS_PATH = "final"
FINALS_CHUNK_ROWS = 64
FINALS_CACHE_BYTES = 32 * 2**20


class ReplayBuffer:
    """A replay buffer whose rows live in a Zarr v3 group on disk or any fsspec URL.

    Rows are identified by *row ids*: ``step * num_envs + lane``, where ``step`` counts every step
    ever added to that env lane. With one lane, row id ``i`` is the ``i``-th row ever added. In a
    ring (``capacity`` set) a row id stays valid until its row is overwritten; reading an
    overwritten id raises IndexError. Use `create` or `open` to get one.
    """

    def __init__(self, storage: Storage, sampler: Sampler, rng: np.random.Generator,
                 finals: Storage | None = None):
        self.storage = storage
        self.sampler = sampler
        self.rng = rng
        config = storage.config
        self.episode_index = EpisodeIndex(storage.layout.num_envs, tuple(config.get("episode_end", ())))
        derived = {f"next_{base}": base for base in config.get("derive_next", ())}
        logical = dict(storage.schema.fields)
        logical.update({twin: storage.schema[base] for twin, base in derived.items()})
        self.view = RowView(storage, self.episode_index, Schema(logical), derived, finals)
        spec = config.get("episodic_return")
        self.episodic_return = EpisodicReturn.from_json(spec) if spec else None
        self._inputs = Schema({name: field for name, field in logical.items()
                               if not spec or name != spec["name"]})
        sampler.attach(storage.layout)
        self._closed = False

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def create(cls, url: str | os.PathLike, fields: Mapping[str, Field], capacity: int | None = None, *,
               num_envs: int = 1, chunk_rows: int = 4096, compression: str | None = "zstd",
               compression_level: int = 3, sampler: Sampler | None = None, seed: int | None = None,
               storage_options: dict | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
               io_threads: int | None = None, overwrite: bool = False,
               episode_end: str | tuple[str, ...] | None = "auto", derive_next: tuple[str, ...] = (),
               episodic_return: EpisodicReturn | None = None, commit: bool = True,
               memory_map: bool | None = None, break_lock: bool = False) -> "ReplayBuffer":
        """Create an empty buffer at ``url`` (a local path, ``file://``, ``s3://``, ``memory://``...).

        Args:
            fields: name -> `Field` (per-step shape and dtype).
            capacity: total rows kept (a ring over all lanes: ``capacity // num_envs`` per lane, must
                divide evenly); ``None`` grows without bound (dataset mode).
            num_envs: number of env lanes; each is its own time-ordered stream.
            chunk_rows: steps per stored chunk (the unit of I/O and caching).
            compression: ``"zstd"``, ``"lz4"`` (blosc) or ``None`` (raw chunks).
            sampler: how `sample` picks rows; `Uniform` by default.
            seed: seed of the buffer's own ``numpy.random.Generator``.
            storage_options: passed to fsspec for remote URLs.
            cache_bytes: bound on decoded chunks kept in RAM (bytes).
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
                the buffer's rows do not fit in ``cache_bytes``, where mapping is faster.
            break_lock: remove a stale writer lock (a writer that was killed) before taking it.

        Raises:
            BufferExistsError: a buffer (or other files) exist at ``url`` and ``overwrite`` is False.
            ValueError: a non-positive capacity, chunk_rows or num_envs, or capacity not divisible
                by num_envs; SchemaError for bad fields.
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
        lane_capacity = _lane_capacity(capacity, num_envs, chunk_rows)
        _prepare_location(url, storage_options, overwrite, break_lock)
        common = dict(num_envs=num_envs, compression=compression, level=compression_level,
                      storage_options=storage_options, io_threads=io_threads, extra={},
                      memory_map=memory_map, break_lock=break_lock)
        storage = Storage.create(
            url, Schema(stored), lane_capacity=lane_capacity,
            chunk_rows=min(chunk_rows, lane_capacity or chunk_rows), cache_bytes=cache_bytes,
            options={"episode_end": list(end_fields), "derive_next": list(derived.values()),
                     "episodic_return": episodic_return.to_json() if episodic_return else None},
            commit=commit, **common)
        finals = None
        if derived:
            finals = Storage.create(_finals_url(url), Schema({base: user[base] for base in derived.values()}),
                                    lane_capacity=None, chunk_rows=FINALS_CHUNK_ROWS,
                                    cache_bytes=FINALS_CACHE_BYTES, **common)
        buf = cls(storage, sampler or Uniform(), np.random.default_rng(seed), finals)
        if commit:
            buf.flush()
        return buf

    @classmethod
    def open(cls, url: str | os.PathLike, mode: str = "r", *, sampler: Sampler | None = None,
             storage_options: dict | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
             io_threads: int | None = None, memory_map: bool | None = None, break_lock: bool = False) -> "ReplayBuffer":
        """Open an existing buffer: ``mode="r+"`` to resume writing, ``"r"`` read-only.

        The sampler and generator state saved with the last commit are restored, so a resumed run
        draws exactly what an uninterrupted one would have. ``sampler`` is only needed for sampler
        types the buffer cannot rebuild from its saved state. ``memory_map`` and ``break_lock``:
        as in `create`.

        Raises:
            NotABufferError: nothing (or something else) is stored at ``url``.
            CorruptBufferError: the metadata or arrays contradict each other.
            LockedError: ``mode="r+"`` and another writer holds the buffer.
            ValueError: ``mode`` is not "r" or "r+".
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        url = os.fspath(url)
        options = dict(mode=mode, storage_options=storage_options, io_threads=io_threads,
                       memory_map=memory_map, break_lock=break_lock)
        storage = Storage.open(url, cache_bytes=cache_bytes, **options)
        finals = None
        if storage.config.get("derive_next"):
            finals = Storage.open(_finals_url(url), cache_bytes=FINALS_CACHE_BYTES, **options)
        state = _load_committed_state(storage)
        buf = cls(storage, sampler or sampler_from_state(state.get("sampler")), np.random.default_rng(), finals)
        if state:
            buf._load_state(state)
        if finals is not None and mode == "r+":
            finals.rewind(buf.episode_index.ended())
        return buf

    # ---- properties ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def fields(self) -> dict[str, Field]:
        """Every field a row has, derived ones included."""
        return dict(self.view.schema.fields)

    @property
    def capacity(self) -> int | None:
        cap = self.storage.layout.lane_capacity
        return None if cap is None else cap * self.num_envs

    @property
    def num_envs(self) -> int:
        return self.storage.layout.num_envs

    @property
    def mode(self) -> str:
        return self.storage.mode

    def __len__(self) -> int:
        lo, hi = self.storage.window()
        return int((hi - lo).sum())

    def __repr__(self) -> str:
        return (f"ReplayBuffer({self.url!r}, rows={len(self)}, capacity={self.capacity}, "
                f"num_envs={self.num_envs}, mode={self.mode!r})")

    # ---- writing ---------------------------------------------------------------------------

    def add(self, env_ids: Any = None, **step: Any) -> None:
        """Add one step: every field given as a keyword, shaped ``field.shape``.

        With ``num_envs > 1`` each value has a leading env axis: ``(num_envs, *field.shape)``, or
        ``(len(env_ids), *field.shape)`` when ``env_ids`` names a subset of lanes.

        Raises:
            SchemaError: missing/unknown field, wrong shape, unsafe dtype, bad env_ids.
            ReadOnlyError: the buffer was opened with mode="r".
        """
        self.storage._require_writable()
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
        than the capacity keeps its last rows.

        Raises:
            SchemaError: missing/unknown field, wrong shape, unsafe dtype, mismatched leading axes.
            ReadOnlyError: the buffer was opened with mode="r".
        """
        self.storage._require_writable()
        count = _leading(data, self._inputs)
        if self.num_envs == 1 and env_ids is None:
            rows = self._inputs.rows(data, lead=(count,))
            self._append(np.array([0]), {k: v[:, None] for k, v in rows.items()}, count)
            return
        lanes = self._env_ids(env_ids)
        rows = self._inputs.rows(data, lead=(count, len(lanes)))
        self._append(lanes, rows, count)

    def _append(self, lanes: np.ndarray, rows: dict[str, np.ndarray], count: int) -> None:
        for j, lane in enumerate(lanes.tolist()):
            lane_rows = {k: v[:, j] for k, v in rows.items()}
            if self.episodic_return is not None:
                self.episodic_return.fill(self.storage, self.episode_index, lane, lane_rows,
                                          self.episode_index.end_flags(lane_rows))
            stored = {k: v for k, v in lane_rows.items() if k not in self.view.derived}
            first, end = self.storage.append(lane, stored, count)
            self.sampler.on_append(lane, first, end)
            # all rows, also those a ring drops at once: an end just before the oldest kept step
            # tells that the kept steps start an episode
            self.episode_index.on_append(lane, end - count, lane_rows)
            self.view.record(lane, end - count, lane_rows)
        for storage in self._storages():
            if storage.sealed:
                storage.write_sealed(durable=False)

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

    def flush(self, durable: bool = True) -> None:
        """Write every staged row and commit: after it returns, a crash loses none of them.

        ``durable=True`` fsyncs data and metadata on local disk before the commit completes.

        Raises:
            ReadOnlyError: the buffer was opened with mode="r".
        """
        self.storage._require_writable()
        self.episode_index.prune(self.storage.window()[0])
        state_meta, arrays = snapshot.split(self._state())
        previous = self.storage.commit_record.extra.get("state_arrays")
        key = None
        if arrays:
            key = f"{STATE_PREFIX}{self.storage.commit_record.sequence + 1:012d}.safetensors"
            self.storage.store.put(key, snapshot.arrays_to_bytes(arrays), durable)
        if self.view.finals is not None:
            self.view.finals.flush(durable)
        self.storage.flush(durable, {"state": state_meta, "state_arrays": key})
        if previous and previous != key:
            self.storage.store.delete(previous)

    def refresh(self) -> bool:
        """Read-only buffers: pick up rows committed by the writer since open. True if any."""
        changed = self.storage.refresh()
        if changed:
            if self.view.finals is not None:
                self.view.finals.refresh()
            state = _load_committed_state(self.storage)
            if state:
                self.sampler.load_state_dict(state["sampler"])
                if "episodes" in state:
                    self.episode_index.load_state_dict(state["episodes"])
                if state.get("last_next"):
                    self.view.load_state_dict(state["last_next"])
        return changed

    # ---- reading ---------------------------------------------------------------------------

    def sample(self, batch_size: int, *, seed: int | None = None, rng: np.random.Generator | None = None,
               seq_len: int | None = None, pad: bool = False, n_step: int | None = None,
               gamma: float = 0.99, stack: int | None = None, stack_fields: tuple[str, ...] = ("obs",),
               her: HER | None = None, out: dict[str, np.ndarray] | None = None, **options: Any
               ) -> dict[str, np.ndarray]:
        """A minibatch: ``{field: array [batch_size, *shape], "index": int64 row ids}``.

        Rows come from the buffer's sampler (uniform with replacement by default) over every row
        added so far, staged or committed (read-only buffers: committed rows). Random choices
        use ``rng``, else a generator seeded with ``seed``, else the buffer's own generator.
        Prioritized samplers add ``"weight"`` (float32 importance weights) and take ``beta=``.
        ``recent_rows=c`` (Uniform) draws from the newest ``c`` rows only (ERE).

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

        Raises:
            ValueError: batch_size <= 0; ``out`` with a name, dtype or shape that does not fit, or
                combined with seq_len/n_step/stack/her.
            EmptyBufferError: the buffer holds no rows.
        """
        if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if out is not None:
            if seq_len is not None or n_step is not None or stack is not None or her is not None:
                raise ValueError("out= works for plain transitions only, not with seq_len, n_step, stack or her")
            self._check_out_names(out)
        if rng is None:
            rng = self.rng if seed is None else np.random.default_rng(seed)
        for attempt in range(STALE_READ_RETRIES):
            try:
                return self._sample_once(rng, int(batch_size), seq_len, pad, n_step, gamma, stack,
                                         stack_fields, her, out, options)
            except StaleReadError:  # a reader behind the writer's ring: it now follows the newer commit
                if attempt == STALE_READ_RETRIES - 1:
                    raise

    def _sample_once(self, rng, batch_size, seq_len, pad, n_step, gamma, stack, stack_fields, her, out, options):
        lo, hi = self.storage.window()
        if (hi - lo).sum() == 0:  # also a reader whose newest commit retired all its rows
            raise EmptyBufferError(f"cannot sample from an empty buffer ({self.url!r} holds 0 readable rows)")
        if seq_len is not None:
            return self._sample_slices(rng, int(batch_size), seq_len, pad, lo, hi, options)
        draw = self.sampler.sample(rng, int(batch_size), lo, hi, **options)
        batch = self.view.gather(draw.lane, draw.step, out=out)
        if (n_step or stack or her) and not self.episode_index.enabled:
            raise ValueError("n_step, stack and her need episode ends: create the buffer with episode_end=")
        if her is not None and n_step is not None:
            raise ValueError("her and n_step cannot be combined: n-step rewards would ignore the relabelled goals")
        if her is not None:
            her.relabel(batch, self.view, self.episode_index, draw.lane, draw.step, lo, hi, rng)
        if n_step is not None:
            batch.update(transitions.nstep(self.view, self.episode_index, draw.lane, draw.step, hi, n_step, gamma))
        if stack is not None:
            next_step = None
            if n_step is not None:  # the next_ stack belongs to the last step of the n-step window
                next_step = np.minimum(draw.step + n_step - 1, transitions.episode_last_step(
                    self.episode_index, draw.lane, draw.step, hi))
            batch.update(transitions.frame_stack(self.view, self.episode_index, draw.lane, draw.step, lo,
                                                 stack, tuple(stack_fields), next_step=next_step))
        batch["index"] = row_ids(draw.lane, draw.step, self.num_envs)
        if draw.weight is not None:
            batch["weight"] = draw.weight
        batch.update(draw.extra)
        return _placed(batch, out)

    def _sample_slices(self, rng: np.random.Generator, batch_size: int, seq_len: int, pad: bool,
                       lo: np.ndarray, hi: np.ndarray, options: dict[str, Any]) -> dict[str, np.ndarray]:
        if not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        if not self.episode_index.enabled:
            raise ValueError("seq_len needs episode ends: create the buffer with episode_end= naming a bool field")
        draw = self._slice_starts(rng, batch_size, seq_len, pad, lo, hi, options)
        steps = draw.step[:, None] + np.arange(seq_len)
        last = np.minimum(self.episode_index.next_end(draw.lane, draw.step), hi[draw.lane] - 1)
        mask = steps <= last[:, None]
        steps = np.minimum(steps, last[:, None])
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

    def _slice_starts(self, rng, batch_size, seq_len, pad, lo, hi, options):
        """Starts of slices that fit in one episode (``pad``: any readable step may start one)."""
        if isinstance(self.sampler, Uniform) and not options and not self.sampler.recent_ratio:
            if pad:
                return self.sampler.sample(rng, batch_size, lo, hi)
            lane, first, count = self.episode_index.window_starts(lo, hi, seq_len)
            if count.sum() == 0:
                raise EmptyBufferError(f"no episode holds {seq_len} consecutive readable steps; "
                                       f"use pad=True or a shorter seq_len")
            segment, step = flat_to_lane_step(rng.integers(0, int(count.sum()), batch_size), first, first + count)
            return Draw(lane[segment], step)
        draw = self.sampler.sample(rng, batch_size, lo, hi, **options)
        for _ in range(256):
            end = np.minimum(self.episode_index.next_end(draw.lane, draw.step), hi[draw.lane] - 1)
            bad = np.zeros(batch_size, bool) if pad else draw.step + seq_len - 1 > end
            if not bad.any():
                return draw
            again = self.sampler.sample(rng, int(bad.sum()), lo, hi, **options)
            draw.lane[bad], draw.step[bad] = again.lane, again.step
            if draw.weight is not None:
                draw.weight[bad] = again.weight
        raise EmptyBufferError(f"could not draw slices of {seq_len} steps inside one episode; "
                               f"use pad=True or a shorter seq_len")

    def as_dataset(self, batch_size: int, mode: str = "sample", **options: Any):
        """A torch ``IterableDataset`` of collated batches over this buffer's committed rows.

        ``mode="sample"``: endless batches from the buffer's sampler; ``"epoch"``: every row once
        per epoch. Options and resume semantics: `diskreplay.torch_data.make_dataset`.
        """
        from .torch_data import make_dataset

        return make_dataset(self, batch_size, mode, **options)

    def update_priorities(self, index: Any, td_errors: Any) -> int:
        """Set the priorities of rows (by row id, e.g. ``batch["index"]``) from TD errors.

        Priorities become ``(|td| + eps) ** alpha``. Ids of rows overwritten since they were
        sampled are ignored. Returns the number of rows updated.

        Raises:
            TypeError: the buffer's sampler has no priorities.
            ValueError: NaN/inf TD errors, or not one TD error per index.
            IndexError: a negative id.
        """
        update = getattr(self.sampler, "update_priorities", None)
        if update is None:
            raise TypeError(f"update_priorities needs a prioritized sampler; this buffer uses "
                            f"{type(self.sampler).__name__}")
        ids = np.asarray(index).reshape(-1)
        if ids.dtype.kind not in "iu" or (ids < 0).any():
            raise IndexError(f"row ids must be non-negative integers, got {ids[:5]}... (dtype {ids.dtype})")
        lane, step = split_row_ids(ids.astype(np.int64), self.num_envs)
        lo, hi = self.storage.window()
        return update(lane, step, td_errors, lo, hi)

    def episodes(self) -> EpisodeTable:
        """Every episode with readable rows: lane, start step, length, complete (ended and its
        first step not overwritten). Rows of an episode are row ids ``(start + i) * num_envs + lane``."""
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
        rows = self.view.gather(np.full(length, lane), steps)
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
            IndexError: an id that is negative, not yet added, or already overwritten.
            ValueError: ``out`` with a name, dtype or shape that does not fit.
        """
        if out is not None:
            self._check_out_names(out)
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise IndexError(f"row ids must be integers, got dtype {arr.dtype}")
        flat = arr.reshape(-1).astype(np.int64)
        lane, step = split_row_ids(flat, self.num_envs)
        lo, hi = self.storage.window()
        bad = (flat < 0) | (step < lo[lane]) | (step >= hi[lane])
        if bad.any():
            first = int(flat[bad][0])
            raise IndexError(f"row id {first} is not in the buffer (readable ids per lane: steps "
                             f"{lo.tolist()} to {(hi - 1).tolist()}, id = step * {self.num_envs} + lane)")
        rows = self.view.gather(lane, step, out=out)
        if arr.ndim == 1:
            return rows
        return {k: v.reshape(arr.shape + v.shape[1:]) for k, v in rows.items()}

    def _check_out_names(self, out: Mapping[str, np.ndarray]) -> None:
        unknown = sorted(set(out) - set(self.fields) - set(BATCH_EXTRAS))
        if unknown:
            raise ValueError(f"out: unknown names {unknown}; expected fields {sorted(self.fields)} "
                             f"or {', '.join(map(repr, BATCH_EXTRAS))}")

    def row_ids(self) -> np.ndarray:
        """Every readable row id, lane by lane in time order (int64)."""
        lo, hi = self.storage.window()
        return np.concatenate([row_ids(lane, np.arange(lo[lane], hi[lane]), self.num_envs)
                               for lane in range(self.num_envs)])

    # ---- state -----------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "sampler": self.sampler.state_dict(),
                "episodes": self.episode_index.state_dict(), "last_next": self.view.state_dict()}

    def _load_state(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.sampler.load_state_dict(state["sampler"])
        if "episodes" in state:
            self.episode_index.load_state_dict(state["episodes"])
        if state.get("last_next"):
            self.view.load_state_dict(state["last_next"])

    def state_dict(self) -> dict[str, Any]:
        """The small in-RAM state: cursors per lane, the generator and the sampler's state."""
        return {**self._state(), "total": self.storage.total.copy()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore generator and sampler state saved by `state_dict` from this same buffer.

        Raises:
            ValueError: the state's cursors differ from the buffer's (rows were added or lost since).
        """
        total = np.asarray(state["total"])
        if not np.array_equal(total, self.storage.total):
            raise ValueError(f"state is for a buffer with {total.tolist()} steps per lane; this buffer "
                             f"has {self.storage.total.tolist()}")
        self._load_state(state)

    def save_snapshot(self, directory: str | os.PathLike) -> None:
        """Write `state_dict` to ``directory``: ``state.safetensors`` (arrays) + ``state.json``."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        meta, arrays = snapshot.split(self.state_dict())
        with open(os.path.join(directory, "state.safetensors"), "wb") as f:
            f.write(snapshot.arrays_to_bytes(arrays))
        with open(os.path.join(directory, "state.json"), "w") as f:
            json.dump({"url": self.url, "state": meta}, f)

    @classmethod
    def load_snapshot(cls, directory: str | os.PathLike, mode: str = "r+", *, url: str | None = None,
                      **open_options: Any) -> "ReplayBuffer":
        """Open the buffer a snapshot was taken of (or ``url``) and restore the snapshot's state."""
        directory = os.fspath(directory)
        with open(os.path.join(directory, "state.json")) as f:
            saved = json.load(f)
        with open(os.path.join(directory, "state.safetensors"), "rb") as f:
            arrays = snapshot.arrays_from_bytes(f.read())
        buf = cls.open(url or saved["url"], mode, **open_options)
        buf.load_state_dict(snapshot.join(saved["state"], arrays))
        return buf

    # ---- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Flush (writers) and release threads. Idempotent."""
        if self._closed:
            return
        if self.mode != "r":
            self.flush()
        for storage in self._storages():
            storage.close()
        self._closed = True

    def _storages(self) -> list[Storage]:
        return [self.storage] + ([self.view.finals] if self.view.finals is not None else [])

    def __enter__(self) -> "ReplayBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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


def _lane_capacity(capacity: int | None, num_envs: int, chunk_rows: int) -> int | None:
    if not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
        raise ValueError(f"num_envs must be an int >= 1, got {num_envs!r}")
    if not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}")
    if capacity is None:
        return None
    if not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
    if capacity % num_envs:
        raise ValueError(f"capacity must be a multiple of num_envs={num_envs}, got {capacity}")
    return int(capacity // num_envs)


def _leading(data: Mapping[str, Any], schema: Schema) -> int:
    """N, the steps in an extend: the leading size most fields with a step axis agree on."""
    sizes = {name: int(np.shape(data[name])[0]) for name, field in schema.items()
             if name in data and np.ndim(data[name]) > len(field.shape)}
    if not sizes:
        raise SchemaError(f"extend expects arrays with a leading step axis (N, *field.shape); got shapes "
                          f"{ {name: np.shape(value) for name, value in data.items()} }")
    counts = list(sizes.values())
    return max(counts, key=counts.count)  # the odd field out is then named by the schema check


def _prepare_location(url: str, storage_options: dict | None, overwrite: bool, break_lock: bool) -> None:
    if is_local(url):
        path = local_path(url)
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            if not overwrite:
                raise BufferExistsError(f"{url!r} already exists; pass overwrite=True to replace it")
            _require_buffer_or_empty(path)
            check_unlocked(url, storage_options, break_lock)
            shutil.rmtree(path)
        return
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if fs.exists(f"{root}/{COMMIT_KEY}") or fs.exists(f"{root}/zarr.json"):
        if not overwrite:
            raise BufferExistsError(f"{url!r} already holds a buffer; pass overwrite=True to replace it")
        check_unlocked(url, storage_options, break_lock)
        fs.rm(root, recursive=True)


def _require_buffer_or_empty(path: str) -> None:
    if not os.path.exists(os.path.join(path, COMMIT_KEY)) and not os.path.exists(os.path.join(path, "zarr.json")):
        raise BufferExistsError(f"{path!r} exists and is not a diskreplay buffer; refusing to delete it")


def _load_committed_state(storage: Storage) -> dict[str, Any]:
    """The sampler/RNG/episode state saved with the storage's commit (empty for a new buffer).

    A reader may race the writer: the commit it read names a state object the writer has since
    replaced. It then adopts the newer commit and reads that one's state.
    """
    for _ in range(10):
        extra = storage.commit_record.extra
        if "state" not in extra:
            return {}
        key = extra.get("state_arrays")
        blob = storage.store.get(key) if key else b""
        if blob is not None:
            return snapshot.join(extra["state"], snapshot.arrays_from_bytes(blob) if key else {})
        if storage.mode != "r" or not storage.refresh():
            break
    raise CorruptBufferError(f"{storage.url!r}: state object {key!r} is missing (the last commit names it)")


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
    return f"{url.rstrip('/')}/{FINALS_PATH}"


def _check_episodic_return(spec: EpisodicReturn, user: Schema) -> None:
    if spec.name in user.fields:
        raise SchemaError(f"episodic_return: field {spec.name!r} is computed by the buffer; "
                          f"remove it from fields or choose another name")
    if spec.reward not in user.fields or user[spec.reward].shape != ():
        raise SchemaError(f"episodic_return: expected a scalar reward field {spec.reward!r}, "
                          f"got {user.fields.get(spec.reward)}")
