"""`Batches`: one minibatch drawn and assembled: the sampler's draw, one gather of the rows, then
the sample-time transforms (HER, n-step returns, frame stacks) or trajectory slices."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, TypeGuard

import numpy as np

from ..checks import check_int
from ..episodes import HER, RowView, transforms
from ..errors import EmptyBufferError
from ..format.lanes import is_empty, row_ids
from ..format.schema import Field
from ..sampling import Draw, PrioritySampler, Sampler, SliceSampler
from ..storage import check_output, physical_memory
from .token_draws import Lengths, TokenRequest, draw_tokens

Batch = dict[str, np.ndarray]
SMALL_BATCH_BYTES = 1 << 26
"""A batch this small fits any machine's memory: `check_batch_size` asks the OS only past it."""
BATCH_EXTRAS = {"index": Field((), "int64"), "weight": Field((), "float32")}
"""Arrays a batch holds besides the fields, which ``out=`` may also provide."""


@dataclass(frozen=True)
class SampleRequest:
    """What `ReplayBuffer.sample` was asked for, besides the batch size (see there)."""

    seq_len: int | None = None
    pad: bool = False
    n_step: int | None = None
    gamma: float = 0.99
    stack: int | None = None
    stack_fields: tuple[str, ...] = ("obs",)
    her: HER | None = None
    out: Mapping[str, np.ndarray] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword options for the sampler (``beta``, ``recent_rows``, a custom sampler's own)."""

    @property
    def transformed(self) -> bool:
        return self.n_step is not None or self.stack is not None or self.her is not None

    def check_out(self, batch_size: int, fields: Mapping[str, Field]) -> None:
        """Raise ValueError for ``out`` arrays that do not fit a batch, or ``out`` with slices
        or transforms (before anything is drawn)."""
        assert self.out is not None
        if self.transformed or self.seq_len is not None:
            raise ValueError("out= works for plain transitions only, not with seq_len, n_step, stack or her")
        check_out(self.out, batch_size, fields)


PLAIN = SampleRequest()
"""A plain request: transitions from the sampler, no options (the common case, made once)."""
TRANSFORMS = frozenset(f.name for f in fields(SampleRequest)) - {"options"}
"""What a request names besides sampling options: trajectories, n-step returns, stacks, HER, ``out``."""


def plain_request(options: dict[str, Any], beta: float | None, recent_rows: int | None) -> SampleRequest:
    """A request for plain transitions with the sampler's ``options``, and ``beta`` and
    ``recent_rows`` unless None. Raises ValueError for an option that asks for more than plain
    transitions (`TRANSFORMS`)."""
    if not options and beta is None and recent_rows is None:
        return PLAIN
    asked = sorted(TRANSFORMS.intersection(options))
    if asked:
        raise ValueError(f"{', '.join(asked)}: plain transitions only here; sample() takes trajectories, "
                         f"n-step returns, frame stacks, HER and out=")
    options.update({k: v for k, v in (("beta", beta), ("recent_rows", recent_rows)) if v is not None})
    return SampleRequest(options=options) if options else PLAIN


def sample_request(options: dict[str, Any], beta: float | None, recent_rows: int | None, seq_len: int | None,
                   pad: bool, n_step: int | None, gamma: float, stack: int | None, stack_fields: Sequence[str],
                   her: HER | None, out: Mapping[str, np.ndarray] | None) -> SampleRequest:
    """What `ReplayBuffer.sample` was asked for (its arguments; see there). Raises ValueError as
    `plain_request`."""
    request = plain_request(options, beta, recent_rows)
    if seq_len is None and n_step is None and her is None and out is None:
        if stack is None:
            return request
        fields = tuple(stack_fields)
        if request is PLAIN and type(stack) is int and all(type(name) is str for name in fields):
            return _stacks_request(stack, fields)
    return SampleRequest(seq_len, pad, n_step, gamma, stack, tuple(stack_fields), her, out, request.options)


@functools.lru_cache(maxsize=64)
def _stacks_request(stack: int, stack_fields: tuple[str, ...]) -> SampleRequest:
    """A request for frame stacks alone (made once per stack length and fields)."""
    return SampleRequest(stack=stack, stack_fields=stack_fields)


def call_generator(seed: int | None, rng: np.random.Generator | None,
                   default: np.random.Generator) -> np.random.Generator:
    """The generator a sampling call draws with: ``rng``, else a new one seeded with ``seed``,
    else ``default`` (the buffer's own)."""
    return rng if rng is not None else default if seed is None else np.random.default_rng(seed)


def batch_generators(count: int, rngs: Sequence[np.random.Generator] | None, seed: int | None,
                     rng: np.random.Generator | None, default: np.random.Generator) -> Sequence[np.random.Generator]:
    """The generator of each of ``count`` batches: ``rngs``, else ``rng``, one seeded with
    ``seed`` or ``default``, the same one for every batch. Raises ValueError for ``rngs`` that
    are not ``count`` generators or come with ``seed``/``rng``."""
    if rngs is None:
        return [call_generator(seed, rng, default)] * count
    if seed is not None or rng is not None:
        raise ValueError("rngs= gives each batch its generator: pass it without seed= or rng=")
    if len(rngs) != count:
        raise ValueError(f"rngs: expected {count} generators (one per batch), got {len(rngs)}")
    return rngs


def split_batches(block: Batch, sizes: list[int]) -> list[Batch]:
    """``block`` cut into consecutive batches of these sizes (views of its arrays)."""
    if len(sizes) == 1:
        return [block]
    edges = list(itertools.accumulate(sizes, initial=0))
    return [{name: rows[a:b] for name, rows in block.items()} for a, b in zip(edges, edges[1:])]


class Batches:
    """Draws and assembles batches from a buffer's sampler and rows."""

    def __init__(self, sampler: Sampler, view: RowView, window: Callable[[], tuple[np.ndarray, np.ndarray]],
                 empty_hint: str):
        """``window()``: the readable steps ``[lo, hi)`` per lane now; ``empty_hint``: what an
        `EmptyBufferError` says of the buffer."""
        self.sampler, self.view, self.episodes = sampler, view, view.episodes
        self.num_envs = view.layout.num_envs
        self.window, self.empty_hint = window, empty_hint
        self._unstacked_by: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._stack_plans: dict[tuple[int, tuple[str, ...]], transforms.StackPlan] = {}

    def sample(self, rng: np.random.Generator, batch_size: int, request: SampleRequest) -> Batch:
        """One batch from the rows readable now. Raises EmptyBufferError when there are none;
        StaleReadError from the reads."""
        lo, hi = self._readable()
        if request.seq_len is not None:
            return self._slices(rng, batch_size, request, lo, hi)
        if request.options:
            check_options(self.sampler, request.options)
        draw = self.sampler.sample(rng, batch_size, lo, hi, **request.options)
        if request.stack is not None and request.n_step is None and request.her is None:
            batch = self._stacks(draw, lo, hi, request.stack, request.stack_fields)
        else:
            batch = self.view.gather(draw.lane, draw.step, self._unstacked(request), out=request.out)
            if request.transformed:
                self._transform(batch, draw, rng, lo, hi, request)
        return self._finished(batch, draw, request)

    def sample_many(self, rngs: Sequence[np.random.Generator], batch_size: int, request: SampleRequest) -> Batch:
        """``len(rngs)`` plain batches from one window, batch i drawn with ``rngs[i]`` as `sample`
        draws it, all gathered at once: batch i is rows ``[i * batch_size, (i + 1) * batch_size)``
        of each array. Each generator is used before the next is asked for. Raises as `sample`."""
        lo, hi = self._readable()
        if request.options:
            check_options(self.sampler, request.options)
        draw = Draw.joined([self.sampler.sample(rng, batch_size, lo, hi, **request.options) for rng in rngs])
        return self._finished(self.view.gather(draw.lane, draw.step), draw, request)

    def sample_tokens(self, rng: np.random.Generator, request: TokenRequest, lengths: Lengths) -> Batch:
        """One token-budgeted batch (`draw_tokens`) from the rows readable now, gathered as
        `sample` gathers plain transitions. ``lengths``: rows' lengths of a ragged field. Raises
        as `sample` and `draw_tokens`."""
        lo, hi = self._readable()
        if request.options:
            check_options(self.sampler, request.options)
        draw = draw_tokens(self.sampler, rng, lo, hi, request, lengths, self.view.gather)
        return self._finished(self.view.gather(draw.lane, draw.step), draw, PLAIN)

    def _readable(self) -> tuple[np.ndarray, np.ndarray]:
        """The window ``[lo, hi)`` per lane. Raises EmptyBufferError if it holds no rows."""
        lo, hi = self.window()
        if is_empty(lo, hi):  # also a reader whose newest commit retired all its rows
            raise EmptyBufferError(f"cannot sample from an empty buffer ({self.empty_hint})")
        return lo, hi

    def _finished(self, batch: Batch, draw: Draw, request: SampleRequest) -> Batch:
        """``batch`` with the draw's row ids, weights and extras (into ``out`` where given)."""
        batch["index"] = row_ids(draw.lane, draw.step, self.num_envs)
        if draw.weight is not None:
            batch["weight"] = draw.weight
        if draw.extra:
            batch.update(draw.extra)
        return batch if request.out is None else placed(batch, request.out)

    def _unstacked(self, request: SampleRequest) -> tuple[str, ...] | None:
        """The fields a batch gathers before its frame stacks replace the stacked ones (None: all).

        Raises ValueError naming a stack field the buffer does not have."""
        return None if request.stack is None else self._unstacked_fields(tuple(request.stack_fields))

    def _unstacked_fields(self, stack_fields: tuple[str, ...]) -> tuple[str, ...]:
        """The fields but ``stack_fields`` and their ``next_`` twins, in schema order (remembered
        per ``stack_fields``). Raises ValueError naming a stack field the buffer does not have."""
        known = self._unstacked_by.get(stack_fields)
        if known is not None:
            return known
        fields = self.view.schema.fields
        for name in stack_fields:
            if name not in fields:
                raise ValueError(f"stack_fields: {name!r} is not a field; the buffer has {list(fields)}")
        stacked = {*stack_fields, *(f"next_{name}" for name in stack_fields)}
        self._unstacked_by[stack_fields] = tuple(name for name in fields if name not in stacked)
        return self._unstacked_by[stack_fields]

    def _stacks(self, draw: Draw, lo: np.ndarray, hi: np.ndarray, stack: int, stack_fields: tuple[str, ...]) -> Batch:
        """Frame stacks alone (no n-step, no HER): the rows of the other fields and the stacks,
        from as few gathers as `transforms.stacked_rows` can."""
        plan = self._stack_plans.get((stack, stack_fields)) if isinstance(stack, (int, np.integer)) else None
        if plan is None:  # checked (stack_fields, episodes, stack) and remembered
            others = self._unstacked_fields(stack_fields)
            self._require_episodes()
            plan = self._stack_plans[(stack, stack_fields)] = transforms.stack_plan(self.view, stack, stack_fields,
                                                                                  others)
        return transforms.stacked_rows(plan, self.view, self.episodes, draw.lane, draw.step, lo, hi)

    def _require_episodes(self) -> None:
        if not self.episodes.enabled:
            raise ValueError("n_step, stack and her need episode ends: create the buffer with episode_end=")

    def _transform(self, batch: Batch, draw: Draw, rng: np.random.Generator, lo: np.ndarray, hi: np.ndarray,
                   request: SampleRequest) -> None:
        """Relabel goals (HER), n-step returns, frame stacks: in place, in that order."""
        self._require_episodes()
        if request.her is not None and request.n_step is not None:
            raise ValueError("her and n_step cannot be combined: n-step rewards would ignore the relabelled goals")
        stack, n_step, stack_fields = request.stack, request.n_step, tuple(request.stack_fields)
        if request.her is not None:
            request.her.relabel(batch, self.view, self.episodes, draw.lane, draw.step, lo, hi, rng)
        if n_step is not None:
            stacked = tuple(f"next_{name}" for name in stack_fields) if stack is not None else ()
            batch.update(transforms.nstep(self.view, self.episodes, draw.lane, draw.step, hi, n_step,
                                          request.gamma, left_out=stacked))
        if stack is not None:
            next_step = None
            if n_step is not None:  # the next_ stack belongs to the last step of the n-step window
                next_step = np.minimum(draw.step + n_step - 1, transforms.episode_last_step(
                    self.episodes, draw.lane, draw.step, hi))
            batch.update(transforms.frame_stack(self.view, self.episodes, draw.lane, draw.step, lo,
                                                stack, stack_fields, next_step=next_step))

    def _slices(self, rng: np.random.Generator, batch_size: int, request: SampleRequest,
                lo: np.ndarray, hi: np.ndarray) -> Batch:
        assert request.seq_len is not None
        seq_len, pad = request.seq_len, request.pad
        slices = SliceSampler(self.sampler, self.episodes, seq_len, pad)
        if not self.episodes.enabled:
            raise ValueError("seq_len needs episode ends: create the buffer with episode_end= naming a bool field")
        check_batch_size(batch_size * seq_len, self.view.schema.row_bytes, "batch_size * seq_len")
        check_options(self.sampler, request.options)
        draw = slices.sample(rng, batch_size, lo, hi, **request.options)
        steps, mask = slices.steps(draw, hi)
        lanes = np.repeat(draw.lane, seq_len)
        rows = self.view.gather(lanes, steps.reshape(-1))
        # a ragged field stays one dr.Ragged of batch_size * seq_len rows, slice by slice
        batch = {k: v.reshape(batch_size, seq_len, *v.shape[1:]) if isinstance(v, np.ndarray) else v
                 for k, v in rows.items()}
        batch["index"] = row_ids(lanes, steps.reshape(-1), self.num_envs).reshape(batch_size, seq_len)
        batch["start"] = row_ids(draw.lane, draw.step, self.num_envs)
        if pad:
            batch["mask"] = mask
        if draw.weight is not None:
            batch["weight"] = draw.weight
        return batch


def placed(batch: Batch, out: Mapping[str, np.ndarray] | None) -> Batch:
    """Copy the batch's non-field arrays (index, weight) into their ``out`` arrays, if given."""
    for name, given in (out or {}).items():
        value = batch.get(name)
        if value is None or value is given:
            continue
        if given.shape != value.shape or given.dtype != value.dtype:
            raise ValueError(f"out[{name!r}]: expected a {value.dtype} array shaped {value.shape}, "
                             f"got {given.dtype} shaped {given.shape}")
        given[...] = value
        batch[name] = given
    return batch


def check_out(out: Mapping[str, np.ndarray], count: int, fields: Mapping[str, Field]) -> None:
    """Raise ValueError unless every ``out`` array fits ``count`` rows (before anything is drawn)."""
    for name, given in out.items():
        field = fields.get(name, BATCH_EXTRAS.get(name))
        if field is None:
            raise ValueError(f"out: unknown names {sorted(set(out) - {*fields, *BATCH_EXTRAS})}; expected fields "
                             f"{sorted(fields)} or {', '.join(map(repr, BATCH_EXTRAS))}")
        check_output(name, field, count, given)


def check_batch_size(batch_size: Any, row_bytes: int, name: str = "batch_size") -> None:
    """Raise ValueError for a batch size that is not a positive int or whose rows could not fit
    in this machine's memory (before anything is allocated)."""
    check_int(batch_size, name, 1)
    need = int(batch_size) * (row_bytes + 8)
    if need <= SMALL_BATCH_BYTES:
        return
    memory = physical_memory()
    if need > memory:
        raise ValueError(f"{name}={int(batch_size):,} needs {need:,} bytes for one batch ({row_bytes + 8} per "
                         f"row), more than this machine's {memory:,} bytes of memory")


def takes_priorities(sampler: Sampler) -> TypeGuard[PrioritySampler]:
    """Whether a sampler satisfies `PrioritySampler` (checked once per class: the protocol
    check costs microseconds)."""
    return _is_priority_sampler(type(sampler))


@functools.cache
def _is_priority_sampler(sampler_type: type) -> bool:
    return issubclass(sampler_type, PrioritySampler)


def check_options(sampler: Sampler, options: Mapping[str, Any]) -> None:
    """Raise ValueError for a sampling option the sampler does not take, or a bad ``beta``."""
    taken = _sampling_options(type(sampler))
    unknown = [] if taken is None else sorted(set(options) - set(taken))
    if unknown:
        raise ValueError(f"{type(sampler).__name__} takes no sampling option {', '.join(map(repr, unknown))} "
                         f"(its options: {', '.join(taken or ()) or 'none'})")
    beta = options.get("beta")
    if beta is not None and (isinstance(beta, bool) or not isinstance(beta, (int, float, np.floating))
                             or not math.isfinite(beta) or beta < 0):
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")


def takes_option(sampler: Sampler, name: str) -> bool:
    """Whether a sampler's ``sample`` takes the keyword option ``name`` (any, with ``**options``)."""
    taken = _sampling_options(type(sampler))
    return taken is None or name in taken


@functools.cache
def _sampling_options(sampler_type: type[Sampler]) -> tuple[str, ...] | None:
    """The keyword options a sampler class's ``sample`` takes (None: any, it has ``**options``)."""
    params = list(inspect.signature(sampler_type.sample).parameters.values())[5:]  # self, rng, size, lo, hi
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params)

