"""Trajectory slices: ``seq_len`` consecutive steps of one lane inside one episode, their starts
drawn with a buffer's sampler. What the slices need to know of episodes comes through
`EpisodeBounds`, which the buffer passes in."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..checks import check_int
from ..errors import EmptyBufferError
from ..format.lanes import flat_to_lane_step
from .draws import integers
from .protocols import Draw, Sampler, WithinSampler
from .uniform import Uniform

REDRAWS = 256
"""How many times a sampler other than plain `Uniform` draws again the starts whose slice would
cross an episode end, before giving up."""


class EpisodeBounds(Protocol):
    """Where episodes end, lane by lane (steps count every step ever added to a lane)."""

    def next_end(self, lane: np.ndarray, step: np.ndarray) -> np.ndarray:
        """Per row, the first episode end step >= ``step`` in its lane (int64 ``[n]``); for an
        episode not ended yet, any value >= every readable step."""

    def window_starts(self, lo: np.ndarray, hi: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lane, first, count)`` (int64 ``[k]``): per episode with room for ``seq_len``
        consecutive steps inside itself and the readable steps ``[lo, hi)``, the steps
        ``first .. first + count - 1`` that may start such a slice."""


class SliceSampler:
    """Starts and steps of trajectory slices, drawn with ``base``.

    Without ``pad``, only slices wholly inside one episode are drawn: with a plain `Uniform`
    (no options, no recent share), uniformly over all such windows; with any other sampler,
    starts whose slice would cross an episode end are drawn again, and those that keep missing
    are drawn among the starts that fit (see `_redraw`). With ``pad``, any readable
    step may start a slice, and the steps past its episode end repeat the episode's last step.
    """

    def __init__(self, base: Sampler, episodes: EpisodeBounds, seq_len: int, pad: bool = False) -> None:
        """Raises ValueError unless ``seq_len`` is a positive int."""
        check_int(seq_len, "seq_len", 1)
        self.base = base
        self.episodes = episodes
        self.seq_len = seq_len
        self.pad = pad

    def sample(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray,
               **options: Any) -> Draw:
        """``batch_size`` slice starts among the readable steps ``[lo, hi)``; ``options`` go to
        the base sampler (a slice's weight is its start row's).

        Raises EmptyBufferError (without ``pad``) when no episode holds ``seq_len`` readable
        steps, or when the base sampler kept drawing starts too close to an episode end.
        """
        if isinstance(self.base, Uniform) and not options and not self.base.recent_ratio:
            if self.pad:
                return self.base.sample(rng, batch_size, lo, hi)
            return self._uniform_windows(rng, batch_size, lo, hi)
        draw = self.base.sample(rng, batch_size, lo, hi, **options)
        for attempt in range(REDRAWS):
            end = self.last_steps(draw, hi)
            bad = np.zeros(batch_size, bool) if self.pad else draw.step + self.seq_len - 1 > end
            if not bad.any():
                return draw
            again = self._redraw(rng, int(bad.sum()), lo, hi, options, attempt >= REDRAWS // 2, draw.weight is None)
            draw.lane[bad], draw.step[bad] = again.lane, again.step
            if draw.weight is not None:
                draw.weight[bad] = again.weight
        raise EmptyBufferError(f"could not draw slices of {self.seq_len} steps inside one episode; "
                               f"use pad=True or a shorter seq_len")

    def _redraw(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray,
                options: dict[str, Any], late: bool, unweighted: bool) -> Draw:
        """Starts for the draws whose slice would cross an episode end: the base sampler's again;
        ``late`` (they kept missing: the starts that fit hold little of the base sampler's
        mass, or none of a recent share's rows), among the starts that fit only, by the base
        sampler's priorities where it draws within ranges (`WithinSampler`), else uniformly
        (unless the base sampler weights its draws)."""
        if late and isinstance(self.base, WithinSampler):
            lane, first, count = self.episodes.window_starts(lo, hi, self.seq_len)
            some = count > 0
            if some.any():
                return self.base.sample_within(rng, batch_size, lane[some], first[some], first[some] + count[some],
                                               lo, hi, **options)
        if late and unweighted:
            return self._uniform_windows(rng, batch_size, lo, hi)
        return self.base.sample(rng, batch_size, lo, hi, **options)

    def _uniform_windows(self, rng: np.random.Generator, batch_size: int, lo: np.ndarray, hi: np.ndarray) -> Draw:
        """Starts drawn uniformly over every window of ``seq_len`` steps inside one episode."""
        lane, first, count = self.episodes.window_starts(lo, hi, self.seq_len)
        if count.sum() == 0:
            raise EmptyBufferError(f"no episode holds {self.seq_len} consecutive readable steps; "
                                   f"use pad=True or a shorter seq_len")
        segment, step = flat_to_lane_step(integers(rng, 0, int(count.sum()), batch_size), first, first + count)
        return Draw(lane[segment], step)

    def last_steps(self, draw: Draw, hi: np.ndarray) -> np.ndarray:
        """Per start, the last readable step of its episode (int64 ``[batch_size]``)."""
        last: np.ndarray = np.minimum(self.episodes.next_end(draw.lane, draw.step), hi[draw.lane] - 1)
        return last

    def steps(self, draw: Draw, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The steps of each slice, ``[batch_size, seq_len]`` int64 (clipped to the episode's last
        readable step), and the mask, ``[batch_size, seq_len]`` bool, False on clipped steps."""
        steps = draw.step[:, None] + np.arange(self.seq_len)
        last = self.last_steps(draw, hi)
        mask = steps <= last[:, None]
        return np.minimum(steps, last[:, None]), mask
