"""Import offline datasets into a diskreplay buffer: D4RL HDF5, Minari, .npz / .npy, Zarr.

`import_dataset` streams the source in slices of ``batch_rows`` rows, so a source larger than
RAM imports with bounded memory (about two slices plus the buffer's write staging).

Field names produced (one mapping, `d4rl_field_name`, for every format that names columns):

* D4RL layout (``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts``, optional
  ``next_observations``, ``infos/*``), as HDF5 datasets or ``.npz`` members: ``obs``, ``action``,
  ``reward``, ``terminated``, ``truncated``, ``next_obs``, ``info_<key>``; any other column with
  one entry per step keeps its (sanitized) name, ``group/key`` becoming ``group_key``.
  ``terminals`` and ``timeouts`` are stored as bool. Format ``"d4rl"`` (an HDF5 file, or an
  ``.npz`` given ``format="d4rl"``) also derives ``next_obs`` when ``next_observations`` is
  missing: ``next_obs[t] = observations[t + 1]`` inside an episode; at an episode's last step
  (``terminals`` or ``timeouts`` set) and at the dataset's last row, ``observations[t + 1]``
  belongs to another episode (or does not exist), so ``next_obs[t]`` is a copy of ``obs[t]``. For
  terminated steps this is harmless (TD targets mask it with ``1 - terminated``); for truncated
  steps the true next observation is simply not in the source: drop or mask those rows if
  bootstrapping from them matters. Files written by `diskreplay export` (HDF5 attribute or zip
  comment ``diskreplay_export``) get no derived field: they round-trip.
* Minari (``<dir>/data/main_data.hdf5``, one ``episode_<id>`` group per episode, in id order):
  ``observations[:-1]`` -> ``obs``, ``observations[1:]`` -> ``next_obs``, ``actions`` ->
  ``action``, ``rewards`` -> ``reward``, ``terminations`` -> ``terminated``, ``truncations`` ->
  ``truncated``, ``infos/<key>`` -> ``info_<key>``. Dict (nested) spaces are flattened:
  ``obs_<key>``, ``next_obs_<key>``, ``action_<key>``, ``obs_<key>_<subkey>``. Infos with T + 1
  entries (the reset's info first) keep their last T, so each row holds its step's info.
* ``.npz`` file (format ``"npz"``), folder of ``.npy`` files, plain Zarr group: one field per
  array, named by the D4RL mapping above (``observations`` -> ``obs``, ``terminals`` -> bool
  ``terminated``, ``infos/<key>`` -> ``info_<key>``, other names sanitized); no field is derived.
* Zarr: a diskreplay buffer keeps its fields and env lanes (rows re-chunked and re-compressed,
  only the readable window of a ring).

Refused sources (`ImportFormatError`, raised before ``dest`` is touched):

* HDF5 data outside the file: external links (anywhere in a D4RL file, anywhere under a Minari
  episode), soft links under a Minari episode (they may lead through one), datasets with external
  storage and virtual datasets. Nothing outside the source file is opened or read.
* ``.npy`` data (a file or an ``.npz`` member) shorter than its header claims (``prod(shape) *
  itemsize`` bytes), so no header can make the import allocate or read more than the data held;
  object arrays; a Fortran-ordered ``.npz`` member of more than `FORTRAN_WHOLE_BYTES` (its rows
  are not contiguous: it could only be read whole; save it C-ordered). Smaller ones are read whole.

Interrupted imports. Rows are written straight into ``dest``, but ``dest`` only becomes a buffer
at the very end: until then its commit record is written under `INCOMPLETE_KEY` instead of
``commit.json``, so `ReplayBuffer.open` of a killed import raises `NotABufferError`. An import
that fails with a Python exception removes ``dest``; one killed hard leaves it marked: import
again with ``overwrite=True``. There is no resume.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import sys
import time
import warnings
import zipfile
from contextlib import ExitStack
from typing import Any, Iterator

import numpy as np

from .buffer import ReplayBuffer
from .chunkstore import is_local, local_path, open_chunkstore
from .errors import BufferExistsError, DiskReplayError, NotABufferError
from .lock import break_lock, lock_holder
from .sampling import Uniform
from .schema import ALLOWED_DTYPES, RESERVED_NAMES, Field, Schema
from .storage import COMMIT_KEY, DEFAULT_CACHE_BYTES, INCOMPLETE_IMPORT_KEY, default_chunk_rows

FORMATS = ("d4rl", "minari", "npz", "npy", "zarr")
INCOMPLETE_KEY = INCOMPLETE_IMPORT_KEY
EXPORT_ATTR = "diskreplay_export"  # HDF5 file attribute set by `diskreplay export`
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
FORTRAN_WHOLE_BYTES = 16 * 2**20  # a Fortran-ordered .npz member up to this size is read whole, larger refused

D4RL_NAMES = {"observations": "obs", "actions": "action", "rewards": "reward", "terminals": "terminated",
              "timeouts": "truncated", "next_observations": "next_obs"}
D4RL_FLAGS = ("terminals", "timeouts")
END_FIELDS = tuple(D4RL_NAMES[k] for k in D4RL_FLAGS)
MINARI_NAMES = {"actions": "action", "rewards": "reward", "terminations": "terminated",
                "truncations": "truncated"}

Batch = dict[str, np.ndarray]


class ImportFormatError(DiskReplayError, ValueError):
    """The source is not in the format asked for (or in none that can be detected)."""


# ---- public API ------------------------------------------------------------------------------


def import_dataset(src: str | os.PathLike, dest: str | os.PathLike, *, format: str | None = None,
                   chunk_rows: int | None = None, compression: str | None = "zstd", batch_rows: int = 65536,
                   progress: bool = True, overwrite: bool = False, mode: str = "r",
                   storage_options: dict | None = None, cache_bytes: int | None = None) -> ReplayBuffer:
    """Import a dataset at ``src`` into a new dataset-mode buffer at ``dest`` and open it.

    Args:
        src: a D4RL-layout ``.hdf5`` (or ``.npz``) file, a Minari dataset folder (or its
            ``main_data.hdf5``), an ``.npz`` file, a folder of ``.npy`` files, or a diskreplay
            buffer / Zarr group. Columns are named by `d4rl_field_name` (see the module docstring).
        dest: where the buffer is written (a local path or an fsspec URL).
        format: one of `FORMATS`; ``None`` detects it from ``src`` (an ``.npz`` file is
            ``"npz"``; pass ``"d4rl"`` to also derive a missing ``next_obs``).
        chunk_rows, compression: the new buffer's chunking and codec (see `ReplayBuffer.create`);
            ``chunk_rows=None`` sizes chunks for the source's row count (`default_chunk_rows`).
        batch_rows: rows read from the source (and written) per slice: bounds memory.
        progress: show a tqdm progress bar (rows, rows/s) on stderr when tqdm is installed.
        overwrite: replace an existing buffer (or an interrupted import) at ``dest``.
        mode: mode of the returned buffer ("r", or "r+" to keep adding rows).
        storage_options: fsspec options for a remote ``dest``.
        cache_bytes: chunk cache of the returned buffer (default: the library's default).

    Returns:
        The imported buffer, opened with ``mode``.

    Raises:
        ImportFormatError: the source format is unknown or the file does not follow it.
        FileNotFoundError: ``src`` does not exist. BufferExistsError: ``dest`` exists.
        ImportError: h5py is needed (HDF5 / Minari sources) and not installed.
    """
    src, dest = os.fspath(src), os.fspath(dest)
    if not isinstance(batch_rows, (int, np.integer)) or batch_rows < 1:
        raise ValueError(f"batch_rows must be a positive int, got {batch_rows!r}")
    _require_source(src)
    fmt = format or detect_format(src)
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    with ExitStack() as stack:
        source = stack.enter_context(_open_source(fmt, src, int(batch_rows)))
        _check_destination(dest, overwrite, storage_options)
        # write staging: the chunks of two slices per lane, not the default read cache
        row_bytes = sum(f.row_bytes for f in source.fields.values())
        if chunk_rows is None:
            chunk_rows = default_chunk_rows(Schema(source.fields), source.num_envs, max(source.rows, 1),
                                            DEFAULT_CACHE_BYTES, compression is None)
        staging_chunks = 2 * -(-int(batch_rows) // max(int(chunk_rows), 1)) + 2 * source.num_envs + 2
        buf = ReplayBuffer.create(dest, source.fields, None, num_envs=source.num_envs,
                                  chunk_rows=chunk_rows, compression=compression, overwrite=overwrite,
                                  storage_options=storage_options, commit=False,
                                  cache_bytes=staging_chunks * int(chunk_rows) * row_bytes)
        store = buf.storage.store
        store.put(INCOMPLETE_KEY, json.dumps({"source": src, "format": fmt, "started": time.time(),
                                              "pid": os.getpid(), "host": socket.gethostname()}).encode(),
                  durable=True)
        try:
            with _progress(source.rows, f"import {fmt}", progress) as bar:
                for lane, batch in source.batches():
                    count = len(next(iter(batch.values())))
                    if source.num_envs == 1:
                        buf.extend(batch)
                    else:
                        buf.extend({k: v[:, None] for k, v in batch.items()}, env_ids=[lane])
                    bar.update(count)
            buf.flush()  # writes the last chunks, then the first commit.json: dest becomes a buffer here
            store.delete(INCOMPLETE_KEY)
            buf.close()
        except BaseException:
            buf.storage.close()
            _remove_failed(dest, storage_options)
            raise
    extra = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    return ReplayBuffer.open(dest, mode, storage_options=storage_options, **extra)


def detect_format(src: str) -> str:
    """Guess the format of ``src`` from its layout (see `FORMATS`).

    Raises FileNotFoundError (no such path) or ImportFormatError (nothing recognised).
    """
    if not is_local(src):
        return "zarr"
    _require_source(src)
    path = local_path(src)
    if os.path.isdir(path):
        if _minari_file(path):
            return "minari"
        if os.path.exists(os.path.join(path, "zarr.json")) or os.path.exists(os.path.join(path, COMMIT_KEY)):
            return "zarr"
        if any(name.endswith(".npy") for name in os.listdir(path)):
            return "npy"
        raise ImportFormatError(f"cannot tell the format of folder {src!r}: expected a Minari dataset "
                                f"(data/main_data.hdf5), a Zarr group (zarr.json) or .npy files")
    with open(path, "rb") as f:
        magic = f.read(8)
    if magic == HDF5_MAGIC or path.endswith((".hdf5", ".h5")):
        h5py = _h5py()
        with h5py.File(path, "r") as f:
            return "minari" if any(k.startswith("episode_") for k in f.keys()) else "d4rl"
    if magic[:2] == b"PK" or path.endswith(".npz"):
        return "npz"
    raise ImportFormatError(f"cannot tell the format of {src!r}: expected .hdf5/.h5 (D4RL or Minari), "
                            f".npz, a folder of .npy files, a Minari folder or a Zarr store; "
                            f"pass format= one of {FORMATS}")


def _require_source(src: str) -> None:
    if is_local(src) and not os.path.exists(local_path(src)):
        raise FileNotFoundError(f"source {src!r} does not exist")


def import_status(url: str, storage_options: dict | None = None) -> dict | None:
    """The marker of an interrupted import at ``url`` (source, format, started, pid, host), or None."""
    store = open_chunkstore(url, storage_options)
    if store.get(COMMIT_KEY) is not None:
        return None
    blob = store.get(INCOMPLETE_KEY)
    if blob is None:
        return None
    try:
        return json.loads(blob)
    except ValueError:
        return {"source": "?"}


def describe_incomplete(url: str, marker: dict) -> str:
    started = marker.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if started else "?"
    return (f"{url!r} holds an interrupted import (from {marker.get('source')!r}, started {when}, "
            f"pid {marker.get('pid', '?')}); it is not a usable buffer: import again with overwrite=True")


# ---- destination handling --------------------------------------------------------------------


def _check_destination(dest: str, overwrite: bool, storage_options: dict | None) -> None:
    marker = import_status(dest, storage_options)
    if marker is None:
        return
    if not overwrite:
        raise BufferExistsError(describe_incomplete(dest, marker))
    holder = lock_holder(dest, storage_options)
    if holder is not None and holder.stale_reason():
        break_lock(dest, storage_options)


def _remove_failed(dest: str, storage_options: dict | None) -> None:
    """Best effort: delete what a failed import wrote (only if it is still marked incomplete)."""
    try:
        if import_status(dest, storage_options) is None:
            return
        if is_local(dest):
            import shutil
            shutil.rmtree(local_path(dest), ignore_errors=True)
        else:
            import fsspec
            fs, root = fsspec.core.url_to_fs(dest, **(storage_options or {}))
            fs.rm(root, recursive=True)
    except Exception:
        pass


# ---- progress --------------------------------------------------------------------------------


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def __enter__(self) -> "_NoBar":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _progress(total: int | None, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit="rows", unit_scale=True, file=sys.stderr, dynamic_ncols=True)


# ---- sources ---------------------------------------------------------------------------------


class Source:
    """A dataset being read: its fields, lanes, total rows and a stream of row slices."""

    fields: dict[str, Field]
    num_envs: int = 1
    rows: int | None = None

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _open_source(fmt: str, src: str, batch_rows: int) -> Source:
    if fmt == "d4rl":
        if zipfile.is_zipfile(local_path(src)):
            return NpzSource(src, batch_rows, d4rl=True)
        return D4RLSource(src, batch_rows)
    if fmt == "minari":
        return MinariSource(src, batch_rows)
    if fmt == "npz":
        return NpzSource(src, batch_rows)
    if fmt == "npy":
        return NpyFolderSource(src, batch_rows)
    return ZarrSource(src, batch_rows)


def field_name(path: str) -> str:
    """A valid, non-reserved field name from an HDF5 path or file name."""
    name = re.sub(r"\W", "_", path.strip("/").replace("/", "_")) or "field"
    if name[0].isdigit():
        name = f"f_{name}"
    return f"{name}_" if name in RESERVED_NAMES else name


def d4rl_field_name(column: str) -> str:
    """The field a column named ``column`` (HDF5 path, ``.npz`` member or ``.npy`` file name,
    without suffix) is imported as: D4RL names mapped (``observations`` -> ``obs``, ``actions``
    -> ``action``, ``rewards`` -> ``reward``, ``terminals`` -> ``terminated``, ``timeouts`` ->
    ``truncated``, ``next_observations`` -> ``next_obs``, ``infos/<key>`` -> ``info_<key>``),
    any other name made a valid field name by `field_name`."""
    if column in D4RL_NAMES:
        return D4RL_NAMES[column]
    if column.startswith("infos/"):
        return "info_" + field_name(column[len("infos/"):])
    return field_name(column)


def _as_bool_flags(batch: Batch, fields: dict[str, Field]) -> Batch:
    """``batch`` with the values of bool fields that the source stores otherwise (D4RL
    ``terminals`` / ``timeouts`` are often float) made bool: nonzero is True."""
    for name, values in batch.items():
        if fields[name].dtype == np.bool_ and values.dtype != np.bool_:
            batch[name] = values != 0
    return batch


def _with_next_obs(slices: Iterator[Batch]) -> Iterator[Batch]:
    """Slices in row order, each given ``next_obs``: the next row's ``obs`` inside an episode, the
    row's own ``obs`` at an episode's last step (an `END_FIELDS` flag set) and at the last row."""
    held: Batch | None = None
    for batch in slices:
        if held is not None:
            yield _next_obs_filled(held, batch["obs"][:1])
        held = batch
    if held is not None:
        yield _next_obs_filled(held, None)


def _next_obs_filled(batch: Batch, following: np.ndarray | None) -> Batch:
    obs = batch["obs"]
    nxt = np.concatenate([obs[1:], obs[-1:] if following is None else following])
    ends = np.zeros(len(obs), bool)
    for flag in END_FIELDS:
        if flag in batch:
            ends |= batch[flag].astype(bool)
    ends[-1] |= following is None
    nxt[ends] = obs[ends]
    return {**batch, "next_obs": nxt}


def _derives_next_obs(fields: dict[str, Field], exported: bool) -> bool:
    """D4RL layout: ``next_obs`` is derived from ``obs`` unless given, or written by `diskreplay export`."""
    return "obs" in fields and "next_obs" not in fields and not exported


def _field_for(name: str, shape: tuple[int, ...], dtype: np.dtype, where: str) -> Field | None:
    dtype = np.dtype(dtype)
    if dtype.newbyteorder("<") not in ALLOWED_DTYPES and dtype not in ALLOWED_DTYPES:
        warnings.warn(f"{where}: skipped (dtype {dtype} cannot be stored; supported: "
                      f"{[d.name for d in ALLOWED_DTYPES]})", stacklevel=3)
        return None
    if math.prod(shape) == 0:
        warnings.warn(f"{where}: skipped (zero-sized rows, shape {shape})", stacklevel=3)
        return None
    return Field(shape, dtype)


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise ImportError("reading HDF5 (D4RL, Minari) needs h5py: pip install h5py") from None
    return h5py


def _open_hdf5(h5py: Any, path: str, src: str, expected: str) -> Any:
    """``h5py.File(path, "r")``; ImportFormatError naming ``expected`` if it is not HDF5."""
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ImportFormatError(f"{src!r} is not an HDF5 file ({exc}); expected {expected}") from None


def _minari_file(path: str) -> str | None:
    for candidate in (os.path.join(path, "data", "main_data.hdf5"), os.path.join(path, "main_data.hdf5")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _hdf5_datasets(h5py: Any, root: Any, where: str, follows_soft: bool) -> dict[str, Any]:
    """Every dataset under ``root`` (by path relative to it), refusing data from outside the file.

    Walks hard links only, so no other file is opened; raises ImportFormatError for an external
    link, a soft link when the importer ``follows_soft`` (by-name access may lead through an
    external link), or a dataset whose data lives in other files (external storage, virtual).
    """
    datasets: dict[str, Any] = {}
    groups = [root]

    def collect(path: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            datasets[path] = obj
        elif isinstance(obj, h5py.Group):
            groups.append(obj)

    root.visititems(collect)  # hard links only
    for group in groups:
        for name in group:
            _refuse_link(h5py, group, name, where, follows_soft)
    for ds in datasets.values():
        if ds.external is not None:
            files = sorted({os.fsdecode(entry[0]) for entry in ds.external})
            raise ImportFormatError(f"{where}: dataset {ds.name!r} keeps its data in external file(s) "
                                    f"{files}; expected its data inside the file (external storage is not read)")
        if ds.is_virtual:
            files = sorted({vds.file_name for vds in ds.virtual_sources()})
            raise ImportFormatError(f"{where}: dataset {ds.name!r} is a virtual dataset mapping {files}; "
                                    f"expected its data inside the file (virtual datasets are not read)")
    return datasets


def _refuse_link(h5py: Any, group: Any, name: str, where: str, follows_soft: bool) -> None:
    """Raise ImportFormatError if ``group[name]`` is a link the importer must not follow (not resolved here)."""
    link = group.get(name, getlink=True)
    path = f"{group.name.rstrip('/')}/{name}"
    if isinstance(link, h5py.ExternalLink):
        raise ImportFormatError(f"{where}: link {path!r} is an external link to {link.filename!r} "
                                f"({link.path!r}); expected data inside the file (other files are not read)")
    if follows_soft and isinstance(link, h5py.SoftLink):
        raise ImportFormatError(f"{where}: link {path!r} is a soft link to {link.path!r}; expected the "
                                f"episode's data stored under it directly (soft links are not followed)")


class D4RLSource(Source):
    def __init__(self, src: str, batch_rows: int):
        h5py = _h5py()
        self.batch_rows = batch_rows
        self.file = _open_hdf5(h5py, local_path(src), src, "a D4RL-layout .hdf5/.h5 or .npz file")
        datasets = _hdf5_datasets(h5py, self.file, repr(src), follows_soft=False)
        lengths = [d.shape[0] for d in datasets.values() if d.ndim >= 1]
        if not lengths:
            raise ImportFormatError(f"{src!r}: no datasets with a step axis found")
        anchor = next((datasets[k] for k in ("observations", "rewards", "actions") if k in datasets), None)
        n = anchor.shape[0] if anchor is not None else max(set(lengths), key=lengths.count)
        self.rows = int(n)
        self.columns: dict[str, Any] = {}
        self.fields = {}
        for path, ds in datasets.items():
            if ds.ndim == 0 or ds.shape[0] != n:
                warnings.warn(f"{src!r}: dataset {path!r} skipped (shape {ds.shape}, not {n} steps)",
                              stacklevel=2)
                continue
            name = d4rl_field_name(path)
            if name in self.fields:
                raise ImportFormatError(f"{src!r}: datasets {path!r} and another both map to field {name!r}")
            dtype = np.dtype(bool) if path in D4RL_FLAGS else ds.dtype
            field = _field_for(name, ds.shape[1:], dtype, f"{src!r}: dataset {path!r}")
            if field is not None:
                self.fields[name] = field
                self.columns[name] = ds
        self.derive_next = _derives_next_obs(self.fields, bool(self.file.attrs.get(EXPORT_ATTR, False)))
        if self.derive_next:
            self.fields["next_obs"] = self.fields["obs"]

    def batches(self) -> Iterator[tuple[int, Batch]]:
        slices = (_as_bool_flags({name: ds[start:start + self.batch_rows] for name, ds in self.columns.items()},
                                 self.fields) for start in range(0, self.rows, self.batch_rows))
        for batch in _with_next_obs(slices) if self.derive_next else slices:
            yield 0, batch

    def close(self) -> None:
        self.file.close()


class MinariSource(Source):
    def __init__(self, src: str, batch_rows: int):
        h5py = _h5py()
        self.h5py = h5py
        self.batch_rows = batch_rows
        path = local_path(src)
        file = _minari_file(path) if os.path.isdir(path) else path
        if file is None:
            raise ImportFormatError(f"{src!r}: not a Minari dataset (no data/main_data.hdf5; Minari's "
                                    f"arrow data format is not supported, convert it to hdf5)")
        self.file = _open_hdf5(h5py, file, src, "a Minari dataset (folder or its main_data.hdf5)")
        keyed = []
        for key in self.file.keys():
            match = re.fullmatch(r"episode_(\d+)", key)
            if match:
                keyed.append((int(match.group(1)), key))
        if not keyed:
            raise ImportFormatError(f"{src!r}: no episode_<id> groups in {file!r}")
        for _, key in keyed:  # by name, h5py follows every link: check them all before the first access
            _refuse_link(h5py, self.file, key, repr(src), follows_soft=True)
            _hdf5_datasets(h5py, self.file[key], repr(src), follows_soft=True)
        self.episodes = [self.file[k] for _, k in sorted(keyed)]
        self.rows = 0
        for ep in self.episodes:
            if "rewards" not in ep:
                raise ImportFormatError(f"{src!r}: episode {ep.name!r} has no 'rewards'")
            self.rows += int(ep["rewards"].shape[0])
        self.fields = {}
        first = self.episodes[0]
        steps = first["rewards"].shape[0]
        self.info_offset: dict[str, int] = {}
        for name, ds, offset in self._columns(first, steps):
            field = _field_for(name, ds.shape[1:], ds.dtype, f"{src!r}: {ds.name!r}")
            if field is not None:
                self.fields[name] = field
                self.info_offset[name] = offset
        if "observations" in first:
            for name in list(self.fields):
                if name == "obs" or name.startswith("obs_"):
                    self.fields["next_" + name] = self.fields[name]

    def _columns(self, ep: Any, steps: int) -> Iterator[tuple[str, Any, int]]:
        """(field name, dataset, offset of row t of the episode) for every column of one episode."""
        for key in ep.keys():
            if key == "observations":
                yield from ((n, d, 0) for n, d in self._flatten(ep[key], "obs"))
            elif key == "infos":
                for n, d in self._flatten(ep[key], "info"):
                    length = d.shape[0] if d.ndim else -1
                    if length == steps + 1:
                        yield n, d, 1
                    elif length == steps:
                        yield n, d, 0
                    else:
                        warnings.warn(f"{ep.name}/{d.name}: info skipped ({length} entries for {steps} steps)",
                                      stacklevel=3)
            elif key in MINARI_NAMES or key == "actions":
                yield from ((n, d, 0) for n, d in self._flatten(ep[key], MINARI_NAMES[key]))

    def _flatten(self, obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if isinstance(obj, self.h5py.Dataset):
            yield prefix, obj
            return
        for key in obj.keys():
            yield from self._flatten(obj[key], f"{prefix}_{field_name(key)}")

    def batches(self) -> Iterator[tuple[int, Batch]]:
        pending = _Pending(self.batch_rows)
        for ep in self.episodes:
            steps = int(ep["rewards"].shape[0])
            columns = {name: (ds, off) for name, ds, off in self._columns(ep, steps) if name in self.fields}
            expected = {n for n in self.fields if not n.startswith("next_obs")}
            if set(columns) != expected:
                raise ImportFormatError(f"{ep.name}: fields {sorted(columns)} differ from the first "
                                        f"episode's {sorted(expected)}")
            for start in range(0, steps, self.batch_rows):
                end = min(start + self.batch_rows, steps)
                batch = {}
                for name, (ds, off) in columns.items():
                    if name == "obs" or name.startswith("obs_"):
                        values = ds[start:end + 1]
                        if len(values) != end - start + 1:
                            raise ImportFormatError(f"{ep.name}: {ds.name} has {ds.shape[0]} entries, "
                                                    f"expected {steps + 1} (one more than steps)")
                        batch[name], batch["next_" + name] = values[:-1], values[1:]
                    else:
                        batch[name] = ds[start + off:end + off]
                yield from pending.add(batch)
        yield from pending.drain()

    def close(self) -> None:
        self.file.close()


class _Pending:
    """Collects small slices (short episodes) into slices of about batch_rows rows."""

    def __init__(self, batch_rows: int):
        self.batch_rows = batch_rows
        self.parts: list[Batch] = []
        self.count = 0

    def add(self, batch: Batch) -> Iterator[tuple[int, Batch]]:
        self.parts.append(batch)
        self.count += len(next(iter(batch.values())))
        if self.count >= self.batch_rows:
            yield from self.drain()

    def drain(self) -> Iterator[tuple[int, Batch]]:
        if not self.parts:
            return
        parts, self.parts, self.count = self.parts, [], 0
        if len(parts) == 1:
            yield 0, parts[0]
        else:
            yield 0, {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _npy_header(fileobj: Any, size: int, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype of a ``.npy`` stream of ``size`` bytes, read from its header.

    Raises ImportFormatError for object arrays, scalars, and a header claiming more data than the
    stream holds (nothing is allocated on a header's word).
    """
    fmt = np.lib.format
    version = fmt.read_magic(fileobj)
    if version == (1, 0):
        shape, fortran, dtype = fmt.read_array_header_1_0(fileobj)
    else:
        shape, fortran, dtype = fmt.read_array_header_2_0(fileobj)
    if dtype.hasobject:
        raise ImportFormatError(f"{where}: object arrays cannot be imported")
    if not shape:
        raise ImportFormatError(f"{where}: a scalar, expected an array with a step axis")
    claimed, held = math.prod(shape) * dtype.itemsize, size - fileobj.tell()
    if claimed > held:
        raise ImportFormatError(f"{where}: the header claims shape {tuple(shape)} of {dtype} ({claimed} bytes) "
                                f"but only {held} bytes of data follow; expected a complete .npy array")
    return tuple(shape), fortran, dtype


class _NpyStream:
    """Row slices of one ``.npy`` stream read front to back (works inside a compressed zip)."""

    def __init__(self, fileobj: Any, size: int, where: str):
        shape, fortran, dtype = _npy_header(fileobj, size, where)
        self.file, self.shape, self.dtype, self.where = fileobj, shape, dtype, where
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize
        self.whole = None
        if fortran and len(shape) > 1:  # rows are not contiguous: no streaming, only small ones read whole
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > FORTRAN_WHOLE_BYTES:
                raise ImportFormatError(f"{where}: Fortran-ordered array of shape {shape} ({nbytes} bytes) "
                                        f"could only be read whole; expected C order above "
                                        f"{FORTRAN_WHOLE_BYTES} bytes: save it as np.ascontiguousarray(array)")
            warnings.warn(f"{where}: Fortran-ordered, read whole into memory", stacklevel=3)
            data = np.frombuffer(fileobj.read(nbytes), dtype=dtype)
            self.whole = data.reshape(tuple(reversed(shape))).transpose()
        self.pos = 0

    def read(self, rows: int) -> np.ndarray:
        if self.whole is not None:
            out = self.whole[self.pos:self.pos + rows]
        else:
            blob = self.file.read(rows * self.row_bytes)
            got = len(blob) // max(self.row_bytes, 1)
            if got != min(rows, self.shape[0] - self.pos):
                raise ImportFormatError(f"{self.where}: truncated data ({got} of {rows} rows read)")
            out = np.frombuffer(blob, dtype=self.dtype).reshape((got, *self.shape[1:]))
        self.pos += len(out)
        return out

    def close(self) -> None:
        self.file.close()


class _ColumnsSource(Source):
    """One field per named column (named by `d4rl_field_name`); every column has the same number of rows."""

    def _setup(self, src: str, columns: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, str]:
        """Sets ``rows`` and ``fields`` from ``{column: (shape, dtype)}``; returns ``{column: field name}``."""
        if not columns:
            raise ImportFormatError(f"{src!r}: no arrays found")
        lengths = {name: shape[0] for name, (shape, _) in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ImportFormatError(f"{src!r}: arrays must share their leading (step) length, got {lengths}")
        self.rows = next(iter(lengths.values()))
        names: dict[str, str] = {}
        for column in columns:
            name = d4rl_field_name(column)
            other = next((c for c, n in names.items() if n == name), None)
            if other is not None:
                raise ImportFormatError(f"{src!r}: arrays {other!r} and {column!r} both map to field {name!r}")
            names[column] = name
        self.fields = {}
        for column, (shape, dtype) in columns.items():
            field = _field_for(names[column], shape[1:], np.dtype(bool) if column in D4RL_FLAGS else dtype,
                               f"{src!r}: array {column!r}")
            if field is not None:
                self.fields[names[column]] = field
        return names


class NpzSource(_ColumnsSource):
    """An ``.npz`` file; ``d4rl=True`` (format "d4rl") also derives a missing ``next_obs``."""

    def __init__(self, src: str, batch_rows: int, d4rl: bool = False):
        self.batch_rows = batch_rows
        try:
            self.zip = zipfile.ZipFile(local_path(src))
        except zipfile.BadZipFile:
            raise ImportFormatError(f"{src!r} is not an .npz file (not a zip archive); expected an .npz "
                                    f"written by numpy.savez or 'diskreplay export'") from None
        self.streams: dict[str, _NpyStream] = {}
        try:
            for member in self.zip.namelist():
                if member.endswith(".npy"):
                    size = self.zip.getinfo(member).file_size
                    self.streams[member[:-4]] = _NpyStream(self.zip.open(member), size, f"{src!r}: {member}")
            names = self._setup(src, {k: (s.shape, s.dtype) for k, s in self.streams.items()})
        except BaseException:
            self.close()
            raise
        self.streams = {names[k]: s for k, s in self.streams.items()}
        self.derive_next = d4rl and _derives_next_obs(self.fields, self.zip.comment == EXPORT_ATTR.encode())
        if self.derive_next:
            self.fields["next_obs"] = self.fields["obs"]

    def batches(self) -> Iterator[tuple[int, Batch]]:
        columns = [name for name in self.fields if name in self.streams]
        slices = (_as_bool_flags({name: self.streams[name].read(self.batch_rows) for name in columns}, self.fields)
                  for _ in range(0, self.rows, self.batch_rows))
        for batch in _with_next_obs(slices) if self.derive_next else slices:
            yield 0, batch

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
        self.zip.close()


class NpyFolderSource(_ColumnsSource):
    def __init__(self, src: str, batch_rows: int):
        self.batch_rows = batch_rows
        path = local_path(src)
        self.arrays = {}
        for entry in sorted(os.listdir(path)):
            if entry.endswith(".npy"):
                file = os.path.join(path, entry)
                with open(file, "rb") as f:
                    _npy_header(f, os.fstat(f.fileno()).st_size, f"{src!r}: {entry}")
                self.arrays[entry[:-4]] = np.load(file, mmap_mode="r", allow_pickle=False)
        names = self._setup(src, {k: (a.shape, a.dtype) for k, a in self.arrays.items()})
        self.arrays = {names[k]: a for k, a in self.arrays.items()}

    def batches(self) -> Iterator[tuple[int, Batch]]:
        for start in range(0, self.rows, self.batch_rows):
            yield 0, _as_bool_flags({name: np.array(self.arrays[name][start:start + self.batch_rows])
                                     for name in self.fields}, self.fields)

    def close(self) -> None:
        self.arrays = {}


class ZarrSource(_ColumnsSource):
    """A diskreplay buffer (its lanes and fields) or a plain Zarr group (one field per array)."""

    def __init__(self, src: str, batch_rows: int):
        self.batch_rows = batch_rows
        self.buffer: ReplayBuffer | None = None
        if open_chunkstore(src).get(COMMIT_KEY) is not None:
            self.buffer = ReplayBuffer.open(src, "r", sampler=Uniform(), cache_bytes=8 * 2**20)
            self.fields = self.buffer.fields
            self.num_envs = self.buffer.num_envs
            self.rows = len(self.buffer)
            return
        marker = import_status(src)
        if marker is not None:
            raise NotABufferError(describe_incomplete(src, marker))
        import zarr
        try:
            group = zarr.open_group(src, mode="r")
        except Exception as exc:
            raise ImportFormatError(f"{src!r} is neither a diskreplay buffer nor a Zarr group ({exc})") from None
        self.arrays = {name: arr for name, arr in group.arrays() if arr.ndim >= 1}
        names = self._setup(src, {k: (a.shape, a.dtype) for k, a in self.arrays.items()})
        self.arrays = {names[k]: a for k, a in self.arrays.items()}

    def batches(self) -> Iterator[tuple[int, Batch]]:
        if self.buffer is None:
            for start in range(0, self.rows, self.batch_rows):
                yield 0, _as_bool_flags({name: np.asarray(self.arrays[name][start:start + self.batch_rows])
                                         for name in self.fields}, self.fields)
            return
        lo, hi = self.buffer.storage.window()
        n = self.num_envs
        for lane in range(n):
            for start in range(int(lo[lane]), int(hi[lane]), self.batch_rows):
                steps = np.arange(start, min(start + self.batch_rows, int(hi[lane])))
                yield lane, self.buffer[steps * n + lane]

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
