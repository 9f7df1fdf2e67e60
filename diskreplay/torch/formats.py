"""Batches in torch formats: ``{name: numpy array}`` -> CPU tensors or a ``tensordict.TensorDict``.

Tensors share memory with the gathered arrays (``torch.from_numpy``): no row is copied again.
Field names map to TensorDict keys as TorchRL lays them out (`name_to_key`): ``next_obs`` ->
``("next", "obs")``, ``a__b`` -> ``("a", "b")``, ``__next_x`` -> ``"next_x"`` (a root key that
would otherwise read as nested), every other name stays a root key. `key_to_name` is its
inverse, used by `diskreplay.integrations.torchrl` to store TensorDicts as fields.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..buffer.output_format import FORMATS
from ..format.ragged import Ragged

NEXT = "next"
"""The sub-TensorDict TorchRL keeps a transition's next step in."""
SEPARATOR = "__"
"""Joins the levels of other nested keys in a field name: ``("a", "b")`` <-> ``a__b``."""

Key = str | tuple[str, ...]


def as_tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A CPU tensor viewing ``array``'s memory (same shape and dtype, bool included); a tensor
    is returned as it is (so that batches a dataset yielded convert too, on any device).

    Copied only where torch cannot view the array: a read-only, byte-swapped or negatively
    strided array becomes a native, C-contiguous copy first.

    Raises:
        TypeError: a dtype torch has no tensor type for (strings, objects, ...).
    """
    if isinstance(array, torch.Tensor):
        return array
    if type(array) is not np.ndarray or not array.flags.writeable or not array.dtype.isnative:
        array = np.asarray(array)
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        if not array.flags.writeable:
            array = np.array(array, order="C")
    try:
        return torch.from_numpy(array)
    except ValueError:  # negative strides
        return torch.from_numpy(np.array(array, order="C"))
    except TypeError as err:
        raise TypeError(f"an array of dtype {array.dtype} has no torch tensor type: {err}") from None


def to_torch(batch: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``{name: array}`` -> ``{name: CPU tensor}`` sharing the arrays' memory (see `as_tensor`).
    A `Ragged` becomes a jagged ``torch.nested`` tensor (``layout=torch.jagged``, `as_nested`);
    text (an object array of ``str``) stays a numpy array: torch has no string tensors."""
    return {name: _torch_value(value) for name, value in batch.items()}


def _torch_value(value: Any) -> Any:
    if isinstance(value, Ragged):
        return as_nested(value)
    if isinstance(value, np.ndarray) and value.dtype == object:
        return value
    return as_tensor(value)


def as_nested(ragged: Ragged) -> torch.Tensor:
    """A `Ragged` as a jagged nested tensor ``[B, j, *T]`` viewing its values (no copy)."""
    return torch.nested.nested_tensor_from_jagged(as_tensor(ragged.values), as_tensor(ragged.offsets))


def packed(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` with each `Ragged` field ``f`` packed as variable-length attention kernels take
    it: ``f`` the values end to end (a tensor ``[total, *T]``), ``f_cu_seqlens`` the int32
    offsets ``[B + 1]`` and ``f_max_seqlen`` the longest row (an int); other fields as `to_torch`."""
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if isinstance(value, Ragged):
            out[name] = as_tensor(value.values)
            out[f"{name}_cu_seqlens"] = torch.from_numpy(value.offsets.astype(np.int32))
            out[f"{name}_max_seqlen"] = int(value.lengths.max(initial=0))
        else:
            out[name] = _torch_value(value)
    return out


def name_to_key(name: str) -> Key:
    """The TensorDict key of field ``name``: ``next_x`` -> ``("next", x)``, ``a__b`` ->
    ``("a", "b")`` (both: ``next_a__b`` -> ``("next", "a", "b")``), a name that starts with
    ``__`` its levels as they are (``__next_x`` -> ``"next_x"``), else ``name`` itself."""
    parts: tuple[str, ...] = ()
    if name.startswith(SEPARATOR):
        name = name[len(SEPARATOR):]
    elif _nests(name):
        parts, name = (NEXT,), name[len(NEXT) + 1:]
    parts += tuple(name.split(SEPARATOR))
    return parts[0] if len(parts) == 1 else parts


def key_to_name(key: Key) -> str:
    """The field name of TensorDict key ``key``, the inverse of `name_to_key`: a first level
    ``next_x`` (which `name_to_key` would read as ``("next", x)``) gets the prefix ``__``.

    Raises:
        ValueError: a key level that is empty or holds ``"__"`` (the names could not be told apart).
    """
    parts = (key,) if isinstance(key, str) else tuple(key)
    bad = [p for p in parts if not isinstance(p, str) or not p or SEPARATOR in p]
    if bad:
        raise ValueError(f"TensorDict key {key!r} cannot be a field name: levels must be non-empty "
                         f"strings without {SEPARATOR!r}")
    if len(parts) > 1 and parts[0] == NEXT:
        return f"{NEXT}_{SEPARATOR.join(parts[1:])}"
    return (SEPARATOR if _nests(parts[0]) else "") + SEPARATOR.join(parts)


def _nests(name: str) -> bool:
    """Whether a name's first level, ``next_x``, stands for ``("next", x)``."""
    return name.startswith(NEXT + "_") and len(name) > len(NEXT) + 1


def tensordict_keys(names: Iterable[str]) -> dict[str, Key]:
    """The TensorDict key of each field name (`name_to_key`), checked to make one TensorDict.

    Raises:
        ValueError: two names for one key, or a key that would be both a tensor and a nested
            TensorDict (``next`` and ``next_obs``).
    """
    keys = {name: name_to_key(name) for name in names}
    paths = {(key,) if isinstance(key, str) else key for key in keys.values()}
    if len(paths) != len(keys):
        raise ValueError(f"fields {sorted(keys)} do not make one TensorDict: two of them map to one key "
                         f"(see name_to_key); use format='torch'")
    clashes = sorted({path[:n] for path in paths for n in range(1, len(path)) if path[:n] in paths})
    if clashes:
        shown = [c[0] if len(c) == 1 else c for c in clashes]
        raise ValueError(f"fields {sorted(keys)} do not make one TensorDict: {shown} would be both a tensor "
                         f"and a nested TensorDict; use format='torch'")
    return keys


def to_tensordict(batch: Mapping[str, np.ndarray | torch.Tensor], batch_dims: int = 1) -> Any:
    """``{name: array [B, ...]}`` -> ``tensordict.TensorDict`` with ``batch_size`` the first
    ``batch_dims`` dims of the arrays (``[B]``) and keys by `name_to_key`; no copy (`as_tensor`).
    Also for the batches of `diskreplay.torch.data.make_dataset` (tensors, e.g. on a GPU after
    `to_device`): ``to_tensordict(batch)`` puts them in TorchRL's layout (what
    ``make_dataset(..., as_tensordict=True)`` yields).

    Raises:
        ImportError: the ``tensordict`` package is not installed.
        ValueError: see `tensordict_keys`.
    """
    keys = tensordict_keys(batch)
    first = next(iter(batch.values()), np.empty(0))
    return from_leaves({keys[name]: as_tensor(array) for name, array in batch.items()},
                       tuple(first.shape[:batch_dims]))


def from_leaves(leaves: Mapping[Key, Any], batch_size: Sequence[int]) -> Any:
    """A ``tensordict.TensorDict`` of batch size ``batch_size`` holding each value of ``leaves``
    (tensors ``[*batch_size, ...]``, not copied) at its key (a tuple key: nested); the inverse of
    `leaves_of`.

    Raises:
        ImportError: the ``tensordict`` package is not installed.
    """
    out = tensordict_class()({}, batch_size=tuple(batch_size))
    for key, value in leaves.items():
        out.set(key, value)
    return out


def leaves_of(td: Any) -> dict[Key, Any]:
    """``{key: leaf}`` for every leaf of TensorDict ``td`` (nested keys as tuples), in its order."""
    return dict(td.items(include_nested=True, leaves_only=True))


def is_tensordict(obj: Any) -> bool:
    """Whether ``obj`` is a TensorDict (any ``tensordict.TensorDictBase``); never imports tensordict."""
    module = sys.modules.get("tensordict")
    return module is not None and isinstance(obj, module.TensorDictBase)


def tensordict_class(needed_by: str = "format='tensordict'") -> Any:
    """``tensordict.TensorDict``, imported now.

    Raises:
        ImportError: tensordict is not installed (naming the package to install and ``needed_by``,
            what asked for it)."""
    try:
        from tensordict import TensorDict
    except ImportError as err:
        raise ImportError(f"{needed_by} needs the tensordict package: pip install tensordict") from err
    return TensorDict


def to_format(batch: Mapping[str, np.ndarray], format: str) -> Any:
    """``batch`` in ``format`` (one of `FORMATS`): the arrays themselves, `to_torch` or `to_tensordict`.

    Raises:
        ValueError: an unknown format.
    """
    if format == "numpy":
        return batch
    if format == "torch":
        return to_torch(batch)
    if format == "tensordict":
        return to_tensordict(batch)
    raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
