"""Encoded frames: the rows of a uint8 frame field (``(H, W)`` or ``(H, W, C)``) as bytes and back.

``png`` and ``jpeg`` encode each frame alone (Pillow, extra ``images``). ``av1`` and ``h264``
code the frames of one row chunk of one lane as a video (PyAV, extra ``video``): a raw bitstream
(AV1 low-overhead OBUs, H.264 Annex B), one packet per frame in display order, the chunk's first
frame a keyframe that carries the sequence header. `VideoEncoder` gives each frame's packet as
the frame is added (low delay: no lookahead, no B-frames). A later keyframe may start another
group of pictures inside a chunk (a writer that reopened mid-chunk); the chunk's packets still
decode in one pass. Either way a chunk is its frames' bytes one after the other plus each
frame's end (`FrameCodec.encode_rows`).

Video frames are coded as 8-bit 4:2:0 YUV, padded by repeating the last row and column to even
sides of at least `MIN_SIDE` pixels (cropped off on decode). Three channels are RGB, converted by
FFmpeg's swscale with BT.601 limited-range coefficients (tagged in the stream); one channel is
the luma plane as it is (full range, chroma 128).

Nothing here does I/O. Decoders check every size against the field's before they allocate and
raise ValueError for bytes that do not decode to the field's frames. Pillow and PyAV release the
GIL while they decode, so threads decode frames (or chunks) in parallel.
"""

from __future__ import annotations

import io
import os
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ..build import missing_extra
from ..checks import check_int

IMAGE_CODECS = ("png", "jpeg")
VIDEO_CODECS = ("av1", "h264")
FRAME_CODECS = IMAGE_CODECS + VIDEO_CODECS
QUALITY = {"jpeg": (1, 100, 95), "av1": (0, 63, 20), "h264": (0, 51, 18)}
"""``(least, most, default)`` of each codec's ``quality``: JPEG's quality (higher is better) or
the video encoder's constant rate factor, CRF (lower is better; ``h264`` at 0 is lossless in YUV)."""
CHANNELS = {"png": (1, 3, 4), "jpeg": (1, 3), "av1": (1, 3), "h264": (1, 3)}
"""The channel counts each codec takes (a 2-D ``(H, W)`` frame has one)."""
MIN_SIDE = 4
"""The narrowest side a video frame is coded with (SVT-AV1 refuses fewer pixels)."""
ENCODERS = {"av1": ("libsvtav1", {"preset": "8", "svtav1-params": "pred-struct=1:lookahead=0"}),
            "h264": ("libx264", {"preset": "fast", "tune": "zerolatency"})}
"""Each video codec's FFmpeg encoder and its options besides the CRF: low delay (no lookahead, no
B-frames), so each frame's packet comes out as the frame goes in, in display order."""
DECODERS = {"av1": ("libdav1d", "libaom-av1", "av1"), "h264": ("h264",)}
"""Each video codec's FFmpeg decoders, the first one this FFmpeg has is used."""
_IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG"}
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
_FRAME_RATE = Fraction(1, 30)
_BT601, _LIMITED, _FULL = 6, 1, 2  # AVCOL_SPC_SMPTE170M, AVCOL_RANGE_MPEG, AVCOL_RANGE_JPEG


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self) -> None:
        with self._lock:
            self.value += 1


_VIDEO_DECODES = _Counter()


def video_chunk_decodes() -> int:
    """How many video chunks (groups of pictures) this process has decoded so far: a read that
    finds a decoded chunk in the cache adds none."""
    return _VIDEO_DECODES.value


@dataclass(frozen=True)
class FrameCodec:
    """How the frames of one field are encoded: ``codec`` (one of `FRAME_CODECS`), the field's
    frame ``shape`` and ``quality`` (None: the codec's default, `QUALITY`; PNG takes none).

    Raises ValueError for an unknown codec, a shape it cannot code or a quality out of range."""

    codec: str
    shape: tuple[int, ...]
    quality: int | None = None

    def __post_init__(self) -> None:
        if self.codec not in FRAME_CODECS:
            raise ValueError(f"codec must be one of {list(FRAME_CODECS)}, got {self.codec!r}")
        channels = self.shape[2] if len(self.shape) == 3 else 1
        if len(self.shape) not in (2, 3) or channels not in CHANNELS[self.codec] or 0 in self.shape:
            raise ValueError(f"codec {self.codec!r} takes uint8 frames of shape (H, W) or (H, W, C) with C in "
                             f"{CHANNELS[self.codec]} and H, W > 0, got shape {self.shape}")
        if self.quality is not None:
            if self.codec not in QUALITY:
                raise ValueError(f"codec {self.codec!r} takes no quality (lossless), got {self.quality!r}")
            least, most, _ = QUALITY[self.codec]
            check_int(self.quality, f"quality for {self.codec}", least, most)

    @property
    def video(self) -> bool:
        """True for a video codec: a chunk's frames are one group of pictures, decoded together."""
        return self.codec in VIDEO_CODECS

    @property
    def level(self) -> int | None:
        """The quality the encoder gets (the given one or the codec's default); None for PNG."""
        return self.quality if self.quality is not None or self.codec not in QUALITY else QUALITY[self.codec][2]

    @property
    def channels(self) -> int:
        return self.shape[2] if len(self.shape) == 3 else 1

    def encode_rows(self, frames: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``frames`` (``[N, *shape]`` uint8, the rows of one chunk of one lane) encoded:
        ``(values, ends)``, the uint8 bytes of every frame one after the other and the int64 end
        of each frame's bytes in ``values``. Video: the first frame is a keyframe."""
        frames = np.ascontiguousarray(frames, dtype=np.uint8)
        if frames.shape[1:] != self.shape:
            raise ValueError(f"expected frames of shape (N, *{self.shape}), got {frames.shape}")
        if not len(frames):
            return np.zeros(0, np.uint8), np.zeros(0, np.int64)
        if self.video:
            stream = VideoEncoder(self)
            blobs = [stream.encode(frame, keyframe=not i) for i, frame in enumerate(frames)]
            stream.close()
        else:
            blobs = [self.encode_frame(frame) for frame in frames]
        values = np.frombuffer(b"".join(blobs), np.uint8)
        return values, np.cumsum([len(b) for b in blobs], dtype=np.int64)

    def decode_rows(self, values: bytes | np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The frames `encode_rows` gave ``(values, ends)`` for: ``[len(ends), *shape]`` uint8.
        Raises ValueError for ends that do not split ``values`` or bytes that do not decode."""
        data = values.tobytes() if isinstance(values, np.ndarray) else bytes(values)
        blobs = split_packets(data, ends)
        if self.video:
            return _decode_video(self, blobs)
        out = np.empty((len(blobs), *self.shape), np.uint8)
        for i, blob in enumerate(blobs):
            out[i] = self.decode_frame(blob)
        return out

    def encode_frame(self, frame: np.ndarray) -> bytes:
        """One frame as a PNG or JPEG file's bytes (image codecs only)."""
        pixels = np.ascontiguousarray(frame, dtype=np.uint8)
        image = _pil().Image.fromarray(pixels.reshape(self.shape[:2]) if self.channels == 1 else pixels)
        out = io.BytesIO()
        if self.codec == "png":
            image.save(out, "PNG", compress_level=1)
        else:  # no chroma subsampling: 4:4:4 keeps thin colored edges
            image.save(out, "JPEG", quality=self.level, subsampling=0)
        return out.getvalue()

    def decode_frame(self, data: bytes) -> np.ndarray:
        """The frame of one PNG or JPEG file's bytes, checked to be of this field's shape and
        channels before its pixels are decoded. Raises ValueError."""
        pil = _pil()
        try:
            with pil.Image.open(io.BytesIO(data), formats=[_IMAGE_FORMATS[self.codec]]) as image:
                height, width = self.shape[:2]
                if image.size != (width, height) or image.mode != _MODES[self.channels]:
                    raise ValueError(f"{self.codec} image of {image.size[1]}x{image.size[0]} {image.mode}, expected "
                                     f"{height}x{width} {_MODES[self.channels]}")
                return np.asarray(image).reshape(self.shape)
        except (OSError, SyntaxError, pil.Image.DecompressionBombError) as exc:
            raise ValueError(f"{self.codec} image does not decode: {exc}") from None


def split_packets(data: bytes, ends: np.ndarray) -> list[bytes]:
    """``data`` cut at ``ends`` (each frame's end): every part non-empty, the last ending at
    ``len(data)``. Raises ValueError."""
    ends = np.asarray(ends)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    if ends.ndim != 1 or (len(ends) and (np.any(ends <= starts) or ends[-1] != len(data))):
        raise ValueError(f"frame ends {ends.tolist()[:8]} do not split {len(data)} bytes into non-empty frames")
    return [data[s:e] for s, e in zip(starts.tolist(), ends.tolist())]


def coded_size(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(height, width)`` a video frame of ``shape`` is coded with: even, at least `MIN_SIDE`."""
    return tuple(max(MIN_SIDE, side + side % 2) for side in shape[:2])  # type: ignore[return-value]


class VideoEncoder:
    """One lane's video stream: `encode` gives each frame's packet at once (no lookahead, no
    B-frames), so that rows are stored as they are added. A keyframe starts a new stream."""

    def __init__(self, codec: FrameCodec):
        self.codec = codec
        self._context: Any = None
        self._next = 0

    def encode(self, frame: np.ndarray, keyframe: bool) -> bytes:
        """``frame``'s packet; ``keyframe``: it starts a new group of pictures (always so for the
        first frame, and after the encoder held a frame back: its stream ended there)."""
        av = _av()
        if keyframe or self._context is None:
            self.close()
            self._context, self._next = _open_encoder(av, self.codec), 0
        picture = _picture(av, frame, self._context.height, self._context.width)
        picture.pts = self._next
        packets = self._context.encode(picture)
        if not packets:  # held back (SVT-AV1 under load, say): end the stream to get it now
            packets, self._context = self._context.encode(None), None
        if [p.pts for p in packets] != [self._next] or (self._next == 0 and not packets[0].is_keyframe):
            raise RuntimeError(f"{self.codec.codec} encoder gave packets for frames {[p.pts for p in packets]} "
                               f"of frame {self._next}, expected exactly its own (a keyframe first)")
        self._next += 1
        return bytes(packets[0])

    def close(self) -> None:
        """End the stream (its encoder holds no frame: each packet came out with its frame)."""
        if self._context is not None:
            context, self._context = self._context, None
            context.encode(None)


def _open_encoder(av: Any, codec: FrameCodec) -> Any:
    name, options = ENCODERS[codec.codec]
    context = av.CodecContext.create(name, "w")
    context.height, context.width = coded_size(codec.shape)
    context.pix_fmt, context.time_base = "yuv420p", _FRAME_RATE
    context.colorspace, context.color_range = _BT601, _FULL if codec.channels == 1 else _LIMITED
    context.options = {**options, "crf": str(codec.level)}
    return context


def _picture(av: Any, frame: np.ndarray, height: int, width: int) -> Any:
    """``frame`` as a yuv420p VideoFrame of ``height`` x ``width`` (padded by repeating edges)."""
    pixels: np.ndarray = frame.reshape(frame.shape[0], frame.shape[1], -1)
    padded = np.pad(pixels, ((0, height - pixels.shape[0]), (0, width - pixels.shape[1]), (0, 0)), mode="edge")
    if padded.shape[2] == 3:
        return av.VideoFrame.from_ndarray(padded, format="rgb24").reformat(format="yuv420p", dst_colorspace=_BT601)
    planes = np.full((height * 3 // 2, width), 128, np.uint8)
    planes[:height] = padded[..., 0]
    return av.VideoFrame.from_ndarray(planes, format="yuv420p")


def _decode_video(codec: FrameCodec, blobs: list[bytes]) -> np.ndarray:
    av = _av()
    context: Any = av.CodecContext.create(_decoder(av, codec.codec), "r")
    context.thread_count = 1  # chunks decode in parallel on the reader's threads
    height, width = codec.shape[:2]
    coded = coded_size(codec.shape)
    out = np.empty((len(blobs), *codec.shape), np.uint8)
    done = 0
    try:
        for packet in [av.Packet(blob) for blob in blobs] + [None]:
            for picture in context.decode(packet):
                if (picture.height, picture.width) != coded or done == len(out):
                    raise ValueError(f"{codec.codec} chunk holds a picture {done} of {picture.height}x{picture.width}"
                                     f", expected {len(out)} of {coded[0]}x{coded[1]}")
                out[done] = _pixels(picture, codec.channels)[:height, :width].reshape(codec.shape)
                done += 1
    except av.FFmpegError as exc:
        raise ValueError(f"{codec.codec} chunk does not decode: {exc}") from None
    if done != len(out):
        raise ValueError(f"{codec.codec} chunk of {len(out)} packets decodes to {done} frames")
    _VIDEO_DECODES.add()
    return out


def _pixels(picture: Any, channels: int) -> np.ndarray:
    """A decoded picture's RGB pixels (swscale, BT.601) or, for one channel, its luma plane."""
    if channels == 3:
        return picture.to_ndarray(format="rgb24", src_colorspace=_BT601)  # type: ignore[no-any-return]
    return picture.to_ndarray()[:picture.height]  # type: ignore[no-any-return]


def _decoder(av: Any, codec: str) -> str:
    for name in DECODERS[codec]:
        if name in av.codecs_available:
            return name
    raise RuntimeError(f"this PyAV's FFmpeg has no {codec} decoder (looked for {list(DECODERS[codec])})")


def _pil() -> Any:
    try:
        import PIL.Image
    except ImportError as exc:
        raise missing_extra("Pillow", "images", "png and jpeg frame fields") from exc
    return PIL


def _av() -> Any:
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its settings to stderr unless told: errors only
    try:
        import av
    except ImportError as exc:
        raise missing_extra("PyAV", "video", "av1 and h264 frame fields") from exc
    return av
