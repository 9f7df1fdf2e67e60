"""The episode index: per env lane, the steps at which episodes ended, kept in RAM.

An episode ends at step ``t`` of a lane when any of the buffer's *end fields* (by default
``done``, or ``terminated`` and ``truncated``) is true at ``t``. Only those end steps are stored
(one int64 per episode), so the index stays small next to the data and is saved with every
commit. Everything else — where the episode of a step began, how many steps remain, which
windows of length L fit inside one episode — is derived with ``searchsorted``.

A ring overwrites the oldest steps: an episode whose first steps are gone is *partial*. It is
still listed, starting at the oldest readable step, with ``complete=False`` when its true start
was overwritten (or when it has not ended yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..build import load_extension
from ..errors import SchemaError
from ..format.journal import LOG_CHUNK, JournalChange, JournalContent
from ..format.schema import Field

_search = load_extension("diskreplay.episodes._search")  # built from _search.c where a C compiler was found

NO_END = np.iinfo(np.int64).max
END_RECORD = np.dtype([("lane", "<i8"), ("step", "<i8")])
"""A journal record of the episode index: an episode of ``lane`` ended at ``step``."""


def episode_end_fields(fields: Mapping[str, Field], episode_end: str | tuple[str, ...] | None = "auto"
                       ) -> tuple[str, ...]:
    """The scalar bool fields whose OR ends an episode: ``episode_end`` checked, or for ``"auto"``
    ``done``, else ``terminated`` and ``truncated`` (those present); ``None``: none.

    Raises SchemaError for a name that is not a scalar bool field."""
    def is_flag(name: str) -> bool:
        return name in fields and fields[name].dtype == np.bool_ and fields[name].shape == ()

    if episode_end is None:
        return ()
    if episode_end == "auto":
        return tuple(filter(is_flag, ("done",) if "done" in fields else ("terminated", "truncated")))
    names = (episode_end,) if isinstance(episode_end, str) else tuple(episode_end)
    for name in names:
        if not is_flag(name):
            raise SchemaError(f"episode_end: expected scalar bool fields, got {name!r} ({fields.get(name)})")
    return names


def end_flags(rows: Mapping[str, np.ndarray], end_fields: tuple[str, ...]) -> np.ndarray:
    """Per row, whether it ends an episode: the OR of the ``end_fields`` (at least one)."""
    flags = np.asarray(rows[end_fields[0]], dtype=bool)
    for name in end_fields[1:]:
        flags = flags | rows[name]
    return flags


@dataclass
class EpisodeTable:
    """One row per episode (readable part): lane, first step, length, complete?"""

    lane: np.ndarray
    start: np.ndarray
    length: np.ndarray
    complete: np.ndarray

    def __len__(self) -> int:
        """Episodes in the table."""
        return len(self.lane)

    def steps_of(self, k: int) -> tuple[int, np.ndarray]:
        """The lane and the readable steps of episode ``k`` (negative counts from the end).
        Raises IndexError for a ``k`` out of range."""
        if not -len(self) <= k < len(self):
            raise IndexError(f"episode {k} out of range: the buffer lists {len(self)} episodes")
        start = int(self.start[k])
        return int(self.lane[k]), np.arange(start, start + int(self.length[k]))


_NO_ARRAY = np.zeros(0, dtype=np.int64)
_NO_ARRAY.flags.writeable = False


def _searchable(lane: np.ndarray, step: np.ndarray) -> bool:
    """Whether `_search` takes these steps: it was built, and they are one row of (lane, step) pairs."""
    return _search is not None and step.ndim == 1 and lane.shape == step.shape


def _int64s(values: np.ndarray) -> np.ndarray:
    """``values`` as a C-contiguous int64 array (itself, where it is one)."""
    return np.ascontiguousarray(values, dtype=np.int64)


def _bounds(ends: np.ndarray, starts: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(episode_start, next_end)`` of steps >= 0 from a lane's ``[-1, *ends, NO_END]`` and the
    matching episode starts (see `EpisodeIndex._store`)."""
    after = ends.searchsorted(step)  # the first end >= step is at `after` (-1 comes before every step)
    return starts.take(after), ends.take(after)


class EpisodeIndex:
    """End steps per lane, appended as rows arrive. Plain arrays: trivially saved.

    A commit saves the ends added since the last one, as ``(lane, step)`` records of a journal
    whose base is the ends a ring still holds; a commit writes a new base once the journal holds
    more than twice those (and a few thousand) records.
    """

    def __init__(self, num_envs: int, end_fields: tuple[str, ...]):
        self.end_fields = end_fields
        self._ends: list[np.ndarray] = [_NO_ARRAY] * num_envs
        self._starts: list[np.ndarray] = [_NO_ARRAY] * num_envs
        self._at = np.zeros(2 * num_envs, dtype=np.int64)  # the addresses of the lanes' arrays (`_search`)
        self._count = np.zeros(num_envs, dtype=np.int64)
        for lane in range(num_envs):
            self._store(lane, np.zeros(0, dtype=np.int64))
        self._pruned = np.zeros(num_envs, dtype=np.int64)
        self._saved: np.ndarray | None = None  # per lane, ends the journal holds; None: write a base
        self._journal_size = 0  # records and base ends in the journal
        self._base_pruned: list[int] = []
        self._staged: tuple[JournalChange, np.ndarray] | None = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (pickled or copied, even shallowly) owns its arrays and searches them, not those
        of the index it was copied from."""
        self.__dict__.update(state)
        self._ends, self._starts = [a.copy() for a in self._ends], [a.copy() for a in self._starts]
        self._count = self._count.copy()
        self._at = np.array([values.ctypes.data for values in (*self._ends, *self._starts)], dtype=np.int64)

    @property
    def enabled(self) -> bool:
        """Whether episodes are tracked (some end fields are given)."""
        return bool(self.end_fields)

    def ends(self, lane: int) -> np.ndarray:
        """Sorted end steps of one lane (a view)."""
        return self._ends[lane][1: self._count[lane] + 1]

    def _bracketed(self, lane: int) -> np.ndarray:
        """The lane's ends between -1 and NO_END (a view): ``[-1, *ends, NO_END]``."""
        return self._ends[lane][: self._count[lane] + 2]

    def on_append(self, lane: int, first: int, rows: dict[str, np.ndarray]) -> None:
        """Record the episode ends among steps ``first, first+1, ...`` (``rows`` of one lane)."""
        if not self.end_fields:
            return
        flags = self.end_flags(rows)
        if not flags.any():
            return
        new = first + np.flatnonzero(flags)
        ends = self.ends(lane)
        keep = np.searchsorted(ends, new[0])
        self._store(lane, np.concatenate([ends[:keep], new]))

    def add_end(self, lane: int, step: int) -> None:
        """Record an episode end at ``step`` (after every recorded end of the lane)."""
        count = int(self._count[lane])
        if count + 3 > len(self._ends[lane]):
            return self._store(lane, np.append(self.ends(lane), np.int64(step)))
        self._ends[lane][count + 1:count + 3] = step, NO_END  # in place: as `_store` would
        self._starts[lane][count + 2] = step + 1
        self._count[lane] = count + 1

    def rewind(self, lane: int, step: int) -> None:
        """Forget the lane's ends at or after ``step`` (steps a failed call had added)."""
        self._count[lane] = np.searchsorted(self.ends(lane), step)
        self._ends[lane][self._count[lane] + 1] = NO_END

    def end_flags(self, rows: Mapping[str, np.ndarray]) -> np.ndarray:
        """Per row, whether it ends an episode (OR of the end fields)."""
        return end_flags(rows, self.end_fields)

    def _store(self, lane: int, ends: np.ndarray) -> None:
        """Keep ``ends`` as the lane's ``[-1, *ends, NO_END]`` (`_bracketed`) and, at the same
        places plus one, the first step of the episode each end closes (``[_, 0, *(ends + 1)]``)."""
        count = len(ends)
        if count + 2 > len(self._ends[lane]):
            size = max(2 * len(self._ends[lane]), count + 2, 16)
            self._ends[lane], self._starts[lane] = np.zeros(size, dtype=np.int64), np.zeros(size, dtype=np.int64)
            self._at[[lane, len(self._count) + lane]] = self._ends[lane].ctypes.data, self._starts[lane].ctypes.data
        bracketed, starts = self._ends[lane], self._starts[lane]
        bracketed[0], bracketed[1:count + 1], bracketed[count + 1] = -1, ends, NO_END
        starts[1], starts[2:count + 2] = 0, ends + 1
        self._count[lane] = count

    def prune(self, lo: np.ndarray) -> None:
        """Drop ends older than each lane's oldest readable step (keeping one before it)."""
        for lane, first in enumerate(lo.tolist()):
            ends = self.ends(lane)
            cut = max(int(np.searchsorted(ends, first)) - 1, 0)
            if cut > 1024 and cut * 2 > len(ends):
                self._store(lane, ends[cut:].copy())
                self._pruned[lane] += cut

    def ends_between(self, lane: int, first: int, end: int) -> np.ndarray:
        """End steps in ``[first, end)`` of one lane."""
        ends = self.ends(lane)
        return ends[np.searchsorted(ends, first):np.searchsorted(ends, end)]

    def end_ordinal(self, lane: np.ndarray, step: np.ndarray) -> np.ndarray:
        """How many episodes of the lane ended before ``step`` (for an end step: its ordinal)."""
        if len(self._count) == 1:  # one lane: no grouping
            ordinal: np.ndarray = self._pruned[0] + np.searchsorted(self.ends(0), step)
            return ordinal
        out = np.zeros(step.shape, dtype=np.int64)
        for e in np.unique(lane).tolist():
            sel = lane == e
            out[sel] = self._pruned[e] + np.searchsorted(self.ends(e), step[sel])
        return out

    def last_ends(self) -> np.ndarray:
        """Per lane, the newest end step (-1 where none is recorded)."""
        return np.array([int(self.ends(lane)[-1]) if self._count[lane] else -1 for lane in range(len(self._count))])

    def ended(self) -> np.ndarray:
        """Episodes ended so far per lane (ordinals of the next ends)."""
        return self._pruned + self._count

    def next_end(self, lane: np.ndarray, step: np.ndarray) -> np.ndarray:
        """The first end step >= ``step`` (>= 0) in the same lane (NO_END if the episode is open)."""
        return self.bounds(lane, step)[1]

    def episode_start(self, lane: np.ndarray, step: np.ndarray) -> np.ndarray:
        """The first step of the episode holding ``step`` (>= 0; may be overwritten in a ring)."""
        return self.bounds(lane, step)[0]

    def bounds(self, lane: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(episode_start, next_end)`` of each step (int64, shaped like ``step``; steps >= 0),
        from one search of each lane's ends."""
        if _searchable(lane, step):
            start, end = np.empty(len(step), dtype=np.int64), np.empty(len(step), dtype=np.int64)
            _search.bounds(self._at, self._count, _int64s(lane), _int64s(step), start, end)
            return start, end
        if len(self._count) == 1:  # one lane: no grouping
            return _bounds(self._bracketed(0), self._starts[0], step)
        start, end = np.zeros(step.shape, dtype=np.int64), np.full(step.shape, NO_END, dtype=np.int64)
        for e in np.unique(lane).tolist():
            sel = lane == e
            start[sel], end[sel] = _bounds(self._bracketed(e), self._starts[e], step[sel])
        return start, end

    def stack_windows(self, lane: np.ndarray, step: np.ndarray, offsets: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                      clamp_last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The steps ``step + offsets`` of each step's window (int64 ``[len(step), len(offsets)]``),
        raised to the first readable step of its episode, ``max(start, lo[lane])``; with
        ``clamp_last`` the last column lowered to its last readable step, ``min(end, hi[lane] - 1)``.
        Then, with ``clamp_last``, the rows whose last readable step is the step itself (int64
        ``[k]``) and whether that step ends its episode (bool ``[k]``; else it is the lane's newest).
        ``lo``, ``hi``: per lane, the readable steps ``[lo, hi)`` (int64 ``[num_envs]``)."""
        if _searchable(lane, step):
            window, kept, ended = (np.empty((len(step), len(offsets)), dtype=np.int64),
                                   np.empty(len(step), dtype=np.int64), np.empty(len(step), dtype=bool))
            found = _search.stack_windows(self._at, self._count, _int64s(lane), _int64s(step), _int64s(lo),
                                          _int64s(hi), _int64s(offsets), clamp_last, window, kept, ended)
            return window, kept[:found], ended[:found]
        start, end = self.bounds(lane, step)
        window = step[:, None] + offsets
        np.maximum(window, np.maximum(start, lo[lane])[:, None], out=window)
        if not clamp_last:
            return window, _NO_ARRAY, _NO_ARRAY.astype(bool)
        last = np.minimum(end, hi[lane] - 1)
        np.minimum(window[:, -1], last, out=window[:, -1])
        kept = np.flatnonzero(last == step)
        return window, kept, end[kept] == step[kept]

    def table(self, lo: np.ndarray, hi: np.ndarray) -> EpisodeTable:
        """Every episode with readable steps, lane by lane in time order."""
        parts = [self._lane_table(e, lo_e, hi_e) for e, (lo_e, hi_e) in enumerate(zip(lo.tolist(), hi.tolist()))]
        if len(parts) == 1:
            return EpisodeTable(*parts[0])
        return EpisodeTable(*(np.concatenate([p[i] for p in parts]) for i in range(4)))

    def _lane_table(self, lane: int, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        if hi <= lo:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, empty.astype(bool)
        ends = self.ends(lane)
        a, b = np.searchsorted(ends, (lo, hi)).tolist()
        n = b - a  # episodes ending inside [lo, hi); one more segment follows the last end
        bounds = np.empty(n + 2, dtype=np.int64)
        bounds[0], bounds[n + 1] = lo, hi
        np.add(ends[a:b], 1, out=bounds[1:n + 1])
        length = bounds[1:] - bounds[:-1]
        complete = np.ones(n + 1, dtype=bool)
        # the first episode began at lo (its start is readable) iff step lo - 1 ended an episode
        complete[0] = lo == 0 or (a > 0 and int(ends[a - 1]) == lo - 1)
        complete[n] = False  # not ended yet
        keep = n + 1 if length[n] > 0 else n  # an end at hi - 1 leaves an empty last segment
        return np.full(keep, lane, np.int64), bounds[:keep], length[:keep], complete[:keep]

    def window_starts(self, lo: np.ndarray, hi: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Segments of valid slice starts: (lane, first start, count) per episode with room for
        ``seq_len`` consecutive steps inside one episode and inside the readable window."""
        table = self.table(lo, hi)
        count = np.maximum(table.length - seq_len + 1, 0)
        keep = count > 0
        return table.lane[keep], table.start[keep], count[keep]

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the end fields, per-lane ``count`` and ``pruned`` (int64 ``[num_envs]``) and
        every lane's end steps concatenated lane by lane (``ends``, int64 ``[count.sum()]``)."""
        return {"end_fields": list(self.end_fields), "count": self._count.copy(), "pruned": self._pruned.copy(),
                "ends": np.concatenate([self.ends(e) for e in range(len(self._count))])}

    def commit_state(self) -> dict[str, Any]:
        """`state_dict` for a commit: the ends added since the last commit, as a journal change;
        ``base_pruned``: per lane, the ordinal of the first end in the journal's base; ``ended``:
        per lane, episodes ended so far."""
        if not self.end_fields:
            return self.state_dict()
        ended, saved = self.ended(), self._saved
        if (saved is None or (self._pruned > saved).any() or (ended < saved).any()
                or self._journal_size > 2 * int(self._count.sum()) + LOG_CHUNK):
            lanes = np.repeat(np.arange(len(self._count)), self._count)
            change = JournalChange(np.zeros(0, END_RECORD), np.stack([lanes, self._all_ends()], 1).reshape(-1))
            self._base_pruned = self._pruned.tolist()
        else:
            grew = np.flatnonzero(ended > saved).tolist()
            records = np.zeros(int((ended - saved).sum()), END_RECORD)
            records["lane"] = np.repeat(grew, (ended - saved)[grew])
            records["step"] = np.concatenate([self.ends(e)[saved[e] - self._pruned[e]:] for e in grew]
                                             or [np.zeros(0, np.int64)])
            change = JournalChange(records)
        self._staged = (change, ended)
        return {"end_fields": list(self.end_fields), "base_pruned": self._base_pruned, "ended": ended.tolist(),
                "ends": change}

    def committed(self) -> None:
        """The last `commit_state` was committed."""
        if self._staged is not None and self.end_fields:
            change, ended = self._staged
            base = change.base
            self._journal_size = len(change.records) + (len(base) // 2 if base is not None else self._journal_size)
            self._saved, self._staged = ended, None

    def _all_ends(self) -> np.ndarray:
        return np.concatenate([self.ends(e) for e in range(len(self._count))])

    def check_state(self, state: Any, total: np.ndarray) -> dict[str, Any]:
        """``state`` (from `state_dict`, or a commit's journal made into that form once, here) if
        it is an index of these end fields whose ends, per lane, are strictly increasing steps
        below ``total``; else raise ValueError."""
        if not isinstance(state, dict):
            raise ValueError(f"'episodes': expected a mapping, got {type(state).__name__}")
        plain = self._plain(state)
        if list(plain.get("end_fields", [])) != list(self.end_fields):
            raise ValueError(f"'episodes.end_fields': expected {list(self.end_fields)}, "
                             f"got {plain.get('end_fields')!r}")
        lanes = len(self._count)
        count, ends = np.asarray(plain.get("count")), np.asarray(plain.get("ends"))
        pruned = np.asarray(plain.get("pruned", np.zeros(lanes, np.int64)))
        for name, value in (("count", count), ("pruned", pruned)):
            if value.shape != (lanes,) or value.dtype.kind not in "iu" or (value < 0).any():
                raise ValueError(f"'episodes.{name}': expected {lanes} ints >= 0, "
                                 f"got {value.dtype} shaped {value.shape}")
        if ends.ndim != 1 or ends.dtype.kind not in "iu" or len(ends) != int(count.sum()):
            raise ValueError(f"'episodes.ends': expected {int(count.sum())} ints (the counts' sum), got "
                             f"{ends.dtype} shaped {ends.shape}")
        offsets = np.concatenate([[0], np.cumsum(count)])
        for lane in range(lanes):
            own = ends[offsets[lane]:offsets[lane + 1]]
            if len(own) and (own[0] < 0 or own[-1] >= total[lane] or (np.diff(own) <= 0).any()):
                raise ValueError(f"'episodes.ends' of lane {lane}: expected increasing steps in "
                                 f"[0, {int(total[lane])}), got {own[:5].tolist()}...")
        return plain

    def _plain(self, state: dict[str, Any]) -> dict[str, Any]:
        """A commit's state (a journal) as a `state_dict` marked ``from_journal``. Raises ValueError
        for a journal that is not one of this index."""
        journal = state.get("ends")
        if not isinstance(journal, JournalContent):
            return state
        lanes = len(self._count)
        if journal.base.dtype != np.int64 or len(journal.base) % 2 or journal.records.dtype != END_RECORD:
            raise ValueError(f"'episodes.ends' (journal): expected int64 (lane, step) pairs, got base "
                             f"{journal.base.dtype} shaped {journal.base.shape} and records {journal.records.dtype}")
        pairs = journal.base.reshape(-1, 2)
        lane = np.concatenate([pairs[:, 0], journal.records["lane"]])
        if len(lane) and not (0 <= lane.min() and lane.max() < lanes):
            raise ValueError(f"'episodes.ends' (journal): expected lanes in [0, {lanes}), got {int(lane.min())} "
                             f"to {int(lane.max())}")
        order = np.argsort(lane, kind="stable")
        count = np.bincount(lane, minlength=lanes)
        pruned = np.asarray(state.get("base_pruned"))
        ended = np.asarray(state.get("ended"))
        if pruned.shape != (lanes,) or ended.shape != (lanes,) or not np.array_equal(pruned + count, ended):
            raise ValueError(f"'episodes.ended': expected base_pruned plus the journal's ends per lane "
                             f"({(pruned + count).tolist() if pruned.shape == count.shape else pruned.tolist()}), "
                             f"got {ended.tolist()}")
        steps = np.concatenate([pairs[:, 1], journal.records["step"]])[order]
        return {"end_fields": state.get("end_fields"), "count": count, "pruned": pruned, "ends": steps,
                "from_journal": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict` or a commit's state (see `check_state`)."""
        state = self._plain(state)  # nothing to do for one `check_state` returned
        if state.get("from_journal"):
            self._saved, self._journal_size = np.asarray(state["count"]) + state["pruned"], len(state["ends"])
            self._base_pruned = np.asarray(state["pruned"]).tolist()
        else:
            self._saved = None
        self._pruned = np.asarray(state.get("pruned", np.zeros_like(self._count)), dtype=np.int64).copy()
        offsets = np.concatenate([[0], np.cumsum(state["count"])])
        for e in range(len(self._count)):
            self._store(e, np.asarray(state["ends"][offsets[e]:offsets[e + 1]], dtype=np.int64))
