"""A LeRobot v3 dataset folder (``meta/info.json`` with ``codebase_version`` ``"v3.0"``; layout in
`diskreplay.offline.formats.lerobot_meta`), imported as one lane whose episodes are LeRobot's, in
episode_index order.

Fields, from info.json's ``features``:

* numeric features (any stored dtype; shape ``[1]`` is a scalar): named as the ``"parquet"``
  import names columns (`parquet_field_name`: ``observation.state`` -> ``obs``, ``action`` ->
  ``action``, ``next.reward`` -> ``reward``, ``next.done`` -> bool ``terminated``, other dots
  ``_``), ``timestamp`` kept; ``episode_index``, ``frame_index`` and ``index`` only place rows.
* ``task_index`` -> ``task``: a text field (``Field((), "str")``) holding each frame's task
  string from ``meta/tasks.parquet``; ``string`` features (language annotations) -> text fields.
* ``video`` features (camera keys, e.g. ``observation.images.top`` -> ``observation_images_top``):
  video fields (``codec="av1"`` or ``"h264"``, as the MP4 is; another codec becomes AV1) whose
  frames are those PyAV decodes from the key's MP4 at ``from_timestamp + timestamp``; each row
  chunk keeps the MP4's own packets where they fit it, else is encoded again, with a warning
  (`diskreplay.offline.formats.lerobot_video`). Slices are then one row chunk each.
* ``image`` features (each frame a PNG or JPEG file's bytes in the data files) -> ``codec="png"``
  / ``"jpeg"`` frame fields that keep those bytes (`diskreplay.offline.images`).

Episode ends: each episode's last frame ends it, ``truncated`` unless ``next.done`` is set there
(as the ``"parquet"`` import does). Everything read is checked against the metadata: each data
file holds exactly its episodes' rows in order (``episode_index`` per row), task indices exist,
video frames exist at the times asked for; anything else is an ImportFormatError naming the file.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...format.schema import Field
from ...io import local_path
from ..images import image_field, image_rows
from ..mp4 import STORED_CODECS, frame_shape, stream_codec
from ..naming import d4rl_field_name
from ..source import Batch, ImportFormatError, PendingSlices, Source, as_bool_flags, concat_rows, field_for
from .lerobot_meta import LeRobotMeta, is_lerobot
from .lerobot_video import VideoChunks
from .parquet import FLAG_FIELDS, _plain, _with_ends, parquet_field_name

__all__ = ["LeRobotSource", "is_lerobot"]

PLACE = ("episode_index", "frame_index", "index")
FIELD_NAMES = {"task_index": "task"}  # beyond the "parquet" import's names


class LeRobotSource(Source):
    """The frames of a LeRobot v3 dataset, episode after episode, as one lane."""

    def __init__(self, src: str, batch_rows: int):
        self.src, self.batch_rows = src, batch_rows
        self.meta = LeRobotMeta(local_path(src))
        self.rows = self.meta.episodes[-1].stop
        self.columns: dict[str, tuple[str, tuple[int, ...]]] = {}  # field -> (column, stored shape)
        self.videos: dict[str, str] = {}  # field -> video key
        self.fields = {}
        for column, ft in self.meta.features.items():
            field = self._field(column, ft)
            if field is None:
                continue
            name = d4rl_field_name(column) if ft["dtype"] == "video" else FIELD_NAMES.get(column) or \
                parquet_field_name(column)
            if name in self.fields:
                raise ImportFormatError(f"{self.meta.info_file!r}: two features map to field {name!r}")
            self.fields[name] = field
            if ft["dtype"] == "video":
                self.videos[name] = column
            else:
                self.columns[name] = (column, tuple(ft["shape"]))
        self.fields.setdefault("truncated", Field((), np.dtype(bool)))
        if "timestamp" not in self.meta.features and self.videos:
            raise ImportFormatError(f"{self.meta.info_file!r}: video features need a 'timestamp' feature")

    def _field(self, column: str, ft: dict) -> Field | None:
        """The field of one feature, or None for a placement column or a skipped one (warned)."""
        where = f"{self.meta.info_file!r}: feature {column!r}"
        if column in PLACE:
            return None
        if ft["dtype"] == "image":
            return image_field(self._first_image(column), where)
        if ft["dtype"] == "video":
            codec = stream_codec(self.meta.episodes[0].videos[column].path, f"video key {column!r}")
            return Field(frame_shape(ft, where), "uint8", codec=STORED_CODECS.get(codec or "", "av1"))
        if ft["dtype"] == "string" or column == "task_index":
            return Field((), "str")
        try:
            dtype = np.dtype(ft["dtype"])
        except TypeError:
            warnings.warn(f"{where}: skipped (dtype {ft['dtype']!r} is not a numpy dtype)", stacklevel=4)
            return None
        shape = () if ft["shape"] == [1] else tuple(ft["shape"])
        if parquet_field_name(column) in FLAG_FIELDS:
            dtype = np.dtype(bool)
        return field_for(parquet_field_name(column), shape, dtype, where)

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows;
        with camera keys, one slice per row chunk of the new buffer (`Source.chunk_rows`)."""
        if not self.videos:
            pending = PendingSlices(self.batch_rows)
            for batch in _with_ends(self._rows()):
                yield from pending.add(batch)
            yield from pending.drain()
            return
        episodes = {ep.index: ep for ep in self.meta.episodes}
        videos = {name: VideoChunks(key, self.fields[name], episodes) for name, key in self.videos.items()}
        try:
            for batch in _with_ends(self._with_videos(_aligned(self._rows(), self.chunk_rows or 32), videos)):
                yield 0, batch
        finally:
            for video in videos.values():
                video.close()
        for video in videos.values():
            if video.warning():
                warnings.warn(f"{self.src!r}: {video.warning()}", stacklevel=2)

    def _with_videos(self, chunks: Iterator[tuple[np.ndarray, Batch]], videos: dict[str, VideoChunks]
                     ) -> Iterator[tuple[np.ndarray, Batch]]:
        for episode, batch in chunks:
            out: dict[str, Any] = dict(batch)  # a video field's rows may be EncodedFrames
            for name, video in videos.items():
                out[name] = video.rows(episode, batch["timestamp"])
            yield episode, out

    def _rows(self) -> Iterator[tuple[np.ndarray, Batch]]:
        """``(episode_index, fields)`` per record batch, data file after data file (no camera keys)."""
        for file, episodes in self.meta.data_files():
            expected = np.repeat([ep.index for ep in episodes], [ep.length for ep in episodes])
            seen = 0
            for rb in self._record_batches(file, len(expected)):
                episode = _plain(file, "episode_index", rb.column("episode_index"), ())
                _check_episodes(file, episode, expected[seen:seen + len(episode)], seen)
                seen += len(episode)
                yield episode, self._decode(file, rb)
            if seen != len(expected):
                raise ImportFormatError(f"{file!r}: holds {seen} rows, meta/episodes says {len(expected)}")

    def _record_batches(self, file: str, rows: int) -> Iterator[Any]:
        pq = self.meta.pq
        try:
            pf = pq.ParquetFile(file)
        except FileNotFoundError:
            raise ImportFormatError(f"{file!r}: missing (named by meta/episodes)") from None
        except Exception as e:
            raise ImportFormatError(f"{file!r}: not a readable Parquet file ({e})") from e
        columns = ["episode_index", *(c for c, _ in self.columns.values())]
        missing = [c for c in columns if c not in pf.schema_arrow.names]
        if missing:
            raise ImportFormatError(f"{file!r}: no column {missing[0]!r} (a feature of info.json)")
        if pf.metadata.num_rows != rows:
            raise ImportFormatError(f"{file!r}: holds {pf.metadata.num_rows} rows, meta/episodes says {rows}")
        try:
            yield from pf.iter_batches(batch_size=self.batch_rows, columns=columns)
        except ImportFormatError:
            raise
        except Exception as e:
            raise ImportFormatError(f"{file!r}: unreadable ({e})") from e

    def _first_image(self, column: str) -> bytes:
        """The first frame's image bytes of an ``image`` feature."""
        file = self.meta.episodes[0].data_file
        try:
            rb = next(self.meta.pq.ParquetFile(file).iter_batches(batch_size=1, columns=[column]))
        except Exception as e:
            raise ImportFormatError(f"{file!r}: no readable column {column!r} (an image feature) ({e})") from e
        return _image_bytes(file, column, rb.column(column))[0]

    def _decode(self, file: str, rb: Any) -> Batch:
        batch: dict[str, Any] = {}
        for name, (column, shape) in self.columns.items():
            if self.fields[name].codec is not None:
                batch[name] = image_rows(_image_bytes(file, column, rb.column(column)), self.fields[name],
                                         f"{file!r}: column {column!r}")
                continue
            if self.fields[name].text:
                batch[name] = self._text(file, column, rb.column(column))
                continue
            stored = () if shape == (1,) and not hasattr(rb.column(column), "value_lengths") else shape
            values = _plain(file, column, rb.column(column), stored).reshape(-1, *self.fields[name].shape)
            if values.dtype != self.fields[name].dtype and self.fields[name].dtype != np.bool_:
                raise ImportFormatError(f"{file!r}: column {column!r} is {values.dtype}, info.json says "
                                        f"{self.fields[name].dtype}")
            batch[name] = values
        return as_bool_flags(batch, self.fields)

    def _text(self, file: str, column: str, values: Any) -> np.ndarray:
        """A text column as an array of str: task strings for ``task_index``, else the strings held."""
        if column == "task_index":
            return np.array(self.meta.task_names(_plain(file, column, values, ()), file), dtype=object)
        texts = values.to_pylist()
        if not all(isinstance(t, str) for t in texts):
            raise ImportFormatError(f"{file!r}: column {column!r} must hold strings without nulls, got {values.type}")
        return np.array(texts, dtype=object)

def _image_bytes(file: str, column: str, values: Any) -> list[bytes]:
    """The image files' bytes of an ``image`` column (Hugging Face's struct of ``bytes`` and ``path``)."""
    try:
        blobs: list = values.field("bytes").to_pylist() if hasattr(values, "field") else values.to_pylist()
    except KeyError:
        blobs = [None]
    if not all(isinstance(b, bytes) for b in blobs):
        raise ImportFormatError(f"{file!r}: column {column!r} must hold each frame's image bytes "
                                f"(images stored as paths are not read), got {values.type}")
    return blobs


def _aligned(pieces: Iterator[tuple[np.ndarray, Batch]], size: int) -> Iterator[tuple[np.ndarray, Batch]]:
    """The rows of ``pieces`` cut into slices of ``size`` rows (the last one may hold fewer)."""
    held: list[tuple[np.ndarray, Batch]] = []
    count = 0
    for episode, batch in pieces:
        held.append((episode, batch))
        count += len(episode)
        while count >= size:
            yield _join(held, size)
            first, rest = _join(held, count), count - size
            held = [(first[0][size:], {k: v[size:] for k, v in first[1].items()})] if rest else []
            count = rest
    if count:
        yield _join(held, count)


def _join(held: list[tuple[np.ndarray, Batch]], rows: int) -> tuple[np.ndarray, Batch]:
    """The first ``rows`` rows of ``held`` as one slice."""
    episode = np.concatenate([e for e, _ in held])[:rows]
    return episode, {k: concat_rows([b[k] for _, b in held])[:rows] for k in held[0][1]}


def _check_episodes(file: str, found: np.ndarray, expected: np.ndarray, first: int) -> None:
    """Raises ImportFormatError at the first row of ``file`` (from row ``first``) whose
    episode_index is not the one meta/episodes places there."""
    wrong = np.flatnonzero(found[:len(expected)] != expected)
    if len(wrong):
        row = int(wrong[0])
        raise ImportFormatError(f"{file!r}: row {first + row} belongs to episode {int(found[row])}, "
                                f"meta/episodes places episode {int(expected[row])} there")


def open_lerobot(src: str, batch_rows: int) -> Source:
    """The source of a LeRobot v3 dataset folder."""
    if not os.path.isdir(local_path(src)):
        raise ImportFormatError(f"{src!r}: a LeRobot v3 dataset is a folder with meta/info.json")
    return LeRobotSource(src, batch_rows)
