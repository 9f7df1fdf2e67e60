"""The fields of a `Mixture`: each source's fields under the mixture's names (``fields=``), the
ones kept (``select=``), checked to agree in shape and dtype before anything is drawn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import SchemaError
from ..format.schema import Field

SOURCE = "source"
"""The batch column that says which source each row came from (its position in the mixture)."""


@dataclass(frozen=True)
class SourceFields:
    """How one source's batches become the mixture's: keys renamed (source name -> mixture
    name) and keys dropped (fields the mixture does not keep)."""

    renamed: Mapping[str, str]
    dropped: frozenset[str]
    to_source: Mapping[str, str]
    """Mixture name -> the source's name, for every field it renames (``stack_fields``, ``out``)."""

    def source_name(self, name: str) -> str:
        """The source's name of the mixture's field ``name``."""
        return self.to_source.get(name, name)

    def rows(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A batch of this source under the mixture's names, without the dropped fields."""
        return {self.renamed.get(k, k): v for k, v in batch.items() if k not in self.dropped}


def mixture_fields(sources: Mapping[str, Mapping[str, Field]], mapping: Mapping[str, Mapping[str, str]] | None,
                   select: Sequence[str] | None) -> tuple[dict[str, Field], dict[str, SourceFields]]:
    """The mixture's fields (name -> `Field`) and how each source's batches become them.

    ``sources``: each source's fields, in the mixture's order. ``mapping``: per source, mixture
    name -> the source's field name. ``select``: the mixture's fields (default: every field of
    the first source, under the mixture's names, which every other source must have exactly).

    Raises:
        ValueError: ``mapping`` names a source the mixture does not have.
        SchemaError: a mapping to a field the source lacks, two names mapped to one field; a
            kept field a source lacks (naming the source and the field), a field only some
            sources have (without ``select``), fields whose shape or dtype differ, a field
            named ``"source"``.
    """
    mapping = dict(mapping or {})
    unknown = sorted(set(mapping) - set(sources))
    if unknown:
        raise ValueError(f"fields: unknown source(s) {unknown}; the mixture's sources are {list(sources)}")
    exposed = {name: _exposed(name, fields, mapping.get(name, {})) for name, fields in sources.items()}
    first = next(iter(exposed))
    kept = list(exposed[first]) if select is None else _selected(select)
    if SOURCE in kept:
        raise SchemaError(f"a field named {SOURCE!r} collides with the mixture's source column: rename it with "
                          f"fields={{source_name: {{'other_name': {SOURCE!r}}}}} or leave it out with select=")
    out = {name: exposed[first][name] for name in kept if name in exposed[first]}
    for name, fields in exposed.items():
        for field in kept:
            _check_field(name, field, fields, out, first)
        if select is None:
            extra = sorted(set(fields) - set(kept))
            if extra:
                raise SchemaError(f"source {name!r} has field(s) {extra} that source {first!r} lacks: map them "
                                  f"with fields= or keep a common set with select=")
        out.update({field: fields[field] for field in kept if field not in out})
    return {name: out[name] for name in kept}, {name: _source_fields(sources[name], mapping.get(name, {}), kept)
                                                for name in sources}


def _exposed(name: str, fields: Mapping[str, Field], renames: Mapping[str, str]) -> dict[str, Field]:
    """A source's fields under the mixture's names. Raises SchemaError for a rename to a field
    it lacks or two names for one field."""
    if not isinstance(renames, Mapping):
        raise SchemaError(f"fields[{name!r}]: expected a mapping of the mixture's field names to source "
                          f"{name!r}'s, got {type(renames).__name__}")
    for ours, theirs in renames.items():
        if theirs not in fields:
            raise SchemaError(f"fields[{name!r}]: maps {ours!r} to {theirs!r}, which is not a field of source "
                              f"{name!r} (its fields: {sorted(fields)})")
    taken = sorted(t for t in set(renames.values()) if list(renames.values()).count(t) > 1)
    if taken:
        raise SchemaError(f"fields[{name!r}]: several names map to the field(s) {taken} of source {name!r}")
    back = {theirs: ours for ours, theirs in renames.items()}
    exposed = {back.get(field, field): spec for field, spec in fields.items() if field not in back}
    exposed.update({ours: fields[theirs] for ours, theirs in renames.items()})
    return exposed


def _selected(select: Sequence[str]) -> list[str]:
    if isinstance(select, str) or not all(isinstance(name, str) for name in select) or not select:
        raise ValueError(f"select must be a non-empty sequence of field names, got {select!r}")
    return list(dict.fromkeys(select))


def _check_field(name: str, field: str, fields: Mapping[str, Field], known: Mapping[str, Field], first: str) -> None:
    """Raise SchemaError unless source ``name`` has ``field`` as the sources before it have it."""
    if field not in fields:
        raise SchemaError(f"source {name!r} has no field {field!r} (its fields: {sorted(fields)}); map one to it "
                          f"with fields={{{name!r}: {{{field!r}: 'its_name'}}}} or leave it out with select=")
    expected = known.get(field)
    got = fields[field]
    if expected is not None and (tuple(expected.shape), np.dtype(expected.dtype)) != (tuple(got.shape),
                                                                                         np.dtype(got.dtype)):
        raise SchemaError(f"field {field!r}: source {name!r} stores shape {tuple(got.shape)} {np.dtype(got.dtype)}, "
                          f"an earlier source (e.g. {first!r}) shape {tuple(expected.shape)} "
                          f"{np.dtype(expected.dtype)}; the sources of a mixture must agree")


def _source_fields(fields: Mapping[str, Field], renames: Mapping[str, str], kept: Sequence[str]) -> SourceFields:
    back = {theirs: ours for ours, theirs in renames.items()}
    dropped = frozenset(f for f in fields if back.get(f, f) not in kept)
    return SourceFields(back, dropped, dict(renames))
