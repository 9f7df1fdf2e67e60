"""A chunk's trailing CRC32C: large bodies are checked without the GIL, with the same outcome and
message as small ones."""

from __future__ import annotations

import numpy as np
import pytest

from diskreplay.format import codecs, lz4_blocks
from diskreplay.format.codecs import GIL_FREE_CHECK_BYTES, Codec, checksum


@pytest.fixture(params=["extension", "fallback"])
def extension(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(lz4_blocks, "_batch", None)
    elif lz4_blocks._batch is None or lz4_blocks._CRC32C_ADDRESS is None:
        pytest.skip("the _batch extension or google-crc32c's C library is not there")
    return request.param


@pytest.mark.parametrize("size", [10, GIL_FREE_CHECK_BYTES - 1, GIL_FREE_CHECK_BYTES, 3 * 2**20 + 7])
@pytest.mark.parametrize("form", [bytes, memoryview])
def test_verified_body_returns_the_body_or_names_both_checksums(extension, size, form):
    body = np.random.default_rng(size).bytes(size)
    stored = checksum(body)
    assert bytes(Codec.verified_body(form(body + stored))) == body
    damaged = bytearray(body)
    damaged[size // 2] ^= 0x40
    computed = checksum(bytes(damaged))
    with pytest.raises(ValueError, match=rf"^checksum mismatch \(stored {stored.hex()}, computed {computed.hex()}\)$"):
        Codec.verified_body(form(bytes(damaged) + stored))


def test_large_bodies_go_through_the_batch_check(monkeypatch):
    calls = []
    real = codecs.first_bad_checksum
    monkeypatch.setattr(codecs, "first_bad_checksum", lambda *a: calls.append(a[1].tolist()) or real(*a))
    body = bytes(GIL_FREE_CHECK_BYTES)
    Codec.verified_body(bytes(100) + checksum(bytes(100)))
    Codec.verified_body(body + checksum(body))
    assert calls == [[GIL_FREE_CHECK_BYTES]]
