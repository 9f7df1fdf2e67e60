"""Per-batch random generators of datasets: ``numpy.random.default_rng([seed, rank, b])``, cheaply.

A dataset draws batch ``b`` with its own generator, so batches do not depend on how many workers
share the stream and a resumed iteration draws the same batches. Seeding a generator the numpy way
costs ~27 µs (SeedSequence hashing in Python objects); `BatchRngs` runs the same SeedSequence
algorithm vectorised over a block of batch numbers and re-seeds one PCG64 per batch, ~6 µs, with
the very same draws (tested against numpy).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_M32, _M128 = 0xFFFFFFFF, (1 << 128) - 1
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341


def _words(x: int) -> list[int]:
    """``x >= 0`` as little-endian 32-bit words (at least one), as numpy's SeedSequence reads it."""
    words = [x & _M32]
    x >>= 32
    while x:
        words.append(x & _M32)
        x >>= 32
    return words


def _seed_states(entropy: list[npt.NDArray[np.uint64]]) -> npt.NDArray[np.uint64]:
    """``SeedSequence(e).generate_state(4, uint64)`` for K entropies at once: ``entropy`` is a list
    of per-word uint64 arrays ``[K]`` (values < 2**32). Returns ``[4, K]`` uint64 (numpy's
    SeedSequence algorithm, pool size 4, vectorised over K)."""
    hc = _INIT_A

    def hashmix(value: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        nonlocal hc
        value = value ^ np.uint64(hc)
        hc = hc * _MULT_A & _M32
        value = value * np.uint64(hc) & np.uint64(_M32)
        return value ^ (value >> np.uint64(16))

    def mix(x: npt.NDArray[np.uint64], y: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        r = (np.uint64(_MIX_L) * x - np.uint64(_MIX_R) * y) & np.uint64(_M32)
        return r ^ (r >> np.uint64(16))

    zero = np.zeros_like(entropy[0])
    pool = [hashmix(entropy[i] if i < len(entropy) else zero) for i in range(4)]
    for src in range(4):
        for dst in range(4):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(4, len(entropy)):
        for dst in range(4):
            pool[dst] = mix(pool[dst], hashmix(entropy[src]))
    hc, words = _INIT_B, []
    for i in range(8):
        value = pool[i % 4] ^ np.uint64(hc)
        hc = hc * _MULT_B & _M32
        value = value * np.uint64(hc) & np.uint64(_M32)
        words.append(value ^ (value >> np.uint64(16)))
    return np.stack([words[2 * j] | (words[2 * j + 1] << np.uint64(32)) for j in range(4)])


def _pcg64_state(seed: tuple[int, int, int, int]) -> tuple[int, int]:
    """PCG64's (state, increment) when seeded with ``generate_state(4, uint64)`` words."""
    initstate, initseq = seed[0] << 64 | seed[1], seed[2] << 64 | seed[3]
    inc = (initseq << 1 | 1) & _M128
    state = (inc + initstate) & _M128
    return (state * _PCG_MULT + inc) & _M128, inc


class BatchRngs:
    """``rngs(b)`` is a generator in the state of ``numpy.random.default_rng([seed, rank, b])``
    (the same draws), for ``b`` in steps of ``stride``, several times cheaper: the seed hashing
    runs vectorised for a block of batches at a time (16, growing to ``max_block``) and one PCG64
    is re-seeded per batch. The returned generator is shared: use it before the next call."""

    def __init__(self, seed: int, rank: int, stride: int = 1, max_block: int = 1024):
        self.prefix = [np.uint64(w) for w in _words(int(seed)) + _words(int(rank))]
        self.stride, self.block, self.max_block = int(stride), 16, int(max_block)
        self._bits = np.random.PCG64()
        self._gen = np.random.Generator(self._bits)
        self._states: dict[int, tuple[int, int]] = {}
        self._seed, self._rank = int(seed), int(rank)

    def __call__(self, b: int) -> np.random.Generator:
        """The generator of batch ``b`` (>= 0), in the state of ``default_rng([seed, rank, b])``;
        shared between calls: use it before the next call."""
        state = self._states.pop(b, None)
        if state is None:
            if b + self.stride * self.block >= 1 << 32:  # two words per b: numpy's own path
                return np.random.default_rng([self._seed, self._rank, b])
            state = self._fill(b)
        self._bits.state = {"bit_generator": "PCG64", "state": {"state": state[0], "inc": state[1]},
                            "has_uint32": 0, "uinteger": 0}
        return self._gen

    def _fill(self, b: int) -> tuple[int, int]:
        bs = b + self.stride * np.arange(self.block, dtype=np.uint64)
        entropy = [np.full(self.block, w, np.uint64) for w in self.prefix] + [bs]
        seeds = _seed_states(entropy).T.tolist()
        self._states = {int(x): _pcg64_state(tuple(v)) for x, v in zip(bs.tolist(), seeds)}
        self.block = min(4 * self.block, self.max_block)
        return self._states.pop(b)
