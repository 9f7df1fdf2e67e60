"""Fields the buffer derives instead of storing them as given.

- ``next_<f>`` at read time, from ``<f>`` at step t+1 of the same episode: this halves the disk
  used by large observations (`RowView`).
- The discounted episodic return-to-go, at write time, once each episode ends
  (`EpisodicReturn`). A step's stored return counts only once its episode's end is committed:
  until then every read gives ``default_return`` (`RowView` masks it), so a crash between the
  write of patched chunks and the commit never shows returns made of uncommitted rewards.

The ``truncated`` flag is masked the same way. A resumed writer sets it on the newest step of
the episode the last writer left open (`Appender.close_cut_episode`), a patch of a committed row
whose chunk may reach the store before that writer commits (or it may die first); the commit
records the same cut as an episode end. So a stored ``truncated`` counts only at steps that end
an episode in the reader's episode index (`RowView` clears it elsewhere).

For the first: Each episode's final ``next_<f>`` (the observation
after its last step, not stored in the main arrays) is kept in a small dataset-mode store of its
own, one row per episode end, indexed by the end's ordinal in its lane; the ``next_<f>`` of each
lane's newest step is kept in RAM and saved with every commit.

`RowView` is a `RowSource` like the storage it reads (``schema``, ``gather``), so everything that reads
rows (sampling, slices, n-step, frame stacks, HER) works the same with or without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..format.config import BufferConfig
from ..format.lanes import LaneLayout
from ..format.schema import Field, Schema
from .index import NO_END, EpisodeIndex
from .returns import discount_cumsum, episodic_returns
from .source import RowStore

PAIRED_ROW_BYTES = 256
"""`RowView` reads a stored field of at most this many bytes per row at the following steps too,
in the gather of the derived twins' bases, where one gather then serves both."""


def derived_next_fields(bases: tuple[str, ...], fields: dict[str, Field]) -> dict[str, str]:
    """``{"next_obs": "obs", ...}`` for each base field whose next twin is derived.

    Raises ValueError if a base or its ``next_`` twin is missing or their specs differ.
    """
    out = {}
    for base in bases:
        twin = f"next_{base}"
        if base not in fields or twin not in fields or fields[base] != fields[twin]:
            raise ValueError(f"derive_next: expected fields {base!r} and {twin!r} with the same shape and "
                             f"dtype, got {fields.get(base)} and {fields.get(twin)}")
        out[twin] = base
    return out


def row_view(storage: RowStore, config: BufferConfig, finals: RowStore | None) -> RowView:
    """The logical rows of a buffer with this config: its stored fields, the ``next_*`` twins of
    ``derive_next`` (their finals in ``finals``), episodic returns masked until committed."""
    episodes = EpisodeIndex(config.num_envs, config.episode_end)
    derived = {f"next_{base}": base for base in config.derive_next}
    logical = {**config.user_schema.fields, **{twin: config.schema[base] for twin, base in derived.items()}}
    spec = config.episodic_return
    returns = EpisodicReturn.from_json(dict(spec)) if spec else None
    return RowView(storage, episodes, Schema(logical), derived, finals, returns)


class RowView:
    """Gathers logical rows: stored fields from the storage, derived ``next_*`` fields rebuilt."""

    def __init__(self, storage: RowStore, episodes: EpisodeIndex, logical: Schema,
                 derived: dict[str, str], finals: RowStore | None, returns: EpisodicReturn | None = None):
        self.storage = storage
        self.episodes = episodes
        self.schema = logical
        self.derived = derived
        self.finals = finals
        self.returns = returns
        self.cut_flag = "truncated" if "truncated" in episodes.end_fields else None
        """The end field a resumed writer patches (read as set only at the index's ends)."""
        computed = [*derived, returns.name if returns else None, self.cut_flag]
        self.computed = frozenset(name for name in computed if name is not None)
        """The logical fields a read computes or masks: the others are read as stored."""
        self.last_next = {twin: np.zeros((storage.layout.num_envs, *logical[twin].shape), logical[twin].dtype)
                          for twin in derived}
        self._pairs: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[str, ...] | None] = {}

    @property
    def layout(self) -> LaneLayout:
        """The lanes and chunking of the storage below."""
        return self.storage.layout

    def inputs(self) -> Schema:
        """The fields rows are added with: every logical field but a computed return."""
        return Schema({name: f for name, f in self.schema.items() if self.returns is None or name != self.returns.name})

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the readable steps ``[lo, hi)`` (``[num_envs]`` each)."""
        return self.storage.window()

    def gather(self, lane: np.ndarray, step: np.ndarray, names: tuple[str, ...] | None = None,
               out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Rows of the logical fields ``names`` (all by default); ``out`` as in `RowSource.gather`."""
        if not self.computed or (names and self.computed.isdisjoint(names)):
            return self.storage.gather(lane, step, names, out)  # stored fields only, as stored
        names = tuple(self.schema.fields) if names is None else names
        wanted = [twin for twin in names if twin in self.derived]
        stored = tuple(n for n in names if n not in self.derived)
        if wanted:
            rows = self._with_next(lane, step, stored, wanted, out or {})
        else:
            rows = self.storage.gather(lane, step, stored, out)
        if self.returns is not None and self.returns.name in rows:
            self.returns.mask(rows[self.returns.name], self.episodes, lane, step)
        if self.cut_flag is not None and self.cut_flag in rows:
            self._mask_cut(rows[self.cut_flag], lane, step)
        return {n: rows[n] for n in names}

    def _mask_cut(self, values: np.ndarray, lane: np.ndarray, step: np.ndarray) -> None:
        """Clear a stored cut flag where the step does not end its episode in the index read with
        the rows: a resumed writer's patch that no commit of this reader holds yet."""
        flagged = np.flatnonzero(values)
        if len(flagged):
            at = step[flagged]
            values[flagged[self.episodes.next_end(lane[flagged], at) != at]] = False

    def _kept_apart(self, lane: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Steps whose next values are not the following step's: episode ends (their final
        values) and each lane's newest step that is not an end (its value in RAM)."""
        _, hi = self.storage.window()
        is_end = self.episodes.next_end(lane, step) == step
        return is_end, ~is_end & (step == hi[lane] - 1)

    def _with_next(self, lane: np.ndarray, step: np.ndarray, stored: tuple[str, ...], twins: list[str],
                   out: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The ``stored`` fields at the steps and the derived ``twins``: their bases at the
        following steps, the rows whose next value is kept apart (episode ends, each lane's
        newest) then replaced. Without ``out``, when every base is among ``stored``, one gather
        reads both: the steps, then the following steps (`_paired`)."""
        is_end, newest = self._kept_apart(lane, step)
        apart = is_end | newest
        following = np.where(apart, step, step + 1)
        bases = tuple(self.derived[t] for t in twins)
        paired = None if out else self._paired(stored, bases)
        if paired is not None:
            size = len(step)
            both = self.storage.gather(np.concatenate([lane, lane]), np.concatenate([step, following]), paired)
            rows = {name: both[name][:size] for name in stored if name in both}
            if len(rows) < len(stored):
                rows.update(self.storage.gather(lane, step, tuple(n for n in stored if n not in rows)))
            values = {twin: both[base][size:] for twin, base in zip(twins, bases)}
        else:
            rows = self.storage.gather(lane, step, stored, out) if stored else {}
            given = {base: out[twin] for twin, base in zip(twins, bases) if twin in out}
            nexts = self.storage.gather(lane, following, bases, given)
            values = {twin: nexts[base] for twin, base in zip(twins, bases)}
        if apart.any():
            self._fill_kept(values, lane, step, is_end, newest)
        rows.update(values)
        return rows

    def _paired(self, stored: tuple[str, ...], bases: tuple[str, ...]) -> tuple[str, ...] | None:
        """The fields one gather reads at the steps and the following steps, when every base is
        among ``stored``: the bases and the stored fields of at most `PAIRED_ROW_BYTES` per row
        (reading their following rows too costs less than a gather of their own); else None.
        Remembered per ``(stored, bases)``."""
        key = (stored, bases)
        if key not in self._pairs:
            self._pairs[key] = None if not set(bases).issubset(stored) else tuple(
                name for name in stored if name in bases or self.schema[name].row_bytes <= PAIRED_ROW_BYTES)
        return self._pairs[key]

    def patched_since(self, committed: np.ndarray, last_ends: np.ndarray) -> list[tuple[int, int, int]]:
        """Reader, after adopting a commit: ``(lane, first, end)``, the committed steps the writer
        may have patched since the commit adopted before (which had ``committed`` steps and the
        newest ends ``last_ends`` per lane), in each lane where episodes ended since: the returns
        of the episode from just after the previous end, a cut flag at the newest step."""
        if self.returns is None and self.cut_flag is None:
            return []
        newest = self.episodes.last_ends()
        patched = []
        for lane in np.flatnonzero(newest > last_ends).tolist():
            end = int(committed[lane])
            first = int(last_ends[lane]) + 1 if self.returns is not None else end - 1
            if 0 <= first < end:
                patched.append((lane, first, end))
        return patched

    def kept_next(self, lane: np.ndarray, step: np.ndarray, twins: tuple[str, ...],
                  is_end: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The derived ``twins`` at steps whose next value is kept apart, every one of them an
        episode end or its lane's newest step (`_kept_apart`): read from where they are kept
        alone, without the following step's row. ``is_end``: which steps are episode ends (the
        others are their lane's newest), if the caller knows."""
        if is_end is None:
            is_end, newest = self._kept_apart(lane, step)
        else:
            newest = ~is_end
        values = {twin: np.empty((len(step), *self.schema[twin].shape), self.schema[twin].dtype) for twin in twins}
        self._fill_kept(values, lane, step, is_end, newest)
        return values

    def _fill_kept(self, values: dict[str, np.ndarray], lane: np.ndarray, step: np.ndarray, is_end: np.ndarray,
                   newest: np.ndarray) -> None:
        """Write into ``values`` (twin -> rows) the kept-apart next values: the final of each
        episode end (the side store), each lane's newest one (in RAM)."""
        ends = np.flatnonzero(is_end)
        assert self.finals is not None  # a buffer with derived fields keeps their finals
        bases = tuple(self.derived[twin] for twin in values)
        finals = (self.finals.gather(lane[ends], self.episodes.end_ordinal(lane[ends], step[ends]), bases)
                  if len(ends) else {})
        newest = np.flatnonzero(newest)
        for twin, value in values.items():
            if len(ends):
                value[ends] = finals[self.derived[twin]]
            if len(newest):
                value[newest] = self.last_next[twin][lane[newest]]

    def record(self, lane: int, first: int, rows: dict[str, np.ndarray]) -> None:
        """Writer: keep what the main arrays drop from these stored rows of one lane (steps
        ``first, first+1, ...``): each ended episode's final ``next_*`` and the newest ``next_*``."""
        if not self.derived:
            return
        ends = self.episodes.ends_between(lane, first, first + len(next(iter(rows.values()))))
        if len(ends):
            finals = {base: rows[twin][ends - first] for twin, base in self.derived.items()}
            assert self.finals is not None  # a buffer with derived fields keeps their finals
            self.finals.append(lane, finals, len(ends))
        for twin in self.derived:
            self.last_next[twin][lane] = rows[twin][-1]

    def record_final(self, lane: int) -> None:
        """Writer: the lane's newest step was made an episode end (a cut episode closed): its
        ``next_*`` kept in RAM becomes that episode's final. All or nothing."""
        if self.derived:
            assert self.finals is not None  # a buffer with derived fields keeps their finals
            self.finals.append(lane, {base: self.last_next[twin][lane][None] for twin, base in self.derived.items()}, 1)

    def state_dict(self) -> dict[str, Any]:
        """Each lane's newest ``next_*`` value kept in RAM: ``{twin: [num_envs, *shape]}`` copies."""
        return {twin: value.copy() for twin, value in self.last_next.items()}

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise ValueError unless ``state`` (from `state_dict`) fits these fields."""
        if not isinstance(state, dict):
            raise ValueError(f"'last_next': expected a mapping, got {type(state).__name__}")
        for twin, value in state.items():
            want = self.last_next.get(twin)
            if (want is None or not isinstance(value, np.ndarray) or value.shape != want.shape
                    or value.dtype != want.dtype):
                raise ValueError(f"'last_next.{twin}': expected {want.dtype if want is not None else 'no such field'} "
                                 f"shaped {want.shape if want is not None else ()}, "
                                 f"got {getattr(value, 'dtype', type(value).__name__)} "
                                 f"shaped {getattr(value, 'shape', None)}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict`: its values are copied into the arrays kept in RAM."""
        for twin in self.derived:
            self.last_next[twin][...] = state[twin]


class EpisodicReturn:
    """Store each step's discounted return-to-go as the float32 field ``name``.

    Until its episode ends a step holds ``default_return``; when the episode ends every one of
    its readable steps is set to sum_i gamma^i r_{t+i} up to the end (rewards clipped to ``clip``
    first, if given), as alf's ``record_episodic_return``. Steps already written to disk are
    patched in place: this is the only field diskreplay ever rewrites after adding it, so a reader
    may see a step's value go from ``default_return`` to its final return.
    """

    def __init__(self, gamma: float = 0.99, reward: str = "reward", name: str = "return",
                 default_return: float = 0.0, clip: tuple[float, float] | None = None):
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"EpisodicReturn gamma must be in [0, 1], got {gamma!r}")
        self.gamma, self.reward, self.name = float(gamma), reward, name
        self.default_return, self.clip = float(default_return), clip

    def to_json(self) -> dict[str, Any]:
        """These settings as JSON-ready data (stored in the buffer's config)."""
        return {"gamma": self.gamma, "reward": self.reward, "name": self.name,
                "default_return": self.default_return, "clip": list(self.clip) if self.clip else None}

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> EpisodicReturn:
        """The settings `to_json` gave."""
        return cls(spec["gamma"], spec["reward"], spec["name"], spec["default_return"],
                   tuple(spec["clip"]) if spec["clip"] else None)

    def field(self) -> Field:
        """The stored field of returns: one float32 per row."""
        return Field((), "float32")

    def fill(self, storage: RowStore, episodes: EpisodeIndex, lane: int, rows: dict[str, np.ndarray],
             ends: np.ndarray) -> None:
        """Before ``rows`` (the next steps of ``lane``) are stored: set their returns, and patch the
        steps of the episode they finish that were stored earlier. ``ends`` flags episode ends."""
        returns, _ = episodic_returns(rows[self.reward], ends, self.gamma, self.default_return, self.clip)
        rows[self.name] = returns.astype(np.float32)
        if not ends.any() or len(returns) > (storage.layout.lane_capacity or np.inf):
            return
        self._patch(storage, episodes, lane, int(storage.window()[1][lane]), float(returns[0]))

    def close(self, storage: RowStore, episodes: EpisodeIndex, lane: int, last: int) -> None:
        """The lane's episode is ended at its stored step ``last``: patch its returns."""
        self._patch(storage, episodes, lane, last + 1, 0.0)

    def _patch(self, storage: RowStore, episodes: EpisodeIndex, lane: int, end: int, after: float) -> None:
        """Set the returns of the stored steps ``[start, end)`` of the episode that step ``end``
        would continue (no end recorded at ``end - 1`` yet) to their discounted rewards followed
        by ``after`` (the return at ``end``)."""
        lo = int(storage.window()[0][lane])
        start = max(int(episodes.episode_start(np.array([lane]), np.array([end]))[0]), lo)
        if start >= end:
            return
        earlier = storage.gather(np.full(end - start, lane), np.arange(start, end), (self.reward,))
        rewards = earlier[self.reward].astype(np.float64)
        if self.clip is not None:
            rewards = np.clip(rewards, *self.clip)
        tail = discount_cumsum(np.append(rewards, after), self.gamma)[:-1]
        storage.update_rows(lane, start, {self.name: tail.astype(np.float32)})

    def mask(self, values: np.ndarray, episodes: EpisodeIndex, lane: np.ndarray, step: np.ndarray) -> None:
        """Set ``default_return`` where the step's episode has not ended (in the index read with
        the rows): a stored value there may come from rewards no commit holds yet."""
        open_ = episodes.next_end(lane, step) == NO_END
        if open_.any():
            values[open_] = self.default_return
