"""Stored zstd frames: a zstd field keeps what zstd cannot shrink as zstd's raw blocks, which any
zstd decoder reads (zarr-python's too) and diskreplay copies out without decoding."""

from __future__ import annotations

import numcodecs
import numpy as np
import pytest
import zarr
import zstandard

import diskreplay as dr
from diskreplay.format import codecs, zstd_frames
from diskreplay.format.codecs import Codec
from diskreplay.format.zstd_frames import BLOCK_BYTES, copy_stored, keeps_frame, stored_frame, stored_mask

SIZES = [1, 7, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES + 5]


def spans(frames: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The frames end to end (uint8), and each one's start and length."""
    length = np.array([len(frame) for frame in frames], np.int64)
    return np.frombuffer(b"".join(frames), np.uint8), np.concatenate([[0], np.cumsum(length)[:-1]]), length


@pytest.mark.parametrize("n", SIZES)
def test_a_stored_frame_is_a_zstd_frame_of_its_content(n):
    content = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    frame = stored_frame(content)
    assert zstandard.ZstdDecompressor().decompress(frame) == content.tobytes()
    assert numcodecs.Zstd().decode(frame) == content.tobytes()
    assert zstandard.frame_content_size(frame) == n
    assert len(frame) == 13 + 3 * -(-n // BLOCK_BYTES) + n  # the header, a 3-byte header per block


def test_a_zstd_frame_is_kept_when_it_saves_an_eighth():
    assert keeps_frame(875, 1000) and not keeps_frame(876, 1000)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("target", ["batched", "one by one", "strided rows"])
@pytest.mark.parametrize("rows", [[5, 0, 2, 7, 1, 6], [3, 0, 4, 0, 0, 5]], ids=["two runs", "one run"])
def test_stored_frames_are_found_and_copied_into_their_rows(n, target, rows, monkeypatch):
    """Among other frames, only the stored frames of the rows' size are found, and only their
    rows are written (the stored frames' rows out of order, in two runs; or one run in order)."""
    if target != "batched":
        monkeypatch.setattr(zstd_frames, "_COPY_RUNS", None)
    contents = np.random.default_rng(n).integers(0, 256, (6, n), dtype=np.uint8)
    frames = [stored_frame(content) for content in contents]
    frames[1] = zstandard.ZstdCompressor().compress(contents[1].tobytes())  # zstd's own frame
    frames[3] = stored_frame(np.zeros(n + 1, np.uint8))  # of another size
    damaged = bytearray(frames[4])
    damaged[13] ^= 0x02  # the first block's type: RLE, not raw
    frames[4] = bytes(damaged)
    data, begin, length = spans(frames)
    stored = stored_mask(data, begin, length, n)
    assert stored.tolist() == [True, False, True, False, False, True]
    flat = np.zeros((8, 2 * n), np.uint8)[:, ::2] if target == "strided rows" else np.zeros((8, n), np.uint8)
    rows = np.array(rows)
    copy_stored(data, begin[stored], flat, rows[stored])
    for frame in np.flatnonzero(stored):
        np.testing.assert_array_equal(flat[rows[frame]], contents[frame])
    assert not np.delete(flat, rows[stored], axis=0).any()
    copy_stored(data, begin[:0], flat, rows[:0])  # no frames: nothing written
    assert not np.delete(flat, rows[stored], axis=0).any()


def test_a_truncated_stored_frame_is_not_taken_for_one():
    frame = stored_frame(np.arange(100, dtype=np.uint8))
    data, begin, length = spans([frame[:-1], frame])
    assert stored_mask(data, begin, length, 100).tolist() == [False, True]
    assert stored_mask(data, begin, length, 99).tolist() == [False, False]
    empty = np.array([len(frame), 13])  # a 13-byte span is the header of a stored frame of nothing
    assert stored_mask(data, np.zeros(2, np.int64), empty, 0).tolist() == [False, False]


class _NoZstd:
    """Stands in for this thread's zstd contexts: decoding through it fails the test."""

    @property
    def decompressor(self):
        raise AssertionError("zstd decoded a frame")

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        return zstandard.ZstdCompressor(level=level)


@pytest.mark.parametrize("inner_rows", [None, 64])
def test_chunks_zstd_cannot_shrink_are_stored_and_read_without_zstd(inner_rows, monkeypatch):
    """Noise is kept in stored frames (read back without calling zstd where its chunk is a shard
    of inner chunks), a slowly varying signal in zstd's own frames."""
    noise = np.random.default_rng(0).standard_normal((4096, 17)).astype(np.float32)
    smooth = np.repeat(np.arange(4096, dtype=np.float32)[:, None] // 64, 17, axis=1)
    codec = Codec("zstd", 3, True, inner_rows)
    stored, compressed = (b"".join(bytes(part) for part in codec.encode(x)) for x in (noise, smooth))
    assert len(stored) > noise.nbytes > 8 * len(compressed)
    if inner_rows is None:
        assert stored[:5] == bytes.fromhex("28b52ffde0")
    else:
        index = np.frombuffer(stored[:codec.index_bytes(4096) - 4], "<u8").reshape(-1, 2).astype(np.int64)
        data = np.frombuffer(stored, np.uint8)
        assert stored_mask(data, index[:, 0], index[:, 1] - 4, 64 * 17 * 4).all()
        monkeypatch.setattr(codecs, "_ZSTD", _NoZstd())
    out = np.empty_like(noise)
    codec.decode_into(stored, out)
    np.testing.assert_array_equal(out, noise)
    if inner_rows is not None:
        with pytest.raises(AssertionError, match="zstd decoded a frame"):
            codec.decode_into(compressed, out)


def test_zarr_python_reads_a_buffer_of_stored_frames(tmp_path):
    """A zstd buffer of random images (sharded chunks of stored inner frames) and noise (whole
    stored chunks): zarr-python reads every value the buffer holds."""
    rng = np.random.default_rng(1)
    rows = {"img": rng.integers(0, 256, (40, 32, 64), dtype=np.uint8),
            "noise": rng.standard_normal((40, 3)).astype(np.float32)}
    path = tmp_path / "stored"
    fields = {"img": dr.Field((32, 64), "uint8"), "noise": dr.Field((3,), "float32")}
    with dr.ReplayBuffer.create(path, fields, capacity=None, chunk_rows=16, compression="zstd") as buf:
        buf.extend(rows)
    chunk = (path / "noise" / "c.0.0.0").read_bytes()
    assert chunk[:5] == bytes.fromhex("28b52ffde0")
    for name, values in rows.items():
        np.testing.assert_array_equal(zarr.open_array(str(path / name), mode="r")[0, :40], values)
