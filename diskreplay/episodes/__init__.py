"""The episode layer: what the buffer knows and computes about episodes.

- `index`: the episode index (`EpisodeIndex`) and its table view (`EpisodeTable`).
- `returns`: discounted returns, GAE, n-step targets and episodic returns (pure numpy).
- `derived`: fields derived instead of stored (`RowView`, `EpisodicReturn`).
- `transforms`: sample-time views of stored steps (n-step, frame stacks, `HER`).

Each module imports only those listed before it (index < returns < derived < transforms).
"""

from .derived import EpisodicReturn, RowView, derived_next_fields, row_view
from .index import NO_END, EpisodeIndex, EpisodeTable, end_flags, episode_end_fields
from .returns import (
    discount_cumsum,
    episodic_returns,
    gae_advantages,
    normalize_advantages,
    nstep_targets,
)
from .transforms import HER

__all__ = [
    "NO_END", "EpisodeIndex", "EpisodeTable", "end_flags", "episode_end_fields",
    "discount_cumsum", "episodic_returns", "gae_advantages", "normalize_advantages", "nstep_targets",
    "EpisodicReturn", "RowView", "derived_next_fields", "row_view",
    "HER",
]
