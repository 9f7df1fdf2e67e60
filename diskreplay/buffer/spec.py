"""`BufferSpec`: what `ReplayBuffer.create` makes, as one frozen value that round-trips through a
dict, JSON and YAML (``diskreplay create --config spec.yaml URL``).

The spec is a read-only mapping of `create`'s keyword arguments, so that
``dr.ReplayBuffer.create(url, **spec)`` makes the buffer it describes (open options such as
``cache_bytes`` or ``overwrite`` go beside it: ``create(url, **spec, overwrite=True)``). Its data
form (`to_dict`) spells fields as ``{"obs": {"shape": [17], "dtype": "float32"}}``.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from ..episodes import EpisodicReturn
from ..errors import SchemaError
from ..format.codecs import COMPRESSIONS, default_level
from ..format.schema import Field
from ..format.shards import check_shards
from .setup import plan_buffer

if TYPE_CHECKING:
    from .replay_buffer import ReplayBuffer

KEYS = ("fields", "capacity", "num_envs", "chunk_rows", "compression", "compression_level", "episode_end",
        "derive_next", "episodic_return", "shards", "row_shards")
"""The keys of a spec, in order: `ReplayBuffer.create`'s arguments that describe the buffer."""
FIELD_KEYS = ("shape", "dtype", "length_of", "codec", "quality")
RETURN_KEYS = ("gamma", "reward", "name", "default_return", "clip")
CHECK_URL = "memory://diskreplay-buffer-spec"  # planning a buffer touches no store: the URL is only a name
CHECK_CACHE_BYTES = 1 << 62  # the spec has no cache budget: `create`'s cache_bytes is an open option


@dataclass(frozen=True, eq=False)
class BufferSpec(Mapping[str, Any]):
    """The settings of a buffer that `ReplayBuffer.create` takes, checked when made.

    ``fields``: name -> `Field` (per-step shape and dtype). ``capacity``: rows kept over all lanes
    (of each shard; None: a dataset that grows). ``num_envs``: env lanes. ``chunk_rows``: steps per
    chunk (None: about 1 MiB chunks). ``compression``: ``"zstd"``, ``"lz4"``, ``"lz4hc"`` or None,
    at ``compression_level`` (None: the codec's default, resolved when made). ``episode_end``:
    ``"auto"``, end field names (one name becomes a 1-tuple), or None. ``derive_next``: fields
    whose ``next_`` twin is read from the next step. ``episodic_return``: an `EpisodicReturn` or
    None. ``shards``: writers of a sharded buffer (None: not sharded). ``row_shards``: compressed
    fields of small rows stored as shards of inner chunks. See `ReplayBuffer.create` for each.

    As a mapping its keys are `KEYS` and its values what `create` takes, so
    ``ReplayBuffer.create(url, **spec)`` works. Two specs are equal when their `to_dict` are.

    Raises ValueError naming the key (SchemaError, a ValueError, for bad fields) for any value
    `create` would refuse, cross-checks included (``capacity`` a multiple of ``num_envs``,
    ``episode_end`` and ``derive_next`` naming suitable fields, ...).
    """

    fields: Mapping[str, Field]
    capacity: int | None = None
    num_envs: int = 1
    chunk_rows: int | None = None
    compression: str | None = "zstd"
    compression_level: int | None = None
    episode_end: str | tuple[str, ...] | None = "auto"
    derive_next: tuple[str, ...] = ()
    episodic_return: EpisodicReturn | None = dataclass_field(default=None, repr=False)
    shards: int | None = None
    row_shards: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "fields", MappingProxyType(_check_fields(self.fields)))
        set_(self, "capacity", _optional_int("capacity", self.capacity, 1))
        set_(self, "num_envs", _int("num_envs", self.num_envs, 1))
        set_(self, "chunk_rows", _optional_int("chunk_rows", self.chunk_rows, 1))
        set_(self, "compression", _compression(self.compression))
        set_(self, "compression_level", default_level(self.compression) if self.compression_level is None
             else _int("compression_level", self.compression_level, 0))
        set_(self, "episode_end", _episode_end(self.episode_end))
        set_(self, "derive_next", _names("derive_next", self.derive_next))
        if self.episodic_return is not None and not isinstance(self.episodic_return, EpisodicReturn):
            raise ValueError(f"episodic_return: expected a dr.EpisodicReturn or None, "
                             f"got {type(self.episodic_return).__name__}")
        if self.shards is not None:
            check_shards(self.shards)
        if not isinstance(self.row_shards, bool):
            raise ValueError(f"row_shards: expected True or False, got {self.row_shards!r:.40}")
        plan_buffer(CHECK_URL, self.fields, self.capacity, self.num_envs, self.chunk_rows, self.compression,
                    self.compression_level, CHECK_CACHE_BYTES, self.episode_end, self.derive_next,
                    self.episodic_return, self.row_shards)

    # ---- the mapping of create's keyword arguments ------------------------------------------

    def __getitem__(self, key: str) -> Any:
        """The value of one of `KEYS` (``spec["capacity"]``). Raises KeyError for another key."""
        if key not in KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        """`KEYS`, in order: what ``**spec`` passes to `ReplayBuffer.create`."""
        return iter(KEYS)

    def __len__(self) -> int:
        """How many settings a spec holds: len(`KEYS`)."""
        return len(KEYS)

    def create_kwargs(self) -> dict[str, Any]:
        """``{key: value}`` for ``ReplayBuffer.create(url, **kwargs)`` (the same as ``dict(spec)``)."""
        return {key: getattr(self, key) for key in KEYS}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BufferSpec) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.to_json())

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its `to_dict` (actor processes get the spec; the fields' proxy cannot be pickled)."""
        return (type(self).from_dict, (self.to_dict(),))

    @classmethod
    def from_buffer(cls, buf: ReplayBuffer) -> BufferSpec:
        """The spec of an open buffer, as its config records it: ``chunk_rows`` and
        ``episode_end`` as resolved at create (not None / ``"auto"``), fields without the
        episodic return field. A sharded union gives its per-shard ``capacity`` and ``num_envs``
        and ``shards`` (a union of one shard reads as not sharded: ``shards`` None)."""
        config = buf.storage.config
        shards = buf.shards
        ret = EpisodicReturn.from_json(dict(config.episodic_return)) if config.episodic_return else None
        fields = {name: f for name, f in buf.fields.items() if ret is None or name != ret.name}
        num_envs = buf.num_envs // shards
        capacity = None if buf.capacity is None else buf.capacity // shards
        return cls(fields, capacity, num_envs, config.chunk_rows, config.compression, config.level,
                   config.episode_end or None, config.derive_next, ret, shards if shards > 1 else None,
                   config.row_shards)

    # ---- data forms -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """This spec as JSON-ready data, every key present: fields as ``{name: {"shape": [...],
        "dtype": "float32"}}``, tuples as lists, ``episodic_return`` as its settings."""
        end = self.episode_end
        return {
            "fields": {name: _field_data(f) for name, f in self.fields.items()},
            "capacity": self.capacity, "num_envs": self.num_envs, "chunk_rows": self.chunk_rows,
            "compression": self.compression, "compression_level": self.compression_level,
            "episode_end": list(end) if isinstance(end, tuple) else end,
            "derive_next": list(self.derive_next),
            "episodic_return": self.episodic_return.to_json() if self.episodic_return else None,
            "shards": self.shards, "row_shards": self.row_shards,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BufferSpec:
        """The spec `to_dict` gave (missing keys take `create`'s defaults; ``compression: none``
        is None). Raises ValueError naming the key for an unknown key or a bad value."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a buffer spec must be a mapping of {list(KEYS)}, got {type(data).__name__}")
        _refuse_unknown("buffer spec", data, KEYS)
        if "fields" not in data:
            raise ValueError("fields: missing (a mapping of name to {shape, dtype})")
        values = {key: data[key] for key in KEYS if key in data}
        values["fields"] = _fields_from_data(data["fields"])
        for key in ("derive_next", "episode_end"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        if values.get("compression") == "none":
            values["compression"] = None
        if values.get("episodic_return") is not None:
            values["episodic_return"] = _return_from_data(values["episodic_return"])
        return cls(**values)

    def to_json(self, indent: int | None = 2) -> str:
        """`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> BufferSpec:
        """The spec in JSON ``text``. Raises ValueError for text that is not JSON, or as `from_dict`."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"a buffer spec: not valid JSON ({exc})") from None
        return cls.from_dict(data)

    def to_yaml(self) -> str:
        """`to_dict` as YAML text. Raises ImportError when pyyaml is not installed."""
        return str(_yaml().safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None))

    @classmethod
    def from_yaml(cls, text: str | bytes) -> BufferSpec:
        """The spec in YAML ``text`` (safe loading only). Raises ImportError when pyyaml is not
        installed, ValueError for text that is not YAML, or as `from_dict`."""
        yaml = _yaml()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"a buffer spec: not valid YAML ({' '.join(str(exc).split())})") from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> BufferSpec:
        """The spec in a ``.json``, ``.yaml`` or ``.yml`` file. Raises ValueError for another
        suffix, OSError when it cannot be read, or as `from_json` / `from_yaml`."""
        suffix = os.path.splitext(os.fspath(path))[1].lower()
        if suffix not in (".json", ".yaml", ".yml"):
            raise ValueError(f"{os.fspath(path)!r}: a buffer spec file must end in .json, .yaml or .yml")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        try:
            return cls.from_json(text) if suffix == ".json" else cls.from_yaml(text)
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)!r}: {exc}") from None

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write this spec to a ``.json``, ``.yaml`` or ``.yml`` file (as its suffix says)."""
        suffix = os.path.splitext(os.fspath(path))[1].lower()
        if suffix not in (".json", ".yaml", ".yml"):
            raise ValueError(f"{os.fspath(path)!r}: a buffer spec file must end in .json, .yaml or .yml")
        text = self.to_json() + "\n" if suffix == ".json" else self.to_yaml()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


def _yaml() -> Any:
    try:
        import yaml  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise ImportError("YAML buffer specs need the 'pyyaml' package: pip install pyyaml "
                          "(or use a .json spec)") from None
    return yaml


def _refuse_unknown(what: str, data: Mapping[str, Any], known: tuple[str, ...]) -> None:
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{what}: unknown key {key!r}{hint}; known keys: {list(known)}")


def _check_fields(fields: Any) -> dict[str, Field]:
    if not isinstance(fields, Mapping) or not fields:
        raise ValueError(f"fields: expected a non-empty mapping of name to dr.Field, got {fields!r:.200}")
    for name, f in fields.items():
        if not isinstance(f, Field):
            raise ValueError(f"fields.{name}: expected a dr.Field, got {type(f).__name__}")
    return dict(fields)


def _field_data(f: Field) -> dict[str, Any]:
    """One field as `to_dict` spells it (a ragged one: shape ``[null, ...]``, maybe ``length_of``;
    text: dtype ``"str"``; an encoded one: its ``codec`` and maybe ``quality``)."""
    return {**f.to_json(), "dtype": "str" if f.text else f.dtype.name}  # a spec names dtypes: "float32"


def _fields_from_data(data: Any) -> dict[str, Field]:
    """``{name: {"shape": [...], "dtype": "..."}}`` as Fields (``shape`` may be left out: a scalar)."""
    if not isinstance(data, Mapping) or not data:
        raise ValueError(f"fields: expected a non-empty mapping of name to {{shape, dtype}}, got {data!r:.200}")
    out = {}
    for name, spec in data.items():
        if not isinstance(spec, Mapping):
            raise ValueError(f"fields.{name}: expected a mapping with 'shape' and 'dtype', got {spec!r:.200}")
        _refuse_unknown(f"fields.{name}", spec, FIELD_KEYS)
        shape = spec.get("shape", [])
        if not isinstance(shape, (list, tuple)) or not all(_is_int(s) and s >= 0 or (s is None and i == 0)
                                                            for i, s in enumerate(shape)):
            raise ValueError(f"fields.{name}.shape: expected a list of non-negative ints (the first may be null: "
                             f"a ragged field), got {shape!r:.200}")
        if not isinstance(spec.get("dtype"), str):
            raise ValueError(f"fields.{name}.dtype: expected a dtype name such as 'float32', "
                             f"got {spec.get('dtype', '<missing>')!r:.200}")
        try:
            dtype = "str" if spec["dtype"] == "str" else np.dtype(spec["dtype"])
        except TypeError:
            raise ValueError(f"fields.{name}.dtype: unknown dtype {spec['dtype']!r:.200}") from None
        try:
            out[str(name)] = Field(tuple(shape), dtype, length_of=spec.get("length_of"), codec=spec.get("codec"),
                                   quality=spec.get("quality"))
        except SchemaError as exc:
            raise ValueError(f"fields.{name}: {exc}") from None
    return out


def _return_from_data(data: Any) -> EpisodicReturn:
    if not isinstance(data, Mapping):
        raise ValueError(f"episodic_return: expected a mapping of {list(RETURN_KEYS)} or null, got {data!r:.200}")
    _refuse_unknown("episodic_return", data, RETURN_KEYS)
    gamma, default = data.get("gamma", 0.99), data.get("default_return", 0.0)
    for key, value in (("gamma", gamma), ("default_return", default)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"episodic_return.{key}: expected a number, got {value!r:.200}")
    for key in ("reward", "name"):
        if not isinstance(data.get(key, ""), str):
            raise ValueError(f"episodic_return.{key}: expected a field name, got {data[key]!r:.200}")
    clip = data.get("clip")
    if clip is not None and (not isinstance(clip, (list, tuple)) or len(clip) != 2
                             or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in clip)):
        raise ValueError(f"episodic_return.clip: expected [low, high] or null, got {clip!r:.200}")
    try:
        return EpisodicReturn(gamma, data.get("reward", "reward"), data.get("name", "return"), default,
                              (float(clip[0]), float(clip[1])) if clip is not None else None)
    except ValueError as exc:
        raise ValueError(f"episodic_return: {exc}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _int(key: str, value: Any, lo: int) -> int:
    if not _is_int(value) or value < lo:
        raise ValueError(f"{key}: expected an int >= {lo}, got {value!r:.200}")
    return int(value)


def _optional_int(key: str, value: Any, lo: int) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < lo:
        raise ValueError(f"{key}: expected an int >= {lo} or null, got {value!r:.200}")
    return int(value)


def _compression(value: Any) -> str | None:
    if value not in COMPRESSIONS:
        raise ValueError(f"compression: expected one of {list(COMPRESSIONS)}, got {value!r:.200}")
    return value  # type: ignore[no-any-return]


def _names(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{key}: expected a list of field names, got {value!r:.200}")
    return tuple(value)


def _episode_end(value: Any) -> str | tuple[str, ...] | None:
    if value is None or value == "auto":
        return value  # type: ignore[no-any-return]
    if isinstance(value, str):
        return (value,)
    return _names("episode_end", value)
