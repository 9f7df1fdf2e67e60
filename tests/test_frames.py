"""Image observations: chunks sized by bytes, compressed frames stored as Zarr shards and read
row by row, frame stacks that share their frames."""

import json
import mmap
import os
import re
import signal
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import lz4.block
import numpy as np
import pytest
import zarr
import zstandard
from conftest import exit_code_in_fork

import diskreplay as dr
from diskreplay.audit import buffer_info, format_info, verify
from diskreplay.format import codecs, lz4_blocks
from diskreplay.format.codecs import Codec, checksum
from diskreplay.format.commit import CommitRecord
from diskreplay.io import LocalChunkStore
from diskreplay.storage import shard_maps

FIELDS = {"obs": dr.Field((32, 32), "uint8"), "next_obs": dr.Field((32, 32), "uint8"),
          "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
INNER = 8  # frames of 1 KiB: inner chunks of 8 KiB


def frames(first: int, count: int, lanes: int = 1) -> np.ndarray:
    """Frames that compress (flat with sparse noise) and say which step and lane they are."""
    rng = np.random.default_rng(first)
    out = np.full((count, lanes, 32, 32), 40, np.uint8)
    noise = rng.random(out.shape) < 0.05
    out[noise] = rng.integers(0, 256, int(noise.sum()), dtype=np.uint8)
    steps = np.arange(first, first + count)
    out[:, :, 0, :4] = ((steps[:, None] >> np.array([0, 8, 16, 24])) & 255).astype(np.uint8)[:, None, :]
    out[:, :, 1, 0] = np.arange(lanes, dtype=np.uint8)
    return out


def rows(first: int, count: int, lanes: int) -> dict[str, np.ndarray]:
    obs = frames(first, count + 1, lanes)
    done = ((np.arange(first, first + count) % 37) == 36)[:, None].repeat(lanes, 1)
    action = np.arange(first, first + count)[:, None].repeat(lanes, 1)
    return {"obs": obs[:-1], "next_obs": obs[1:], "action": action, "reward": (action % 7).astype(np.float32),
            "done": done}


def fill(buf: dr.ReplayBuffer, count: int, lanes: int, start: int = 0) -> None:
    for first in range(start, start + count, 250):
        piece = rows(first, min(250, start + count - first), lanes)
        buf.extend(piece if lanes > 1 else {name: value[:, 0] for name, value in piece.items()})


def make(url: str, compression: str | None, capacity: int | None = 2000, lanes: int = 2, **kwargs) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.create(url, FIELDS, capacity=capacity, num_envs=lanes, chunk_rows=64,
                                  compression=compression, derive_next=("obs",), episode_end="done", seed=0, **kwargs)


def test_lz4hc_writes_the_same_kind_of_lz4_blocks_in_fewer_bytes(tmp_path):
    """lz4hc (level 6 unless given) writes blosc frames of one LZ4 block, as lz4 does, in fewer
    bytes; zarr-python reads them back."""
    url = str(tmp_path / "hc")
    with make(url, "lz4hc", capacity=None, lanes=1) as buf:
        fill(buf, 300, 1)
        assert buf.storage.config.level == 6
    inner = zarr.open_array(url + "/obs", mode="r").metadata.to_dict()["codecs"][0]["configuration"]["codecs"]
    assert inner[1]["name"] == "blosc" and (inner[1]["configuration"]["cname"], inner[1]["configuration"]["clevel"]) \
        == ("lz4hc", 6)
    written = np.concatenate([rows(first, min(250, 300 - first), 1)["obs"][:, 0] for first in (0, 250)])
    np.testing.assert_array_equal(zarr.open_array(url + "/obs", mode="r")[0, :300], written)
    stored = {c: [bytes(Codec(c, inner_rows=1).encode(frame[None])[2]) for frame in written] for c in ("lz4", "lz4hc")}
    assert sum(map(len, stored["lz4hc"])) < 0.95 * sum(map(len, stored["lz4"]))
    for body, frame in zip(stored["lz4hc"], written):
        assert body[2] >> 5 == lz4_blocks.BLOSC_LZ4  # the compressor code blosc writes for LZ4 and LZ4-HC alike
        block = lz4.block.decompress(body[lz4_blocks.LZ4_HEAD:], uncompressed_size=frame.size)
        np.testing.assert_array_equal(np.frombuffer(block, np.uint8).reshape(frame.shape), frame)


def test_default_chunks_follow_bytes(tmp_path):
    pixels = {"obs": dr.Field((84, 84), "uint8"), "action": dr.Field((), "int64")}
    small = {"obs": dr.Field((17,), "float32"), "reward": dr.Field((), "float32")}
    assert dr.ReplayBuffer.create(str(tmp_path / "a"), pixels, capacity=100_000).storage.layout.chunk_rows == 128
    assert dr.ReplayBuffer.create(str(tmp_path / "b"), small, capacity=100_000).storage.layout.chunk_rows == 4096
    # raw rings of many chunk files get longer chunks, so that all of them can stay mapped
    raw = dr.ReplayBuffer.create(str(tmp_path / "c"), pixels, capacity=3_000_000, compression=None)
    assert raw.storage.layout.chunk_rows == 512


def test_compressed_frames_are_zarr_shards_of_inner_chunks(tmp_path):
    url = str(tmp_path / "b")
    with make(url, "zstd", capacity=None) as buf:
        fill(buf, 300, 2)
    meta = zarr.open_array(url + "/obs", mode="r").metadata.to_dict()
    sharding = meta["codecs"][0]
    assert sharding["name"] == "sharding_indexed"
    assert list(sharding["configuration"]["chunk_shape"]) == [1, INNER, 32, 32]
    assert [c["name"] for c in sharding["configuration"]["codecs"]] == ["bytes", "zstd", "crc32c"]
    assert [c["name"] for c in zarr.open_array(url + "/action", mode="r").metadata.to_dict()["codecs"]] == \
        ["bytes", "zstd", "crc32c"]  # small rows: whole chunks
    assert "Zarr shards read row by row, inner chunks: obs 8 rows" in format_info(buffer_info(url))
    stored = zarr.open_array(url + "/obs", mode="r")[:, :300]  # plain zarr-python reads the shards
    written = np.concatenate([rows(first, min(250, 300 - first), 2)["obs"] for first in range(0, 300, 250)])
    np.testing.assert_array_equal(stored, written.transpose(1, 0, 2, 3))


@pytest.mark.parametrize("compression", ["zstd", "lz4", "lz4hc"])
@pytest.mark.parametrize("capacity", [None, 2000])
def test_frames_read_row_by_row_equal_raw_ones(tmp_path, compression, capacity):
    """A cache far smaller than the frames: each sampled frame is one inner chunk read; batches,
    stacks and n-step windows equal those of a raw buffer holding the same steps."""
    raw = make(str(tmp_path / "raw"), None, capacity)
    packed = make(str(tmp_path / "z"), compression, capacity, cache_bytes=1 << 20)  # the writer too, once a ring
    for buf in (raw, packed):
        fill(buf, 2600, 2)  # the ring wraps
        buf.flush()
    reader = dr.ReplayBuffer.open(str(tmp_path / "z"), "r", cache_bytes=64 << 10)
    assert (set(reader.stats().row_fields) == {"obs"}
            and set(packed.stats().row_fields) == ({"obs"} if capacity else set()))
    for kwargs in (dict(), dict(stack=4), dict(n_step=3, gamma=0.9, stack=2)):
        want = raw.sample(200, seed=3, **kwargs)
        for buf in (packed, reader):
            got = buf.sample(200, seed=3, **kwargs)
            assert got.keys() == want.keys()
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"{key} {kwargs}")
    ids = raw.row_ids()
    np.testing.assert_array_equal(reader[ids]["obs"], raw[ids]["obs"])


def test_a_reader_past_its_cache_never_fills_it_with_half_read_chunks(tmp_path):
    """A ring whose capacity exceeds the reader's cache reads its frames row by row, though its
    few stored rows fit: the first read caches the other fields' chunk in its home slot, and a
    fill behind it must not take that chunk for a whole one (it once did, and the frames then
    read as zeros). Found by the model-based test."""
    fields = {"img": dr.Field((32, 32), "uint8"), "act": dr.Field((), "int64")}
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), fields, capacity=13, chunk_rows=2, compression="zstd",
                                 cache_bytes=12600)
    frames = np.arange(2 * 32 * 32).reshape(2, 32, 32).astype(np.uint8)
    buf.extend({"img": frames, "act": np.arange(2)})
    buf.close()
    reader = dr.ReplayBuffer.open(str(tmp_path / "b"), "r", cache_bytes=12600)
    assert set(reader.stats().row_fields) == {"img"}
    for _ in range(2):
        np.testing.assert_array_equal(reader[np.arange(2)]["img"], frames)
        reader.warm()
    np.testing.assert_array_equal(reader[np.arange(2)]["img"], frames)


def count_reads(monkeypatch) -> dict[str, int]:
    counts = {"inner": 0, "whole obs": 0}
    decode_bodies, get = Codec.decode_bodies, LocalChunkStore.get

    def counted_decode_bodies(self, bodies, out, rows=None):
        counts["inner"] += len(bodies)
        return decode_bodies(self, bodies, out, rows)

    def counted_get(self, key, limit=None):
        # not the final obs kept apart
        counts["whole obs"] += key.startswith("obs/") and not self.root.endswith("final")
        return get(self, key, limit)
    monkeypatch.setattr(Codec, "decode_bodies", counted_decode_bodies)
    monkeypatch.setattr(LocalChunkStore, "get", counted_get)
    return counts


def test_a_sampled_frame_costs_one_inner_chunk_not_its_whole_chunk(tmp_path, monkeypatch):
    with make(str(tmp_path / "z"), "zstd") as buf:
        fill(buf, 2000, 2)
    reader = dr.ReplayBuffer.open(str(tmp_path / "z"), "r", cache_bytes=64 << 10)
    counts = count_reads(monkeypatch)
    batch = reader.sample(256, seed=1)
    lane, step = batch["index"] % 2, batch["index"] // 2
    drawn = {(ln, t % 1000 // INNER) for ln, t in zip(lane.tolist(), step.tolist())}
    following = {(ln, (t + 1) % 1000 // INNER) for ln, t in zip(lane.tolist(), step.tolist())}
    assert counts["whole obs"] == 0
    # obs and the next obs it derives: once; an episode end's next obs: one inner chunk of the finals kept apart
    assert len(drawn) <= counts["inner"] <= len(drawn | following) + int(batch["done"].sum())
    counts["inner"] = 0
    stacked = reader.sample(32, stack=4, seed=2)
    assert 0 < counts["inner"] <= 32 * 5 and counts["whole obs"] == 0
    assert np.shares_memory(stacked["obs"], stacked["next_obs"])


def drop_tables(url: str) -> None:
    """Remove the shard index tables a closing writer left: readers read each shard's own index."""
    for name in os.listdir(tables := os.path.join(url, "diskreplay", "objects", "shard-index-tables")):
        os.remove(os.path.join(tables, name))


def damage(path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("where, message", [
    ("index", "does not decode .*checksum mismatch"),
    ("span", "does not decode .*outside the shard's data"),
    ("frame", "does not decode .*checksum mismatch"),
    ("truncated", "does not decode .*too short to hold an index"),
])
def test_a_damaged_shard_is_reported_naming_its_chunk(tmp_path, where, message):
    url = str(tmp_path / "z")
    with make(url, "zstd", lanes=1) as buf:
        fill(buf, 2000, 1)
    path = f"{url}/obs/c.0.3.0.0"
    index = 16 * (64 // INNER) + 4
    if where == "index":
        damage(path, 5, b"\xff")
    elif where == "span":  # a consistent index (checksum fixed) whose first span is enormous
        blob = bytearray(open(path, "rb").read())
        entries = np.frombuffer(bytes(blob[:index - 4]), "<u8").copy().reshape(-1, 2)
        entries[:, 1] = 1 << 40
        blob[:index - 4] = entries.tobytes()
        blob[index - 4:index] = checksum(bytes(blob[:index - 4]))
        open(path, "wb").write(bytes(blob))
    elif where == "frame":
        damage(path, index + 3, b"\x00\x01\x02")
    else:
        open(path, "wb").write(b"\0" * 10)
    drop_tables(url)  # else the closing writer's table gives the index, and the shard's own is not read
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10)
    ids = np.array([3 * 64])  # the first row of chunk 3
    with pytest.raises(dr.CorruptBufferError, match=rf"chunk 'obs/c.0.3.0.0' {message}"):
        reader.rows(ids)
    assert not verify(url).ok


def test_a_zstd_frame_cannot_size_an_allocation(tmp_path):
    codec = Codec("zstd", 3, True, 1)
    out = np.empty((1, 32, 32), np.uint8)
    huge = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))  # says 1 MiB where 1 KiB belongs
    with pytest.raises(ValueError, match="zstd frame of 1048576 bytes, expected 1024"):
        codec.decode_inner(huge + checksum(huge), out)


def shard_rows(kind: str) -> tuple[np.ndarray, int]:
    """A chunk's rows of one kind, and the rows of its inner chunks."""
    rng = np.random.default_rng(7)
    pictures = frames(0, 64)[:, 0]
    return {"floats": (np.cumsum(rng.standard_normal((256, 17)), axis=0).astype(np.float32), 16),
            "frames": (np.ascontiguousarray(np.tile(pictures[:12], (1, 3, 3))[:, :84, :84]), 1),
            "frames and noise": (np.concatenate([pictures[:6], rng.integers(0, 256, (6, 32, 32), np.uint8)]), 1),
            "blocks of frames": (pictures, 8),
            "one inner chunk": (np.arange(128).reshape(8, 16) * 3, 8)}[kind]


def with_index(codec: Codec, blob: bytes, rows: int, change: Any) -> bytes:
    """The shard ``blob`` of ``rows`` rows with ``change`` applied to its index (inner chunks x
    (offset, nbytes), uint64), the index's checksum made to match."""
    head = codec.index_bytes(rows) - 4
    index = np.frombuffer(blob[:head], "<u8").reshape(-1, 2).copy()
    change(index)
    return index.tobytes() + checksum(index.tobytes()) + blob[head + 4:]


@pytest.mark.parametrize("empty", ["none", "some", "all"])
@pytest.mark.parametrize("kind", ["floats", "frames", "frames and noise", "blocks of frames", "one inner chunk"])
@pytest.mark.parametrize("compression", ["zstd", "lz4", "lz4hc"])
def test_a_shard_decoded_whole_is_what_was_written(compression, kind, empty, lz4_decodes):
    """Whole shards decode to their rows, from bytes or a view, through each LZ4 decoder; inner
    chunks the index marks stored empty (as zarr writes one of its fill value) to zeros."""
    chunk, inner = shard_rows(kind)
    codec = Codec(compression, 3, True, inner)
    count = len(chunk) // inner
    gone = {"none": [], "some": [0, count - 1, count // 2][:max(count - 1, 1)], "all": list(range(count))}[empty]
    blob = with_index(codec, b"".join(bytes(part) for part in codec.encode(chunk)), len(chunk),
                      lambda index: index.__setitem__(gone, codecs.EMPTY_INNER))
    expected = chunk.copy()
    for i in gone:
        expected[i * inner:(i + 1) * inner] = 0
    for given in (blob, memoryview(bytearray(blob))):
        out = np.full_like(chunk, 7)
        codec.decode_into(given, out)
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("compression", ["zstd", "lz4", "lz4hc"])
def test_a_shard_zarr_wrote_decodes_whole_from_a_map(tmp_path, compression):
    """zarr-python marks inner chunks of its fill value empty; a shard it wrote decodes, from a
    memory map, to its rows, those zeros; nothing holds the map after."""
    codec = Codec(compression, 3, True, 8)
    chunk = frames(0, 64)[:, 0]
    chunk[8:24] = chunk[56:] = 0
    arr = zarr.create_array(str(tmp_path / "a"), shape=(1, 64, 32, 32), chunks=(1, 64, 32, 32), dtype="uint8",
                            fill_value=0, **codec.zarr_codecs(dr.Field((32, 32), "uint8")))
    arr[:] = chunk[None]
    out = np.full_like(chunk, 7)
    with open(tmp_path / "a/c/0/0/0/0", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        index = np.frombuffer(data[:128], "<u8").reshape(-1, 2)
        assert (index[[1, 2, 7]] == codecs.EMPTY_INNER).all() and (index[[0, 3, 6]] != codecs.EMPTY_INNER).all()
        view = memoryview(data)
        codec.decode_into(view, out)
        view.release()
    np.testing.assert_array_equal(out, chunk)


def damaged_shard(codec: Codec, chunk: np.ndarray, where: str) -> tuple[bytes, str]:
    """``chunk`` stored as a shard of inner chunks of 8 rows, damaged at ``where``, and the message
    (a regex) its whole decode raises."""
    blob = b"".join(bytes(part) for part in codec.encode(chunk))
    head, size = codec.index_bytes(len(chunk)), len(blob)
    offset, nbytes = (int(v) for v in np.frombuffer(blob[32:48], "<u8"))  # inner chunk 2's span

    def spans(*changes: tuple[int, int, int], data: bytes = blob) -> bytes:
        return with_index(codec, data, len(chunk), lambda index: [index.__setitem__(i, span) for i, *span in changes])

    def replaced(data: bytes, inner: int, body: bytes, empty: bool = False) -> bytes:  # a new body at the end
        others = [(i, codecs.EMPTY_INNER, codecs.EMPTY_INNER) for i in range(len(chunk) // 8) if empty and i != inner]
        return spans((inner, len(data), len(body) + 4), *others, data=data + body + checksum(body))

    flipped = blob[:offset + 10] + bytes([blob[offset + 10] ^ 1]) + blob[offset + 11:]  # in inner chunk 2's body
    later = int.from_bytes(blob[80:88], "little") + 10  # in inner chunk 5's body
    outside = re.escape(f"inner chunk 2: span ({head - 1}, {nbytes}) outside the shard's data")
    mismatch = r"checksum mismatch \(stored [0-9a-f]{8}, computed [0-9a-f]{8}\)"
    body = bytes(codec.encode(chunk[:8])[2])
    other_size = {"zstd": "error decompressing item 2: decompressed 4096 bytes; expected 8192",
                  "lz4": "blosc frame of 4096 bytes, expected 8192"}[codec.compression]
    return {
        "short": (blob[:100], "^100 bytes: too short to hold the shard's index of 132 bytes$"),
        "index": (blob[:5] + bytes([blob[5] ^ 1]) + blob[6:], f"^{mismatch}$"),
        "offset in the index": (spans((2, head - 1, nbytes)), f"^{outside}$"),
        "span too long": (spans((2, offset, size + 1)),
                          "^" + re.escape(f"inner chunk 2: span ({offset}, {size + 1}) outside the shard's data")),
        "span too short": (spans((2, offset, 4)),
                           "^" + re.escape(f"inner chunk 2: span ({offset}, 4) outside the shard's data")),
        "half empty": (spans((2, codecs.EMPTY_INNER, nbytes)), "^" + re.escape(
            f"inner chunk 2: span ({codecs.EMPTY_INNER}, {nbytes}) past the shard's {size} bytes")),
        "span past the end": (spans((2, size - nbytes + 1, nbytes)), "^" + re.escape(
            f"inner chunk 2: span ({size - nbytes + 1}, {nbytes}) past the shard's {size} bytes")),
        "inner checksum": (flipped, f"^inner chunk 2: {mismatch}$"),
        "checksum before span": (spans((5, head - 1, 40), data=flipped), f"^inner chunk 2: {mismatch}$"),
        "span before checksum": (spans((2, head - 1, nbytes), data=blob[:later] + b"\0\1" + blob[later + 2:]),
                                 f"^{outside}$"),
        "frame of another size": (replaced(blob, 2, bytes(codec.encode(chunk[:4])[2])), f"^{other_size}"),
        "lone frame of another size": (replaced(blob, 2, bytes(codec.encode(chunk[:4])[2]), empty=True),
                                       {"zstd": "^zstd frame of 4096 bytes, expected 8192$",
                                        "lz4": "^blosc frame of 4096 bytes, expected 8192$"}[codec.compression]),
        "frame of garbage": (replaced(blob, 2, body[:24] + b"\xff" * (len(body) - 24)),
                             {"zstd": "^error decompressing item 2: ",
                              "lz4": "^LZ4 block: "}[codec.compression]),
    }[where]


@pytest.mark.parametrize("where", ["short", "index", "offset in the index", "span too long", "span too short",
                                   "half empty", "span past the end", "inner checksum", "checksum before span",
                                   "span before checksum", "frame of another size", "lone frame of another size",
                                   "frame of garbage"])
@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_a_damaged_shard_decoded_whole_says_what_is_wrong(compression, where, lz4_decodes):
    """A damaged shard's whole decode raises ValueError naming the first damage, in the order of
    the inner chunks: its index, an inner chunk's span, its checksum, a frame that does not decode
    to its rows."""
    codec = Codec(compression, 3, True, 8)
    blob, message = damaged_shard(codec, frames(0, 64)[:, 0], where)
    with pytest.raises(ValueError, match=message):
        codec.decode_into(blob, np.full((64, 32, 32), 7, np.uint8))


def built_batch() -> Any:
    """The `_batch` extension; the test is skipped where it was not built (no C compiler at
    install), except under CI, which installs with one."""
    if lz4_blocks._batch is None:
        assert not os.environ.get("CI"), "CI installs with a C compiler: the extension must be built"
        pytest.skip("diskreplay.format._batch was not built (no C compiler at install)")
    return lz4_blocks._batch


@pytest.fixture(params=["batch", "one by one"])
def checksum_path(request, monkeypatch) -> str:
    """Checksums checked by the `_batch` extension (a decoding thread's frames in one call), then without it."""
    if request.param == "batch":
        built_batch()
    if request.param == "one by one":
        monkeypatch.setattr(lz4_blocks, "_batch", None)
    return request.param


def test_first_bad_checksum_finds_the_first_body_whose_crc32c_differs(checksum_path):
    bodies = [bytes([k]) * (100 + k) for k in range(5)]
    blobs = [body + checksum(body) for body in bodies]
    blobs[2] = blobs[2][:-1] + bytes([blobs[2][-1] ^ 1])
    blobs[4] = b"x" + blobs[4][1:]
    data = [np.frombuffer(blob, np.uint8) for blob in blobs]
    sources = np.array([d.ctypes.data for d in data], np.int64)
    sizes = np.array([len(b) for b in bodies], np.int64)
    assert lz4_blocks.first_bad_checksum(sources, sizes) == 2
    assert lz4_blocks.first_bad_checksum(sources[[0, 1, 3]], sizes[[0, 1, 3]]) == -1
    assert lz4_blocks.first_bad_checksum(sources[[3, 4]], sizes[[3, 4]]) == 1
    assert lz4_blocks.first_bad_checksum(sources[:0], sizes[:0]) == -1


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
@pytest.mark.parametrize("chunk", [3, 25])
def test_a_damaged_frame_among_many_is_named(tmp_path, checksum_path, compression, chunk):
    """Many frames are checked in one call per decoding thread; the damaged one is still named by
    its chunk, early in the batch (chunk 3) or late (25), whichever thread takes it."""
    url = str(tmp_path / "z")
    with make(url, compression, lanes=1) as buf:
        fill(buf, 2000, 1)
    damage(f"{url}/obs/c.0.{chunk}.0.0", 16 * (64 // INNER) + 4 + 40, b"\x00\x01\x02")
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10, io_threads=2)
    ids = np.arange(0, 2000, 9)
    with pytest.raises(dr.CorruptBufferError,
                       match=rf"chunk 'obs/c.0.{chunk}.0.0' does not decode \(inner chunk 0: checksum"):
        reader.rows(ids)


def test_a_blosc_frame_claiming_fewer_bytes_is_refused():
    codec = Codec("lz4")
    short = codec.encode(np.zeros((1, 16, 16), np.uint8))[0]  # a frame of 256 bytes where 1 KiB belongs
    with pytest.raises(ValueError, match="blosc frame of 256 bytes, expected 1024"):
        codec.decode_bodies([memoryview(short)], np.empty((1, 32, 32), np.uint8))


def full_ring_and_reader(tmp_path, compression: str) -> tuple[dr.ReplayBuffer, dr.ReplayBuffer]:
    """A one-lane ring of 1,000 frames, full and flushed, and a reader whose cache holds 64 KiB."""
    url = str(tmp_path / "z")
    writer = make(url, compression, capacity=1000, lanes=1)
    fill(writer, 1000, 1)
    writer.flush()
    return writer, dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10)


@pytest.mark.parametrize("compression", ["zstd", "lz4"])
def test_mapped_shards_follow_the_writer_and_stay_within_their_budget(tmp_path, compression):
    """A reader keeps shard files mapped; after the writer rewrites them (a wrapping ring) and
    the reader refreshes, it reads the new frames. Past its budget the oldest maps are closed."""
    writer, reader = full_ring_and_reader(tmp_path, compression)
    maps = reader.storage.row_reads.maps
    maps.budget = 5
    for _ in range(3):
        ids = reader.row_ids()
        np.testing.assert_array_equal(reader.rows(ids)["obs"][:, 0, :4], ids[:, None] >> np.array([0, 8, 16, 24]) & 255)
        assert maps.maps == 5
    spans = maps.spans["obs"]  # closed maps give their slots back: 5 held of the 8 first made
    assert len(spans.address) == 8 and len(spans.free) == 3
    maps.budget = 100
    reader.rows(reader.row_ids())
    assert maps.maps == 1000 // 64 + 1
    fill(writer, 700, 1, start=1000)
    writer.flush()
    reader.refresh()
    for ids in (reader.row_ids(), reader.sample(256, seed=3)["index"]):
        batch = reader.rows(ids)
        np.testing.assert_array_equal(batch["obs"][:, 0, :4], ids[:, None] >> np.array([0, 8, 16, 24]) & 255)
    ids = writer.row_ids()  # and the writer reads what it wrote
    np.testing.assert_array_equal(writer.rows(ids)["obs"][:, 0, :4], ids[:, None] >> np.array([0, 8, 16, 24]) & 255)


def test_past_the_map_budget_the_least_recently_read_shards_are_closed(tmp_path):
    writer, reader = full_ring_and_reader(tmp_path, "lz4")
    maps = reader.storage.row_reads.maps
    maps.budget = 3

    def mapped() -> list[int]:
        return np.flatnonzero(maps.spans["obs"].slot_at[0] >= 0).tolist()
    for chunk in (0, 1, 2, 0, 3):  # chunk 1, read least recently, goes when chunk 3 needs room
        ids = np.array([64 * chunk + 5])
        assert reader.rows(ids)["obs"][0, 0, 0] == ids[0] & 255
    assert mapped() == [0, 2, 3] and maps.maps == 3
    reader.rows(np.array([64 * 4, 64 * 5 + 1, 64 * 4 + 2]))  # two new chunks in one read: the two oldest go
    assert mapped() == [3, 4, 5]
    reader.storage.row_reads.forget(0, np.array([4, 7]))
    assert mapped() == [3, 5] and maps.maps == 2
    reader.close()
    assert maps.maps == 0 and not maps.spans["obs"].holding.any()


def test_a_ring_reader_reading_frames_the_writer_replaced_gets_stale_read_error(tmp_path):
    writer, reader = full_ring_and_reader(tmp_path, "zstd")
    old = reader.row_ids()[:64]
    fill(writer, 300, 1, start=1000)
    writer.flush()
    with pytest.raises(dr.StaleReadError, match="overwritten by the writer"):
        reader.rows(old)
    batch = reader.sample(64, seed=0)
    np.testing.assert_array_equal(batch["obs"][:, 0, :4], batch["index"][:, None] >> np.array([0, 8, 16, 24]) & 255)


def test_a_ring_reader_parses_the_newest_commit_again_only_when_it_changed(tmp_path, monkeypatch):
    """Each read of frames past the cache checks the newest commit; the bytes of an unchanged
    commit are not parsed again, a new commit's are (and its retired rows are refused)."""
    writer, reader = full_ring_and_reader(tmp_path, "lz4")
    parsed = []
    from_bytes = CommitRecord.from_bytes
    monkeypatch.setattr(CommitRecord, "from_bytes",
                        lambda blob, *args: (parsed.append(blob), from_bytes(blob, *args))[1])
    old = reader.row_ids()[:64]
    for k in range(3):
        reader.rows(old + 64 * k)
    assert len(parsed) == 1
    fill(writer, 300, 1, start=1000)
    writer.flush()
    parsed.clear()
    with pytest.raises(dr.StaleReadError, match="overwritten by the writer"):
        reader.rows(old)
    assert [from_bytes(blob, "", 1).sequence for blob in parsed].count(writer.storage.record.sequence) == 1
    writer.close()
    reader.close()


def test_single_frame_inner_chunks_decode_into_the_batch(tmp_path):
    """Frames of 9 KiB: one per inner chunk, decoded straight into the output, repeats copied."""
    fields = {"obs": dr.Field((96, 96), "uint8"), "done": dr.Field((), "bool")}
    url = str(tmp_path / "z")
    obs = np.random.default_rng(0).integers(0, 4, (300, 96, 96), dtype=np.uint8)
    with dr.ReplayBuffer.create(url, fields, capacity=None, chunk_rows=64, compression="zstd") as buf:
        buf.extend({"obs": obs, "done": np.zeros(300, bool)})
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10)
    assert reader.stats().row_fields == {"obs": 1}
    ids = np.array([5, 299, 5, 64, 0, 299, 128])
    np.testing.assert_array_equal(reader.rows(ids)["obs"], obs[ids])


@pytest.mark.parametrize("change, message", [
    (lambda c: c["configuration"].update(chunk_shape=[2, 8, 32, 32]),
     r"inner chunk shape \[2, 8, 32, 32\], expected \[1, 8, 32, 32\]"),
    (lambda c: c["configuration"].update(chunk_shape=[1, 4, 32, 32]), "inner chunks of 4 rows, expected 8"),
    (lambda c: c["configuration"].update(index_location="end"), "is not one diskreplay writes"),
])
def test_a_shard_layout_diskreplay_does_not_write_is_refused(tmp_path, change, message):
    url = str(tmp_path / "z")
    make(url, "zstd", capacity=None).close()
    path = f"{url}/obs/zarr.json"
    meta = json.loads(open(path).read())
    change(meta["codecs"][0])
    open(path, "w").write(json.dumps(meta))
    with pytest.raises(dr.CorruptBufferError, match=message):
        dr.ReplayBuffer.open(url, "r")


@pytest.fixture(params=["batch", "into rows", "python-lz4"])
def lz4_decodes(request, monkeypatch) -> list[int]:
    """The LZ4 fast path's three decoders, each in turn: the `_batch` extension (a thread's
    blocks in one call, without the GIL), python-lz4's LZ4_decompress_safe through ctypes, one call
    per block (where the extension was not built), both straight into the rows; and python-lz4's
    decompress (where python-lz4 does not export LZ4_decompress_safe). Counts the blocks it
    decodes (the rest go through blosc)."""
    calls = []
    if request.param == "batch":
        batch = built_batch()

        def counted_batch(*args):
            taken, *failure = batch.decode_lz4(*args)
            calls.extend([args[5]] * taken)
            return taken, *failure
        monkeypatch.setattr(lz4_blocks, "_batch", SimpleNamespace(decode_lz4=counted_batch,
                                                              first_bad_checksum=batch.first_bad_checksum))
        return calls
    monkeypatch.setattr(lz4_blocks, "_batch", None)
    if request.param == "into rows":
        decode = lz4_blocks._LZ4_DECODE
        assert decode is not None  # python-lz4's Linux wheels export it: the path is tested here

        def counted_into(source, target, size, capacity):
            calls.append(capacity)
            return decode(source, target, size, capacity)
        monkeypatch.setattr(lz4_blocks, "_LZ4_DECODE", counted_into)
        return calls
    decompress = lz4.block.decompress

    def counted(source, uncompressed_size):
        calls.append(uncompressed_size)
        return decompress(source, uncompressed_size=uncompressed_size)
    monkeypatch.setattr(lz4_blocks, "_LZ4_DECODE", None)
    monkeypatch.setattr(lz4.block, "decompress", counted)
    return calls


@pytest.mark.parametrize("kind, direct", [("frames", 6), ("big frames", 6), ("noise", 0), ("floats", 0), ("mixed", 3)])
def test_lz4_inner_chunks_decode_into_the_rows_asked_for(lz4_decodes, kind, direct):
    """Frames of bytes compressed into one LZ4 block are decoded from their blosc frames straight
    into the rows asked for; others (stored uncompressed, typed, shuffled) by blosc: the same values."""
    rng = np.random.default_rng(5)
    pictures = frames(0, 6)[:, 0]
    rows = {"frames": pictures, "big frames": np.tile(pictures, (1, 4, 2)),
            "noise": rng.integers(0, 256, (6, 32, 32), dtype=np.uint8),
            "floats": np.tile(np.linspace(0, 1, 256, dtype=np.float32), (6, 1)).reshape(6, 16, 16),
            "mixed": np.concatenate([pictures[:3], rng.integers(0, 256, (3, 32, 32), dtype=np.uint8)])}[kind]
    codec = Codec("lz4", inner_rows=1)
    bodies: list[memoryview | None] = [memoryview(codec.encode(row[None])[2]) for row in rows]
    out = np.full((8, *rows.shape[1:]), 7, rows.dtype)
    where = np.array([7, 0, 3, 1, 5, 2, 4])
    codec.decode_bodies([*bodies, None], out, where)
    np.testing.assert_array_equal(out[where[:6]], rows)
    assert (out[4] == 0).all() and (out[6] == 7).all()  # stored empty: zeros; not asked for: untouched
    assert len(lz4_decodes) == direct


def test_lz4_rows_outside_the_output_are_refused():
    flat = np.zeros((2, 16), np.uint8)
    block = lz4.block.compress(bytes(16), store_size=False)
    with pytest.raises(IndexError, match=r"rows 0..2 outside the 2 rows decoded into"):
        source = np.frombuffer(block, np.uint8)
        lz4_blocks.decode_lz4_at(np.full(2, source.ctypes.data), np.full(2, len(block)), flat, np.array([0, 2]))


def lz4_bodies(rows: np.ndarray, bad: int | None = None) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each row as a blosc-like body: 8 bytes of head, the row's LZ4 block (row 1: its bytes as
    they are), its CRC32C; block ``bad`` garbage. Returns the bodies and the blocks' addresses and sizes."""
    bodies = []
    for i, row in enumerate(rows):
        block = row.tobytes() if i == 1 else lz4.block.compress(row.tobytes(), store_size=False)
        if i == bad:
            block = b"\xff" * 9
        body = b"h" * lz4_blocks.LZ4_HEAD + block
        bodies.append(np.frombuffer(bytearray(body + checksum(body)), np.uint8))
    sources = np.array([b.ctypes.data + lz4_blocks.LZ4_HEAD for b in bodies], np.int64)
    sizes = np.array([len(b) - lz4_blocks.LZ4_HEAD - 4 for b in bodies], np.int64)
    return bodies, sources, sizes


def test_lz4_batch_decode_takes_blocks_until_none_is_left_or_one_fails():
    """The extension's own contract: a call takes blocks from the shared cursor, as many at a
    time as it is told, and decodes them (a block as long as a row copied, a body checked first
    where asked), until the cursor passes the end or a block fails, which it names (with the
    decoder's result, or as a checksum) and which moves the cursor to the end."""
    batch = built_batch()
    rows = np.arange(20 * 64, dtype=np.uint8).reshape(20, 64) // 8
    targets = lambda out: out.ctypes.data + np.arange(20, dtype=np.int64) * 64  # noqa: E731
    bodies, sources, sizes = lz4_bodies(rows)
    checks, cursor, out = np.ones(20, np.uint8), np.array([8]), np.zeros_like(rows)  # another thread took 0..7
    decoder, crc32c, head = lz4_blocks._LZ4_ADDRESS, lz4_blocks._CRC32C_ADDRESS, lz4_blocks.LZ4_HEAD
    assert batch.decode_lz4(decoder, crc32c, sources, sizes, targets(out), 64, checks, head, cursor, 8) == \
        (12, -1, 0, 0)
    np.testing.assert_array_equal(out[8:], rows[8:])
    assert not out[:8].any() and cursor[0] >= 20

    bad_bodies, sources_bad, sizes_bad = lz4_bodies(rows, bad=13)
    cursor, out = np.array([0]), np.zeros_like(rows)
    taken, failed, bad_checksum, code = batch.decode_lz4(decoder, crc32c, sources_bad, sizes_bad, targets(out), 64,
                                                         checks, head, cursor, 8)
    assert (taken, failed, bad_checksum) == (16, 13, 0) and code < 0 and cursor[0] == 20
    np.testing.assert_array_equal(out[:13], rows[:13])
    assert not out[14:].any()  # not reached

    bodies[5][-1] ^= 1  # block 5's stored checksum
    cursor, out = np.array([0]), np.zeros_like(rows)
    assert batch.decode_lz4(decoder, crc32c, sources, sizes, targets(out), 64, checks, head, cursor, 3)[1:] == (5, 1, 0)
    checks[5], cursor = 0, np.array([0])  # not asked for: decoded
    assert batch.decode_lz4(decoder, 0, sources, sizes, targets(out), 64, np.zeros(20, np.uint8), head, cursor,
                            1) == (20, -1, 0, 0)
    np.testing.assert_array_equal(out, rows)

    args = [decoder, crc32c, sources, sizes, targets(out), 64, checks, head, np.array([0]), 8]
    needs = r"needs a decoder, a row width in \[1, 2\*\*31 - 1\], a head >= 0 and a take >= 1"
    for at, value, message in [(3, sizes[:3], "sizes must hold one int64 per block"), (0, 0, needs), (9, 0, needs),
                               (6, checks[:4], "one check byte per block and one int64 cursor"),
                               (8, np.array([0, 0]), "one check byte per block and one int64 cursor"),
                               (1, 0, "needs a crc32c function to check blocks")]:
        with pytest.raises(ValueError, match=message):
            batch.decode_lz4(*args[:at], value, *args[at + 1:])


@pytest.mark.parametrize("path", ["batch", "one by one"])
def test_lz4_frames_are_shared_by_the_threads_that_decode_them(path, monkeypatch):
    """Threads decoding one `LZ4Frames` at once take every block once between them (each call
    says how many it took), with and without the extension; a block that fails ends the decode
    (the blocks after the failing one's take are left) and is kept as the failure."""
    if path == "batch":
        built_batch()
    else:
        monkeypatch.setattr(lz4_blocks, "_batch", None)
    rng = np.random.default_rng(3)
    rows = (rng.integers(0, 4, (3000, 256)) * 60).astype(np.uint8)
    bodies, sources, sizes = lz4_bodies(rows)
    out = np.zeros_like(rows)
    frames = lz4_blocks.LZ4Frames(sources, sizes, out, np.arange(3000)[::-1], np.ones(3000, bool))
    start = threading.Barrier(4)
    taken: list[int] = []
    threads = [threading.Thread(target=lambda: (start.wait(), taken.append(frames.decode()))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(taken) == 3000 and frames.failure is None
    np.testing.assert_array_equal(out[::-1], rows)

    bodies, sources, sizes = lz4_bodies(rows[:40], bad=21)
    frames = lz4_blocks.LZ4Frames(sources, sizes, out, np.arange(40))
    assert frames.decode() == 24 and frames.failure == lz4_blocks.LZ4Failure(21, False, frames.failure.why)
    assert frames.failure.why.startswith("LZ4 block: malformed, or decodes to other than 256 bytes (code -")
    assert frames.decode() == 0  # the rest are left


def test_lz4_batch_decode_lets_other_threads_run():
    """The GIL is released for the whole call: with the interpreter never switching threads on
    its own, another thread still runs while one decodes (and only then). The decoder keeps
    decoding, a call at a time, until the other thread has run (at most 500 calls), so a loaded
    machine that is slow to schedule it cannot fail the test."""
    batch = built_batch()
    row = (np.arange(4096) % 251).astype(np.uint8)
    block = np.frombuffer(lz4.block.compress(row.tobytes(), store_size=False), np.uint8)
    count = 2_000
    out = np.empty((count, 4096), np.uint8)
    sources, sizes = np.full(count, block.ctypes.data, np.int64), np.full(count, len(block), np.int64)
    targets = out.ctypes.data + np.arange(count, dtype=np.int64) * 4096
    decoding, observed, seen = threading.Event(), threading.Event(), []

    def decode() -> None:
        decoding.set()
        for _ in range(500):
            batch.decode_lz4(lz4_blocks._LZ4_ADDRESS, 0, sources, sizes, targets, 4096, np.zeros(count, np.uint8), 0,
                             np.zeros(1, np.int64), 8)
            if observed.is_set():
                break
        decoding.clear()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        worker = threading.Thread(target=decode)
        worker.start()
        decoding.wait(timeout=60)  # a decoder that held the GIL would set and clear it before this runs
        seen.append(decoding.is_set())  # this thread ran: the decoder gave the GIL up, or had returned
        observed.set()
        worker.join()
    finally:
        sys.setswitchinterval(interval)
    assert seen == [True] and (out[-1] == row).all()


@pytest.mark.parametrize("chunk", [3, 25])
@pytest.mark.parametrize("compression, message", [("lz4", "LZ4 block"), ("zstd", "zstd frame does not decode")])
def test_a_frame_that_does_not_decode_is_named(tmp_path, compression, message, chunk, lz4_decodes):
    """A frame whose checksum matches but whose compressed bytes are garbage: the chunk is named,
    whether the frame is decoded alone or among others, early in a batch (chunk 3) or late
    (chunk 25), whichever thread takes it."""
    url = str(tmp_path / "z")
    with make(url, compression, lanes=1) as buf:
        fill(buf, 2000, 1)
    path = f"{url}/obs/c.0.{chunk}.0.0"
    blob = bytearray(open(path, "rb").read())
    entries = np.frombuffer(bytes(blob[:16 * (64 // INNER)]), "<u8").reshape(-1, 2)
    offset, nbytes = (int(v) for v in entries[0])
    body = blob[offset:offset + nbytes - 4]
    if compression == "lz4":
        assert body[2] >> 5 == 1 and int.from_bytes(body[8:12], "little") == 8 * 1024  # one LZ4 block
    body[24:] = b"\xff" * (len(body) - 24)
    blob[offset:offset + nbytes] = bytes(body) + checksum(bytes(body))
    open(path, "wb").write(bytes(blob))
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10, io_threads=2)
    for ids in ([chunk * 64], [chunk * 64 + 1, chunk * 64, 5 * 64], np.arange(0, 2000, 7)):
        with pytest.raises(dr.CorruptBufferError, match=rf"chunk 'obs/c.0.{chunk}.0.0' does not decode \({message}"):
            reader.rows(np.array(ids))
    reader.close()


def counted_frames(monkeypatch) -> list[tuple[str, int, int]]:
    """(thread name, blocks, blocks taken) per `LZ4Frames.decode` call of the shard maps' reads."""
    calls: list[tuple[str, int, int]] = []

    class Counted(lz4_blocks.LZ4Frames):
        def decode(self) -> int:
            taken = super().decode()
            calls.append((threading.current_thread().name, len(self), taken))
            return taken
    monkeypatch.setattr(shard_maps, "LZ4Frames", Counted)
    return calls


@pytest.mark.parametrize("compression", ["lz4", "zstd", "lz4hc"])
def test_a_batch_of_frames_is_decoded_side_by_side(tmp_path, compression, monkeypatch):
    """With two I/O threads, a batch of 250 inner chunks is decoded on this thread and the decode
    thread at once: LZ4 blocks taken a few at a time by either, zstd frames in two parts of 125;
    each inner chunk is decoded once and the rows are the stored ones."""
    url = str(tmp_path / "z")
    with make(url, compression, lanes=1) as buf:
        fill(buf, 2000, 1)
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10, io_threads=2)
    ids = np.arange(0, 2000, 7)
    reader.rows(ids)
    reader.warm()  # the next obs kept apart at episode ends now come from their cache
    parts: list[tuple[str, int]] = []
    decode_bodies = Codec.decode_bodies
    monkeypatch.setattr(Codec, "decode_bodies", lambda self, bodies, out, rows=None: (
        parts.append((threading.current_thread().name, len(bodies))), decode_bodies(self, bodies, out, rows)))
    blocks = counted_frames(monkeypatch)
    np.testing.assert_array_equal(reader.rows(ids)["obs"][:, 0, :4], ids[:, None] >> np.array([0, 8, 16, 24]) & 255)
    if compression == "zstd":
        assert sorted((name.startswith("diskreplay-decode"), count) for name, count in parts) == [(False, 125),
                                                                                              (True, 125)]
    else:
        assert not parts and sorted((name.startswith("diskreplay-decode"), count) for name, count, _ in blocks) == [
            (False, 250), (True, 250)]
        assert sum(taken for *_, taken in blocks) == 250
    reader.close()


@pytest.mark.parametrize("compression", ["lz4", "zstd"])
def test_a_frames_checksum_is_checked_at_its_first_read_only(tmp_path, compression, monkeypatch):
    """An inner chunk's checksum is checked when it is first read (LZ4 blocks: in the decoding
    call), not again; the inner chunks of other rows are checked at theirs."""
    url = str(tmp_path / "z")
    with make(url, compression, lanes=1) as buf:
        fill(buf, 2000, 1)
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10, io_threads=2)
    checked: list[int] = []

    class Counted(lz4_blocks.LZ4Frames):
        def __init__(self, *args: Any):
            super().__init__(*args)
            checked.append(int(self.check.sum()))
    monkeypatch.setattr(shard_maps, "LZ4Frames", Counted)
    first_bad = shard_maps.first_bad_checksum
    monkeypatch.setattr(shard_maps, "first_bad_checksum", lambda sources, sizes: (
        checked.append(len(sources)), first_bad(sources, sizes))[1])
    counts = []
    for ids in (np.arange(0, 1000, 3), np.arange(0, 1000, 3), np.arange(1000, 2000, 3), np.arange(1000, 2000, 3)):
        reader.rows(ids)
        counts.append(sum(checked))
    assert counts[0] > 100 and counts[1] == counts[0] and counts[2] > counts[0] + 100 and counts[3] == counts[2]
    reader.close()


@pytest.mark.parametrize("compression", ["lz4", "zstd", "lz4hc"])
def test_mangled_frames_decode_or_raise_value_error(compression, lz4_decodes):
    """Bytes changed at random in a frame (as in a file whose checksums were recomputed) decode
    to some values or raise ValueError, never another exception, alone or among good frames."""
    rng = np.random.default_rng(11)
    codec = Codec(compression, inner_rows=1)
    frame = frames(0, 1)[:, 0]
    good = bytes(codec.encode(frame)[2])
    out = np.empty((2, 32, 32), np.uint8)
    raised = 0
    for _ in range(400):
        body = bytearray(good)
        for at in rng.integers(0, len(body), rng.integers(1, 4)):
            body[at] = int(rng.integers(0, 256))
        if rng.random() < 0.2:
            body = body[:int(rng.integers(0, len(body)))]
        for bodies in ([bytes(body)], [good, bytes(body)]):
            try:
                codec.decode_bodies(bodies, out[:len(bodies)])
            except ValueError:
                raised += 1
    assert 200 < raised < 800  # most mangled frames are refused, some still decode
    assert compression == "zstd" or len(lz4_decodes) > 400  # the LZ4 fast path saw them (lz4hc's too)
    codec.decode_bodies([good], out[:1])
    np.testing.assert_array_equal(out[0], frame[0])


@pytest.mark.parametrize("compression", ["zstd", "lz4", "lz4hc"])
def test_frames_of_one_inner_chunk_each_decode_straight_into_the_batch(tmp_path, compression, monkeypatch):
    """84x84 frames are inner chunks of one row, decoded straight into the rows of the batch in
    one call: a frame asked for again right after itself (a padded slice's end) is copied,
    elsewhere in the batch decoded again (finding such repeats costs more than the few a large
    buffer's batch draws); the rows equal a raw buffer's."""
    fields = {"obs": dr.Field((84, 84), "uint8"), "done": dr.Field((), "bool")}
    steps = np.arange(300)
    obs = np.repeat(steps.astype(np.uint8)[:, None, None], 84, 1).repeat(84, 2)
    obs[:, 5:40:3, 7:70:5] = np.random.default_rng(0).integers(0, 256, (300, 12, 13), dtype=np.uint8)
    data = {"obs": obs, "done": steps % 50 == 49}
    for url, codec in ((str(tmp_path / "raw"), None), (str(tmp_path / "z"), compression)):
        with dr.ReplayBuffer.create(url, fields, capacity=300, chunk_rows=64, compression=codec) as buf:
            buf.extend(data)
    raw, reader = (dr.ReplayBuffer.open(str(tmp_path / name), "r", cache_bytes=64 << 10) for name in ("raw", "z"))
    assert reader.storage.row_reads.io.codecs["obs"].inner_rows == 1
    decoded: list[tuple[str, int]] = []
    decode_bodies = Codec.decode_bodies
    monkeypatch.setattr(Codec, "decode_bodies", lambda self, bodies, out, rows=None: (
        decoded.append(("bodies", len(bodies))), decode_bodies(self, bodies, out, rows)))
    blocks = counted_frames(monkeypatch)
    ids = np.array([17, 17, 250, 17, 3, 3, 3, 250, 299, 0])
    np.testing.assert_array_equal(reader.rows(ids)["obs"], obs[ids])
    decoded += [("from the map", taken) for _, _, taken in blocks]
    assert decoded == [("bodies" if compression == "zstd" else "from the map", 7)]  # 17 250 17 3 250 299 0
    np.testing.assert_array_equal(reader.rows(ids)["obs"], raw.rows(ids)["obs"])
    raw.close()
    reader.close()


@pytest.mark.parametrize("compression", ["lz4", "zstd", "lz4hc"])
def test_frames_stored_empty_read_back_as_zeros_past_the_cache(tmp_path, compression):
    """Inner chunks a shard's index marks empty (as zarr writes chunks of its fill value) read back
    as zeros past the cache, alone or among decoded frames; the others as written."""
    fields = {"obs": dr.Field((84, 84), "uint8"), "done": dr.Field((), "bool")}
    obs = np.repeat((np.arange(128) % 255 + 1).astype(np.uint8)[:, None, None], 84, 1).repeat(84, 2)
    url = str(tmp_path / "z")
    with dr.ReplayBuffer.create(url, fields, capacity=128, chunk_rows=64, compression=compression) as buf:
        buf.extend({"obs": obs, "done": np.zeros(128, bool)})
    path = f"{url}/obs/c.0.1.0.0"  # rows 64..127, one inner chunk each
    blob = bytearray(open(path, "rb").read())
    index = np.frombuffer(bytes(blob[:16 * 64]), "<u8").copy().reshape(-1, 2)
    index[::5] = codecs.EMPTY_INNER
    blob[:16 * 64 + 4] = index.tobytes() + checksum(index.tobytes())
    open(path, "wb").write(bytes(blob))
    drop_tables(url)
    obs[64::5] = 0
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10)
    for ids in (np.arange(128), np.arange(65, 128, 5), np.arange(64, 128, 5)):
        np.testing.assert_array_equal(reader.rows(ids)["obs"], obs[ids])
    reader.close()


def test_the_same_step_of_two_lanes_is_two_frames(tmp_path, monkeypatch):
    """Reading frames one by one, a row counts as a repeat of the row before it only when both
    its lane and its step are the same: the lanes' frames at one step are each decoded."""
    fields = {"obs": dr.Field((84, 84), "uint8"), "done": dr.Field((), "bool")}
    obs = np.zeros((200, 2, 84, 84), np.uint8)
    obs[:, :, 0, 0] = np.arange(200)[:, None] % 256
    obs[:, 1, 0, 1] = 1  # lane 1's frames differ from lane 0's at every step
    with dr.ReplayBuffer.create(str(tmp_path / "z"), fields, capacity=400, num_envs=2, chunk_rows=64,
                                compression="lz4") as buf:
        buf.extend({"obs": obs, "done": np.zeros((200, 2), bool)})
    reader = dr.ReplayBuffer.open(str(tmp_path / "z"), "r", cache_bytes=64 << 10)
    blocks = counted_frames(monkeypatch)
    ids = np.array([2 * 10, 2 * 10 + 1, 2 * 10 + 1, 2 * 150, 2 * 150 + 1])  # row id = step * num_envs + lane
    got = reader.rows(ids)["obs"]
    np.testing.assert_array_equal(got, obs[ids // 2, ids % 2])
    assert sum(taken for *_, taken in blocks) == 4  # the lane-1 frame of step 10 asked twice in a row: decoded once
    reader.close()


def test_a_forked_child_decodes_in_parts_on_threads_of_its_own(tmp_path):
    """A reader that decoded frames side by side, then forked: the child's reads (which would
    wait forever on the parent's decode threads, absent from the child) decode the same rows."""
    url = str(tmp_path / "z")
    with make(url, "lz4", lanes=1) as buf:
        fill(buf, 2000, 1)
    reader = dr.ReplayBuffer.open(url, "r", cache_bytes=64 << 10, io_threads=2)
    ids = np.arange(0, 2000, 7)
    stamps = ids[:, None] >> np.array([0, 8, 16, 24]) & 255
    np.testing.assert_array_equal(reader.rows(ids)["obs"][:, 0, :4], stamps)
    reader.storage.row_reads.maps.forget(0, np.arange(32))  # the child maps (and decodes) every frame again
    assert exit_code_in_fork(lambda: np.array_equal(reader.rows(ids)["obs"][:, 0, :4], stamps)) == 0
    reader.close()
