"""Reading HDF5 sources (D4RL, Minari) without touching anything outside the file."""

from __future__ import annotations

import os
from typing import Any

from .source import ImportFormatError, file_magic

HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def require_h5py() -> Any:
    """The h5py module. Raises ImportError with the install hint when it is missing."""
    try:
        import h5py
    except ImportError:
        raise ImportError("reading HDF5 (D4RL, Minari) needs h5py: pip install h5py") from None
    return h5py


def looks_like_hdf5(path: str) -> bool:
    """The file ``path`` starts with the HDF5 signature or is named ``.hdf5`` / ``.h5``."""
    return file_magic(path) == HDF5_MAGIC or path.endswith((".hdf5", ".h5"))


def has_episode_groups(path: str) -> bool:
    """The HDF5 file ``path`` has ``episode_*`` groups at its root (Minari's layout)."""
    with require_h5py().File(path, "r") as f:
        return any(k.startswith("episode_") for k in f)


def open_hdf5(h5py: Any, path: str, src: str, expected: str) -> Any:
    """``h5py.File(path, "r")``; ImportFormatError naming ``expected`` if it is not HDF5."""
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise ImportFormatError(f"{src!r} is not an HDF5 file ({exc}); expected {expected}") from None


def hdf5_datasets(h5py: Any, root: Any, where: str, follows_soft: bool) -> dict[str, Any]:
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
            refuse_link(h5py, group, name, where, follows_soft)
    for ds in datasets.values():
        _refuse_outside_data(ds, where)
    return datasets


def _refuse_outside_data(ds: Any, where: str) -> None:
    """Raise ImportFormatError if the dataset ``ds`` keeps its data in other files."""
    if ds.external is not None:
        files = sorted({os.fsdecode(entry[0]) for entry in ds.external})
        raise ImportFormatError(f"{where}: dataset {ds.name!r} keeps its data in external file(s) "
                                f"{files}; expected its data inside the file (external storage is not read)")
    if ds.is_virtual:
        files = sorted({vds.file_name for vds in ds.virtual_sources()})
        raise ImportFormatError(f"{where}: dataset {ds.name!r} is a virtual dataset mapping {files}; "
                                f"expected its data inside the file (virtual datasets are not read)")


def refuse_link(h5py: Any, group: Any, name: str, where: str, follows_soft: bool) -> None:
    """Raise ImportFormatError if ``group[name]`` is a link the importer must not follow (not resolved here)."""
    link = group.get(name, getlink=True)
    path = f"{group.name.rstrip('/')}/{name}"
    if isinstance(link, h5py.ExternalLink):
        raise ImportFormatError(f"{where}: link {path!r} is an external link to {link.filename!r} "
                                f"({link.path!r}); expected data inside the file (other files are not read)")
    if follows_soft and isinstance(link, h5py.SoftLink):
        raise ImportFormatError(f"{where}: link {path!r} is a soft link to {link.path!r}; expected the "
                                f"episode's data stored under it directly (soft links are not followed)")
