"""The metadata of a LeRobot v3 dataset (``codebase_version`` ``"v3.0"``), read and checked.

Layout (LeRobot's ``LeRobotDatasetMetadata``)::

    meta/info.json                         codebase_version, fps, features, data_path, video_path, ...
    meta/tasks.parquet                     task_index (int) and task (str, the pandas index)
    meta/episodes/chunk-000/file-000.parquet   one row per episode (see `Episode`)
    data/chunk-000/file-000.parquet        the frames of many episodes, in episode order
    videos/<key>/chunk-000/file-000.mp4    the frames of many episodes of one camera key

``data_path`` and ``video_path`` are format templates (``{chunk_index}``, ``{file_index}``,
``{video_key}``); the paths they give must stay inside the dataset folder. A frame of an episode
with timestamp ``t`` is the video frame at ``videos/<key>/from_timestamp + t`` of the episode's
video file.
"""

from __future__ import annotations

import math
import os
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..source import ImportFormatError, json_file
from .parquet import require_pyarrow

INFO_PATH = os.path.join("meta", "info.json")
TASKS_PATH = os.path.join("meta", "tasks.parquet")
EPISODES_DIR = os.path.join("meta", "episodes")
CODEBASE_VERSION = "v3.0"
TEMPLATE_KEYS = {"data_path": {"chunk_index", "file_index"},
                 "video_path": {"chunk_index", "file_index", "video_key"}}
EPISODE_COLUMNS = ("episode_index", "length", "data/chunk_index", "data/file_index",
                   "dataset_from_index", "dataset_to_index")
VIDEO_COLUMNS = ("chunk_index", "file_index", "from_timestamp", "to_timestamp")


@dataclass
class VideoSpan:
    """Where an episode's frames of one camera key are: a video file and its start time there."""

    path: str
    from_timestamp: float
    to_timestamp: float


@dataclass
class Episode:
    """One row of ``meta/episodes``: the episode's frames are rows ``[start, stop)`` of the dataset,
    held by one data file, and one video span per camera key."""

    index: int
    length: int
    data_file: str
    start: int
    stop: int
    tasks: list[str]
    videos: dict[str, VideoSpan] = field(default_factory=dict)


def is_lerobot(path: str) -> bool:
    """``path`` is a folder with a ``meta/info.json`` whose ``codebase_version`` is v3."""
    info = os.path.join(path, INFO_PATH)
    if not os.path.isdir(path) or not os.path.isfile(info):
        return False
    try:
        version = json_file(info).get("codebase_version")
    except ImportFormatError:
        return False
    return isinstance(version, str) and version.startswith("v3")


class LeRobotMeta:
    """``meta/info.json``, ``meta/tasks.parquet`` and ``meta/episodes`` of a LeRobot v3 dataset.

    Attributes: ``root``; ``info`` (the JSON object); ``fps``; ``features`` (name -> feature
    dict); ``video_keys`` (features of dtype ``"video"``, in ``info`` order); ``tasks``
    (task_index -> task); ``episodes`` (in episode_index order, checked to cover rows 0..total
    in order). Raises ImportFormatError naming the file and the entry for anything missing or
    of the wrong type.
    """

    def __init__(self, root: str):
        self.pq = require_pyarrow()
        self.root = root
        self.info_file = os.path.join(root, INFO_PATH)
        self.info = json_file(self.info_file)
        version = self.info.get("codebase_version")
        if not isinstance(version, str) or not version.startswith("v3"):
            raise ImportFormatError(f"{self.info_file!r}: codebase_version is {version!r}, expected "
                                    f"{CODEBASE_VERSION!r} (LeRobot v2 datasets import with format 'parquet')")
        self.fps = self._fps()
        self.features = self._features()
        self.video_keys = [k for k, ft in self.features.items() if ft["dtype"] == "video"]
        self.data_path = self._template("data_path")
        self.video_path = self._template("video_path") if self.video_keys else ""
        self.tasks = self._tasks()
        self.episodes = self._episodes()

    def _fps(self) -> float:
        fps = self.info.get("fps")
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
            raise ImportFormatError(f"{self.info_file!r}: fps is {fps!r}, expected a number > 0")
        return float(fps)

    def _features(self) -> dict[str, dict]:
        features = self.info.get("features")
        if not isinstance(features, dict) or not features:
            raise ImportFormatError(f"{self.info_file!r}: features is {type(features).__name__}, expected "
                                    f"an object of feature name -> {{dtype, shape}}")
        for name, ft in features.items():
            shape = ft.get("shape") if isinstance(ft, dict) else None
            if not isinstance(ft, dict) or not isinstance(ft.get("dtype"), str) or not isinstance(shape, list) \
                    or not all(type(n) is int and n >= 0 for n in shape):
                raise ImportFormatError(f"{self.info_file!r}: feature {name!r} is {ft!r}, expected "
                                        f"{{'dtype': str, 'shape': [ints >= 0], ...}}")
        return features

    def _template(self, key: str) -> str:
        """The path template ``key`` of info.json, checked to name only its known fields."""
        template = self.info.get(key)
        names: set[str | None] | None = None
        if isinstance(template, str):
            try:
                names = {f for _, f, _, _ in string.Formatter().parse(template)} - {None}
            except ValueError:
                pass
        if not isinstance(template, str) or names is None or not names <= TEMPLATE_KEYS[key] \
                or "{chunk_index" not in template:
            raise ImportFormatError(f"{self.info_file!r}: {key} is {template!r}, expected a path template "
                                    f"with fields {sorted(TEMPLATE_KEYS[key])}")
        return template

    def inside(self, relative: str, what: str) -> str:
        """``root/relative``, refused (ImportFormatError) when it would lead outside the dataset folder."""
        parts = Path(relative).parts
        if Path(relative).is_absolute() or ".." in parts or not parts:
            raise ImportFormatError(f"{self.info_file!r}: {what} {relative!r} leads outside the dataset folder")
        return os.path.join(self.root, relative)

    def _table(self, path: str, columns: list[str] | None = None) -> Any:
        try:
            return self.pq.read_table(path, columns=columns)
        except FileNotFoundError:
            raise ImportFormatError(f"{path!r}: missing (named by the dataset's metadata)") from None
        except Exception as e:  # ArrowInvalid, KeyError for a missing column, OSError
            raise ImportFormatError(f"{path!r}: not a readable Parquet file with columns {columns} ({e})") from e

    def _tasks(self) -> dict[int, str]:
        path = os.path.join(self.root, TASKS_PATH)
        table = self._table(path)
        if "task_index" not in table.column_names or "task" not in table.column_names:
            raise ImportFormatError(f"{path!r}: columns {table.column_names}, expected 'task_index' and 'task'")
        indices, names = table.column("task_index").to_pylist(), table.column("task").to_pylist()
        if not all(type(i) is int for i in indices) or not all(isinstance(n, str) for n in names):
            raise ImportFormatError(f"{path!r}: 'task_index' must hold ints and 'task' strings")
        return dict(zip(indices, names, strict=True))

    def _episodes(self) -> list[Episode]:
        folder = os.path.join(self.root, EPISODES_DIR)
        files = sorted(str(p) for p in Path(folder).glob("*/*.parquet")) if os.path.isdir(folder) else []
        if not files:
            raise ImportFormatError(f"{folder!r}: no chunk-*/file-*.parquet episode files")
        episodes = [ep for file in files for ep in self._episode_rows(file)]
        episodes.sort(key=lambda ep: ep.index)
        at = 0
        for ep in episodes:
            if ep.start != at or ep.stop != at + ep.length or ep.length < 1:
                raise ImportFormatError(f"{folder!r}: episode {ep.index} holds rows [{ep.start}, {ep.stop}) "
                                        f"of length {ep.length}, expected rows from {at} on, one per frame")
            at = ep.stop
        return episodes

    def _episode_rows(self, file: str) -> list[Episode]:
        videos = [f"videos/{key}/{c}" for key in self.video_keys for c in VIDEO_COLUMNS]
        table = self._table(file, [*EPISODE_COLUMNS, "tasks", *videos])
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
        for name in (*EPISODE_COLUMNS, *videos):
            want = float if name.endswith("timestamp") else int
            if not all(type(v) is want or want is float and type(v) is int for v in columns[name]):
                raise ImportFormatError(f"{file!r}: column {name!r} must hold {want.__name__}s without nulls")
        if not all(isinstance(t, list) and all(isinstance(s, str) for s in t) for t in columns["tasks"]):
            raise ImportFormatError(f"{file!r}: column 'tasks' must hold lists of strings")
        return [self._episode(file, {k: v[i] for k, v in columns.items()}) for i in range(table.num_rows)]

    def _episode(self, file: str, row: dict[str, Any]) -> Episode:
        data = self.data_path.format(chunk_index=row["data/chunk_index"], file_index=row["data/file_index"])
        ep = Episode(row["episode_index"], row["length"], self.inside(data, "data_path"),
                     row["dataset_from_index"], row["dataset_to_index"], row["tasks"])
        for key in self.video_keys:
            def col(c: str, key: str = key) -> Any:
                return row[f"videos/{key}/{c}"]
            path = self.video_path.format(video_key=key, chunk_index=col("chunk_index"), file_index=col("file_index"))
            ep.videos[key] = VideoSpan(self.inside(path, "video_path"), float(col("from_timestamp")),
                                       float(col("to_timestamp")))
        return ep

    def data_files(self) -> list[tuple[str, list[Episode]]]:
        """The data files in the order their episodes come, each with its episodes (in order).
        Raises ImportFormatError when a file's episodes are not consecutive."""
        files: list[tuple[str, list[Episode]]] = []
        for ep in self.episodes:
            if files and files[-1][0] == ep.data_file:
                files[-1][1].append(ep)
            elif any(f == ep.data_file for f, _ in files):
                raise ImportFormatError(f"{ep.data_file!r}: holds episodes that are not consecutive "
                                        f"(episode {ep.index} comes after another file's)")
            else:
                files.append((ep.data_file, [ep]))
        return files

    def task_names(self, indices: np.ndarray, file: str) -> list[str]:
        """The task of each ``task_index`` in ``indices``; ImportFormatError for one tasks.parquet lacks."""
        missing = set(np.unique(indices).tolist()) - set(self.tasks)
        if missing:
            raise ImportFormatError(f"{file!r}: task_index {sorted(missing)[:5]} not in "
                                    f"{os.path.join(self.root, TASKS_PATH)!r}")
        return [self.tasks[i] for i in indices.tolist()]
