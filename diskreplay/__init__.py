"""diskreplay: RL replay buffers on chunked Zarr arrays, served at in-memory speed."""

from typing import Any

from .buffer import BufferSpec, RateLimiter, ReplayBuffer
from .build import build_info
from .episodes import (
    HER,
    EpisodeTable,
    EpisodicReturn,
    discount_cumsum,
    episodic_returns,
    gae_advantages,
    normalize_advantages,
    nstep_targets,
)
from .errors import (
    BufferExistsError,
    ClosedError,
    CorruptBufferError,
    DiskReplayError,
    EmptyBufferError,
    LockedError,
    NotABufferError,
    RateLimitTimeout,
    ReadOnlyError,
    SchemaError,
    StaleReadError,
    StoreUnavailableError,
)
from .format.ragged import Ragged
from .format.schema import Field
from .integrations.gymnasium import fields_from_env, fields_from_spaces, flatten_fields, spec_from_env
from .io import RetryPolicy
from .offline import export_buffer, import_dataset
from .rollout import RolloutBuffer
from .sampling import Draw, Prioritized, Sampler, Uniform, WithoutReplacement, ere_recent_rows, ere_schedule
from .sampling.segment_tree import MinSegmentTree, SumSegmentTree

__version__ = "0.1.0"

__all__ = [
    "ReplayBuffer", "RateLimiter", "Field", "Ragged",
    "BufferSpec", "fields_from_spaces", "fields_from_env", "spec_from_env",
    "flatten_fields", "import_dataset", "export_buffer", "Uniform", "Prioritized",
    "WithoutReplacement", "Sampler", "Draw", "ere_schedule", "ere_recent_rows", "SumSegmentTree", "MinSegmentTree",
    "EpisodeTable", "EpisodicReturn", "HER", "RolloutBuffer",
    "discount_cumsum", "episodic_returns", "gae_advantages", "normalize_advantages", "nstep_targets",
    "DiskReplayError", "SchemaError", "NotABufferError", "BufferExistsError", "ReadOnlyError",
    "EmptyBufferError", "CorruptBufferError", "LockedError", "StaleReadError", "StoreUnavailableError",
    "ClosedError", "RateLimitTimeout",
    "RetryPolicy", "build_info",
]

_TORCH_DATA = {"make_dataset", "SampleDataset", "EpochDataset", "Loader", "IndexBatchSampler", "IndexBatch",
               "RowDataset", "merge_worker_states", "dataset_state_from_loader", "keep_batch", "DistributedLearner"}
_DEVICE = {"to_device", "DevicePrefetcher", "to_tensordict"}
__all__ += sorted(_TORCH_DATA | _DEVICE)


def __getattr__(name: str) -> Any:
    """torch (and ``dr.sb3``: Stable-Baselines3) is imported only when first used: ``import diskreplay``
    stays light."""
    if name in _TORCH_DATA or name in _DEVICE:
        from . import torch as torch_layer
        return getattr(torch_layer, name)
    if name == "sb3":  # Stable-Baselines3 buffers: imports stable_baselines3 (and torch) when first used
        from .integrations import sb3
        return sb3
    if name == "torchrl":  # dr.torchrl.ZarrStorage: imports torchrl and tensordict when first used
        from .integrations import torchrl
        return torchrl
    raise AttributeError(f"module 'diskreplay' has no attribute {name!r}")
