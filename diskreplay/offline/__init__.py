"""Offline datasets: import from files (D4RL, Minari, npz, npy, Zarr), export to npz / HDF5,
the `info` report and `verify`. Sits above the buffer: nothing below imports this package."""

from .export import EXPORT_FORMATS, export_buffer
from .formats import (
    DETECT_ORDER,
    FORMATS,
    SOURCE_FORMATS,
    SourceFormat,
    detect_format,
    open_source,
)
from .formats.d4rl import D4RLSource
from .formats.minari import MinariSource
from .formats.npy import NpyFolderSource
from .formats.npz import NpzSource
from .formats.zarr_group import ZarrSource
from .importing import import_dataset
from .info import (
    buffer_info,
    episode_stats,
    format_info,
    iter_rows,
    open_readonly,
    read_chunk,
    readable,
)
from .naming import EXPORT_ATTR, d4rl_field_name, d4rl_name, field_name
from .npyfile import FORTRAN_WHOLE_BYTES
from .source import ImportFormatError, Source
from .status import INCOMPLETE_KEY, describe_incomplete, import_status
from .verify import VerifyReport, verify

__all__ = [
    "DETECT_ORDER",
    "EXPORT_ATTR",
    "EXPORT_FORMATS",
    "FORMATS",
    "FORTRAN_WHOLE_BYTES",
    "INCOMPLETE_KEY",
    "SOURCE_FORMATS",
    "D4RLSource",
    "ImportFormatError",
    "MinariSource",
    "NpyFolderSource",
    "NpzSource",
    "Source",
    "SourceFormat",
    "VerifyReport",
    "ZarrSource",
    "buffer_info",
    "d4rl_field_name",
    "d4rl_name",
    "describe_incomplete",
    "detect_format",
    "episode_stats",
    "export_buffer",
    "field_name",
    "format_info",
    "import_dataset",
    "import_status",
    "iter_rows",
    "open_readonly",
    "open_source",
    "read_chunk",
    "readable",
    "verify",
]
