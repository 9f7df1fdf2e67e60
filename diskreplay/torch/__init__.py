"""The torch layer: datasets, device prefetch and the worker ring over a `ReplayBuffer`.

Importing this package imports torch (``import diskreplay`` alone does not). Modules:

* `data` - `make_dataset`, the resume helpers and `keep_batch` (the DataLoader ``collate_fn``
  for TensorDict batches); `datasets` - `SampleDataset` / `EpochDataset`; `loader` - `Loader`,
  DataLoader workers that hand over blocks of batches;
  `rows` - `IndexBatchSampler` + `RowDataset`; `reader`, `tensors` - their shared parts;
* `device` - `to_device`: batches copied to a device through pinned host slots;
* `shared_ring` - the shared-memory slots fork DataLoader workers gather batches into;
* `distributed` - `DistributedLearner`: torch.distributed learner ranks that keep one sampling
  state over a sharded buffer (one refresh, one global batch, priorities applied on every rank);
* `batch_rng`, `epoch_order` - per-batch generators and epoch orders as pure functions of a few ints.
* `formats` - batches as tensors or TensorDicts (``sample(format=...)``). TorchRL's storage
  (``dr.torchrl.ZarrStorage``) is an integration: `diskreplay.integrations.torchrl`.

Tunables read at run time (e.g. ``shared_ring.DEFAULT_WORKERS``) stay in their module.
torch is an extra (``pip install "diskreplay[torch]"``): without it, importing this package (which
``as_dataset``, ``format="torch"`` and ``dr.RowDataset`` etc. do) raises an ImportError that says so.
"""

from ..build import missing_extra

try:
    import torch  # noqa: F401  # every module below needs it: the one place that says how to install it
except ImportError as error:
    raise missing_extra("torch", "torch", "diskreplay's torch layer (as_dataset, format='torch', RowDataset, "
                        "Loader, to_device)") from error

from .batch_rng import BatchRngs
from .data import dataset_state_from_loader, keep_batch, make_dataset, merge_worker_states
from .datasets import EpochDataset, SampleDataset
from .device import DevicePrefetcher, to_device
from .distributed import DistributedLearner
from .epoch_order import SHUFFLES, EpochOrder, Shard, chunk_pieces, expand_pieces, shard_range, slice_pieces
from .formats import to_tensordict
from .loader import Loader
from .reader import committed_window, current_shard, resolve_rank
from .rows import IndexBatch, IndexBatchSampler, RowDataset
from .shared_ring import FREE, HELD, SENT, ArraySpec, SlotBatch, WorkerRing, plan_slot
from .tensors import Batch, Block, packed_tensors, to_tensors

__all__ = [
    "make_dataset", "SampleDataset", "EpochDataset", "Loader", "Block", "IndexBatchSampler", "IndexBatch", "RowDataset",
    "merge_worker_states", "dataset_state_from_loader", "keep_batch",
    "resolve_rank", "current_shard", "committed_window",
    "Batch", "to_tensors", "packed_tensors", "to_tensordict",
    "to_device", "DevicePrefetcher",
    "WorkerRing", "SlotBatch", "ArraySpec", "plan_slot", "FREE", "SENT", "HELD",
    "BatchRngs", "DistributedLearner",
    "EpochOrder", "Shard", "SHUFFLES", "chunk_pieces", "expand_pieces", "slice_pieces", "shard_range",
]
