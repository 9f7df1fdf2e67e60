"""Samplers: which rows a minibatch takes. A buffer is composed with one; none subclasses it.

A sampler sees the lane layout, the lane windows (``lo``, ``hi``: readable steps per lane) and
notifications of appended steps; it returns (lane, step) pairs. Its state is plain data
(`state_dict`), saved with the buffer at every commit and restored on open, so a resumed run
draws exactly what an uninterrupted one would have.

Modules: `protocols` (`Sampler`, `PrioritySampler`, `Draw`, and `BaseSampler`: the built-in
samplers' base class, with the optional methods and their defaults, which `with_defaults` gives
any other sampler), `uniform`, `prioritized`, `without_replacement`, `slices` (trajectory slices
over any sampler), `segment_tree`, `state` (checks of saved state) and `registry` (the built-in
types by saved name).
"""

from .prioritized import Prioritized
from .protocols import BaseSampler, Draw, PrioritySampler, Sampler, with_defaults
from .registry import SAMPLER_TYPES, load_sampler_state, sampler_from_state
from .segment_tree import MinSegmentTree, SumSegmentTree
from .slices import EpisodeBounds, SliceSampler
from .state import check_sampler_state
from .uniform import Uniform, ere_recent_rows, ere_schedule
from .without_replacement import WithoutReplacement

__all__ = ["SAMPLER_TYPES", "BaseSampler", "Draw", "EpisodeBounds", "MinSegmentTree", "Prioritized", "PrioritySampler",
           "Sampler", "SliceSampler", "SumSegmentTree", "Uniform", "WithoutReplacement", "check_sampler_state",
           "ere_recent_rows", "ere_schedule", "load_sampler_state", "sampler_from_state", "with_defaults"]
