"""The import formats: a registry from format name to how a source is opened and recognised.

Each format module gives a `SourceFormat`: ``open(src, batch_rows)`` returns its `Source`,
``detect(path)`` says whether an existing local path is in that format. `detect_format` asks the
formats in `DETECT_ORDER`, the more specific layouts first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ...io import is_local, local_path
from ..source import ImportFormatError, Source, require_source
from .d4rl import is_d4rl, open_d4rl
from .lerobot import is_lerobot, open_lerobot
from .minari import is_minari, open_minari
from .npy import NpyFolderSource, is_npy_folder
from .npz import NpzSource, is_npz
from .parquet import ParquetSource, is_parquet
from .zarr_group import ZarrSource, is_zarr


@dataclass(frozen=True)
class SourceFormat:
    """How to open a source of one format (``open(src, batch_rows)``) and recognise it (``detect(path)``)."""

    open: Callable[[str, int], Source]
    detect: Callable[[str], bool]


SOURCE_FORMATS: dict[str, SourceFormat] = {
    "d4rl": SourceFormat(open_d4rl, is_d4rl),
    "minari": SourceFormat(open_minari, is_minari),
    "npz": SourceFormat(NpzSource, is_npz),
    "npy": SourceFormat(NpyFolderSource, is_npy_folder),
    "zarr": SourceFormat(ZarrSource, is_zarr),
    "parquet": SourceFormat(ParquetSource, is_parquet),
    "lerobot": SourceFormat(open_lerobot, is_lerobot),
}
FORMATS = tuple(SOURCE_FORMATS)
# folders: a LeRobot v3 dataset also holds .parquet files; a Minari dataset or a Zarr group may also
# hold .npy files; files: HDF5 before a zip suffix
DETECT_ORDER = ("lerobot", "minari", "zarr", "parquet", "npy", "d4rl", "npz")


def detect_format(src: str) -> str:
    """Guess the format of ``src`` from its layout (one of `FORMATS`; a remote URL is ``"zarr"``).

    Raises FileNotFoundError (no such path), ImportFormatError (nothing recognised), ImportError
    (an HDF5 file and no h5py).
    """
    if not is_local(src):
        return "zarr"
    require_source(src)
    path = local_path(src)
    for name in DETECT_ORDER:
        if SOURCE_FORMATS[name].detect(path):
            return name
    if os.path.isdir(path):
        raise ImportFormatError(f"cannot tell the format of folder {src!r}: expected a Minari dataset "
                                f"(data/main_data.hdf5), a Zarr group (zarr.json), .parquet files or .npy files")
    raise ImportFormatError(f"cannot tell the format of {src!r}: expected .hdf5/.h5 (D4RL or Minari), "
                            f".npz, .parquet, a folder of .npy files, a Minari folder or a Zarr store; "
                            f"pass format= one of {FORMATS}")


def open_source(fmt: str, src: str, batch_rows: int) -> Source:
    """The `Source` reading ``src`` in format ``fmt`` (one of `FORMATS`), ``batch_rows`` rows per slice.

    Raises ValueError for an unknown format, ImportFormatError if ``src`` does not follow it.
    """
    if fmt not in SOURCE_FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    return SOURCE_FORMATS[fmt].open(src, batch_rows)
