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
  every frame decoded (PyAV) from the key's MP4 file at ``from_timestamp + timestamp`` into a
  plain ``uint8 [height, width, 3]`` field (the fallback until encoded video fields exist: the
  frames are stored as pixels, compressed by the buffer's codec).
* ``image`` features are skipped with a warning.

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
from ..mp4 import FrameReader, frame_shape
from ..naming import d4rl_field_name
from ..source import Batch, ImportFormatError, PendingSlices, Source, as_bool_flags, field_for
from .lerobot_meta import Episode, LeRobotMeta, is_lerobot
from .parquet import FLAG_FIELDS, _plain, _with_ends, parquet_field_name

__all__ = ["LeRobotSource", "is_lerobot"]

PLACE = ("episode_index", "frame_index", "index")
FIELD_NAMES = {"task_index": "task"}  # beyond the "parquet" import's names
SKIPPED_DTYPES = ("image",)


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
        if ft["dtype"] in SKIPPED_DTYPES:
            warnings.warn(f"{where}: skipped ({ft['dtype']} features are not imported yet)", stacklevel=4)
            return None
        if ft["dtype"] == "video":
            return Field(frame_shape(ft, where), np.dtype(np.uint8))
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
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        pending = PendingSlices(self.batch_rows)
        readers = {name: FrameReader(f"video key {key!r}", self.fields[name].shape)
                   for name, key in self.videos.items()}
        try:
            for batch in _with_ends(self._rows(readers)):
                yield from pending.add(batch)
            yield from pending.drain()
        finally:
            for reader in readers.values():
                reader.close()

    def _rows(self, readers: dict[str, FrameReader]) -> Iterator[tuple[np.ndarray, Batch]]:
        """``(episode_index, fields)`` per record batch, data file after data file."""
        for file, episodes in self.meta.data_files():
            expected = np.repeat([ep.index for ep in episodes], [ep.length for ep in episodes])
            by_index = {ep.index: ep for ep in episodes}
            seen = 0
            for rb in self._record_batches(file, len(expected)):
                episode = _plain(file, "episode_index", rb.column("episode_index"), ())
                _check_episodes(file, episode, expected[seen:seen + len(episode)], seen)
                seen += len(episode)
                batch = self._decode(file, rb)
                for name, reader in readers.items():
                    batch[name] = self._frames(reader, self.videos[name], episode, batch["timestamp"], by_index)
                yield episode, batch
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

    def _decode(self, file: str, rb: Any) -> Batch:
        batch = {}
        for name, (column, shape) in self.columns.items():
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

    def _frames(self, reader: FrameReader, key: str, episode: np.ndarray, timestamps: np.ndarray,
                episodes: dict[int, Episode]) -> np.ndarray:
        """The frames of one camera key for rows of ``episode`` at ``timestamps`` (episode time)."""
        out = np.empty((len(episode), *reader.shape), np.uint8)
        for i, (ep, t) in enumerate(zip(episode.tolist(), timestamps.tolist(), strict=True)):
            span = episodes[ep].videos[key]
            out[i] = reader.frame(span.path, span.from_timestamp + t)
        return out


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
