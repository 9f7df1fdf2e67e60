"""Model-based stateful test of a buffer (issue 39): hypothesis drives a real `ReplayBuffer` and a
plain reference model (`BufferModel`) through the same random sequence of calls, and checks after
every step that what the buffer and its readers show is what the model says.

The model is small on purpose: per lane the steps ever added (each step's row carries a unique
serial number, so a returned row names the step it must be), the ring window, the episode ends and
the ``truncated`` flags that a cut set, each in two versions: what the writer has staged and what
the last commit holds. A crash throws the staged version away; a flush makes it the committed one.

Examples and steps per example come from the hypothesis profiles in ``conftest.py``: a few dozen in
the fast subset, many more with ``CI=true`` (or ``HYPOTHESIS_PROFILE=ci``); the example database
is kept, so a failure found once replays first the next time. The straight-line tests at the end
replay the shortest failing sequences it found, so that those stay pinned without the database.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from dataclasses import dataclass, field

import numpy as np
import pytest
from conftest import model_test_settings, writes_done
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import diskreplay as dr
from diskreplay.audit.verify import verify

pytestmark = pytest.mark.usefixtures("no_fsync")
SAMPLERS = ("uniform", "recent", "prioritized", "without-replacement")
IMG = (32, 32)  # 1 KiB a row: a compressed field this large is stored as Zarr shards of frames
DEPTH = (64, 64)  # 4 KiB: a reader past its cache may keep the other fields' chunks whole and read depth's rows


def make_sampler(kind: str) -> dr.Sampler:
    return {"uniform": dr.Uniform, "recent": lambda: dr.Uniform(recent_ratio=0.5, recent_rows=5),
            "prioritized": dr.Prioritized, "without-replacement": dr.WithoutReplacement}[kind]()


@dataclass(frozen=True)
class Layout:
    """What `create` is given."""

    num_envs: int
    lane_cap: int | None  # rows per lane of a ring; None: grows without bound
    chunk_rows: int
    compression: str | None
    derive_next: bool
    sampler: str
    frames: bool  # two image fields (sharded when compressed)
    small_cache: bool  # a writer's staging and two chunks more, a reader's three chunks: chunks evicted, raw
    # buffers memory-mapped, a reader's smaller sharded field kept whole (in the cache's partial slots)

    @property
    def capacity(self) -> int | None:
        return None if self.lane_cap is None else self.lane_cap * self.num_envs

    def fields(self) -> dict[str, dr.Field]:
        out = {"id": dr.Field((), "int64"), "obs": dr.Field((2,), "float32"),
               "next_obs": dr.Field((2,), "float32"), "terminated": dr.Field((), "bool"),
               "truncated": dr.Field((), "bool")}
        if self.frames:
            out["img"] = dr.Field(IMG, "uint8")
            out["depth"] = dr.Field(DEPTH, "uint8")
        return out

    def cache(self, chunks: int) -> dict:
        """The ``cache_bytes`` option of a cache of ``chunks`` chunks, if small."""
        row_bytes = sum(f.row_bytes for f in self.fields().values())
        return {"cache_bytes": chunks * self.chunk_rows * row_bytes} if self.small_cache else {}

    def writer_cache(self) -> dict:
        """A writer's ``cache_bytes`` option, if small (the layout's and every reopen's)."""
        return self.cache(2 * self.num_envs + 4)

    def options(self) -> dict:
        return dict(fields=self.fields(), capacity=self.capacity, num_envs=self.num_envs, chunk_rows=self.chunk_rows,
                    compression=self.compression, derive_next=("obs",) if self.derive_next else (),
                    **self.writer_cache())


layouts = st.builds(
    Layout,
    num_envs=st.integers(1, 3),
    lane_cap=st.sampled_from([None, 3, 8, 13, 16, 32]),
    chunk_rows=st.sampled_from([2, 3, 4, 8, 16]),
    compression=st.sampled_from([None, "zstd", "lz4"]),
    derive_next=st.booleans(),
    sampler=st.sampled_from(SAMPLERS),
    frames=st.booleans(),
    small_cache=st.booleans(),
)


# ---- the reference model ---------------------------------------------------------------------


def row_values(serial: np.ndarray, lane: np.ndarray, frames: bool) -> dict[str, np.ndarray]:
    """The stored fields of the rows with these serial numbers (``next_obs`` as `add` was given it)."""
    s = serial.astype(np.float32)
    out = {"id": serial.astype(np.int64),
           "obs": np.stack([s, lane.astype(np.float32)], axis=-1),
           "next_obs": np.stack([s + 0.5, -1.0 - lane.astype(np.float32)], axis=-1)}
    if frames:
        img = np.empty((len(serial), *IMG), np.uint8)
        img[:] = (serial % 251).astype(np.uint8)[:, None, None]
        img[:, 0, :8] = serial.astype("<u8").view(np.uint8).reshape(-1, 8)
        out["img"] = img
        depth = np.empty((len(serial), *DEPTH), np.uint8)
        depth[:] = (lane % 7 + 3 * serial % 241).astype(np.uint8)[:, None, None]
        depth[:, -1, -8:] = serial.astype("<u8").view(np.uint8).reshape(-1, 8)
        out["depth"] = depth
    return out


@dataclass
class View:
    """One version of the buffer's state: per lane the steps added (``hi``), the lower bound that
    `clear` and a crash's retired rows set, the episode end steps and the steps whose ``truncated``
    flag a cut set."""

    hi: list[int]
    lower: list[int]
    ends: list[list[int]]
    cuts: list[set[int]]

    def copy(self) -> View:
        return View(list(self.hi), list(self.lower), [list(e) for e in self.ends], [set(c) for c in self.cuts])


@dataclass
class BufferModel:
    """The truth: every step's (serial, terminated, truncated) per lane, a staged and a committed `View`."""

    layout: Layout
    serials: list[list[int]] = field(default_factory=list)
    terminated: list[list[bool]] = field(default_factory=list)
    truncated: list[list[bool]] = field(default_factory=list)
    staged: View = field(init=False)
    committed: View = field(init=False)
    pending_cut: set[int] = field(default_factory=set)  # lanes whose open episode a restart cut
    counter: int = 0
    arrays: dict[int, tuple[np.ndarray, ...]] = field(default_factory=dict)  # `steps`' arrays of a lane

    def __post_init__(self) -> None:
        n = self.layout.num_envs
        self.serials, self.terminated, self.truncated = ([[] for _ in range(n)] for _ in range(3))
        self.staged = View([0] * n, [0] * n, [[] for _ in range(n)], [set() for _ in range(n)])
        self.committed = self.staged.copy()

    # -- what calls do

    def append(self, lane: int, serials: list[int], terminated: list[bool], truncated: list[bool]) -> None:
        if lane in self.pending_cut:
            self.cut(lane)
        first = self.staged.hi[lane]
        self.arrays.pop(lane, None)
        self.serials[lane] += serials
        self.terminated[lane] += terminated
        self.truncated[lane] += truncated
        self.staged.ends[lane] += [first + i for i, (te, tr) in enumerate(zip(terminated, truncated)) if te or tr]
        self.staged.hi[lane] += len(serials)

    def cut(self, lane: int) -> None:
        """End the lane's open episode as truncated (a restart or `clear` cut it)."""
        last = self.staged.hi[lane] - 1
        ends = self.staged.ends[lane]
        if last >= 0 and not (ends and ends[-1] == last):
            ends.append(last)
            self.staged.cuts[lane].add(last)
        self.pending_cut.discard(lane)

    def clear(self) -> None:
        for lane in range(self.layout.num_envs):
            if self.staged.hi[lane]:
                self.cut(lane)
            self.staged.lower[lane] = self.staged.hi[lane]

    def flush(self) -> None:
        self.committed = self.staged.copy()

    def restart(self) -> None:
        """A writer opened again with ``mode="r+"``: each lane's open episode ends at its next rows."""
        self.pending_cut = set(range(self.layout.num_envs))

    def crash(self) -> None:
        """Staged rows, ends, cuts and clears are lost; committed ones are kept."""
        for lane, hi in enumerate(self.committed.hi):
            for rows in (self.serials, self.terminated, self.truncated):
                del rows[lane][hi:]
        self.arrays.clear()
        self.staged = self.committed.copy()
        self.restart()

    def reopened(self, lo: np.ndarray, hi: np.ndarray, bound: np.ndarray) -> None:
        """After a `crash`, the reopened writer shows ``[lo, hi)``: the committed rows, fewer old
        ones perhaps (a ring writer commits a raised lower bound before it overwrites rows), never
        more and never fewer than the dead writer showed (``bound``: its lower bounds). Adopts ``lo``."""
        want_lo, want_hi = self.windows(self.committed)
        assert hi.tolist() == want_hi.tolist(), ("committed rows after a crash", hi, want_hi)
        assert (want_lo <= lo).all() and (lo <= np.maximum(want_lo, np.minimum(bound, hi))).all(), \
            ("lower bound after a crash", lo, want_lo, bound)
        for view in (self.staged, self.committed):
            view.lower = lo.tolist()

    def new_rows(self, n: int, lanes: list[int], ends: tuple[int, str]) -> tuple[dict, np.ndarray]:
        """``n`` steps of ``lanes`` (time-major), serials counted on; and the serials [n, lanes]."""
        serial = self.counter + np.arange(n * len(lanes)).reshape(n, len(lanes))
        self.counter += serial.size
        period, how = ends
        end = (serial % period == period - 1) if period else np.zeros(serial.shape, bool)
        lane = np.broadcast_to(np.array(lanes), serial.shape)
        rows = row_values(serial.reshape(-1), lane.reshape(-1), self.layout.frames)
        rows["terminated"] = end.reshape(-1) & (how != "truncated")
        rows["truncated"] = end.reshape(-1) & (how != "terminated")
        return {k: v.reshape(n, len(lanes), *v.shape[1:]) for k, v in rows.items()}, serial

    def store(self, lanes: list[int], rows: dict, serial: np.ndarray) -> None:
        """`new_rows`' rows, added to ``lanes``."""
        for j, lane in enumerate(lanes):
            self.append(lane, serial[:, j].tolist(), rows["terminated"][:, j].tolist(),
                        rows["truncated"][:, j].tolist())

    # -- what a view shows

    def window(self, view: View, lane: int) -> tuple[int, int]:
        hi = view.hi[lane]
        lo = max(view.lower[lane], 0 if self.layout.lane_cap is None else hi - self.layout.lane_cap)
        return min(lo, hi), hi

    def windows(self, view: View) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = zip(*(self.window(view, lane) for lane in range(self.layout.num_envs)))
        return np.array(lo, np.int64), np.array(hi, np.int64)

    def steps(self, lane: int) -> tuple[np.ndarray, ...]:
        """The lane's (serial, terminated, truncated) per step, as arrays."""
        if lane not in self.arrays:
            self.arrays[lane] = (np.asarray(self.serials[lane], np.int64), np.asarray(self.terminated[lane], bool),
                                 np.asarray(self.truncated[lane], bool))
        return self.arrays[lane]

    def flags(self, view: View, lane: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, ...]:
        """(serial, terminated, truncated, episode end) of the rows at (lane, step) as ``view`` shows them."""
        serial = np.zeros(len(step), np.int64)
        terminated, truncated, end = (np.zeros(len(step), bool) for _ in range(3))
        for e in range(self.layout.num_envs):
            at = lane == e
            s = step[at]
            serials, terminations, truncations = self.steps(e)
            serial[at], terminated[at] = serials[s], terminations[s]
            truncated[at] = truncations[s] | np.isin(s, list(view.cuts[e]))
            end[at] = np.isin(s, view.ends[e])
        return serial, terminated, truncated, end

    def rows(self, view: View, lane: np.ndarray, step: np.ndarray, hi: np.ndarray) -> dict[str, np.ndarray]:
        """The rows at (lane, step) as ``view`` shows them, ``hi`` being each lane's newest step + 1."""
        serial, terminated, truncated, end = self.flags(view, lane, step)
        out = {**row_values(serial, lane, self.layout.frames), "terminated": terminated, "truncated": truncated}
        if self.layout.derive_next:  # next_obs is the lane's next step's obs, inside an episode
            follows = ~end & (step + 1 < hi[lane])
            if follows.any():
                nxt = self.rows(view, lane[follows], step[follows] + 1, hi)
                out["next_obs"][follows] = nxt["obs"]
        return out

    def episodes(self, view: View, lo: np.ndarray, hi: np.ndarray) -> list[tuple[int, int, int, bool]]:
        """(lane, start, length, complete) of each episode with steps in ``[lo, hi)``, lane by lane."""
        out = []
        for lane in range(self.layout.num_envs):
            start, stop = int(lo[lane]), int(hi[lane])
            if stop <= start:
                continue
            ends = view.ends[lane]
            complete = start == 0 or start - 1 in ends
            for end in (e for e in ends if start <= e < stop):
                out.append((lane, start, end + 1 - start, complete))
                start, complete = end + 1, True
            if start < stop:
                out.append((lane, start, stop - start, False))
        return out


def ids_of(lo: np.ndarray, hi: np.ndarray, num_envs: int) -> np.ndarray:
    return np.sort(np.concatenate([np.arange(a, b, dtype=np.int64) * num_envs + lane
                                   for lane, (a, b) in enumerate(zip(lo, hi))]))


def table_rows(table: dr.EpisodeTable) -> list[tuple[int, int, int, bool]]:
    return list(zip(table.lane.tolist(), table.start.tolist(), table.length.tolist(), table.complete.tolist()))


def assert_rows(got: dict, want: dict, context: str, truncated_too: np.ndarray | None = None) -> None:
    """``got`` holds ``want``'s fields with equal values; ``truncated_too``: other values the
    ``truncated`` field may have instead (a reader's rows: a later commit's cut)."""
    for name, value in want.items():
        have = np.asarray(got[name])
        assert have.dtype == value.dtype, (context, name, have.dtype, value.dtype)
        if name == "truncated" and truncated_too is not None:
            bad = (have != value) & (have != truncated_too)
        else:
            bad = (have != value).reshape(len(value), -1).any(axis=1)
        if bad.any():
            ids = np.asarray(got.get("index", np.arange(len(value))))
            raise AssertionError(f"{context}: field {name!r} differs at row ids {ids[bad][:8].tolist()}: "
                                 f"got {have[bad][:4].tolist()}, want {value[bad][:4].tolist()}")


# ---- the machine ------------------------------------------------------------------------------


@dataclass
class Reader:
    buf: dr.ReplayBuffer
    view: View  # the model's committed view when the reader last adopted a commit


picks = st.none() | st.lists(st.integers(0, 2), min_size=1, max_size=3)
"""The lanes a call writes (None: all; numbers past the layout's lanes are left out)."""
ends_spec = st.tuples(st.sampled_from([0, 1, 2, 5, 9]), st.sampled_from(["terminated", "truncated", "both"]))
"""Episode ends among new rows: every ``period``-th serial number ends one (0: none), and how."""


@dataclass
class Run:
    """What this module's machine ran (printed at its end, summed up by tools/reliability_report.py)."""

    layouts: set[Layout] = field(default_factory=set)
    sequences: int = 0
    steps: int = 0
    failures: list[str] = field(default_factory=list)
    """Tracebacks of the first runs that failed (a failure hypothesis shrinks fails many)."""


RUN = Run()


@pytest.fixture(scope="module", autouse=True)
def report_run():
    yield
    layouts = RUN.layouts
    if layouts:
        caps = sorted({x.lane_cap for x in layouts}, key=lambda c: -1 if c is None else c)
        print(f"\nmodel test: {RUN.sequences} sequences, {RUN.steps} steps checked, {len(layouts)} layouts "
              f"(lanes {sorted({x.num_envs for x in layouts})}, capacities per lane {caps}, "
              f"chunk_rows {sorted({x.chunk_rows for x in layouts})}, "
              f"codecs {sorted({str(x.compression) for x in layouts})}, samplers {len({x.sampler for x in layouts})}, "
              f"derive_next {sorted({x.derive_next for x in layouts})})")


class BufferMachine(RuleBasedStateMachine):
    """A writer (reopened, crashed, cleared...), up to two readers and the model, in step."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="diskreplay-model-")
        self.path = os.path.join(self.dir, "buf")
        self.buf: dr.ReplayBuffer | None = None
        self.readers: list[Reader] = []
        self.pinned: dict[int, View] = {}  # commit sequence -> the committed view it keeps

    # -- setup and calls

    @initialize(layout=layouts, seed=st.integers(0, 2**16))
    def create(self, layout: Layout, seed: int) -> None:
        self.layout, self.model = layout, BufferModel(layout)
        RUN.layouts.add(layout)
        RUN.sequences += 1
        self.open_options = layout.writer_cache()
        self.reader_options = layout.cache(3)
        self.buf = dr.ReplayBuffer.create(self.path, sampler=make_sampler(layout.sampler), seed=seed,
                                          **layout.options())

    def env_ids(self, pick: list[int] | None) -> tuple[list[int], list[int] | None]:
        """The lanes a call writes: ``pick`` filtered to this layout's lanes (None or none left: all)."""
        ids = [e for e in dict.fromkeys(pick or []) if e < self.layout.num_envs]
        return (ids, ids) if ids else (list(range(self.layout.num_envs)), None)

    @rule(pick=picks, ends=ends_spec, count=st.integers(1, 4))
    def add(self, pick: list[int] | None, ends: tuple[int, str], count: int) -> None:
        """``count`` single steps of the picked lanes."""
        lanes, env_ids = self.env_ids(pick)
        for _ in range(count):
            rows, serial = self.model.new_rows(1, lanes, ends)
            if self.layout.num_envs == 1 and env_ids is None:
                self.buf.add(**{k: v[0, 0] for k, v in rows.items()})
            else:
                self.buf.add(env_ids=env_ids, **{k: v[0] for k, v in rows.items()})
            self.model.store(lanes, rows, serial)

    @rule(pick=picks, ends=ends_spec, data=st.data())
    def extend(self, pick: list[int] | None, ends: tuple[int, str], data: st.DataObject) -> None:
        """One to four extends in a row, each of 1 to 3x a lane's capacity of steps (a growing
        buffer: of up to 96 steps)."""
        lanes, env_ids = self.env_ids(pick)
        most = 3 * (self.layout.lane_cap or 32)
        for n in data.draw(st.lists(st.integers(1, most), min_size=1, max_size=4), label="sizes"):
            rows, serial = self.model.new_rows(n, lanes, ends)
            if self.layout.num_envs == 1 and env_ids is None:
                self.buf.extend({k: v[:, 0] for k, v in rows.items()})
            else:
                self.buf.extend(rows, env_ids=env_ids)
            self.model.store(lanes, rows, serial)

    @rule()
    def flush(self) -> None:
        self.buf.flush()
        self.model.flush()

    @rule()
    def clear(self) -> None:
        self.buf.clear()
        self.model.clear()

    @rule()
    def close_and_reopen(self) -> None:
        self.buf.close()
        self.model.flush()
        self.buf = dr.ReplayBuffer.open(self.path, "r+", **self.open_options)
        self.model.restart()

    @rule()
    def crash_and_reopen(self) -> None:
        """The writer dies without flushing (its lock released, as a dead process's is taken over)."""
        self.buf._release()
        bound = self.model.windows(self.model.staged)[0]
        self.model.crash()
        self.buf = dr.ReplayBuffer.open(self.path, "r+", **self.open_options)
        self.model.reopened(*self.buf.window(), bound)

    @rule(new=st.booleans(), first=st.sampled_from([0, 4, 16]), warm=st.booleans())
    def open_or_refresh_reader(self, new: bool, first: int = 0, warm: bool = False) -> None:
        """A new reader (or the last one refreshed): its first read a batch of ``first`` rows,
        the fill behind it waited for if ``warm``, then every row (``first`` 0: every row first)."""
        writes_done(self.buf)
        exact = self.model.staged == self.model.committed
        if new or not self.readers:
            if len(self.readers) == 2:
                self.readers.pop(0).buf.close()
            self.readers.append(Reader(dr.ReplayBuffer.open(self.path, "r", retry=dr.RetryPolicy(budget_s=2.0),
                                                            **self.reader_options), self.model.committed.copy()))
            if first:
                self.sample(first, reader=True)
            if first and warm:
                self.readers[-1].buf.warm()
        else:
            self.readers[-1].buf.refresh()
            self.readers[-1].view = self.model.committed.copy()
        self.check_reader(self.readers[-1], exact=exact)

    @rule()
    def warm_reader(self) -> None:
        """The fill a reader's first read started behind it, waited for: reads after it show the same."""
        if self.readers:
            self.readers[-1].buf.warm()
            self.check_reader(self.readers[-1], exact=False)

    @rule()
    def pin(self) -> None:
        """The writer pins its next commit (at most two pins: the oldest is unpinned first)."""
        if len(self.pinned) == 2:
            oldest = min(self.pinned)
            self.buf.unpin(oldest)
            del self.pinned[oldest]
        n = self.buf.pin()
        self.model.flush()
        self.pinned[n] = self.model.committed.copy()
        assert self.buf.pins() == dict.fromkeys(self.pinned), "pins"

    @rule(pick=st.integers(0, 1), batch=st.integers(1, 32))
    def read_pinned(self, pick: int, batch: int) -> None:
        """A reader opened at a pinned commit shows exactly its rows, whatever the writer did since."""
        if not self.pinned:
            return
        n = sorted(self.pinned)[pick % len(self.pinned)]
        view = self.pinned[n]
        with dr.ReplayBuffer.open(self.path, "r", at_commit=n, **self.reader_options) as past:
            assert past.at_commit == n
            lo, hi = past.window()
            want_lo, want_hi = self.model.windows(view)
            assert (lo.tolist(), hi.tolist()) == (want_lo.tolist(), want_hi.tolist()), ("pinned window", n)
            self.check_rows(past, view, lo, hi, "pinned")
            if (hi > lo).any():
                self.check_batch(past.sample(batch), view, lo, hi)

    @rule(seed=st.integers(0, 2**16), batch=st.integers(1, 64))
    def announced_reads(self, seed: int, batch: int) -> None:
        """A reader told the order of its next reads (as an epoch tells it) reads them as the
        model says: whole chunks read ahead, the cache's fill or not."""
        if not self.readers:
            return
        r, n = self.readers[-1], self.layout.num_envs
        lo, hi = self.adopted(r)
        ids = np.random.default_rng(seed).permutation(ids_of(lo, hi, n))
        parts = [ids[i:i + batch] for i in range(0, len(ids), batch)]
        r.buf.storage.read_ahead((part % n, part // n) for part in parts)
        view, got = r.view, []
        try:
            for part in parts:
                got.append({**r.buf[part], "index": part})
        except dr.StaleReadError:  # a ring's writer overwrote rows: the reader adopted its newest commit
            r.view = self.model.committed.copy()
        finally:
            r.buf.storage.read_ahead(None)
        if got:  # the batches read before any stale one, checked at once (the model's cost is per call)
            self.check_batch({k: np.concatenate([g[k] for g in got]) for k in got[0]}, view, lo, hi, reader=True)

    @rule(batch=st.integers(1, 64), reader=st.booleans())
    def sample(self, batch: int, reader: bool) -> None:
        if reader and self.readers:
            r = self.readers[-1]
            if len(r.buf) == 0:
                return
            got = r.buf.sample(batch)
            lo, hi = self.adopted(r)
            self.check_batch(got, r.view, lo, hi, reader=True)
            return
        lo, hi = self.model.windows(self.model.staged)
        if not (hi > lo).any():
            with pytest.raises(dr.EmptyBufferError):
                self.buf.sample(batch)
            return
        self.check_batch(self.buf.sample(batch), self.model.staged, lo, hi)

    @rule(batch=st.integers(1, 16), seq_len=st.integers(1, 4), pad=st.booleans())
    def sample_slices(self, batch: int, seq_len: int, pad: bool) -> None:
        view = self.model.staged
        lo, hi = self.model.windows(view)
        episodes = self.model.episodes(view, lo, hi)
        if not any(length >= (1 if pad else seq_len) for _, _, length, _ in episodes):
            with pytest.raises(dr.EmptyBufferError):
                self.buf.sample(batch, seq_len=seq_len, pad=pad)
            return
        got = self.buf.sample(batch, seq_len=seq_len, pad=pad)
        ids, start = got["index"], got["start"]
        assert ids.shape == (batch, seq_len) and (ids[:, 0] == start).all()
        lane, step = start % self.layout.num_envs, start // self.layout.num_envs
        mask = got["mask"] if pad else np.ones(ids.shape, bool)
        assert mask[:, 0].all()
        for b in range(batch):  # consecutive steps of one episode, then (pad) its last step repeated
            episode = next(e for e in episodes if e[0] == lane[b] and e[1] <= step[b] < e[1] + e[2])
            last = episode[1] + episode[2] - 1
            want = np.minimum(step[b] + np.arange(seq_len), last)
            np.testing.assert_array_equal(ids[b], want * self.layout.num_envs + lane[b])
            np.testing.assert_array_equal(mask[b], step[b] + np.arange(seq_len) <= last)
        flat = {k: v.reshape(batch * seq_len, *v.shape[2:]) for k, v in got.items() if k in self.layout.fields()}
        want = self.model.rows(view, np.repeat(lane, seq_len), (ids // self.layout.num_envs).reshape(-1), hi)
        assert_rows({**flat, "index": ids.reshape(-1)}, want, "slices")

    @rule(batch=st.integers(1, 32), scale=st.sampled_from([0.0, 1e-3, 1.0, 1e3]), stale=st.booleans())
    def update_priorities(self, batch: int, scale: float, stale: bool) -> None:
        """Prioritized buffers: new priorities for sampled rows; rows no longer readable are not counted."""
        lo, hi = self.model.windows(self.model.staged)
        if self.layout.sampler != "prioritized" or not (hi > lo).any():
            return
        ids = self.buf.sample(batch)["index"]
        n = self.layout.num_envs
        gone = [(int(a) - 1) * n + lane for lane, a in enumerate(lo) if a > 0] if stale else []
        ids = np.concatenate([ids, np.array(gone, np.int64)])
        td = scale * np.random.default_rng(len(ids)).standard_normal(len(ids))
        assert self.buf.update_priorities(ids, td) == batch
        self.check_batch(self.buf.sample(batch), self.model.staged, lo, hi)

    @rule()
    def verify_store(self) -> None:
        writes_done(self.buf)
        report = verify(self.path)
        assert report.ok, report.problems

    @rule(pick=st.integers(0, 2**16))
    def damage_and_repair_a_chunk(self, pick: int) -> None:
        """``verify`` fails exactly while a chunk that holds committed rows is damaged."""
        writes_done(self.buf)
        with dr.ReplayBuffer.open(self.path, "r") as reader:
            ids = reader.row_ids()
            if not len(ids):
                return
            _, lane, step = reader.locate(ids[pick % len(ids)])
            chunk = int(reader.layout.chunk_and_offset(step)[0])
            key = reader.storage.chunk_key("id", int(lane), chunk)
        path = os.path.join(self.path, key)
        with open(path, "rb") as f:
            blob = f.read()
        with open(path, "r+b") as f:
            f.seek(len(blob) // 2)
            f.write(bytes([blob[len(blob) // 2] ^ 0xFF]))
        try:
            report = verify(self.path)
            assert not report.ok and any(key in p for p in report.problems), (key, report.problems)
        finally:
            with open(path, "r+b") as f:
                f.write(blob)
        assert verify(self.path).ok

    # -- invariants

    @invariant()
    def writer_matches_model(self) -> None:
        RUN.steps += 1
        if self.buf is None:
            return
        # the chunk writes behind the rule's last call end first: what a step leaves behind then
        # does not depend on thread timing, so hypothesis can replay and shrink a failure
        writes_done(self.buf)
        view = self.model.staged
        lo, hi = self.model.windows(view)
        got_lo, got_hi = self.buf.window()
        assert (got_lo.tolist(), got_hi.tolist()) == (lo.tolist(), hi.tolist()), "writer window"
        self.check_rows(self.buf, view, lo, hi, "writer")

    @invariant()
    def readers_match_model(self) -> None:
        for reader in self.readers:
            self.check_reader(reader, exact=False)

    def check_reader(self, reader: Reader, exact: bool, again: int = 2) -> None:
        """A reader shows the rows of the commit it adopted (its lower bound perhaps raised by a
        ring writer's retire commits since), with the values of that commit or a later one. A
        read that meets rows retired since its commit makes it adopt the newest commit. The
        writer's background writes are then waited for: a retire commit they make after that
        adoption makes the next read adopt once more (``again``: reads left to meet one)."""
        lo, hi = self.adopted(reader)
        want_lo, want_hi = self.model.windows(reader.view)
        if exact:
            assert lo.tolist() == want_lo.tolist(), ("reader window", lo, want_lo)
        writer_lo = self.model.windows(self.model.staged)[0]
        assert (want_lo <= lo).all() and (lo <= np.maximum(want_lo, np.minimum(writer_lo, hi))).all(), \
            ("reader lower bound", lo, want_lo, writer_lo)
        try:
            self.check_rows(reader.buf, reader.view, lo, hi, "reader")
        except dr.StaleReadError:
            if not again:
                raise
            if self.buf is not None and not self.buf.closed:
                writes_done(self.buf)
            reader.view = self.model.committed.copy()
            self.check_reader(reader, exact, again - 1)

    def adopted(self, reader: Reader) -> tuple[np.ndarray, np.ndarray]:
        """The reader's window, its view moved on if a read met overwritten rows and adopted the newest commit."""
        lo, hi = reader.buf.window()
        if hi.tolist() != reader.view.hi:
            assert hi.tolist() == self.model.committed.hi, ("reader rows", hi, reader.view.hi)
            reader.view = self.model.committed.copy()
        return lo, hi

    def check_rows(self, buf: dr.ReplayBuffer, view: View, lo: np.ndarray, hi: np.ndarray, who: str) -> None:
        """``len``, ``row_ids``, ``episodes`` and every readable row as ``view`` says."""
        n = self.layout.num_envs
        ids = ids_of(lo, hi, n)
        assert len(buf) == len(ids), (who, "len")
        np.testing.assert_array_equal(np.sort(buf.row_ids()), ids, err_msg=f"{who} row_ids")
        assert table_rows(buf.episodes()) == self.model.episodes(view, lo, hi), f"{who} episodes"
        if len(ids):
            self.check_batch({**buf[ids], "index": ids}, view, lo, hi, reader=who == "reader")
        for lane in range(n):  # overwritten, cleared and future steps are not readable
            for step in {int(lo[lane]) - 1, int(hi[lane])} - {-1}:
                with pytest.raises(IndexError):
                    buf[[step * n + lane]]

    def check_batch(self, got: dict, view: View, lo: np.ndarray, hi: np.ndarray, reader: bool = False) -> None:
        n = self.layout.num_envs
        ids = got["index"]
        lane, step = ids % n, ids // n
        assert ((lo[lane] <= step) & (step < hi[lane])).all(), ("ids outside the window", ids, lo, hi)
        want = self.model.rows(view, lane, step, hi)
        later = self.model.flags(self.model.committed, lane, step)[2] if reader else None
        assert_rows(got, want, "reader rows" if reader else "writer rows", later)
        if self.layout.sampler == "prioritized" and "weight" in got:
            assert np.isfinite(got["weight"]).all() and (got["weight"] > 0).all()

    def teardown(self) -> None:
        failure = sys.exc_info()[1]  # what ends this run, if anything does (teardown runs in a finally)
        if failure is not None and not type(failure).__module__.startswith("hypothesis") and len(RUN.failures) < 3:
            RUN.failures.append("".join(traceback.format_exception(failure)))
        try:
            if self.buf is not None:
                self.buf.close()
                self.model.flush()
                with dr.ReplayBuffer.open(self.path, "r") as reader:
                    self.check_reader(Reader(reader, self.model.committed.copy()), exact=True)
                report = verify(self.path)
                assert report.ok, report.problems
        finally:
            for reader in self.readers:
                reader.buf.close()
            shutil.rmtree(self.dir, ignore_errors=True)


class TestBufferModel(BufferMachine.TestCase):
    settings = model_test_settings()

    def runTest(self) -> None:
        """The machine's run; a failure hypothesis cannot replay (`Flaky`: it depends on timing)
        is reported with the first failures the runs met."""
        try:
            super().runTest()
        except Flaky as e:
            raise AssertionError(f"{e}\nfailures met before:\n" + "\n".join(RUN.failures or ["none"])) from e


# ---- the shortest failing sequences the machine found, replayed without the database ----------

EPISODE_FIELDS = {"id": dr.Field((), "int64"), "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}


def steps(first: int, n: int, num_envs: int = 1) -> dict[str, np.ndarray]:
    """``n`` steps of every lane whose ``id`` is their row id, no episode ending."""
    ids = np.arange(first * num_envs, (first + n) * num_envs, dtype=np.int64)
    shape = (n,) if num_envs == 1 else (n, num_envs)
    return {"id": ids.reshape(shape), "terminated": np.zeros(shape, bool), "truncated": np.zeros(shape, bool)}


def test_a_reader_keeping_a_sharded_field_whole_past_its_cache_matches_the_model():
    # the machine reaches this rarely: a small reader cache past which `img`'s chunks fit half of it
    machine = BufferMachine()
    try:
        machine.create(Layout(1, None, 4, "zstd", False, "uniform", frames=True, small_cache=True), seed=3)
        machine.add(None, (5, "terminated"), 4)
        for _ in range(6):
            machine.add(None, (5, "terminated"), 4)
            machine.sample(16, reader=False)
        machine.flush()
        machine.open_or_refresh_reader(new=True, first=4, warm=True)  # `img`'s chunks filled behind the batch
        stats = machine.readers[-1].buf.storage.stats()
        assert list(stats.row_fields) == ["depth"] and stats.cache_slots == 10  # one with room for depth, 9 without
        assert stats.cached_chunks == 7
        machine.sample(32, reader=True)
        machine.readers_match_model()
        machine.add(None, (5, "terminated"), 4)
        machine.flush()
        machine.open_or_refresh_reader(new=False)
        machine.sample(32, reader=True)
    finally:
        machine.teardown()


def test_ring_extends_larger_than_the_ring_keep_their_rows(tmp_path):
    # issue 39, item 1: extends of 19, 4, 19 and 19 rows into a ring of 16 rows in chunks of 2
    # left two chunk slots holding rows of the previous round
    path = tmp_path / "b"
    buf = dr.ReplayBuffer.create(path, EPISODE_FIELDS, 16, chunk_rows=2, compression=None)
    first = 0
    for n in (19, 4, 19, 19):
        buf.extend(steps(first, n))
        first += n
    ids = buf.row_ids()
    np.testing.assert_array_equal(ids, np.arange(45, 61))
    np.testing.assert_array_equal(buf[ids]["id"], ids)
    buf.close()
    with dr.ReplayBuffer.open(path, "r") as reader:
        np.testing.assert_array_equal(reader[ids]["id"], ids)


@pytest.mark.parametrize("num_envs", [1, 2])
@pytest.mark.parametrize("capacity", [None, 16])
def test_without_replacement_buffer_reopens_before_its_first_sample(tmp_path, num_envs, capacity):
    # issue 39, item 2: the sampler's epoch bounds were saved empty until the first sample, and
    # every open then refused the commit ("'sampler.epoch_lo/epoch_hi': expected ... got [] and []")
    path = tmp_path / "b"
    with dr.ReplayBuffer.create(path, EPISODE_FIELDS, capacity, num_envs=num_envs, chunk_rows=4,
                                sampler=dr.WithoutReplacement()) as buf:
        buf.extend(steps(0, 3, num_envs))
    with dr.ReplayBuffer.open(path, "r+") as buf:
        assert len(buf) == 3 * num_envs
    with dr.ReplayBuffer.open(path, "r") as reader:
        assert sorted(reader.sample(3 * num_envs)["index"].tolist()) == list(range(3 * num_envs))


def test_a_crashed_writer_does_not_change_the_rows_of_the_last_commit(tmp_path):
    # issue 39, item 3: the writer that reopened the buffer marked the open episode's last step
    # truncated in the stored chunk at its first add, before any commit; it died unflushed and
    # readers of the last commit (and the next writer) read truncated=True there
    path = tmp_path / "b"
    with dr.ReplayBuffer.create(path, EPISODE_FIELDS, None, chunk_rows=4, compression=None) as buf:
        buf.add(**{k: v[0] for k, v in steps(0, 1).items()})  # an episode left open
    buf = dr.ReplayBuffer.open(path, "r+")
    buf.add(**{k: v[0] for k, v in steps(1, 1).items()})
    writes_done(buf)
    with dr.ReplayBuffer.open(path, "r") as reader:
        assert reader[[0]]["truncated"].tolist() == [False]
    buf._release()  # dies without flushing
    with dr.ReplayBuffer.open(path, "r") as reader:
        assert reader[[0]]["truncated"].tolist() == [False]
        assert table_rows(reader.episodes()) == [(0, 0, 1, False)]
    with dr.ReplayBuffer.open(path, "r+") as buf:
        assert buf[[0]]["truncated"].tolist() == [False]


def test_cleared_rows_keep_no_priority(tmp_path):
    # issue 39, item 6: after clear() a growing buffer's cleared rows kept their priorities, and
    # once the new rows' priorities were lower the sampler drew only cleared rows
    buf = dr.ReplayBuffer.create(tmp_path / "b", EPISODE_FIELDS, None, chunk_rows=2, sampler=dr.Prioritized(),
                                 seed=0)
    buf.extend(steps(0, 1))
    buf.clear()
    buf.add(**{k: v[0] for k, v in steps(1, 1).items()})
    assert buf.update_priorities([1], [0.0]) == 1
    assert buf.sample(4)["index"].tolist() == [1, 1, 1, 1]
    buf.close()


def test_ring_of_several_lanes_keeps_rows_after_clear(tmp_path):
    # found by the machine: after clear(), whose cut marks each lane's last step truncated,
    # two extends of one ring's worth each left the old rows in a chunk slot of every lane
    path = tmp_path / "b"
    buf = dr.ReplayBuffer.create(path, EPISODE_FIELDS, 16, num_envs=2, chunk_rows=2, compression=None)
    buf.extend(steps(0, 2, 2))
    buf.clear()
    buf.extend(steps(2, 8, 2))
    buf.extend(steps(10, 8, 2))
    ids = np.sort(buf.row_ids())
    np.testing.assert_array_equal(ids, np.arange(20, 36))
    np.testing.assert_array_equal(buf[ids]["id"], ids)
    buf.close()
    with dr.ReplayBuffer.open(path, "r") as reader:
        np.testing.assert_array_equal(reader[ids]["id"], ids)


def test_derive_next_buffer_takes_the_cache_its_rows_need(tmp_path):
    # found by the machine: create() gave the derive_next side store the caller's cache_bytes,
    # too small for the side store's own chunks, while open() sizes that cache itself
    fields = {"obs": dr.Field((2,), "float32"), "next_obs": dr.Field((2,), "float32"), "done": dr.Field((), "bool")}
    cache = 4 * 2 * sum(f.row_bytes for f in fields.values())  # staging of one lane in chunks of 2
    path = tmp_path / "b"
    with dr.ReplayBuffer.create(path, fields, None, chunk_rows=2, compression=None, derive_next=("obs",),
                                cache_bytes=cache) as buf:
        buf.add(obs=np.zeros(2), next_obs=np.ones(2), done=False)
    with dr.ReplayBuffer.open(path, "r+", cache_bytes=cache) as buf:
        assert buf[[0]]["next_obs"].tolist() == [[1.0, 1.0]]


def test_prioritized_slices_start_where_a_slice_fits_whatever_its_priority(tmp_path):
    # found by the machine: slices are drawn by their start row's priority and rows where no
    # slice fits are drawn again; when the only start that fits had a low priority, every draw
    # missed it and sample() said no slice fits ("could not draw slices of 3 steps ...")
    buf = dr.ReplayBuffer.create(tmp_path / "b", EPISODE_FIELDS, None, chunk_rows=2, sampler=dr.Prioritized(),
                                 seed=0)
    buf.add(**{k: v[0] for k, v in steps(0, 1).items()})
    assert buf.update_priorities([0], [0.0]) == 1
    buf.extend(steps(1, 2))
    assert buf.sample(4, seq_len=3)["start"].tolist() == [0, 0, 0, 0]
    buf.close()


@pytest.mark.parametrize("num_envs,lane_cap,chunk_rows,calls,cache_chunks", [
    (2, 13, 2, ((1,), (12, 2, 3)), 2 * 2 + 4),  # a cache of the writer's staging and two chunks more
    (3, 32, 3, ((1, 18, 20, 30), (1,), (3, 12)), None),
])
def test_ring_whose_capacity_is_not_whole_chunks_keeps_rows(tmp_path, num_envs, lane_cap, chunk_rows, calls,
                                                             cache_chunks):
    # found by the machine: rings of several lanes whose last chunk is short (13 rows in chunks
    # of 2, 32 in chunks of 3), raw; after these extends, each shorter than the ring, a chunk
    # slot of one lane held rows of the previous round (the writer's, and after close, readers');
    # ``calls``: extends in a row, the writes behind them done after each group
    path = tmp_path / "b"
    fields = {"id": dr.Field((), "int64")}
    cache = {} if cache_chunks is None else {"cache_bytes": cache_chunks * chunk_rows * 8}
    buf = dr.ReplayBuffer.create(path, fields, lane_cap * num_envs, num_envs=num_envs, chunk_rows=chunk_rows,
                                 compression=None, **cache)
    first = 0
    for group in calls:
        for n in group:
            buf.extend({"id": steps(first, n, num_envs)["id"]})
            first += n
        writes_done(buf)
    ids = np.sort(buf.row_ids())
    np.testing.assert_array_equal(ids, np.arange((first - lane_cap) * num_envs, first * num_envs))
    np.testing.assert_array_equal(buf[ids]["id"], ids)
    buf.close()
    with dr.ReplayBuffer.open(path, "r") as reader:
        np.testing.assert_array_equal(reader[ids]["id"], ids)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_refreshed_reader_reads_the_truncated_flag_of_its_commit(tmp_path, compression):
    # found by the machine: a reader kept the chunk it had read before a reopened writer closed
    # the episode that was left open (truncated=True on its last step); after refresh() adopted
    # that commit, its episode index ended the episode there but the row still read False
    path = tmp_path / "b"
    with dr.ReplayBuffer.create(path, EPISODE_FIELDS, None, chunk_rows=2, compression=compression) as buf:
        buf.extend(steps(0, 2))  # an episode left open
    buf = dr.ReplayBuffer.open(path, "r+")
    with dr.ReplayBuffer.open(path, "r") as reader:
        assert reader[[0, 1]]["truncated"].tolist() == [False, False]
        buf.add(**{k: v[0] for k, v in steps(2, 1).items()})
        buf.flush()
        assert reader.refresh() is True
        assert table_rows(reader.episodes()) == [(0, 0, 2, True), (0, 2, 1, False)]
        assert reader[[0, 1]]["truncated"].tolist() == [False, True]
    buf.close()
