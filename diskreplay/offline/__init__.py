"""Offline datasets: import from files (D4RL, Minari, npz, npy, Parquet, Zarr), export to npz /
HDF5 / Parquet / Minari. Sits above the buffer and the audits (`diskreplay.audit`: `info`,
`verify`), whose names this package also exports, as it did when they lived here: nothing below
imports this package. Fields from gymnasium spaces, named as the importers name them (`naming`),
are an integration: `diskreplay.integrations.gymnasium`."""

from ..audit import (  # the audits' names, as this package exported them before they moved to diskreplay.audit
    INCOMPLETE_KEY,
    VerifyReport,
    buffer_info,
    describe_incomplete,
    episode_stats,
    format_info,
    import_status,
    iter_rows,
    open_readonly,
    read_chunk,
    readable,
    verify,
)
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
from .formats.minari_arrow import MinariArrowSource
from .formats.npy import NpyFolderSource
from .formats.npz import NpzSource
from .formats.parquet import ParquetSource
from .formats.zarr_group import ZarrSource
from .importing import import_dataset
from .naming import EXPORT_ATTR, d4rl_field_name, d4rl_name, field_name
from .npyfile import FORTRAN_WHOLE_BYTES
from .source import ImportFormatError, Source

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
    "MinariArrowSource",
    "MinariSource",
    "NpyFolderSource",
    "NpzSource",
    "ParquetSource",
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
