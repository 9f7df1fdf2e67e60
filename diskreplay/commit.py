"""The commit record (``commit.json``): which steps of each lane are visible, and the state object
that belongs to them.

It is replaced atomically (temp + fsync + rename locally, one PUT on object stores) after the
chunks it makes visible are written. Everything in it is validated before use: cursors are
non-negative ints with ``lower <= committed``, a dataset-mode commit covers no more steps than the
arrays hold (`Commit.check_covered`), ``extra`` is an object, and the state object it names follows the buffer's own
naming rule (`state_key`), so a crafted record can neither point a reader at another file nor make
a writer delete one.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import CorruptBufferError
from .zarr_layout import MAX_STEPS, STATE_DIR, json_object

COMMIT_KEY = "commit.json"
STATE_KEY = re.compile(rf"{STATE_DIR}/(\d{{12}})(-[0-9a-f]{{16}})?\.safetensors")


def state_key(sequence: int) -> str:
    """A new, never reused name for the state object of commit ``sequence``."""
    return f"{STATE_DIR}/{sequence:012d}-{secrets.token_hex(8)}.safetensors"


def is_state_key(key: Any) -> bool:
    return isinstance(key, str) and STATE_KEY.fullmatch(key) is not None


@dataclass
class Commit:
    """The durable cursor record: per lane, steps ``[max(lower, committed - capacity), committed)``
    are visible. ``extra`` holds the JSON part of the saved state and its array object's key."""

    sequence: int
    committed: np.ndarray
    lower: np.ndarray
    time: float
    extra: dict[str, Any]

    @property
    def state_arrays(self) -> str | None:
        return self.extra.get("state_arrays")

    def to_bytes(self) -> bytes:
        return json.dumps({
            "sequence": self.sequence, "time": self.time,
            "committed": self.committed.tolist(), "lower": self.lower.tolist(), "extra": self.extra,
        }).encode()

    def same_as(self, other: "Commit") -> bool:
        return self.sequence == other.sequence and self.time == other.time

    def check_covered(self, url: str, lane_rows: int) -> None:
        """Dataset mode: raise CorruptBufferError if a lane commits more steps than the arrays hold
        (the arrays' sizes are checked against `MAX_CHUNKS` with the rest of their metadata)."""
        if int(self.committed.max(initial=0)) > lane_rows:
            raise CorruptBufferError(f"{url!r}: {COMMIT_KEY} field 'committed': {int(self.committed.max())} steps "
                                     f"in a lane, but the arrays hold {lane_rows}")

    @classmethod
    def from_bytes(cls, blob: bytes, url: str, num_envs: int) -> "Commit":
        """Parse and validate a record. Raises CorruptBufferError naming the field."""
        where = f"{url!r}: {COMMIT_KEY}"
        data = json_object(blob, COMMIT_KEY, url)
        committed = _cursors(data, "committed", where, num_envs)
        lower = _cursors(data, "lower", where, num_envs)
        if (lower > committed).any():
            raise CorruptBufferError(f"{where} field 'lower': expected lower <= committed per lane, got "
                                     f"lower {lower.tolist()} and committed {committed.tolist()}")
        sequence, stamp, extra = data.get("sequence"), data.get("time"), data.get("extra")
        if isinstance(sequence, bool) or not isinstance(sequence, int) or not 0 <= sequence < 2**62:
            raise CorruptBufferError(f"{where} field 'sequence': expected an int >= 0, got {sequence!r:.100}")
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
            raise CorruptBufferError(f"{where} field 'time': expected a finite number, got {stamp!r:.100}")
        if not isinstance(extra, dict):
            raise CorruptBufferError(f"{where} field 'extra': expected an object, got {extra!r:.100}")
        if "state" in extra and not isinstance(extra["state"], dict):
            raise CorruptBufferError(f"{where} field 'extra.state': expected an object, got {extra['state']!r:.100}")
        key = extra.get("state_arrays")
        if key is not None and not (is_state_key(key) and int(STATE_KEY.fullmatch(key).group(1)) <= sequence):
            raise CorruptBufferError(f"{where} field 'extra.state_arrays': expected a key like "
                                     f"'{STATE_DIR}/<sequence>-<token>.safetensors', got {key!r:.100}")
        return cls(sequence, committed, lower, float(stamp), extra)


def _cursors(data: dict, name: str, where: str, num_envs: int) -> np.ndarray:
    values = data.get(name)
    if (not isinstance(values, list) or len(values) != num_envs
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_STEPS for v in values)):
        raise CorruptBufferError(f"{where} field {name!r}: expected {num_envs} ints in [0, {MAX_STEPS}] "
                                 f"(one per lane), got {values!r:.200}")
    return np.asarray(values, dtype=np.int64)
