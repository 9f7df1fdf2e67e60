"""Which client serves an ``s3://`` URL, and how s3fs's storage options reach obstore.

`open_chunkstore` picks `ObstoreChunkStore` when obstore is installed and every storage option has
an obstore equivalent; anything else goes to s3fs with the user's options, never dropped. The
stores' behaviour (retries, deadlines, faults) is tested on both clients in test_s3*.py.
"""

from __future__ import annotations

import multiprocessing
import re
import subprocess
import sys
from datetime import timedelta

import botocore.loaders
import pytest
from s3server import SAFETY_S, fault_proxy, outcome, proxy_options, s3

pytest.importorskip("obstore")

from diskreplay import RetryPolicy, StoreUnavailableError
from diskreplay.io import FsspecChunkStore, open_chunkstore
from diskreplay.io.access import access_problem
from diskreplay.io.obstore_store import ObstoreChunkStore, UntranslatableOptionError, s3store_config

URL = "s3://bucket/prefix/buf"
AWS_VARIABLES = ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE",
                 "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_ENDPOINT_URL", "DISKREPLAY_S3_CLIENT")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """No AWS variables, and a home without ~/.aws: only what a test sets counts."""
    for name in AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))


def test_fsspec_style_options_translate():
    config, cap = s3store_config({
        "endpoint_url": "http://127.0.0.1:9000", "key": "K", "secret": "S", "token": "T",
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": {"retries": {"total_max_attempts": 3, "mode": "standard"}, "connect_timeout": 2,
                          "read_timeout": 7.5, "max_pool_connections": 8}})
    assert config == {"access_key_id": "K", "secret_access_key": "S", "session_token": "T",
                      "retry_config": {"max_retries": 2}, "region": "eu-west-1", "endpoint": "http://127.0.0.1:9000",
                      "client_options": {"allow_http": True, "connect_timeout": timedelta(seconds=2),
                                         "read_timeout": timedelta(seconds=7.5)}}
    assert cap == 8


def test_anonymous_access_region_from_the_environment_and_https(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "us-west-2")
    assert s3store_config({"anon": True, "client_kwargs": {"endpoint_url": "https://s3.example.com"},
                           "config_kwargs": {"retries": {"max_attempts": 4}}}) == (
        {"skip_signature": True, "retry_config": {"max_retries": 4}, "region": "us-west-2",
         "endpoint": "https://s3.example.com", "client_options": {"allow_http": False}}, None)


@pytest.mark.parametrize("options,named", [
    ({"requester_pays": True, "key": "K", "secret": "S"}, r"storage option 'requester_pays' has"),
    ({"config_kwargs": {"signature_version": "s3v4"}}, r"storage option config_kwargs\['signature_version'\] has"),
    ({"client_kwargs": {"verify": False}}, r"storage option client_kwargs\['verify'\] has"),
    ({"config_kwargs": {"retries": {"mode": "adaptive"}}}, r"config_kwargs\['retries'\] mode 'adaptive' has"),
])
def test_an_option_without_an_obstore_equivalent_is_named(options, named):
    with pytest.raises(UntranslatableOptionError, match=named + " no obstore equivalent$"):
        s3store_config({"endpoint_url": "http://127.0.0.1:9000", **options})


def test_settings_only_botocore_finds_are_untranslatable(monkeypatch):
    with pytest.raises(UntranslatableOptionError, match=r"^no region is set .*s3fs looks the bucket's region up$"):
        s3store_config({"key": "K", "secret": "S"})
    with pytest.raises(UntranslatableOptionError, match=r"^no credentials are given .*profiles and instance metadata$"):
        s3store_config({"endpoint_url": "http://127.0.0.1:9000"})
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "K")  # obstore reads the environment's credentials as botocore does
    assert s3store_config({"endpoint_url": "http://127.0.0.1:9000"}) == (
        {"region": "us-east-1", "endpoint": "http://127.0.0.1:9000", "client_options": {"allow_http": True}}, None)


def test_untranslatable_options_go_to_s3fs_unchanged(monkeypatch):
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "K", "secret": "S", "requester_pays": True}
    store = open_chunkstore(URL, options)
    assert type(store) is FsspecChunkStore and store.fs.storage_options["requester_pays"] is True
    assert store.fs.config_kwargs == {"max_pool_connections": 128}  # room for the ranged GETs of 16 x 8 in flight
    monkeypatch.setenv("DISKREPLAY_S3_CLIENT", "obstore")
    with pytest.raises(UntranslatableOptionError, match=r"^DISKREPLAY_S3_CLIENT=obstore, but storage option "
                                                        r"'requester_pays' has no obstore equivalent$"):
        open_chunkstore(URL, options)


def test_the_client_is_chosen_by_url_options_and_environment(monkeypatch):
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "K", "secret": "S",
               "config_kwargs": {"max_pool_connections": 4}}
    store = open_chunkstore(URL, options, concurrency=16)
    assert type(store) is ObstoreChunkStore and store.root == "bucket/prefix/buf"
    assert store.concurrency == 4  # the user's cap on connections caps the requests in flight
    assert store.path("obs/c.0.0") == "bucket/prefix/buf/obs/c.0.0"
    assert type(open_chunkstore("s3a://bucket/buf", options)) is FsspecChunkStore
    monkeypatch.setenv("DISKREPLAY_S3_CLIENT", "s3fs")
    assert type(open_chunkstore(URL, options)) is FsspecChunkStore
    monkeypatch.setenv("DISKREPLAY_S3_CLIENT", "boto")
    with pytest.raises(ValueError, match=r"^DISKREPLAY_S3_CLIENT must be one of auto, obstore, s3fs, got 'boto'$"):
        open_chunkstore(URL, options)


def test_without_obstore_s3fs_serves(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # `import obstore` raises ImportError
    monkeypatch.delitem(sys.modules, "diskreplay.io.obstore_store")
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "K", "secret": "S"}
    assert type(open_chunkstore(URL, options)) is FsspecChunkStore
    monkeypatch.setenv("DISKREPLAY_S3_CLIENT", "obstore")
    with pytest.raises(ImportError, match=r"^DISKREPLAY_S3_CLIENT=obstore, but obstore is not installed"):
        open_chunkstore(URL, options)



def test_obstore_errors_name_the_callers_setup(s3):
    """What the CLI tells users: a missing bucket, credentials the store rejects (obstore quotes
    S3's XML answer in its errors, where botocore parses it)."""
    from obstore.exceptions import GenericError

    store = ObstoreChunkStore("s3://no-such-bucket/buf", s3.storage_options())
    with pytest.raises(FileNotFoundError) as missing:
        store.put("commit.json", b"{}")
    assert access_problem(missing.value) == "bucket"
    rejected = GenericError("Server returned non-2xx status code: 403 Forbidden: <?xml version=\"1.0\"?><Error>"
                            "<Code>SignatureDoesNotMatch</Code><Message>The signature ...</Message></Error>")
    assert access_problem(rejected) == "rejected SignatureDoesNotMatch"


def test_a_failed_first_try_on_a_thread_is_retried_on_the_event_loop(s3, fault_proxy):
    """GETs are first tried on the store's threads; a transient failure there goes on under the
    retry policy (counted and retried once), for whole objects and ranges alike."""
    store = ObstoreChunkStore(s3.new_url("first"), proxy_options(s3, fault_proxy))
    for key in ("a", "b"):
        store.put(key, key.encode() * 10)
    assert store._first_tries_here()
    fault_proxy.reset_stats()
    fault_proxy.fail("503", "/a", times=1, method="GET")
    fault_proxy.fail("reset", "/b", times=1, method="GET")
    assert store.get_many(["a", "b"]) == [b"a" * 10, b"b" * 10]
    assert store.retried == 2 and fault_proxy.count("/a", "GET") == fault_proxy.count("/b", "GET") == 2
    fault_proxy.fail("503", "/a", times=1, method="GET")
    assert store.get_ranges([("a", 2, 5), ("b", 0, 3), ("missing", 0, 1)]) == [(b"aaa", 10), (b"bbb", 10), None]
    assert store.retried == 3
    fault_proxy.fail("500", "/b", times=10, method="GET")
    with pytest.raises(StoreUnavailableError, match=r"read of 'b' failed after 6 tries .*all 6 attempts used.* "
                                                    r"HTTP 500 InternalError"):
        store.get_many(["a", "b"])


def test_whole_objects_are_handed_over_without_a_copy(s3, fault_proxy):
    """`get_many` gives views of the buffers obstore assembled the answers in (first tries on the
    store's threads, retries on the event loop and limited reads alike); `get` gives bytes."""
    import obstore

    store = ObstoreChunkStore(s3.new_url("views"), proxy_options(s3, fault_proxy))
    store.put("a", bytes(range(200)))
    store.put("b", b"b" * 300)
    fault_proxy.reset_stats()
    fault_proxy.fail("503", "/b", times=1, method="GET")
    for limit, want in ((None, [bytes(range(200)), b"b" * 300]), (7, [bytes(range(7)), b"b" * 7])):
        blobs = store.get_many(["a", "b"], limit)
        assert [bytes(blob) for blob in blobs] == want
        assert all(isinstance(blob, memoryview) and blob.readonly and isinstance(blob.obj, obstore.Bytes)
                   for blob in blobs)
    assert store.retried == 1
    assert type(store.get("a")) is bytes and store.get("a", 3) == bytes(range(3))
    head, tail = bytearray(150), bytearray(60)
    assert store.read_into("a", [memoryview(head), memoryview(tail)]) == 200
    assert bytes(head + tail) == bytes(range(200)) + bytes(10)


def test_a_first_try_on_a_thread_ends_at_the_deadline(s3, fault_proxy):
    """A GET never answered blocks a thread no longer than the policy's deadline, as on the loop."""
    store = ObstoreChunkStore(s3.new_url("first"), proxy_options(s3, fault_proxy), retry=RetryPolicy(budget_s=1.0))
    store.put("k", b"value")
    fault_proxy.fail("blackhole", "/k", times=10**6, method="GET")
    _, error = outcome(lambda: store.get_many(["k"]))
    assert isinstance(error, StoreUnavailableError), repr(error)
    assert re.search(r"read of 'k' failed after 1 try in [\d.]+ s \(the retry deadline of 1 s was reached\); "
                     r"last error: TimeoutError: no answer within 1.00 s: the request was cancelled",
                     str(error)), str(error)
    assert fault_proxy.count("/k", "GET") == 1
    assert fault_proxy.wait_until(lambda: fault_proxy.abandoned == 1, SAFETY_S)
    store.retry = RetryPolicy(budget_s=0.5)  # stricter than the client's timeout: every try on the loop
    assert not store._first_tries_here()
    _, error = outcome(lambda: store.get_many(["k"]))
    assert "no answer within" in str(error) and "the request was cancelled" in str(error), str(error)


def _use_after_fork(store: ObstoreChunkStore, options: dict, results) -> None:
    parsed = []
    parse = botocore.loaders.JSONFileLoader.load_file
    botocore.loaders.JSONFileLoader.load_file = lambda loader, path: parsed.append(path) or parse(loader, path)
    reopened = open_chunkstore(store.url, options)
    results.put((store.get("k"), store.exists("k"), type(reopened).__name__, reopened.get("k"), parsed))


def test_a_forked_child_is_served_by_s3fs(s3):
    """obstore's runtime does not survive a fork (a request in the child would hang): a store
    inherited through a fork, and one opened in the child, go through s3fs, on botocore's S3
    data that the parent parsed before the fork (the child parses no file)."""
    options = s3.storage_options()
    store = ObstoreChunkStore(s3.new_url("fork"), options)
    store.put("k", b"value")
    assert store.get("k") == b"value"  # the parent's runtime is running
    fork = multiprocessing.get_context("fork")
    results = fork.Queue()
    child = fork.Process(target=_use_after_fork, args=(store, options, results))
    child.start()
    child.join(SAFETY_S)
    assert child.exitcode == 0, "the child hung or failed"
    assert results.get(timeout=SAFETY_S) == (b"value", True, "FsspecChunkStore", b"value", [])
    assert store.get("k") == b"value"  # the parent goes on with obstore


S3FS_AT_FORK = """
import os, sys
from diskreplay.io.obstore_store import ObstoreChunkStore
ObstoreChunkStore("s3://bucket/x", {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"})
before = "s3fs" in sys.modules
child = os.fork()
if child == 0:
    os._exit(0 if "s3fs" in sys.modules else 3)
print(before, os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


def test_s3fs_is_imported_before_a_fork_not_in_each_child():
    """A forked child serves S3 through s3fs: the parent imports it once, before the fork."""
    done = subprocess.run([sys.executable, "-c", S3FS_AT_FORK], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["False", "0"], done.stderr


EXIT_AFTER_READS = """
import sys
from diskreplay.io.obstore_store import ObstoreChunkStore
store = ObstoreChunkStore(sys.argv[1], {"endpoint_url": sys.argv[2], "key": sys.argv[3], "secret": sys.argv[4]})
assert store.get_many(["a", "b", "missing"]) == [b"1" * 1000, b"2" * 1000, None]
"""


@pytest.mark.slow
def test_a_process_exits_cleanly_right_after_its_reads(s3):
    """obstore's runtime threads wake the event loop from Python as requests complete; one still
    doing so as the interpreter finalized aborted the process (SIGABRT) in about 1 exit in 10."""
    from s3server import CREDENTIALS

    url = s3.new_url("exit")
    store = ObstoreChunkStore(url, s3.storage_options())
    store.put("a", b"1" * 1000)
    store.put("b", b"2" * 1000)
    codes = [subprocess.run([sys.executable, "-c", EXIT_AFTER_READS, url, s3.endpoint, CREDENTIALS["key"],
                             CREDENTIALS["secret"]], capture_output=True, timeout=120).returncode for _ in range(40)]
    assert codes == [0] * 40
