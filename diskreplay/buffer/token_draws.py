"""Token-budgeted draws (`ReplayBuffer.sample_tokens`): the sampler's rows, in draw order, kept
while their summed lengths of some ragged fields stay within a budget, optionally only rows
whose scalar fields lie in given ranges (``where``).

A draw is made in rounds: the sampler draws a block of rows, the rows outside ``where`` are
dropped (one gather of those fields, a vectorized mask), the lengths of the rest come from
their ends (no values read), and one ``cumsum`` + ``searchsorted`` finds how many fit. The
batch ends before the first row that would pass the budget; otherwise the next block is sized
from the lengths and the share of matching rows seen so far. No Python loop runs per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks import check_int
from ..errors import EmptyBufferError, SchemaError
from ..format.lanes import row_ids
from ..format.schema import Schema
from ..sampling import Draw, Sampler

FIRST_DRAW = 64
"""Rows drawn in a call's first round (fewer when ``max_rows`` is smaller)."""
MIN_MAX_DRAWS = 4096
"""The least ``max_draws`` defaults to (else 16 draws per row the batch may hold)."""
Lengths = Callable[[np.ndarray, np.ndarray, str], np.ndarray]
Values = Callable[..., Mapping[str, Any]]
Bound = tuple[str, Any, Any]


@dataclass(frozen=True)
class TokenRequest:
    """What `ReplayBuffer.sample_tokens` was asked for (checked by `token_request`)."""

    max_tokens: int
    lengths_of: tuple[str, ...]
    where: tuple[Bound, ...] = ()
    """``(field, low, high)``: rows with ``low <= value <= high`` (None: no bound)."""
    max_rows: int = 1
    max_draws: int = MIN_MAX_DRAWS
    options: dict[str, Any] = field(default_factory=dict)


def token_request(schema: Schema, max_tokens: int, lengths_of: str | Sequence[str],
                  where: Mapping[str, tuple[Any, Any]] | None, max_rows: int | None, max_draws: int | None,
                  options: dict[str, Any]) -> TokenRequest:
    """The request of `ReplayBuffer.sample_tokens`'s arguments, checked before anything is drawn.

    Raises:
        ValueError: ``max_tokens``, ``max_rows`` or ``max_draws`` not an int >= 1; ``where``
            bounds that are not two numbers (or None) with low <= high.
        SchemaError: a ``lengths_of`` field that is missing or not ragged; a ``where`` field that
            is missing or not a scalar number (shape ``()``).
    """
    budget = check_int(max_tokens, "max_tokens", 1)
    rows = budget if max_rows is None else check_int(max_rows, "max_rows", 1)
    draws = max(MIN_MAX_DRAWS, 16 * rows) if max_draws is None else check_int(max_draws, "max_draws", 1)
    names = (lengths_of,) if isinstance(lengths_of, str) else tuple(lengths_of)
    if not names:
        raise ValueError("lengths_of: expected the name of a ragged field (or several), got none")
    for name in names:
        f = schema.fields.get(name)
        if f is None:
            raise SchemaError(f"lengths_of: {name!r} is not a field; the buffer has {list(schema.fields)}")
        if not f.ragged:
            raise SchemaError(f"lengths_of: field {name!r} is not ragged (shape {f.shape}); a token budget "
                              f"counts the values of ragged fields (Field((None,), ...))")
    bounds = tuple(_bound(schema, name, limits) for name, limits in (where or {}).items())
    return TokenRequest(budget, names, bounds, rows, draws, options)


def _bound(schema: Schema, name: str, limits: Any) -> Bound:
    f = schema.fields.get(name)
    if f is None:
        raise SchemaError(f"where: {name!r} is not a field; the buffer has {list(schema.fields)}")
    if f.ragged or f.shape != () or f.dtype.kind not in "biuf":
        raise SchemaError(f"where: field {name!r} is not a scalar number (shape (), a numeric dtype); it is "
                          f"{'ragged' if f.ragged else f'{f.dtype} shaped {f.shape}'}")
    if not isinstance(limits, (tuple, list)) or len(limits) != 2:
        raise ValueError(f"where[{name!r}]: expected (low, high), either None for no bound, got {limits!r}")
    low, high = limits
    for value in (low, high):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, np.number))
                                  or math.isnan(value)):
            raise ValueError(f"where[{name!r}]: bounds must be numbers or None, got {value!r}")
    if low is not None and high is not None and low > high:
        raise ValueError(f"where[{name!r}]: low {low} is above high {high}")
    return name, low, high


def draw_tokens(sampler: Sampler, rng: np.random.Generator, lo: np.ndarray, hi: np.ndarray, request: TokenRequest,
                lengths: Lengths, values: Values) -> Draw:
    """The rows of a token-budgeted batch (see the module). ``lengths(lane, step, name)``: rows'
    lengths of a ragged field; ``values(lane, step, names)``: rows of fixed fields.

    Raises:
        ValueError: the first row drawn that matches is longer than ``max_tokens`` alone.
        EmptyBufferError: no row among ``max_draws`` drawn matched ``where``.
    """
    kept: list[Draw] = []
    rows = tokens = drawn = matched = 0
    block = min(FIRST_DRAW, request.max_rows)
    while True:
        draw = sampler.sample(rng, block, lo, hi, **request.options)
        drawn += block
        draw = _matching(draw, request.where, values)
        size = _sizes(draw, request.lengths_of, lengths)
        total = tokens + np.cumsum(size)
        fit = min(int(np.searchsorted(total, request.max_tokens, side="right")), request.max_rows - rows)
        if rows == 0 and fit == 0 and len(size):
            row = int(row_ids(draw.lane[:1], draw.step[:1], len(lo))[0])
            raise ValueError(f"row {row} holds {int(size[0])} values of {list(request.lengths_of)}, more than "
                             f"max_tokens={request.max_tokens}: the budget must hold the longest row")
        kept.append(_taken(draw, fit))
        rows, tokens, matched = rows + fit, (int(total[fit - 1]) if fit else tokens), matched + len(size)
        if fit < len(size) or rows == request.max_rows or drawn >= request.max_draws:
            break
        block = _next_block(request, rows, tokens, matched, drawn)
    if rows == 0:
        raise EmptyBufferError(f"no row matched where={_shown(request.where)} among {drawn} rows drawn "
                               f"(max_draws={request.max_draws})")
    return Draw.joined(kept)


def _sizes(draw: Draw, names: tuple[str, ...], lengths: Lengths) -> np.ndarray:
    """Each drawn row's length, summed over the ragged fields ``names``."""
    size = np.zeros(len(draw.step), np.int64)
    for name in names:
        size += lengths(draw.lane, draw.step, name)
    return size


def _matching(draw: Draw, where: tuple[Bound, ...], values: Values) -> Draw:
    """The rows of ``draw`` inside every range of ``where``, in draw order."""
    if not where:
        return draw
    rows = values(draw.lane, draw.step, tuple(name for name, _, _ in where))
    keep = np.ones(len(draw.lane), bool)
    for name, low, high in where:
        if low is not None:
            keep &= rows[name] >= low
        if high is not None:
            keep &= rows[name] <= high
    return draw if keep.all() else _taken(draw, np.flatnonzero(keep))


def _taken(draw: Draw, rows: int | np.ndarray) -> Draw:
    """The first ``rows`` rows of ``draw`` (an int), or those at the indices ``rows``."""
    pick: Any = slice(0, rows) if isinstance(rows, int) else rows
    weight = None if draw.weight is None else draw.weight[pick]
    return Draw(draw.lane[pick], draw.step[pick], weight, {k: v[pick] for k, v in draw.extra.items()})


def _next_block(request: TokenRequest, rows: int, tokens: int, matched: int, drawn: int) -> int:
    """Rows to draw next: enough, by the mean length and the share of matching rows seen so
    far, to fill the rest of the budget (a quarter more), within ``max_rows`` and ``max_draws``."""
    if matched == 0:
        wanted = 2 * drawn
    else:
        mean = max(tokens / max(rows, 1), 1.0)
        left = min((request.max_tokens - tokens) / mean, request.max_rows - rows)
        wanted = math.ceil(1.25 * left * drawn / matched) + 1
    return max(1, min(wanted, request.max_draws - drawn))


def _shown(where: tuple[Bound, ...]) -> str:
    return "{" + ", ".join(f"{name!r}: ({low}, {high})" for name, low, high in where) + "}"
