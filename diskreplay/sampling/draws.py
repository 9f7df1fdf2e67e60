"""Fast paths into numpy's bit generators, where the `_draws` extension was built and agrees with
this numpy: uniform integer draws (``rng.integers(low, high, size=n)``, the same numbers, without
most of its per-call cost) and PCG64 states set many at a time."""

from __future__ import annotations

import numpy as np

from ..build import disable, load_extension

_draws = load_extension("diskreplay.sampling._draws")  # built from _draws.c where a C compiler was found

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


def set_pcg64_states(generators: list[np.random.Generator], words: np.ndarray) -> None:
    """Set ``generators[i]`` (PCG64 generators) to the state ``words[i]`` (uint64 ``[len(generators),
    4]``: state high, state low, increment high, increment low), as ``bit_generator.state = {...}``
    does: ~0.4 µs per generator where the extension agrees with numpy, ~2 µs otherwise.

    Raises:
        TypeError: a generator is not a PCG64 ``np.random.Generator``.
        ValueError: not one row of ``words`` per generator.
    """
    if any(type(gen) is not np.random.Generator or type(gen.bit_generator) is not np.random.PCG64
           for gen in generators):
        raise TypeError("set_pcg64_states sets PCG64 generators only")
    words = np.ascontiguousarray(words, dtype=np.uint64)
    if len(words) != len(generators):
        raise ValueError(f"set_pcg64_states: {len(generators)} generators, {len(words)} states")
    if _set_pcg64 is not None:
        _set_pcg64([gen.bit_generator.capsule for gen in generators], words)
        return
    for gen, row in zip(generators, words.tolist()):
        _set_as_numpy_does(gen, *row)


def _set_as_numpy_does(gen: np.random.Generator, state_hi: int, state_lo: int, inc_hi: int, inc_lo: int) -> None:
    gen.bit_generator.state = {"bit_generator": "PCG64", "has_uint32": 0, "uinteger": 0,
                               "state": {"state": state_hi << 64 | state_lo, "inc": inc_hi << 64 | inc_lo}}


def _agrees_with_numpy() -> bool:
    """Whether `_draws` gives numpy's numbers here (narrow, wide and rejection-heavy spans)."""
    ours, theirs = np.random.default_rng(20261127), np.random.default_rng(20261127)
    for high in (2, 3, 1000, 3 * 2**30 + 1, 2**31 + 1, _LARGEST_SPAN + 1):
        out = np.empty(64, dtype=np.int64)
        _draws.integers(ours.bit_generator.capsule, -5, high - 1, out)
        if not np.array_equal(out, theirs.integers(-5, high - 5, size=64)):
            return False
    return ours.bit_generator.state == theirs.bit_generator.state


def _sets_pcg64_as_numpy() -> bool:
    """Whether `_draws.set_pcg64` leaves a PCG64 generator in numpy's state for the same words."""
    words = np.array([[2**64 - 3, 12345, 2**63 + 7, 2**40 + 1], [1, 2**64 - 1, 0, 3]], dtype=np.uint64)
    ours = [np.random.Generator(np.random.PCG64(0)) for _ in words]
    for gen in ours:
        gen.integers(0, 10)  # leaves half of a 64-bit output buffered: the setter clears it
    try:
        _draws.set_pcg64([gen.bit_generator.capsule for gen in ours], words)
    except NotImplementedError:
        return False
    for gen, row in zip(ours, words.tolist()):
        theirs = np.random.Generator(np.random.PCG64(1))
        _set_as_numpy_does(theirs, *row)
        if gen.bit_generator.state != theirs.bit_generator.state or \
                not np.array_equal(gen.integers(0, 1000, 8), theirs.integers(0, 1000, 8)):
            return False
    return True


if _draws is not None and not _agrees_with_numpy():
    disable("diskreplay.sampling._draws", f"its uniform draws differ from numpy {np.__version__}'s Generator.integers")
    _draws = None
_set_pcg64 = _draws.set_pcg64 if _draws is not None and _sets_pcg64_as_numpy() else None
if _draws is not None and _set_pcg64 is None:
    disable("diskreplay.sampling._draws", f"it does not set PCG64 states as numpy {np.__version__} does", "set_pcg64")
