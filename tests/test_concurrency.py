"""One writer, several readers, in different processes: every row a reader gets is right, and
all of a reader's state belongs to one commit (issue #11, item 3).

Every row is a pure function of its row id (``RULES_CODE``, run by the writer, the readers and
this module alike): ``obs``, ``reward``, the episode ends of each lane (lengths cycling through a
fixed list; some ends terminated, some truncated), ``next_obs`` (the lane's next ``obs`` inside an
episode, a distinct final observation at its last step), the discounted return-to-go, the n-step
targets and the episode table a window must show. So a reader can check everything it gets
without asking the writer, and whatever timing the processes have.

- `test_live_ring_writer_and_three_readers`: a free-running writer wraps a small ring over and
  over (add, add to a subset of lanes, extend, flushes at random points, priority updates) while
  three reader processes sample plain batches / slices, n-step batches and the episode table /
  a sample-mode dataset, checking every row against the rules.
- `test_reader_behind_ring_writer_adopts_newest_commit`: the same property step by step, with a
  writer driven by commands and an in-process reader with a one-byte cache.
- `test_refreshed_reader_sees_returns_patched_by_later_commit`: the episodic return of steps in
  chunks the reader had cached before the episode ended.
- `test_prioritized_reader_samples_from_commit_that_retired_most_rows`: a reader of the commit a
  ring writer makes before overwriting rows (a raised lower bound, the last flush's priorities).
- `test_reader_opening_while_writer_creates_buffer`: a reader that starts before its writer.
- `test_live_derive_next_readers_while_writers_are_killed`: writers of a ``derive_next`` buffer
  (plain, and two shards) SIGKILLed again and again and restarted, while a live reader samples:
  every ``next_obs`` it returns is its row id's (issue #39, item 4).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import diskreplay as dr

RULES_CODE = r'''
import numpy as np
import diskreplay as dr

E = 2                                      # env lanes; row id = step * E + lane
LANE_CAP = 512                             # 8 chunks per lane: the ring wraps often
CAPACITY = E * LANE_CAP
CHUNK = 64
GAMMA = 0.9
DEFAULT_RETURN = -1000.0                   # no true return comes near it
SEQ_LEN, N_STEP = 8, 3
LENGTHS = (np.array([5, 13, 3, 21, 8, 1, 34, 2]), np.array([7, 2, 17, 11, 9, 40, 1]))  # per lane, cycling
CUM = tuple(np.cumsum(x) for x in LENGTHS)
PERIOD = tuple(int(x.sum()) for x in LENGTHS)
MAX_LEN = int(max(x.max() for x in LENGTHS))
FIELDS = {"obs": dr.Field((4,), "float32"), "next_obs": dr.Field((4,), "float32"),
          "reward": dr.Field((), "float32"), "terminated": dr.Field((), "bool"),
          "truncated": dr.Field((), "bool")}
CHECKED = ("obs", "next_obs", "reward", "terminated", "truncated")


def create(url, compression, seed=0):
    return dr.ReplayBuffer.create(url, FIELDS, capacity=CAPACITY, num_envs=E, chunk_rows=CHUNK,
                                  compression=compression, derive_next=("obs",), seed=seed,
                                  sampler=dr.Prioritized(alpha=0.6),
                                  episodic_return=dr.EpisodicReturn(gamma=GAMMA, default_return=DEFAULT_RETURN))


def episode(ids):
    """(first step, last step, ordinal in its lane) of the episode holding each row id."""
    ids = np.asarray(ids, dtype=np.int64)
    lane, step = ids % E, ids // E
    start, end, ordinal = (np.zeros_like(ids) for _ in range(3))
    for e in range(E):
        sel = lane == e
        q, r = np.divmod(step[sel], PERIOD[e])
        j = np.searchsorted(CUM[e], r, side="right")
        end[sel] = q * PERIOD[e] + CUM[e][j] - 1
        start[sel] = end[sel] - LENGTHS[e][j] + 1
        ordinal[sel] = q * len(LENGTHS[e]) + j
    return start, end, ordinal


def obs(ids):
    i = np.asarray(ids, dtype=np.float64)
    return np.stack([i, i + 0.5, -i, i % 7], -1).astype(np.float32)


def final_obs(ids):  # the observation after an episode's last step: never any row's obs (-0.5)
    i = np.asarray(ids, dtype=np.float64)
    return np.stack([i + 0.25, np.full_like(i, -0.5), i, 100 + i % 5], -1).astype(np.float32)


def reward(ids):
    return (((np.asarray(ids, dtype=np.int64) * 37) % 17 - 8) / 4).astype(np.float32)


def rows(ids):
    """The fields the writer adds for these row ids (any shape)."""
    ids = np.asarray(ids, dtype=np.int64)
    _, end, ordinal = episode(ids)
    last = ids // E == end
    term = last & ((ordinal + ids % E) % 3 != 2)
    return {"obs": obs(ids), "next_obs": np.where(last[..., None], final_obs(ids), obs(ids + E)),
            "reward": reward(ids), "terminated": term, "truncated": last & ~term}


def returns(ids):
    """Discounted return-to-go of each step to its episode's end (float64)."""
    ids = np.asarray(ids, dtype=np.int64)
    _, end, _ = episode(ids)
    out, disc = np.zeros(ids.shape), 1.0
    for i in range(MAX_LEN):
        out += np.where(ids // E + i <= end, disc * reward(ids + i * E).astype(np.float64), 0.0)
        disc *= GAMMA
    return out


def window(buf):
    """Per lane, the steps [lo, hi) the buffer shows (a reader: its commit's), by the public API."""
    ids = buf.row_ids()
    lane, step = ids % E, ids // E
    hi = np.asarray(buf.state_dict()["total"], dtype=np.int64)
    lo = np.array([step[lane == e].min() if (lane == e).any() else hi[e] for e in range(E)])
    return lo, hi


def check_rows(batch, ids, lo, hi, names=CHECKED, problems=None):
    """Count, per kind of problem, the rows of ``batch`` (at row ids ``ids``, any shape) that are
    wrong for a reader whose commit shows steps [lo, hi) per lane. Returns the rows with any."""
    problems = {} if problems is None else problems
    ids = np.asarray(ids, dtype=np.int64)
    lane, step = ids % E, ids // E
    bad = {"outside window": (step < lo[lane]) | (step >= hi[lane])}
    want = rows(ids)
    for name in names:
        got = np.asarray(batch[name])
        bad[name] = (got != want[name]).reshape(ids.shape + (-1,)).any(-1)
    if "return" in batch:
        got = np.asarray(batch["return"])
        ended = episode(ids)[1] < hi[lane]  # the episode's end is in the reader's commit
        exact = np.isclose(got, returns(ids), rtol=1e-5, atol=1e-5)
        bad["return stale (default, episode ended in the reader's commit)"] = ended & (got == DEFAULT_RETURN)
        bad["return wrong"] = (ended & ~exact & (got != DEFAULT_RETURN)) | (~ended & (got != DEFAULT_RETURN))
    anything = np.zeros(ids.shape, bool)
    for kind, flags in bad.items():
        if flags.any():
            problems[kind] = problems.get(kind, 0) + int(flags.sum())
        anything |= flags
    return int(anything.sum())


def nstep_reference(ids, hi):
    """reward, discount and next_obs of ``sample(n_step=N_STEP, gamma=GAMMA)`` from these starts,
    for a reader whose commit ends at ``hi``: k = min(n, steps left in the episode or the commit)."""
    ids = np.asarray(ids, dtype=np.int64)
    lane, step = ids % E, ids // E
    last = np.minimum(episode(ids)[1], hi[lane] - 1)
    k = np.minimum(N_STEP, last - step + 1)
    powers = GAMMA ** np.arange(N_STEP + 1, dtype=np.float64)
    offsets = np.minimum(np.arange(N_STEP)[None, :], (k - 1)[:, None])
    used = np.arange(N_STEP)[None, :] < k[:, None]
    r = reward(ids[:, None] + offsets * E).astype(np.float64)
    end_row = rows(ids + (k - 1) * E)
    return {"reward": (r * powers[None, :N_STEP] * used).sum(axis=1).astype(np.float32),
            "discount": (powers[k] * ~end_row["terminated"]).astype(np.float32),
            "next_obs": end_row["next_obs"]}


def check_nstep(batch, lo, hi, problems):
    ids = np.asarray(batch["index"])
    wrong = check_rows(batch, ids, lo, hi, ("obs", "terminated", "truncated"), problems)
    bad = np.zeros(len(ids), bool)
    for name, value in nstep_reference(ids, hi).items():
        flags = (np.asarray(batch[name]) != value).reshape(len(ids), -1).any(-1)
        if flags.any():
            problems["n-step " + name] = problems.get("n-step " + name, 0) + int(flags.sum())
        bad |= flags
    return wrong + int(bad.sum())  # rows wrong on either count (0 means all right)


def check_slices(batch, lo, hi, problems):
    """Slices: consecutive steps of one lane inside one episode, every row right."""
    index, start = np.asarray(batch["index"]), np.asarray(batch["start"])
    bad = (index != start[:, None] + np.arange(index.shape[1]) * E).any(1)
    bad |= episode(start)[1] < start // E + index.shape[1] - 1  # crosses an episode end
    if bad.any():
        problems["slice not inside one episode"] = problems.get("slice not inside one episode", 0) + int(bad.sum())
    wrong_rows = check_rows(batch, index, lo, hi, problems=problems)
    return wrong_rows + int(bad.sum()) * index.shape[1]


def check_episodes(table, lo, hi):
    """Problems in an EpisodeTable for the window [lo, hi): it must tile the window with the
    rule's episodes (the first may start late at lo, the last may be open at hi)."""
    problems = 0
    for e in range(E):
        sel = np.asarray(table.lane) == e
        start, length = np.asarray(table.start)[sel], np.asarray(table.length)[sel]
        complete = np.asarray(table.complete)[sel]
        if hi[e] <= lo[e]:
            problems += int(sel.sum())
            continue
        if len(start) == 0:
            problems += 1
            continue
        last = start + length - 1
        problems += int(start[0] != lo[e]) + int(last[-1] != hi[e] - 1) + int((start[1:] != last[:-1] + 1).sum())
        problems += int((length <= 0).sum())
        rule_start, rule_end, _ = episode(start * E + e)
        ended = rule_end == last
        problems += int((~ended & (rule_end < hi[e])).sum())     # an end the table missed
        problems += int((~ended[:-1]).sum())                      # only the newest may be open
        problems += int((rule_start[1:] != start[1:]).sum())      # only the oldest may start late
        problems += int((complete != (ended & (rule_start == start))).sum())
    return problems
'''

rules: dict = {}
exec(RULES_CODE, rules)
E, CHUNK, LANE_CAP, CAPACITY = rules["E"], rules["CHUNK"], rules["LANE_CAP"], rules["CAPACITY"]
DEFAULT_RETURN, GAMMA, N_STEP = rules["DEFAULT_RETURN"], rules["GAMMA"], rules["N_STEP"]
window = rules["window"]

# ---- the writer: driven by commands, or free-running for a while ------------------------------

WRITER_CODE = RULES_CODE + r'''
import json, os, sys, time
url, compression, mode = sys.argv[1], sys.argv[2], sys.argv[3]
buf = create(url, None if compression == "raw" else compression)
total = np.zeros(E, np.int64)
rng = np.random.default_rng(17)
stats = {"rows_checked": 0, "wrong": 0, "problems": {}, "flushes": 0, "priority_updates": 0}


def put(lanes, n, how):
    """The next n steps of these lanes, by extend or by n adds (a subset of lanes: env_ids)."""
    lanes = np.asarray(lanes, dtype=np.int64)
    ids = (total[lanes][None, :] + np.arange(n)[:, None]) * E + lanes[None, :]
    data = rows(ids)
    env_ids = None if len(lanes) == E else lanes
    if how == "extend":
        buf.extend(data, env_ids=env_ids)
    else:
        for i in range(n):
            buf.add(env_ids=env_ids, **{k: v[i] for k, v in data.items()})
    total[lanes] += n


def prioritize():
    """Sample (staged rows included), check the rows, and update their priorities."""
    batch = buf.sample(64)
    lo, hi = window(buf)
    stats["wrong"] += check_rows(batch, batch["index"], lo, hi, problems=stats["problems"])
    stats["rows_checked"] += len(batch["index"])
    buf.update_priorities(batch["index"], rng.random(64) * 4)
    stats["priority_updates"] += 1


def reply(**extra):
    print(json.dumps({"total": total.tolist(), "sequence": buf.stats().commit_sequence, **extra}), flush=True)


if mode == "commands":
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "put":
            put(cmd["lanes"], cmd["n"], cmd["how"])
        elif cmd["op"] == "flush":
            buf.flush()
        elif cmd["op"] == "prioritize":
            prioritize()
        reply()
    buf.close()
else:  # free-running: "ready" after a first commit, then "go" starts random writes for `seconds`
    seconds, rounds, stop_path = float(mode), int(sys.argv[4]), sys.argv[5]
    put(np.arange(E), 300, "extend")
    buf.flush()
    reply(ready=True)
    assert sys.stdin.readline().strip() == "go"
    started = time.monotonic()
    # and on until every lane went `rounds` times round the ring (a busy machine), at most 60 s
    while (time.monotonic() < started + seconds or total.min() < rounds * LANE_CAP) and time.monotonic() < started + 60:
        u = rng.random()
        one = [int(np.argmin(total)) if rng.random() < 0.7 else int(rng.integers(E))]  # keep lanes close
        if u < 0.4:
            put(np.arange(E), int(rng.integers(1, 3 * CHUNK)), "extend")
        elif u < 0.55:
            put(one, int(rng.integers(1, 2 * CHUNK)), "extend")
        elif u < 0.8:
            put(np.arange(E), int(rng.integers(1, 12)), "add")
        else:
            put(one, int(rng.integers(1, 12)), "add")
        if rng.random() < 0.3:
            buf.flush(durable=bool(rng.random() < 0.3))
            stats["flushes"] += 1
        if rng.random() < 0.1:
            prioritize()
    buf.close()
    open(stop_path, "w").close()
    reply(done=True, **stats)
'''

# ---- the readers: each checks every row it gets, then reports one JSON line -------------------

READER_CODE = RULES_CODE + r'''
import json, os, sys, time, traceback
kind, url, stop_path = sys.argv[1], sys.argv[2], sys.argv[3]
stats = {"kind": kind, "rows_checked": 0, "wrong": 0, "problems": {}, "batches": 0, "refreshes": 0,
         "refresh_moved": 0, "stale_absorbed": 0, "episode_tables": 0, "episode_problems": 0,
         "first_min_id": None, "late_min_id": None, "max_id": 0, "error": None, "timed_out": False}
commits = set()
STARTED = time.monotonic()


def count_refreshes(buf):
    """Count a dataset's own refresh() calls (and those of its stale reads)."""
    plain = buf.refresh

    def counted():
        moved = plain()
        stats["refreshes"] += 1
        stats["refresh_moved"] += bool(moved)
        return moved
    buf.refresh = counted


def seen(buf, ids):
    commits.add(buf.stats().commit_sequence)
    stats["stale_absorbed"] = buf.stats().stale_reads  # each one adopted the newest commit and drew again
    ids = np.asarray(ids)
    stats["batches"] += 1
    stats["late_min_id"] = int(ids.min())
    if stats["first_min_id"] is None:
        stats["first_min_id"] = int(ids.min())
    stats["max_id"] = max(stats["max_id"], int(ids.max()))


def too_long():
    """The writer should have finished long ago (it died?): stop, and say so."""
    stats["timed_out"] = time.monotonic() > STARTED + 120
    return stats["timed_out"]


def refresh(buf):
    stats["refreshes"] += 1
    stats["refresh_moved"] += bool(buf.refresh())


def plain_round(buf, i):
    if i % 3 == 2:
        refresh(buf)
    batch = buf.sample(256)
    lo, hi = window(buf)  # the commit the batch was drawn from (sample may have moved it)
    stats["wrong"] += check_rows(batch, batch["index"], lo, hi, problems=stats["problems"])
    stats["rows_checked"] += batch["index"].size
    seen(buf, batch["index"])


def slices_round(buf, i):
    if i % 3 == 2:
        refresh(buf)
    batch = buf.sample(64, seq_len=SEQ_LEN)
    lo, hi = window(buf)
    stats["wrong"] += check_slices(batch, lo, hi, stats["problems"])
    stats["rows_checked"] += batch["index"].size
    seen(buf, batch["index"])
    batch = buf.sample(64, n_step=N_STEP, gamma=GAMMA)
    lo, hi = window(buf)
    stats["wrong"] += check_nstep(batch, lo, hi, stats["problems"])
    stats["rows_checked"] += batch["index"].size
    seen(buf, batch["index"])
    lo, hi = window(buf)
    stats["episode_problems"] += check_episodes(buf.episodes(), lo, hi)
    stats["episode_tables"] += 1


def open_when_written():
    """The buffer, once it holds committed rows (the parent starts us after the writer's first
    commit of rows: this waits only if that ever changes)."""
    buf = dr.ReplayBuffer.open(url, "r")
    while len(buf) == 0:
        time.sleep(0.01)
        buf.refresh()
    return buf


def main():
    if kind == "dataset":
        import torch.utils.data
        ds = open_when_written().as_dataset(128, mode="sample", refresh_every=4)
        dsbuf = ds.reader.get()  # the buffer the dataset samples from (this process, 0 workers)
        count_refreshes(dsbuf)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
        for batch in loader:
            batch = {k: v.numpy() for k, v in batch.items()}
            lo, hi = window(dsbuf)  # the generator is paused at its yield: same commit
            stats["wrong"] += check_rows(batch, batch["index"], lo, hi, problems=stats["problems"])
            stats["rows_checked"] += batch["index"].size
            seen(dsbuf, batch["index"])
            if stats["batches"] == 1:
                print("ready", flush=True)
            if os.path.exists(stop_path) or too_long():
                break
        return
    buf = open_when_written()
    one_round = plain_round if kind == "plain" else slices_round
    i = 0
    while True:
        stopping = os.path.exists(stop_path) or too_long()
        one_round(buf, i)
        i += 1
        if i == 1:
            print("ready", flush=True)
        if stopping:
            break


try:
    main()
except BaseException:
    stats["error"] = traceback.format_exc()
stats["commits_seen"] = len(commits)
print(json.dumps(stats), flush=True)
sys.exit(1 if stats["error"] else 0)
'''


def _json_line(proc: subprocess.Popen, who: str) -> dict:
    line = proc.stdout.readline()
    assert line, f"{who} ended without a report (exit {proc.wait()})"
    return json.loads(line)


COMPRESSIONS = pytest.mark.parametrize("compression", ["raw", "zstd"])


@pytest.mark.slow
@COMPRESSIONS
def test_live_ring_writer_and_three_readers(tmp_path, compression):
    """A writer wraps a 2 x 512-row ring over and over (2 s, and at least 5 rounds per lane)
    while three reader processes sample: plain batches (refreshing every third), slices +
    n-step batches + the episode table, and a sample-mode dataset (refresh_every=4). Every row
    any of them gets is checked against the rules; none may get a wrong one or any exception
    (StaleReadError included; EmptyBufferError too: the readers start after the writer's first
    commit of rows). Their windows must really move: several commits each, and late batches
    from well past the ring's first round."""
    url, stop = str(tmp_path / "ring"), str(tmp_path / "writer-done")
    writer = subprocess.Popen([sys.executable, "-c", WRITER_CODE, url, compression, "2", "5", stop],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    readers = {}
    try:
        assert _json_line(writer, "the writer").get("ready")  # created, first rows committed
        for kind in ("plain", "slices", "dataset"):
            readers[kind] = subprocess.Popen([sys.executable, "-c", READER_CODE, kind, url, stop],
                                             stdout=subprocess.PIPE, text=True)
        for kind, proc in readers.items():  # each opened the buffer and checked a first batch
            line = proc.stdout.readline()
            assert line.strip() == "ready", f"reader {kind}: {line!r}{proc.stdout.read()}"
        writer.stdin.write("go\n")
        writer.stdin.flush()
        done = _json_line(writer, "the writer")
        reports = {kind: _json_line(proc, f"reader {kind}") for kind, proc in readers.items()}
        codes = {kind: proc.wait(timeout=60) for kind, proc in readers.items()}
        assert writer.wait(timeout=60) == 0
    finally:
        for proc in [writer, *readers.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    checked = sum(r["rows_checked"] for r in reports.values())
    wrong = sum(r["wrong"] for r in reports.values())
    stale = sum(r["stale_absorbed"] for r in reports.values())
    moved = sum(r["refresh_moved"] for r in reports.values())
    problems: dict = {}
    for r in reports.values():
        for k, v in r["problems"].items():
            problems[k] = problems.get(k, 0) + v
    print(f"\nlive ring writer + 3 readers ({compression}): reader rows checked {checked}, wrong {wrong}"
          f"{' ' + str(problems) if problems else ''}; {stale} stale reads absorbed by sample(), "
          f"{moved} refresh() calls moved to a newer commit; episode tables checked "
          f"{reports['slices']['episode_tables']}, wrong {reports['slices']['episode_problems']}; writer: "
          f"{sum(done['total'])} rows ({min(done['total']) // LANE_CAP} ring rounds), {done['flushes']} flushes, "
          f"{done['priority_updates']} priority updates, its own sampled rows checked {done['rows_checked']}, "
          f"wrong {done['wrong']}")
    for kind, r in reports.items():
        print(f"  reader {kind}: {r['rows_checked']} rows in {r['batches']} batches, wrong {r['wrong']}, "
              f"{r['commits_seen']} commits seen, {r['stale_absorbed']} stale reads absorbed, "
              f"{r['refresh_moved']}/{r['refreshes']} refreshes moved, row ids {r['first_min_id']} (first) "
              f"→ {r['late_min_id']} (late, min of last batch) … {r['max_id']} (max)")
    failed = {kind: r["error"] or f"exit {codes[kind]}" for kind, r in reports.items() if r["error"] or codes[kind]}
    assert not failed, "\n".join(f"reader {kind} died:\n{error}" for kind, error in failed.items())
    for kind, r in reports.items():
        assert not r["timed_out"], f"reader {kind} never saw the writer finish"
    assert done["wrong"] == 0, f"the writer's own samples: {done['problems']}"
    assert min(done["total"]) >= 5 * LANE_CAP, "every lane went round the ring 5 times"
    for kind, r in reports.items():
        assert r["wrong"] == 0, f"reader {kind}: {r['wrong']} wrong rows: {r['problems']}"
        assert r["rows_checked"] > 2000, f"reader {kind} checked only {r['rows_checked']} rows"
        assert r["commits_seen"] >= 5, f"reader {kind} saw {r['commits_seen']} commits: its window did not move"
        assert r["late_min_id"] > CAPACITY, f"reader {kind} never got past the ring's first round"
    assert reports["slices"]["episode_problems"] == 0 and reports["slices"]["episode_tables"] > 10
    assert reports["plain"]["refresh_moved"] > 0 and reports["slices"]["refresh_moved"] > 0


# ---- the same property step by step -------------------------------------------------------------

class Writer:
    """The writer process, one command at a time (each answered with its totals and commit)."""

    def __init__(self, url: str, compression: str):
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER_CODE, url, compression, "commands"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def do(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the writer died on {cmd} (exit {self.proc.wait()})"
        return json.loads(line)

    def put(self, n: int, how: str = "extend", lanes=tuple(range(E))) -> dict:
        return self.do(op="put", lanes=list(lanes), n=n, how=how)

    def close(self) -> None:
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0


def assert_right(batch: dict, ids, buf: dr.ReplayBuffer, what: str, check=None) -> None:
    lo, hi = window(buf)
    problems: dict = {}
    wrong = (check or (lambda b, lo, hi, p: rules["check_rows"](b, ids, lo, hi, problems=p)))(batch, lo, hi, problems)
    assert wrong == 0, f"{what}: {wrong} wrong rows: {problems}"


def assert_same_batches(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=f"{what}: {name}")


def assert_same_commit(reader: dr.ReplayBuffer, newest: dr.ReplayBuffer) -> None:
    """Everything a reader shows is the newest commit's: window, episodes, rows (next_obs and
    return included), and the sampler (same draws from the same seed, so the same priorities)."""
    np.testing.assert_array_equal(reader.row_ids(), newest.row_ids())
    table, want = reader.episodes(), newest.episodes()
    for name in ("lane", "start", "length", "complete"):
        np.testing.assert_array_equal(getattr(table, name), getattr(want, name), err_msg=f"episodes().{name}")
    lo, hi = window(reader)
    assert rules["check_episodes"](table, lo, hi) == 0
    ids = reader.row_ids()
    assert_right(reader[ids], ids, reader, "every row")
    for options in ({}, {"n_step": N_STEP, "gamma": GAMMA}, {"seq_len": rules["SEQ_LEN"]}):
        got = reader.sample(256, seed=5, **options)
        assert_same_batches(got, newest.sample(256, seed=5, **options), f"sample({options})")
        check = None
        if "n_step" in options:
            check = rules["check_nstep"]
        elif "seq_len" in options:
            check = rules["check_slices"]
        assert_right(got, got["index"], reader, f"sample({options})", check)


@COMPRESSIONS
def test_reader_behind_ring_writer_adopts_newest_commit(tmp_path, compression):
    """A reader with a one-byte cache (every read fetches) reads, the writer wraps the ring past
    the reader's whole window and commits: reading overwritten ids raises StaleReadError, after
    which the reader is wholly on the newest commit. A cold reader's sample() in the same
    situation does not raise and returns rows of the newest commit."""
    url = str(tmp_path / "ring")
    writer = Writer(url, compression)
    writer.put(300)
    for how, lanes in (("add", [1]), ("extend", [0]), ("add", [0, 1])):  # lanes apart, an add mix
        writer.put(37, how, lanes)
    writer.do(op="prioritize")
    first = writer.do(op="flush")
    # a one-slot cache, not memory maps: a mapped reader keeps the files of its commit mapped
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=1, memory_map=False)
    cold = dr.ReplayBuffer.open(url, "r", cache_bytes=1, memory_map=False)
    lo, hi = window(reader)
    np.testing.assert_array_equal(hi, first["total"])
    old = reader.row_ids()
    newest_chunk = old[(old // E) >= hi[old % E] - CHUNK]
    assert_right(reader[newest_chunk], newest_chunk, reader, "rows before the wrap")
    assert rules["check_episodes"](reader.episodes(), lo, hi) == 0

    # the writer goes round the ring past everything the readers can see, and commits
    writer.put(LANE_CAP - 300)
    writer.do(op="prioritize")
    writer.put(250, "extend", [0])
    writer.put(29, "add")
    writer.put(300 + CHUNK)
    writer.do(op="prioritize")
    last = writer.do(op="flush")
    assert min(last["total"]) - LANE_CAP > max(first["total"])  # no step the readers saw is left

    oldest_chunks = old[(old // E) < lo[old % E] + 2 * CHUNK]  # never fetched by this reader
    with pytest.raises(dr.StaleReadError, match="overwritten by the writer") as info:
        reader.rows(oldest_chunks)
    assert isinstance(info.value, IndexError)
    newest = dr.ReplayBuffer.open(url, "r")
    np.testing.assert_array_equal(newest.state_dict()["total"], last["total"])
    assert_same_commit(reader, newest)  # straight after the error, without a refresh() by us
    assert reader.refresh() is False

    batch = cold.sample(256)  # drawn from its old window: the rows are gone; it adopts and draws again
    lo, hi = window(newest)
    lane, step = batch["index"] % E, batch["index"] // E
    assert ((step >= lo[lane]) & (step < hi[lane])).all()
    assert_right(batch, batch["index"], cold, "cold reader's sample")
    assert_same_commit(cold, newest)
    assert cold.refresh() is False
    for buf in (reader, cold, newest):
        buf.close()
    writer.close()


@COMPRESSIONS
def test_refreshed_reader_sees_returns_patched_by_later_commit(tmp_path, compression):
    """Lane 0's episode of steps 51..84 spans the chunk boundary at step 64. A reader reads its
    first steps while it is open (their return: the default), the writer ends it and commits,
    the reader refreshes: the episode is listed complete, so every one of its steps must give
    the true return, also those in the chunk the reader had cached before the end."""
    url = str(tmp_path / "ring")
    writer = Writer(url, compression)
    writer.put(70)
    writer.do(op="flush")
    start, end, _ = rules["episode"](np.array([51 * E]))
    assert (start[0], end[0]) == (51, 84)
    ids = np.arange(51, 70) * E
    reader = dr.ReplayBuffer.open(url, "r")
    assert (reader[ids]["return"] == DEFAULT_RETURN).all()  # open episode
    writer.put(20)
    writer.do(op="flush")
    assert reader.refresh()
    table = reader.episodes()
    ours = (table.lane == 0) & (table.start == 51)
    assert table.complete[ours].tolist() == [True] and table.length[ours].tolist() == [34]
    ids = np.arange(51, 85) * E
    fresh = dr.ReplayBuffer.open(url, "r")
    np.testing.assert_allclose(fresh[ids]["return"], rules["returns"](ids), rtol=1e-5)
    got = reader[ids]["return"]
    stale = ids[got == DEFAULT_RETURN] // E
    assert not len(stale), (f"steps {stale.tolist()} of lane 0 still give the default return after the reader "
                            f"adopted the commit that ended their episode (fresh reader: the true return)")
    np.testing.assert_allclose(got, rules["returns"](ids), rtol=1e-5)
    for buf in (reader, fresh):
        buf.close()
    writer.close()


@COMPRESSIONS
def test_prioritized_reader_samples_from_commit_that_retired_most_rows(tmp_path, compression):
    """Before overwriting a full ring the writer commits a raised lower bound (a "retire"
    commit), with the state (sampler priorities) of its last flush. Here the writer extends both
    lanes by all but 10 steps of the ring without a flush: a reader of that commit sees 10 rows
    per lane, while the saved priorities still cover the whole ring. sample() must draw from the
    20 readable rows, not fail."""
    url = str(tmp_path / "ring")
    writer = Writer(url, compression)
    writer.put(LANE_CAP)
    writer.do(op="flush")
    writer.put(LANE_CAP - 10)  # whole chunks are written at once: lower is raised first
    reader = dr.ReplayBuffer.open(url, "r")
    lo, hi = window(reader)
    assert lo.tolist() == [LANE_CAP - 10] * E and hi.tolist() == [LANE_CAP] * E
    for options in ({}, {"n_step": N_STEP, "gamma": GAMMA}):
        batch = reader.sample(256, **options)
        check = rules["check_nstep"] if options else None
        assert_right(batch, batch["index"], reader, f"sample({options})", check)
    reader.close()
    writer.close()


def test_reader_opening_while_writer_creates_buffer(tmp_path, monkeypatch):
    """A reader may start before its writer. While `create` writes the buffer (the main store,
    then the side store of derive_next) a reader that opens it must find no buffer yet
    (NotABufferError: try again) or an empty one, never a damaged one."""
    from diskreplay.buffer import setup
    url = str(tmp_path / "ring")
    create = setup.create_storage
    seen = []

    def create_then_open(plan, options, commit=True):
        storage = create(plan, options, commit)
        try:
            with dr.ReplayBuffer.open(url, "r") as buf:
                seen.append(f"{len(buf)} rows")
        except dr.NotABufferError:
            seen.append("no buffer yet")
        except Exception as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
        return storage

    monkeypatch.setattr(setup, "create_storage", create_then_open)
    rules["create"](url, "zstd").close()
    monkeypatch.undo()
    assert len(seen) == 2, seen  # after the main store, after the side store
    assert all(what in ("no buffer yet", "0 rows") for what in seen), seen
    with dr.ReplayBuffer.open(url, "r") as buf:
        assert len(buf) == 0


# ---- live readers of a derive_next buffer while its writers are killed and restarted -----------

KILLED_RULES_CODE = r'''
import numpy as np


def content(shard, lane, step):
    """The row at ``step`` of ``lane`` in ``shard``: episodes of 1 to a few steps; the final
    observation after an episode's last step is never any row's ``obs`` (last entry < 0). The
    ``frame`` makes a main commit take a while after the side store's: readers can come between."""
    shard, lane, step = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (shard, lane, step)))
    end = (step * 5 + (shard * 7 + lane) * 3) % 7 < 3

    def obs(at):
        return np.stack([at, lane, shard, at % 13], -1).astype(np.float32)

    final = np.stack([step, lane, shard, -1 - step % 13], -1).astype(np.float32)
    return {"obs": obs(step), "next_obs": np.where(end[..., None], final, obs(step + 1)),
            "terminated": end, "truncated": np.zeros(end.shape, bool),
            "frame": np.broadcast_to((step % 251).astype(np.uint8)[..., None], end.shape + (4096,))}
'''

KILLED_WRITER_CODE = KILLED_RULES_CODE + r'''
import json, os, sys, traceback
import diskreplay as dr


def write_forever(job):
    """Append random runs of steps to every lane, each flushed (durable or not), until killed."""
    try:
        shard = job["shard"]
        buf = (dr.ReplayBuffer.open(job["url"], "r+") if shard is None
               else dr.ReplayBuffer.open_shard(job["url"], shard, "r+"))
        rng = np.random.default_rng(job["seed"])
        total = np.array(buf.state_dict()["total"], dtype=np.int64)
        lanes = np.arange(len(total))
        while True:
            n = int(rng.integers(100, 300))
            buf.extend(content(shard or 0, lanes[None, :], total[None, :] + np.arange(n)[:, None]))
            total += n
            buf.flush()
    except BaseException:
        with open(job["errors"], "a") as fh:
            fh.write(traceback.format_exc())
        os._exit(1)


for line in sys.stdin:  # a fork server: writers start in milliseconds, diskreplay imported once
    cmd = json.loads(line)
    if cmd["op"] == "spawn":
        pid = os.fork()
        if pid == 0:
            write_forever(cmd["job"])
        print(pid, flush=True)
    elif cmd["op"] == "reap":
        print(os.waitpid(cmd["pid"], 0)[1], flush=True)
'''

killed_rules: dict = {}
exec(KILLED_RULES_CODE, killed_rules)
KILLED_FIELDS = {"obs": dr.Field((4,), "float32"), "next_obs": dr.Field((4,), "float32"),
                 "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool"),
                 "frame": dr.Field((4096,), "uint8")}
KILLS = 20
KILLED_CHECKED = ("obs", "next_obs", "terminated")  # truncated: a restart cuts the open episode


class WriterForks:
    """A process with diskreplay imported that forks writers (`KILLED_WRITER_CODE`) and reaps them."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER_CODE], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, **cmd) -> int:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def spawn(self, **job) -> int:
        return self._ask(op="spawn", job=job)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        self._ask(op="reap", pid=pid)  # gone for good before the next writer opens

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def wrong_rows(buf: dr.ReplayBuffer, batch: dict) -> list[tuple[int, str]]:
    """(row id, field) of every value of ``batch`` that is not the rule's for its row id."""
    ids = np.asarray(batch["index"]).reshape(-1)
    want = killed_rules["content"](*buf.locate(ids))
    return [(int(ids[i]), name) for name in KILLED_CHECKED
            for i in np.flatnonzero((np.asarray(batch[name]) != want[name]).reshape(len(ids), -1).any(-1))]


@pytest.mark.parametrize("shards", [None, 2], ids=["plain", "sharded"])
def test_live_derive_next_readers_while_writers_are_killed(tmp_path, shards):
    """Writer processes append to a ``derive_next`` buffer (episodes of a few steps, flushes
    now and then) and are SIGKILLed at random moments, each restarted on the same buffer (its
    open episodes cut) while a live reader (a learner over two shards) refreshes and samples:
    every ``obs``, ``next_obs`` and ``terminated`` it returns is the rule's for the row id, and
    after the last kill, so is every row it shows; so are those of a reader opened then."""
    url, errors = str(tmp_path / "buf"), str(tmp_path / "errors.txt")
    rng = np.random.default_rng(39)
    dr.ReplayBuffer.create(url, KILLED_FIELDS, num_envs=2, chunk_rows=16, derive_next=("obs",), shards=shards,
                           compression=None).close()
    writers = [None] if shards is None else list(range(shards))
    for shard in writers:
        with (dr.ReplayBuffer.open(url, "r+") if shard is None else dr.ReplayBuffer.open_shard(url, shard)) as first:
            first.extend(killed_rules["content"](shard or 0, np.arange(2)[None, :], np.arange(40)[:, None]))
    reader = dr.ReplayBuffer.open(url)
    forks, wrong, checked = WriterForks(), [], 0
    try:
        for _ in range(KILLS):
            pids = [forks.spawn(url=url, shard=shard, seed=int(rng.integers(2**31)), errors=errors)
                    for shard in writers]
            deadline = time.monotonic() + float(rng.uniform(0.1, 0.4))
            moved = False
            while not (moved and time.monotonic() > deadline):  # then killed right after an adoption
                spell = time.monotonic() + float(rng.uniform(0.05, 0.2))  # some commits go by unseen
                while time.monotonic() < spell:
                    batch = reader.sample(256)
                    wrong += wrong_rows(reader, batch)
                    checked += len(batch["index"])
                moved = reader.refresh()
            for pid in pids:
                forks.kill(pid)
    finally:
        forks.close()
    assert not os.path.exists(errors), open(errors).read()
    reader.refresh()
    ids = reader.row_ids()
    wrong += wrong_rows(reader, {"index": ids, **reader[ids]})
    print(f"\nlive derive_next reader ({'plain' if shards is None else f'{shards} shards'}): {checked} sampled "
          f"rows and {len(ids)} rows at the end checked, {len(wrong)} wrong")
    assert not wrong, f"{len(wrong)} wrong values, e.g. {wrong[:5]}"
    late = dr.ReplayBuffer.open(url)
    np.testing.assert_array_equal(late.row_ids(), ids)
    assert wrong_rows(late, {"index": ids, **late[ids]}) == []
    assert len(ids) > 2 * 40 * len(writers) and checked > 0
