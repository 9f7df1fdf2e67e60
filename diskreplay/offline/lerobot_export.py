"""Export a buffer as a LeRobot v3 dataset folder, which ``import --format lerobot`` (and LeRobot's
``LeRobotDataset``) reads back.

Episodes are the buffer's (an episode ends after a row whose end flag is set, and at each lane's
end), lane after lane, numbered from 0. Files: ``data/chunk-000/file-000.parquet`` and on (a new
file, at an episode start, once a file holds `DATA_FILE_BYTES` of rows), one MP4 per camera key
beside each data file (``videos/<key>/chunk-000/file-000.mp4``, the same episodes),
``meta/episodes/chunk-000/file-000.parquet`` (each episode's rows and video times),
``meta/tasks.parquet``, ``meta/info.json`` and ``meta/stats.json`` (mean, std, min, max, count
of each feature; per channel, in [0, 1], for camera keys).

Fields: ``uint8 [height, width, 3]`` fields are camera keys, encoded as AV1 (LeRobot's default
settings: yuv420p, keyframe every 2 frames, crf 30; H.264 where PyAV has no AV1 encoder), so
their frames come back as the codec decodes them, not bit-exact. Other fields are feature
columns named as the ``"parquet"`` export names them (`parquet_name`: ``obs`` ->
``observation.state``, ``reward`` -> ``next.reward``, ``terminated`` -> ``next.done``, ...;
``observation_images_<k>`` -> ``observation.images.<k>``). ``timestamp`` is ``frame_index /
fps``; a ``timestamp`` field only gives the default fps. ``task_index`` is the ``task_index``
field when the buffer has one (tasks named ``"task <i>"``), else 0 (task ``""``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from ..audit.rows import iter_rows, readable
from .formats.lerobot_meta import CODEBASE_VERSION
from .formats.parquet import require_arrow, require_pyarrow
from .lerobot_files import EpisodeFiles, Stats, tasks_table
from .parquet_export import _rows, check_parquet_names, parquet_name

DATA_FILE_BYTES = 100 << 20
"""Rows a data file holds before the next episode starts a new file (LeRobot's ``data_files_size_in_mb``)."""
DEFAULT_FPS = 30
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
CHUNKS_SIZE = 1000
PLACE = ("episode_index", "frame_index", "index")


def is_camera(spec: Any) -> bool:
    """Whether a field is exported as a camera key (a video): ``uint8 [height, width, 3]``."""
    return bool(spec.dtype == np.uint8 and len(spec.shape) == 3 and spec.shape[2] == 3
                and (spec.codec is not None or not spec.ragged))


def lerobot_name(field: str, spec: Any) -> str:
    """The feature a field is exported as (the inverse of the LeRobot import's names)."""
    if field.startswith("observation_images_") and is_camera(spec):
        return "observation.images." + field[len("observation_images_"):]
    return parquet_name(field)


def default_fps(buf: Any) -> float:
    """The frame rate the buffer's ``timestamp`` field shows (from its first two rows), else `DEFAULT_FPS`."""
    if "timestamp" not in buf.fields or len(buf) < 2:
        return DEFAULT_FPS
    lane, lo, hi = readable(buf)[0]
    first = next(iter_rows(buf, ["timestamp"], lane, lo, min(hi, lo + 2), 2))["timestamp"]
    step = float(first[1] - first[0]) if len(first) == 2 else 0.0
    if not step > 0:
        return DEFAULT_FPS
    fps = 1 / step
    return float(round(fps)) if abs(fps - round(fps)) < 1e-3 else fps


def write_lerobot(buf: Any, path: str, batch_rows: int, compress: bool, bar: Any, fps: float | None = None) -> None:
    """Writes every readable row of ``buf`` into the new folder ``path`` (see the module docstring)."""
    fps = default_fps(buf) if fps is None else float(fps)
    if not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps must be a number > 0, got {fps!r}")
    names = _names(buf.fields)
    task_text = "task" in buf.fields and buf.fields["task"].text  # no column: its strings give task_index
    cameras = {names[f]: s.shape for f, s in buf.fields.items() if is_camera(s)}
    columns = {c: buf.fields[f] for f, c in names.items() if c not in cameras and not (task_text and f == "task")}
    os.makedirs(path)
    files = EpisodeFiles(path, fps, _schema(columns), cameras, compress)
    stats = Stats()
    try:
        for part in _rows(buf, batch_rows):
            features = _features_of(part, names, fps, files.task_names, task_text)
            for segment in _episode_segments(features):
                if segment["frame_index"][0] == 0 and files.bytes >= DATA_FILE_BYTES:
                    files.roll()
                files.write(segment)
            stats.add({k: v for k, v in features.items() if k not in columns or not columns[k].text}, set(cameras))
            bar.update(len(part["index"]))
    finally:
        files.close()
    _write_meta(path, fps, columns, cameras, files, stats)


def _names(fields: dict) -> dict[str, str]:
    """``{field: feature}`` of every field but ``timestamp``. Raises ValueError for a field LeRobot
    cannot hold (variable-length) or one that would be read back as another."""
    names = {f: lerobot_name(f, s) for f, s in fields.items() if f != "timestamp"}
    for field, spec in fields.items():
        if spec.ragged and not spec.text and spec.codec is None:
            raise ValueError(f"field {field!r} cannot be exported to LeRobot: its rows vary in length "
                             f"(shape {spec.declared_shape}); LeRobot features have fixed shapes")
    check_parquet_names([f for f, c in names.items() if c == parquet_name(f)])
    return names


def _features_of(part: dict[str, Any], names: dict[str, str], fps: float, tasks: dict[str, int],
                 task_text: bool) -> dict[str, Any]:
    """The rows of ``part`` keyed by feature, with ``timestamp`` and ``task_index``: indices of
    the ``task`` text field's strings (registered in ``tasks`` as they first come), else of the
    ``task_index`` field (tasks named ``"task <i>"``), else 0 (task ``""``)."""
    features = {names.get(k, k): v for k, v in part.items() if k != "timestamp"}
    features["timestamp"] = (part["frame_index"] / fps).astype(np.float32)
    if task_text:
        texts = features.pop("task")
        features["task_index"] = np.array([tasks.setdefault(t, len(tasks)) for t in texts.tolist()], np.int64)
        return features
    if "task_index" not in features:
        features["task_index"] = np.zeros(len(part["index"]), np.int64)
    for i in np.unique(features["task_index"]).tolist():
        tasks.setdefault(f"task {i}" if "task_index" in names else "", i)
    return features


def _schema(columns: dict[str, Any]) -> Any:
    """The data files' arrow schema: the feature columns, then LeRobot's default features."""
    pa = require_arrow()
    out = []
    for column, spec in columns.items():
        typ = pa.string() if spec.text else pa.from_numpy_dtype(spec.dtype)
        for size in reversed(spec.shape):
            typ = pa.list_(typ, size)
        out.append(pa.field(column, typ))
    out.append(pa.field("timestamp", pa.float32()))
    out += [pa.field(name, pa.int64()) for name in (*PLACE, "task_index") if name not in columns]
    return pa.schema(out)


def _episode_segments(part: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """``part`` cut where an episode starts (frame_index 0), so each piece holds one episode's rows."""
    starts = np.flatnonzero(part["frame_index"] == 0)
    cuts = [0, *starts[starts > 0].tolist(), len(part["frame_index"])]
    return [{k: v[a:b] for k, v in part.items()} for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def _features(columns: dict[str, Any], cameras: dict[str, tuple[int, ...]], fps: float, codec: str) -> dict:
    features: dict[str, dict] = {}
    for column, spec in columns.items():
        dtype = "string" if spec.text else spec.dtype.name
        features[column] = {"dtype": dtype, "shape": list(spec.shape) or [1], "names": None}
    for key, (h, w, c) in cameras.items():
        features[key] = {"dtype": "video", "shape": [h, w, c], "names": ["height", "width", "channels"],
                         "info": {"video.height": h, "video.width": w, "video.codec": codec,
                                  "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                                  "video.fps": fps, "video.channels": c, "has_audio": False}}
    features["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    for name in (*PLACE, "task_index"):
        features.setdefault(name, {"dtype": "int64", "shape": [1], "names": None})
    return features


def _write_meta(path: str, fps: float, columns: dict[str, Any], cameras: dict[str, tuple[int, ...]],
                files: EpisodeFiles, stats: Stats) -> None:
    """meta/episodes, meta/tasks.parquet, meta/info.json and meta/stats.json."""
    pq = require_pyarrow()
    tasks = files.task_names
    episodes = os.path.join(path, "meta", "episodes", "chunk-000")
    os.makedirs(episodes)
    pq.write_table(files.episode_table(), os.path.join(episodes, "file-000.parquet"))
    pq.write_table(tasks_table(tasks), os.path.join(path, "meta", "tasks.parquet"))
    info = {"codebase_version": CODEBASE_VERSION, "robot_type": None, "total_episodes": files.episodes,
            "total_frames": files.frames, "total_tasks": len(tasks), "chunks_size": CHUNKS_SIZE,
            "data_files_size_in_mb": DATA_FILE_BYTES >> 20, "video_files_size_in_mb": 500, "fps": fps,
            "splits": {"train": f"0:{files.episodes}"}, "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if cameras else None,
            "features": _features(columns, cameras, fps, files.codec_name)}
    with open(os.path.join(path, "meta", "info.json"), "w") as f:
        json.dump(info, f, indent=4)
    with open(os.path.join(path, "meta", "stats.json"), "w") as f:
        json.dump(stats.summary(), f, indent=4)
