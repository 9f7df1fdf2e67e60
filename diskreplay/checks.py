"""Checks of arguments that every layer takes alike."""

from __future__ import annotations

from typing import Any

import numpy as np


def check_int(value: Any, name: str, least: int, most: int | None = None) -> int:
    """``value`` as an int. Raises ValueError naming ``name`` unless it is an int (a numpy
    integer too, a bool not) >= ``least`` and, if given, <= ``most``."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < least
            or (most is not None and value > most)):
        wanted = f"an int >= {least}" if most is None else f"an int in [{least}, {most}]"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")
    return int(value)
