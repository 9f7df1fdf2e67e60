"""The commit record (``commit.json``): which steps of each lane are visible, and the state object
that belongs to them.

It is replaced atomically (temp + fsync + rename locally, one PUT on object stores) after the
chunks it makes visible are written. Everything in it is validated before use: cursors are
non-negative ints with ``lower <= committed``, a dataset-mode commit covers no more steps than the
arrays hold (`CommitRecord.check_covered`), the state is an object, and the state object it names
follows the buffer's own naming rule (`state_key`), so a crafted record can neither point a reader
at another file nor make a writer delete one.

On disk: ``{"sequence", "time", "committed": [per lane], "lower": [per lane], "extra": {"state":
<JSON part of the buffer's state>, "state_arrays": <key of its arrays> or null,
"state_arrays_crc32c": <the CRC32C of that object's bytes>}}``; ``extra`` is ``{}`` before the
first state is saved. Records written before checksums lack ``state_arrays_crc32c``: their state
object is read unchecked (the next commit writes a new one, with its checksum).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import CorruptBufferError
from .codecs import checksum
from .config import MAX_STEPS
from .keys import COMMIT_KEY, STATE_DIR, json_object

CHECKSUM_FIELD = "state_arrays_crc32c"
"""The field of ``extra`` that holds the state object's CRC32C."""
CAPACITY_FIELD = "lane_capacity"
"""The field of ``extra`` that holds a ring's steps per lane after a change of capacity."""
STATE_KEY = re.compile(rf"{STATE_DIR}/(\d{{12}})(-[0-9a-f]{{16}})?\.safetensors")


def state_key(sequence: int) -> str:
    """A new, never reused name for the state object of commit ``sequence``."""
    return f"{STATE_DIR}/{sequence:012d}-{secrets.token_hex(8)}.safetensors"


def is_state_key(key: Any) -> bool:
    """Whether ``key`` follows the naming rule of state objects (`state_key`)."""
    return isinstance(key, str) and STATE_KEY.fullmatch(key) is not None


def _frozen(values: Any) -> np.ndarray:
    array = np.array(values, dtype=np.int64)
    array.flags.writeable = False
    return array


@dataclass(frozen=True)
class CommitRecord:
    """The durable cursor record: per lane, steps ``[max(lower, committed - capacity), committed)``
    are visible. ``state`` is the JSON part of the buffer's saved state (None: none saved yet) and
    ``state_arrays`` the key of the state object holding its arrays. Cursor arrays are read-only."""

    sequence: int
    committed: np.ndarray
    lower: np.ndarray
    time: float
    state: dict[str, Any] | None = field(default=None, compare=False)
    state_arrays: str | None = None
    state_checksum: int | None = None
    """The CRC32C of the state object's bytes (None: a record written before checksums)."""
    lane_capacity: int | None = None
    """A ring's steps per lane since its capacity was changed (``open(url, "r+", capacity=n)``;
    None: as created). Every later record carries it: a reader opened before the change refuses it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "committed", _frozen(self.committed))
        object.__setattr__(self, "lower", _frozen(self.lower))

    @classmethod
    def empty(cls, num_envs: int, time: float) -> CommitRecord:
        """The record of a new buffer: nothing committed, no state."""
        return cls(0, np.zeros(num_envs, np.int64), np.zeros(num_envs, np.int64), time)

    def next(self, committed: np.ndarray, lower: np.ndarray, time: float, **state: Any) -> CommitRecord:
        """The record that follows this one (``state=``, ``state_arrays=``: new state, else kept)."""
        return replace(self, sequence=self.sequence + 1, committed=committed, lower=lower, time=time, **state)

    def to_bytes(self) -> bytes:
        extra: dict[str, Any] = {} if self.state is None else {"state": self.state, "state_arrays": self.state_arrays}
        if self.state is not None and self.state_checksum is not None:
            extra[CHECKSUM_FIELD] = self.state_checksum
        if self.lane_capacity is not None:
            extra[CAPACITY_FIELD] = self.lane_capacity
        return json.dumps({
            "sequence": self.sequence, "time": self.time,
            "committed": self.committed.tolist(), "lower": self.lower.tolist(), "extra": extra,
        }).encode()

    def check_state_object(self, blob: bytes, url: str) -> None:
        """Raise CorruptBufferError naming the state object if ``blob``, its bytes, do not match
        the checksum this record holds (a record without one accepts any)."""
        if self.state_checksum is None:
            return
        found = int.from_bytes(checksum(blob), "little")
        if found != self.state_checksum:
            raise CorruptBufferError(f"{url!r}: state object {self.state_arrays!r} is damaged: checksum mismatch "
                                     f"({COMMIT_KEY} records {self.state_checksum:08x}, the object has {found:08x})")

    def same_as(self, other: CommitRecord) -> bool:
        return self.sequence == other.sequence and self.time == other.time

    def check_covered(self, url: str, lane_rows: int) -> None:
        """Dataset mode: raise CorruptBufferError if a lane commits more steps than the arrays hold
        (the arrays' sizes are checked against `MAX_CHUNKS` with the rest of their metadata)."""
        if int(self.committed.max(initial=0)) > lane_rows:
            raise CorruptBufferError(f"{url!r}: {COMMIT_KEY} field 'committed': {int(self.committed.max())} steps "
                                     f"in a lane, but the arrays hold {lane_rows}")

    @classmethod
    def from_bytes(cls, blob: bytes, url: str, num_envs: int, key: str = COMMIT_KEY) -> CommitRecord:
        """Parse and validate a record stored at ``key``. Raises CorruptBufferError naming the field."""
        where = f"{url!r}: {key}"
        data = json_object(blob, key, url)
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
        arrays = extra.get("state_arrays")
        match = STATE_KEY.fullmatch(arrays) if isinstance(arrays, str) else None
        if arrays is not None and not (match and int(match.group(1)) <= sequence):
            raise CorruptBufferError(f"{where} field 'extra.state_arrays': expected a key like "
                                     f"'{STATE_DIR}/<sequence>-<token>.safetensors', got {arrays!r:.100}")
        crc = extra.get(CHECKSUM_FIELD)
        if CHECKSUM_FIELD in extra and (arrays is None or isinstance(crc, bool) or not isinstance(crc, int)
                                        or not 0 <= crc < 2**32):
            raise CorruptBufferError(f"{where} field 'extra.{CHECKSUM_FIELD}': expected an int in [0, 2**32) "
                                     f"beside a state object, got {crc!r:.100}")
        capacity = extra.get(CAPACITY_FIELD)
        if CAPACITY_FIELD in extra and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                        or not 1 <= capacity < 2**62):
            raise CorruptBufferError(f"{where} field 'extra.{CAPACITY_FIELD}': expected an int >= 1, "
                                     f"got {capacity!r:.100}")
        return cls(sequence, committed, lower, float(stamp), extra.get("state"), arrays, crc, capacity)


def _cursors(data: dict[str, Any], name: str, where: str, num_envs: int) -> np.ndarray:
    values = data.get(name)
    if (not isinstance(values, list) or len(values) != num_envs
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_STEPS for v in values)):
        raise CorruptBufferError(f"{where} field {name!r}: expected {num_envs} ints in [0, {MAX_STEPS}] "
                                 f"(one per lane), got {values!r:.200}")
    return np.asarray(values, dtype=np.int64)
