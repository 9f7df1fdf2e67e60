"""Plain S3 GETs (`S3Gets`), the first try of an s3fs store's whole-object reads, against the
real (moto) server through the fault proxy: what goes out (presigned GETs, counted at the proxy),
what a failure leads to (the policy's retries, or s3fs for good where S3 refuses), forked
children, HTTPS, which storage options leave every request to s3fs; and a model-based test of
reads, writes, faults and forks against a dict."""

from __future__ import annotations

import ssl
from urllib.parse import parse_qs, urlsplit

import pytest
from conftest import exit_code_in_fork, logged
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from s3server import FaultProxy, fault_proxy, moto_server, outcome, proxy_options, remote_store, s3

from diskreplay import RetryPolicy
from diskreplay.io import FsspecChunkStore, s3_gets
from diskreplay.io.s3_gets import S3AnswerError, S3Gets

KEYS = [f"obs/c.0.{i}.0" for i in range(6)]


def blob(i: int) -> bytes:
    return bytes([i]) * (100_000 + i)


def seeded(s3, proxy) -> object:
    """An s3fs store through ``proxy`` (s3fs's own retries off) holding `KEYS`; the proxy's counts
    start after the writes."""
    store = remote_store(s3.new_url("gets"), proxy_options(s3, proxy), "s3fs")
    for i, key in enumerate(KEYS):
        store.put(key, blob(i))
    proxy.reset_stats()
    return store


def test_whole_object_reads_are_presigned_gets_on_kept_connections(s3, fault_proxy):
    store = seeded(s3, fault_proxy)
    assert store.plain_gets is not None
    for _ in range(2):
        got = store.get_many(KEYS + ["obs/absent"])
        assert [None if b is None else bytes(b) for b in got] == [blob(i) for i in range(6)] + [None]
    assert fault_proxy.presigned == fault_proxy.count("/obs/", "GET") == 2 * 7
    assert store.retried == 0
    # a read bounded by a limit is a plain GET too, its body cut at the limit
    got = store.get_many(KEYS[:3] + ["obs/absent"], limit=10)
    assert [None if b is None else bytes(b) for b in got] == [blob(0)[:10], blob(1)[:10], blob(2)[:10], None]
    assert fault_proxy.presigned == fault_proxy.count("/obs/", "GET") == 18


def test_an_empty_object_leaves_its_connection_ready_for_the_next_get(s3, fault_proxy):
    store = seeded(s3, fault_proxy)
    store.put("obs/empty", b"")
    gets = store.plain_gets
    for _ in range(2):
        assert bytes(gets.get("obs/empty", 10.0)) == b""
        assert bytes(gets.get(KEYS[0], 10.0)) == blob(0)  # on the same kept connection
    assert fault_proxy.connections == 1


def test_a_body_cut_at_its_limit_drops_its_connection(s3, fault_proxy):
    gets = seeded(s3, fault_proxy).plain_gets
    assert bytes(gets.get(KEYS[0], 10.0)) == blob(0)  # this thread's first connection
    assert bytes(gets.get(KEYS[1], 10.0, limit=10)) == blob(1)[:10]  # on it; the rest of the body is not read
    assert bytes(gets.get(KEYS[2], 10.0)) == blob(2)  # so a new connection
    assert bytes(gets.get(KEYS[3], 10.0, limit=len(blob(3)) + 1)) == blob(3)  # whole: the connection is kept
    assert gets.get("obs/absent", 10.0, limit=10) is None
    assert bytes(gets.get(KEYS[4], 10.0, limit=0)) == b""
    assert bytes(gets.get(KEYS[5], 10.0)) == blob(5)
    assert fault_proxy.connections == 3 and fault_proxy.presigned == 7


def test_a_transient_failure_is_retried_and_plain_gets_stay(s3, fault_proxy):
    store = seeded(s3, fault_proxy)
    fault_proxy.fail("503", f"/{KEYS[2]}", times=1, method="GET")
    assert bytes(store.get(KEYS[2])) == blob(2)
    assert store.retried == 1 and fault_proxy.count(f"/{KEYS[2]}", "GET") == 2
    assert fault_proxy.presigned == 1  # the retry went out through s3fs
    assert store.plain_gets is not None
    assert bytes(store.get(KEYS[3])) == blob(3) and fault_proxy.presigned == 2


def test_a_refused_plain_get_leaves_every_later_get_to_s3fs(s3, fault_proxy, caplog):
    store = seeded(s3, fault_proxy)
    fault_proxy.fail("403", f"/{KEYS[1]}", times=1, method="GET")
    with logged(caplog, r"s3fs serves every GET from now on \(a plain GET failed: S3AnswerError: GET of "
                        r"'obs/c\.0\.1\.0': HTTP 403 AccessDenied: Access Denied\)$", 20):
        assert bytes(store.get(KEYS[1])) == blob(1)
    assert store.plain_gets is None and store.retried == 0  # s3fs's try was a first one, not a retry
    assert fault_proxy.count(f"/{KEYS[1]}", "GET") == 2 and fault_proxy.presigned == 1
    got = store.get_many(KEYS)
    assert [bytes(b) for b in got] == [blob(i) for i in range(6)] and fault_proxy.presigned == 1


def test_a_kept_connection_the_server_dropped_is_replaced_within_the_try(s3, fault_proxy):
    store = seeded(s3, fault_proxy)
    gets = store.plain_gets
    assert bytes(gets.get(KEYS[0], 10.0)) == blob(0)  # this thread's connection is now kept
    fault_proxy.fail("reset", f"/{KEYS[4]}", times=1, method="GET")
    assert bytes(gets.get(KEYS[4], 10.0)) == blob(4)  # sent again at once, on a new connection
    assert fault_proxy.count(f"/{KEYS[4]}", "GET") == 2 and fault_proxy.faults["reset"] == 1
    fault_proxy.fail("reset", f"/{KEYS[5]}", times=2, method="GET")
    with pytest.raises(ConnectionResetError):  # a new connection reset too: the try fails
        gets.get(KEYS[5], 10.0)
    assert fault_proxy.count(f"/{KEYS[5]}", "GET") == 2


def test_any_other_answer_is_an_error_with_its_status_and_code(s3, fault_proxy):
    gets = seeded(s3, fault_proxy).plain_gets
    fault_proxy.fail("slowdown", f"/{KEYS[0]}", times=1, method="GET")
    with pytest.raises(S3AnswerError, match=r"^GET of 'obs/c\.0\.0\.0': HTTP 503 SlowDown: Please reduce your "
                                            r"request rate\.$") as caught:
        gets.get(KEYS[0], 10.0)
    assert caught.value.response == {"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                                     "ResponseMetadata": {"HTTPStatusCode": 503}}
    assert gets.get("obs/absent", 10.0) is None
    assert bytes(gets.get(KEYS[0], 10.0)) == blob(0)  # the connection that answered 503 and 404 serves on


@pytest.mark.parametrize("plain", [True, False])
def test_a_forked_child_reads_through_connections_of_its_own(s3, fault_proxy, plain):
    """An inherited store reads in a forked child: its plain GETs on the child's connections, s3fs
    on a filesystem of the child's (the parent's is bound to the parent's event loop)."""
    store = FsspecChunkStore(s3.new_url("gets"), proxy_options(s3, fault_proxy), plain_gets=plain)
    for i, key in enumerate(KEYS):
        store.put(key, blob(i))
    fault_proxy.reset_stats()
    assert [bytes(b) for b in store.get_many(KEYS)] == [blob(i) for i in range(6)]  # the parent's connections
    assert exit_code_in_fork(lambda: [bytes(b) for b in store.get_many(KEYS)] == [blob(i) for i in range(6)]
                             and store.get(KEYS[0], limit=10) == blob(0)[:10]) == 0
    assert [bytes(b) for b in store.get_many(KEYS)] == [blob(i) for i in range(6)]
    assert fault_proxy.presigned == (3 * 6 + 1 if plain else 0) and fault_proxy.count("/obs/", "GET") == 3 * 6 + 1
    assert store.retried == 0


@pytest.mark.parametrize("url,options", [
    ("memory://gets", {}),
    ("gs://bucket/gets", {}),
    ("s3://bucket/gets", {"requester_pays": True}),
    ("s3://bucket/gets", {"profile": "other"}),
    ("s3://bucket/gets", {"session": object()}),
    ("s3://bucket/gets", {"client_kwargs": {"verify": False}}),
    ("s3://bucket/gets", {"config_kwargs": {"proxies": {"https": "http://proxy:3128"}}}),
    ("s3://bucket/gets", {"config_kwargs": {"no_such_setting": 1}}),
])
def test_options_a_plain_get_might_not_honour_leave_every_get_to_s3fs(url, options):
    assert S3Gets.for_options(url, {"key": "k", "secret": "s", **options}) is None


def test_a_proxy_in_the_environment_leaves_every_get_to_s3fs(monkeypatch):
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    assert S3Gets.for_options("s3://bucket/gets", options) is not None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert S3Gets.for_options("s3://bucket/gets", options) is None


@pytest.mark.parametrize("options,signed", [
    ({"key": "k", "secret": "s", "token": "t", "client_kwargs": {"region_name": "eu-west-1"}}, True),
    ({"anon": True, "client_kwargs": {"region_name": "eu-west-1"}}, False),
])
def test_the_url_is_signed_as_s3fs_would_sign_the_request(options, signed):
    gets = S3Gets.for_options("s3a://bucket/some/prefix/", {"endpoint_url": "http://127.0.0.1:9", **options})
    url = urlsplit(gets.client.generate_presigned_url("get_object", Params={"Bucket": gets.bucket, "Key": "k"}))
    assert (gets.bucket, gets.prefix, url.path) == ("bucket", "some/prefix", "/bucket/k")
    query = parse_qs(url.query)
    if signed:
        credential = query["X-Amz-Credential"][0]
        assert credential.startswith("k/") and credential.endswith("/eu-west-1/s3/aws4_request")
        assert query["X-Amz-Security-Token"] == ["t"] and "X-Amz-Signature" in query
    else:
        assert query == {}


# ---- HTTPS --------------------------------------------------------------------------------------


@pytest.fixture
def https_object(tmp_path):
    """An HTTPS server on 127.0.0.1 with a self-signed certificate, answering every GET with
    `blob(7)`: its endpoint and the certificate's file."""
    import datetime
    import http.server
    import ipaddress
    import ssl
    import threading

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(blob(7))))
            self.end_headers()
            self.wfile.write(blob(7))

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", str(cert_file)
    server.shutdown()
    server.server_close()


def test_https_endpoints_are_checked_against_botocores_certificate_bundle(https_object, monkeypatch):
    endpoint, cert_file = https_object
    options = {"endpoint_url": endpoint, "key": "k", "secret": "s"}
    with pytest.raises(ssl.SSLCertVerificationError):  # a certificate botocore's default bundle does not hold
        S3Gets.for_options("s3://bucket/p", options).get("k", 10.0)
    monkeypatch.setenv("AWS_CA_BUNDLE", cert_file)
    s3_gets._tls_context.cache_clear()
    try:
        assert bytes(S3Gets.for_options("s3://bucket/p", options).get("k", 10.0)) == blob(7)
    finally:
        s3_gets._tls_context.cache_clear()


# ---- model-based: reads, writes, faults and forks against a dict ---------------------------------


NAMES = [f"k{i}" for i in range(4)]
TRANSIENT = ["503", "500", "slowdown", "reset"]


class PlainGetsMachine(RuleBasedStateMachine):
    """An s3fs store with plain GETs through the fault proxy, driven by writes, deletes, whole and
    ranged reads, faults armed on an object's next GETs and reads from a forked child; the model is
    the objects (a dict), the faults armed per object and whether plain GETs are still on.

    What it predicts: a read returns the model's bytes (None where absent) while at most three
    transient faults are armed on an object (fewer than the policy's attempts); an armed 403 is
    taken by the plain GET's first try while plain GETs are on (s3fs then reads the object, and
    plain GETs are off for good), else it is s3fs's answer, a `PermissionError`; a read consumes
    every fault armed on what it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.s3 = moto_server()
        self.proxy = FaultProxy(self.s3.endpoint)
        self.store = remote_store(self.s3.new_url("model"), proxy_options(self.s3, self.proxy), "s3fs")
        self.store.retry = RetryPolicy(base_delay=0.001, max_delay=0.01)
        self.objects: dict[str, bytes] = {}
        self.armed: dict[str, list[str]] = {name: [] for name in NAMES}
        self.plain = self.store.plain_gets is not None

    def teardown(self) -> None:
        self.proxy.close()

    def _path(self, name: str) -> str:
        return f"/{self.store.root}/{name}"

    @rule(name=st.sampled_from(NAMES), size=st.integers(0, 300_000), fill=st.integers(0, 255))
    def put(self, name: str, size: int, fill: int) -> None:
        data = bytes([fill]) * size
        self.store.put(name, data)
        self.objects[name] = data

    @rule(name=st.sampled_from(NAMES))
    def delete(self, name: str) -> None:
        self.store.delete(name)
        self.objects.pop(name, None)

    @rule(name=st.sampled_from(NAMES), kind=st.sampled_from(TRANSIENT), times=st.integers(1, 2))
    def arm_transient(self, name: str, kind: str, times: int) -> None:
        assume("403" not in self.armed[name] and len(self.armed[name]) + times <= 3)
        self.proxy.fail(kind, self._path(name), times=times, method="GET")
        self.armed[name] += [kind] * times

    @rule(name=st.sampled_from(NAMES))
    def arm_refusal(self, name: str) -> None:
        assume(not self.armed[name])
        self.proxy.fail("403", self._path(name), times=1, method="GET")
        self.armed[name] = ["403"]

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4, unique=True))
    def read(self, names: list[str]) -> None:
        refused = [name for name in names if self.armed[name] == ["403"]]
        result, error = outcome(lambda: self.store.get_many(names))
        for name in names:
            self.armed[name] = []
        if refused and not self.plain:
            assert isinstance(error, PermissionError), repr(error)
            return
        assert error is None, repr(error)
        assert [None if b is None else bytes(b) for b in result] == [self.objects.get(n) for n in names]
        self.plain = self.plain and not refused

    @rule(name=st.sampled_from(NAMES), limit=st.sampled_from([1, 10, 200_000]))
    def read_bounded(self, name: str, limit: int) -> None:
        refused = self.armed[name] == ["403"]
        result, error = outcome(lambda: self.store.get(name, limit=limit))
        self.armed[name] = []
        if refused and not self.plain:
            assert isinstance(error, PermissionError), repr(error)
            return
        assert error is None, repr(error)
        assert result == (None if name not in self.objects else self.objects[name][:limit])
        self.plain = self.plain and not refused

    @precondition(lambda self: not any(self.armed.values()))
    @rule()
    def read_in_a_forked_child(self) -> None:
        names, want = list(self.objects), list(self.objects.values())
        assert exit_code_in_fork(lambda: [bytes(b) for b in self.store.get_many(names)] == want) == 0

    @invariant()
    def plain_gets_are_on_until_s3_refuses_one(self) -> None:
        assert (self.store.plain_gets is not None) == self.plain


TestPlainGetsModel = PlainGetsMachine.TestCase
TestPlainGetsModel.settings = settings(max_examples=25, stateful_step_count=20, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
