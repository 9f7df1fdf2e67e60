"""Pins: commits a writer keeps readable while the buffer goes on (`ReplayBuffer.pin`).

A pin of commit ``n`` is a copy, made by the writer under its lock, of everything commit ``n``
names, under ``pins/<n:012d>/`` among the buffer's own objects and keyed as the buffer keys them
(a buffer of format ``diskreplay/1``'s layout): ``commit.json`` (the record of commit ``n``),
``state/...`` (its state object and journal objects) and ``<field>/c.<lane>.<chunk>...`` (every
chunk that holds a visible row of commit ``n``, its bytes as stored). The index ``pins.json``
lists the pins: ``{"pins": [{"commit", "name", "time", "status"}]}``, where ``status`` is
``"kept"`` (complete: readable), ``"copying"`` (a pin being made) or ``"removing"`` (an unpin
under way). A pin is written in the commit protocol's order: its entry as ``"copying"``, then
the record copy, the state and the chunks, then its entry as ``"kept"``; an unpin marks it
``"removing"`` before deleting anything. Only ``"kept"`` pins are read.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..errors import CorruptBufferError
from .commit import CommitRecord
from .journal import JOURNAL_MARK, JournalRef
from .keys import json_object

PINS_KEY = "pins.json"
PIN_DIR = "pins"
KEPT, COPYING, REMOVING = "kept", "copying", "removing"
MAX_NAME = 255


def pin_prefix(commit: int) -> str:
    """Where the copy of commit ``commit`` lies, relative to the buffer's own objects."""
    return f"{PIN_DIR}/{commit:012d}/"


@dataclass(frozen=True)
class Pin:
    """One entry of ``pins.json``."""

    commit: int
    name: str | None
    time: float
    status: str = KEPT

    def label(self) -> str:
        return str(self.commit) if self.name is None else f"{self.commit} ({self.name!r})"


@dataclass(frozen=True)
class PinIndex:
    """``pins.json``: every pin, by commit."""

    pins: tuple[Pin, ...] = ()

    def kept(self) -> list[Pin]:
        return [pin for pin in self.pins if pin.status == KEPT]

    def unfinished(self) -> list[Pin]:
        """Pins whose making or removal was interrupted: their copies are to be deleted."""
        return [pin for pin in self.pins if pin.status != KEPT]

    def describe_unfinished(self) -> list[str]:
        """A sentence for each pin an interrupted writer left unfinished."""
        return [f"{PINS_KEY}: pin {pin.label()} is {pin.status!r}, left by an interrupted writer (not readable; "
                f"the writer's next pin or unpin deletes its copies)" for pin in self.unfinished()]

    def find(self, at: int | str) -> Pin | None:
        """The pin of commit ``at`` (an int) or named ``at`` (a str), in any status."""
        for pin in self.pins:
            if (pin.name == at) if isinstance(at, str) else (pin.commit == at):
                return pin
        return None

    def with_pin(self, pin: Pin) -> PinIndex:
        return PinIndex(tuple(p for p in self.pins if p.commit != pin.commit) + (pin,))

    def without(self, commit: int) -> PinIndex:
        return PinIndex(tuple(p for p in self.pins if p.commit != commit))

    def marked(self, commit: int, status: str) -> PinIndex:
        return PinIndex(tuple(replace(p, status=status) if p.commit == commit else p for p in self.pins))

    def to_bytes(self) -> bytes:
        return json.dumps({"pins": [{"commit": p.commit, "name": p.name, "time": p.time, "status": p.status}
                                    for p in self.pins]}).encode()

    @classmethod
    def from_bytes(cls, blob: bytes | None, url: str) -> PinIndex:
        """Parse and validate ``pins.json`` (None: no pins). Raises CorruptBufferError naming the field."""
        if blob is None:
            return cls()
        entries = json_object(blob, PINS_KEY, url).get("pins")
        if not isinstance(entries, list):
            raise CorruptBufferError(f"{url!r}: {PINS_KEY} field 'pins': expected a list, got {entries!r:.100}")
        pins = tuple(_pin(entry, f"{url!r}: {PINS_KEY} field 'pins'") for entry in entries)
        for what, values in (("commit", [p.commit for p in pins]), ("name", [p.name for p in pins if p.name])):
            if len(set(values)) != len(values):
                raise CorruptBufferError(f"{url!r}: {PINS_KEY} field 'pins': expected each {what} once, got {values}")
        return cls(pins)


def _pin(entry: Any, where: str) -> Pin:
    if not isinstance(entry, dict):
        raise CorruptBufferError(f"{where}: expected objects, got {entry!r:.100}")
    commit, name, stamp, status = (entry.get(k) for k in ("commit", "name", "time", "status"))
    if isinstance(commit, bool) or not isinstance(commit, int) or not 0 <= commit < 2**62:
        raise CorruptBufferError(f"{where}: 'commit': expected an int >= 0, got {commit!r:.100}")
    if name is not None and not (isinstance(name, str) and 0 < len(name) <= MAX_NAME):
        raise CorruptBufferError(f"{where}: 'name': expected null or a string of 1 to {MAX_NAME} "
                                 f"characters, got {name!r:.100}")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
        raise CorruptBufferError(f"{where}: 'time': expected a finite number, got {stamp!r:.100}")
    if status not in (KEPT, COPYING, REMOVING):
        raise CorruptBufferError(f"{where}: 'status': expected one of {[KEPT, COPYING, REMOVING]}, "
                                 f"got {status!r:.100}")
    return Pin(commit, name, float(stamp), status)


def state_keys(record: CommitRecord) -> list[str]:
    """Every state object commit ``record`` names: its state arrays, then its journals' objects
    (keys relative to the buffer's own objects). Raises ValueError for a bad journal reference."""
    keys = [record.state_arrays] if record.state_arrays else []
    for path, value in _journal_marks(record.state or {}, ""):
        keys += JournalRef.from_json(path, value, record.sequence).keys()
    return keys


def _journal_marks(meta: Any, path: str) -> Iterator[tuple[str, Any]]:
    """``(path, reference)`` of each journal in a state's JSON part (paths as `state.join` names them)."""
    if isinstance(meta, dict):
        if set(meta) == {JOURNAL_MARK}:
            yield path, meta[JOURNAL_MARK]
            return
        for key, value in meta.items():
            yield from _journal_marks(value, f"{path}.{key}" if path else str(key))
    elif isinstance(meta, list):
        for i, value in enumerate(meta):
            yield from _journal_marks(value, f"{path}.{i}")
