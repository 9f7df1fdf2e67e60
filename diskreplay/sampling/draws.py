"""Uniform integer draws: ``rng.integers(low, high, size=n)``, the same numbers, without most of
its per-call cost where the `_draws` extension was built and agrees with this numpy."""

from __future__ import annotations

import numpy as np

try:
    from . import _draws  # type: ignore[attr-defined]  # built from _draws.c where a C compiler was found
except ImportError:
    _draws = None

_LARGEST_SPAN = 2**32 - 2
"""The widest ``high - low - 1`` drawn by `_draws`; numpy draws wider ranges in another way."""


def integers(rng: np.random.Generator, low: int, high: int, size: int) -> np.ndarray:
    """int64 ``[size]`` uniform in ``[low, high)``: ``rng.integers(low, high, size=size)``, with the
    same numbers and ``rng`` left in the same state."""
    span = high - low - 1
    if _draws is None or not 0 < span <= _LARGEST_SPAN or type(rng) is not np.random.Generator:
        return rng.integers(low, high, size=size)
    out = np.empty(size, dtype=np.int64)
    bits = rng.bit_generator
    with bits.lock:
        _draws.integers(bits.capsule, low, span, out)
    return out


def _agrees_with_numpy() -> bool:
    """Whether `_draws` gives numpy's numbers here (narrow, wide and rejection-heavy spans)."""
    ours, theirs = np.random.default_rng(20261127), np.random.default_rng(20261127)
    for high in (2, 3, 1000, 3 * 2**30 + 1, 2**31 + 1, _LARGEST_SPAN + 1):
        out = np.empty(64, dtype=np.int64)
        _draws.integers(ours.bit_generator.capsule, -5, high - 1, out)
        if not np.array_equal(out, theirs.integers(-5, high - 5, size=64)):
            return False
    return ours.bit_generator.state == theirs.bit_generator.state


if _draws is not None and not _agrees_with_numpy():
    _draws = None
