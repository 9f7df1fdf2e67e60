"""Coordination of actors and learners: what each operation asks of the store, how fast a learner
updates over many shards, and what the requests of an actor-learner job cost on S3.

Workload: bench_shards' MuJoCo-like rows (obs 17 f32, action 6 f32, reward, next_obs 17 f32,
terminated, truncated; 166 B). S3 is moto in a child process behind tests/s3server.py's proxy,
which counts requests and adds ``--latency-ms`` to each (default 20).

1. Requests per operation, counted at the proxy, for S = ``--shards`` shards (default 4,16,64):
   an actor's rate-limit check (``insert_allowed``) with the serverless limiter (the learner's
   progress object) and with the counts kept by a Ray actor (``diskreplay.ray.EngineCounts``);
   an actor's commit of ``--flush-every`` rows; a learner's rate-limited ``sample(256)`` (its
   progress is written by a thread of its own, at most every 50 ms; with the engine not at all);
   a learner's ``refresh()`` after k = 2 shards and after every shard committed.
2. Learner updates per second with S shards against 1 (same rows in all, a ring of ``--rows``):
   ``sample(256)`` with ``Prioritized``, ``update_priorities`` of the batch, ``refresh()`` every 10
   updates, while a writer thread of this process commits ``--flush-every`` rows to one shard
   after another every ``--commit-ms``. Interleaved rounds of ``--seconds`` each, medians; on
   local disk and on S3 (``--s3-rows``; the writers direct to moto, the learner through the proxy).
3. The S3 request cost per hour of the actors-learner example at ``--actors`` actors (default
   100), computed from section 1's counts, ``--steps-per-s`` steps per actor and
   ``--updates-per-s`` learner updates (a refresh every 10), at S3 Standard's list prices.

Usage: python tools/bench_coordination.py [--quick] [--shards 4,16,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import benchlib as bl  # noqa: E402
from bench_shards import BUCKET, FIELDS, columns, start_s3  # noqa: E402
from s3server import FaultProxy  # noqa: E402

import diskreplay as dr  # noqa: E402

PACKAGES = ["diskreplay", "numpy", "zarr", "s3fs", "moto", "ray"]
BATCH = 256
REFRESH_EVERY = 10
LONG_FLUSH = 1024
CHECKS = 20
PUT_PRICE, GET_PRICE = 0.005 / 1000, 0.0004 / 1000  # S3 Standard, us-east-1: PUT/LIST and GET, per request
log = bl.log


def limiter(counts: Any = None) -> dr.RateLimiter:
    return dr.RateLimiter(samples_per_insert=1.0, error_buffer=1e9, min_size=1, timeout_s=60, counts=counts)


def new_buffer(base: str, so: dict | None, shards: int, rows: int, flush_every: int) -> str:
    """A sharded ring of ``rows`` rows over ``shards`` shards, every shard filled with its share."""
    url = f"{base}/{shards}-{uuid.uuid4().hex[:8]}"
    per_shard = rows // shards
    dr.ReplayBuffer.create(url, FIELDS, capacity=per_shard, shards=shards, chunk_rows=max(flush_every, 256),
                           compression=None, storage_options=so).close()
    for s in range(shards):
        with dr.ReplayBuffer.open_shard(url, s, storage_options=so) as w:
            w.extend(columns(per_shard, s))
    return url


def warm(proxy: FaultProxy, buf: dr.ReplayBuffer) -> None:
    """Sample until a batch reads nothing from the store (every row cached), at most 200 times."""
    for _ in range(200):
        proxy.reset_stats()
        buf.sample(BATCH)
        if proxy.count("", "GET") == 0:
            return


def counted(proxy: FaultProxy, action: Callable[[], Any], times: int) -> tuple[float, float]:
    """``(GETs, other requests)`` per call of ``action``, at the proxy."""
    proxy.reset_stats()
    for _ in range(times):
        action()
    gets = proxy.count("", "GET")
    return gets / times, (sum(proxy.hits.values()) - gets) / times


def requests_per_operation(so: dict, proxy: FaultProxy, shards: int, args: argparse.Namespace,
                           engine: Any) -> dict[str, tuple[float, float]]:
    via = {**so, "endpoint_url": proxy.endpoint}
    url = new_buffer(f"s3://{BUCKET}/ops", so, shards, shards * 512, args.flush_every)
    out = {}
    with dr.ReplayBuffer.open(url, "r", rate_limiter=limiter(), storage_options=via) as lrn:
        warm(proxy, lrn)
        lrn.learner_rank().publish()
        out["learner sample(256), serverless limiter"] = counted(proxy, lambda: lrn.sample(BATCH), 50)
        lrn.learner_rank().publish()
    if engine is not None:
        with dr.ReplayBuffer.open(url, "r", rate_limiter=limiter(engine), storage_options=via) as lrn:
            warm(proxy, lrn)
            out["learner sample(256), engine limiter"] = counted(proxy, lambda: lrn.sample(BATCH), 50)
    with dr.ReplayBuffer.open_shard(url, 0, rate_limiter=limiter(), storage_options=via) as w:
        out["actor check, serverless limiter"] = counted(proxy, lambda: w.insert_allowed(1), CHECKS)
        rows = iter(range(10**6))
        for flush in (args.flush_every, LONG_FLUSH):
            out[f"actor commit of {flush} rows"] = counted(
                proxy, lambda flush=flush: (w.extend(columns(flush, next(rows))), w.flush()), 10)
    if engine is not None:
        with dr.ReplayBuffer.open_shard(url, 0, rate_limiter=limiter(engine), storage_options=via) as w:
            out["actor check, engine limiter"] = counted(proxy, lambda: w.insert_allowed(1), CHECKS)
    with dr.ReplayBuffer.open(url, "r", storage_options=via) as lrn:
        writers = [dr.ReplayBuffer.open_shard(url, s, storage_options=so) for s in range(shards)]
        try:
            for k in sorted({2, shards}):
                def commit_then_refresh(k: int = k) -> None:
                    proxy.reset_stats()  # only the refresh is counted
                    for w in writers[:k]:
                        w.extend(columns(8, k))
                        w.flush()
                    proxy.reset_stats()
                    lrn.refresh()
                gets, other = [], []
                for _ in range(3):
                    commit_then_refresh()
                    g = proxy.count("", "GET")
                    gets.append(g)
                    other.append(sum(proxy.hits.values()) - g)
                name = f"learner refresh, {'every shard' if k == shards else f'{k} shards'} committed"
                out[name] = (statistics.median(gets), statistics.median(other))
        finally:
            for w in writers:
                w.close()
    return out


class Committer:
    """A thread that commits ``rows`` rows to one shard after another every ``period_s``."""

    def __init__(self, url: str, so: dict | None, shards: int, rows: int, period_s: float):
        self.writers = [dr.ReplayBuffer.open_shard(url, s, storage_options=so) for s in range(shards)]
        self.rows, self.period_s, self.stop = rows, period_s, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        n = 0
        while not self.stop.wait(self.period_s):
            w = self.writers[n % len(self.writers)]
            w.extend(columns(self.rows, n))
            w.flush()
            n += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for w in self.writers:
            w.close()


def updates_per_s(url: str, so: dict | None, learner_so: dict | None, shards: int, args: argparse.Namespace) -> float:
    """Learner updates per second over ``args.seconds`` while a `Committer` writes (``so``; the
    learner reads through ``learner_so``: on S3, the proxy that adds latency)."""
    committer = Committer(url, so, shards, args.flush_every, args.commit_ms / 1e3)
    try:
        with dr.ReplayBuffer.open(url, "r", sampler=dr.Prioritized(), seed=0, storage_options=learner_so) as lrn:
            rng = np.random.default_rng(0)
            for _ in range(args.warmup):  # the chunks into the cache, untimed
                sample_or_refresh(lrn)
            updates, started = 0, time.perf_counter()
            while time.perf_counter() - started < args.seconds:
                if (batch := sample_or_refresh(lrn)) is None:
                    continue
                lrn.update_priorities(batch["index"], rng.random(BATCH) + 0.01)
                updates += 1
                if updates % REFRESH_EVERY == 0:
                    lrn.refresh()
            return updates / (time.perf_counter() - started)
    finally:
        committer.close()


def sample_or_refresh(lrn: dr.ReplayBuffer) -> Any:
    """A batch, or None when the writers went round the ring past this reader's commit (then
    it adopts the newest commit, as a learner does)."""
    try:
        return lrn.sample(BATCH)
    except dr.StaleReadError:
        lrn.refresh()
        return None


def bench_updates(backends: dict[str, tuple[str, dict | None, dict | None]], args: argparse.Namespace) -> str:
    counts = sorted({1, *args.shards})
    lines = ["| store | " + " | ".join(f"{s} shard{'s' * (s > 1)}" for s in counts) + " | "
             + " | ".join(f"{s} vs 1" for s in counts if s > 1) + " |",
             "|---|" + "---:|" * (2 * len(counts) - 1)]
    for name, (base, so, learner_so) in backends.items():
        rows = args.s3_rows if base.startswith("s3://") else args.rows
        urls = {s: new_buffer(base, so, s, rows, args.flush_every) for s in counts}
        rates: dict[int, list[float]] = {s: [] for s in counts}
        for r in range(args.rounds):
            for s in counts[r % len(counts):] + counts[:r % len(counts)]:
                rates[s].append(updates_per_s(urls[s], so, learner_so, s, args))
        med = {s: statistics.median(v) for s, v in rates.items()}
        log(f"  {name}: {med}")
        lines.append(f"| {name} | " + " | ".join(f"{med[s]:,.0f}/s" for s in counts) + " | "
                     + " | ".join(f"{med[s] / med[1]:.2f}×" for s in counts if s > 1) + " |")
    return "\n".join(lines)


def cost_per_hour(ops: dict[str, tuple[float, float]], shards: int, args: argparse.Namespace, engine: bool,
                  flush: int) -> str:
    """S3 requests per second and dollars per hour at ``args.actors`` actors committing every
    ``flush`` steps, from the counts at ``shards`` shards (a refresh after every shard committed
    grows with the shards: scaled to the actors)."""
    commit = ops[f"actor commit of {flush} rows"]
    check = ops["actor check, engine limiter" if engine else "actor check, serverless limiter"]
    sample = ops["learner sample(256), engine limiter" if engine else "learner sample(256), serverless limiter"]
    refresh = ops["learner refresh, every shard committed"]
    actor = args.actors * args.steps_per_s / flush  # commits per second, one check each
    refreshes = args.updates_per_s / REFRESH_EVERY
    scale = args.actors / shards
    gets = actor * (commit[0] + check[0]) + args.updates_per_s * sample[0] + refreshes * refresh[0] * scale
    puts = actor * (commit[1] + check[1]) + args.updates_per_s * sample[1] + refreshes * refresh[1] * scale
    dollars = 3600 * (gets * GET_PRICE + puts * PUT_PRICE)
    limit = "engine (Ray actor)" if engine else "serverless"
    return f"| {limit} | {flush} | {gets:,.0f} | {puts:,.0f} | ${dollars:,.2f} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, one round")
    p.add_argument("--shards", default="4,16,64", help="shard counts")
    p.add_argument("--rows", type=int, default=None, help="section 2 rows in all (default 262,144; quick 65,536)")
    p.add_argument("--flush-every", type=int, default=32, help="rows per actor commit")
    p.add_argument("--commit-ms", type=float, default=5.0, help="section 2: a commit every this many ms")
    p.add_argument("--seconds", type=float, default=None, help="section 2 seconds per round (default 4; quick 1)")
    p.add_argument("--rounds", type=int, default=None, help="section 2 rounds (default 3; quick 1)")
    p.add_argument("--warmup", type=int, default=200, help="section 2 untimed samples before each round")
    p.add_argument("--latency-ms", type=float, default=20.0, help="added to each S3 request")
    p.add_argument("--actors", type=int, default=100, help="section 3 actors")
    p.add_argument("--steps-per-s", type=float, default=1000.0, help="section 3 steps per actor per second")
    p.add_argument("--updates-per-s", type=float, default=100.0, help="section 3 learner updates per second")
    p.add_argument("--s3-rows", type=int, default=None, help="section 2 rows on S3 (default: --rows // 4)")
    p.add_argument("--no-ray", action="store_true", help="leave the engine limiter out")
    p.add_argument("--out", default=None, help="also write the report to this file")
    args = p.parse_args()
    args.shards = [int(s) for s in args.shards.split(",")]
    args.rows = args.rows or (65_536 if args.quick else 262_144)
    args.s3_rows = args.s3_rows or args.rows // 4
    args.seconds = args.seconds or (1.0 if args.quick else 4.0)
    args.rounds = args.rounds or (1 if args.quick else 3)
    header = bl.report_header("diskreplay coordination benchmark", args.quick, PACKAGES, None, [
        f"shards {args.shards}; commits of {args.flush_every} rows; S3 at {args.latency_ms:g} ms per request",
        f"section 2: {args.rows:,} rows (S3: {args.s3_rows:,}), a commit every {args.commit_ms:g} ms, "
        f"{args.rounds} x {args.seconds:g} s",
        f"section 3: {args.actors} actors x {args.steps_per_s:g} steps/s, learner {args.updates_per_s:g} updates/s"])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    engine = None
    if not args.no_ray:
        import ray

        from diskreplay.ray import EngineCounts
        ray.init(num_cpus=1, include_dashboard=False, configure_logging=False)
        engine = EngineCounts()
    server, so = start_s3()
    proxy = FaultProxy(so["endpoint_url"], latency_s=args.latency_ms / 1e3)
    scratch = tempfile.mkdtemp(prefix="coordination-")
    body = []
    try:
        log("[1/3] requests per operation")
        ops = {s: requests_per_operation(so, proxy, s, args, engine) for s in args.shards}
        names = list(dict.fromkeys(n for s in args.shards for n in ops[s]))
        lines = ["| operation | " + " | ".join(f"S = {s}" for s in args.shards) + " |",
                 "|---|" + "---:|" * len(args.shards)]
        for n in names:
            cells = [f"{ops[s][n][0]:g} GET + {ops[s][n][1]:g} other" if n in ops[s] else "" for s in args.shards]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        body.append("## 1. S3 requests per operation (counted at the proxy)\n\n" + "\n".join(lines))
        print(body[-1] + "\n", flush=True)  # each section as it is done
        log("[2/3] learner updates per second")
        via = {**so, "endpoint_url": proxy.endpoint}
        backends = {"local disk": (scratch, None, None),
                    f"S3 (moto, {args.latency_ms:g} ms per request)": (f"s3://{BUCKET}/upd", so, via)}
        body.append("## 2. Learner updates per second, S shards vs 1\n\n" + bench_updates(backends, args))
        print(body[-1] + "\n", flush=True)
        s = max(args.shards)
        cost = ["| limiter | steps per commit | GET/s | PUT, LIST, POST/s | $ per hour |", "|---|---:|---:|---:|---:|"]
        for engine_on in ([False, True] if engine is not None else [False]):
            cost += [cost_per_hour(ops[s], s, args, engine_on, flush) for flush in (args.flush_every, LONG_FLUSH)]
        body.append(f"## 3. S3 requests at {args.actors} actors\n\n" + "\n".join(cost))
    finally:
        proxy.close()
        server.stdin.close()
        server.wait(timeout=30)
    bl.publish_report(header, "\n\n".join(body), args.out, started)


if __name__ == "__main__":
    main()
