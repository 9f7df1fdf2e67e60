"""The files a LeRobot v3 export writes while it streams: data Parquet files with their MP4s
(`EpisodeFiles`), feature statistics (`Stats`) and the tasks table (`tasks_table`)."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from .formats.parquet import require_arrow, require_pyarrow
from .mp4 import FrameWriter, require_av

VIDEO_OPTIONS = {"g": "2", "crf": "30"}  # LeRobot's encoder settings (keyframe every 2 frames)
ENCODERS = (("libsvtav1", "av1"), ("libaom-av1", "av1"), ("libx264", "h264"))  # preferred first


def video_encoder() -> tuple[str, str]:
    """(PyAV encoder, codec name for info.json): AV1 as LeRobot writes it, else H.264."""
    available = require_av().codecs_available
    for encoder, name in ENCODERS:
        if encoder in available:
            return encoder, name
    raise ImportError(f"PyAV has none of the video encoders {[e for e, _ in ENCODERS]}")


class EpisodeFiles:
    """The data file and the camera keys' video files being written, and each episode's metadata
    row (``meta/episodes``). `roll` starts the next files; episodes are numbered from 0."""

    def __init__(self, root: str, fps: float, schema: Any, cameras: dict[str, tuple[int, ...]], compress: bool):
        self.pq, self.pa = require_pyarrow(), require_arrow()
        self.root, self.fps, self.schema, self.cameras = root, fps, schema, cameras
        self.compression = "zstd" if compress else "snappy"
        self.encoder, self.codec_name = video_encoder() if cameras else ("", "av1")
        self.file_index, self.bytes = 0, 0
        self.writer: Any = None
        self.videos: dict[str, FrameWriter] = {}
        self.rows: list[dict[str, Any]] = []  # meta/episodes, one per episode
        self.task_names: dict[str, int] = {}
        self.frames = 0

    @property
    def episodes(self) -> int:
        """Episodes begun so far."""
        return len(self.rows)

    def _relative(self, template: str, **keys: Any) -> str:
        return template.format(chunk_index=self.file_index // 1000, file_index=self.file_index % 1000, **keys)

    def _open(self) -> None:
        path = os.path.join(self.root, self._relative("data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.writer = self.pq.ParquetWriter(path, self.schema, compression=self.compression)
        for key, (h, w, _) in self.cameras.items():
            video = os.path.join(self.root, self._relative(
                "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4", video_key=key))
            os.makedirs(os.path.dirname(video), exist_ok=True)
            self.videos[key] = FrameWriter(video, self.fps, w, h, self.encoder, VIDEO_OPTIONS)

    def write(self, segment: dict[str, np.ndarray]) -> None:
        """Appends rows of one episode (a new one when its first frame_index is 0), keyed by feature."""
        if self.writer is None:
            self._open()
        n = len(segment["index"])
        if segment["frame_index"][0] == 0:
            self._begin(int(segment["episode_index"][0]))
        row = self.rows[-1]
        row["length"] += n
        row["dataset_to_index"] += n
        names = {name for name, i in self.task_names.items() if i in set(segment["task_index"].tolist())}
        row["tasks"] += sorted(names - set(row["tasks"]))
        for key, video in self.videos.items():
            video.write(segment[key], first_is_key=segment["frame_index"][0] == 0)
            row[f"videos/{key}/to_timestamp"] = video.seconds
        arrays = []
        for column in self.schema:
            if column.type == self.pa.string():
                arrays.append(self.pa.array(list(segment[column.name]), self.pa.string()))
                continue
            values = np.ascontiguousarray(segment[column.name])
            array = self.pa.array(values.reshape(-1))
            for size in reversed(values.shape[1:]):
                array = self.pa.FixedSizeListArray.from_arrays(array, size)
            arrays.append(array)
        self.writer.write_batch(self.pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.bytes += sum(a.nbytes for a in arrays)
        self.frames += n

    def _begin(self, episode: int) -> None:
        row: dict[str, Any] = {"episode_index": episode, "tasks": [], "length": 0,
                               "data/chunk_index": self.file_index // 1000, "data/file_index": self.file_index % 1000,
                               "dataset_from_index": self.frames, "dataset_to_index": self.frames}
        for key, video in self.videos.items():
            start = video.seconds
            row.update({f"videos/{key}/chunk_index": self.file_index // 1000,
                        f"videos/{key}/file_index": self.file_index % 1000,
                        f"videos/{key}/from_timestamp": start, f"videos/{key}/to_timestamp": start})
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        self.rows.append(row)

    def roll(self) -> None:
        """Closes the files being written: the next episode starts the next ones."""
        self.close()
        self.file_index, self.bytes = self.file_index + 1, 0

    def episode_table(self) -> Any:
        """``meta/episodes``: one row per episode."""
        return self.pa.Table.from_pylist(self.rows) if self.rows else self.pa.table({"episode_index": []})

    def close(self) -> None:
        """Closes the open data and video files."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        for video in self.videos.values():
            video.close()
        self.videos = {}


class Stats:
    """Running mean, std, min, max and count of each feature (per channel, in [0, 1], for images)."""

    def __init__(self) -> None:
        self.acc: dict[str, list[Any]] = {}  # feature -> [count, sum, sum of squares, min, max, image?]

    def add(self, batch: dict[str, np.ndarray], images: set[str]) -> None:
        """Counts the rows of ``batch`` (feature -> rows)."""
        for name, values in batch.items():
            x = values.reshape(-1, 3) / 255.0 if name in images else values.reshape(len(values), -1).astype(np.float64)
            found = [len(x), x.sum(0), (x * x).sum(0), x.min(0), x.max(0), name in images]
            if name not in self.acc:
                self.acc[name] = found
                continue
            acc = self.acc[name]
            acc[:5] = [acc[0] + found[0], acc[1] + found[1], acc[2] + found[2],
                       np.minimum(acc[3], found[3]), np.maximum(acc[4], found[4])]

    def summary(self) -> dict[str, dict[str, list]]:
        """``stats.json``: per feature, ``mean``, ``std``, ``min``, ``max`` and ``count`` lists."""
        out = {}
        for name, (count, total, squares, low, high, image) in self.acc.items():
            mean = total / count
            std = np.sqrt(np.maximum(squares / count - mean * mean, 0))

            def shaped(v: np.ndarray, image: bool = image) -> list:
                return v.reshape(3, 1, 1).tolist() if image else v.tolist()
            out[name] = {"mean": shaped(mean), "std": shaped(std), "min": shaped(low), "max": shaped(high),
                         "count": [int(count)]}
        return out


def tasks_table(tasks: dict[str, int]) -> Any:
    """``meta/tasks.parquet``: ``task_index`` and ``task``, marked (pandas metadata) so that
    ``pandas.read_parquet`` gives ``task`` as the index, as LeRobot reads it."""
    pa = require_arrow()
    names = sorted(tasks, key=tasks.__getitem__)
    pandas = {"index_columns": ["task"], "column_indexes": [],
              "columns": [{"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                           "numpy_type": "int64", "metadata": None},
                          {"name": "task", "field_name": "task", "pandas_type": "unicode",
                           "numpy_type": "object", "metadata": None}],
              "creator": {"library": "diskreplay"}, "pandas_version": "2.0.0"}
    schema = pa.schema([pa.field("task_index", pa.int64()), pa.field("task", pa.string())],
                       metadata={"pandas": json.dumps(pandas)})
    return pa.table({"task_index": [tasks[n] for n in names], "task": names}, schema=schema)
