"""A rate limit kept by a Ray actor (`diskreplay.ray.RateLimiterActor`, issue 43): shard writers
on a real two-node Ray cluster (tests/ray_cluster.py) and a learner in this process, the buffer
on moto S3 behind counting proxies (one per writer): no limiter request reaches the store, and
the samples-per-insert ratio is held within ``error_buffer``."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("ray.data")
import ray
from ray_cluster import ray_cluster, ray_driver  # fixtures
from s3server import FaultProxy, fault_proxy, proxy_options, s3  # fixtures

import diskreplay as dr
from diskreplay.format.shards import LEARNER_KEY, shard_name
from diskreplay.ray import EngineCounts

pytestmark = pytest.mark.slow

FIELDS = {"obs": dr.Field((2,), "float64"), "done": dr.Field((), "bool")}
SHARDS, ROWS, STEP, BATCH = 4, 200, 10, 32
SPI, ERROR, MIN = 2.0, 64.0, 20


@ray.remote(num_cpus=0)
def actor(url: str, shard: int, options: dict, limiter: dr.RateLimiter) -> int:
    """Writes `ROWS` rows into ``shard``, `STEP` at a time, each after the limiter allowed them
    (committing every 5 steps, and before it waits); the checks it made."""
    checks = 0
    with dr.ReplayBuffer.open_shard(url, shard, rate_limiter=limiter, storage_options=options) as w:
        for n in range(ROWS // STEP):
            checks += 1
            if not w.insert_allowed(STEP):
                w.flush()  # what the learner counts
                while not w.insert_allowed(STEP):
                    checks += 1
                    time.sleep(0.002)
            w.extend({"obs": np.zeros((STEP, 2)), "done": np.zeros(STEP, bool)})
            if n % 5 == 4:
                w.flush()
    return checks


def test_writers_and_learner_keep_the_ratio_through_a_ray_actor(ray_driver, s3, fault_proxy):
    options = proxy_options(s3, fault_proxy)
    url = s3.new_url("engine")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=SHARDS, chunk_rows=8, storage_options=options).close()
    counts = EngineCounts()
    limiter = dr.RateLimiter(SPI, ERROR, MIN, timeout_s=120, counts=counts)
    proxies = [FaultProxy(s3.endpoint) for _ in range(SHARDS)]
    try:
        with dr.ReplayBuffer.open(url, "r", rate_limiter=limiter, storage_options=options) as learner:
            rank = learner.learner_rank()
            running = [actor.remote(url, s, proxy_options(s3, proxies[s]), limiter) for s in range(SHARDS)]
            sampled = 0
            while True:
                done = not ray.wait(running, num_returns=SHARDS, timeout=0)[1]
                learner.refresh()
                if rank.allowed(BATCH):
                    learner.sample(BATCH)
                    sampled += BATCH
                    inserted = len(learner)
                    assert sampled <= SPI * (inserted - MIN) + ERROR  # the learner's bound, exact
                elif done:
                    break
                else:
                    time.sleep(0.005)
            checks, held = ray.get(running), len(learner)
        inserted, samples = counts.current()
        requests = [{"limiter": p.count(LEARNER_KEY), "other shards": sum(
            p.count(shard_name(o)) for o in range(SHARDS) if o != s)} for s, p in enumerate(proxies)]
    finally:
        for p in proxies:
            p.close()
    assert held == SHARDS * ROWS and samples == sampled
    assert inserted == SHARDS * (ROWS - STEP)  # each writer's last check came before its last rows
    assert abs(sampled - SPI * (SHARDS * ROWS - MIN)) <= ERROR  # the ratio, held within error_buffer
    assert requests == [{"limiter": 0, "other shards": 0}] * SHARDS and min(checks) >= ROWS // STEP
    assert fault_proxy.count(LEARNER_KEY) == 0  # the learner wrote (and read) nothing for the limit
