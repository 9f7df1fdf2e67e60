"""Sample-time views of stored steps: n-step returns, frame stacks and HER goal relabelling.

Each is computed from rows already on disk when a batch is drawn, so nothing extra is stored
and every one works on buffers larger than RAM. They read the episode index to stay inside the
sampled step's episode and the readable window ``[lo, hi)`` of its lane.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ..checks import check_int
from ..errors import SchemaError
from ..format.schema import Field, Schema
from .derived import RowView
from .index import EpisodeIndex
from .returns import nstep_window
from .source import RowSource


def at_lanes(per_lane: np.ndarray, lane: np.ndarray) -> np.ndarray:
    """``per_lane[lane]``: a scalar of shape () where there is one lane (it broadcasts like the
    rows it stands for, without a gather)."""
    values: np.ndarray = per_lane[0] if len(per_lane) == 1 else per_lane[lane]
    return values


def episode_last_step(episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The last readable step of the episode holding each step (its end, or the lane's newest)."""
    last: np.ndarray = np.minimum(episodes.next_end(lane, step), at_lanes(hi, lane) - 1)
    return last


def episode_first_step(episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """The first readable step of the episode holding each step."""
    first: np.ndarray = np.maximum(episodes.episode_start(lane, step), at_lanes(lo, lane))
    return first


def termination_field(schema: Schema) -> str:
    """The field that says "no bootstrap": ``terminated`` if stored, else ``done``."""
    for name in ("terminated", "done"):
        if name in schema.fields:
            return name
    raise ValueError("n-step returns need a 'terminated' or 'done' field")


def nstep(rows_from: RowSource, episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray,
          hi: np.ndarray, n: int, gamma: float, left_out: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """n-step targets for transitions starting at (lane, step).

    Uses k = min(n, steps left in the episode, steps left in the lane) steps. Returns
    ``reward`` (float32 sum of gamma^i r[t+i], i < k), every ``next_*`` field but those in
    ``left_out`` taken at step t+k-1, and ``discount`` = gamma^k * (1 - terminated[t+k-1]): a
    time-limit truncation bootstraps, a termination does not.
    """
    check_int(n, "n_step", 1)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma!r}")
    schema = rows_from.schema
    term = termination_field(schema)
    next_fields = tuple(name for name in schema.fields if name.startswith("next_") and name not in left_out)
    last = episode_last_step(episodes, lane, step, hi)
    k = np.minimum(n, last - step + 1)
    offsets = np.minimum(np.arange(n)[None, :], (k - 1)[:, None])
    steps = (step[:, None] + offsets).reshape(-1)
    rows = rows_from.gather(np.repeat(lane, n), steps, ("reward", term, *next_fields))
    final = np.arange(len(step)) * n + (k - 1)
    returns, discounts = nstep_window(rows["reward"].reshape(len(step), n), k, rows[term][final], gamma)
    out = {"reward": returns.astype(np.float32), "discount": discounts.astype(np.float32)}
    for name in next_fields:
        out[name] = rows[name][final]
    return out


SMALL_ROW_BYTES = 256
"""`stacked_rows` gathers a field it does not stack together with the frame windows, and picks
its row at each step from them, when one row takes at most this many bytes: reading ``frames``
extra rows of it costs less than a gather of its own."""


def frame_stack(view: RowView, episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray,
                lo: np.ndarray, frames: int, fields: tuple[str, ...],
                next_step: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Stacks ``[B, frames, *shape]`` of each field in ``fields`` (and its ``next_`` twin).

    Frame i of step t is the field at step t - (frames-1) + i, never earlier than the first step
    of t's episode: at an episode start the first frame repeats. The ``next_`` stack is the
    stack of step t shifted by one frame, ending with ``next_<field>`` at t. ``next_step``
    (a later step of the same episode per row, e.g. the last step t+k-1 of an n-step window)
    takes the place of t for the ``next_`` stack.

    Without ``next_step``, see `stacked_rows` (a field and its twin share one window).
    """
    if next_step is None or np.array_equal(next_step, step):
        return stacked_rows(stack_plan(view, frames, fields), view, episodes, lane, step, lo)
    check_stack(frames)
    first = episode_first_step(episodes, lane, step, lo)
    back = np.arange(-(frames - 1), 1)
    steps = np.maximum(step[:, None] + back[None, :], first[:, None])
    rows = view.gather(np.repeat(lane, frames), steps.reshape(-1), fields)
    later_steps = np.maximum(next_step[:, None] + back[None, :], first[:, None])
    later = view.gather(np.repeat(lane, frames), later_steps.reshape(-1), fields)
    out = {}
    for name in fields:
        out[name] = rows[name].reshape(len(step), frames, *rows[name].shape[1:])
        twin = f"next_{name}"
        if twin in view.schema.fields:
            base = later[name].reshape(out[name].shape)
            last = view.gather(lane, next_step, (twin,))[twin]
            out[twin] = np.concatenate([base[:, 1:], last[:, None]], axis=1)
    return out


def check_stack(frames: object) -> None:
    """Raise ValueError unless ``frames`` (a stack's length) is an int >= 1."""
    check_int(frames, "stack", 1)


@dataclass(frozen=True)
class StackPlan:
    """What `stacked_rows` reads, for one schema, stack length and set of fields (`stack_plan`)."""

    frames: int
    fields: tuple[str, ...]
    """The stacked fields, each once, in order."""
    others: tuple[str, ...]
    """The fields read at each step only."""
    twins: dict[str, str]
    """Stacked field -> its ``next_`` twin, for those that have one."""
    derived: tuple[str, ...]
    """The twins derived from the following step (`RowView.derived`)."""
    small: tuple[str, ...]
    """The ``others`` gathered with the windows (`SMALL_ROW_BYTES`)."""
    apart: tuple[str, ...]
    """The fields gathered at the steps: the other ``others`` and the twins stored as given."""
    offsets: np.ndarray
    """Per window column, its step after the row's step (int64 ``[width]``: ``1 - frames .. 0``,
    then for the twin's column 1 if it is derived from the following step, else 0). Read-only."""
    windowed: tuple[str, ...]
    """The fields gathered at the window steps: the stacked ones and the small others."""
    width: int
    """Steps in each row's window: ``frames``, plus one if a field has a twin."""


def stack_plan(view: RowView, frames: int, fields: tuple[str, ...], others: tuple[str, ...] = ()) -> StackPlan:
    """The `StackPlan` of stacks of ``fields`` with rows of ``others``. Raises ValueError unless
    ``frames`` is an int >= 1."""
    check_stack(frames)
    fields = tuple(dict.fromkeys(fields))
    varying = [name for name in fields if name in view.schema.fields and view.schema[name].ragged
               and view.schema[name].codec is None]  # encoded frames have a fixed shape per step
    if varying:
        raise SchemaError(f"stack_fields: field {varying[0]!r} is ragged ({view.schema[varying[0]]}); frames are "
                          f"stacked from fields with a fixed shape per step")
    twins = {name: f"next_{name}" for name in fields if f"next_{name}" in view.schema.fields}
    derived = tuple(twin for twin in twins.values() if twin in view.derived)
    small = tuple(name for name in others
                  if view.schema[name].row_bytes <= SMALL_ROW_BYTES and not view.schema[name].ragged)
    apart = (*(name for name in others if name not in small), *(t for t in twins.values() if t not in derived))
    offsets = np.arange(1 - frames, 1 + bool(twins), dtype=np.int64)
    offsets[frames:] = 1 if derived else 0
    offsets.flags.writeable = False
    return StackPlan(int(frames), fields, tuple(others), twins, derived, small, apart, offsets, (*fields, *small),
                     len(offsets))


def stacked_rows(plan: StackPlan, view: RowView, episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray,
                 lo: np.ndarray, hi: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The rows of ``plan.others`` at each step (``[B, *shape]``), then the stacks ``[B, frames,
    *shape]`` of ``plan.fields`` and their ``next_`` twins, as `frame_stack` defines them.

    A field and its twin are two views of one ``[B, frames + 1, *shape]`` window (``[:, :-1]``
    and ``[:, 1:]``). Where the twin is the field at the following step (a derived twin, the
    step before `episode_last_step`) the window's last frame is read with the others, else
    it is the twin at the step. Every window, and the small ``others`` (picked at each step from
    the window's rows), come from one gather; the other ``others`` and the twins stored as given
    from one gather at the steps; the derived twins of the other steps (episode ends, each lane's
    newest) from where they are kept (`RowView.kept_next`). ``hi``: the window's end per lane, if
    the caller has it."""
    frames, width, derived = plan.frames, plan.width, plan.derived
    hi = view.window()[1] if hi is None else hi
    window, kept, ended = episodes.stack_windows(lane, step, plan.offsets, lo, hi, bool(derived))
    windowed = plan.windowed
    rows = view.gather(lane.repeat(width), window.reshape(-1), windowed) if windowed else {}
    at_step = view.gather(lane, step, plan.apart) if plan.apart else {}
    finals = view.kept_next(lane[kept], step[kept], derived, ended) if len(kept) else {}
    out = {name: rows[name][frames - 1::width].copy() if name in plan.small else at_step[name]
           for name in plan.others}
    for name in plan.fields:
        stack = rows[name].reshape(len(step), width, *rows[name].shape[1:])
        twin = plan.twins.get(name)
        if twin is None:
            out[name] = stack if width == frames else stack[:, :frames].copy()
            continue
        if twin in at_step:
            stack[:, frames] = at_step[twin]
        elif twin in finals:
            stack[kept, frames] = finals[twin]
        out[name], out[twin] = stack[:, :frames], stack[:, 1:]
    return out


GOAL_PREFIXES = ("", "obs_", "observations_")
"""How a goal field may be named: as stored by ``add``, under the Minari importer's flattening of a
dict observation (``obs_<key>``, next twin ``next_obs_<key>``) and under the D4RL importer's naming
of an HDF5 ``observations/<key>`` group (``observations_<key>``, ``next_observations_<key>``)."""

UNFINISHED = ("skip", "newest")
"""What `HER` does with rows of episodes that have not ended (see there)."""


def goal_copies(name: str, fields: Mapping[str, Field]) -> tuple[str, ...]:
    """The fields holding goal ``name`` at a step: ``name``, ``obs_<name>``, ``observations_<name>``
    (those stored, in that order; see `GOAL_PREFIXES`)."""
    return tuple(prefix + name for prefix in GOAL_PREFIXES if prefix + name in fields)


@dataclass
class HER:
    """Hindsight experience replay: relabel goals at sample time from the same episode.

    For a share ``k / (k + 1)`` (rounded; the rows chosen at random) of the batch's rows whose
    episode has ended, the goal is replaced by an achieved goal of the same episode and the
    reward recomputed with ``reward_fn(achieved, goal) -> reward`` (vectorized over the batch;
    ``achieved`` is the achieved goal after step t). The new goal is the achieved goal after
    step t' (``next_<achieved_goal>`` if stored, else ``achieved_goal``), with t' drawn uniformly
    from [t, episode end] for ``"future"``, the episode's last step for ``"final"``, or any
    readable step of the episode for ``"episode"``. Nothing extra is stored.

    Fields relabelled, on every relabelled row: the goal field ``goal``, every stored twin of it
    (``next_<goal>``, and the importers' flattened names ``obs_<goal>`` / ``next_obs_<goal>``
    (Minari dict observations) and ``observations_<goal>`` / ``next_observations_<goal>`` (D4RL
    HDF5 groups), each also when derived with ``derive_next``), all set to the new goal, and
    ``reward``. The batch gains ``"relabelled"`` (bool ``[B]``). Every other field is left as
    stored. ``goal`` and ``achieved_goal`` may be given bare (``"desired_goal"``): a buffer that
    stores only the flattened names is read under them.

    ``unfinished``: rows of an episode that has not ended yet (the open episode of each lane)
    are never relabelled with ``"skip"`` (the default, as Stable-Baselines3's HerReplayBuffer,
    which samples only ended episodes); they stay in the batch as stored and the share k/(k+1)
    counts the other rows. ``"newest"`` relabels them too, their newest readable step standing
    in for the episode's end (diskreplay's behaviour before this option).
    """

    reward_fn: Callable[[np.ndarray, np.ndarray], np.ndarray]
    strategy: str = "future"
    k: int = 4
    goal: str = "desired_goal"
    achieved_goal: str = "achieved_goal"
    unfinished: str = "skip"

    def __post_init__(self) -> None:
        if self.strategy not in ("future", "final", "episode"):
            raise ValueError(f"HER strategy must be 'future', 'final' or 'episode', got {self.strategy!r}")
        check_int(self.k, "HER k", 0)
        if self.unfinished not in UNFINISHED:
            raise ValueError(f"HER unfinished must be 'skip' (leave rows of episodes that have not ended as "
                             f"stored) or 'newest' (relabel them up to their newest step), got {self.unfinished!r}")

    def relabelled_fields(self, schema: Schema) -> tuple[str, ...]:
        """The goal fields a relabelled row gets the new goal in: each stored copy of ``goal``
        (`goal_copies`) and its stored ``next_`` twin."""
        fields = schema.fields
        return tuple(name for copy in goal_copies(self.goal, fields) for name in (copy, f"next_{copy}")
                     if name in fields)

    def relabel(self, batch: dict[str, np.ndarray], rows_from: RowSource, episodes: EpisodeIndex,
                lane: np.ndarray, step: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Relabel ``batch`` (drawn at ``(lane, step)``) in place; adds ``"relabelled"`` (bool).

        Raises ValueError if the buffer lacks the goal, achieved goal or reward, or the batch
        lacks a goal field (frame-stacked)."""
        targets = self._targets(rows_from.schema, batch)
        achieved_name = self._achieved_name(rows_from.schema)
        chosen = self._choose(self._eligible(episodes, lane, step, hi), rng)
        rows = np.flatnonzero(chosen)
        source = self._source_steps(episodes, lane[rows], step[rows], lo, hi, rng)
        achieved = rows_from.gather(lane[rows], step[rows], (achieved_name,))[achieved_name]
        new_goal = rows_from.gather(lane[rows], source, (achieved_name,))[achieved_name]
        for name in targets:
            batch[name][rows] = new_goal
        batch["reward"][rows] = np.asarray(self.reward_fn(achieved, new_goal)).astype(batch["reward"].dtype)
        batch["relabelled"] = chosen
        return batch

    def _targets(self, schema: Schema, batch: dict[str, np.ndarray]) -> tuple[str, ...]:
        """`relabelled_fields`, checked: raises ValueError for a missing goal, reward or batch field."""
        targets = self.relabelled_fields(schema)
        if not targets or "reward" not in schema.fields:
            wanted = "reward" if targets else self.goal
            raise ValueError(f"HER needs field {wanted!r}; the buffer has {list(schema.fields)}")
        missing = [name for name in targets if name not in batch]
        if missing:
            raise ValueError(f"HER relabels {missing}, which are frame-stacked here: leave them out of stack_fields")
        return targets

    def _achieved_name(self, schema: Schema) -> str:
        """The field holding the achieved goal after a step: a stored copy's ``next_`` twin if any
        (``next_achieved_goal``), else the copy itself. Raises ValueError if none is stored."""
        copies = goal_copies(self.achieved_goal, schema.fields)
        if not copies:
            raise ValueError(f"HER needs field {self.achieved_goal!r}; the buffer has {list(schema.fields)}")
        return next((f"next_{c}" for c in copies if f"next_{c}" in schema.fields), copies[0])

    def _eligible(self, episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Per row, whether it may be relabelled: its episode has ended (or ``unfinished="newest"``)."""
        if self.unfinished == "newest":
            return np.ones(len(step), dtype=bool)
        ended: np.ndarray = episodes.next_end(lane, step) < hi[lane]
        return ended

    def _choose(self, eligible: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A random share k/(k+1) (rounded) of the ``eligible`` rows, as a bool mask."""
        candidates = np.flatnonzero(eligible)
        count = int(round(len(candidates) * self.k / (self.k + 1)))
        chosen = np.zeros(len(eligible), dtype=bool)
        chosen[candidates[rng.permutation(len(candidates))[:count]]] = True
        return chosen

    def _source_steps(self, episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray, lo: np.ndarray,
                      hi: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        last = episode_last_step(episodes, lane, step, hi)
        if self.strategy == "final":
            return last
        first = step if self.strategy == "future" else episode_first_step(episodes, lane, step, lo)
        source: np.ndarray = first + np.floor(rng.random(len(step)) * (last - first + 1)).astype(np.int64)
        return source
