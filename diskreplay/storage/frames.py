"""Encoded frame fields over ragged storage: `FrameWrites` turns a lane's added frames into the
bytes stored as the field's ragged rows (a PNG or JPEG file per frame, or each frame's packet of
its row chunk's video), `FrameReads` decodes rows read back and keeps decoded frames in an LRU.

A video chunk is decoded whole (its frames up to the lane's newest row) on first read; its
frames then serve every later read of that chunk without a decode. A cached entry is named by
its lane, the first step of its chunk and the number of rows decoded, so rows a ring wrote over
or a tail that grew since are decoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import CorruptBufferError
from ..format.frame_codecs import FrameCodec, VideoEncoder
from ..format.lanes import LaneLayout
from ..format.ragged import EncodedFrames, Ragged, RaggedColumn
from ..format.schema import Field
from ..io.threads import Threads

FRAME_CACHE_BYTES = 256 << 20
"""Decoded frames a storage keeps (at least one video chunk of each field), besides its chunk cache."""
Fetch = Callable[[str, np.ndarray, np.ndarray], Ragged]
"""``(name, lanes, steps)`` -> the stored bytes of those rows."""


class FrameWrites:
    """The writer's encoders: one video stream per lane and video field."""

    def __init__(self, fields: Mapping[str, Field], layout: LaneLayout):
        self.codecs = {name: f.frames for name, f in fields.items() if f.frames is not None}
        self.layout = layout
        self._streams: dict[tuple[str, int], tuple[VideoEncoder, int]] = {}
        """(field, lane) -> its open stream and the step its next frame must be."""

    def encode(self, lane: int, start: int, rows: Mapping[str, np.ndarray]) -> dict[str, RaggedColumn]:
        """Frames ``rows[name]`` (``[count, *shape]``) of steps ``[start, start + count)`` of
        ``lane`` as the ragged bytes that store them. A video frame that starts a row chunk, or
        does not follow its stream's last frame, starts a new stream with a keyframe."""
        out = {}
        for name, codec in self.codecs.items():
            frames = rows[name]
            if isinstance(frames, EncodedFrames):  # stored as given; the next frame added starts a stream
                open_stream = self._streams.pop((name, lane), None)
                if open_stream is not None:
                    open_stream[0].close()
                out[name] = RaggedColumn(frames.values, frames.lengths)
                continue
            if codec.video:
                blobs = self._video(name, codec, lane, start, frames)
            else:
                blobs = [codec.encode_frame(frame) for frame in frames]
            out[name] = RaggedColumn(np.frombuffer(b"".join(blobs), np.uint8),
                                     np.array([len(b) for b in blobs], np.int64))
        return out

    def _video(self, name: str, codec: FrameCodec, lane: int, start: int, frames: np.ndarray) -> list[bytes]:
        stream, expected = self._streams.pop((name, lane), (None, -1))
        _, offsets = self.layout.chunk_and_offset(start + np.arange(len(frames)))
        blobs: list[bytes] = []
        for frame, offset in zip(frames, offsets.tolist()):
            fresh = stream is None or offset == 0 or start + len(blobs) != expected
            if fresh:
                if stream is not None:
                    stream.close()
                stream = VideoEncoder(codec)
            assert stream is not None
            blobs.append(stream.encode(frame, keyframe=fresh))
            expected = start + len(blobs)
        if stream is not None:
            self._streams[(name, lane)] = (stream, expected)
        return blobs

    def close(self) -> None:
        """End every open stream."""
        for stream, _ in self._streams.values():
            stream.close()
        self._streams.clear()

    def reset(self, lane: int) -> None:
        """Forget the lane's streams (its last rows were undone): its next frame starts a new one."""
        for key in [key for key in self._streams if key[1] == lane]:
            self._streams.pop(key)[0].close()


class FrameReads:
    """Decodes encoded frame fields' rows, through an LRU of decoded frames."""

    def __init__(self, fields: Mapping[str, Field], layout: LaneLayout, threads: Threads):
        self.codecs = {name: f.frames for name, f in fields.items() if f.frames is not None}
        self.layout, self.threads, self.budget = layout, threads, FRAME_CACHE_BYTES
        self._cache: OrderedDict[tuple[str, int, int, int], np.ndarray] = OrderedDict()
        """(field, lane, first step, rows) -> decoded frames: a video chunk's, or one image row's (rows 1)."""
        self._bytes = 0

    def read(self, name: str, lane: np.ndarray, step: np.ndarray, total: np.ndarray, fetch: Fetch,
             where: str) -> np.ndarray:
        """The frames of rows ``(lane, step)`` of field ``name``: ``[len(step), *shape]``."""
        codec = self.codecs[name]
        if codec.video:
            _, offset = self.layout.chunk_and_offset(step)
            first = step - offset
            size = np.minimum(self.layout.chunk_rows, total[lane] - first)
            keys = [(name, ln, f, n) for ln, f, n in zip(lane.tolist(), first.tolist(), size.tolist())]
            at = offset.tolist()
        else:
            keys = [(name, ln, st, 1) for ln, st in zip(lane.tolist(), step.tolist())]
            at = [0] * len(keys)
        found = {key: self._cache[key] for key in dict.fromkeys(keys) if key in self._cache}
        for key in found:
            self._cache.move_to_end(key)
        missing = [key for key in dict.fromkeys(keys) if key not in found]
        if missing:
            found.update(zip(missing, self._decode(codec, missing, fetch, where)))
            for key in missing:
                self._keep(key, found[key])
        out = np.empty((len(keys), *codec.shape), np.uint8)
        for i, (key, row) in enumerate(zip(keys, at)):
            out[i] = found[key][row]
        return out

    def _decode(self, codec: FrameCodec, keys: list[tuple[str, int, int, int]], fetch: Fetch,
                where: str) -> list[np.ndarray]:
        """The decoded frames of each key: a video chunk's ``n`` rows from step ``first``, or one
        image row (``[1, *shape]``), decoded on the threads."""
        name = keys[0][0]
        if codec.video:  # every chunk's rows in one read, then one decode per chunk
            sizes = [n for *_, n in keys]
            rows = fetch(name, np.repeat([key[1] for key in keys], sizes),
                         np.concatenate([first + np.arange(n) for _, _, first, n in keys]))
            bounds = np.cumsum([0, *sizes]).tolist()
            chunks = [Ragged(rows.values[rows.offsets[a]:rows.offsets[b]], rows.offsets[a:b + 1] - rows.offsets[a])
                      for a, b in zip(bounds[:-1], bounds[1:])]
            return list(self.threads.map(lambda chunk: _decoded_chunk(codec, chunk, where), chunks))
        rows = fetch(name, np.array([key[1] for key in keys]), np.array([key[2] for key in keys]))
        return list(self.threads.map(lambda blob: _decoded(codec, blob.tobytes(), where)[None], list(rows)))

    def _keep(self, key: tuple[str, int, int, int], frames: np.ndarray) -> None:
        self._cache[key] = frames
        self._bytes += frames.nbytes
        while self._bytes > self.budget and len(self._cache) > 1:
            self._bytes -= self._cache.popitem(last=False)[1].nbytes

    def forget(self) -> None:
        """Drop every decoded frame (rows were undone, or the storage follows another commit)."""
        self._cache.clear()
        self._bytes = 0


def _decoded(codec: FrameCodec, blob: bytes, where: str) -> np.ndarray:
    try:
        return codec.decode_frame(blob)
    except ValueError as exc:
        raise CorruptBufferError(f"{where}: {exc}") from None


def _decoded_chunk(codec: FrameCodec, rows: Ragged, where: str) -> np.ndarray:
    try:
        return codec.decode_rows(rows.values, rows.offsets[1:])
    except ValueError as exc:
        raise CorruptBufferError(f"{where}: {exc}") from None
