"""`FsspecChunkStore` and `ObstoreChunkStore` (each test runs on both) against a real (moto) S3
server through the fault-injecting proxy: hung requests are cancelled at the retry deadline,
transient failures are retried, `clear` stays under its root; and `RetryPolicy` refuses bad values.

No test here measures time: each asserts what the client and the proxy did (requests seen,
held, abandoned) and what the error says. Calls that could hang run on a thread joined for
`SAFETY_S` seconds, so a regression fails instead of hanging pytest.
"""

from __future__ import annotations

import asyncio
import gc
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec.asyn
import pytest
from conftest import exit_code_in_fork
from s3server import SAFETY_S, fault_proxy, outcome, proxy_options, remote_store, s3, s3_client, store_loop

from diskreplay import RetryPolicy, StoreUnavailableError
from diskreplay.io import ChunkStore, FsspecChunkStore, LocalChunkStore, PrefixedStore

BUDGET_S = 1.5
KEY, OTHER, NEW = "obs/c.0.1.0", "obs/c.0.0.0", "obs/c.0.2.0"
LOCK = "writer.lock"
DATA, OTHER_DATA = b"\x00chunk\xff" * 200, b"other chunk"
SEEDED = {KEY: DATA, OTHER: OTHER_DATA}


@dataclass
class Op:
    """One store operation: its HTTP method, the key it targets (None: the bucket, for `clear`'s
    bulk delete), how errors name it, the call, what it returns and the objects after it."""

    method: str
    key: str | None
    what: str
    call: Callable[[Any], Any]
    result: Any
    after: dict[str, bytes]


OPS = {
    "put": Op("PUT", NEW, f"write of '{NEW}'", lambda st: st.put(NEW, DATA), None, {**SEEDED, NEW: DATA}),
    "get": Op("GET", KEY, f"read of '{KEY}'", lambda st: st.get(KEY), DATA, SEEDED),
    "get_many": Op("GET", KEY, f"read of '{KEY}'", lambda st: st.get_many([OTHER, KEY, "absent"]),
                   [OTHER_DATA, DATA, None], SEEDED),
    "put_if_absent": Op("PUT", LOCK, f"conditional write of '{LOCK}'",
                        lambda st: st.put_if_absent(LOCK, DATA), True, {**SEEDED, LOCK: DATA}),
    "exists": Op("HEAD", KEY, f"existence check of '{KEY}'", lambda st: st.exists(KEY), True, SEEDED),
    "delete": Op("DELETE", KEY, f"delete of '{KEY}'", lambda st: st.delete(KEY), None, {OTHER: OTHER_DATA}),
    "clear": Op("POST", None, "clear of every object under", lambda st: st.clear(), None, {}),
}


def op_of(name: str, client: str) -> Op:
    """`OPS[name]` as ``client`` sends it: obstore deletes even one object with a bulk delete
    (a POST to the bucket)."""
    op = OPS[name]
    return Op("POST", None, op.what, op.call, op.result, op.after) if (name, client) == ("delete", "obstore") else op


def seeded_store(s3, proxy, client: str, **policy: Any) -> ChunkStore:
    """A store of ``client`` on a fresh prefix through ``proxy``, holding `SEEDED` (written
    through it, which also opens the client's session before any fault). The client's own retry
    loops are off, so every retry counted in ``store.retried`` is diskreplay's."""
    store = remote_store(s3.new_url("faults"), proxy_options(s3, proxy), client)
    for key, data in SEEDED.items():  # under the default policy: a loaded machine may be slow here
        store.put(key, data)
    store.retry = RetryPolicy(**policy)
    proxy.reset_stats()
    store.retried = 0
    return store


def target(s3, store: Any, op: Op) -> str:
    """The request path substring that ``op`` sends to (path-style addressing: /bucket/key)."""
    return f"/{s3.bucket}" if op.key is None else f"/{store.root}/{op.key}"


def tasks_left(store: Any) -> list[asyncio.Task]:
    """The tasks still pending on the store's event loop (none once an operation has returned:
    a request left running after the deadline shows up here)."""
    async def pending() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    return fsspec.asyn.sync(store_loop(store), pending)


# ---- hung requests -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPS))
def test_blackholed_request_is_cancelled_at_the_deadline(s3, fault_proxy, s3_client, name):
    op = op_of(name, s3_client)
    store = seeded_store(s3, fault_proxy, s3_client, budget_s=BUDGET_S)
    path = target(s3, store, op)
    fault_proxy.fail("blackhole", path, times=10**6, method=op.method)
    _, error = outcome(lambda: op.call(store))
    assert isinstance(error, StoreUnavailableError), repr(error)
    message = str(error)
    assert re.search(rf"{re.escape(repr(store.url))}: {re.escape(op.what)}.* failed after 1 try in [\d.]+ s "
                     rf"\(the retry deadline of {BUDGET_S:g} s was reached\); last error: TimeoutError: "
                     r"no answer within [\d.]+ s: the request was cancelled", message), message
    # the proxy held the one request until the client gave up on it and closed the connection
    assert fault_proxy.count(path, op.method) == 1 and fault_proxy.holds == 1
    assert fault_proxy.wait_until(lambda: fault_proxy.abandoned == 1, SAFETY_S), fault_proxy.abandoned
    assert tasks_left(store) == []  # nothing of the operation still runs in the background
    assert store.retried == 0
    assert s3.keys(store.url) == SEEDED  # the held request never reached the server


def test_get_many_keeps_its_bound_while_requests_hang(s3, fault_proxy, s3_client):
    keys = [f"obs/c.0.{i}.0" for i in range(5)]
    store = seeded_store(s3, fault_proxy, s3_client, budget_s=3.0)  # room for each GET to reach the proxy under load
    store.concurrency = 2
    fault_proxy.fail("blackhole", f"/{store.root}/obs/", times=10**6, method="GET")
    _, error = outcome(lambda: store.get_many(keys))
    assert isinstance(error, StoreUnavailableError), repr(error)
    assert re.search(r"read of 'obs/c\.0\.\d\.0' failed after 1 try .*retry deadline of 3 s was reached",
                     str(error)), str(error)
    # every key got its one GET (no HEAD), never more than `concurrency` held at once
    assert [fault_proxy.count(f"/{store.root}/{k}", "GET") for k in keys] == [1] * len(keys)
    assert fault_proxy.count("/", "HEAD") == 0
    # obstore's runtime closes a timed-out request's connection after the call returned its error:
    # the next request of that thread may reach the proxy first, so one abandoned connection can
    # still look held for a moment
    closing = 1 if s3_client == "obstore" else 0
    assert fault_proxy.holds == len(keys) and 2 <= fault_proxy.max_holding <= 2 + closing
    assert tasks_left(store) == []
    assert fault_proxy.wait_until(lambda: fault_proxy.abandoned == len(keys), SAFETY_S)


def test_proxy_close_releases_held_connections(s3, fault_proxy, s3_client):
    store = seeded_store(s3, fault_proxy, s3_client, budget_s=60.0)
    fault_proxy.fail("blackhole", f"/{store.root}/{KEY}", method="GET")
    box: list[BaseException] = []
    thread = threading.Thread(target=lambda: box.append(outcome(lambda: store.get(KEY))[1]), daemon=True)
    thread.start()
    assert fault_proxy.wait_until(lambda: fault_proxy.holding == 1, SAFETY_S)
    fault_proxy.close()  # closes the held connection: the client sees it dropped, not a hang
    thread.join(SAFETY_S)
    assert fault_proxy.holding == 0 and fault_proxy.abandoned == 0
    assert box and isinstance(box[0], StoreUnavailableError), box  # and then no proxy to retry on


# ---- transient failures ----------------------------------------------------------------------


@pytest.mark.parametrize("fault", ["503", "reset"])
@pytest.mark.parametrize("name", list(OPS))
def test_transient_failures_are_retried_then_succeed(s3, fault_proxy, s3_client, name, fault):
    op = op_of(name, s3_client)
    store = seeded_store(s3, fault_proxy, s3_client)
    path = target(s3, store, op)
    fault_proxy.fail(fault, path, times=2, method=op.method)
    result, error = outcome(lambda: op.call(store))
    assert error is None, repr(error)
    assert result == op.result
    assert fault_proxy.faults[fault] == 2
    assert fault_proxy.count(path, op.method) == 3  # exactly the two failures, then one success
    # diskreplay's layer retried them; a reset of an idempotent request (all but clear's POST) may
    # first be re-sent once by aiohttp itself, which retries a dropped connection once
    assert (store.retried == 2) if fault == "503" or op.method == "POST" else (1 <= store.retried <= 2)
    assert s3.keys(store.url) == op.after


# ---- clear ----------------------------------------------------------------------------------


def test_clear_removes_everything_under_the_root_and_nothing_else(s3, s3_client):
    so = s3.storage_options()
    url = s3.new_url("clear")
    stores = {u: remote_store(u, so, s3_client) for u in (url, url + "-sibling", s3.new_url("other"))}
    for store in stores.values():
        for key in ("commit.json", "obs/c.0.0", "obs/deep/c.1.2", "writer.lock"):
            store.put(key, key.encode())
    stores[url].clear()
    assert s3.keys(url) == {}
    for other in list(stores)[1:]:  # a sibling sharing the name as a prefix, and another prefix
        assert sorted(s3.keys(other)) == ["commit.json", "obs/c.0.0", "obs/deep/c.1.2", "writer.lock"]
    stores[url].clear()  # nothing left: not an error
    assert stores[url].get("commit.json") is None and not stores[url].exists("obs/c.0.0")


def test_clear_on_local_and_memory_stores(tmp_path, memory_url):
    local = LocalChunkStore(str(tmp_path / "b"))
    beside = LocalChunkStore(str(tmp_path / "b-sibling"))
    memory = FsspecChunkStore(memory_url, {})
    memory_beside = FsspecChunkStore(memory_url + "-sibling", {})
    try:
        for store in (local, beside, memory, memory_beside):
            store.put("obs/c.0.0", b"x")
            store.put("commit.json", b"y")
        for store, other in ((local, beside), (memory, memory_beside)):
            store.clear()
            assert store.get_many(["obs/c.0.0", "commit.json"]) == [None, None]
            assert other.get_many(["obs/c.0.0", "commit.json"]) == [b"x", b"y"]
            store.clear()  # a missing root is not an error
        assert not (tmp_path / "b").exists()
    finally:
        memory_beside.clear()


# ---- RetryPolicy ----------------------------------------------------------------------------


@pytest.mark.parametrize("field,value,expected", [
    ("attempts", 0, "an int >= 1"),
    ("attempts", 2.0, "an int >= 1"),
    ("attempts", True, "an int >= 1"),
    ("base_delay", -0.1, "a finite number of seconds >= 0"),
    ("max_delay", float("inf"), "a finite number of seconds >= 0"),
    ("max_delay", "1", "a finite number of seconds >= 0"),
    ("budget_s", 0, "a finite number of seconds > 0"),
    ("budget_s", float("nan"), "a finite number of seconds > 0"),
    ("budget_s", None, "a finite number of seconds > 0"),
])
def test_retry_policy_refuses_bad_values(field, value, expected):
    message = f"RetryPolicy.{field} must be {expected}, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        RetryPolicy(**{field: value})
    policy = RetryPolicy()
    with pytest.raises(ValueError, match=re.escape(message)):
        setattr(policy, field, value)  # a live store's policy is checked too
    assert policy == RetryPolicy()


def test_retry_policy_accepts_edge_values():
    policy = RetryPolicy(attempts=1, base_delay=0, max_delay=0.0, budget_s=0.001)
    assert (policy.attempts, policy.base_delay, policy.max_delay, policy.budget_s) == (1, 0, 0.0, 0.001)
    assert policy.delay(3) == 0


def test_a_prefixed_store_is_one_directory_of_its_store(tmp_path, memory_url):
    """`PrefixedStore`: keys without the prefix, everything else of the store untouched."""
    for root in (LocalChunkStore(str(tmp_path / "b")), FsspecChunkStore(memory_url, {})):
        root.put("commit.json", b"root")
        own = PrefixedStore(root, "diskreplay/objects/")
        assert isinstance(own, ChunkStore) and own.supports_mmap == root.supports_mmap
        own.put("commit.json", b"mine", durable=True)
        assert own.put_if_absent("writer.lock", b"L") and not own.put_if_absent("writer.lock", b"M")
        own.put_in_place("state/a", b"12345")
        assert own.get_many(["commit.json", "missing"]) == [b"mine", None] and own.get("state/a", limit=2) == b"12"
        out = [memoryview(bytearray(3)), memoryview(bytearray(2))]
        assert own.read_into("state/a", out) == 5 and bytes(out[0]) + bytes(out[1]) == b"12345"
        assert own.sizes() == {"commit.json": 4, "writer.lock": 1, "state/a": 5}
        assert own.path("state/a").endswith("/diskreplay/objects/state/a")
        own.delete("writer.lock")
        assert not own.exists("writer.lock") and root.exists("diskreplay/objects/commit.json")
        own.clear()
        assert own.sizes() == {} and root.get("commit.json") == b"root"
        root.clear()


# ---- forked children --------------------------------------------------------------------------


def test_a_forked_child_leaves_its_parents_connections_alone(s3, fault_proxy):
    """A forked child (a DataLoader worker) opens a store of its own and lets the one it inherited
    go. Collecting the parent's s3fs filesystem on the child's event loop would close the parent's
    pooled connections through the parent's loop, whose epoll set the child shares: the parent's
    next request on one would hear nothing until the deadline. Its next reads are answered."""
    stores = [seeded_store(s3, fault_proxy, "s3fs", budget_s=BUDGET_S)]
    url = stores[0].url
    assert stores[0].get_many([KEY, OTHER]) == [DATA, OTHER_DATA]  # two connections wait in the pool

    async def collect() -> None:
        gc.collect()

    def child() -> bool:
        own = remote_store(url, proxy_options(s3, fault_proxy), "s3fs")
        stores.clear()  # the inherited store goes, and with it the child's last use of its filesystem
        fsspec.asyn.sync(store_loop(own), collect)  # collected where a worker's garbage is: on its loop's thread
        return bool(own.get(KEY) == DATA)

    assert exit_code_in_fork(child) == 0
    for _ in range(3):
        assert stores[0].get_many([KEY, OTHER]) == [DATA, OTHER_DATA]
    assert stores[0].retried == 0
