"""The s3fs stores of a process share one aiobotocore session, on botocore data parsed once
(and inherited, parsed, by a forked child): `diskreplay.io.s3fs_session`."""

from __future__ import annotations

import os

import botocore.loaders
import fsspec.asyn
import pytest

from diskreplay.io import s3fs_session
from diskreplay.io.remote import pool_options

s3fs = pytest.importorskip("s3fs")
OPTIONS = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}


@pytest.fixture
def parsed(monkeypatch):
    """The botocore data files parsed while the test runs."""
    paths: list[str] = []
    parse = botocore.loaders.JSONFileLoader.load_file
    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file",
                        lambda loader, path: paths.append(os.path.basename(path)) or parse(loader, path))
    return paths


def _client_made(options: dict) -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    fsspec.asyn.sync(fs.loop, fs.set_session)  # makes the S3 client (no request)
    return fs


def test_stores_share_one_session_whose_data_is_parsed_once(parsed):
    s3fs_session.warm()
    parsed.clear()
    first, second = (pool_options("s3://bucket/a", OPTIONS, 16), pool_options("s3://bucket/b", OPTIONS, 32))
    assert first["session"] is second["session"] is s3fs_session.session()
    assert first["config_kwargs"] == {"max_pool_connections": 16}
    fs = _client_made(first)
    assert fs.session is first["session"]
    assert parsed == []  # the S3 model, endpoint rules and partitions were parsed by warm()


def test_a_client_of_a_new_session_parses_the_data(parsed):
    """What the shared session spares: s3fs's own session parses botocore's S3 data."""
    _client_made(OPTIONS)
    assert {"service-2", "endpoint-rule-set-1", "endpoints", "partitions"} <= set(parsed)


@pytest.mark.parametrize("own", [{"session": "mine"}, {"profile": "test-user"}])
def test_options_that_configure_a_session_keep_it(own):
    options = {**OPTIONS, **own}
    assert s3fs_session.with_session(options) == options


def test_other_filesystems_get_no_session():
    assert pool_options("memory://x", OPTIONS, 16) is OPTIONS


def test_a_forked_child_makes_its_own_session_on_the_parsed_data():
    s3fs_session.warm()
    parent = s3fs_session.session()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        calls = []
        parse = botocore.loaders.JSONFileLoader.load_file
        botocore.loaders.JSONFileLoader.load_file = lambda loader, path: calls.append(path) or parse(loader, path)
        mine = s3fs_session.session()
        _client_made({**OPTIONS, "session": mine})
        same_loader = mine.get_component("data_loader") is parent.get_component("data_loader")
        os.write(write, f"{mine is not parent} {same_loader} {len(calls)}".encode())
        os._exit(0)
    os.close(write)
    answer = os.read(read, 100).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    assert answer == "True True 0"
