"""Export a buffer's committed rows to ``.npz`` or HDF5, in the D4RL layout that `import_dataset` reads back.

Rows are written lane by lane, each lane in time order, streamed in slices (bounded memory).

Both formats hold the same arrays under the same names (`d4rl_name`): D4RL's, ``obs`` ->
``observations``, ``action`` -> ``actions``, ``reward`` -> ``rewards``, ``terminated`` ->
``terminals``, ``truncated`` -> ``timeouts``, ``next_obs`` -> ``next_observations``, ``info_<k>``
-> ``infos/<k>`` (an HDF5 group; an ``.npz`` member ``infos/<k>.npy``); other fields keep their
names. `import_dataset` maps these names back for either format, so exporting then importing
gives the buffer's field names and values. With several env lanes, a lane's last row is written
with ``timeouts`` set (when a ``truncated`` field exists) so that D4RL readers do not join the
end of one lane to the start of the next. Both files are marked as written here (HDF5 attribute,
zip comment ``diskreplay_export``), so importing them derives no ``next_obs``. Encoded frame
fields (``codec=``) are written as their decoded pixels; ragged and text fields are refused
(ValueError): export them to Parquet.

Format ``"parquet"`` writes a folder of LeRobot / Hugging Face-style Parquet files instead
(`diskreplay.offline.parquet_export`), which the ``"parquet"`` import reads back; format
``"minari"`` a Minari dataset folder in the arrow data format (`diskreplay.offline.minari_export`);
format ``"lerobot"`` a LeRobot v3 dataset folder (`diskreplay.offline.lerobot_export`).
"""

from __future__ import annotations

import functools
import os
import shutil
import zipfile
from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np

from ..audit.rows import episode_fields, iter_rows, open_readonly, readable
from ..episodes import end_flags
from ..progress import progress_bar
from .hdf5 import require_h5py
from .lerobot_export import write_lerobot
from .minari_export import minari_dataset_id, write_minari
from .naming import EXPORT_ATTR, d4rl_name
from .parquet_export import write_parquet

EXPORT_FORMATS = ("npz", "hdf5", "parquet", "minari", "lerobot")
DONE_FIELDS = ("terminated", "truncated", "done")
Writer = Callable[[Any, str, int, bool, Any], None]
"""``write(buf, path, batch_rows, compress, bar)``: writes the rows of ``buf`` to the new ``path``."""


def export_buffer(url: str | os.PathLike, dest: str | os.PathLike, *, format: str | None = None,
                  batch_rows: int = 65536, progress: bool = True, overwrite: bool = False,
                  compress: bool = False, storage_options: dict | None = None, dataset_id: str | None = None,
                  fps: float | None = None) -> int:
    """Write the committed rows of the buffer at ``url`` to the file ``dest``. Returns the row count.

    Either format holds one array per field, ``[rows, *shape]``, named by `d4rl_name` (D4RL's
    names: ``observations``, ``actions``, ...; see the module docstring); `import_dataset` reads
    both back under the buffer's field names.

    Args:
        format: ``"npz"``, ``"hdf5"``, ``"parquet"`` (a folder), ``"minari"`` (a Minari
            dataset folder, arrow data format) or ``"lerobot"`` (a LeRobot v3 dataset folder,
            camera fields as AV1 video); ``None`` picks from dest's suffix (.npz, .h5 / .hdf5,
            .parquet).
        batch_rows: rows read per slice (bounds memory).
        progress: show a tqdm progress bar on stderr (total: rows) when tqdm is installed.
        compress: deflate the npz members / gzip the HDF5 datasets / zstd the Parquet pages.
        dataset_id: format ``"minari"``: the Minari id, ``(namespace/)name-vN``; by default
            dest's path under Minari's datasets folder, else dest's name (`minari_dataset_id`).
        fps: format ``"lerobot"``: the frame rate (timestamps, videos); by default the one the
            buffer's ``timestamp`` field shows, else 30.

    Raises:
        FileExistsError: ``dest`` exists and ``overwrite`` is False.
        ValueError: unknown format, a ragged or text field with format ``"npz"``, ``"hdf5"`` or
            ``"minari"`` (``"parquet"`` writes them, see `diskreplay.offline.parquet_export`;
            ``"lerobot"`` takes text fields), two fields mapping to one exported name, a
            ``dataset_id`` with another format than ``"minari"`` (an ``fps`` with another than
            ``"lerobot"``), or a Minari id Minari cannot find (malformed, or another than dest's
            path under Minari's datasets folder).
    """
    url, dest = os.fspath(url), os.fspath(dest)
    fmt = format or _format_from_suffix(dest)
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if fmt == "minari":
        write: Writer = functools.partial(write_minari, dataset_id=minari_dataset_id(dest, dataset_id))
    elif dataset_id is not None:
        raise ValueError(f"dataset_id names a Minari dataset: it needs format 'minari', not {fmt!r}")
    elif fmt == "lerobot":
        write = functools.partial(write_lerobot, fps=fps)
    else:
        write = WRITERS[fmt]
    if fps is not None and fmt != "lerobot":
        raise ValueError(f"fps is the frame rate of a LeRobot dataset: it needs format 'lerobot', not {fmt!r}")
    if os.path.exists(dest) and not overwrite:
        raise FileExistsError(f"{dest!r} already exists; pass overwrite=True (--overwrite) to replace it")
    buf = open_readonly(url, storage_options)
    tmp = f"{dest}.partial"
    try:
        varying = [name for name, f in buf.fields.items() if f.varies]
        if varying and fmt in ("npz", "hdf5", "minari"):  # parquet and lerobot write them
            raise ValueError(f"export to {fmt!r} does not support ragged or text fields; {url!r} has "
                             f"{varying}: export to 'parquet' or read them with ReplayBuffer.rows")
        if fmt in ("npz", "hdf5"):
            _check_names(buf.fields)
        _remove(tmp)
        with progress_bar(len(buf), f"export {fmt}", progress) as bar:
            write(buf, tmp, batch_rows, compress, bar)
        if os.path.isdir(dest):  # os.replace cannot replace a folder (a Parquet export)
            _remove(dest)
        os.replace(tmp, dest)
        return len(buf)
    except BaseException:
        _remove(tmp)
        raise
    finally:
        buf.close()


def _remove(path: str) -> None:
    """Removes the file or folder ``path`` if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _format_from_suffix(dest: str) -> str:
    if dest.endswith(".npz"):
        return "npz"
    if dest.endswith((".h5", ".hdf5")):
        return "hdf5"
    if dest.rstrip("/").endswith(".parquet"):
        return "parquet"
    raise ValueError(f"cannot tell the export format from {dest!r}: use a .npz/.h5/.hdf5/.parquet name or "
                     f"format= one of {EXPORT_FORMATS}")


def _check_names(fields: Collection[str]) -> None:
    names = [d4rl_name(field) for field in fields]
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        raise ValueError(f"fields {[f for f in fields if d4rl_name(f) in clashes]} map to the same exported "
                         f"names {clashes}: rename them first")


def _slices(buf: Any, names: list[str], batch_rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Row slices of the fields ``names``, lane by lane in time order. With several lanes, a lane's
    last row gets ``truncated`` set unless a done field already ends an episode there."""
    mark = buf.num_envs > 1 and "truncated" in names
    ends = episode_fields(buf) if mark else ()
    read = names + [k for k in ends if k not in names]
    for lane, lo, hi in readable(buf):
        step = lo
        for part in iter_rows(buf, read, lane, lo, hi, batch_rows):
            step += len(part[read[0]])
            if mark and step == hi and not (ends and end_flags(part, ends)[-1]):
                part["truncated"][-1] = True
            yield {k: part[k] for k in names}


def _write_npz(buf: Any, path: str, batch_rows: int, compress: bool, bar: Any) -> None:
    """One ``.npy`` member per field, written field after field: the bar advances by rows / fields."""
    rows, written, shown = len(buf), 0, 0
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method, allowZip64=True) as zf:
        for name, spec in buf.fields.items():
            header = {"descr": np.lib.format.dtype_to_descr(spec.dtype), "fortran_order": False,
                      "shape": (rows, *spec.shape)}
            with zf.open(f"{d4rl_name(name)}.npy", "w", force_zip64=True) as member:
                try:
                    np.lib.format.write_array_header_1_0(member, header)
                except ValueError:  # header too long for format 1.0
                    np.lib.format.write_array_header_2_0(member, header)
                for part in _slices(buf, [name], batch_rows):
                    member.write(np.ascontiguousarray(part[name]).tobytes())
                    written += len(part[name])
                    bar.update(written // len(buf.fields) - shown)
                    shown = written // len(buf.fields)
        zf.comment = EXPORT_ATTR.encode()


def _write_hdf5(buf: Any, path: str, batch_rows: int, compress: bool, bar: Any) -> None:
    h5py = require_h5py()
    rows = len(buf)
    with h5py.File(path, "w") as f:
        datasets = {}
        for field, spec in buf.fields.items():
            chunks = (max(1, min(rows, max(1, 2**20 // max(spec.row_bytes, 1)))), *spec.shape) if rows else None
            datasets[field] = f.create_dataset(d4rl_name(field), shape=(rows, *spec.shape), dtype=spec.dtype,
                                               chunks=chunks, compression="gzip" if compress else None)
        at = 0
        for part in _slices(buf, list(buf.fields), batch_rows):
            n = len(next(iter(part.values())))
            for field, values in part.items():
                datasets[field][at:at + n] = values
            at += n
            bar.update(n)
        f.attrs[EXPORT_ATTR] = True


WRITERS: dict[str, Writer] = {"npz": _write_npz, "hdf5": _write_hdf5, "parquet": write_parquet}
"""The writer of each format but ``"minari"`` (whose writer also takes the dataset id)."""
