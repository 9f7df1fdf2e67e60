"""Plain S3 GETs (`S3Gets`), the first try of an s3fs store's whole-object reads, against the
real (moto) server through the fault proxy: what goes out (presigned GETs, counted at the proxy),
what a failure leads to (the policy's retries, or s3fs for good where S3 refuses), forked
children, and which storage options leave every request to s3fs."""

from __future__ import annotations

import ssl
from urllib.parse import parse_qs, urlsplit

import pytest
from conftest import exit_code_in_fork, logged
from s3server import fault_proxy, proxy_options, remote_store, s3

from diskreplay.io import s3_gets
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
    # a ranged read (the first bytes of an object) stays s3fs's: signed in a header
    assert store.get_many(KEYS[:1], limit=10) == [blob(0)[:10]]
    assert fault_proxy.presigned == 14 and fault_proxy.count("/obs/", "GET") == 15


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


def test_a_forked_child_reads_through_connections_of_its_own(s3, fault_proxy):
    store = seeded(s3, fault_proxy)
    assert [bytes(b) for b in store.get_many(KEYS)] == [blob(i) for i in range(6)]  # the parent's connections
    assert exit_code_in_fork(lambda: [bytes(b) for b in store.get_many(KEYS)] == [blob(i) for i in range(6)]) == 0
    assert [bytes(b) for b in store.get_many(KEYS)] == [blob(i) for i in range(6)]
    assert fault_proxy.presigned == fault_proxy.count("/obs/", "GET") == 3 * 6 and store.retried == 0


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
