"""The root of a sharded buffer, and the learner's progress document beside its shards.

A sharded buffer is a Zarr v3 group whose attribute ``diskreplay_shards`` says how many shards it
holds. Shard ``i`` is a complete buffer in the child group ``shard-<i:05d>``: its own commits,
writer lock, lanes, episode index and state. Every shard has the same schema, capacity and
chunking. The root group is written last at create, so an interrupted create never opens.

``learner.json`` holds a learner's sample count and the inserts it had seen, for actors that
keep to a rate limit (`LearnerProgress`).

The commit index (roots that declare ``"commit_index": true``): after each commit, a shard's
writer puts an empty object ``commits/<shard:05d>-<sequence:012d>`` beside ``learner.json`` and
deletes its previous one, so one listing of ``commits/`` tells a learner every shard's newest
sequence (`index_sequences`). Each shard's writer writes only its own names: no two writers
ever update one object.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import zarr
import zarr.storage

from ..errors import CorruptBufferError
from .config import MAX_STEPS
from .keys import FORMAT, FORMAT_1, FORMATS, GROUP_KEY, json_object, objects_prefix
from .layout import add_own_nodes

SHARDS_ATTRIBUTE = "diskreplay_shards"
MAX_SHARDS = 4096
LEARNER_KEY = "learner.json"
COMMIT_INDEX_DIR = "commits"
"""Where, beside ``learner.json``, the shards' writers announce their commits (see the module)."""
_INDEX_NAME = re.compile(r"(\d{5})-(\d{12})")


def shard_name(shard: int) -> str:
    """The child group of shard ``shard``."""
    return f"shard-{shard:05d}"


def shard_url(url: str, shard: int) -> str:
    """Where shard ``shard`` of the sharded buffer at ``url`` lives."""
    return f"{url.rstrip('/')}/{shard_name(shard)}"


def check_shards(shards: Any, commit: bool = True) -> int:
    """``shards`` as an int in [1, `MAX_SHARDS`]; else ValueError naming it (also with
    ``commit=False``: every shard is committed at create)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be None or an int in [1, {MAX_SHARDS}], got {shards!r}")
    if not commit:
        raise ValueError("shards= with commit=False: every shard of a sharded buffer is committed at create")
    return shards


@dataclass(frozen=True)
class ShardedRoot:
    """What a sharded buffer's root declares: its shard count, and the format its own objects
    (``learner.json``) follow (`FORMATS`; roots from before the format was declared: `FORMAT_1`)."""

    count: int
    format: str = FORMAT
    index: bool = False
    """Whether the shards' writers keep the commit index (roots made before it: False)."""

    @property
    def learner_key(self) -> str:
        """Where a learner's progress (`LEARNER_KEY`) is kept, in the root's store."""
        return objects_prefix(self.format) + LEARNER_KEY

    @property
    def index_prefix(self) -> str:
        """Where the commit index (`COMMIT_INDEX_DIR`) is, in the root's store."""
        return objects_prefix(self.format) + COMMIT_INDEX_DIR + "/"


def index_name(shard: int, sequence: int) -> str:
    """The commit index's name for commit ``sequence`` of shard ``shard`` (in `COMMIT_INDEX_DIR`)."""
    return f"{shard:05d}-{sequence:012d}"


def index_sequences(names: Iterable[str], count: int) -> dict[int, int]:
    """``{shard: newest sequence}`` from the names listed in a commit index of ``count`` shards.
    Other names (a local store's temp files, a shard number out of range) are not the index's."""
    newest: dict[int, int] = {}
    for name in names:
        found = _INDEX_NAME.fullmatch(name)
        if found is not None and int(found.group(1)) < count:
            shard, sequence = int(found.group(1)), int(found.group(2))
            newest[shard] = max(sequence, newest.get(shard, -1))
    return newest


def root_documents(count: int) -> dict[str, bytes]:
    """``{key: bytes}``: the root group's ``zarr.json`` of a buffer of ``count`` shards, and the
    nodes around its own objects."""
    documents: dict[str, Any] = {}
    group = zarr.open_group(store=zarr.storage.MemoryStore(store_dict=documents), mode="w")
    group.attrs.update({SHARDS_ATTRIBUTE: {"count": count, "format": FORMAT, "commit_index": True}})
    add_own_nodes(group)
    return {key: value.to_bytes() for key, value in documents.items()}


def read_root(blob: bytes | None, url: str) -> ShardedRoot | None:
    """What a root ``zarr.json`` declares (None: not a sharded buffer's root).

    Raises CorruptBufferError naming the field when the declaration is damaged."""
    if blob is None:
        return None
    attributes = json_object(blob, GROUP_KEY, url).get("attributes")
    declared = attributes.get(SHARDS_ATTRIBUTE) if isinstance(attributes, dict) else None
    if declared is None:
        return None
    count = declared.get("count") if isinstance(declared, dict) else None
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_SHARDS:
        raise CorruptBufferError(f"{url!r}: {GROUP_KEY} field 'attributes.{SHARDS_ATTRIBUTE}.count': expected an "
                                 f"int in [1, {MAX_SHARDS}], got {count!r}")
    version = declared.get("format", FORMAT_1)
    if version not in FORMATS:
        raise CorruptBufferError(f"{url!r}: {GROUP_KEY} field 'attributes.{SHARDS_ATTRIBUTE}.format': expected one "
                                 f"of {list(FORMATS)}, got {version!r:.40}")
    index = declared.get("commit_index", False)
    if not isinstance(index, bool):
        raise CorruptBufferError(f"{url!r}: {GROUP_KEY} field 'attributes.{SHARDS_ATTRIBUTE}.commit_index': expected "
                                 f"true or false, got {index!r:.40}")
    return ShardedRoot(count, version, index)


@dataclass(frozen=True)
class LearnerProgress:
    """What a learner published: rows it sampled, per shard the rows it had seen inserted, and
    the type of its sampler (None in files written before it was recorded)."""

    samples: int
    inserts: tuple[int, ...]
    time: float
    sampler: str | None = None

    def to_bytes(self) -> bytes:
        data = {"samples": self.samples, "inserts": list(self.inserts), "time": self.time}
        return json.dumps(data if self.sampler is None else {**data, "sampler": self.sampler}).encode()

    @classmethod
    def from_bytes(cls, blob: bytes, url: str, shards: int) -> LearnerProgress:
        """Parse and validate ``learner.json`` of a buffer of ``shards`` shards. Raises
        CorruptBufferError naming the field."""
        data = json_object(blob, LEARNER_KEY, url)
        samples, inserts, when = data.get("samples"), data.get("inserts"), data.get("time")
        if not _count(samples):
            raise CorruptBufferError(f"{url!r}: {LEARNER_KEY} field 'samples': expected an int >= 0, got {samples!r}")
        if not isinstance(inserts, list) or len(inserts) != shards or not all(map(_count, inserts)):
            raise CorruptBufferError(f"{url!r}: {LEARNER_KEY} field 'inserts': expected {shards} ints >= 0, "
                                     f"got {str(inserts)[:80]}")
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not math.isfinite(when):
            raise CorruptBufferError(f"{url!r}: {LEARNER_KEY} field 'time': expected a number, got {when!r}")
        sampler = data.get("sampler")
        if sampler is not None and not (isinstance(sampler, str) and sampler.isidentifier() and len(sampler) <= 64):
            raise CorruptBufferError(f"{url!r}: {LEARNER_KEY} field 'sampler': expected a class name, "
                                     f"got {sampler!r:.80}")
        return cls(samples, tuple(inserts), float(when), sampler)  # type: ignore[arg-type]  # checked by _count


def _count(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value <= MAX_STEPS * MAX_SHARDS
