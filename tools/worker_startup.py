"""Where a DataLoader worker's start-up goes: from ``iter(loader)`` to its first batch, in phases.

`StartupProbe` wraps (in this process, before the workers fork, so the workers inherit the
wrappers) torch's worker loop, the dataset's ``__iter__``, the reader's open, its first read (an
epoch's gather, a sample-mode draw) and what it waits for before reading (`Warmer.before_read`), each writing a
time stamp (``time.perf_counter``: one monotonic clock for every process of this machine) to a
file. `phases` reads them back for the worker whose batch comes first (worker 0):

- fork: ``iter()`` until the worker process runs (the DataLoader's queues, the fork itself);
- torch set-up: until the dataset's ``__iter__`` (torch's worker loop: seeds, ``worker_init_fn``,
  the fetcher; a `Loader`'s persistent worker: its pass);
- to open: until the worker opens the store (waiting for its first index, the generator starting);
- open: ``ReplayBuffer.open`` in the worker;
- to read: until its first gather (the epoch's row order, announcing the read-ahead);
- first read: that gather (a `Loader`'s: a whole block), the cache fill included (also alone: fill);
- hand-over: from the end of that gather until the main process holds the first batch.

Used by ``tools/bench_loader.py`` (``--startup``, and the epochs section).
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.utils.data._utils.worker as torch_worker
from torch.utils.data import get_worker_info

from diskreplay.storage import warm as warm_module
from diskreplay.torch import datasets as datasets_module
from diskreplay.torch import reader as reader_module

PHASES = ("fork", "torch set-up", "to open", "open", "to read", "first read", "hand-over")
"""Phase names, in order (their sum: the first batch's time), then the fill inside the first read."""


class StartupProbe:
    """Time stamps of the start-up of DataLoader workers forked while the probe is installed."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="diskreplay-startup-", suffix=".log")
        os.close(fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def stamp(self, what: str) -> None:
        """Record ``what`` now, for this process."""
        os.write(self._fd, f"{os.getpid()} {time.perf_counter():.7f} {what}\n".encode())

    def clear(self) -> None:
        """Forget the stamps so far."""
        os.truncate(self.path, 0)

    def stamps(self) -> list[tuple[int, float, str]]:
        with open(self.path) as f:
            return [(int(pid), float(t), what) for pid, t, what in (line.split() for line in f)]

    def close(self) -> None:
        os.close(self._fd)
        os.unlink(self.path)


@contextmanager
def installed() -> Iterator[StartupProbe]:
    """A `StartupProbe` with its wrappers in place (removed on exit)."""
    probe = StartupProbe()
    targets: list[tuple[Any, str, str, bool]] = [
        (torch_worker, "_worker_loop", "loop", False), (datasets_module._BufferDataset, "__iter__", "iter", False),
        (reader_module.Reader, "_open", "open", False), (datasets_module._BufferDataset, "_gather", "gather", True),
        (datasets_module, "_read", "gather", False),
        (warm_module.Warmer, "before_read", "fill", False)]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _, _ in targets]
    try:
        for owner, name, label, static in targets:
            wrapped = _stamped(probe, getattr(owner, name), label)
            setattr(owner, name, staticmethod(wrapped) if static else wrapped)
        yield probe
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        probe.close()


def _stamped(probe: StartupProbe, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        info = get_worker_info()
        if label == "iter" and info is not None:
            probe.stamp(f"worker{info.id}")
        probe.stamp(label + "<")
        try:
            return fn(*args, **kwargs)
        finally:
            probe.stamp(label + ">")
    return wrapper


def first_batch(probe: StartupProbe, loader: Any) -> tuple[Any, dict[str, float]]:
    """``iter(loader)`` and its first batch, and the phases of the worker it came from (seconds;
    ``"fill"``: the part of the first read spent filling the cache; ``"total"``: iter to batch;
    ``"rest"``: the total less the open and the first read).
    Returns the iterator (still running) and the phases."""
    probe.clear()
    probe.stamp("start")
    it = iter(loader)
    next(it)
    probe.stamp("first")
    return it, phases(probe.stamps())


def phases(stamps: list[tuple[int, float, str]]) -> dict[str, float]:
    """The phases of worker 0 (whose batch torch hands over first) from stamps; NaN for a
    phase it had not reached when the main process got the first batch."""
    main = {what: t for pid, t, what in stamps if what in ("start", "first")}
    worker = next((pid for pid, _, what in stamps if what == "worker0"), None)

    def at(what: str) -> float:
        return next((t for pid, t, w in stamps if pid == worker and w == what and t <= main["first"]), math.nan)

    fills = [t for pid, t, what in stamps if pid == worker and what.startswith("fill")]
    marks = [main["start"], at("loop<"), at("iter<"), at("open<"), at("open>"), at("gather<"), at("gather>"),
             main["first"]]
    out = {name: b - a for name, a, b in zip(PHASES, marks, marks[1:])}
    out["fill"] = fills[1] - fills[0] if len(fills) >= 2 else 0.0
    out["total"] = main["first"] - main["start"]
    out["rest"] = out["total"] - out["open"] - out["first read"]  # what start-up costs besides those
    return out


def median_phases(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over runs."""
    return {k: statistics.median(r[k] for r in runs) if all(not math.isnan(r[k]) for r in runs) else math.nan
            for k in runs[0]}
