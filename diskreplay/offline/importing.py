"""Import offline datasets into a diskreplay buffer: D4RL HDF5, Minari, .npz / .npy, Parquet, Zarr.

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
* Minari's arrow / parquet data formats (``data/metadata.json`` and ``data/<id>/`` episode
  folders): mapped as Minari HDF5 above (`diskreplay.offline.formats.minari_arrow`).
* Parquet (format ``"parquet"``: a ``.parquet`` file or a folder of them, LeRobot v2 or Hugging
  Face layout): rows ordered by ``episode_index`` / ``frame_index``, which become no field;
  ``observation.state`` -> ``obs``, ``next.reward`` -> ``reward``, ``next.done`` -> ``terminated``,
  other dotted names with ``_``; list columns become vector fields, non-numeric columns are
  skipped with a warning; every episode's last frame ends it (``truncated`` unless ``next.done``).
  See `diskreplay.offline.formats.parquet`.
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
* Damaged files: a zip that does not open (or a member name that is not UTF-8), an encrypted or
  unsupported member, a ``.npy`` header that does not parse or has a negative size, metadata
  (``metadata.json``, a plain Zarr group's ``zarr.json``) over `MAX_METADATA_BYTES` or not a JSON
  object, a Box shape that is not a list of ints >= 0, episode folders that are not ASCII ids.
  Damage found only while streaming (a bad CRC, corrupt compressed data, a column whose type
  changes) is an ImportFormatError too; what was written is then removed.

Sizes read from a source are checked before anything is allocated for them: a field's rows hold
at most `MAX_IMPORT_ROW_BYTES` (`diskreplay.offline.source.field_for`), and a slice holds at most
`IMPORT_BATCH_BYTES` of rows (``batch_rows`` is lowered to fit), so the write staging is bounded too.

Failed and interrupted imports. The whole plan (the source's fields, the new buffer's arguments,
``dest``) is checked before anything is written. Rows are then written next to ``dest``, at
``<dest>.import-partial`` (`diskreplay.offline.partial`), whose commit record is written under
`INCOMPLETE_KEY` instead of ``commit.json`` until the last row: `ReplayBuffer.open` of it raises
`NotABufferError`. Only a finished import is moved to ``dest`` (replacing the buffer there with
``overwrite=True``). An import that fails with a Python exception removes what it wrote and leaves
``dest`` as it was; one killed hard leaves ``dest`` as it was too, and its ``.import-partial``
until the next import into ``dest`` replaces it. There is no resume.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from ..audit.status import INCOMPLETE_KEY, describe_incomplete, import_status
from ..buffer import ReplayBuffer
from ..buffer.setup import VIDEO_CHUNK_ROWS, check_open_options, replaceable_location
from ..checks import check_int
from ..errors import BufferExistsError
from ..format.schema import Schema
from ..io import is_local
from ..progress import progress_bar
from ..storage import DEFAULT_CACHE_BYTES, default_chunk_rows, own_stores
from .formats import detect_format, open_source
from .partial import break_stale_lock, claim_partial, partial_url, remove_partial, swap_in
from .source import ImportFormatError, Source, require_source

IMPORT_BATCH_BYTES = 32 << 20
"""The most bytes of rows an import reads (and writes) per slice: ``batch_rows`` is lowered to fit."""


def import_dataset(src: str | os.PathLike, dest: str | os.PathLike, *, format: str | None = None,
                   chunk_rows: int | None = None, compression: str | None = "zstd", batch_rows: int = 65536,
                   progress: bool = True, overwrite: bool = False, mode: str = "r",
                   storage_options: dict | None = None, cache_bytes: int | None = None) -> ReplayBuffer:
    """Import a dataset at ``src`` into a new dataset-mode buffer at ``dest`` and open it.

    Args:
        src: a D4RL-layout ``.hdf5`` (or ``.npz``) file, a Minari dataset folder (or its
            ``main_data.hdf5``), an ``.npz`` file, a folder of ``.npy`` files, a ``.parquet`` file
            or folder (LeRobot / Hugging Face), or a diskreplay
            buffer / Zarr group. Columns are named by `d4rl_field_name` (see the module docstring).
        dest: where the buffer is written (a local path or an fsspec URL).
        format: one of `FORMATS`; ``None`` detects it from ``src`` (an ``.npz`` file is
            ``"npz"``; pass ``"d4rl"`` to also derive a missing ``next_obs``).
        chunk_rows: the new buffer's chunking (see `ReplayBuffer.create`); ``None`` sizes chunks
            for the source's row count (`default_chunk_rows`).
        compression: the new buffer's codec (see `ReplayBuffer.create`).
        batch_rows: rows read from the source (and written) per slice: bounds memory. Lowered
            so that a slice holds at most `IMPORT_BATCH_BYTES`.
        progress: show a tqdm progress bar (rows, rows/s) on stderr when tqdm is installed.
        overwrite: replace an existing buffer (or an interrupted import) at ``dest``, once the
            import has finished: a failing import leaves it as it was.
        mode: mode of the returned buffer ("r", or "r+" to keep adding rows).
        storage_options: fsspec options for a remote ``dest``.
        cache_bytes: chunk cache of the returned buffer (default: the library's default).

    Returns:
        The imported buffer, opened with ``mode``.

    Raises:
        ValueError: ``format`` is not one of `FORMATS`, ``batch_rows`` is not a positive int,
            ``mode`` or ``cache_bytes`` not usable (all checked before anything is written).
        ImportFormatError: the source format is unknown or the file does not follow it (the
            message names the file and the field). CorruptBufferError: a diskreplay buffer source
            is damaged.
        FileNotFoundError: ``src`` does not exist. BufferExistsError: ``dest`` exists (without
            ``overwrite``), or holds other files than a buffer. LockedError: a live writer holds
            the buffer at ``dest``, or another import into ``dest`` is running.
        ImportError: h5py is needed (HDF5 / Minari sources) or pyarrow (Parquet, Minari arrow)
            and not installed.
    """
    src, dest = os.fspath(src), os.fspath(dest)
    _check_arguments(batch_rows, mode, cache_bytes, storage_options)
    require_source(src)
    fmt = format or detect_format(src)
    partial = partial_url(dest)
    with open_source(fmt, src, int(batch_rows)) as source:
        source.batch_rows = slice_rows(source, src, int(batch_rows))
        _check_destination(dest, overwrite, storage_options)
        claim_partial(partial, storage_options)
        buf = _create_partial(source, partial, chunk_rows, compression, storage_options)
        source.chunk_rows = buf.layout.chunk_rows
        marker = {"source": src, "format": fmt, "started": time.time(), "pid": os.getpid(),
                  "host": socket.gethostname()}
        _copy_rows(source, buf, partial, marker, progress, storage_options)
    try:
        swap_in(partial, dest, overwrite, storage_options)
    except BaseException:
        remove_partial(partial, storage_options)
        raise
    extra: dict[str, Any] = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
    return ReplayBuffer.open(dest, mode, storage_options=storage_options, **extra)


def _check_arguments(batch_rows: int, mode: str, cache_bytes: int | None, storage_options: dict | None) -> None:
    """Raises ValueError for an argument of `import_dataset` that is not usable, before the import
    starts (the returned buffer's ``mode`` and ``cache_bytes`` too: they are used only at the end)."""
    check_int(batch_rows, "batch_rows", 1)
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' or 'r+', got {mode!r}")
    if cache_bytes is not None:
        check_int(cache_bytes, "cache_bytes", 0)
    check_open_options(None, None, None, storage_options)


def slice_rows(source: Source, src: str, batch_rows: int) -> int:
    """Rows per slice: ``batch_rows``, lowered so that a slice holds at most `IMPORT_BATCH_BYTES`
    (at least one row). Raises ImportFormatError when the source has no field to import."""
    if not source.fields:
        raise ImportFormatError(f"{src!r}: no field to import (every column was skipped)")
    row_bytes = sum(f.row_bytes for f in source.fields.values())
    return max(1, min(batch_rows, IMPORT_BATCH_BYTES // max(row_bytes, 1)))


def _create_partial(source: Source, partial: str, chunk_rows: int | None, compression: str | None,
                    storage_options: dict | None) -> ReplayBuffer:
    """The new, uncommitted buffer at ``partial``, its cache sized as write staging: the chunks of
    two slices, and two per lane, not the default read cache. Removes ``partial`` if that fails."""
    row_bytes = sum(f.row_bytes for f in source.fields.values())
    if chunk_rows is None:  # as `ReplayBuffer.create` sizes them (video: a chunk is a group of pictures)
        chunk_rows = default_chunk_rows(Schema(source.fields).storage(), source.num_envs, max(source.rows, 1),
                                        DEFAULT_CACHE_BYTES, compression is None, remote=not is_local(partial))
        if any(f.frames is not None and f.frames.video for f in source.fields.values()):
            chunk_rows = min(chunk_rows, VIDEO_CHUNK_ROWS)
    staging_chunks = 2 * -(-source.batch_rows // max(int(chunk_rows), 1)) + 2 * source.num_envs + 2
    try:
        return ReplayBuffer.create(partial, source.fields, None, num_envs=source.num_envs,
                                   chunk_rows=chunk_rows, compression=compression, overwrite=True,
                                   storage_options=storage_options, commit=False,
                                   cache_bytes=staging_chunks * int(chunk_rows) * row_bytes)
    except BaseException:
        remove_partial(partial, storage_options)
        raise


def _copy_rows(source: Source, buf: ReplayBuffer, partial: str, marker: dict, progress: bool,
               storage_options: dict | None) -> None:
    """Writes every slice of ``source`` into ``buf`` (at ``partial``) under the incomplete-import
    ``marker``, then commits and closes it; on any failure removes ``partial``."""
    try:
        store = own_stores(partial, storage_options)[0]  # the new buffer's own objects
        store.put(INCOMPLETE_KEY, json.dumps(marker).encode(), durable=True)
        with progress_bar(source.rows, f"import {marker['format']}", progress) as bar:
            for lane, batch in source.batches():
                count = len(next(iter(batch.values())))
                if source.num_envs == 1:
                    buf.extend(batch)
                else:
                    buf.extend({k: v[:, None] for k, v in batch.items()}, env_ids=[lane])
                bar.update(count)
        buf.flush()  # writes the last chunks, then the first commit.json
        store.delete(INCOMPLETE_KEY)
        buf.close()
    except BaseException:
        buf.storage.close()
        remove_partial(partial, storage_options)
        raise


def _check_destination(dest: str, overwrite: bool, storage_options: dict | None) -> None:
    """Refuses (BufferExistsError) anything at ``dest`` unless ``overwrite``; with it, anything but a
    buffer or an interrupted import (BufferExistsError) and a buffer a live writer holds
    (LockedError). Breaks the stale lock of an import killed while writing at ``dest`` itself."""
    marker = import_status(dest, storage_options)
    if marker is not None and not overwrite:
        raise BufferExistsError(describe_incomplete(dest, marker))
    if marker is not None:
        break_stale_lock(dest, storage_options)
    replaceable_location(dest, storage_options, overwrite, False, None)
