"""The progress bar of imports, exports and verify: tqdm on stderr when installed and wanted, else nothing."""

from __future__ import annotations

import sys
from typing import Any


class NoBar:
    """A progress bar that shows nothing (tqdm missing, or progress turned off)."""

    def update(self, n: int) -> None:
        """Ignores ``n`` rows done."""

    def __enter__(self) -> NoBar:
        """The bar itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Nothing to close (exceptions propagate)."""


def progress_bar(total: int | None, desc: str, enabled: bool, unit: str = "rows") -> Any:
    """A context manager with ``update(n)``: a tqdm bar counting ``total`` (None: unknown) ``unit``
    (rows; rows/s shown) on stderr when ``enabled`` and tqdm is installed, else a `NoBar`."""
    if not enabled:
        return NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return NoBar()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit.strip() == "rows", file=sys.stderr,
                dynamic_ncols=True)
