"""The built-in sampler types by the name their saved state carries: rebuild and load a saved sampler."""

from __future__ import annotations

from typing import Any

from .prioritized import Prioritized
from .protocols import BaseSampler
from .uniform import Uniform
from .without_replacement import WithoutReplacement

SAMPLER_TYPES: dict[str, type[BaseSampler]] = {
    "Uniform": Uniform, "Prioritized": Prioritized, "WithoutReplacement": WithoutReplacement}


def load_sampler_state(sampler: BaseSampler, state: dict[str, Any]) -> bool:
    """Load a saved sampler state into ``sampler``, unless it was saved by another of the built-in
    sampler types (a reader may sample with another sampler than the writer's). Returns whether
    it was loaded."""
    saved = state.get("type")
    if saved == sampler.type_name or saved not in SAMPLER_TYPES:
        sampler.load_state_dict(state)
        return True
    return False


def sampler_from_state(state: dict[str, Any] | None) -> BaseSampler:
    """Rebuild the sampler a buffer was saved with (its type and settings; state loaded later)."""
    if not state:
        return Uniform()
    kind = SAMPLER_TYPES.get(state.get("type", ""))
    if kind is None:
        raise ValueError(f"the buffer was saved with sampler {state.get('type')!r}; pass sampler= to open")
    return kind.from_state_dict(state)
