"""Journals: parts of the saved state that grow with the buffer (priorities, the episode index),
persisted by what changed, not by what exists.

A journal holds one *generation*: a base array, then records appended commit after commit. A part
of the state decides what both mean (priorities: the leaves, then ``(leaf, value)`` writes;
episodes: the live end steps, then new ones). Every object is written once under a name never
reused, so a reader of an older commit, or a process reopening after a crash, finds exactly the
objects its commit names:

- ``state/<path>/<generation>/base.<i>``: elements ``[i * BASE_CHUNK, ...)`` of the base;
- ``state/<path>/<generation>/log.<i>``: records ``[i * LOG_CHUNK, (i + 1) * LOG_CHUNK)``;
- ``state/<path>/<generation>/tail-<sequence>-<token>``: the records past the last full log chunk,
  rewritten (under a new name) by each commit that appends.

``<path>`` is where the part sits in the state (``sampler.leaves``). All are raw little-endian
bytes, each followed by the CRC32C of those bytes (4 bytes, little-endian, as zarr's ``crc32c``
codec stores it): a writer checksums only the objects it writes, a reader checks every object
before using it. Generations written before checksums (no ``checksum`` in their reference) have
none; they are read as they are, and appended to so, until their part writes a new generation.
The commit record names a generation, the element and record counts and the tail (`JournalRef`):
a few hundred bytes at any size.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from .codecs import CHECKSUM_BYTES
from .keys import STATE_DIR

JOURNAL_MARK = "__journal__"
BASE_CHUNK = 1 << 20
"""Base elements per object (4 MiB of float32 leaves)."""
LOG_CHUNK = 4096
"""Records per log object: a commit rewrites at most this many records of its tail."""
MAX_ELEMENTS = 1 << 40
CHECKSUM = "crc32c"
"""The ``checksum`` of a reference whose objects end with their CRC32C."""
_PATH = re.compile(r"[a-z_]{1,32}(\.[a-z_]{1,32}){0,3}")
_NAME = re.compile(r"(\d{12})-[0-9a-f]{16}")
_DTYPES = {"<f4", "<f8", "<i8", "<u4", "<i4"}


_KEY = re.compile(rf"{STATE_DIR}/{_PATH.pattern}/{_NAME.pattern}/(base\.\d+|log\.\d+|tail-{_NAME.pattern})")


def is_journal_key(key: str) -> bool:
    """Whether ``key`` is named like a journal's object (garbage collection deletes no other)."""
    return _KEY.fullmatch(key) is not None


def new_name(sequence: int) -> str:
    """A never reused name for a generation or tail first written by commit ``sequence``."""
    return f"{sequence:012d}-{secrets.token_hex(8)}"


@dataclass(frozen=True)
class JournalChange:
    """What a part of the state hands a commit: ``records`` to append, or, with ``base``, a new
    generation (``base`` followed by ``records``)."""

    records: np.ndarray
    base: np.ndarray | None = None


@dataclass(frozen=True)
class JournalContent:
    """A journal as a commit left it: its base and the records appended since, in order."""

    base: np.ndarray
    records: np.ndarray


@dataclass(frozen=True)
class JournalRef:
    """Which objects hold a journal at one commit."""

    path: str
    generation: str
    base_dtype: np.dtype
    record_dtype: np.dtype
    base: int
    records: int
    tail: str | None
    checksummed: bool = True
    """Whether each object ends with the CRC32C of its bytes (a generation written before
    checksums has none)."""

    def trailer(self) -> int:
        """Bytes each object has after its elements: its checksum, or none."""
        return CHECKSUM_BYTES if self.checksummed else 0

    def prefix(self) -> str:
        return f"{STATE_DIR}/{self.path}/{self.generation}"

    def base_keys(self) -> list[str]:
        return [f"{self.prefix()}/base.{i}" for i in range(-(-self.base // BASE_CHUNK))]

    def log_key(self, chunk: int) -> str:
        return f"{self.prefix()}/log.{chunk}"

    def tail_key(self) -> str | None:
        return None if self.tail is None else f"{self.prefix()}/tail-{self.tail}"

    def keys(self) -> list[str]:
        """Every object of this journal at this commit."""
        tail = self.tail_key()
        return (self.base_keys() + [self.log_key(i) for i in range(self.records // LOG_CHUNK)]
                + ([tail] if tail else []))

    def names(self, key: str) -> bool:
        """Whether ``key`` is one of `keys` (without listing them)."""
        prefix = self.prefix() + "/"
        if not key.startswith(prefix):
            return False
        name = key[len(prefix):]
        if name.startswith("tail-"):
            return key == self.tail_key()
        kind, _, number = name.partition(".")
        count = {"base": -(-self.base // BASE_CHUNK), "log": self.records // LOG_CHUNK}.get(kind, 0)
        return number.isdigit() and int(number) < count and name == f"{kind}.{int(number)}"

    def to_json(self) -> dict[str, Any]:
        checksum = {"checksum": CHECKSUM} if self.checksummed else {}
        return {JOURNAL_MARK: {"generation": self.generation, "base": self.base, "records": self.records,
                               "tail": self.tail, "base_dtype": self.base_dtype.str,
                               "record_dtype": [[n, self.record_dtype[n].str] for n in self.record_dtype.names or ()],
                               **checksum}}

    @classmethod
    def from_json(cls, path: str, value: Any, sequence: int) -> JournalRef:
        """A reference read from the record of commit ``sequence``, checked. Raises ValueError
        naming the field."""
        if not _PATH.fullmatch(path):
            raise ValueError(f"journal at {path!r:.80}: not a state path of lowercase names")
        where = f"'{path}.{JOURNAL_MARK}'"
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {type(value).__name__}")
        generation, tail = value.get("generation"), value.get("tail")
        for name, text in (("generation", generation), ("tail", tail)):
            match = _NAME.fullmatch(text) if isinstance(text, str) else None
            if not (match and int(match.group(1)) <= sequence) and not (name == "tail" and text is None):
                raise ValueError(f"{where} field {name!r}: expected '<sequence>-<16 hex digits>' of a "
                                 f"commit up to {sequence}, got {text!r:.80}")
        base, records = value.get("base", -1), value.get("records", -1)
        if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_ELEMENTS for n in (base, records)):
            raise ValueError(f"{where} fields 'base', 'records': expected ints in [0, {MAX_ELEMENTS}], "
                             f"got {[base, records]}")
        if (tail is None) != (records % LOG_CHUNK == 0):
            raise ValueError(f"{where} field 'tail': expected a tail exactly when 'records' "
                             f"({records}) is not a multiple of {LOG_CHUNK}, got {tail!r}")
        if value.get("checksum", CHECKSUM) != CHECKSUM:
            raise ValueError(f"{where} field 'checksum': expected {CHECKSUM!r} (or none, in journals written "
                             f"before checksums), got {value['checksum']!r:.80}")
        return cls(path, str(generation), _dtype(value.get("base_dtype"), where), _record_dtype(value, where),
                   int(base), int(records), tail, "checksum" in value)


def _dtype(text: Any, where: str) -> np.dtype:
    if text not in _DTYPES:
        raise ValueError(f"{where} field 'base_dtype': expected one of {sorted(_DTYPES)}, got {text!r:.80}")
    return np.dtype(str(text))


def _record_dtype(value: dict[str, Any], where: str) -> np.dtype:
    fields = value.get("record_dtype")
    if (not isinstance(fields, list) or not 1 <= len(fields) <= 4
            or not all(isinstance(f, list) and len(f) == 2 and isinstance(f[0], str) and _PATH.fullmatch(f[0])
                       and f[1] in _DTYPES for f in fields) or len({f[0] for f in fields}) != len(fields)):
        raise ValueError(f"{where} field 'record_dtype': expected 1 to 4 [name, dtype] pairs with dtypes in "
                         f"{sorted(_DTYPES)}, got {fields!r:.120}")
    return np.dtype([(name, text) for name, text in fields])
