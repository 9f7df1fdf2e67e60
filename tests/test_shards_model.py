"""Model-based stateful test of a sharded buffer: hypothesis drives one writer per shard (each
extended, flushed, closed, crashed, cleared and reopened on its own) and a learner reading the
union (opened, refreshed, sampling, updating priorities, its state saved and loaded into a new
learner), and checks after every step that the learner shows each shard's rows as of the commit it
adopted, per the plain per-shard model of ``test_model.BufferModel``.

Serial numbers are unique over all shards (shard s counts from ``s * SHARD_SERIALS``), so a row
shown under the wrong shard, lane or step is caught by its values. Examples and steps per example
come from the same hypothesis profiles as ``test_model.py`` (CI's tries 150 sequences here).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np
import pytest
from conftest import model_test_settings, writes_done
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_model import (
    BufferModel,
    Layout,
    View,
    assert_rows,
    ends_spec,
    ids_of,
    make_sampler,
    picks,
    table_rows,
)

import diskreplay as dr
from diskreplay.audit.verify import verify

pytestmark = pytest.mark.usefixtures("no_fsync")
SHARD_SERIALS = 10**6
MAX_SHARDS = 3

layouts = st.builds(
    Layout,
    num_envs=st.integers(1, 2),
    lane_cap=st.sampled_from([None, 5, 8, 13]),
    chunk_rows=st.sampled_from([2, 3, 4, 8]),
    compression=st.sampled_from([None, "zstd"]),
    derive_next=st.booleans(),
    sampler=st.sampled_from(["uniform", "prioritized"]),
    frames=st.just(False),
    small_cache=st.booleans(),
)
shard_ids = st.integers(0, MAX_SHARDS - 1)
"""The shard a rule acts on (taken modulo the shards the buffer has)."""


class ShardsMachine(RuleBasedStateMachine):
    """Writers of every shard, a learner on the union and one model per shard, in step."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="diskreplay-shards-model-")
        self.url = os.path.join(self.dir, "buf")
        self.writers: list[dr.ReplayBuffer | None] = []
        self.models: list[BufferModel] = []
        self.learner: dr.ReplayBuffer | None = None
        self.views: list[View] = []  # per shard, the committed view the learner adopted

    @initialize(layout=layouts, shards=st.integers(2, MAX_SHARDS))
    def create(self, layout: Layout, shards: int) -> None:
        self.layout, self.shards, n = layout, shards, layout.num_envs
        options = {k: v for k, v in layout.options().items() if k != "cache_bytes"}
        dr.ReplayBuffer.create(self.url, shards=shards, **options).close()
        self.models = [BufferModel(layout) for _ in range(shards)]
        for s, model in enumerate(self.models):
            model.counter = s * SHARD_SERIALS
        self.writers = [None] * shards
        self.lanes = shards * n  # the union's lanes: shard s's lane e is lane s * n + e
        self.new_learner(seed=0)

    # -- writers

    def writer(self, shard: int) -> dr.ReplayBuffer:
        """Shard ``shard``'s writer, opened if it is not (its lanes' open episodes then end)."""
        s = shard % self.shards
        if self.writers[s] is None:
            self.writers[s] = dr.ReplayBuffer.open_shard(self.url, s, **self.layout.writer_cache())
            self.models[s].restart()
        return self.writers[s]

    @rule(shard=shard_ids, pick=picks, ends=ends_spec, sizes=st.lists(st.integers(1, 30), min_size=1, max_size=3),
          then=st.sampled_from(["", "flush", "flush and refresh"]))
    def extend(self, shard: int, pick: list[int] | None, ends: tuple[int, str], sizes: list[int], then: str) -> None:
        """One to three extends of the picked lanes of a shard, then perhaps a flush, and the
        learner's refresh (swarm-chosen rules rarely put a commit between two refreshes)."""
        buf, model = self.writer(shard), self.models[shard % self.shards]
        lanes = [e for e in dict.fromkeys(pick or []) if e < self.layout.num_envs] or list(range(self.layout.num_envs))
        env_ids = None if len(lanes) == self.layout.num_envs and pick is None else lanes
        for n in sizes:
            rows, serial = model.new_rows(n, lanes, ends)
            if self.layout.num_envs == 1 and env_ids is None:
                buf.extend({k: v[:, 0] for k, v in rows.items()})
            else:
                buf.extend(rows, env_ids=env_ids)
            model.store(lanes, rows, serial)
        if then:
            self.flush(shard)
        if then == "flush and refresh":
            self.refresh()

    @rule(shard=shard_ids)
    def flush(self, shard: int) -> None:
        self.writer(shard).flush()
        self.models[shard % self.shards].flush()

    @rule(shard=shard_ids)
    def clear(self, shard: int) -> None:
        self.writer(shard).clear()
        self.models[shard % self.shards].clear()

    @rule(shard=shard_ids)
    def close(self, shard: int) -> None:
        s = shard % self.shards
        if self.writers[s] is not None:
            self.writers[s].close()
            self.writers[s] = None
            self.models[s].flush()

    @rule(shard=shard_ids)
    def crash_and_reopen(self, shard: int) -> None:
        """Shard ``shard``'s writer dies without flushing (its lock released, as a dead process's
        is taken over); the shard opens again as it was last committed."""
        s = shard % self.shards
        buf, model = self.writer(s), self.models[s]
        buf._release()
        bound = model.windows(model.staged)[0]
        model.crash()
        self.writers[s] = buf = dr.ReplayBuffer.open_shard(self.url, s, **self.layout.writer_cache())
        model.reopened(*buf.window(), bound)

    # -- the learner

    def writes_done(self) -> None:
        for buf in self.writers:
            if buf is not None:
                writes_done(buf)

    def all_committed(self) -> bool:
        """Whether no writer has staged anything since its last commit (a ring writer that has
        staged rows may have committed a raised lower bound since: no exact lower bound then)."""
        return all(model.staged == model.committed for model in self.models)

    def adopt_all(self) -> None:
        self.views = [model.committed.copy() for model in self.models]

    def open_learner(self, seed: int) -> dr.ReplayBuffer:
        # a small retry budget: a draw from a window whose rows a writer retired waits that long for new ones
        return dr.ReplayBuffer.open(self.url, "r", sampler=make_sampler(self.layout.sampler), seed=seed,
                                    retry=dr.RetryPolicy(budget_s=0.5), **self.layout.cache(3 * self.shards))

    @rule(seed=st.integers(0, 2**16))
    def new_learner(self, seed: int) -> None:
        self.writes_done()
        if self.learner is not None:
            self.learner.close()
        self.learner = self.open_learner(seed)
        self.adopt_all()
        self.check_learner(exact=self.all_committed())

    @rule()
    def refresh(self) -> None:
        self.writes_done()
        self.learner.refresh()
        self.adopt_all()
        self.check_learner(exact=self.all_committed())

    @rule(batch=st.integers(1, 48))
    def sample(self, batch: int) -> None:
        """A batch of the learner's rows; with none (a writer retires rows it is about to write over:
        a ring's, or cleared rows sharing a chunk with new ones), of the newest commits', adopted
        first; `EmptyBufferError` only where those have none either."""
        try:
            got = self.learner.sample(batch)
        except dr.EmptyBufferError:
            lo, hi = self.window()
            assert not (hi > lo).any(), ("no rows drawn from a window with rows", lo, hi)
            return
        self.check_batch(got, *self.window())

    @rule(batch=st.integers(1, 16), seq_len=st.integers(1, 4), pad=st.booleans())
    def sample_slices(self, batch: int, seq_len: int, pad: bool) -> None:
        """Slices of consecutive steps of one episode of one shard's lane (``pad``: its last step
        repeated past its end)."""
        try:
            got = self.learner.sample(batch, seq_len=seq_len, pad=pad)
        except dr.EmptyBufferError:
            episodes = self.episodes(*self.window())
            assert not any(length >= (1 if pad else seq_len) for _, _, length, _ in episodes), \
                ("no slice drawn from episodes long enough", episodes)
            return
        lo, hi = self.window()
        episodes = self.episodes(lo, hi)
        ids, mask = got["index"], got["mask"] if pad else np.ones(got["index"].shape, bool)
        lane, step = ids[:, 0] % self.lanes, ids[:, 0] // self.lanes
        for b in range(batch):
            _, first, length, _ = next(e for e in episodes if e[0] == lane[b] and e[1] <= step[b] < e[1] + e[2])
            want = np.minimum(step[b] + np.arange(seq_len), first + length - 1)
            np.testing.assert_array_equal(ids[b], want * self.lanes + lane[b])
            np.testing.assert_array_equal(mask[b], step[b] + np.arange(seq_len) < first + length)
        flat = {k: v.reshape(batch * seq_len, *v.shape[2:]) for k, v in got.items() if k in self.layout.fields()}
        self.check_batch({**flat, "index": ids.reshape(-1)}, lo, hi)

    @precondition(lambda self: self.layout.sampler == "prioritized")
    @rule(batch=st.integers(1, 32), scale=st.sampled_from([0.0, 1e-3, 1.0, 1e3]))
    def update_priorities(self, batch: int, scale: float) -> None:
        if not len(self.learner):
            return
        ids = self.learner.sample(batch)["index"]
        td = scale * np.random.default_rng(batch).standard_normal(len(ids))
        assert self.learner.update_priorities(ids, td) == batch
        self.check_batch(self.learner.sample(batch), *self.window())

    @rule(batches=st.lists(st.integers(1, 16), min_size=1, max_size=3), seed=st.integers(0, 2**16))
    def resume_from_state(self, batches: list[int], seed: int) -> None:
        """A new learner given the learner's state (after a refresh: both hold the newest commits)
        draws the very batches the learner draws next, and goes on as it."""
        self.refresh()
        if not len(self.learner):
            return
        state = self.learner.state_dict()
        resumed = self.open_learner(seed)
        resumed.load_state_dict(state)
        for batch in batches:
            want, got = self.learner.sample(batch), resumed.sample(batch)
            for key in ("index", "weight"):
                if key in want:
                    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
            self.check_batch(got, *self.window())
        self.learner.close()
        self.learner = resumed

    # -- what the learner shows

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """The learner's window, each shard's view moved on where a read met overwritten rows and
        adopted that shard's newest commit."""
        lo, hi = self.learner.window()
        n = self.layout.num_envs
        for s, model in enumerate(self.models):
            shown = hi[s * n:(s + 1) * n].tolist()
            if shown != self.views[s].hi:
                assert shown == model.committed.hi, ("learner rows of shard", s, shown, self.views[s].hi)
                self.views[s] = model.committed.copy()
        return lo, hi

    def model_window(self) -> tuple[np.ndarray, np.ndarray]:
        parts = [model.windows(view) for model, view in zip(self.models, self.views)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def check_learner(self, exact: bool, again: int = 2) -> None:
        """The learner shows the rows of each shard's commit it adopted (a lower bound perhaps
        raised by a ring writer's retire commits since), with that commit's values or a later
        one's; a read meeting overwritten rows adopts the newest commit."""
        lo, hi = self.window()
        want_lo, want_hi = self.model_window()
        assert hi.tolist() == want_hi.tolist(), ("learner window", hi, want_hi)
        writer_lo = np.concatenate([m.windows(m.staged)[0] for m in self.models])
        if exact:
            assert lo.tolist() == want_lo.tolist(), ("learner lower bound", lo, want_lo)
        assert (want_lo <= lo).all() and (lo <= np.maximum(want_lo, np.minimum(writer_lo, hi))).all(), \
            ("learner lower bound", lo, want_lo, writer_lo)
        try:
            ids = ids_of(lo, hi, self.lanes)
            assert len(self.learner) == len(ids), "len"
            np.testing.assert_array_equal(np.sort(self.learner.row_ids()), ids, err_msg="row_ids")
            assert table_rows(self.learner.episodes()) == self.episodes(lo, hi), "episodes"
            if len(ids):
                self.check_batch({**self.learner[ids], "index": ids}, lo, hi)
        except dr.StaleReadError:
            if not again:
                raise
            self.writes_done()
            self.check_learner(exact, again - 1)

    def episodes(self, lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int, int, bool]]:
        n, out = self.layout.num_envs, []
        for s, (model, view) in enumerate(zip(self.models, self.views)):
            out += [(s * n + lane, start, length, complete) for lane, start, length, complete
                    in model.episodes(view, lo[s * n:(s + 1) * n], hi[s * n:(s + 1) * n])]
        return out

    def check_batch(self, got: dict, lo: np.ndarray, hi: np.ndarray) -> None:
        """Rows of the learner's window, each with its shard's values (as committed when adopted, or
        later: a later commit's cut may set ``truncated``), where `locate` puts it."""
        ids, n = got["index"], self.layout.num_envs
        union_lane, step = ids % self.lanes, ids // self.lanes
        assert ((lo[union_lane] <= step) & (step < hi[union_lane])).all(), ("ids outside the window", ids, lo, hi)
        shard, lane, located = self.learner.locate(ids)
        np.testing.assert_array_equal(shard * n + lane, union_lane, err_msg="locate: lane")
        np.testing.assert_array_equal(located, step, err_msg="locate: step")
        for s, (model, view) in enumerate(zip(self.models, self.views)):
            at = shard == s
            if not at.any():
                continue
            rows = {k: np.asarray(v)[at] for k, v in got.items()}
            want = model.rows(view, lane[at], step[at], hi[s * n:(s + 1) * n])
            assert_rows(rows, want, f"shard {s} rows", model.flags(model.committed, lane[at], step[at])[2])
        if "weight" in got:
            assert np.isfinite(got["weight"]).all() and (got["weight"] > 0).all()

    # -- invariants

    @invariant()
    def writers_match_model(self) -> None:
        for s, buf in enumerate(self.writers):
            if buf is not None:
                writes_done(buf)
                lo, hi = self.models[s].windows(self.models[s].staged)
                got_lo, got_hi = buf.window()
                assert (got_lo.tolist(), got_hi.tolist()) == (lo.tolist(), hi.tolist()), ("writer window", s)

    @invariant()
    def learner_matches_model(self) -> None:
        self.check_learner(exact=False)

    def teardown(self) -> None:
        try:
            if self.models:
                for s, buf in enumerate(self.writers):
                    if buf is not None:
                        buf.close()
                        self.models[s].flush()
                self.writers = [None] * self.shards
                if self.learner is not None:
                    self.learner.close()
                self.learner = self.open_learner(0)
                self.adopt_all()
                self.check_learner(exact=True)
                report = verify(self.url)
                assert report.ok and len(report.shards) == self.shards, report.problems
        finally:
            for buf in (*self.writers, self.learner):
                if buf is not None:
                    buf.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class TestShardsModel(ShardsMachine.TestCase):
    # a sequence here opens several stores and learners: CI's profile tries 150 (about a minute)
    settings = settings(model_test_settings(), max_examples=min(model_test_settings().max_examples, 150))


# ---- the shortest failing sequences the machine found, replayed without the database ----------


def test_a_learner_patching_a_ring_tail_chunk_forgets_the_chunk_after_it():
    # a ring of 5 rows in chunks of 4: steps 36-38 fall in chunk 0 (patched in the learner's
    # cache) and step 39 in chunk 1, whose cached copy still held step 34
    machine = ShardsMachine()
    try:
        machine.create(Layout(1, 5, 4, None, False, "uniform", frames=False, small_cache=False), shards=2)
        machine.extend(shard=1, pick=[0], ends=(0, "terminated"), sizes=[1, 12, 23], then="flush")
        machine.new_learner(seed=0)
        machine.clear(shard=1)
        machine.learner.warm()  # the learner's cache holds every chunk of its window
        assert machine.learner.storage.stats().cached_chunks == 2
        machine.extend(shard=1, pick=None, ends=(0, "terminated"), sizes=[4], then="flush and refresh")
    finally:
        machine.teardown()
