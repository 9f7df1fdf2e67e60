"""Encoded frame fields in a buffer: ``dr.Field((H, W, C), "uint8", codec=...)`` stored as ragged
uint8 rows (a PNG or JPEG file per frame; per row chunk of a lane, one video whose packets are the
rows), decoded on read, video chunks decoded once and then served from the cache."""

import io
import json

import numpy as np
import pytest
import zarr
from test_frame_codecs import DECODER, psnr, scene

import diskreplay as dr
from diskreplay.errors import CorruptBufferError, SchemaError
from diskreplay.format.frame_codecs import video_chunk_decodes

av = pytest.importorskip("av")
PIL_Image = pytest.importorskip("PIL.Image")

SHAPE = (24, 32, 3)
CHUNK = 8


def fields(codec, **kw):
    return {"obs": dr.Field(SHAPE, "uint8", codec=codec, **kw), "action": dr.Field((), "int64"),
            "done": dr.Field((), "bool")}


def filled(url, codec, frames, num_envs=1, **kw):
    """A buffer of ``frames`` ([T, lanes, *SHAPE]) added step by step (the first half) and in one extend."""
    steps = len(frames)
    with dr.ReplayBuffer.create(url, fields(codec, **kw), capacity=1000 * num_envs, chunk_rows=CHUNK,
                                num_envs=num_envs, episode_end="done") as buf:
        half = steps // 2
        for t in range(half):
            step = {"obs": frames[t], "action": np.full(num_envs, t), "done": np.full(num_envs, t % 7 == 6)}
            buf.add(**({k: v[0] for k, v in step.items()} if num_envs == 1 else step))
        rest = {"obs": frames[half:], "action": np.repeat(np.arange(half, steps)[:, None], num_envs, 1),
                "done": np.repeat((np.arange(half, steps) % 7 == 6)[:, None], num_envs, 1)}
        buf.extend(rest if num_envs > 1 else {k: v[:, 0] for k, v in rest.items()})
    return url


def lane_frames(steps, lanes):
    return np.stack([scene(steps, *SHAPE[:2], seed=lane) for lane in range(lanes)], axis=1)


def plain_frames(url, codec, lane, steps):
    """A lane's frames as a reader with zarr, PyAV and docs/format.md alone decodes them: per row
    chunk, the packets at obs[lane, chunk, :end] cut at obs.ends, decoded in order."""
    group = zarr.open_group(url, mode="r")
    ends = group["obs.ends"][lane, :steps]
    out = []
    for chunk in range(-(-steps // CHUNK)):
        rows = ends[chunk * CHUNK:min((chunk + 1) * CHUNK, steps)]
        data = group["obs"][lane, chunk, :rows[-1]].tobytes()
        context = av.CodecContext.create(DECODER[codec], "r")
        packets = [av.Packet(data[a:b]) for a, b in zip([0, *rows[:-1].tolist()], rows.tolist())]
        for packet in packets + [None]:
            out += [p.to_ndarray(format="rgb24")[:SHAPE[0], :SHAPE[1]] for p in context.decode(packet)]
    return np.stack(out)


def test_png_frames_round_trip_exactly_through_a_reopen(tmp_path):
    frames = lane_frames(20, 2)
    url = filled(str(tmp_path / "b"), "png", frames, num_envs=2)
    with dr.ReplayBuffer.open(url) as buf:
        assert buf.fields["obs"] == dr.Field(SHAPE, "uint8", codec="png")
        rows = buf[np.arange(40)]
        np.testing.assert_array_equal(rows["obs"], frames.reshape(40, *SHAPE))
        np.testing.assert_array_equal(rows["action"], np.repeat(np.arange(20), 2))
        batch = buf.sample(16, rng=np.random.default_rng(0))
        np.testing.assert_array_equal(batch["obs"], frames.reshape(40, *SHAPE)[batch["index"]])
    # a plain PNG file per row, at obs[lane, chunk, start:end]
    group = zarr.open_group(url, mode="r")
    end = int(group["obs.ends"][1, 0])
    np.testing.assert_array_equal(np.asarray(PIL_Image.open(io.BytesIO(group["obs"][1, 0, :end].tobytes()))),
                                  frames[0, 1])


def test_jpeg_frames_come_back_within_the_qualitys_psnr(tmp_path):
    frames = lane_frames(20, 1)
    url = filled(str(tmp_path / "b"), "jpeg", frames, quality=90)
    with dr.ReplayBuffer.open(url) as buf:
        assert buf.fields["obs"].quality == 90
        got = buf[np.arange(20)]["obs"]
    assert psnr(got, frames[:, 0]) > 40


@pytest.mark.parametrize("codec", ["h264", "av1"])
def test_video_frames_are_what_pyav_decodes_from_the_stored_packets(tmp_path, codec):
    frames = lane_frames(27, 2)
    url = filled(str(tmp_path / "b"), codec, frames, num_envs=2)
    with dr.ReplayBuffer.open(url) as buf:
        got = buf[np.arange(54)]["obs"].reshape(27, 2, *SHAPE)
    for lane in range(2):
        np.testing.assert_array_equal(got[:, lane], plain_frames(url, codec, lane, 27))
    assert psnr(got, frames) > 36


@pytest.mark.parametrize("codec", ["h264", "av1"])
def test_a_random_frame_decodes_one_chunk_and_a_cached_chunk_none(tmp_path, codec):
    frames = lane_frames(40, 1)
    url = filled(str(tmp_path / "b"), codec, frames)
    with dr.ReplayBuffer.open(url) as buf:
        before = video_chunk_decodes()
        first = buf[[19]]["obs"]  # row 3 of chunk 2
        assert video_chunk_decodes() == before + 1
        # the next batches: rows of the cached chunk cost no decode, one row of a new chunk one
        again = buf[[16, 23, 19, 17]]["obs"]
        assert video_chunk_decodes() == before + 1
        np.testing.assert_array_equal(again[2], first[0])
        buf[[18, 33, 35]]
        assert video_chunk_decodes() == before + 2
        batch = buf.sample(8, rng=np.random.default_rng(3))
        chunks = {i // CHUNK for i in batch["index"].tolist()} - {2, 4}
        assert video_chunk_decodes() == before + 2 + len(chunks)
        buf.sample(8, rng=np.random.default_rng(3))
        assert video_chunk_decodes() == before + 2 + len(chunks)


@pytest.mark.parametrize("codec", ["h264", "av1"])
def test_a_writer_reopened_mid_chunk_starts_a_new_group_of_pictures_there(tmp_path, codec):
    frames = lane_frames(20, 1)
    url = filled(str(tmp_path / "b"), codec, frames[:11])
    with dr.ReplayBuffer.open(url, "r+") as buf:
        buf.extend({"obs": frames[11:, 0], "action": np.arange(11, 20), "done": np.zeros(9, bool)})
        written = buf[np.arange(20)]["obs"]
    with dr.ReplayBuffer.open(url) as buf:
        np.testing.assert_array_equal(buf[np.arange(20)]["obs"], written)
    np.testing.assert_array_equal(written, plain_frames(url, codec, 0, 20))
    assert psnr(written, frames[:, 0]) > 36


def test_stacks_of_video_frames(tmp_path):
    frames = lane_frames(30, 1)
    url = filled(str(tmp_path / "b"), "h264", frames)
    with dr.ReplayBuffer.open(url) as buf:
        plain = buf[np.arange(30)]["obs"]
        batch = buf.sample(6, stack=4, rng=np.random.default_rng(1))
    assert batch["obs"].shape == (6, 4, *SHAPE)
    for row, index in zip(batch["obs"], batch["index"].tolist()):
        episode_start = index // 7 * 7
        window = [max(step, episode_start) for step in range(index - 3, index + 1)]
        np.testing.assert_array_equal(row, plain[window])


def test_a_video_buffer_gets_chunks_of_32_rows_unless_told():
    with dr.ReplayBuffer.create("memory://video-rows", fields("av1"), capacity=10_000) as buf:
        assert buf.storage.layout.chunk_rows == 32


@pytest.mark.parametrize("kwargs, match", [
    (dict(shape=SHAPE, dtype="uint8", codec="gif"),
     r"codec must be one of \['png', 'jpeg', 'av1', 'h264'\], got 'gif'"),
    (dict(shape=SHAPE, dtype="float32", codec="png"), r"a codec takes uint8 frames of a fixed shape"),
    (dict(shape=(None, 3), dtype="uint8", codec="png"), r"a codec takes uint8 frames of a fixed shape"),
    (dict(shape=(8,), dtype="uint8", codec="h264"), r"codec 'h264' takes uint8 frames of shape \(H, W\)"),
    (dict(shape=(8, 8, 4), dtype="uint8", codec="jpeg"), r"with C in \(1, 3\)"),
    (dict(shape=SHAPE, dtype="uint8", codec="png", quality=3), r"codec 'png' takes no quality"),
    (dict(shape=SHAPE, dtype="uint8", codec="h264", quality=52), r"quality for h264 must be an int in \[0, 51\]"),
    (dict(shape=SHAPE, dtype="uint8", quality=50), r"codec must be one of .*got None"),
])
def test_a_codec_on_a_field_it_cannot_code_is_refused(kwargs, match):
    with pytest.raises(SchemaError, match=match):
        dr.Field(**kwargs)


def test_a_stored_field_table_with_an_unknown_codec_names_the_field():
    spec = {"obs": {"shape": [4, 4, 3], "dtype": "|u1", "codec": "webp"}}
    with pytest.raises(SchemaError, match=r"field 'obs': .*codec must be one of \['png', 'jpeg', 'av1', 'h264'\], "
                                          r"got 'webp'"):
        dr.format.Schema.from_json(spec)


def test_an_encoded_field_round_trips_through_json():
    field = dr.Field(SHAPE, "uint8", codec="jpeg", quality=80)
    spec = json.loads(json.dumps(field.to_json()))
    assert spec == {"shape": list(SHAPE), "dtype": "|u1", "codec": "jpeg", "quality": 80}
    assert dr.Field.from_json(spec) == field
    assert repr(field) == "Field(shape=(24, 32, 3), dtype=dtype('uint8'), codec='jpeg', quality=80)"


def test_frames_of_the_wrong_shape_are_refused_before_anything_is_stored(tmp_path):
    with dr.ReplayBuffer.create(str(tmp_path / "b"), fields("png"), capacity=100, chunk_rows=CHUNK) as buf:
        with pytest.raises(SchemaError, match=r"field 'obs': expected shape \(24, 32, 3\), got \(24, 32\)"):
            buf.add(obs=np.zeros(SHAPE[:2], np.uint8), action=1, done=False)
        with pytest.raises(SchemaError, match=r"field 'obs': expected dtype uint8"):
            buf.add(obs=np.zeros(SHAPE, np.float32), action=1, done=False)
        assert len(buf) == 0


def test_damaged_image_bytes_are_a_corrupt_buffer_naming_the_field(tmp_path):
    url = filled(str(tmp_path / "b"), "png", lane_frames(4, 1))
    group = zarr.open_group(url, mode="r+")
    values = group["obs"][0, 0, :]
    values[:64] = 7
    group["obs"][0, 0, :] = values
    with dr.ReplayBuffer.open(url) as buf:
        with pytest.raises(CorruptBufferError, match=r"encoded frame field 'obs': png image does not decode"):
            buf[[0]]
