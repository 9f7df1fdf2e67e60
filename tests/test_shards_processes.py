"""A sharded buffer with real actor and learner processes (tests/shard_actor.py runs them).

- `test_writers_killed_while_learner_samples`: four shard writers and a prioritized learner, on
  local disk and on S3 (moto over HTTP); two writers are SIGKILLed at moments a seeded generator
  picks. The learner checks every sampled row against the content its (shard, lane, step) says
  it must have; every row a killed writer committed stays readable; the killed shards reopen
  (their dead writers' locks taken over) and take new rows the running learner adopts.
- Prioritized sampling over the union, in one process: draws follow the per-shard priorities
  (chi-square), updates of overwritten rows change nothing, a learner restored from
  `save_snapshot` draws the very batches the original draws next.
- `test_rate_limiter_fast_and_slow_actor`: a fast and a slow actor process keep to a
  `RateLimiter` with a learner process; every batch the learner logged keeps the upper bound
  exactly and the lower bound within a slack the protocol guarantees.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import OWN, logged
from s3server import s3
from shard_actor import content, fields, steps_rows

import diskreplay as dr

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("shard_actor.py")
SAFETY_S = 120.0
"""How long a wait for a process may take before the test fails instead of hanging (never a measurement)."""


def start(role: str, job: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(SCRIPT), role, json.dumps(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen, what: str) -> str:
    """Wait for ``proc`` to exit on its own; its stdout. Fails with its stderr if it failed."""
    out, err = proc.communicate(timeout=SAFETY_S)
    assert proc.returncode == 0, f"{what} exited with {proc.returncode}:\n{err}"
    return out


def stop_all(procs) -> None:
    """Kill whatever is still running (a failed test), so that nothing outlives it."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def events(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        word, _, value = line.partition(" ")
        out.append((word, int(value)))
    return out


def last(evts: list[tuple[str, int]], word: str, default: int = 0) -> int:
    values = [v for w, v in evts if w == word]
    return values[-1] if values else default


def check_running(procs, what: str) -> None:
    for proc in procs:
        if proc.poll() is not None:
            raise AssertionError(f"a process exited ({proc.returncode}) while waiting for {what}: "
                                 f"{proc.communicate()[1]}")


def wait_until(condition, what: str, procs=()) -> None:
    """Poll ``condition()`` until it holds; fail if one of ``procs`` died meanwhile."""
    deadline = time.monotonic() + SAFETY_S
    while not condition():
        check_running(procs, what)
        assert time.monotonic() < deadline, f"still waiting for {what} after {SAFETY_S} s"
        time.sleep(0.005)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def shard_ids(shard: int, lanes: int, shards: int, lo: int, hi: int) -> np.ndarray:
    """Row ids of steps ``[lo, hi)`` of every lane of ``shard`` (step * shards*lanes + shard*lanes + lane)."""
    steps = np.arange(lo, hi, dtype=np.int64)[:, None]
    return (steps * (shards * lanes) + shard * lanes + np.arange(lanes)).reshape(-1)


def check_content(buf: dr.ReplayBuffer, ids: np.ndarray, where: str) -> None:
    got = buf[ids]
    want = content(*buf.locate(ids))
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=f"{where}: field {name}")


# ---- four writers, two SIGKILLed, one learner -------------------------------------------------

SHARDS, LANES, CHUNK = 4, 2, 16
RUNS = {"local": {"lane_cap": 64, "kill_at": (30, 200), "batches_after": 20},
        "s3": {"lane_cap": 1024, "kill_at": (8, 30), "batches_after": 5}}
"""On local disk a ring of 64 steps a lane (4 chunks) wraps several times: kills land amid
retirements, and the learner's reads race the writers' overwrites (stale reads, drawn again).
On S3 (moto: one Python process serving five) a sample of the union takes so long that with a
ring of 4 chunks some shard retired rows it drew in attempt after attempt, until `sample` gave
up with `StaleReadError` after ``retry.budget_s`` (30 s): there the ring is large enough not to
wrap in the run (the checks would account for it if it did)."""


@pytest.mark.slow  # subprocesses and kills, as conftest.SLOW_MODULES
@pytest.mark.parametrize("where", ["local", "s3"])
def test_writers_killed_while_learner_samples(tmp_path, where, request, caplog):
    so, url = None, str(tmp_path / "buf")
    if where == "s3":
        server = request.getfixturevalue("s3")
        so, url = server.storage_options(), server.new_url("shards")
    lane_cap, (kill_lo, kill_hi), batches_after = (RUNS[where][k] for k in ("lane_cap", "kill_at", "batches_after"))
    dr.ReplayBuffer.create(url, fields(), capacity=lane_cap * LANES, shards=SHARDS, num_envs=LANES,
                           chunk_rows=CHUNK, storage_options=so).close()
    rng = np.random.default_rng(20240611)
    victims = sorted(int(s) for s in rng.choice(SHARDS, 2, replace=False))
    # a kill lands a random 0-20 ms after the victim's flush of step kill_at completed: amid an
    # add, an extend, a flush (before or after its commit landed) or a retirement of ring rows
    kill_at = {v: int(rng.integers(kill_lo, kill_hi)) for v in victims}
    delay = {v: float(rng.uniform(0.0, 0.02)) for v in victims}
    stop, heartbeat = tmp_path / "stop", tmp_path / "heartbeat.json"
    progress = {s: tmp_path / f"writer-{s}.txt" for s in range(SHARDS)}
    writers = {s: start("writer", {"url": url, "storage_options": so, "shard": s, "lanes": LANES, "seed": 100 + s,
                                   "max_steps": 6, "progress": str(progress[s]), "stop": str(stop)})
               for s in range(SHARDS)}
    learner = start("learner", {"url": url, "storage_options": so, "shards": SHARDS, "lanes": LANES, "seed": 7,
                                "batch": 64, "heartbeat": str(heartbeat), "stop": str(stop)})
    procs = [*writers.values(), learner]
    reopened: dict[int, dr.ReplayBuffer] = {}
    try:
        killed: dict[int, list[tuple[str, int]]] = {}
        kills: list[str] = []
        deadline = time.monotonic() + SAFETY_S
        while len(killed) < len(victims):  # kill each victim once it flushed step kill_at
            for v in victims:
                if v not in killed and last(events(progress[v]), "flushed") >= kill_at[v]:
                    time.sleep(delay[v])
                    os.kill(writers[v].pid, signal.SIGKILL)
                    writers[v].wait()  # reaped: its pid is gone before anyone looks at its lock
                    killed[v] = events(progress[v])
            check_running([p for s, p in writers.items() if s not in killed] + [learner], "the kills")
            assert time.monotonic() < deadline, f"the victims never flushed steps {kill_at}"
            time.sleep(0.002)
        batches_at_kill = (read_json(heartbeat) or {"batches": 0})["batches"]
        flushed_at_kill = {s: last(events(progress[s]), "flushed") for s in range(SHARDS) if s not in victims}

        # every row a killed writer committed is readable, exactly its content; nothing else is there
        union = dr.ReplayBuffer.open(url, "r", storage_options=so)
        lo, hi = (x.reshape(SHARDS, LANES) for x in union.window())
        resume = {}
        for v, evts in killed.items():
            where_v = f"{where} shard {v} killed after {evts[-3:]}"
            low = last(evts, "flushed")
            high = evts[-1][1] if evts[-1][0] == "flushing" else low
            assert (hi[v] == hi[v][0]).all(), where_v
            assert int(hi[v][0]) in (low, high), f"{where_v}: {hi[v]} steps committed, expected {low} or {high}"
            # rows a ring retired before the kill: below the newest commit's or the newest add's lap
            need_lo = max(0, int(hi[v][0]) - lane_cap, last(evts, "adding") - lane_cap)
            assert (lo[v] <= need_lo).all(), f"{where_v}: committed rows lost: readable from {lo[v]}, not {need_lo}"
            assert (lo[v] >= int(hi[v][0]) - lane_cap).all(), where_v
            want_ids = shard_ids(v, LANES, SHARDS, int(lo[v].max()), int(hi[v][0]))
            ids = union.row_ids()
            np.testing.assert_array_equal(np.sort(ids[union.locate(ids)[0] == v]), np.sort(want_ids), where_v)
            check_content(union, want_ids, where_v)
            resume[v] = int(hi[v][0])
            kills.append(f"shard {v} at {evts[-1][0]} {evts[-1][1]}, {int(hi[v][0])} steps committed, "
                         f"readable from {int(lo[v].max())}")
        union.close()

        # the killed shards reopen (their dead writers' locks taken over) and take new rows
        for v in victims:
            with logged(caplog, "took over the writer lock"):
                reopened[v] = dr.ReplayBuffer.open_shard(url, shard=v, storage_options=so)
            reopened[v].extend(steps_rows(v, LANES, resume[v], 40))
            reopened[v].flush()

        def learner_caught_up() -> bool:
            beat = read_json(heartbeat)
            return (beat is not None and beat["batches"] >= batches_at_kill + batches_after
                    and all(beat["totals"][v] == resume[v] + 40 for v in victims))

        running = [p for s, p in writers.items() if s not in victims] + [learner]
        wait_until(learner_caught_up, "the learner to adopt the reopened shards' rows", running)
        wait_until(lambda: all(last(events(progress[s]), "flushed") >= flushed_at_kill[s] + 12
                               for s in flushed_at_kill), "the surviving writers to go on", running)
        for buf in reopened.values():
            buf.close()
        stop.touch()
        closed = {}
        for s, proc in writers.items():
            if s not in victims:
                finish(proc, f"writer {s}")
                evts = events(progress[s])
                assert evts[-1][0] == "closed"
                closed[s] = evts[-1][1]
        report = json.loads(finish(learner, "learner"))
    finally:
        for buf in reopened.values():
            buf.close()
        stop_all(procs)

    assert report["n_failures"] == 0, report["failures"]
    assert report["bad_weights"] == 0
    assert report["batches"] >= batches_at_kill + batches_after
    assert report["rows"] == 64 * report["batches"] == report["samples"]
    assert all(n > 0 for n in report["sampled_per_shard"]), report["sampled_per_shard"]
    assert 0 < report["updated"] <= report["rows"]

    final = {**closed, **{v: resume[v] + 40 for v in victims}}
    union = dr.ReplayBuffer.open(url, "r", storage_options=so)
    lo, hi = (x.reshape(SHARDS, LANES) for x in union.window())
    for s in range(SHARDS):
        # a full ring, also where a killed writer had retired rows past its commit: the 40 new
        # steps lapped those (a kill loses at most the 6 steps of one insert)
        assert (hi[s] == final[s]).all() and (lo[s] == max(0, final[s] - lane_cap)).all(), (s, lo[s], hi[s])
    # its last refresh came after the reopened shards closed; a survivor may commit once more after it
    assert all(report["totals"][v] == final[v] for v in victims), report["totals"]
    assert all(report["totals"][s] <= final[s] for s in range(SHARDS)), report["totals"]
    check_content(union, union.row_ids(), f"{where} after the run")
    assert len(union) == int((hi - lo).sum())
    union.close()
    print(f"\nshards {where}: kills: {'; '.join(kills)}; learner: {report['batches']} batches, "
          f"{report['rows']} rows checked, {report['refreshes']} refreshes adopted, "
          f"{report['stale_reads']} stale reads drawn again, per shard "
          f"{report['sampled_per_shard']}; final steps per shard {[final[s] for s in range(SHARDS)]}")


# ---- prioritized sampling over the union, in one process -------------------------------------

def make_union(path, shards: int, lanes: int, steps: int, lane_cap: int | None = None,
               **learner_options) -> tuple[str, list[dr.ReplayBuffer], dr.ReplayBuffer]:
    """A sharded buffer with ``steps`` committed steps in every lane of every shard; its writers
    (kept open) and a learner."""
    url = str(path)
    dr.ReplayBuffer.create(url, fields(), capacity=None if lane_cap is None else lane_cap * lanes, shards=shards,
                           num_envs=lanes, chunk_rows=8).close()
    writers = [dr.ReplayBuffer.open_shard(url, shard=s) for s in range(shards)]
    for s, w in enumerate(writers):
        w.extend(steps_rows(s, lanes, 0, steps))
        w.flush(durable=False)
    return url, writers, dr.ReplayBuffer.open(url, "r", **learner_options)


TD_BY_SHARD = np.array([0.25, 1.0, 2.0, 5.0])


@pytest.mark.parametrize("stratified", [True, False], ids=["stratified", "independent"])
def test_prioritized_draws_follow_per_shard_priorities(tmp_path, stratified):
    stats = pytest.importorskip("scipy.stats")
    steps, lanes = (12, 20, 7, 16), 2  # shards of different sizes: a class's mass is rows * priority
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, fields(), capacity=64 * lanes, shards=4, num_envs=lanes, chunk_rows=8).close()
    for s, n in enumerate(steps):
        with dr.ReplayBuffer.open_shard(url, shard=s) as w:
            w.extend(steps_rows(s, lanes, 0, n))
    sampler = dr.Prioritized(alpha=0.6, beta=0.4, stratified=stratified)
    buf = dr.ReplayBuffer.open(url, "r", sampler=sampler, seed=0)
    ids = buf.row_ids()
    shard_of = buf.locate(ids)[0]
    assert buf.update_priorities(ids, TD_BY_SHARD[shard_of]) == len(ids) == 2 * sum(steps)

    leaf = ((TD_BY_SHARD + sampler.eps) ** sampler.alpha).astype(np.float32)  # the float32 leaves
    mass = leaf.astype(np.float64) * np.array(steps) * lanes
    counts = np.zeros(4, np.int64)
    for _ in range(80):
        batch = buf.sample(250)
        shard = buf.locate(batch["index"])[0]
        counts += np.bincount(shard, minlength=4)
        want_weight = ((leaf[shard] / leaf.min()) ** -0.4).astype(np.float32)
        np.testing.assert_allclose(batch["weight"], want_weight, rtol=1e-6)
        for name, value in content(*buf.locate(batch["index"])).items():
            np.testing.assert_array_equal(batch[name], value)
    expected = mass / mass.sum() * counts.sum()
    fit = stats.chisquare(counts, expected)
    assert fit.pvalue > 1e-3, (counts, expected, fit)
    # the test can tell: the same counts are far from what uniform sampling over the rows gives
    uniform = np.array(steps) / sum(steps) * counts.sum()
    assert stats.chisquare(counts, uniform).pvalue < 1e-12, (counts, uniform)
    buf.close()


def test_stale_priority_updates_change_nothing(tmp_path):
    lane_cap = 16
    url, writers, buf = make_union(tmp_path / "b", shards=2, lanes=1, steps=lane_cap, lane_cap=lane_cap,
                                   sampler=dr.Prioritized(alpha=0.6, beta=0.4), seed=3)
    batch = buf.sample(64)
    ids = np.unique(batch["index"])
    shard = buf.locate(ids)[0]
    old0, live1 = ids[shard == 0], ids[shard == 1]
    assert len(old0) > 0 and len(live1) > 0
    assert buf.update_priorities(ids, np.full(len(ids), 0.5)) == len(ids)

    # writer 0 laps its ring: every row the learner drew from shard 0 is overwritten
    writers[0].extend(steps_rows(0, 1, lane_cap, lane_cap))
    writers[0].flush(durable=False)
    assert buf.refresh()
    lo, hi = buf.window()
    assert lo.tolist() == [lane_cap, 0] and hi.tolist() == [2 * lane_cap, lane_cap]
    before = buf.state_dict()["sampler"]
    reference = buf.sample(512, seed=11)

    assert buf.update_priorities(old0, np.full(len(old0), 1000.0)) == 0
    after = buf.state_dict()["sampler"]
    np.testing.assert_array_equal(after["leaves"], before["leaves"])
    assert after["max_priority"] == before["max_priority"]
    again = buf.sample(512, seed=11)
    for name in ("index", "weight", "obs"):
        np.testing.assert_array_equal(again[name], reference[name])

    # a mix: only the live ids (shard 1's, never overwritten) count and change
    mixed = np.concatenate([old0, live1])
    assert buf.update_priorities(mixed, np.full(len(mixed), 3.0)) == len(live1)
    leaves = buf.state_dict()["sampler"]["leaves"]
    assert (leaves != before["leaves"]).sum() == len(live1)
    for w in writers:
        w.close()
    buf.close()


def td_of(index: np.ndarray) -> np.ndarray:
    """TD errors as a function of the rows drawn: both learners update alike."""
    return (index % 7).astype(np.float64) * 0.3 + 0.05


@pytest.mark.parametrize("commits_after_snapshot", [False, True], ids=["same-commit", "newer-commit"])
def test_learner_restored_from_snapshot_draws_the_same_batches(tmp_path, commits_after_snapshot):
    url, writers, first = make_union(tmp_path / "b", shards=3, lanes=2, steps=30,
                                     sampler=dr.Prioritized(alpha=0.6, beta=0.4), seed=5)
    for _ in range(6):
        batch = first.sample(32)
        first.update_priorities(batch["index"], td_of(batch["index"]))
    first.save_snapshot(tmp_path / "snap")
    if commits_after_snapshot:  # the restored learner opens a newer commit than the snapshot's
        for s in (0, 2):
            writers[s].extend(steps_rows(s, 2, 30, 9))
            writers[s].flush(durable=False)
        assert first.refresh()
    draws = []
    for _ in range(5):
        batch = first.sample(32)
        first.update_priorities(batch["index"], td_of(batch["index"]))
        draws.append(batch)

    restored = dr.ReplayBuffer.load_snapshot(tmp_path / "snap", mode="r", sampler=dr.Prioritized(alpha=0.6, beta=0.4))
    assert restored.state_dict()["samples"] == 6 * 32
    for k, want in enumerate(draws):
        got = restored.sample(32)
        for name in ("index", "weight", "obs", "pos", "done"):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"batch {k} field {name}")
        assert restored.update_priorities(got["index"], td_of(got["index"])) == 32
    np.testing.assert_array_equal(restored.state_dict()["sampler"]["leaves"], first.state_dict()["sampler"]["leaves"])
    assert restored.state_dict()["samples"] == first.state_dict()["samples"] == 11 * 32
    for buf in (*writers, first, restored):
        buf.close()


# ---- a rate limiter with a fast and a slow actor ------------------------------------------------

SPI, ERROR_BUFFER, MIN_SIZE, BATCH, INSERT_STEPS, RL_LANES = 64.0, 256.0, 4, 32, 2, 2
"""An insert is 2 steps of 2 lanes (4 rows); error_buffer >= (BATCH + SPI * 4) / 2 = 144 as the
`RateLimiter` docs ask, so that neither side can wait for the other for good; SPI * MIN_SIZE <=
ERROR_BUFFER."""


LOWER_SLACK = SPI * INSERT_STEPS * RL_LANES
"""How far below ``spi * (I - min_size) - error_buffer`` the learner's samples S can be with two
actors: one insert of the other actor's (4 rows), times ``spi``.

An actor inserts ``k`` rows when ``S_p >= spi * (I + k - min_size) - error_buffer`` with ``I``
the other shards' inserts the learner last published plus its own rows (exactly) and ``S_p <= S``
the learner's last published count: alone it keeps the bound exactly. Two actors that check at the same moment
each count the other's rows before that one's insert is committed, so together they can pass it
by the other's insert, ``spi * k``; the insert is flushed right after it is added, so no more.
"""


def shard_rows(url: str) -> list[int]:
    """The rows each shard's last commit holds."""
    with dr.ReplayBuffer.open(url, "r") as buf:
        return buf.window()[1].reshape(2, -1).sum(axis=1).tolist()


@pytest.mark.slow  # subprocesses
def test_rate_limiter_fast_and_slow_actor(tmp_path):
    url = str(tmp_path / "buf")
    dr.ReplayBuffer.create(url, fields(), capacity=None, shards=2, num_envs=RL_LANES, chunk_rows=64).close()
    limits = {"spi": SPI, "error_buffer": ERROR_BUFFER, "min_size": MIN_SIZE}
    stop_actors, stop_learner = tmp_path / "stop-actors", tmp_path / "stop-learner"
    actors = {name: start("rl_actor", {"url": url, "shard": shard, "lanes": RL_LANES, "steps": INSERT_STEPS,
                                       "pause_s": pause, "timeout_s": SAFETY_S, "stop": str(stop_actors), **limits})
              for name, shard, pause in (("fast", 0, 0.0), ("slow", 1, 0.2))}
    # the learner starts once the fast actor holds all it may insert alone: it is held back at least
    # once however fast the learner samples later on a loaded machine
    alone = int(ERROR_BUFFER / SPI + MIN_SIZE)
    procs = list(actors.values())
    progress = Path(url) / OWN / "learner.json"
    try:
        wait_until(lambda: shard_rows(url)[0] >= alone, f"the fast actor to insert {alone} rows", procs)
        learner = start("rl_learner", {"url": url, "shards": 2, "seed": 1, "batch": BATCH, "timeout_s": 0.5,
                                       "stop": str(stop_learner), **limits})
        procs.append(learner)
        # run until the learner sampled 32,000 rows (~500 inserted at 64 samples per insert)
        wait_until(lambda: (read_json(progress) or {"samples": 0})["samples"] >= 32_000,
                   "the learner to sample 32,000 rows", procs)
        stop_actors.touch()  # the learner goes on sampling, so that blocked actors get through
        done = {name: json.loads(finish(proc, f"{name} actor")) for name, proc in actors.items()}
        stop_learner.touch()  # it stops at its next RateLimitTimeout (no actor inserts any more)
        report = json.loads(finish(learner, "learner"))
    finally:
        stop_all(procs)

    log = np.array(report["log"], dtype=np.int64)  # per batch: samples after it, inserts per shard seen
    samples, inserts = log[:, 0], log[:, 1:].sum(axis=1)
    assert report["failures"] == 0
    np.testing.assert_array_equal(samples, BATCH * np.arange(1, len(log) + 1))
    assert samples[-1] >= 32_000
    assert (inserts >= MIN_SIZE).all() and (np.diff(inserts) >= 0).all()
    upper = SPI * (inserts - MIN_SIZE) + ERROR_BUFFER
    assert (samples <= upper).all(), log[samples > upper][:5]
    deficit = SPI * (inserts - MIN_SIZE) - ERROR_BUFFER - samples
    # until the learner's first count reaches them, each actor counts its own rows only: alone it may
    # insert up to error_buffer / spi + min_size rows; past those rows of both, the bound is LOWER_SLACK
    started = inserts > 2 * (ERROR_BUFFER / SPI + MIN_SIZE)
    assert deficit[~started].max(initial=0) <= SPI * (ERROR_BUFFER / SPI + MIN_SIZE), log[~started][:5]
    assert deficit[started].max() <= LOWER_SLACK, (deficit[started].max(), log[started][deficit[started].argmax()])
    # the actors: both inserted, the fast one more; it was held back (else nothing was limited)
    assert done["fast"]["rows"] > done["slow"]["rows"] > 0
    assert done["fast"]["rows"] == RL_LANES * done["fast"]["steps"]
    assert done["fast"]["denied"] > 0
    assert inserts[-1] <= done["fast"]["rows"] + done["slow"]["rows"]
    assert report["timeouts"] >= 1  # how the learner learned that the actors stopped
    print(f"\nrate limiter: {len(log)} batches, {samples[-1]} rows sampled, {inserts[-1]} inserted "
          f"(fast {done['fast']['rows']}, denied {done['fast']['denied']}x; slow {done['slow']['rows']}); "
          f"samples - spi*(inserts-min) ranged {(-deficit - ERROR_BUFFER).min():.0f}.."
          f"{(-deficit - ERROR_BUFFER).max():.0f} "
          f"(bounds -{ERROR_BUFFER + LOWER_SLACK:.0f}..+{ERROR_BUFFER:.0f})")
