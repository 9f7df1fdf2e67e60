"""Importers (D4RL, Minari, npz, npy, zarr), export round trips, bounded memory, interrupted imports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile

import numpy as np
import pytest
from conftest import dir_snapshot

import diskreplay as dr
import diskreplay.offline.export as export_module
from diskreplay import offline as importers
from diskreplay.audit import INCOMPLETE_KEY, import_status
from diskreplay.errors import BufferExistsError, LockedError, NotABufferError
from diskreplay.offline import ImportFormatError, detect_format, export_buffer, import_dataset, importing

h5py = pytest.importorskip("h5py")


def rows_of(buf: dr.ReplayBuffer) -> dict[str, np.ndarray]:
    return buf[buf.row_ids()]


def write_d4rl(path, n=103, seed=0, next_obs=False, float_flags=False):
    rng = np.random.default_rng(seed)
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    terminals[[9, 40, 41]] = True  # episodes ending at batch boundaries too (batch_rows=10 below)
    timeouts[[19, 70]] = True
    data = {
        "observations": rng.normal(size=(n, 3)).astype(np.float32),
        "actions": rng.normal(size=(n, 2)).astype(np.float32),
        "rewards": rng.normal(size=n).astype(np.float32),
        "terminals": terminals.astype(np.float32) if float_flags else terminals,
        "timeouts": timeouts,
    }
    with h5py.File(path, "w") as f:
        for key, value in data.items():
            f[key] = value
        if next_obs:
            data["next_observations"] = rng.normal(size=(n, 3)).astype(np.float32)
            f["next_observations"] = data["next_observations"]
        f["infos/qpos"] = data["qpos"] = rng.normal(size=(n, 4))
        f["infos/goal/xy"] = data["goal_xy"] = rng.integers(0, 9, size=(n, 2)).astype(np.int32)
        f["metadata/algorithm"] = "SAC"  # not per-step: skipped with a warning
    return data


@pytest.mark.filterwarnings("ignore:.*skipped")
@pytest.mark.parametrize("float_flags", [False, True])
def test_d4rl_derives_next_obs_within_episodes(tmp_path, float_flags):
    data = write_d4rl(tmp_path / "d.hdf5", float_flags=float_flags)
    assert detect_format(str(tmp_path / "d.hdf5")) == "d4rl"
    buf = import_dataset(tmp_path / "d.hdf5", tmp_path / "b", batch_rows=10, chunk_rows=16, progress=False)
    assert set(buf.fields) == {"obs", "action", "reward", "terminated", "truncated", "next_obs",
                               "info_qpos", "info_goal_xy"}
    assert buf.fields["terminated"].dtype == np.bool_ and buf.fields["info_qpos"].dtype == np.float64
    r = rows_of(buf)
    obs = data["observations"]
    np.testing.assert_array_equal(r["obs"], obs)
    np.testing.assert_array_equal(r["action"], data["actions"])
    np.testing.assert_array_equal(r["terminated"], data["terminals"] != 0)
    np.testing.assert_array_equal(r["truncated"], data["timeouts"])
    np.testing.assert_array_equal(r["info_goal_xy"], data["goal_xy"])
    ends = (data["terminals"] != 0) | data["timeouts"]
    ends[-1] = True
    for t in range(len(obs)):  # inside an episode: the next row; at its end (or the last row): itself
        np.testing.assert_array_equal(r["next_obs"][t], obs[t] if ends[t] else obs[t + 1])
    assert not buf.storage.store.exists(INCOMPLETE_KEY)


@pytest.mark.filterwarnings("ignore:.*skipped")
def test_d4rl_keeps_given_next_observations(tmp_path):
    data = write_d4rl(tmp_path / "d.hdf5", next_obs=True)
    buf = import_dataset(tmp_path / "d.hdf5", tmp_path / "b", batch_rows=32, progress=False)
    np.testing.assert_array_equal(rows_of(buf)["next_obs"], data["next_observations"])


D4RL_FIELDS = {"obs", "action", "reward", "terminated", "truncated", "next_obs", "info_qpos", "info_goal_xy"}


@pytest.mark.filterwarnings("ignore:.*skipped")
def test_d4rl_npz_is_named_like_d4rl_hdf5(tmp_path):
    data = write_d4rl(tmp_path / "d.hdf5", float_flags=True)
    columns = {k: v for k, v in data.items() if k not in ("qpos", "goal_xy")}
    np.savez(tmp_path / "d.npz", **columns, **{"infos/qpos": data["qpos"], "infos/goal/xy": data["goal_xy"]})
    hdf5 = rows_of(import_dataset(tmp_path / "d.hdf5", tmp_path / "from-hdf5", batch_rows=10, progress=False))
    as_d4rl = import_dataset(tmp_path / "d.npz", tmp_path / "from-d4rl-npz", format="d4rl", batch_rows=10,
                             progress=False)
    assert set(as_d4rl.fields) == D4RL_FIELDS and as_d4rl.fields["terminated"].dtype == np.bool_
    for k, v in rows_of(as_d4rl).items():
        np.testing.assert_array_equal(v, hdf5[k], err_msg=k)
    as_npz = import_dataset(tmp_path / "d.npz", tmp_path / "from-npz", batch_rows=10, progress=False)
    assert detect_format(str(tmp_path / "d.npz")) == "npz"
    assert set(as_npz.fields) == D4RL_FIELDS - {"next_obs"}  # format "npz" derives nothing
    for k, v in rows_of(as_npz).items():
        np.testing.assert_array_equal(v, hdf5[k], err_msg=k)


def test_column_names_colliding_after_the_d4rl_mapping_are_refused(tmp_path):
    np.savez(tmp_path / "both.npz", obs=np.zeros(4), observations=np.ones(4))
    with pytest.raises(ImportFormatError, match="arrays 'obs' and 'observations' both map to field 'obs'"):
        import_dataset(tmp_path / "both.npz", tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_format_that_does_not_fit_the_file_is_one_clear_error(tmp_path):
    np.savez(tmp_path / "d.npz", observations=np.zeros((4, 2)))
    write_d4rl(tmp_path / "d.hdf5")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ImportFormatError, match=r"'.*notes\.txt' is not an HDF5 file \(.*\); expected a "
                                                r"D4RL-layout \.hdf5/\.h5 or \.npz file"):
        import_dataset(tmp_path / "notes.txt", tmp_path / "x", format="d4rl", progress=False)
    with pytest.raises(ImportFormatError, match=r"'.*d\.hdf5' is not an \.npz file \(not a zip archive\)"):
        import_dataset(tmp_path / "d.hdf5", tmp_path / "x", format="npz", progress=False)
    with pytest.raises(ImportFormatError, match=r"'.*d\.npz' is not an HDF5 file .*expected a Minari dataset"):
        import_dataset(tmp_path / "d.npz", tmp_path / "x", format="minari", progress=False)
    with pytest.raises(FileNotFoundError, match=r"source '.*missing\.npz' does not exist"):
        import_dataset(tmp_path / "missing.npz", tmp_path / "x", format="d4rl", progress=False)
    assert not (tmp_path / "x").exists()


def write_minari(root, lengths=(5, 12, 3), seed=0):
    """Minari hdf5 layout: episode_<id> groups, observations T+1, nested dict observations."""
    rng = np.random.default_rng(seed)
    os.makedirs(root / "data")
    episodes = {}
    with h5py.File(root / "data" / "main_data.hdf5", "w") as f:
        for ep_id, T in zip((0, 10, 2), lengths):  # ids out of order: imported as 0, 2, 10
            g = f.create_group(f"episode_{ep_id}")
            ep = {
                "pos": rng.normal(size=(T + 1, 2)).astype(np.float32),
                "img": rng.integers(0, 255, size=(T + 1, 3, 3), dtype=np.uint8),
                "vel": rng.normal(size=(T + 1,)),
                "actions": rng.normal(size=(T, 2)).astype(np.float32),
                "rewards": rng.normal(size=T),
                "terminations": np.arange(T) == T - 1 if ep_id != 2 else np.zeros(T, bool),
                "truncations": np.zeros(T, bool) if ep_id != 2 else np.arange(T) == T - 1,
                "success": rng.random(T + 1) < 0.5,  # T + 1 infos: the reset's first
                "cost": rng.normal(size=T),          # T infos
            }
            g["observations/pos"] = ep["pos"]
            g["observations/cam/img"] = ep["img"]
            g["observations/vel"] = ep["vel"]
            for key in ("actions", "rewards", "terminations", "truncations"):
                g[key] = ep[key]
            g["infos/success"] = ep["success"]
            g["infos/cost"] = ep["cost"]
            episodes[ep_id] = ep
    return [episodes[i] for i in (0, 2, 10)]


def test_minari_maps_observations_exactly(tmp_path):
    episodes = write_minari(tmp_path / "ds")
    assert detect_format(str(tmp_path / "ds")) == "minari"
    buf = import_dataset(tmp_path / "ds", tmp_path / "b", batch_rows=4, chunk_rows=8, progress=False)
    assert set(buf.fields) == {"obs_pos", "obs_cam_img", "obs_vel", "next_obs_pos", "next_obs_cam_img",
                               "next_obs_vel", "action", "reward", "terminated", "truncated",
                               "info_success", "info_cost"}
    r = rows_of(buf)
    cat = lambda key, sl: np.concatenate([ep[key][sl] for ep in episodes])  # noqa: E731
    for key in ("pos", "img", "vel"):
        np.testing.assert_array_equal(r[f"obs_{key}" if key != "img" else "obs_cam_img"], cat(key, slice(None, -1)))
        np.testing.assert_array_equal(r[f"next_obs_{key}" if key != "img" else "next_obs_cam_img"],
                                      cat(key, slice(1, None)))
    np.testing.assert_array_equal(r["action"], cat("actions", slice(None)))
    np.testing.assert_array_equal(r["reward"], cat("rewards", slice(None)))
    np.testing.assert_array_equal(r["terminated"], cat("terminations", slice(None)))
    np.testing.assert_array_equal(r["truncated"], cat("truncations", slice(None)))
    np.testing.assert_array_equal(r["info_success"], cat("success", slice(1, None)))
    np.testing.assert_array_equal(r["info_cost"], cat("cost", slice(None)))
    assert len(buf) == 5 + 3 + 12


def test_npz_and_npy_folder(tmp_path):
    rng = np.random.default_rng(1)
    arrays = {"obs": rng.normal(size=(50, 4)).astype(np.float32), "action": rng.integers(0, 3, 50),
              "done": rng.random(50) < 0.1, "img": np.asfortranarray(rng.integers(0, 9, (50, 2, 3)).astype(np.uint8))}
    np.savez(tmp_path / "plain.npz", **arrays)
    np.savez_compressed(tmp_path / "packed.npz", **arrays)
    os.makedirs(tmp_path / "npy")
    for k, v in arrays.items():
        np.save(tmp_path / "npy" / f"{k}.npy", v)
    for src, fmt in (("plain.npz", "npz"), ("packed.npz", "npz"), ("npy", "npy")):
        assert detect_format(str(tmp_path / src)) == fmt
        with pytest.warns(UserWarning, match="Fortran") if fmt == "npz" else _nothing():
            buf = import_dataset(tmp_path / src, tmp_path / f"b-{src}", batch_rows=7, progress=False)
        r = rows_of(buf)
        assert set(r) == set(arrays)
        for k, v in arrays.items():
            np.testing.assert_array_equal(r[k], v)
            assert r[k].dtype == v.dtype


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_sources(tmp_path):
    np.savez(tmp_path / "ragged.npz", a=np.zeros(3), b=np.zeros(4))
    with pytest.raises(ImportFormatError, match="leading"):
        import_dataset(tmp_path / "ragged.npz", tmp_path / "x", progress=False)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        import_dataset(tmp_path / "missing.hdf5", tmp_path / "x", progress=False)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ImportFormatError, match="cannot tell"):
        import_dataset(tmp_path / "notes.txt", tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_rechunk_buffer_keeps_lanes_and_window(tmp_path):
    fields = {"obs": dr.Field((3,), "float32"), "done": dr.Field((), "bool")}
    src = dr.ReplayBuffer.create(tmp_path / "src", fields, capacity=40, num_envs=2, chunk_rows=8, compression=None,
                                 cache_bytes=2**16)
    rng = np.random.default_rng(2)
    src.extend({"obs": rng.normal(size=(33, 2, 3)), "done": rng.random((33, 2)) < 0.2})
    src.close()
    src = dr.ReplayBuffer.open(tmp_path / "src", cache_bytes=2**16)
    buf = import_dataset(tmp_path / "src", tmp_path / "dst", chunk_rows=5, compression="lz4", batch_rows=6,
                         progress=False, cache_bytes=2**16)
    assert detect_format(str(tmp_path / "src")) == "zarr"
    assert buf.num_envs == 2 and len(buf) == len(src) == 40 and buf.capacity is None
    assert buf.storage.config.chunk_rows == 5 and buf.storage.config.compression == "lz4"
    lo, hi = src.window()
    for lane in range(2):
        old = src[np.arange(lo[lane], hi[lane]) * 2 + lane]
        new = buf[np.arange(0, hi[lane] - lo[lane]) * 2 + lane]
        for k in fields:
            np.testing.assert_array_equal(old[k], new[k])


def test_plain_zarr_group(tmp_path):
    import zarr

    g = zarr.open_group(str(tmp_path / "g"), mode="w")
    g.create_array("obs", shape=(30, 2), chunks=(7, 2), dtype="float32")[:] = np.arange(60).reshape(30, 2)
    g.create_array("reward", shape=(30,), chunks=(7,), dtype="float64")[:] = np.arange(30)
    buf = import_dataset(tmp_path / "g", tmp_path / "b", format="zarr", batch_rows=8, progress=False)
    np.testing.assert_array_equal(rows_of(buf)["obs"], np.arange(60).reshape(30, 2))


@pytest.mark.filterwarnings("ignore:.*skipped")
@pytest.mark.parametrize("fmt", ["hdf5", "npz"])
def test_export_import_round_trip(tmp_path, fmt):
    write_d4rl(tmp_path / "d.hdf5")
    buf = import_dataset(tmp_path / "d.hdf5", tmp_path / "b", progress=False)
    out = tmp_path / f"out.{fmt}"
    assert export_buffer(tmp_path / "b", out, progress=False, batch_rows=9) == len(buf)
    with pytest.raises(FileExistsError):
        export_buffer(tmp_path / "b", out, progress=False)
    for i, import_format in enumerate((None, "d4rl")):  # as detected, and as D4RL: nothing derived either way
        back = import_dataset(out, tmp_path / f"back{i}", format=import_format, progress=False)
        a, b = rows_of(buf), rows_of(back)
        assert set(buf.fields) == set(back.fields) == D4RL_FIELDS
        for k in a:
            assert a[k].dtype == b[k].dtype, k
            np.testing.assert_array_equal(a[k], b[k])


def test_npz_and_hdf5_exports_hold_the_same_d4rl_arrays(tmp_path):
    fields = {"obs": dr.Field((2,), "float32"), "terminated": dr.Field((), "bool"),
              "truncated": dr.Field((), "bool"), "info_cost": dr.Field((), "float64"), "extra": dr.Field((), "int8")}
    buf = dr.ReplayBuffer.create(tmp_path / "b", fields, num_envs=2, chunk_rows=4, cache_bytes=2**12)
    terminated = np.zeros((6, 2), bool)
    terminated[5, 1] = True  # lane 1 ends an episode at its last row: no timeout added there
    buf.extend({"obs": np.arange(24).reshape(6, 2, 2), "terminated": terminated, "truncated": np.zeros((6, 2), bool),
                "info_cost": np.ones((6, 2)), "extra": np.full((6, 2), 3)})
    buf.close()
    export_buffer(tmp_path / "b", tmp_path / "o.npz", progress=False, batch_rows=4)
    export_buffer(tmp_path / "b", tmp_path / "o.h5", progress=False, batch_rows=4)
    expected = {"observations", "terminals", "timeouts", "infos/cost", "extra"}
    with np.load(tmp_path / "o.npz") as npz, h5py.File(tmp_path / "o.h5") as f:
        hdf5 = {}
        f.visititems(lambda name, obj: hdf5.update({name: obj[:]}) if isinstance(obj, h5py.Dataset) else None)
        assert set(npz.files) == set(hdf5) == expected
        for name in expected:
            np.testing.assert_array_equal(npz[name], hdf5[name], err_msg=name)
        assert np.flatnonzero(npz["timeouts"]).tolist() == [5]
        assert np.flatnonzero(npz["terminals"]).tolist() == [11]
        np.testing.assert_array_equal(npz["observations"][:6], np.arange(24).reshape(6, 2, 2)[:, 0])
    assert zipfile.ZipFile(tmp_path / "o.npz").comment == b"diskreplay_export"


class RecordingBar:
    """Stands in for the tqdm bar: its total and the sum of its updates."""

    def __init__(self, total, desc):
        self.total, self.desc, self.n = total, desc, 0

    def update(self, n):
        assert n >= 0
        self.n += n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.filterwarnings("ignore:.*skipped")
def test_progress_counts_rows(tmp_path, monkeypatch):
    bars = []

    def recording(total, desc, enabled):
        bars.append(RecordingBar(total, desc))
        return bars[-1]

    monkeypatch.setattr(importing, "progress_bar", recording)
    monkeypatch.setattr(export_module, "progress_bar", recording)
    write_d4rl(tmp_path / "d.hdf5")
    import_dataset(tmp_path / "d.hdf5", tmp_path / "b", batch_rows=10).close()
    for fmt in ("npz", "hdf5"):
        export_buffer(tmp_path / "b", tmp_path / f"o.{fmt}", batch_rows=7)
        import_dataset(tmp_path / f"o.{fmt}", tmp_path / f"back-{fmt}", batch_rows=10).close()
    assert [(bar.desc, bar.total, bar.n) for bar in bars] == [
        ("import d4rl", 103, 103), ("export npz", 103, 103), ("import npz", 103, 103),
        ("export hdf5", 103, 103), ("import d4rl", 103, 103)]


def test_export_round_trips_buffers_without_next_obs(tmp_path):
    buf = dr.ReplayBuffer.create(tmp_path / "b", {"obs": dr.Field((2,), "float32"), "done": dr.Field((), "bool")})
    buf.extend({"obs": np.arange(20).reshape(10, 2), "done": np.arange(10) % 4 == 3})
    buf.close()
    export_buffer(tmp_path / "b", tmp_path / "o.h5", progress=False)
    back = import_dataset(tmp_path / "o.h5", tmp_path / "back", progress=False)
    assert set(back.fields) == {"obs", "done"}
    np.testing.assert_array_equal(rows_of(back)["obs"], np.arange(20).reshape(10, 2))


def derive_next_buffer(url) -> tuple[dr.ReplayBuffer, dict[str, np.ndarray]]:
    """A ring of 16 rows (22 added) whose ``next_obs`` is derived, and the rows that ``buf[ids]``
    reads from it: episodes end at steps 4, 5, 11 and 17 (their finals kept apart), steps 18..21
    are an unfinished episode (the newest ``next_obs`` kept in RAM, saved with the commit)."""
    fields = {"obs": dr.Field((2,), "float32"), "next_obs": dr.Field((2,), "float32"),
              "action": dr.Field((2,), "float32"), "reward": dr.Field((), "float32"),
              "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.create(url, fields, 16, chunk_rows=4, derive_next=("obs",))
    steps = np.arange(22)
    obs = np.stack([steps, -steps], 1).astype(np.float32)
    next_obs = np.append(obs[1:], [[99, 99]], 0).astype(np.float32)
    terminated, truncated = np.isin(steps, (4, 17)), np.isin(steps, (5, 11))
    next_obs[terminated | truncated] = 1000 + steps[terminated | truncated, None]  # each episode's final
    buf.extend({"obs": obs, "next_obs": next_obs, "action": obs / 2, "reward": steps.astype(np.float32),
                "terminated": terminated, "truncated": truncated})
    rows = rows_of(buf)
    np.testing.assert_array_equal(rows["next_obs"], next_obs[6:])
    buf.close()
    return buf, rows


@pytest.mark.parametrize("fmt", ["npz", "hdf5", "parquet", "minari"])
def test_export_writes_the_derived_next_obs_exactly(tmp_path, fmt):
    _, rows = derive_next_buffer(tmp_path / "b")
    out = tmp_path / ("out-v0" if fmt == "minari" else f"out.{fmt}")
    assert export_buffer(tmp_path / "b", out, format=fmt, progress=False, batch_rows=3) == 16
    back = rows_of(import_dataset(out, tmp_path / "back", progress=False))
    if fmt in ("parquet", "minari"):  # the unfinished last episode comes back truncated
        rows["truncated"][-1] = True
    assert set(back) == set(rows)
    for name, values in rows.items():
        assert back[name].dtype == values.dtype, name
        np.testing.assert_array_equal(back[name], values, err_msg=name)


def test_export_marks_lane_ends_for_d4rl(tmp_path):
    fields = {"obs": dr.Field((1,), "float32"), "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.create(tmp_path / "b", fields, num_envs=2, chunk_rows=4, cache_bytes=2**12)
    buf.extend({"obs": np.zeros((6, 2, 1)), "terminated": np.zeros((6, 2), bool), "truncated": np.zeros((6, 2), bool)})
    buf.close()
    export_buffer(tmp_path / "b", tmp_path / "o.h5", progress=False)
    with h5py.File(tmp_path / "o.h5") as f:
        assert np.flatnonzero(f["timeouts"][:]).tolist() == [5, 11]
        assert f["observations"].shape == (12, 1)


def test_import_memory_is_bounded(tmp_path):
    rows, width = 60_000, 64  # 15 MB of float32 source
    np.save(tmp_path / "obs.npy", np.random.default_rng(0).random((rows, width), dtype=np.float32))
    np.save(tmp_path / "reward.npy", np.ones(rows, np.float32))
    os.makedirs(tmp_path / "npy")
    os.replace(tmp_path / "obs.npy", tmp_path / "npy" / "obs.npy")
    os.replace(tmp_path / "reward.npy", tmp_path / "npy" / "reward.npy")
    with zipfile.ZipFile(tmp_path / "src.npz", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(tmp_path / "npy" / "obs.npy", "obs.npy")
        zf.write(tmp_path / "npy" / "reward.npy", "reward.npy")
    source_bytes = rows * (width + 1) * 4
    for src in ("npy", "src.npz"):
        tracemalloc.start()
        try:
            buf = import_dataset(tmp_path / src, tmp_path / f"b-{src}", batch_rows=2048, chunk_rows=1024,
                                 compression=None, progress=False, cache_bytes=2**20)
            buf.close()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(dr.ReplayBuffer.open(tmp_path / f"b-{src}")) == rows
        assert peak < source_bytes / 3, f"{src}: peak {peak / 1e6:.1f} MB for a {source_bytes / 1e6:.1f} MB source"


def test_failing_source_leaves_no_buffer(tmp_path, monkeypatch):
    write_d4rl(tmp_path / "d.hdf5")
    original = importers.D4RLSource.batches

    def failing(self):
        for i, item in enumerate(original(self)):
            if i == 3:
                raise OSError("disk went away")
            yield item

    monkeypatch.setattr(importers.D4RLSource, "batches", failing)
    with pytest.warns(UserWarning), pytest.raises(OSError, match="disk went away"):
        import_dataset(tmp_path / "d.hdf5", tmp_path / "b", batch_rows=10, progress=False)
    with pytest.raises(NotABufferError):
        dr.ReplayBuffer.open(tmp_path / "b")
    monkeypatch.undo()
    with pytest.warns(UserWarning):
        assert len(import_dataset(tmp_path / "d.hdf5", tmp_path / "b", progress=False)) == 103


KILLED_IMPORT = textwrap.dedent("""
    import gc, sys, time
    import diskreplay as dr
    from diskreplay import offline as importers
    original = importers.NpyFolderSource.batches
    def slow(self):
        for i, item in enumerate(original(self)):
            if i == 3:  # the chunk writes behind the appends done: the files stay as they are now
                for buf in (o for o in gc.get_objects() if isinstance(o, dr.ReplayBuffer)):
                    buf.storage.writer.wait()
                print("started", flush=True)
                time.sleep(60)
            yield item
    importers.NpyFolderSource.batches = slow
    importers.import_dataset(sys.argv[1], sys.argv[2], batch_rows=100, chunk_rows=64, progress=False,
                             overwrite=sys.argv[3] == "overwrite")
""")


@pytest.mark.parametrize("overwrite", [True, False])
def test_killed_import_leaves_dest_as_it_was(tmp_path, overwrite):
    """An import killed hard wrote only next to dest: dest is as it was (the old buffer, byte for
    byte, or nothing); what it wrote is marked and never opens; the next import replaces it."""
    os.makedirs(tmp_path / "npy")
    np.save(tmp_path / "npy" / "obs.npy", np.arange(2000, dtype=np.float32).reshape(1000, 2))
    dest, partial = tmp_path / "b", tmp_path / "b.import-partial"
    if overwrite:
        dr.ReplayBuffer.create(dest, {"x": dr.Field((), "int8")}).close()
    before = dir_snapshot(str(dest))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_IMPORT, str(tmp_path / "npy"), str(dest),
                             "overwrite" if overwrite else "new"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "started"
        assert any((partial / "obs").glob("c.0.*"))  # rows were written next to dest
        written = dir_snapshot(str(partial))
        with pytest.raises(LockedError):  # a second import into dest while this one runs
            import_dataset(tmp_path / "npy", dest, overwrite=True, progress=False)
        assert dir_snapshot(str(partial)) == written
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert dir_snapshot(str(dest)) == before and dest.exists() == overwrite
    with pytest.raises(NotABufferError):
        dr.ReplayBuffer.open(partial)
    marker = import_status(str(partial))
    assert marker is not None and marker["source"] == str(tmp_path / "npy")
    if overwrite:
        assert dr.ReplayBuffer.open(dest).fields == {"x": dr.Field((), "int8")}
        with pytest.raises(BufferExistsError, match="already exists"):
            import_dataset(tmp_path / "npy", dest, progress=False)
    buf = import_dataset(tmp_path / "npy", dest, overwrite=overwrite, progress=False)
    assert len(buf) == 1000 and import_status(str(dest)) is None
    np.testing.assert_array_equal(rows_of(buf)["obs"], np.arange(2000).reshape(1000, 2))
    assert sorted(os.listdir(tmp_path)) == ["b", "npy"]


def write_frames_npz(path, rows: int, shape: tuple[int, ...], dtype: str) -> None:
    """An .npz of ``observations`` (row i filled with i % 251) and ``rewards``, written a row at a
    time (the test never holds the frames)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        with zf.open("observations.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(member, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                          "shape": (rows, *shape)})
            for i in range(rows):
                member.write(np.full(shape, i % 251, dtype).tobytes())
        with zf.open("rewards.npy", "w") as member:
            np.save(member, np.arange(rows, dtype=np.float32))


@pytest.mark.parametrize("rows, shape, dtype", [(1024, (256, 256, 4), "uint8"), (600, (100_000,), "uint8"),
                                                (64, (1024, 1024), "float32")])
def test_large_rows_import_with_memory_bounded_by_bytes(tmp_path, rows, shape, dtype):
    """Slices and write staging are sized by bytes, not by batch_rows (65,536 rows of 256 KiB frames
    would be 16 GiB): 256 MiB of frames import within a fraction of their size."""
    write_frames_npz(tmp_path / "frames.npz", rows, shape, dtype)
    tracemalloc.start()
    try:
        import_dataset(tmp_path / "frames.npz", tmp_path / "b", progress=False, cache_bytes=2**20).close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 160 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    buf = dr.ReplayBuffer.open(tmp_path / "b", cache_bytes=2**20)
    assert len(buf) == rows and buf.fields["obs"] == dr.Field(shape, dtype)
    picked = np.array([0, 1, rows // 2, rows - 1])
    got = buf[picked]
    np.testing.assert_array_equal(got["obs"], np.stack([np.full(shape, i % 251, dtype) for i in picked]))
    np.testing.assert_array_equal(got["reward"], picked.astype(np.float32))
    assert sorted(os.listdir(tmp_path)) == ["b", "frames.npz"]
