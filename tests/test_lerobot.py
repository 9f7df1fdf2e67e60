"""LeRobot v3 import and export: a dataset built here in LeRobot's own layout (pyarrow + PyAV, as
``LeRobotDatasetMetadata`` / ``DatasetWriter`` write it: many episodes per data file and per
video file, ``meta/episodes`` offsets), imported with every value, frame and episode boundary
checked; export -> import round trips."""

from __future__ import annotations

import io
import json
import os
import re
import warnings
from fractions import Fraction

import numpy as np
import pytest

import diskreplay as dr
from diskreplay.offline import ImportFormatError, detect_format, export_buffer, import_dataset

pa = pytest.importorskip("pyarrow", reason="LeRobot import/export needs pyarrow")
pq = pytest.importorskip("pyarrow.parquet", reason="LeRobot import/export needs pyarrow")
av = pytest.importorskip("av", reason="LeRobot video needs PyAV")

FPS = 10
LENGTHS = (5, 8, 3, 6)
DATA_FILES = (0, 0, 1, 1)  # data file of each episode
TASKS = ("pick up the red cube", "place it in the bowl")
EPISODE_TASK = (0, 1, 0, 1)
CAMERAS = {  # key: (height, width, codec, video file of each episode)
    "observation.images.top": (48, 64, "libsvtav1", (0, 0, 0, 1)),
    "observation.images.wrist": (32, 48, "libx264", (0, 0, 1, 1)),
}
CODEC_NAMES = {"libsvtav1": "av1", "libx264": "h264"}
CHUNK_FILE = "chunk-{chunk_index:03d}/file-{file_index:03d}"


def source_columns(seed=0) -> dict[str, np.ndarray]:
    """The data columns of every frame, episode after episode (``next.done`` ends episode 0 only)."""
    rng = np.random.default_rng(seed)
    n = sum(LENGTHS)
    frame = np.concatenate([np.arange(k) for k in LENGTHS])
    done = np.zeros(n, bool)
    done[LENGTHS[0] - 1] = True
    return {"observation.state": rng.normal(size=(n, 4)).astype(np.float32),
            "action": rng.normal(size=(n, 2)).astype(np.float32),
            "next.reward": rng.normal(size=n).astype(np.float32),
            "next.done": done,
            "timestamp": (frame / FPS).astype(np.float32),
            "frame_index": frame.astype(np.int64),
            "episode_index": np.repeat(np.arange(len(LENGTHS)), LENGTHS).astype(np.int64),
            "index": np.arange(n, dtype=np.int64),
            "task_index": np.repeat(EPISODE_TASK, LENGTHS).astype(np.int64)}


def camera_frames(height, width, seed) -> np.ndarray:
    """Every frame of one camera: a moving square on a gradient, so that frames differ."""
    n = sum(LENGTHS)
    rng = np.random.default_rng(seed)
    base = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * np.ones((height, 1, 3), np.float32)
    frames = np.repeat(base[None], n, 0).astype(np.uint8)
    for i in range(n):
        y, x = (3 * i) % (height - 8), (5 * i) % (width - 8)
        frames[i, y:y + 8, x:x + 8] = rng.integers(0, 256, 3)
    return frames


def write_video(path, frames_by_episode, fps, codec, gop=2):
    """One MP4 holding several episodes back to back (as LeRobot concatenates them), each
    starting with a keyframe; LeRobot's encoder settings (yuv420p, g=2, crf=30)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps, options={"g": str(gop), "crf": "30"})
        stream.height, stream.width = frames_by_episode[0].shape[1:3]
        stream.pix_fmt = "yuv420p"
        pts = 0
        for frames in frames_by_episode:
            for i, image in enumerate(frames):
                frame = av.VideoFrame.from_ndarray(image, format="rgb24")
                frame.pts, frame.time_base = pts, Fraction(1, fps)
                if i == 0:
                    frame.pict_type = av.video.frame.PictureType.I
                out.mux(stream.encode(frame))
                pts += 1
        out.mux(stream.encode())


def column(values: np.ndarray):
    if values.ndim == 2:  # HF datasets' Sequence(length=n): a fixed-size list
        return pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), values.shape[1])
    return pa.array(values)


def features() -> dict:
    found = {"observation.state": {"dtype": "float32", "shape": [4], "names": [f"joint_{i}" for i in range(4)]},
             "action": {"dtype": "float32", "shape": [2], "names": ["x", "y"]},
             "next.reward": {"dtype": "float32", "shape": [1], "names": None},
             "next.done": {"dtype": "bool", "shape": [1], "names": None}}
    for key, (h, w, codec, _) in CAMERAS.items():
        found[key] = {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                      "info": {"video.height": h, "video.width": w, "video.codec": CODEC_NAMES.get(codec, codec),
                               "video.pix_fmt": "yuv420p", "video.is_depth_map": False, "video.fps": FPS,
                               "video.channels": 3, "has_audio": False}}
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        found[name] = {"dtype": "float32" if name == "timestamp" else "int64", "shape": [1], "names": None}
    return found


def write_lerobot_v3(root, gop=2) -> dict:
    """A LeRobot v3.0 dataset at ``root``: 4 episodes in 2 data files, 2 camera keys (AV1 and
    H.264, a keyframe every ``gop`` frames) whose episodes lie in their own video files, 2 episode
    metadata files. Returns the columns, the frames of each camera, and what PyAV decodes from
    each video file."""
    cols = source_columns()
    starts = np.cumsum((0, *LENGTHS))
    for f in sorted(set(DATA_FILES)):
        rows = np.isin(cols["episode_index"], [e for e, d in enumerate(DATA_FILES) if d == f])
        path = root / "data" / f"{CHUNK_FILE.format(chunk_index=0, file_index=f)}.parquet"
        os.makedirs(path.parent, exist_ok=True)
        pq.write_table(pa.table({k: column(v[rows]) for k, v in cols.items()}), path, row_group_size=4)
    pixels, decoded, episodes = {}, {}, {}
    for c, (key, (h, w, codec, files)) in enumerate(CAMERAS.items()):
        pixels[key] = camera_frames(h, w, seed=c)
        for f in sorted(set(files)):
            eps = [e for e, v in enumerate(files) if v == f]
            path = root / "videos" / key / f"{CHUNK_FILE.format(chunk_index=0, file_index=f)}.mp4"
            write_video(path, [pixels[key][starts[e]:starts[e + 1]] for e in eps], FPS, codec, gop)
            with av.open(str(path)) as container:
                decoded[key, f] = [fr.to_ndarray(format="rgb24") for fr in container.decode(video=0)]
            at = 0.0
            for e in eps:
                episodes.setdefault(e, {}).update({
                    f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": f,
                    f"videos/{key}/from_timestamp": at, f"videos/{key}/to_timestamp": at + LENGTHS[e] / FPS})
                at += LENGTHS[e] / FPS
    _write_meta(root, cols, starts, episodes)
    return {"cols": cols, "pixels": pixels, "decoded": decoded}


def _write_meta(root, cols, starts, videos):
    import pandas as pd

    rows = []
    for e, length in enumerate(LENGTHS):
        rows.append({"episode_index": e, "tasks": [TASKS[EPISODE_TASK[e]]], "length": length,
                     "data/chunk_index": 0, "data/file_index": DATA_FILES[e],
                     "dataset_from_index": int(starts[e]), "dataset_to_index": int(starts[e + 1]),
                     **videos[e], "stats/action/mean": [0.0, 0.0],
                     "meta/episodes/chunk_index": 0, "meta/episodes/file_index": e // 2})
    for f in (0, 1):
        path = root / "meta" / "episodes" / f"{CHUNK_FILE.format(chunk_index=0, file_index=f)}.parquet"
        os.makedirs(path.parent, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows[2 * f:2 * f + 2]), path)
    pd.DataFrame({"task_index": range(len(TASKS))}, index=pd.Index(TASKS, name="task")).to_parquet(
        root / "meta" / "tasks.parquet")
    info = {"codebase_version": "v3.0", "robot_type": "so100", "total_episodes": len(LENGTHS),
            "total_frames": int(starts[-1]), "total_tasks": len(TASKS), "chunks_size": 1000,
            "data_files_size_in_mb": 100, "video_files_size_in_mb": 500, "fps": FPS,
            "splits": {"train": f"0:{len(LENGTHS)}"},
            "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
            "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4",
            "features": features()}
    (root / "meta" / "info.json").write_text(json.dumps(info, indent=4))
    stats = {k: {"mean": v.mean(0).tolist(), "std": v.std(0).tolist(), "min": v.min(0).tolist(),
                 "max": v.max(0).tolist(), "count": [len(v)]} for k, v in cols.items() if k != "next.done"}
    (root / "meta" / "stats.json").write_text(json.dumps(stats, indent=4))


def expected_frames(built, key) -> np.ndarray:
    """What PyAV decodes from the source files for each row: the episode's frames in its video
    file, counted from the episodes before it there."""
    files = CAMERAS[key][3]
    out = []
    for e, length in enumerate(LENGTHS):
        before = sum(LENGTHS[p] for p in range(e) if files[p] == files[e])
        out.extend(built["decoded"][key, files[e]][before:before + length])
    return np.stack(out)


def rows_of(buf):
    return buf[buf.row_ids()]


VIDEO_FIELDS = {"observation_images_top": dr.Field((48, 64, 3), "uint8", codec="av1"),
                "observation_images_wrist": dr.Field((32, 48, 3), "uint8", codec="h264")}


def check_values_and_episodes(buf, cols):
    rows = rows_of(buf)
    assert len(buf) == sum(LENGTHS)
    for field, name in (("obs", "observation.state"), ("action", "action"), ("reward", "next.reward"),
                        ("terminated", "next.done"), ("timestamp", "timestamp")):
        np.testing.assert_array_equal(rows[field], cols[name], err_msg=field)
    assert list(rows["task"]) == [TASKS[i] for i in cols["task_index"]]
    last = np.cumsum(LENGTHS) - 1
    truncated = np.zeros(sum(LENGTHS), bool)
    truncated[last[1:]] = True  # episode 0 ends with next.done
    np.testing.assert_array_equal(rows["truncated"], truncated)
    table = buf.episodes()
    assert table.start.tolist() == [0, *np.cumsum(LENGTHS)[:-1].tolist()]
    assert table.length.tolist() == list(LENGTHS) and table.complete.all()
    return rows


def test_lerobot_v3_imports_every_value_frame_and_episode(tmp_path):
    built = write_lerobot_v3(tmp_path / "ds", gop=1)  # every frame a keyframe: every chunk fits
    assert detect_format(str(tmp_path / "ds")) == "lerobot"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no chunk re-encoded
        buf = import_dataset(tmp_path / "ds", tmp_path / "b", batch_rows=3, chunk_rows=4, progress=False)
    assert dict(buf.fields) == {
        "obs": dr.Field((4,), "float32"), "action": dr.Field((2,), "float32"),
        "reward": dr.Field((), "float32"), "terminated": dr.Field((), "bool"), **VIDEO_FIELDS,
        "timestamp": dr.Field((), "float32"), "task": dr.Field((), "str"), "truncated": dr.Field((), "bool")}
    rows = check_values_and_episodes(buf, built["cols"])
    for key in CAMERAS:
        field = key.replace(".", "_")
        np.testing.assert_array_equal(rows[field], expected_frames(built, key), err_msg=field)
        assert np.abs(rows[field].astype(int) - built["pixels"][key]).mean() < 8  # the lossy codecs kept the images
    reopened = dr.ReplayBuffer.open(tmp_path / "b")
    ids = np.array([21, 0, 9, 13])
    for key in CAMERAS:
        field = key.replace(".", "_")
        np.testing.assert_array_equal(reopened[ids][field], expected_frames(built, key)[ids])


def row_keyframes(root, key) -> np.ndarray:
    """Whether each row's frame is a keyframe of its MP4 (packets in display order)."""
    files, out = CAMERAS[key][3], []
    for f in sorted(set(files)):
        with av.open(str(root / "videos" / key / "chunk-000" / f"file-{f:03d}.mp4")) as container:
            packets = sorted((p for p in container.demux(video=0) if p.size), key=lambda p: p.pts)
            out.extend(p.is_keyframe for p in packets)
    return np.array(out)  # the files hold the episodes in row order


def test_chunks_the_mp4_groups_of_pictures_do_not_fit_are_re_encoded_and_said_so(tmp_path):
    built = write_lerobot_v3(tmp_path / "ds")  # LeRobot's g=2: episodes 1 and 2 start on odd rows
    with pytest.warns(UserWarning) as caught:
        buf = import_dataset(tmp_path / "ds", tmp_path / "b", chunk_rows=4, progress=False)
    messages = sorted(str(w.message) for w in caught)
    rows = check_values_and_episodes(buf, built["cols"])
    starts = np.arange(0, sum(LENGTHS), 4)
    for key, message in zip(CAMERAS, messages, strict=True):
        field = key.replace(".", "_")
        fits = row_keyframes(tmp_path / "ds", key)[starts]  # chunks that start on a keyframe keep the MP4's packets
        codec = CODEC_NAMES[CAMERAS[key][2]]
        assert f"video key {key!r}: {int((~fits).sum())} of 6 row chunks re-encoded as {codec}" in message
        kept = np.concatenate([np.arange(s, min(s + 4, sum(LENGTHS))) for s in starts[fits]])
        redone = np.setdiff1d(np.arange(sum(LENGTHS)), kept)
        assert len(kept) and len(redone)
        np.testing.assert_array_equal(rows[field][kept], expected_frames(built, key)[kept], err_msg=field)
        assert psnr(rows[field][redone], expected_frames(built, key)[redone]) > 30, field


def decode_all(path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b) ** 2)
    return float(10 * np.log10(255**2 / max(mse, 1e-12)))


def test_export_import_round_trip(tmp_path, monkeypatch):
    from diskreplay.offline import lerobot_export

    write_lerobot_v3(tmp_path / "ds", gop=1)
    buf = import_dataset(tmp_path / "ds", tmp_path / "b", chunk_rows=4, progress=False)
    monkeypatch.setattr(lerobot_export, "DATA_FILE_BYTES", 1)  # each episode starts new files
    assert export_buffer(tmp_path / "b", tmp_path / "out", format="lerobot", batch_rows=4, progress=False) == 22
    out = tmp_path / "out"
    info = json.loads((out / "meta" / "info.json").read_text())
    assert (info["codebase_version"], info["fps"], info["total_episodes"], info["total_frames"]) == ("v3.0", 10, 4, 22)
    assert info["features"]["observation.images.top"]["dtype"] == "video"
    assert info["features"]["observation.state"] == {"dtype": "float32", "shape": [4], "names": None}
    assert sorted(p.name for p in (out / "data" / "chunk-000").iterdir()) == [f"file-{i:03d}.parquet" for i in range(4)]
    episodes = pq.read_table(out / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pylist()
    assert [(e["dataset_from_index"], e["dataset_to_index"], e["data/file_index"]) for e in episodes] == \
        [(0, 5, 0), (5, 13, 1), (13, 16, 2), (16, 22, 3)]
    assert [e["videos/observation.images.top/to_timestamp"] for e in episodes] == [n / FPS for n in LENGTHS]
    stats = json.loads((out / "meta" / "stats.json").read_text())
    assert stats["action"]["count"] == [22] and np.array(stats["observation.images.top"]["mean"]).shape == (3, 1, 1)
    with pytest.warns(UserWarning, match="re-encoded as av1"):  # exported with g=2: episodes 1 and 2 start on odd rows
        back = import_dataset(out, tmp_path / "back", batch_rows=5, chunk_rows=2, progress=False)
    assert dict(back.fields) == {**buf.fields, "observation_images_wrist": dr.Field((32, 48, 3), "uint8", codec="av1")}
    a, b = rows_of(buf), rows_of(back)
    for name in a:
        if name.startswith("observation_images_"):
            key = name.replace("observation_images_", "observation.images.")
            exported = np.concatenate([decode_all(out / "videos" / key / "chunk-000" / f"file-{e:03d}.mp4")
                                       for e in range(4)])
            kept = np.r_[0:4, 16:22]  # chunks starting on a keyframe of an episode: stored as exported
            np.testing.assert_array_equal(b[name][kept], exported[kept], err_msg=name)
            assert psnr(b[name], a[name]) > 30, name
        else:
            np.testing.assert_array_equal(b[name], a[name], err_msg=name)
    assert back.episodes().length.tolist() == list(LENGTHS)


def test_tasks_table_reads_in_pandas_as_lerobot_does(tmp_path):
    pd = pytest.importorskip("pandas")
    write_lerobot_v3(tmp_path / "ds")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one chunk of 22 rows: each file's run starts on a keyframe, fits
        buf = import_dataset(tmp_path / "ds", tmp_path / "b", progress=False)
    assert buf.layout.chunk_rows == 32  # as ReplayBuffer.create picks for video fields: a chunk is a GOP
    buf.close()
    export_buffer(tmp_path / "b", tmp_path / "out", format="lerobot", progress=False)
    tasks = pd.read_parquet(tmp_path / "out" / "meta" / "tasks.parquet")
    assert tasks.index.name == "task" and tasks["task_index"].tolist() == [0, 1]
    assert tasks.index.tolist() == list(TASKS)
    episodes = pq.read_table(tmp_path / "out" / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert episodes["tasks"].to_pylist() == [[TASKS[t]] for t in EPISODE_TASK]


def test_two_lane_buffer_exports_its_episodes_at_the_fps_given(tmp_path):
    fields = {"obs": dr.Field((3,), "float32"), "terminated": dr.Field((), "bool"),
              "observation_images_cam": dr.Field((16, 16, 3), "uint8")}
    buf = dr.ReplayBuffer.create(tmp_path / "b", fields, num_envs=2, chunk_rows=4)
    rng = np.random.default_rng(1)
    for lane, n in ((0, 7), (1, 5)):
        terminated = np.zeros(n, bool)
        terminated[2] = True
        buf.extend({"obs": rng.normal(size=(n, 1, 3)).astype(np.float32), "terminated": terminated[:, None],
                    "observation_images_cam": np.full((n, 1, 16, 16, 3), 40 * lane, np.uint8)}, env_ids=[lane])
    buf.flush()
    assert export_buffer(tmp_path / "b", tmp_path / "out", format="lerobot", fps=15, progress=False) == 12
    info = json.loads((tmp_path / "out" / "meta" / "info.json").read_text())
    assert info["fps"] == 15 and info["total_episodes"] == 4
    back = import_dataset(tmp_path / "out", tmp_path / "back", progress=False)
    rows = rows_of(back)
    assert back.episodes().length.tolist() == [3, 4, 3, 2]
    np.testing.assert_array_equal(rows["obs"], rows_of(buf)["obs"])
    np.testing.assert_allclose(rows["timestamp"], np.r_[0:3, 0:4, 0:3, 0:2] / 15, rtol=1e-6)
    assert np.abs(rows["observation_images_cam"].astype(int) - rows_of(buf)["observation_images_cam"]).max() <= 2


def _edit_info(root, **changes):
    info = json.loads((root / "meta" / "info.json").read_text())
    info.update(changes)
    (root / "meta" / "info.json").write_text(json.dumps(info))


def _edit_episodes(root, file, column, values):
    path = root / "meta" / "episodes" / "chunk-000" / f"file-{file:03d}.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index(column), column, pa.array(values)), path)


def _edit_data(root, file, column, values):
    path = root / "data" / "chunk-000" / f"file-{file:03d}.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.column_names.index(column), column, pa.array(values)), path)


TOP = ("videos", "observation.images.top", "chunk-000")
DAMAGE = {
    "data path outside": (
        lambda r: _edit_info(r, data_path="../elsewhere/chunk-{chunk_index:03d}/f{file_index}.parquet"),
        r"info\.json'?: data_path '\.\./elsewhere/chunk-000/f0\.parquet' leads outside the dataset"),
    "template field": (
        lambda r: _edit_info(r, video_path="videos/{video_key.__class__}/{chunk_index}/{file_index}.mp4"),
        r"info\.json'?: video_path .* expected a path template with fields "
        r"\['chunk_index', 'file_index', 'video_key'\]"),
    "version": (lambda r: _edit_info(r, codebase_version="v2.1"),
                r"codebase_version is 'v2\.1', expected 'v3\.0' \(LeRobot v2 datasets import with format 'parquet'\)"),
    "fps": (lambda r: _edit_info(r, fps=0), r"info\.json'?: fps is 0, expected a number > 0"),
    "offsets": (lambda r: _edit_episodes(r, 1, "dataset_from_index", [14, 16]),
                r"episode 2 holds rows \[14, 16\) of length 3, expected rows from 13 on"),
    "rows of another episode": (
        lambda r: _edit_data(r, 1, "episode_index", [2, 2, 3, 3, 3, 3, 3, 3, 3]),
        r"file-001\.parquet'?: row 2 belongs to episode 3, meta/episodes places episode 2 there"),
    "no frame there": (
        lambda r: _edit_episodes(r, 0, "videos/observation.images.top/from_timestamp", [0.0, 0.55]),
        r"file-000\.mp4'?: video key 'observation\.images\.top': no frame at 0\.550000 s "
        r"\(the next frame is at 0\.600000 s\)"),
    "missing video": (lambda r: os.remove(r / "videos" / "observation.images.wrist" / "chunk-000" / "file-001.mp4"),
                      r"file-001\.mp4'?: missing \(named by the dataset's metadata\)"),
    "damaged video": (lambda r: r.joinpath(*TOP, "file-001.mp4").write_bytes(b"\0\0\0\x18ftypisom" + bytes(64)),
                      r"file-001\.mp4'?: video key 'observation\.images\.top': not a readable video"),
    "unknown task": (lambda r: _edit_data(r, 0, "task_index", [0] * 5 + [7] * 8),
                     r"file-000\.parquet'?: task_index \[7\] not in .*tasks\.parquet'"),
    "null string": (lambda r: _add_string_feature(r, [None] + ["x"] * 12),
                    r"file-000\.parquet'?: column 'language\.instruction' must hold strings without nulls"),
}


def _add_string_feature(root, first_file_values):
    """A ``string`` feature (a language annotation per frame) in info.json and the data files."""
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["language.instruction"] = {"dtype": "string", "shape": [1], "names": None}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    for f, values in ((0, first_file_values), (1, [f"say {i}" for i in range(9)])):
        path = root / "data" / "chunk-000" / f"file-{f:03d}.parquet"
        pq.write_table(pq.read_table(path).append_column("language.instruction", pa.array(values, pa.string())), path)


def test_string_features_import_as_text_fields_and_export_back(tmp_path):
    write_lerobot_v3(tmp_path / "ds")
    texts = [f"step {i} ünïcode" for i in range(13)]
    _add_string_feature(tmp_path / "ds", texts)
    buf = import_dataset(tmp_path / "ds", tmp_path / "b", progress=False)
    assert buf.fields["language_instruction"] == dr.Field((), "str")
    assert list(rows_of(buf)["language_instruction"]) == texts + [f"say {i}" for i in range(9)]
    export_buffer(tmp_path / "b", tmp_path / "out", format="lerobot", progress=False)
    info = json.loads((tmp_path / "out" / "meta" / "info.json").read_text())
    assert info["features"]["language_instruction"] == {"dtype": "string", "shape": [1], "names": None}
    back = import_dataset(tmp_path / "out", tmp_path / "back", progress=False)
    assert list(rows_of(back)["language_instruction"]) == list(rows_of(buf)["language_instruction"])


def test_variable_length_fields_are_refused_by_the_lerobot_export(tmp_path):
    buf = dr.ReplayBuffer.create(tmp_path / "b", {"tokens": dr.Field((None,), "int32"), "x": dr.Field((), "float32")})
    buf.extend({"tokens": [np.arange(3, dtype=np.int32), np.arange(1, dtype=np.int32)], "x": np.zeros(2, np.float32)})
    buf.close()
    with pytest.raises(ValueError, match=r"field 'tokens' cannot be exported to LeRobot: its rows vary in length"):
        export_buffer(tmp_path / "b", tmp_path / "out", format="lerobot", progress=False)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.partial")


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_lerobot_datasets_are_refused_and_leave_no_buffer(tmp_path, damage):
    write_lerobot_v3(tmp_path / "ds")
    edit, message = DAMAGE[damage]
    edit(tmp_path / "ds")
    with pytest.raises(ImportFormatError, match=message):
        import_dataset(tmp_path / "ds", tmp_path / "b", format="lerobot", progress=False)
    assert not os.path.exists(tmp_path / "b") and not os.path.exists(tmp_path / "b.import-partial")


def test_encoded_frames_are_stored_as_given_and_checked(tmp_path):
    from diskreplay.errors import SchemaError
    from diskreplay.format.frame_codecs import FrameCodec
    from diskreplay.format.ragged import EncodedFrames

    codec = FrameCodec("av1", (16, 16, 3))
    frames = np.random.default_rng(0).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    values, ends = codec.encode_rows(frames[:4])
    fields = {"cam": dr.Field((16, 16, 3), "uint8", codec="av1"), "x": dr.Field((), "int64")}
    buf = dr.ReplayBuffer.create(tmp_path / "b", fields, chunk_rows=4)
    with pytest.raises(SchemaError, match=r"field 'cam': encoded frames must be uint8 values split by lengths > 0"):
        buf.extend({"cam": EncodedFrames(values, np.diff(np.r_[0, ends])[:3]), "x": np.arange(4)})
    buf.extend({"cam": EncodedFrames(values, np.diff(np.r_[0, ends])), "x": np.arange(4)})
    buf.extend({"cam": frames[4:], "x": np.arange(2)})  # the next chunk: encoded by the buffer
    buf.close()
    back = dr.ReplayBuffer.open(tmp_path / "b")
    np.testing.assert_array_equal(back[np.arange(4)]["cam"], codec.decode_rows(values, ends))
    assert len(back) == 6


def test_image_features_import_as_png_fields_that_keep_the_files(tmp_path):
    from PIL import Image

    write_lerobot_v3(tmp_path / "ds", gop=1)
    root = tmp_path / "ds"
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.images.side"] = {"dtype": "image", "shape": [24, 32, 3],
                                                   "names": ["height", "width", "channels"]}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    pixels = np.random.default_rng(5).integers(0, 256, (sum(LENGTHS), 24, 32, 3), dtype=np.uint8)
    pngs = []
    for image in pixels:
        out = io.BytesIO()
        Image.fromarray(image).save(out, "PNG")
        pngs.append(out.getvalue())
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # Hugging Face's Image feature
    for f, rows in ((0, slice(0, 13)), (1, slice(13, 22))):
        path = root / "data" / "chunk-000" / f"file-{f:03d}.parquet"
        column = pa.array([{"bytes": b, "path": None} for b in pngs[rows]], struct)
        pq.write_table(pq.read_table(path).append_column("observation.images.side", column), path)
    buf = import_dataset(root, tmp_path / "b", chunk_rows=4, progress=False)
    assert buf.fields["observation_images_side"] == dr.Field((24, 32, 3), "uint8", codec="png")
    np.testing.assert_array_equal(rows_of(buf)["observation_images_side"], pixels)


def test_a_video_codec_no_frame_field_has_is_imported_as_av1(tmp_path, monkeypatch):
    monkeypatch.setitem(CAMERAS, "observation.images.wrist", (32, 48, "mpeg4", (0, 0, 1, 1)))
    built = write_lerobot_v3(tmp_path / "ds")
    message = r"video key 'observation\.images\.wrist': 1 of 1 row chunks re-encoded as av1"
    with pytest.warns(UserWarning, match=message):
        buf = import_dataset(tmp_path / "ds", tmp_path / "b", progress=False)
    assert buf.fields["observation_images_wrist"] == dr.Field((32, 48, 3), "uint8", codec="av1")
    assert psnr(rows_of(buf)["observation_images_wrist"], expected_frames(built, "observation.images.wrist")) > 30
