"""The frames of one LeRobot camera key for an encoded video field, a row chunk at a time: the
MP4's own packets where they fit the chunk, else the decoded frames, which the field encodes again.

A chunk's packets fit when, for each run of its rows that one video file holds, they are the
file's packets in decode order one after the other (one per frame, no reordering), the run's
first a keyframe, and they decode (as the field decodes a chunk) to exactly the frames PyAV
decodes from the file. LeRobot starts each episode with a keyframe and puts one every 2 frames
(``g=2``), so chunks that start on even frames of an episode usually fit.
"""

from __future__ import annotations

import numpy as np

from ...format.ragged import EncodedFrames
from ...format.schema import Field
from ..mp4 import FrameReader, PacketReader
from .lerobot_meta import Episode


class VideoChunks:
    """Rows of one camera key (field ``field``) as the field stores them (see the module docstring)."""

    def __init__(self, key: str, field: Field, episodes: dict[int, Episode]):
        assert field.frames is not None
        self.key, self.codec, self.episodes = key, field.frames, episodes
        self.frames = FrameReader(f"video key {key!r}", field.shape)
        self.packets = PacketReader(f"video key {key!r}")
        self.chunks = self.reencoded = 0

    def rows(self, episode: np.ndarray, timestamps: np.ndarray) -> np.ndarray | EncodedFrames:
        """The rows of one chunk (episode index and timestamp of each): encoded frames to store as
        they are, or the decoded frames (the field encodes them)."""
        spans = [self.episodes[ep].videos[self.key] for ep in episode.tolist()]
        times = [(span.path, span.from_timestamp + t) for span, t in zip(spans, timestamps.tolist(), strict=True)]
        reference = np.stack([self.frames.frame(path, t) for path, t in times])
        self.chunks += 1
        blobs = self._packets(times)
        if blobs is not None:
            lengths = np.array([len(b) for b in blobs], np.int64)
            values = np.frombuffer(b"".join(blobs), np.uint8)
            try:
                same = np.array_equal(self.codec.decode_rows(values, np.cumsum(lengths)), reference)
            except ValueError:
                same = False
            if same:
                return EncodedFrames(values, lengths)
        self.reencoded += 1
        return reference

    def _packets(self, times: list[tuple[str, float]]) -> list[bytes] | None:
        """The packets of the chunk's rows when they fit it, else None."""
        found = []
        for path, t in times:
            packet = self.packets.packet(path, t)
            if packet is None or self.packets.codec != self.codec.codec:
                return None
            found.append((path, *packet))
        for i, (path, index, keyframe, _) in enumerate(found):
            starts_run = i == 0 or found[i - 1][0] != path
            if starts_run and not keyframe or not starts_run and index != found[i - 1][1] + 1:
                return None
        return [data for *_, data in found]

    def warning(self) -> str | None:
        """What was encoded again, if anything, to tell the user."""
        if not self.reencoded:
            return None
        return (f"video key {self.key!r}: {self.reencoded} of {self.chunks} row chunks re-encoded as "
                f"{self.codec.codec}: their packets do not fit the field's chunks (a keyframe at each chunk's "
                f"first row, frames in display order, the same codec and frames as the MP4 decodes)")

    def close(self) -> None:
        """Closes the video files."""
        self.frames.close()
        self.packets.close()
