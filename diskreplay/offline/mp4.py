"""MP4 video through PyAV (an optional dependency: ``pip install av``): frames read by timestamp,
frames written at a frame rate. The LeRobot importer and exporter use it for camera keys.

Frames are RGB, ``uint8 [height, width, 3]``, as PyAV gives them with ``to_ndarray(format="rgb24")``.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

from ..build import missing_extra
from .source import ImportFormatError

TOLERANCE_S = 1e-4
"""How far a frame's time may be from the time asked for (LeRobot's default ``tolerance_s``)."""


def require_av() -> Any:
    """The ``av`` module (PyAV), or ImportError saying how to install it."""
    try:
        import av
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise missing_extra("PyAV", "video", "LeRobot video") from e
    return av


class FrameReader:
    """Decodes the frames of MP4 files at the times asked for, in increasing time per file.

    `frame` keeps one file open and decodes forward; asking for an earlier time of the same
    file, or another file, reopens. Damaged files and missing frames are ImportFormatErrors
    naming the file and the time.
    """

    def __init__(self, what: str, shape: tuple[int, ...]):
        self.av = require_av()
        self.what, self.shape = what, shape
        self.path: str | None = None
        self.container: Any = None
        self.frames: Any = None
        self.ahead: tuple[float, Any] | None = None  # the next decoded frame: (time, frame)

    def frame(self, path: str, time: float) -> np.ndarray:
        """The frame of ``path`` shown at ``time`` seconds (within `TOLERANCE_S`), ``uint8 [H, W, 3]``."""
        if path != self.path or self.ahead is not None and self.ahead[0] > time + TOLERANCE_S:
            self._open(path)
        while self.ahead is not None and self.ahead[0] < time - TOLERANCE_S:
            self._advance()
        if self.ahead is None or abs(self.ahead[0] - time) > TOLERANCE_S:
            near = "no later frame" if self.ahead is None else f"the next frame is at {self.ahead[0]:.6f} s"
            raise ImportFormatError(f"{path!r}: {self.what}: no frame at {time:.6f} s ({near})")
        array: np.ndarray = self.ahead[1].to_ndarray(format="rgb24")
        if array.shape != self.shape:
            raise ImportFormatError(f"{path!r}: {self.what}: frames of shape {array.shape}, "
                                    f"expected {self.shape} (info.json)")
        return array

    def _open(self, path: str) -> None:
        self.close()
        try:
            self.container = self.av.open(path)
            stream = self.container.streams.video[0]
            self.frames = self.container.decode(stream)
        except FileNotFoundError:
            raise ImportFormatError(f"{path!r}: missing (named by the dataset's metadata)") from None
        except (self.av.error.FFmpegError, IndexError) as e:
            raise ImportFormatError(f"{path!r}: {self.what}: not a readable video ({e})") from e
        self.path = path
        self._advance()

    def _advance(self) -> None:
        try:
            frame = next(self.frames, None)
        except self.av.error.FFmpegError as e:
            raise ImportFormatError(f"{self.path!r}: {self.what}: damaged video ({e})") from e
        self.ahead = None if frame is None or frame.time is None else (float(frame.time), frame)

    def close(self) -> None:
        """Closes the open file, if any."""
        if self.container is not None:
            self.container.close()
        self.container = self.frames = self.ahead = self.path = None


class FrameWriter:
    """Writes RGB frames into one MP4 file at ``fps`` frames per second: frame ``i`` is shown
    at ``i / fps`` s. A frame written with ``key=True`` is a keyframe (an episode's first)."""

    def __init__(self, path: str, fps: float, width: int, height: int, codec: str, options: dict[str, str]):
        self.av = require_av()
        self.container = self.av.open(path, "w")
        rate = Fraction(fps).limit_denominator(1001)
        self.stream = self.container.add_stream(codec, rate=rate, options=options)
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"
        self.time_base = 1 / rate
        self.count = 0

    def write(self, frames: np.ndarray, first_is_key: bool) -> None:
        """Appends ``frames`` (``uint8 [n, H, W, 3]``)."""
        for i, image in enumerate(frames):
            frame = self.av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
            frame.pts, frame.time_base = self.count, self.time_base
            if i == 0 and first_is_key:
                frame.pict_type = self.av.video.frame.PictureType.I
            self.container.mux(self.stream.encode(frame))
            self.count += 1

    @property
    def seconds(self) -> float:
        """The time at which the next frame will be shown."""
        return float(self.count * self.time_base)

    def close(self) -> None:
        """Flushes the encoder and closes the file."""
        self.container.mux(self.stream.encode())
        self.container.close()


def frame_shape(feature: dict, what: str) -> tuple[int, int, int]:
    """``(height, width, 3)`` of a LeRobot video feature (its ``info`` or its shape and names);
    ImportFormatError for other than 3 channels."""
    info = feature.get("info") or {}
    shape, names = feature["shape"], feature.get("names") or ["height", "width", "channels"]
    dims = dict(zip([str(n).rstrip("s") if str(n) != "rgb" else "channel" for n in names], shape, strict=False))
    height, width = info.get("video.height", dims.get("height")), info.get("video.width", dims.get("width"))
    channels = info.get("video.channels", dims.get("channel"))
    if type(height) is not int or type(width) is not int or min(height, width) < 1 or channels != 3 \
            or len(shape) != 3 or math.prod(shape) != height * width * 3:
        raise ImportFormatError(f"{what}: video feature of shape {shape} (names {names}), expected "
                                f"height, width and 3 channels")
    return height, width, 3


STORED_CODECS = {"av1": "av1", "h264": "h264"}
"""MP4 stream codecs (FFmpeg's canonical names) whose packets a video frame field stores as they are."""


class PacketReader:
    """The packets of MP4 files at the times asked for, as a video frame field stores them
    (AV1: the temporal unit's OBUs as muxed; H.264: Annex B, parameter sets before each IDR), with
    their place in decode order and whether they are keyframes. Like `FrameReader`, it reads
    forward and reopens to go back. A stream whose packets are not in display order (B-frames)
    or of another codec gives None: its packets cannot be stored as they are."""

    def __init__(self, what: str):
        self.av = require_av()
        self.what = what
        self.path: str | None = None
        self.container: Any = None
        self.packets: Any = None
        self.ahead: tuple[float, int, bool, bytes] | None = None  # (time, decode index, keyframe, data)
        self.codec: str | None = None
        self.last = -math.inf

    def packet(self, path: str, time: float) -> tuple[int, bool, bytes] | None:
        """(decode index, keyframe, data) of the packet of ``path`` shown at ``time``, or None."""
        if path != self.path or self.ahead is not None and self.ahead[0] > time + TOLERANCE_S:
            self._open(path)
        while self.ahead is not None and self.ahead[0] < time - TOLERANCE_S:
            self._advance()
        if self.codec is None or self.ahead is None or abs(self.ahead[0] - time) > TOLERANCE_S:
            return None
        return self.ahead[1:]

    def _open(self, path: str) -> None:
        self.close()
        try:
            self.container = self.av.open(path)
            stream = self.container.streams.video[0]
        except FileNotFoundError:
            raise ImportFormatError(f"{path!r}: missing (named by the dataset's metadata)") from None
        except (self.av.error.FFmpegError, IndexError) as e:
            raise ImportFormatError(f"{path!r}: {self.what}: not a readable video ({e})") from e
        self.path, self.codec = path, STORED_CODECS.get(stream.codec_context.codec.canonical_name)
        self.time_base, self.last, self.index = stream.time_base, -math.inf, 0
        self.packets = self._annexb(stream) if self.codec == "h264" else self._demux(stream)
        self._advance()

    def _demux(self, stream: Any) -> Any:
        for packet in self.container.demux(stream):
            if packet.size:
                yield packet

    def _annexb(self, stream: Any) -> Any:
        import av.bitstream

        bsf = av.bitstream.BitStreamFilterContext("h264_mp4toannexb", stream)
        for packet in self.container.demux(stream):
            yield from bsf.filter(packet if packet.size else None)

    def _advance(self) -> None:
        try:
            packet = next(self.packets, None)
        except self.av.error.FFmpegError as e:
            raise ImportFormatError(f"{self.path!r}: {self.what}: damaged video ({e})") from e
        if packet is None or packet.pts is None:
            self.ahead = None
            return
        time = float(packet.pts * self.time_base)
        if time <= self.last:  # reordered (B-frames): packets are not one per frame in display order
            self.codec = None
        self.last = time
        self.ahead = (time, self.index, bool(packet.is_keyframe), bytes(packet))
        self.index += 1

    def close(self) -> None:
        """Closes the open file, if any."""
        if self.container is not None:
            self.container.close()
        self.container = self.packets = self.ahead = self.path = None


def stream_codec(path: str, what: str) -> str | None:
    """The codec of the first video stream of ``path`` (FFmpeg's canonical name), or None."""
    av = require_av()
    try:
        with av.open(path) as container:
            return str(container.streams.video[0].codec_context.codec.canonical_name)
    except FileNotFoundError:
        raise ImportFormatError(f"{path!r}: missing (named by the dataset's metadata)") from None
    except (av.error.FFmpegError, IndexError) as e:
        raise ImportFormatError(f"{path!r}: {what}: not a readable video ({e})") from e
