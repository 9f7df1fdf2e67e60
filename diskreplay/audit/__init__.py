"""Buffer audits: the `info` report (`buffer_info`, `format_info`), `verify` (every stored object
checked against the last commit), the chunk-level row reader they (and the exporters) read
committed rows with (`rows`), and the marker of an interrupted import (`status`). Read-only:
nothing here writes to a buffer. Sits above the buffer; the importers and exporters (`offline`)
sit above it."""

from .info import EpisodeStats, buffer_info, episode_stats, format_info
from .rows import episode_fields, iter_rows, open_readonly, read_chunk, readable
from .status import INCOMPLETE_KEY, describe_incomplete, import_status
from .verify import VerifyReport, verify

__all__ = ["INCOMPLETE_KEY", "EpisodeStats", "VerifyReport", "buffer_info", "describe_incomplete", "episode_fields",
           "episode_stats", "format_info", "import_status", "iter_rows", "open_readonly", "read_chunk", "readable",
           "verify"]
