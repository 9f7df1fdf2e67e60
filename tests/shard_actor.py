"""Processes of a sharded buffer for tests/test_shards_processes.py: shard writers (actors) and
learners, run as ``python tests/shard_actor.py ROLE JOB_JSON``.

Every row is a pure function of where it lives (`content`: shard, lane, step), so a learner
checks each sampled row by `ReplayBuffer.locate` alone, whatever the timing of the writers.

Roles:

- ``writer``: writes its shard (extend or add, a random 1..``max_steps`` steps each, then flush)
  until the stop file appears, then closes. It appends to its progress file ``adding N`` before
  each add, ``flushing N`` / ``flushed N`` around each flush (N = steps per lane) and
  ``closed N`` at the end: the parent knows what was committed when it SIGKILLs the writer.
- ``learner``: samples the union (prioritized), refreshing before every batch, checks every row
  against `content`, updates priorities; a heartbeat file says how far it got; at the stop file
  it prints a JSON report.
- ``rl_actor``: an actor under a `RateLimiter`: ``insert_allowed(rows, wait=True)`` before each
  insert of ``steps`` steps (all lanes), then flush; ``pause_s`` between inserts (a slow actor).
- ``rl_learner``: a learner under the same limiter: logs ``(samples, inserts)`` after every
  batch; a `RateLimitTimeout` after the actors stopped ends it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np

FIELDS_SPEC = {"obs": ((), "int64"), "pos": ((3,), "float64"), "done": ((), "bool")}


def fields():
    import diskreplay as dr

    return {name: dr.Field(shape, dtype) for name, (shape, dtype) in FIELDS_SPEC.items()}


def content(shard, lane, step) -> dict[str, np.ndarray]:
    """The row at ``step`` of ``lane`` in shard ``shard`` (any broadcastable int arrays)."""
    shard, lane, step = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (shard, lane, step)))
    return {"obs": shard * 10**9 + lane * 10**6 + step,
            "pos": np.stack([shard, lane, step], -1).astype(np.float64),
            "done": step % 7 == 6}


def steps_rows(shard: int, lanes: int, first: int, n: int) -> dict[str, np.ndarray]:
    """Steps ``first .. first + n`` of every lane of ``shard``: arrays ``(n, lanes, ...)`` (one lane: ``(n, ...)``)."""
    rows = content(shard, np.arange(lanes)[None, :], np.arange(first, first + n)[:, None])
    return {k: v[:, 0] for k, v in rows.items()} if lanes == 1 else rows


def mismatches(batch: dict, located: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[str]:
    """Fields of ``batch`` rows that differ from `content` at the located (shard, lane, step)."""
    want = content(*located)
    bad = np.zeros(len(batch["index"]), bool)
    for name, value in want.items():
        got = np.asarray(batch[name])
        bad |= (got != value).reshape(len(bad), -1).any(axis=1)
    return [f"id {int(i)} at {tuple(int(x[j]) for x in located)}: obs {batch['obs'][j]!r}"
            for j, i in enumerate(batch["index"]) if bad[j]]


def write_json(path: str, obj) -> None:
    """Replace ``path`` with ``obj`` as JSON all at once (readers never see half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
    os.replace(tmp, path)


def writer(job: dict) -> None:
    import diskreplay as dr

    out = os.open(job["progress"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def say(line: str) -> None:
        os.write(out, (line + "\n").encode())

    shard, lanes, rng = job["shard"], job["lanes"], np.random.default_rng(job["seed"])
    buf = dr.ReplayBuffer.open_shard(job["url"], shard=shard, storage_options=job["storage_options"])
    hi = buf.window(committed=True)[1]
    step = int(hi[0])
    assert (hi == step).all(), hi
    say(f"start {step}")
    while not os.path.exists(job["stop"]):
        n = int(rng.integers(1, job["max_steps"] + 1))
        say(f"adding {step + n}")
        rows = steps_rows(shard, lanes, step, n)
        if rng.random() < 0.5:
            buf.extend(rows)
        else:
            for i in range(n):
                buf.add(**{k: v[i] for k, v in rows.items()})
        step += n
        say(f"flushing {step}")
        buf.flush()
        say(f"flushed {step}")
    buf.close()
    say(f"closed {step}")


def learner(job: dict) -> None:
    import diskreplay as dr

    buf = dr.ReplayBuffer.open(job["url"], "r", sampler=dr.Prioritized(alpha=0.6, beta=0.4), seed=job["seed"],
                               storage_options=job["storage_options"])
    shards, lanes = job["shards"], job["lanes"]
    rng = np.random.default_rng(job["seed"] + 1)
    report = {"batches": 0, "rows": 0, "failures": [], "n_failures": 0, "updated": 0, "refreshes": 0,
              "sampled_per_shard": [0] * shards, "bad_weights": 0}

    def totals() -> list[int]:
        return buf.window()[1].reshape(shards, lanes)[:, 0].tolist()

    while not os.path.exists(job["stop"]):
        report["refreshes"] += bool(buf.refresh())
        if len(buf) == 0:
            time.sleep(0.01)
            continue
        batch = buf.sample(job["batch"])
        located = buf.locate(batch["index"])
        bad = mismatches(batch, located)
        report["n_failures"] += len(bad)
        report["failures"] = (report["failures"] + bad)[:5]
        weight = batch["weight"]
        report["bad_weights"] += int(((weight <= 0) | (weight > 1) | ~np.isfinite(weight)).sum())
        report["rows"] += len(batch["index"])
        report["sampled_per_shard"] = (np.asarray(report["sampled_per_shard"])
                                       + np.bincount(located[0], minlength=shards)).tolist()
        report["updated"] += buf.update_priorities(batch["index"], rng.random(len(batch["index"])) * 2)
        report["batches"] += 1
        if report["batches"] % 5 == 0:
            write_json(job["heartbeat"], {"batches": report["batches"], "totals": totals(),
                                          "n_failures": report["n_failures"]})
    buf.refresh()
    report["totals"] = totals()
    report["samples"] = buf.state_dict()["samples"]
    report["stale_reads"] = buf.stats().stale_reads
    buf.close()
    print(json.dumps(report), flush=True)


def limiter(job: dict):
    import diskreplay as dr

    return dr.RateLimiter(samples_per_insert=job["spi"], error_buffer=job["error_buffer"], min_size=job["min_size"],
                          timeout_s=job["timeout_s"])


def rl_actor(job: dict) -> None:
    import diskreplay as dr

    shard, lanes, n = job["shard"], job["lanes"], job["steps"]
    buf = dr.ReplayBuffer.open_shard(job["url"], shard=shard, rate_limiter=limiter(job))
    step = denied = 0
    while not os.path.exists(job["stop"]):
        if not buf.insert_allowed(n * lanes):
            denied += 1
            assert buf.insert_allowed(n * lanes, wait=True) is True
        buf.extend(steps_rows(shard, lanes, step, n))
        step += n
        buf.flush(durable=False)
        if job["pause_s"]:
            time.sleep(job["pause_s"])
    total = int(buf.window()[1].sum())
    buf.close()
    print(json.dumps({"rows": total, "steps": step, "denied": denied}), flush=True)


def rl_learner(job: dict) -> None:
    import diskreplay as dr

    buf = dr.ReplayBuffer.open(job["url"], "r", seed=job["seed"], rate_limiter=limiter(job))
    log, timeouts, failures = [], 0, 0
    while True:
        buf.refresh()
        try:
            batch = buf.sample(job["batch"])
        except dr.RateLimitTimeout:
            timeouts += 1
            if os.path.exists(job["stop"]):
                break
            continue
        failures += len(mismatches(batch, buf.locate(batch["index"])))
        per_shard = buf.window()[1].reshape(job["shards"], -1).sum(axis=1).tolist()
        log.append([buf.state_dict()["samples"], *per_shard])
    buf.close()
    print(json.dumps({"log": log, "timeouts": timeouts, "failures": failures}), flush=True)


ROLES = {"writer": writer, "learner": learner, "rl_actor": rl_actor, "rl_learner": rl_learner}

if __name__ == "__main__":
    try:
        ROLES[sys.argv[1]](json.loads(sys.argv[2]))
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
