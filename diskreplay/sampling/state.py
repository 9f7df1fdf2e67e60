"""Checks of a sampler's saved state before it is loaded (shared by the sampler types)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.lanes import LaneLayout
from .protocols import BaseSampler


def is_int(value: Any) -> bool:
    """True for a Python or numpy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_sampler_state(sampler: BaseSampler, state: Any, layout: LaneLayout, total: np.ndarray) -> None:
    """Raise ValueError (naming the field) unless ``state`` can be loaded into ``sampler``. A
    saved state of another sampler type is no error: it is not loaded (see `load_sampler_state`)."""
    if not isinstance(state, dict):
        raise ValueError(f"'sampler': expected a mapping, got {type(state).__name__}")
    if state.get("type") == sampler.type_name:
        try:
            sampler.check_state(state, layout, np.asarray(total))
        except KeyError as exc:
            raise ValueError(f"'sampler': {exc} is missing") from None
