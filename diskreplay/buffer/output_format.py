"""What `ReplayBuffer.sample` and `ReplayBuffer.rows` return: numpy arrays, or (``format=``)
torch tensors or a TensorDict, made by the torch layer, imported only when asked for."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..format.ragged import Ragged

FORMATS = ("numpy", "torch", "tensordict")
"""The values ``format=`` takes (`diskreplay.torch.formats` says what each returns)."""


def output_converter(format: str = "numpy", as_tensordict: bool = False,
                     packed: bool = False) -> Callable[[Mapping[str, np.ndarray]], Any]:
    """The function that turns a gathered batch into what the caller asked for: itself for
    ``"numpy"``; for ``"torch"`` a dict of CPU tensors sharing the arrays' memory; for
    ``"tensordict"`` (also ``as_tensordict=True``) a ``tensordict.TensorDict`` whose batch size is
    the arrays' first dim, ``next_*`` fields nested as ``("next", *)`` (TorchRL's layout).
    ``packed``: each ragged field ``f`` as its values end to end, ``f_cu_seqlens`` (int32
    ``[B + 1]``, the row offsets variable-length attention kernels take) and ``f_max_seqlen``
    (an int), as numpy arrays or (``"torch"``) tensors. Checked before anything is read, so
    that a bad argument draws nothing.

    Raises:
        ValueError: ``format`` is not one of `FORMATS`, or ``as_tensordict=True`` with another
            format than ``"numpy"`` (the default) or ``"tensordict"``; ``packed`` with a TensorDict.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if as_tensordict and format not in ("numpy", "tensordict"):
        raise ValueError(f"as_tensordict=True asks for format='tensordict'; it contradicts format={format!r}")
    chosen = "tensordict" if as_tensordict else format
    if packed and chosen == "tensordict":
        raise ValueError("packed=True gives rows of different lengths end to end, which a TensorDict of one "
                         "batch size cannot hold: use format='numpy' or 'torch'")
    if packed:
        return packed_arrays if chosen == "numpy" else _packed_tensors
    return _same if chosen == "numpy" else functools.partial(_convert, chosen)


def packed_arrays(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` with each `Ragged` field ``f`` packed: ``f`` its values end to end,
    ``f_cu_seqlens`` its offsets as int32 ``[B + 1]``, ``f_max_seqlen`` the longest row (an int)."""
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if isinstance(value, Ragged):
            out[name] = value.values
            out[f"{name}_cu_seqlens"] = value.offsets.astype(np.int32)
            out[f"{name}_max_seqlen"] = int(value.lengths.max(initial=0))
        else:
            out[name] = value
    return out


def _packed_tensors(batch: Mapping[str, np.ndarray]) -> Any:
    """``batch`` packed as `packed_arrays`, as torch tensors (torch imported here)."""
    from ..torch.formats import packed

    return packed(batch)


def _same(batch: Mapping[str, np.ndarray]) -> Any:
    """The numpy batch as it was gathered."""
    return batch


def _convert(format: str, batch: Mapping[str, np.ndarray]) -> Any:
    """``batch`` in a torch format; torch (and tensordict) are imported here, at first use."""
    from ..torch.formats import to_format

    return to_format(batch, format)
