"""The rate limiter's requests (issue 43): an actor's check reads one object, whatever the shard
count; a learner's `sample` never waits on a write of its progress. Counted at a proxy in front
of moto S3, with actors in processes of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import OWN
from s3server import FaultProxy, fault_proxy, proxy_options, s3  # fixtures

import diskreplay as dr
from diskreplay.buffer.rate_limit import Progress
from diskreplay.format.shards import LEARNER_KEY

pytestmark = pytest.mark.slow

FIELDS = {"obs": dr.Field((2,), "float64"), "done": dr.Field((), "bool")}
SHARDS, ACTORS, CHECKS, ROWS = 64, 16, 5, 40  # actors write 16 of the 64 shards, 640 rows in all
LIMITER = {"samples_per_insert": 2.0, "error_buffer": 2000.0, "min_size": 1}

ACTOR = f"""
import json, sys
import numpy as np
import diskreplay as dr
url, shard, options, limiter = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
with dr.ReplayBuffer.open_shard(url, shard, rate_limiter=dr.RateLimiter(**limiter), storage_options=options) as w:
    w.extend({{"obs": np.zeros(({ROWS}, 2)), "done": np.zeros({ROWS}, bool)}})
    w.flush()
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps([w.insert_allowed(k) for k in (1, 2000, 1, 2000, 1)][:{CHECKS}]), flush=True)
    sys.stdin.readline()
"""


def make(s3, options) -> str:
    url = s3.new_url("limited")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=SHARDS, chunk_rows=8, storage_options=options).close()
    return url


def gets(proxy: FaultProxy, contains: str) -> int:
    return proxy.count(contains, "GET")


def test_an_actor_check_reads_one_object_whatever_the_shards(s3, fault_proxy):
    options = proxy_options(s3, fault_proxy)
    url = make(s3, options)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    actors = [subprocess.Popen([sys.executable, "-c", ACTOR, url, str(s), json.dumps(options), json.dumps(LIMITER)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
              for s in range(ACTORS)]
    try:
        assert [a.stdout.readline() for a in actors] == ["ready\n"] * ACTORS  # type: ignore[union-attr]
        with dr.ReplayBuffer.open(url, "r", rate_limiter=dr.RateLimiter(**LIMITER), storage_options=options) as lrn:
            assert len(lrn) == ACTORS * ROWS
            lrn.sample(30)
            lrn.learner_rank().publish()  # samples 30, every actor's rows seen
        fault_proxy.reset_stats()
        for a in actors:
            a.stdin.write("go\n")  # type: ignore[union-attr]
            a.stdin.flush()  # type: ignore[union-attr]
        answers = [json.loads(a.stdout.readline()) for a in actors]  # type: ignore[union-attr]
        checked = {"learner": gets(fault_proxy, LEARNER_KEY), "commits": gets(fault_proxy, "commit"),
                   "others": gets(fault_proxy, "") - gets(fault_proxy, LEARNER_KEY) - gets(fault_proxy, "lock")}
    finally:
        for a in actors:
            a.communicate("close\n", timeout=60)
    # 30 >= 2 * (640 + k - 1) - 2000  <=>  k <= 376: the others' rows as the learner published them
    assert answers == [[True, False, True, False, True]] * ACTORS
    assert checked == {"learner": ACTORS * CHECKS, "commits": 0, "others": 0}
    assert [a.returncode for a in actors] == [0] * ACTORS


def test_the_learners_sample_never_waits_on_a_write_of_its_progress(s3, fault_proxy, monkeypatch):
    options = proxy_options(s3, fault_proxy)
    url = make(s3, options)
    with dr.ReplayBuffer.open_shard(url, 0, storage_options=options) as w:
        w.extend({"obs": np.zeros((50, 2)), "done": np.zeros(50, bool)})
    entered, release = threading.Event(), threading.Event()
    write = Progress.write

    def held(self, progress):
        entered.set()
        assert release.wait(60)
        write(self, progress)

    monkeypatch.setattr(Progress, "write", held)
    with dr.ReplayBuffer.open(url, "r", rate_limiter=dr.RateLimiter(**LIMITER), storage_options=options) as lrn:
        fault_proxy.reset_stats()
        lrn.sample(8)
        assert entered.wait(60)  # the first value is being written, and held there
        for _ in range(5):
            lrn.sample(8)  # returns while the write is held: nothing written in the caller's thread
        assert fault_proxy.count(LEARNER_KEY, "PUT") == 0
        release.set()
    # closed: flushed; the value held, then the newest (the ones between were replaced)
    assert fault_proxy.count(LEARNER_KEY, "PUT") == 2
    assert json.loads(s3.keys(url)[OWN + LEARNER_KEY])["samples"] == 48


def test_a_failed_write_of_the_learners_progress_is_raised_by_its_next_sample(tmp_path, monkeypatch):
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=2).close()
    with dr.ReplayBuffer.open_shard(url, 1) as w:
        w.extend({"obs": np.zeros((50, 2)), "done": np.zeros(50, bool)})

    def broken(self, progress):
        raise OSError("disk full")

    with dr.ReplayBuffer.open(url, "r", rate_limiter=dr.RateLimiter(**LIMITER)) as lrn:
        monkeypatch.setattr(Progress, "write", broken)
        lrn.sample(8)
        with pytest.raises(OSError, match="disk full"):
            lrn.learner_rank().publish()  # waits for the write: its error
        monkeypatch.undo()
        lrn.sample(8)
    assert json.loads((tmp_path / "b" / OWN / LEARNER_KEY).read_text())["samples"] == 16
    with pytest.raises(ValueError, match="RateLimiter: counts must be None or a SharedCounts"):
        dr.RateLimiter(1, 1, counts=object())  # type: ignore[arg-type]


class Counts:
    """A `SharedCounts` kept in this process (as a Ray actor keeps them)."""

    def __init__(self) -> None:
        self.samples, self.inserts = 0, {}

    def set_samples(self, samples: int) -> None:
        self.samples = samples

    def set_inserts(self, shard: int, rows: int) -> tuple[int, int]:
        self.inserts[shard] = rows
        return sum(self.inserts.values()), self.samples


def test_a_learner_whose_counts_an_engine_keeps_writes_nothing_to_the_store_also_when_it_waits(tmp_path):
    url = str(tmp_path / "b")
    dr.ReplayBuffer.create(url, FIELDS, capacity=None, shards=2).close()
    with dr.ReplayBuffer.open_shard(url, 1) as w:
        w.extend({"obs": np.zeros((10, 2)), "done": np.zeros(10, bool)})
    counts = Counts()
    limiter = dr.RateLimiter(samples_per_insert=1.0, error_buffer=1.0, min_size=1, timeout_s=0.05, counts=counts)
    with dr.ReplayBuffer.open(url, "r", rate_limiter=limiter) as lrn:
        lrn.sample(8)
        with pytest.raises(dr.RateLimitTimeout, match=r"sample\(8\) waited 0.05 s"):
            lrn.sample(8)  # 16 > 1 * (10 - 1) + 1: it waits, refreshing, and gives up
        lrn.learner_rank().publish()
    assert counts.samples == 8
    assert not (tmp_path / "b" / OWN / LEARNER_KEY).exists()
