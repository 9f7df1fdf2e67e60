"""What `ReplayBuffer.sample` and `ReplayBuffer.rows` return: numpy arrays, or (``format=``)
torch tensors or a TensorDict, made by the torch layer, imported only when asked for."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

FORMATS = ("numpy", "torch", "tensordict")
"""The values ``format=`` takes (`diskreplay.torch.formats` says what each returns)."""


def output_converter(format: str = "numpy", as_tensordict: bool = False) -> Callable[[Mapping[str, np.ndarray]], Any]:
    """The function that turns a gathered batch into what the caller asked for: itself for
    ``"numpy"``; for ``"torch"`` a dict of CPU tensors sharing the arrays' memory; for
    ``"tensordict"`` (also ``as_tensordict=True``) a ``tensordict.TensorDict`` whose batch size is
    the arrays' first dim, ``next_*`` fields nested as ``("next", *)`` (TorchRL's layout).
    Checked before anything is read, so that a bad argument draws nothing.

    Raises:
        ValueError: ``format`` is not one of `FORMATS`, or ``as_tensordict=True`` with another
            format than ``"numpy"`` (the default) or ``"tensordict"``.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if as_tensordict and format not in ("numpy", "tensordict"):
        raise ValueError(f"as_tensordict=True asks for format='tensordict'; it contradicts format={format!r}")
    chosen = "tensordict" if as_tensordict else format
    return _same if chosen == "numpy" else functools.partial(_convert, chosen)


def _same(batch: Mapping[str, np.ndarray]) -> Any:
    """The numpy batch as it was gathered."""
    return batch


def _convert(format: str, batch: Mapping[str, np.ndarray]) -> Any:
    """``batch`` in a torch format; torch (and tensordict) are imported here, at first use."""
    from ..torch.formats import to_format

    return to_format(batch, format)
