"""`SeededPermutation`: a pseudo-random permutation of ``range(n)`` evaluated at any positions,
never stored: an epoch over a billion rows costs no RAM and no start-up time.

Up to `STORED_MAX` values it is numpy's ``default_rng(seed).permutation(n)``, kept (at most 8 MiB).
Beyond, an eight-round Feistel network over the smallest even number of bits that covers ``n``
(round function: the splitmix64 finalizer of the right half and a round key), with cycle walking:
a value ``>= n`` is encrypted again until it falls inside the range, which keeps the map a
bijection of ``range(n)``. Feistel networks over tiny halves are visibly biased; from 10-bit
halves on, eight rounds of a pseudo-random function are far more than shuffling needs (four make
a pseudo-random permutation, Luby and Rackoff).
"""

from __future__ import annotations

import numpy as np

ROUNDS = 8
STORED_MAX = 1 << 20


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (uint64, wrapping)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


class SeededPermutation:
    """The permutation of ``range(n)`` that ``seed`` picks."""

    def __init__(self, n: int, seed: int):
        """Raises ValueError for ``n`` outside ``[0, 2**62]``."""
        if not 0 <= n <= 1 << 62:
            raise ValueError(f"n must be in [0, 2**62], got {n}")
        self.n = n
        self.stored = np.random.default_rng(seed).permutation(n) if n <= STORED_MAX else None
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.default_rng(seed).integers(0, 2**63, ROUNDS, dtype=np.uint64)

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        """The values at ``positions`` (int64 in ``[0, n)``), int64."""
        if self.stored is not None:
            values: np.ndarray = self.stored[positions]
            return values
        out = self._encrypt(np.asarray(positions, np.uint64))
        outside = np.flatnonzero(out >= self.n)
        while outside.size:
            out[outside] = self._encrypt(out[outside])
            outside = outside[out[outside] >= self.n]
        return out.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        joined: np.ndarray = (left << self.half) | right
        return joined
