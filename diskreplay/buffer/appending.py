"""`Appender`: the writer's side of a buffer: steps of several lanes checked, then stored all or
nothing, with the episode index, derived fields and episodic returns kept in step, and the sampler
told of them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..episodes import RowView
from ..episodes.index import end_flags
from ..errors import SchemaError
from ..format.schema import Schema
from ..sampling.protocols import BaseSampler
from ..storage import BufferStorage
from .state import BufferState


class Appender:
    """Adds steps to a buffer's storage (and its ``derive_next`` side store). ``inputs``: the
    fields `add` and `extend` take (every field but a computed return); ``cut``: as `cut`."""

    def __init__(self, storage: BufferStorage, finals: BufferStorage | None, view: RowView, sampler: BaseSampler,
                 inputs: Schema, state: BufferState, cut: set[int]):
        self.storage, self.finals, self.view, self.sampler, self.state = storage, finals, view, sampler, state
        self.episodes, self.returns = view.episodes, view.returns
        self.inputs = inputs
        self.num_envs = storage.layout.num_envs
        self.cut = cut
        """Lanes whose open episode the last writer left: closed, as truncated, by their next rows."""
        lead = () if self.num_envs == 1 else (self.num_envs,)
        self._exact = [(name, (np.ndarray, field.dtype.type), field.dtype, lead + field.shape)
                       for name, field in inputs.items()]
        """Per input field: the types a value may have to be taken as is (an array, or a numpy
        scalar of the field's dtype), its dtype and the shape of one step of every lane."""
        self._staging = storage.writer  # None: a reader's (which never adds)
        # ragged and encoded frame fields are staged apart from the fixed fields (`BufferStorage.append`)
        self._short = finals is None and self.returns is None and not view.derived and not inputs.ragged

    def add(self, step: Mapping[str, Any], env_ids: Any) -> None:
        """One step of every lane (or of ``env_ids``): see `ReplayBuffer.add`."""
        if env_ids is None and self._short and not self.cut and self._is_exact(step):
            assert self._staging is not None  # `ReplayBuffer.add` checked the buffer is writable
            staged = self._staging.steps.append(step)
            if staged >= 0:
                return self._staged_step(step, staged)
        if self.num_envs == 1 and env_ids is None:
            rows = self.inputs.rows(step, lead=())
            self.append(np.array([0]), {k: v[None, None] for k, v in rows.items()}, 1)
            return
        lanes = self._env_ids(env_ids)
        rows = self.inputs.rows(step, lead=(len(lanes),))
        self.append(lanes, {k: v[None] for k, v in rows.items()}, 1)

    def _is_exact(self, step: Mapping[str, Any]) -> bool:
        """Whether ``step`` has every field and nothing else, each an array (or numpy scalar) of
        exactly its stored dtype and shape: nothing to cast, `Schema.rows` would pass it as is."""
        if len(step) != len(self._exact):
            return False
        for name, types, dtype, shape in self._exact:
            value: Any = step.get(name)
            if type(value) not in types or value.shape != shape or (value.dtype is not dtype and value.dtype != dtype):
                return False
        return True

    def _staged_step(self, rows: Mapping[str, Any], step: int) -> None:
        """Tell the episode index and the sampler of ``step``, which the short way staged
        (`StepStaging.append`) from ``rows`` (checked by `_is_exact`); undone if that fails."""
        try:
            for name in self.episodes.end_fields:
                # one lane: a numpy bool scalar or 0-d array, truth-tested at no numpy call's cost
                if rows[name] if self.num_envs == 1 else np.count_nonzero(rows[name]):
                    for lane in np.flatnonzero(end_flags(rows, self.episodes.end_fields)).tolist():
                        self.episodes.add_end(lane, step)
                    break
            self.sampler.on_append_lanes(self.num_envs, step, step + 1)
        except BaseException:
            self._undo([(lane, step, 0, {}) for lane in range(self.num_envs)], 1)
            raise

    def extend(self, data: Mapping[str, Any], env_ids: Any) -> None:
        """N steps of every lane (or of ``env_ids``), time-major: see `ReplayBuffer.extend`."""
        if not isinstance(data, Mapping):
            raise SchemaError(f"extend expects a mapping of field name to array (fields {list(self.inputs.fields)}), "
                              f"got {type(data).__name__}")
        count = _leading(data, self.inputs)
        if self.num_envs == 1 and env_ids is None:
            rows = self.inputs.rows(data, lead=(count,))
            self.append(np.array([0]), {k: v[:, None] for k, v in rows.items()}, count)
            return
        lanes = self._env_ids(env_ids)
        self.append(lanes, self.inputs.rows(data, lead=(count, len(lanes))), count)

    def _env_ids(self, env_ids: Any) -> np.ndarray:
        if env_ids is None:
            return np.arange(self.num_envs)
        ids = np.atleast_1d(np.asarray(env_ids))
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise SchemaError(f"env_ids: expected a 1-D array of ints, got {ids.dtype} shaped {ids.shape}")
        bad = ids[(ids < 0) | (ids >= self.num_envs)]
        if bad.size:
            raise SchemaError(f"env_ids: expected ids in [0, {self.num_envs}), got {bad.tolist()}")
        if np.unique(ids).size != ids.size:
            raise SchemaError(f"env_ids: expected distinct ids, got {ids.tolist()}")
        return ids.astype(np.int64)

    def flush(self, durable: bool, last: bool = False) -> None:
        """Write every staged row and commit, with the state (see `ReplayBuffer.flush`);
        ``last``: the writer's last commit, followed by the shard index tables."""
        self.episodes.prune(self.storage.window()[0])
        self.storage.flush(durable, self.state.for_commit(), side=self.finals)
        self.state.committed()
        for storage in self.storages() if last else ():
            storage.write_shard_tables()

    def storages(self) -> list[BufferStorage]:
        """The main storage, then the side store of ``derive_next`` (if any)."""
        return [self.storage] + ([self.finals] if self.finals is not None else [])

    def append(self, lanes: np.ndarray, rows: dict[str, np.ndarray], count: int) -> None:
        """Store ``count`` steps of each lane (``rows[name]`` shaped ``[count, len(lanes), ...]``),
        all or nothing: a failure undoes every lane."""
        finals, derived = self.finals, self.view.derived
        done: list[tuple[int, int, int, dict[str, np.ndarray]]] = []  # (lane, start, finals start, newest next_*)
        stored: list[tuple[int, int, int]] = []
        for storage in self.storages():
            storage.settle()
        try:
            for j, lane in enumerate(lanes.tolist()):
                lane_rows = {k: v[:, j] for k, v in rows.items()}
                if lane in self.cut:
                    self.close_cut_episode(lane)
                if self.returns is not None:  # may patch stored returns: masked until committed
                    self.returns.fill(self.storage, self.episodes, lane, lane_rows, self.episodes.end_flags(lane_rows))
                done.append((lane, int(self.storage.total[lane]), int(finals.total[lane]) if finals else 0,
                             {twin: value[lane].copy() for twin, value in self.view.last_next.items()}
                             if derived else {}))
                first, end = self.storage.append(lane, {k: v for k, v in lane_rows.items() if k not in derived}
                                                 if derived else lane_rows, count)
                stored.append((lane, first, end))
                # all rows, also those a ring drops at once: an end just before the oldest kept step
                # tells that the kept steps start an episode
                self.episodes.on_append(lane, end - count, lane_rows)
                self.view.record(lane, end - count, lane_rows)
            for storage in self.storages():
                storage.write_behind()
        except BaseException:
            self._undo(done, count)
            raise
        for lane, first, end in stored:
            self.sampler.on_append(lane, first, end)

    def _undo(self, done: list[tuple[int, int, int, dict[str, np.ndarray]]], count: int) -> None:
        finals = self.finals
        for lane, start, finals_start, newest in reversed(done):
            self.storage.unappend(lane, start, start + count)
            if finals is not None and finals.total[lane] > finals_start:
                finals.unappend(lane, finals_start, int(finals.total[lane]))
            self.episodes.rewind(lane, start)
            for twin, value in newest.items():
                self.view.last_next[twin][lane] = value

    def close_cut_episode(self, lane: int) -> None:
        """First rows of ``lane`` since this writer opened the buffer: end the episode the last
        writer left open, as truncated (episode index, a ``truncated`` flag, final next_* and
        returns). All or nothing."""
        last = int(self.storage.total[lane]) - 1
        ends = self.episodes.ends(lane)
        if last >= 0 and not (len(ends) and ends[-1] == last) and self.episodes.enabled:
            readable = last >= int(self.storage.window()[0][lane])
            if readable and self.returns is not None:
                self.returns.close(self.storage, self.episodes, lane, last)
            flag = readable and "truncated" in self.episodes.end_fields
            if flag:
                self.storage.update_rows(lane, last, {"truncated": np.ones(1, bool)})
            try:
                self.view.record_final(lane)
            except BaseException:
                if flag:  # the slot is pinned by the update above: no I/O, cannot fail
                    self.storage.update_rows(lane, last, {"truncated": np.zeros(1, bool)})
                raise
            self.episodes.add_end(lane, last)
        self.cut.discard(lane)

    def clear(self) -> None:
        """Forget every row (see `ReplayBuffer.clear`)."""
        for lane in range(self.storage.layout.num_envs):
            if self.episodes.enabled and int(self.storage.total[lane]):
                self.close_cut_episode(lane)
        self.storage.retire_all()
        self.episodes.prune(self.storage.window()[0])


def _leading(data: Mapping[str, Any], schema: Schema) -> int:
    """N, the steps in an extend: the leading size most fields with a step axis agree on."""
    sizes = {name: int(np.shape(data[name])[0]) for name, field in schema.items()
             if name in data and not field.ragged and np.ndim(data[name]) > len(field.shape)}
    lead = schema.lead_of({name: data[name] for name in schema.ragged if name in data}) if not sizes else ()
    if lead:
        return lead[0]
    if not sizes:
        raise SchemaError(f"extend expects arrays with a leading step axis (N, *field.shape); got shapes "
                          f"{ {name: _shape(value) for name, value in data.items()} }")
    counts = list(sizes.values())
    return max(counts, key=counts.count)  # the odd field out is then named by the schema check


def _shape(value: Any) -> Any:
    """``value``'s shape for a message; a list or tuple (a ragged field's rows) by its length."""
    return f"{type(value).__name__} of {len(value)}" if isinstance(value, (list, tuple)) else np.shape(value)
