"""Discounted returns, GAE, n-step targets and episodic returns (pure numpy).

Conventions shared by every function in this module:

* Arrays are **time-major**: shape ``[T]`` or ``[T, *E]`` where ``E`` are
  parallel environments (any number of trailing axes).  The leading axis is
  always time; the recursions run along it and are vectorized over ``E``.
* ``terminated[t]`` true: the episode ended at step ``t`` by reaching a
  terminal state, so nothing is bootstrapped after ``t``.
* ``truncated[t]`` true: the episode was cut at step ``t`` by a time limit;
  the target at ``t`` still bootstraps from the value of the next observation.
  If both flags are set, termination wins.
* ``done = terminated | truncated``: step ``t`` is the last step of its
  episode, so no recursion (discounted sum, GAE lambda-chain, n-step window)
  crosses from ``t`` to ``t + 1``.
* Accumulation is done in float64.  Results are float64 when the main input
  (``x`` / ``rewards`` / ``values`` / ``adv``) is float64, float32 otherwise.
* Invalid arguments raise ``ValueError``: a shape mismatch names the argument
  and gives expected and actual shapes; an out-of-range ``gamma``,
  ``gae_lambda`` or ``n`` gives the offending value.

This module depends on numpy only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ..checks import check_int

__all__ = [
    "discount_cumsum",
    "gae_advantages",
    "nstep_targets",
    "episodic_returns",
    "normalize_advantages",
]


# --------------------------------------------------------------------------- #
# validation helpers
# --------------------------------------------------------------------------- #
def _check_unit_interval(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise ValueError unless it lies in [0, 1]."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number in [0, 1], got {value!r}") from None
    if not (0.0 <= v <= 1.0):  # also rejects NaN
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    return v


def _check_n(n: Any) -> int:
    """Return ``n`` as an int, or raise ValueError unless it is an int >= 1 (`check_int`)."""
    return check_int(n, "n", 1)


def _time_major(name: str, x: ArrayLike) -> np.ndarray:
    """``np.asarray(x)``, raising ValueError if it has no leading time axis."""
    arr = np.asarray(x)
    if arr.ndim < 1:
        raise ValueError(f"{name} must have a leading time axis (shape [T] or [T, *E]), got shape {arr.shape}")
    return arr


def _same_shape(name: str, x: ArrayLike, shape: tuple[int, ...], ref: str) -> np.ndarray:
    """``np.asarray(x)``, raising ValueError unless its shape is ``shape``."""
    arr = np.asarray(x)
    if arr.shape != shape:
        raise ValueError(f"{name} has shape {arr.shape}, expected {shape} (same as {ref})")
    return arr


def _env_shaped(name: str, x: ArrayLike, env_shape: tuple[int, ...]) -> np.ndarray:
    """Broadcast a per-env array (shape ``E`` or scalar) to ``env_shape``."""
    arr = np.asarray(x)
    if arr.shape != env_shape and arr.shape != ():
        raise ValueError(f"{name} has shape {arr.shape}, expected {env_shape} (trailing shape of rewards) or a scalar")
    return np.broadcast_to(arr, env_shape)


def _out_dtype(*arrays: np.ndarray) -> type[np.float64] | type[np.float32]:
    """float64 if any of ``arrays`` is float64, else float32."""
    return np.float64 if any(a.dtype == np.float64 for a in arrays) else np.float32


def _backward_discounted(x: np.ndarray, gamma: float, cont: np.ndarray) -> np.ndarray:
    """y[t] = x[t] + gamma * cont[t] * y[t+1], y[T] = 0; float64 in, float64 out."""
    y = np.empty_like(x)
    acc = np.zeros(x.shape[1:], dtype=np.float64)
    for t in range(x.shape[0] - 1, -1, -1):
        acc = x[t] + gamma * cont[t] * acc
        y[t] = acc
    return y


# --------------------------------------------------------------------------- #
# public functions
# --------------------------------------------------------------------------- #
def discount_cumsum(x: ArrayLike, gamma: float, dones: ArrayLike | None = None) -> np.ndarray:
    """Discounted cumulative sum along the time axis, reset at episode ends.

    ``y[t] = x[t] + gamma * y[t+1] * (1 - dones[t])`` with ``y[T] = 0``, i.e.
    ``dones[t]`` true means an episode ended at step ``t`` and nothing after
    ``t`` contributes to ``y[t]``.

    Args:
        x: shape ``[T]`` or ``[T, *E]``.
        gamma: discount in ``[0, 1]``.
        dones: optional bool-like array of the same shape as ``x``.

    Returns:
        Array of the shape of ``x``; float64 if ``x`` is float64, else float32.

    Raises:
        ValueError: ``x`` is 0-d, ``dones`` has a different shape, or
            ``gamma`` is outside ``[0, 1]``.
    """
    g = _check_unit_interval("gamma", gamma)
    arr = _time_major("x", x)
    if dones is None:
        cont = np.ones(arr.shape, dtype=np.float64)
    else:
        cont = 1.0 - _same_shape("dones", dones, arr.shape, "x").astype(bool)
    y = _backward_discounted(arr.astype(np.float64), g, cont)
    return y.astype(_out_dtype(arr), copy=False)


def gae_advantages(
    rewards: ArrayLike,
    values: ArrayLike,
    terminated: ArrayLike,
    truncated: ArrayLike,
    last_values: ArrayLike | None,
    last_terminated: ArrayLike | None,
    gamma: float,
    gae_lambda: float,
    next_values: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalized advantage estimation with correct truncation handling.

    With ``nv[t]`` the value of the observation that followed step ``t``::

        delta[t] = r[t] + gamma * nv[t] * (1 - terminated[t]) - values[t]
        A[t]     = delta[t] + gamma * gae_lambda * (1 - done[t]) * A[t+1],  A[T] = 0
        returns  = A + values

    So the lambda-chain is cut at every episode end (``done = terminated |
    truncated``), while the TD error of a truncated step still bootstraps.

    Bootstrap value ``nv[t]``:

    * ``next_values`` given: ``nv = next_values`` (``V`` of the actual next
      observation, i.e. of the *final* observation at truncation steps, and
      ``V(s_T)`` at ``t = T - 1``).  ``last_values`` is then ignored and may
      be ``None``.
    * ``next_values`` is ``None``: ``nv[t] = values[t+1]`` for ``t < T - 1``
      and ``nv[T-1] = last_values``.  At a truncation step those belong to the
      *next* episode's first state (auto-reset), and the final observation's
      value is unknown, so **``nv[t] = values[t]`` is used when
      ``truncated[t]``** (the value of the last state seen stands in for that of
      the final observation; ``delta[t] = r[t] + (gamma - 1) * values[t]``).
      Pass ``next_values`` for exact targets.

    ``last_terminated`` (shape ``E`` or scalar, may be ``None``) marks that the
    last step ``T - 1`` ended in a terminal state; it is OR-ed into
    ``terminated[T-1]`` (for loops that hold the final flag separately).

    Args:
        rewards: ``[T]`` or ``[T, *E]``.
        values: ``V(s_t)``, same shape as ``rewards``.
        terminated: bool-like, same shape as ``rewards``.
        truncated: bool-like, same shape as ``rewards``.
        last_values: ``V(s_T)``, shape ``E`` (or scalar); required unless
            ``next_values`` is given.
        last_terminated: bool-like, shape ``E`` (or scalar), or ``None``.
        gamma: discount in ``[0, 1]``.
        gae_lambda: GAE's lambda in ``[0, 1]``.
        next_values: optional, same shape as ``rewards``.

    Returns:
        ``(advantages, returns)``, both of the shape of ``rewards``; float64 if
        ``rewards`` or ``values`` is float64, else float32.

    Raises:
        ValueError: on any shape mismatch (naming the argument), a missing
            ``last_values`` without ``next_values``, or ``gamma`` /
            ``gae_lambda`` outside ``[0, 1]``.
    """
    g = _check_unit_interval("gamma", gamma)
    lam = _check_unit_interval("gae_lambda", gae_lambda)
    r = _time_major("rewards", rewards)
    shape, env_shape = r.shape, r.shape[1:]
    v = _same_shape("values", values, shape, "rewards").astype(np.float64)
    term = _same_shape("terminated", terminated, shape, "rewards").astype(bool)
    done = term | _same_shape("truncated", truncated, shape, "rewards").astype(bool)
    trunc = done & ~term
    if last_terminated is not None and shape[0] > 0:
        term[-1] |= _env_shaped("last_terminated", last_terminated, env_shape).astype(bool)

    if next_values is not None:
        nv = _same_shape("next_values", next_values, shape, "rewards").astype(np.float64)
    else:
        if last_values is None:
            raise ValueError("last_values is required when next_values is None")
        last = _env_shaped("last_values", last_values, env_shape).astype(np.float64)
        nv = np.concatenate([v[1:], last[None]], axis=0)
        nv = np.where(trunc, v, nv)

    delta = r.astype(np.float64) + g * nv * (1.0 - term) - v
    adv = _backward_discounted(delta, g * lam, 1.0 - done)
    dtype = _out_dtype(r, np.asarray(values))
    return adv.astype(dtype), (adv + v).astype(dtype)


def nstep_window(rewards: np.ndarray, k: np.ndarray, terminated_last: np.ndarray,
                 gamma: float) -> tuple[np.ndarray, np.ndarray]:
    """The n-step rule, for windows already gathered: every n-step figure goes through here.

    ``rewards[:, i]`` is the reward ``i`` steps after each window's start (``[B, n, *E]``; entries
    at ``i >= k`` are ignored), ``k`` (``[B, *E]``, in ``[1, n]``) the steps each window uses and
    ``terminated_last`` whether its last used step terminates. Returns float64 ``returns`` =
    sum_{i<k} gamma**i * rewards[:, i], added in order of ``i``, and ``discounts`` =
    gamma**k * (1 - terminated_last): a truncation bootstraps, a termination does not.
    """
    n = rewards.shape[1]
    # Python's pow, so that gamma**k is the same number under every numpy: numpy 1.26's vectorised
    # float64 power rounds some powers an ulp apart from it.
    powers = np.array([float(gamma) ** i for i in range(n + 1)], dtype=np.float64)
    returns = np.zeros(rewards.shape[:1] + rewards.shape[2:], dtype=np.float64)
    for i in range(n):
        returns += np.where(i < k, powers[i] * rewards[:, i].astype(np.float64), 0.0)
    discounts: np.ndarray = powers[k] * ~np.asarray(terminated_last, dtype=bool)
    return returns, discounts


def nstep_targets(
    rewards: ArrayLike,
    terminated: ArrayLike,
    truncated: ArrayLike,
    n: int,
    gamma: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n-step return targets for one contiguous, time-ordered lane segment.

    For each start ``t`` the window uses ``k[t] = min(n, steps until the
    episode ends (the end step included), T - t)`` steps, and::

        returns[t]   = sum_{i < k} gamma**i * rewards[t + i]
        offsets[t]   = k                       # bootstrap from next_obs[t + k - 1]
        discounts[t] = gamma**k * (1 - terminated[t + k - 1])

    so the full target is ``returns[t] + discounts[t] * V(next_obs[t + k - 1])``.
    A truncation at the last used step bootstraps (discount ``gamma**k``); a
    termination does not (discount 0).  The window also stops at the segment
    end, where it bootstraps from that step's next observation.

    Vectorized over ``t`` (and trailing axes, if any): the only loop is over
    the ``n`` window offsets.

    Args:
        rewards: shape ``[T]`` (trailing axes ``[T, *E]`` also accepted).
        terminated: bool-like, same shape as ``rewards``.
        truncated: bool-like, same shape as ``rewards``.
        n: window length, integer ``>= 1``.
        gamma: discount in ``[0, 1]``.

    Returns:
        ``(returns, discounts, offsets)`` of the shape of ``rewards``; returns
        and discounts are float64 if ``rewards`` is float64 else float32;
        offsets are int64 in ``[1, n]``.

    Raises:
        ValueError: shape mismatch, ``n < 1`` or ``gamma`` outside ``[0, 1]``.
    """
    n = _check_n(n)
    g = _check_unit_interval("gamma", gamma)
    r_in = _time_major("rewards", rewards)
    shape, T = r_in.shape, r_in.shape[0]
    term = _same_shape("terminated", terminated, shape, "rewards").astype(bool)
    done = term | _same_shape("truncated", truncated, shape, "rewards").astype(bool)
    width = min(n, T)
    windows = np.zeros((T, width, *shape[1:]), dtype=np.float64)
    k = np.zeros(shape, dtype=np.int64)
    alive = np.ones(shape, dtype=bool)  # window starting at t still open at offset i
    for i in range(width):
        alive[T - i :] = False  # t + i would run past the segment end
        windows[: T - i, i] = r_in[i:]
        k += alive
        d_i = np.ones(shape, dtype=bool)
        d_i[: T - i] = done[i:]
        alive &= ~d_i

    last = np.arange(T).reshape((T,) + (1,) * (len(shape) - 1)) + k - 1
    term_last = np.take_along_axis(term, last, axis=0) if T else term
    ret, disc = nstep_window(windows, k, term_last, g)
    dtype = _out_dtype(r_in)
    return ret.astype(dtype), disc.astype(dtype), k


def episodic_returns(
    rewards: ArrayLike,
    done: ArrayLike,
    gamma: float,
    default_return: float = 0.0,
    clip: tuple[float, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Discounted return-to-go within each episode of one lane segment.

    ``returns[t] = sum_{i=0}^{e-t} gamma**i * rewards[t + i]`` where ``e`` is
    the first step ``>= t`` with ``done[e]``.  Steps of the final, unfinished
    episode (no ``done`` at or after them) get ``default_return`` and
    ``complete[t] = False``.  No bootstrapping is done.

    Args:
        rewards: shape ``[T]`` (trailing axes ``[T, *E]`` also accepted).
        done: bool-like, same shape; ``done[t]``: an episode ended at ``t``
            (terminated or truncated).
        gamma: discount in ``[0, 1]``.
        default_return: value for steps of the unfinished episode.
        clip: optional ``(lo, hi)``; rewards are clipped to it first.

    Returns:
        ``(returns, complete)``: returns float64 if ``rewards`` is float64
        else float32; ``complete`` bool, both of the shape of ``rewards``.

    Raises:
        ValueError: shape mismatch, ``gamma`` outside ``[0, 1]``, or
            ``clip`` not a pair with ``lo <= hi``.
    """
    g = _check_unit_interval("gamma", gamma)
    r_in = _time_major("rewards", rewards)
    d = _same_shape("done", done, r_in.shape, "rewards").astype(bool)
    r = r_in.astype(np.float64)
    if clip is not None:
        lo, hi = _check_clip(clip)
        r = np.clip(r, lo, hi)
    complete = np.flip(np.logical_or.accumulate(np.flip(d, 0), axis=0), 0)
    ret = _backward_discounted(r, g, 1.0 - d)
    ret = np.where(complete, ret, float(default_return))
    return ret.astype(_out_dtype(r_in)), complete


def _check_clip(clip: Any) -> tuple[float, float]:
    """Validate a ``(lo, hi)`` clip range."""
    try:
        lo, hi = (float(c) for c in clip)
    except (TypeError, ValueError):
        raise ValueError(f"clip must be a pair (lo, hi), got {clip!r}") from None
    if not lo <= hi:
        raise ValueError(f"clip must satisfy lo <= hi, got {clip!r}")
    return lo, hi


def normalize_advantages(adv: ArrayLike, eps: float = 1e-8) -> np.ndarray:
    """Standardize advantages over all elements: ``(adv - mean) / (std + eps)``.

    Args:
        adv: any shape (statistics are over every element).
        eps: non-negative constant added to the (population) std.

    Returns:
        New array of the shape of ``adv``; float64 if ``adv`` is float64 else
        float32.  An empty input gives an empty output; a constant input
        gives zeros.

    Raises:
        ValueError: ``eps`` is negative or not finite.
    """
    if not (math.isfinite(float(eps)) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    a_in = np.asarray(adv)
    dtype = _out_dtype(a_in)
    if a_in.size == 0:
        return a_in.astype(dtype)
    a = a_in.astype(np.float64)
    std = a.std()
    out: np.ndarray = a - a.mean()
    if std + eps > 0:
        out /= std + eps
    return out.astype(dtype)
