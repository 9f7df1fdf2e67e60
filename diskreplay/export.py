"""Export a buffer's committed rows to ``.npz`` or D4RL-layout HDF5 (which `import_dataset` reads back).

Rows are written lane by lane, each lane in time order, streamed in slices (bounded memory).

HDF5 names follow D4RL: ``obs`` -> ``observations``, ``action`` -> ``actions``, ``reward`` ->
``rewards``, ``terminated`` -> ``terminals``, ``truncated`` -> ``timeouts``, ``next_obs`` ->
``next_observations``, ``info_<k>`` -> ``infos/<k>``; other fields keep their names. With several
env lanes, a lane's last row is written with ``timeouts`` set (when a ``truncated`` field exists)
so that D4RL readers do not join the end of one lane to the start of the next.
``.npz`` files hold one array per field, named after it.
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import numpy as np

from .importers import D4RL_NAMES, EXPORT_ATTR, _progress
from .inspect import iter_rows, open_readonly, readable

EXPORT_FORMATS = ("npz", "hdf5")
HDF5_NAMES = {field: d4rl for d4rl, field in D4RL_NAMES.items()}


def hdf5_name(field: str) -> str:
    if field in HDF5_NAMES:
        return HDF5_NAMES[field]
    if field.startswith("info_"):
        return "infos/" + field[len("info_"):]
    return field


def export_buffer(url: str | os.PathLike, dest: str | os.PathLike, *, format: str | None = None,
                  batch_rows: int = 65536, progress: bool = True, overwrite: bool = False,
                  compress: bool = False, storage_options: dict | None = None) -> int:
    """Write the committed rows of the buffer at ``url`` to the file ``dest``. Returns the row count.

    Args:
        format: ``"npz"`` or ``"hdf5"``; ``None`` picks from dest's suffix (.npz, .h5 / .hdf5).
        compress: deflate the npz members / gzip the HDF5 datasets.

    Raises:
        FileExistsError: ``dest`` exists and ``overwrite`` is False.
        ValueError: unknown format, or two fields mapping to one HDF5 name.
    """
    url, dest = os.fspath(url), os.fspath(dest)
    fmt = format or _format_from_suffix(dest)
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"export format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    if os.path.exists(dest) and not overwrite:
        raise FileExistsError(f"{dest!r} already exists; pass overwrite=True (--overwrite) to replace it")
    buf = open_readonly(url, storage_options)
    tmp = f"{dest}.partial"
    try:
        with _progress(len(buf) * (len(buf.fields) if fmt == "npz" else 1), f"export {fmt}", progress) as bar:
            if fmt == "npz":
                _write_npz(buf, tmp, batch_rows, compress, bar)
            else:
                _write_hdf5(buf, tmp, batch_rows, compress, bar)
        os.replace(tmp, dest)
        return len(buf)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    finally:
        buf.close()


def _format_from_suffix(dest: str) -> str:
    if dest.endswith(".npz"):
        return "npz"
    if dest.endswith((".h5", ".hdf5")):
        return "hdf5"
    raise ValueError(f"cannot tell the export format from {dest!r}: use a .npz/.h5/.hdf5 name or "
                     f"format= one of {EXPORT_FORMATS}")


def _write_npz(buf: Any, path: str, batch_rows: int, compress: bool, bar: Any) -> None:
    rows = len(buf)
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method, allowZip64=True) as zf:
        for name, spec in buf.fields.items():
            header = {"descr": np.lib.format.dtype_to_descr(spec.dtype), "fortran_order": False,
                      "shape": (rows, *spec.shape)}
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                try:
                    np.lib.format.write_array_header_1_0(member, header)
                except ValueError:  # header too long for format 1.0
                    np.lib.format.write_array_header_2_0(member, header)
                for lane, lo, hi in readable(buf):
                    for part in iter_rows(buf, [name], lane, lo, hi, batch_rows):
                        member.write(np.ascontiguousarray(part[name]).tobytes())
                        bar.update(len(part[name]))


def _write_hdf5(buf: Any, path: str, batch_rows: int, compress: bool, bar: Any) -> None:
    from .importers import _h5py

    h5py = _h5py()
    names = {field: hdf5_name(field) for field in buf.fields}
    clashes = {v for v in names.values() if list(names.values()).count(v) > 1}
    if clashes:
        raise ValueError(f"fields map to the same HDF5 dataset names {sorted(clashes)}: rename them first")
    rows = len(buf)
    mark_lane_ends = buf.num_envs > 1 and "truncated" in buf.fields
    with h5py.File(path, "w") as f:
        datasets = {}
        for field, spec in buf.fields.items():
            chunks = (max(1, min(rows, max(1, 2**20 // max(spec.row_bytes, 1)))), *spec.shape) if rows else None
            datasets[field] = f.create_dataset(names[field], shape=(rows, *spec.shape), dtype=spec.dtype,
                                               chunks=chunks, compression="gzip" if compress else None)
        at = 0
        for lane, lo, hi in readable(buf):
            step = lo
            for part in iter_rows(buf, list(buf.fields), lane, lo, hi, batch_rows):
                n = len(next(iter(part.values())))
                step += n
                if mark_lane_ends and step == hi and not _is_done(part, -1):
                    part["truncated"][-1] = True
                for field, values in part.items():
                    datasets[field][at:at + n] = values
                at += n
                bar.update(n)
        f.attrs[EXPORT_ATTR] = True


def _is_done(part: dict[str, np.ndarray], i: int) -> bool:
    return any(bool(part[k][i]) for k in ("terminated", "truncated", "done") if k in part)
