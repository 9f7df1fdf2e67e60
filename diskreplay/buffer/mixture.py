"""`Mixture`: batches drawn from several buffers at once in fixed proportions (offline-to-online
RL: a fixed offline dataset and the live online buffer, e.g. 50/50 as RLPD samples them)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checks import check_int
from ..errors import EmptyBufferError
from ..format.schema import Field
from .batches import TRANSFORMS, batch_generators, call_generator, check_batch_size, takes_option, takes_priorities
from .mixture_fields import SOURCE, SourceFields, mixture_fields
from .output_format import output_converter
from .replay_buffer import ReplayBuffer
from .state import check_rng_state

if TYPE_CHECKING:
    from ..torch.datasets import SampleDataset

Rows = dict[str, np.ndarray]
MAX_SOURCES = 256
"""Sources a mixture reads at most (the ``"source"`` column is uint8)."""


class Mixture:
    """Batches from several buffers at once, each batch in fixed proportions.

    ``Mixture({"offline": a, "online": b}, weights={"offline": 0.5, "online": 0.5}, seed=0)``:
    every batch of ``B`` rows holds exactly `counts` ``(B)`` rows of each source, drawn by that
    source's own sampler (its priorities, its options), source after source in the order of
    ``sources``; a ``"source"`` column (uint8) gives each row's source as its position in that
    order (`names`). Trajectory slices, n-step returns and frame stacks are each source's own, so
    they never cross from one source into another.

    The sources are `ReplayBuffer`s of any kind: local or remote (``s3://``...), sharded (a
    learner's union) or not, read-only or the writer. A writer's rows are sampled as soon as they
    are added; read-only sources adopt their writers' new commits at `refresh` (as a read-only
    `ReplayBuffer` does), or when a read finds its rows overwritten. The mixture does not own its
    sources: `close` closes them all, if you want it to.
    """

    def __init__(self, sources: Mapping[str, ReplayBuffer], weights: Mapping[str, float] | None = None, *,
                 seed: int | None = None, fields: Mapping[str, Mapping[str, str]] | None = None,
                 select: Sequence[str] | None = None):
        """Args:
            sources: name -> buffer, in the order the rows of a batch come (1 to 256 sources).
            weights: name -> a weight >= 0 for every source (default: equal weights); only the
                ratios matter. See `counts` for how a batch is split.
            seed: seed of the mixture's own ``numpy.random.Generator``, which every source's
                draws use (a source's own generator is not used).
            fields: per source, the mixture's field name -> that source's field name, for
                sources that name a field differently, e.g. ``{"online": {"obs": "observation",
                "next_obs": "next_observation"}}``; fields not named keep their names.
            select: the fields a batch holds (the mixture's names; default: every field of the
                first source, which every other source must then have exactly). Fields left out
                are still read from the store, and dropped.

        Raises:
            ValueError: no sources, more than 256, a source that is not a `ReplayBuffer`;
                ``weights`` naming an unknown source or missing one, a weight that is negative
                or not finite, weights whose total is not positive; ``fields`` naming an unknown
                source.
            SchemaError: a field a source lacks (the message names the source and the field),
                fields of different shape or dtype, see `mixture_fields`.
        """
        self.sources: dict[str, ReplayBuffer] = _checked_sources(sources)
        """The sources, name -> buffer, in batch order."""
        self.weights: dict[str, float] = _checked_weights(weights, self.sources)
        """Each source's weight, as given (normalized: ``weights[name] / sum(weights.values())``)."""
        self.fields: dict[str, Field]
        """The fields a batch holds (the mixture's names), besides index, weight and source."""
        self.fields, self._fields = mixture_fields({n: b.fields for n, b in self.sources.items()}, fields, select)
        self.renames: dict[str, dict[str, str]] = {name: dict(m) for name, m in (fields or {}).items()}
        """``fields`` as given: per source, the mixture's field name -> that source's."""
        self.select: tuple[str, ...] | None = None if select is None else tuple(self.fields)
        """``select`` as given (None: the first source's fields)."""
        self.rng = np.random.default_rng(seed)
        self.names: tuple[str, ...] = tuple(self.sources)
        """The source names; ``batch["source"] == i`` marks rows of ``names[i]``."""

    def __repr__(self) -> str:
        parts = ", ".join(f"{n!r}: {self.weights[n]:g}" for n in self.names)
        return f"Mixture({{{parts}}}, fields={sorted(self.fields)})"

    # ---- sampling ----------------------------------------------------------------------------

    def counts(self, batch_size: int) -> dict[str, int]:
        """Rows of each source in a batch of ``batch_size``, by the largest remainder method:
        source i gets ``floor(w_i * B / W)`` rows (W: the weights' total), and the rows left go
        one each to the sources with the largest fractional parts ``w_i * B / W - floor(...)``,
        ties to the source that comes first. So each count is ``w_i * B / W`` rounded up or
        down, the counts add up to ``B``, and they are the same for every batch of that size.

        Raises ValueError for a batch size that is not an int >= 1."""
        size = check_int(batch_size, "batch_size", 1)
        total = math.fsum(self.weights.values())
        exact = [self.weights[name] * size / total for name in self.names]
        counts = [math.floor(x) for x in exact]
        left = size - sum(counts)
        order = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
        for i in order[:left]:
            counts[i] += 1
        return dict(zip(self.names, counts))

    def sample(self, batch_size: int, *, seed: int | None = None, rng: np.random.Generator | None = None,
               format: str = "numpy", as_tensordict: bool = False, out: dict[str, np.ndarray] | None = None,
               stack_fields: Sequence[str] = ("obs",), **options: Any) -> Rows | Any:
        """A minibatch of ``batch_size`` rows: `counts` rows from each source, each source's
        drawn as ``source.sample(count, rng=..., **options)`` draws them, one after another in
        the order of `names`: ``{field: [B, ...], "index": [B] (each source's row ids),
        "source": [B] uint8, ...}``.

        ``options``: everything `ReplayBuffer.sample` takes (``seq_len``, ``pad``, ``n_step``,
        ``gamma``, ``stack``, ``her``, ``beta``, ``recent_rows``, a sampler's own options),
        passed to every source; a sampler option (``beta``, ``recent_rows``, a sampler's own)
        only to the sources whose sampler takes it (``beta`` to the prioritized ones).
        ``stack_fields`` and ``out`` use the mixture's field names; ``her`` names fields as the
        sources do. Random choices use ``rng``, else a generator seeded with ``seed``, else the
        mixture's own, for every source in turn. ``format`` as in `ReplayBuffer.sample`.

        ``"weight"``: when some source has priorities, each row's importance weight as its own
        source computes it (normalized within that source); rows of a source without
        priorities weigh 1. ``out``: arrays ``[B, *shape]`` of the mixture's fields (and
        ``"index"``, ``"weight"``, ``"source"``): each source's rows are gathered straight into
        its part of them.

        Raises:
            ValueError: as `ReplayBuffer.sample` (the first source that refuses raises); a sampler
                option that no source's sampler takes.
            EmptyBufferError: a source holds no rows (the message names it).
            StaleReadError, RateLimitTimeout, ClosedError: from a source, as `ReplayBuffer.sample`.
        """
        convert = output_converter(format, as_tensordict)
        check_batch_size(batch_size, sum(f.row_bytes for f in self.fields.values()) + 1)
        generator = call_generator(seed, rng, self.rng)
        counts = self.counts(batch_size)
        _check_out_rows(out, int(batch_size))
        per_source = self._options(options)
        parts, start = {}, 0
        for name in self.names:
            count = counts[name]
            if count:
                part_out = _part(out, start, start + count, self._fields[name])
                parts[name] = self._draw(name, count, generator, part_out, stack_fields, per_source[name])
            start += count
        return convert(self._joined(parts, counts, out))

    def sample_batches(self, batch_size: int, count: int, *, seed: int | None = None,
                       rng: np.random.Generator | None = None, rngs: Sequence[np.random.Generator] | None = None,
                       format: str = "numpy", **options: Any) -> list[Rows | Any]:
        """``count`` batches, as ``count`` calls of `sample` in a row draw them (batch i with
        ``rngs[i]`` if given). Raises as `sample`; ValueError for ``count`` or ``rngs`` as
        `ReplayBuffer.sample_batches`."""
        check_int(count, "count", 1)
        generators = batch_generators(int(count), rngs, seed, rng, self.rng)
        return [self.sample(batch_size, rng=generator, format=format, **options) for generator in generators]

    def _options(self, options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """Each source's options: every one but sampler options (``beta``, ``recent_rows``, a
        sampler's own) its sampler does not take. Raises ValueError for a sampler option that no
        source's sampler takes."""
        sampler_options = {k: v for k, v in options.items() if k not in TRANSFORMS and v is not None}
        for key in sampler_options:
            if not any(takes_option(buf.sampler, key) for buf in self.sources.values()):
                samplers = ", ".join(f"{n}: {type(b.sampler).__name__}" for n, b in self.sources.items())
                raise ValueError(f"no source's sampler takes the sampling option {key!r} ({samplers})")
        return {name: {k: v for k, v in options.items() if k not in sampler_options or takes_option(buf.sampler, k)}
                for name, buf in self.sources.items()}

    def _draw(self, name: str, count: int, rng: np.random.Generator, out: dict[str, np.ndarray] | None,
              stack_fields: Sequence[str], options: Mapping[str, Any]) -> Rows:
        """``count`` rows of source ``name`` under the mixture's names."""
        fields = self._fields[name]
        stacks = tuple(fields.source_name(f) for f in stack_fields)
        try:
            batch = self.sources[name].sample(count, rng=rng, out=out, stack_fields=stacks, **options)
        except EmptyBufferError as exc:
            raise EmptyBufferError(f"source {name!r} of the mixture: {exc}") from None
        return fields.rows(batch)

    def _joined(self, parts: Mapping[str, Rows], counts: Mapping[str, int], out: Mapping[str, np.ndarray] | None
                ) -> Rows:
        """The parts' rows one after another (into ``out``'s arrays where given), with the
        ``source`` column, and weights of 1 for sources without priorities if some have them.
        Raises ValueError for parts with different arrays (a sampler's own extras)."""
        if any("weight" in part for part in parts.values()):
            for part in parts.values():
                part.setdefault("weight", np.ones(len(part["index"]), np.float32))
        (first, keys), *others = ((name, sorted(part)) for name, part in parts.items())
        for name, theirs in others:
            if theirs != keys:
                raise ValueError(f"the sources' batches differ: source {first!r} gave {keys}, source {name!r} {theirs}")
        codes = np.repeat(np.arange(len(self.names), dtype=np.uint8), [counts[n] for n in self.names])
        batch: Rows = {}
        for key in [*parts[first], SOURCE]:
            pieces = [codes] if key == SOURCE else [part[key] for part in parts.values()]
            given = None if out is None else out.get(key)
            if given is None:
                batch[key] = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
                continue
            start = 0
            for piece in pieces:  # a source gathered its fields, index and weight into its part already
                if not np.may_share_memory(piece, given):
                    given[start:start + len(piece)] = piece
                start += len(piece)
            batch[key] = given
        return batch

    # ---- priorities, refresh, state ----------------------------------------------------------

    def update_priorities(self, batch: Mapping[str, Any], td_errors: Any) -> int:
        """Set the priorities of a batch's rows from TD errors, each in its own source:
        ``batch["source"]`` says which, ``batch["index"]`` the row ids (``batch["start"]`` for
        trajectory slices, whose priority is their first row's). Rows of sources without
        priorities are left out. Returns the number of rows updated.

        Raises:
            TypeError: no source has priorities.
            ValueError: a batch without ``"source"`` and ``"index"``, not one TD error per row, a
                source number the mixture does not have; as `ReplayBuffer.update_priorities`.
        """
        if not any(takes_priorities(buf.sampler) for buf in self.sources.values()):
            raise TypeError(f"update_priorities needs a prioritized sampler; no source of the mixture has one "
                            f"({', '.join(f'{n}: {type(b.sampler).__name__}' for n, b in self.sources.items())})")
        source, ids, td = _priority_rows(batch, td_errors, len(self.names))
        updated = 0
        for code, buf in enumerate(self.sources.values()):
            rows = source == code
            if rows.any() and takes_priorities(buf.sampler):
                updated += buf.update_priorities(ids[rows], td[rows])
        return updated

    def refresh(self) -> bool:
        """Read-only sources adopt their writers' newest commits (`ReplayBuffer.refresh`);
        True if any had a newer one."""
        refreshed = [buf.refresh() for buf in self.sources.values()]  # every one, not up to the first
        return any(refreshed)

    def state_dict(self) -> dict[str, Any]:
        """The mixture's generator and each source's `ReplayBuffer.state_dict` (its sampler's
        state, priorities included): same seed and same calls give the same batches, also after
        `load_state_dict` of a state saved in the middle."""
        return {"rng": self.rng.bit_generator.state,
                "sources": {name: buf.state_dict() for name, buf in self.sources.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a `state_dict` of a mixture of these same sources (holding the same rows).
        All or nothing: if one part does not fit, the sources are as before the call.

        Raises ValueError: another set of sources, a bad generator state, or a source's state
        that does not fit it (see `ReplayBuffer.load_state_dict`)."""
        if not isinstance(state, Mapping) or not isinstance(state.get("sources"), Mapping) or "rng" not in state:
            raise ValueError("state: expected the mapping Mixture.state_dict() returns ('rng', 'sources')")
        if list(state["sources"]) != list(self.names):
            raise ValueError(f"state is of a mixture of {list(state['sources'])}, this one mixes {list(self.names)}")
        check_rng_state(state["rng"])
        before = {name: buf.state_dict() for name, buf in self.sources.items()}
        loaded = []
        try:
            for name, buf in self.sources.items():
                buf.load_state_dict(state["sources"][name])
                loaded.append(name)
        except BaseException:
            for name in loaded:
                self.sources[name].load_state_dict(before[name])
            raise
        self.rng.bit_generator.state = state["rng"]

    def as_dataset(self, batch_size: int, **options: Any) -> SampleDataset:
        """A torch ``IterableDataset`` of endless mixed batches over the sources' committed rows,
        for ``DataLoader`` workers: `diskreplay.torch.mixtures.mixture_dataset` (options there)."""
        from ..torch.mixtures import mixture_dataset  # torch is imported only when first used

        return mixture_dataset(self, batch_size, **options)

    def close(self) -> None:
        """Close every source (`ReplayBuffer.close`)."""
        for buf in self.sources.values():
            buf.close()

    def __enter__(self) -> Mixture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _checked_sources(sources: Mapping[str, ReplayBuffer]) -> dict[str, ReplayBuffer]:
    if not isinstance(sources, Mapping) or not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"sources must be a mapping of 1 to {MAX_SOURCES} names to buffers, got {sources!r}")
    for name, buf in sources.items():
        if not isinstance(name, str) or not isinstance(buf, ReplayBuffer):
            raise ValueError(f"sources: expected str -> ReplayBuffer, got {name!r} -> {type(buf).__name__}")
    return dict(sources)


def _checked_weights(weights: Mapping[str, float] | None, sources: Mapping[str, ReplayBuffer]) -> dict[str, float]:
    if weights is None:
        return dict.fromkeys(sources, 1.0)
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping of source names to numbers, got {type(weights).__name__}")
    unknown, missing = sorted(set(weights) - set(sources)), [n for n in sources if n not in weights]
    if unknown or missing:
        raise ValueError(f"weights: unknown source(s) {unknown}, missing source(s) {missing}; the mixture's "
                         f"sources are {list(sources)}")
    out = {}
    for name in sources:
        w = weights[name]
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)) or not math.isfinite(w) \
                or w < 0:
            raise ValueError(f"weights[{name!r}] must be a finite number >= 0, got {w!r}")
        out[name] = float(w)
    if not math.fsum(out.values()) > 0:
        raise ValueError(f"weights must add up to a positive total, got {out}")
    return out


def _part(out: Mapping[str, np.ndarray] | None, start: int, end: int, fields: SourceFields
          ) -> dict[str, np.ndarray] | None:
    """Rows ``[start, end)`` of the ``out`` arrays, under the source's names (the source column
    is the mixture's to fill)."""
    if out is None:
        return None
    return {fields.source_name(k): v[start:end] for k, v in out.items() if k != SOURCE}


def _check_out_rows(out: Mapping[str, np.ndarray] | None, rows: int) -> None:
    """Raise ValueError for an ``out`` array that is not ``rows`` long (the sources check the rest)."""
    for name, given in (out or {}).items():
        if np.ndim(given) < 1 or len(given) != rows:
            raise ValueError(f"out[{name!r}]: expected an array of {rows} rows, got shape {np.shape(given)}")


def _priority_rows(batch: Mapping[str, Any], td_errors: Any, sources: int) -> tuple[np.ndarray, ...]:
    """``(source, row ids, td errors)`` of a batch, as flat numpy arrays of one length each."""
    if SOURCE not in batch or "index" not in batch:
        raise ValueError("update_priorities: expected a batch of Mixture.sample (with 'source' and 'index')")
    ids = _numpy(batch["start"] if "start" in batch else batch["index"]).reshape(-1)
    source, td = _numpy(batch[SOURCE]).reshape(-1), _numpy(td_errors).reshape(-1)
    if not len(source) == len(ids) == len(td):
        raise ValueError(f"update_priorities: {len(td)} TD errors for a batch of {len(ids)} rows "
                         f"({len(source)} source numbers)")
    if source.size and (source.dtype.kind not in "iu" or source.min() < 0 or source.max() >= sources):
        raise ValueError(f"update_priorities: source numbers must be in [0, {sources}), got {source[:5]}...")
    return source, ids, td


def _numpy(values: Any) -> np.ndarray:
    """An array of ``values``: numpy, or a torch tensor on any device (copied to the CPU)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    return np.asarray(values)
