"""The frame codec layer (diskreplay.format.frame_codecs): PNG and JPEG per frame, AV1 and H.264 per
chunk (one group of pictures), each checked against what Pillow or PyAV read from the bytes alone."""

import io
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from diskreplay.format import frame_codecs
from diskreplay.format.frame_codecs import FrameCodec, split_packets, video_chunk_decodes

av = pytest.importorskip("av")
PIL_Image = pytest.importorskip("PIL.Image")

VIDEO = ["av1", "h264"]
DECODER = {"av1": "libdav1d", "h264": "h264"}


def scene(n: int, height: int, width: int, channels: int | None = 3, seed: int = 0) -> np.ndarray:
    """Camera-like frames: smooth shading that pans, a soft bright blob moving across it, faint noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    frames = []
    for t in range(n):
        cx, cy = 0.5 + 0.3 * np.cos(t / 6), 0.5 + 0.3 * np.sin(t / 6)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / 0.02)[..., None]
        shade = 0.5 + 0.3 * np.sin(6 * x + t / 5)[..., None] * np.cos(4 * y)[..., None] * [1.0, 0.8, 0.6]
        frame = 255 * ((1 - blob) * shade + blob * [0.9, 0.7, 0.3]) + rng.normal(0, 1, (height, width, 3))
        frames.append(np.clip(frame, 0, 255).astype(np.uint8))
    out = np.stack(frames)
    return out if channels == 3 else out[..., :1] if channels == 1 else out[..., 0]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b) ** 2)
    return float("inf") if mse == 0 else float(10 * np.log10(255 ** 2 / mse))


def plain_video_decode(codec: str, values: np.ndarray, ends: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """What a reader with only PyAV and docs/format.md gets: the packets cut at the ends, decoded,
    RGB by PyAV's default conversion (one channel: the luma plane), cropped to the field's size."""
    context = av.CodecContext.create(DECODER[codec], "r")
    data, starts = values.tobytes(), [0, *ends[:-1].tolist()]
    pictures = []
    for packet in [av.Packet(data[s:e]) for s, e in zip(starts, ends.tolist())] + [None]:
        pictures += context.decode(packet)
    height, width = shape[:2]
    if len(shape) == 3 and shape[2] == 3:
        return np.stack([p.to_ndarray(format="rgb24")[:height, :width] for p in pictures])
    return np.stack([p.to_ndarray()[:height, :width] for p in pictures]).reshape(len(pictures), *shape)


@pytest.mark.parametrize("shape", [(6, 8), (5, 7, 1), (9, 4, 3), (3, 5, 4), (1, 1)])
def test_png_round_trips_exactly_and_is_a_plain_png_file(shape):
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (4, *shape), dtype=np.uint8)
    codec = FrameCodec("png", shape)
    values, ends = codec.encode_rows(frames)
    assert values.dtype == np.uint8 and ends.dtype == np.int64 and len(ends) == 4 and ends[-1] == len(values)
    np.testing.assert_array_equal(codec.decode_rows(values, ends), frames)
    first = np.asarray(PIL_Image.open(io.BytesIO(values[:ends[0]].tobytes())))
    np.testing.assert_array_equal(first.reshape(shape), frames[0])


@pytest.mark.parametrize("channels", [None, 1, 3])
def test_jpeg_keeps_its_quality_psnr_and_a_lower_quality_takes_fewer_bytes(channels):
    frames = scene(4, 48, 64, channels)
    codec = FrameCodec("jpeg", frames.shape[1:])
    assert codec.level == 95
    values, ends = codec.encode_rows(frames)
    decoded = codec.decode_rows(values, ends)
    assert decoded.shape == frames.shape and psnr(decoded, frames) > 44  # 46-49 dB here
    plain = np.asarray(PIL_Image.open(io.BytesIO(values[:ends[0]].tobytes())))
    np.testing.assert_array_equal(plain.reshape(frames.shape[1:]), decoded[0])
    low, _ = FrameCodec("jpeg", frames.shape[1:], quality=50).encode_rows(frames)
    assert len(low) < len(values)


@pytest.mark.parametrize("codec", VIDEO)
@pytest.mark.parametrize("channels", [None, 1, 3])
def test_video_chunk_decodes_to_what_pyav_reads_from_its_packets_within_the_psnr_bound(codec, channels):
    frames = scene(12, 48, 64, channels)
    video = FrameCodec(codec, frames.shape[1:])
    values, ends = video.encode_rows(frames)
    assert len(ends) == 12 and np.all(np.diff(ends) > 0) and ends[-1] == len(values)
    decoded = video.decode_rows(values, ends)
    np.testing.assert_array_equal(decoded, plain_video_decode(codec, values, ends, frames.shape[1:]))
    # 4:2:0 chroma costs RGB frames most (39.8 dB for this scene even at h264's lossless CRF 0)
    assert psnr(decoded, frames) > (38 if channels == 3 else 42)
    # the first frame is a keyframe: its packet alone decodes, to the same picture
    np.testing.assert_array_equal(video.decode_rows(values[:ends[0]], ends[:1]), decoded[:1])
    assert len(values) < frames.nbytes / 10


@pytest.mark.parametrize("codec", VIDEO)
@pytest.mark.parametrize("shape", [(5, 7, 3), (1, 1), (3, 2, 1), (2, 9, 3)])
def test_video_of_odd_or_tiny_frames_is_padded_then_cropped(codec, shape):
    frames = np.broadcast_to(np.linspace(60, 200, shape[1], dtype=np.uint8)[:, None] if len(shape) == 3
                             else np.linspace(60, 200, shape[1], dtype=np.uint8), (6, *shape)).copy()
    video = FrameCodec(codec, shape)
    assert all(side % 2 == 0 and side >= 4 for side in frame_codecs.coded_size(shape))
    values, ends = video.encode_rows(frames)
    decoded = video.decode_rows(values, ends)
    assert decoded.shape == frames.shape
    np.testing.assert_array_equal(decoded, plain_video_decode(codec, values, ends, shape))
    assert np.abs(decoded.astype(int) - frames).max() <= 12


def test_lossless_h264_keeps_a_gray_frame_exactly():
    frames = scene(5, 20, 30, None)
    video = FrameCodec("h264", (20, 30), quality=0)
    np.testing.assert_array_equal(video.decode_rows(*video.encode_rows(frames)), frames)


@pytest.mark.parametrize("codec", VIDEO)
def test_each_decode_of_a_video_chunk_is_counted_once_and_images_count_none(codec):
    frames = scene(6, 16, 16)
    video = FrameCodec(codec, (16, 16, 3))
    values, ends = video.encode_rows(frames)
    before = video_chunk_decodes()
    video.decode_rows(values, ends)
    assert video_chunk_decodes() == before + 1
    png = FrameCodec("png", (16, 16, 3))
    png.decode_rows(*png.encode_rows(frames))
    assert video_chunk_decodes() == before + 1


@pytest.mark.parametrize("name", ["png", "jpeg", *VIDEO])
def test_threads_decode_many_chunks_to_the_frames_one_thread_gives(name):
    codec = FrameCodec(name, (40, 56, 3))
    chunks = [codec.encode_rows(scene(8, 40, 56, seed=s)) for s in range(12)]
    alone = [codec.decode_rows(values, ends) for values, ends in chunks]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda chunk: codec.decode_rows(*chunk), chunks))
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("args, match", [
    (("gif", (4, 4, 3)), r"codec must be one of \['png', 'jpeg', 'av1', 'h264'\], got 'gif'"),
    (("jpeg", (4, 4, 4)), r"codec 'jpeg' takes uint8 frames of shape \(H, W\) or \(H, W, C\) with C in \(1, 3\)"),
    (("h264", (4,)), r"codec 'h264' takes uint8 frames .* got shape \(4,\)"),
    (("av1", (0, 4, 3)), r"H, W > 0, got shape \(0, 4, 3\)"),
    (("png", (4, 4), 5), r"codec 'png' takes no quality \(lossless\), got 5"),
    (("jpeg", (4, 4), 101), r"quality for jpeg must be an int in \[1, 100\], got 101"),
    (("av1", (4, 4), 64), r"quality for av1 must be an int in \[0, 63\], got 64"),
])
def test_a_codec_it_cannot_apply_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        FrameCodec(*args)


def test_ends_that_do_not_split_the_bytes_are_refused():
    with pytest.raises(ValueError, match=r"frame ends \[3, 3\] do not split 5 bytes into non-empty frames"):
        split_packets(b"12345", np.array([3, 3]))
    with pytest.raises(ValueError, match=r"frame ends \[2, 4\] do not split 5 bytes"):
        split_packets(b"12345", np.array([2, 4]))


@pytest.mark.parametrize("name", ["png", "jpeg"])
def test_image_bytes_of_another_size_or_garbage_do_not_decode(name):
    other = FrameCodec(name, (8, 8, 3)).encode_frame(np.zeros((8, 8, 3), np.uint8))
    codec = FrameCodec(name, (8, 6, 3))
    with pytest.raises(ValueError, match=rf"{name} image of 8x8 RGB, expected 8x6 RGB"):
        codec.decode_frame(other)
    with pytest.raises(ValueError, match=rf"{name} image does not decode"):
        codec.decode_frame(b"not an image")
    gray = FrameCodec(name, (8, 8))
    with pytest.raises(ValueError, match=rf"{name} image of 8x8 RGB, expected 8x8 L"):
        gray.decode_frame(other)


@pytest.mark.parametrize("codec", VIDEO)
def test_video_bytes_of_another_size_or_garbage_do_not_decode(codec):
    values, ends = FrameCodec(codec, (8, 8, 3)).encode_rows(scene(3, 8, 8))
    with pytest.raises(ValueError, match=rf"{codec} chunk holds a picture 0 of 8x8, expected 3 of 8x12"):
        FrameCodec(codec, (8, 12, 3)).decode_rows(values, ends)
    with pytest.raises(ValueError, match=rf"{codec} chunk (of 3 packets decodes to 0 frames|does not decode)"):
        FrameCodec(codec, (8, 8, 3)).decode_rows(np.full(30, 7, np.uint8), np.array([10, 20, 30]))


def test_frames_of_the_wrong_shape_are_refused_at_encode():
    with pytest.raises(ValueError, match=r"expected frames of shape \(N, \*\(4, 4, 3\)\), got \(2, 4, 4\)"):
        FrameCodec("png", (4, 4, 3)).encode_rows(np.zeros((2, 4, 4), np.uint8))


@pytest.mark.parametrize("module, extra, name", [("av", "video", "h264"), ("PIL", "images", "png")])
def test_a_missing_library_names_the_extra_that_installs_it(monkeypatch, module, extra, name):
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setitem(sys.modules, f"{module}.Image", None)
    with pytest.raises(ImportError, match=rf'pip install "diskreplay\[{extra}\]"'):
        FrameCodec(name, (4, 4, 3)).encode_rows(np.zeros((1, 4, 4, 3), np.uint8))


@pytest.mark.parametrize("codec", VIDEO)
def test_a_stream_gives_each_frames_packet_at_once_and_a_second_group_of_pictures_still_decodes(codec):
    frames = scene(10, 24, 32)
    video = FrameCodec(codec, (24, 32, 3))
    stream = frame_codecs.VideoEncoder(video)
    packets = [stream.encode(frame, keyframe=i in (0, 6)) for i, frame in enumerate(frames)]
    values = np.frombuffer(b"".join(packets), np.uint8)
    ends = np.cumsum([len(p) for p in packets])
    decoded = video.decode_rows(values, ends)
    np.testing.assert_array_equal(decoded, plain_video_decode(codec, values, ends, (24, 32, 3)))
    assert psnr(decoded, frames) > 36  # small frames: chroma is coarser still
    # the second group starts with a keyframe: its packets alone decode to the same frames
    np.testing.assert_array_equal(video.decode_rows(values[ends[5]:], ends[6:] - ends[5]), decoded[6:])
