"""`BufferConfig`: what a buffer is, as recorded in its group's ``zarr.json``
(``attributes.diskreplay``), validated on read.

The config never changes after create. Every value read from a store is checked here before use
(`BufferConfig.from_group`): numbers are bounded, names must be fields of the right kind, so a
damaged or crafted document is a `CorruptBufferError` naming the field, never a wrong read or an
allocation sized by the file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import CorruptBufferError, NotABufferError, SchemaError
from .codecs import COMPRESSIONS, LEVELS
from .keys import CHUNK_KEY_SEPARATOR, FORMAT, FORMATS, GROUP_KEY
from .lanes import LaneLayout
from .schema import Field, Schema

MAX_LANES = 1 << 16
MAX_STEPS = 1 << 46
"""Bounds on lanes and on the steps a lane may ever count: a row id ``step * num_envs + lane``
stays below 2**62."""
MAX_CHUNK_ROWS = 1 << 24
MAX_CHUNKS = 1 << 26
"""Chunks a buffer may have over all lanes: the chunk table (8 bytes per chunk) stays below 512 MiB."""


@dataclass(frozen=True)
class BufferConfig:
    """A buffer's fixed settings.

    ``schema``: the stored fields (derived ``next_*`` twins are not stored). ``lane_capacity``:
    steps a lane's ring keeps (None: a dataset that grows). ``chunk_rows``: steps per chunk.
    ``compression`` and ``level``: the chunks' codec. ``chunk_key_separator``: ``"."`` (new
    buffers) or ``"/"`` (zarr's default, older buffers). ``row_access``: compressed fields with
    big rows are stored as shards read row by row; ``row_shards`` (`ReplayBuffer.create`'s
    option): those of small rows too, where a chunk holds four inner chunks or more
    (`inner_rows_for`). ``episode_end``: the bool fields whose OR ends an episode.
    ``derive_next``: fields whose ``next_`` twin is read from the next step.
    ``episodic_return``: the settings of a stored return-to-go field (`EpisodicReturn.to_json`).
    ``format``: one of `FORMATS` (where diskreplay's own objects live, `objects_prefix`).
    """

    schema: Schema
    num_envs: int
    lane_capacity: int | None
    chunk_rows: int
    compression: str | None
    level: int
    chunk_key_separator: str = CHUNK_KEY_SEPARATOR
    row_access: bool = True
    row_shards: bool = False
    episode_end: tuple[str, ...] = ()
    derive_next: tuple[str, ...] = ()
    episodic_return: Mapping[str, Any] | None = field(default=None, hash=False)
    format: str = FORMAT
    fields: Schema | None = field(default=None, hash=False)
    """The fields as declared, ragged ones included, when some are ragged (``schema`` then holds
    the fixed arrays that store them: `Schema.storage`); None: ``schema``."""

    @property
    def user_schema(self) -> Schema:
        """The fields as declared (ragged and text fields included)."""
        return self.fields if self.fields is not None else self.schema

    @property
    def layout(self) -> LaneLayout:
        """Lanes, ring capacity and chunk length: the index arithmetic of this buffer."""
        return LaneLayout(self.num_envs, self.lane_capacity, self.chunk_rows)

    def to_json(self) -> dict[str, Any]:
        """The ``attributes.diskreplay`` object of the group's ``zarr.json``."""
        return {"format": self.format, "fields": self.user_schema.to_json(), "num_envs": self.num_envs,
                "lane_capacity": self.lane_capacity, "chunk_rows": self.chunk_rows,
                "compression": self.compression, "level": self.level,
                "chunk_key_separator": self.chunk_key_separator, "row_access": self.row_access,
                "row_shards": self.row_shards,
                "episode_end": list(self.episode_end), "derive_next": list(self.derive_next),
                "episodic_return": dict(self.episodic_return) if self.episodic_return else None}

    @classmethod
    def from_group(cls, group: Mapping[str, Any], url: str) -> BufferConfig:
        """The config in a group's ``zarr.json`` document, every value checked.

        Raises NotABufferError (not a diskreplay group) or CorruptBufferError naming the field.
        """
        if group.get("zarr_format") != 3 or group.get("node_type") != "group":
            raise NotABufferError(f"{url!r} is not a diskreplay buffer ({GROUP_KEY} is not a Zarr v3 group)")
        attrs = group.get("attributes")
        config = attrs.get("diskreplay") if isinstance(attrs, dict) else None
        version = config.get("format") if isinstance(config, dict) else None
        if isinstance(version, str) and version.startswith("diskreplay/") and version not in FORMATS:
            raise NotABufferError(f"{url!r}: a buffer of format {version!r:.40}, this diskreplay reads {list(FORMATS)} "
                                  f"(upgrade diskreplay)")
        if not isinstance(config, dict) or version not in FORMATS:
            raise NotABufferError(f"{url!r} is a zarr group but not a diskreplay buffer (no {' or '.join(FORMATS)} "
                                  f"attributes)")
        return replace(_parse(_ConfigCheck(config, url)), format=version)


def _parse(check: _ConfigCheck) -> BufferConfig:
    try:
        declared = Schema.from_json(check.get("fields", dict))
    except (SchemaError, KeyError, TypeError, ValueError) as exc:
        raise check.bad("fields", f"a valid field table ({exc})") from None
    schema = declared.storage()
    num_envs = check.integer("num_envs", 1, MAX_LANES)
    lane_capacity = check.optional_integer("lane_capacity", 1, MAX_STEPS)
    chunk_rows = check.integer("chunk_rows", 1, min(MAX_CHUNK_ROWS, lane_capacity or MAX_CHUNK_ROWS))
    if lane_capacity and num_envs * -(-lane_capacity // chunk_rows) > MAX_CHUNKS:
        raise check.bad("lane_capacity", f"at most {MAX_CHUNKS} chunks of chunk_rows={chunk_rows} over "
                                         f"{num_envs} lanes")
    separator = check.choice("chunk_key_separator", ("/", "."), default="/")
    compression = check.choice("compression", COMPRESSIONS)
    level = check.integer("level", *LEVELS[compression], f" for {compression}" if compression else "")
    row_access = check.choice("row_access", (False, True), default=False)
    row_shards = check.choice("row_shards", (False, True), default=False)
    episode_end = check.names("episode_end", schema, lambda f: f.shape == () and f.dtype == np.bool_)
    derive_next = check.names("derive_next", schema, lambda f: True)
    episodic_return = _episodic_return_spec(check, schema)
    if (derive_next or episodic_return) and not episode_end:
        raise check.bad("episode_end", "end fields when derive_next or episodic_return is set")
    return BufferConfig(schema, num_envs, lane_capacity, chunk_rows, compression, level, separator, row_access,
                        row_shards, episode_end, derive_next, episodic_return,
                        fields=declared if declared.ragged else None)


class _ConfigCheck:
    """Typed reads of the config's values; every failure names the field."""

    def __init__(self, config: dict[str, Any], url: str):
        self.config, self.url = config, url

    def bad(self, key: str, expected: str) -> CorruptBufferError:
        return CorruptBufferError(f"{self.url!r}: {GROUP_KEY} field diskreplay.{key}: expected {expected}, "
                                  f"got {self.config.get(key, '<missing>')!r:.200}")

    def get(self, key: str, kind: type) -> Any:
        value = self.config.get(key)
        if not isinstance(value, kind):
            raise self.bad(key, kind.__name__)
        return value

    def integer(self, key: str, lo: int, hi: int, expected_too: str = "") -> int:
        value = self.config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.bad(key, f"an int in [{lo}, {hi}]{expected_too}")
        return value

    def optional_integer(self, key: str, lo: int, hi: int) -> int | None:
        return None if self.config.get(key) is None else self.integer(key, lo, hi, " or null")

    def choice(self, key: str, options: tuple[Any, ...], default: Any = ...) -> Any:
        value = self.config.get(key, default)
        if value not in options:
            raise self.bad(key, f"one of {list(options)}")
        return value

    def names(self, key: str, schema: Schema, ok: Callable[[Field], bool]) -> tuple[str, ...]:
        value = self.config.get(key) or []
        if (not isinstance(value, list) or not all(isinstance(n, str) and n in schema.fields and ok(schema[n])
                                                   for n in value) or len(set(value)) != len(value)):
            raise self.bad(key, "a list of distinct names of suitable fields")
        return tuple(value)


def _episodic_return_spec(check: _ConfigCheck, schema: Schema) -> dict[str, Any] | None:
    spec = check.config.get("episodic_return")
    if spec is None:
        return None
    expected = "null or {gamma in [0, 1], scalar reward field, float32 return field, finite default_return, clip}"
    try:
        gamma, default, clip = float(spec["gamma"]), float(spec["default_return"]), spec["clip"]
        ok = (0.0 <= gamma <= 1.0 and math.isfinite(default)
              and schema[spec["reward"]].shape == () and schema[spec["name"]] == Field((), "float32")
              and (clip is None or (isinstance(clip, list) and len(clip) == 2
                                    and all(isinstance(c, (int, float)) and math.isfinite(c) for c in clip))))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise check.bad("episodic_return", expected)
    return dict(spec)
