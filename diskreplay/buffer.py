"""`ReplayBuffer`: storage + sampler + a random generator, and the public API around them."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import fsspec
import numpy as np

from . import snapshot
from .chunkstore import is_local, local_path
from .errors import BufferExistsError, EmptyBufferError, SchemaError
from .lanes import row_ids, split_row_ids
from .sampling import Sampler, Uniform
from .schema import Field, Schema
from .storage import COMMIT_KEY, DEFAULT_CACHE_BYTES, Storage

STATE_PREFIX = "state/"


class ReplayBuffer:
    """A replay buffer whose rows live in a Zarr v3 group on disk or any fsspec URL.

    Rows are identified by *row ids*: ``step * num_envs + lane``, where ``step`` counts every step
    ever added to that env lane. With one lane, row id ``i`` is the ``i``-th row ever added. In a
    ring (``capacity`` set) a row id stays valid until its row is overwritten; reading an
    overwritten id raises IndexError. Use `create` or `open` to get one.
    """

    def __init__(self, storage: Storage, sampler: Sampler, rng: np.random.Generator):
        self.storage = storage
        self.sampler = sampler
        self.rng = rng
        sampler.attach(storage.layout)
        self._closed = False

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def create(cls, url: str | os.PathLike, fields: Mapping[str, Field], capacity: int | None = None, *,
               num_envs: int = 1, chunk_rows: int = 4096, compression: str | None = "zstd",
               compression_level: int = 3, sampler: Sampler | None = None, seed: int | None = None,
               storage_options: dict | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
               io_threads: int = 8, overwrite: bool = False) -> "ReplayBuffer":
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
            io_threads: concurrent chunk reads/writes.
            overwrite: replace an existing buffer at ``url``.

        Raises:
            BufferExistsError: a buffer (or other files) exist at ``url`` and ``overwrite`` is False.
            ValueError: a non-positive capacity, chunk_rows or num_envs, or capacity not divisible
                by num_envs; SchemaError for bad fields.
        """
        url = os.fspath(url)
        schema = Schema(fields)
        lane_capacity = _lane_capacity(capacity, num_envs, chunk_rows)
        _prepare_location(url, storage_options, overwrite)
        sampler = sampler or Uniform()
        storage = Storage.create(
            url, schema, num_envs=num_envs, lane_capacity=lane_capacity,
            chunk_rows=min(chunk_rows, lane_capacity or chunk_rows), compression=compression,
            level=compression_level, storage_options=storage_options, cache_bytes=cache_bytes,
            io_threads=io_threads, extra={})
        buf = cls(storage, sampler, np.random.default_rng(seed))
        buf.flush()
        return buf

    @classmethod
    def open(cls, url: str | os.PathLike, mode: str = "r", *, sampler: Sampler | None = None,
             storage_options: dict | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
             io_threads: int = 8) -> "ReplayBuffer":
        """Open an existing buffer: ``mode="r+"`` to resume writing, ``"r"`` read-only.

        The sampler and generator state saved with the last commit are restored, so a resumed run
        draws exactly what an uninterrupted one would have. ``sampler`` is only needed for sampler
        types the buffer cannot rebuild from its saved state.

        Raises:
            NotABufferError: nothing (or something else) is stored at ``url``.
            CorruptBufferError: the metadata or arrays contradict each other.
            ValueError: ``mode`` is not "r" or "r+".
        """
        if mode not in ("r", "r+"):
            raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
        url = os.fspath(url)
        storage = Storage.open(url, mode=mode, storage_options=storage_options,
                               cache_bytes=cache_bytes, io_threads=io_threads)
        state = _load_committed_state(storage)
        buf = cls(storage, sampler or _sampler_from_state(state.get("sampler")), np.random.default_rng())
        if state:
            buf._load_state(state)
        return buf

    # ---- properties ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def fields(self) -> dict[str, Field]:
        return dict(self.storage.schema.fields)

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
            rows = self.storage.schema.rows(step, lead=())
            self._append(np.array([0]), {k: v[None, None] for k, v in rows.items()}, 1)
            return
        lanes = self._env_ids(env_ids)
        rows = self.storage.schema.rows(step, lead=(len(lanes),))
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
        count = _leading(data)
        if self.num_envs == 1 and env_ids is None:
            rows = self.storage.schema.rows(data, lead=(count,))
            self._append(np.array([0]), {k: v[:, None] for k, v in rows.items()}, count)
            return
        lanes = self._env_ids(env_ids)
        rows = self.storage.schema.rows(data, lead=(count, len(lanes)))
        self._append(lanes, rows, count)

    def _append(self, lanes: np.ndarray, rows: dict[str, np.ndarray], count: int) -> None:
        for j, lane in enumerate(lanes.tolist()):
            first, end = self.storage.append(lane, {k: v[:, j] for k, v in rows.items()}, count)
            self.sampler.on_append(lane, first, end)
        if self.storage.sealed:
            self.storage.write_sealed(durable=False)

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
        """
        state_meta, arrays = snapshot.split(self._state())
        previous = self.storage.commit_record.extra.get("state_arrays")
        key = None
        if arrays:
            key = f"{STATE_PREFIX}{self.storage.commit_record.sequence + 1:012d}.safetensors"
            self.storage.store.put(key, snapshot.arrays_to_bytes(arrays), durable)
        self.storage.flush(durable, {"state": state_meta, "state_arrays": key})
        if previous and previous != key:
            self.storage.store.delete(previous)

    def refresh(self) -> bool:
        """Read-only buffers: pick up rows committed by the writer since open. True if any."""
        return self.storage.refresh()

    # ---- reading ---------------------------------------------------------------------------

    def sample(self, batch_size: int, *, seed: int | None = None, rng: np.random.Generator | None = None,
               **options: Any) -> dict[str, np.ndarray]:
        """A minibatch: ``{field: array [batch_size, *shape], "index": int64 row ids}``.

        Rows come from the buffer's sampler (uniform with replacement by default) over every row
        added so far, staged or committed (read-only buffers: committed rows). Random choices
        use ``rng``, else a generator seeded with ``seed``, else the buffer's own generator.

        Raises:
            ValueError: batch_size <= 0.
            EmptyBufferError: the buffer holds no rows.
        """
        if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        lo, hi = self.storage.window()
        if (hi - lo).sum() == 0:
            raise EmptyBufferError(f"cannot sample from an empty buffer ({self.url!r} holds 0 rows)")
        if rng is None:
            rng = self.rng if seed is None else np.random.default_rng(seed)
        draw = self.sampler.sample(rng, int(batch_size), lo, hi, **options)
        batch = self.storage.gather(draw.lane, draw.step)
        batch["index"] = row_ids(draw.lane, draw.step, self.num_envs)
        if draw.weight is not None:
            batch["weight"] = draw.weight
        batch.update(draw.extra)
        return batch

    def __getitem__(self, ids: Any) -> dict[str, np.ndarray]:
        """Rows by row id (an int or a 1-D int array): ``{field: array}``.

        Raises:
            IndexError: an id that is negative, not yet added, or already overwritten.
        """
        arr = np.asarray(ids)
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
        rows = self.storage.gather(lane, step)
        return {k: v.reshape(arr.shape + v.shape[1:]) for k, v in rows.items()}

    def row_ids(self) -> np.ndarray:
        """Every readable row id, lane by lane in time order (int64)."""
        lo, hi = self.storage.window()
        return np.concatenate([row_ids(lane, np.arange(lo[lane], hi[lane]), self.num_envs)
                               for lane in range(self.num_envs)])

    # ---- state -----------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state, "sampler": self.sampler.state_dict()}

    def _load_state(self, state: Mapping[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.sampler.load_state_dict(state["sampler"])

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
        self.storage.close()
        self._closed = True

    def __enter__(self) -> "ReplayBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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


def _leading(data: Mapping[str, Any]) -> int:
    for value in data.values():
        shape = np.shape(value)
        if not shape:
            raise SchemaError("extend expects arrays with a leading step axis, got a scalar")
        return int(shape[0])
    raise SchemaError("extend got no fields")


def _prepare_location(url: str, storage_options: dict | None, overwrite: bool) -> None:
    if is_local(url):
        path = local_path(url)
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            if not overwrite:
                raise BufferExistsError(f"{url!r} already exists; pass overwrite=True to replace it")
            _require_buffer_or_empty(path)
            shutil.rmtree(path)
        return
    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if fs.exists(f"{root}/{COMMIT_KEY}") or fs.exists(f"{root}/zarr.json"):
        if not overwrite:
            raise BufferExistsError(f"{url!r} already holds a buffer; pass overwrite=True to replace it")
        fs.rm(root, recursive=True)


def _require_buffer_or_empty(path: str) -> None:
    if not os.path.exists(os.path.join(path, COMMIT_KEY)) and not os.path.exists(os.path.join(path, "zarr.json")):
        raise BufferExistsError(f"{path!r} exists and is not a diskreplay buffer; refusing to delete it")


def _load_committed_state(storage: Storage) -> dict[str, Any]:
    extra = storage.commit_record.extra
    if "state" not in extra:
        return {}
    arrays = {}
    if extra.get("state_arrays"):
        blob = storage.store.get(extra["state_arrays"])
        if blob is None:
            from .errors import CorruptBufferError
            raise CorruptBufferError(f"{storage.url!r}: state object {extra['state_arrays']!r} is missing")
        arrays = snapshot.arrays_from_bytes(blob)
    return snapshot.join(extra["state"], arrays)


SAMPLER_TYPES: dict[str, type] = {"Uniform": Uniform}


def _sampler_from_state(state: Mapping[str, Any] | None) -> Sampler:
    if not state:
        return Uniform()
    kind = SAMPLER_TYPES.get(state.get("type", "Uniform"))
    if kind is None:
        raise ValueError(f"the buffer was saved with sampler {state.get('type')!r}; pass sampler= to open")
    return kind.from_state_dict(state) if hasattr(kind, "from_state_dict") else kind()
