"""The on-disk contract of a buffer, in one place: fields, lanes, object names, chunk codecs, the
Zarr metadata, the config and commit records (frozen, validated on read) and saved state objects.

Nothing here does I/O: reads take the bytes (or a ``get(key)`` callable) and validate them;
writes return bytes. ``docs/format.md`` describes the same contract for readers of other tools.
"""

from .codecs import Codec
from .commit import CommitRecord
from .config import BufferConfig
from .lanes import LaneLayout
from .schema import Field, Schema

__all__ = ["BufferConfig", "Codec", "CommitRecord", "Field", "LaneLayout", "Schema"]
