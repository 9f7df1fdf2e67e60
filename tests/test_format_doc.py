"""`docs/format.md` is enough to read a buffer: `FormatReader` is written from that page alone,
with plain zarr-python and json, and must read exactly the rows `ReplayBuffer` returns for every
valid row id (a wrapped, cleared, compressed multi-lane ring with sharded image chunks; datasets;
a sharded buffer). Also: xarray opens new buffers (their arrays carry ``dimension_names``),
buffers without ``dimension_names`` still open, and listing a buffer with zarr-python or xarray
warns of none of diskreplay's own objects.
"""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from format_v1 import downgrade

import diskreplay as dr
from diskreplay.audit import verify


@pytest.fixture
def xr() -> Any:
    """xarray (a test dependency; the tests that need it are skipped without it)."""
    return pytest.importorskip("xarray")


# ---- the reader: docs/format.md, sections 1-5 and 9 ------------------------------------------

class FormatReader:
    """One buffer (not a sharded root) read as docs/format.md says: the config from the group's
    attributes, the valid steps from ``commit.json``, the rows from the arrays at their slots."""

    def __init__(self, path: Path):
        self.path = path
        self.group = zarr.open_group(str(path), mode="r")
        self.config: dict[str, Any] = self.group.attrs["diskreplay"]
        own = {"diskreplay/2": path / "diskreplay" / "objects", "diskreplay/1": path}[self.config["format"]]
        self.commit: dict[str, Any] = json.loads((own / "commit.json").read_text())

    def valid_steps(self, lane: int) -> np.ndarray:
        """Section 5: steps ``[max(lower, committed - lane_capacity), committed)`` (dataset: ``[lower, ...)``)."""
        committed, lower = self.commit["committed"][lane], self.commit["lower"][lane]
        capacity = self.config["lane_capacity"]
        first = lower if capacity is None else max(lower, committed - capacity)
        return np.arange(first, committed, dtype=np.int64)

    def lane_steps(self) -> tuple[np.ndarray, np.ndarray]:
        """Every valid (lane, step), lane by lane."""
        lanes = range(self.config["num_envs"])
        steps = [self.valid_steps(lane) for lane in lanes]
        return np.concatenate([np.full(len(s), lane, np.int64) for lane, s in zip(lanes, steps)]), np.concatenate(steps)

    def rows(self, lane: np.ndarray, step: np.ndarray) -> dict[str, np.ndarray]:
        """Section 4: step ``t`` of lane ``e`` is ``array[e, t % lane_capacity]`` (dataset: ``[e, t]``)."""
        capacity = self.config["lane_capacity"]
        slot = step if capacity is None else step % capacity
        out = {}
        for name, spec in self.config["fields"].items():
            array = zarr.open_array(str(self.path / name), mode="r")
            assert array.dtype == np.dtype(spec["dtype"]) and list(array.shape[2:]) == spec["shape"]
            out[name] = array[...][lane, slot]
        return out


def read_all(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every valid row of the buffer at ``path``, by row id ``step * num_envs + lane`` (sorted)."""
    reader = FormatReader(path)
    lane, step = reader.lane_steps()
    ids = step * reader.config["num_envs"] + lane
    order = np.argsort(ids)
    return ids[order], reader.rows(lane[order], step[order])


def read_sharded(path: Path) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Section 9: every valid union row id (sorted), its ``(shard, lane, step)`` and its rows."""
    count = zarr.open_group(str(path), mode="r").attrs["diskreplay_shards"]["count"]
    ids, where, parts = [], [], []
    for shard in range(count):
        reader = FormatReader(path / f"shard-{shard:05d}")
        envs = reader.config["num_envs"]
        lane, step = reader.lane_steps()
        ids.append(step * (count * envs) + shard * envs + lane)
        where.append(np.stack([np.full(len(lane), shard), lane, step]))
        parts.append(reader.rows(lane, step))
    order = np.argsort(np.concatenate(ids))
    rows = {name: np.concatenate([p[name] for p in parts])[order] for name in parts[0]}
    return np.concatenate(ids)[order], np.concatenate(where, axis=1)[:, order], rows


# ---- buffers to read ---------------------------------------------------------------------------

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int16"), "done": dr.Field((), "bool"),
          "img": dr.Field((32, 64), "uint8")}  # img rows take 2 KiB: sharded chunks when compressed


def steps(n: int, lanes: int, start: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` time-major steps of ``lanes`` lanes, every value telling its step and lane apart."""
    t = np.arange(start, start + n)[:, None] * 10 + np.arange(lanes)[None, :]
    img = np.random.default_rng(seed + start).integers(0, 256, (n, lanes, 32, 64), dtype=np.uint8)
    return {"obs": np.stack([t, -t, t / 4], -1).astype(np.float32), "act": (t % 30000).astype(np.int16),
            "done": t % 7 == 0, "img": img}


def one_lane(n: int, start: int) -> dict[str, np.ndarray]:
    """`steps` of a buffer with one lane (no lane axis)."""
    return {name: value[:, 0] for name, value in steps(n, 1, start).items()}


def assert_same_rows(buf: dr.ReplayBuffer, ids: np.ndarray, rows: dict[str, np.ndarray]) -> None:
    """The reader's row ids are the buffer's, and its rows are ``buf[ids]``, byte for byte."""
    np.testing.assert_array_equal(ids, np.sort(buf.row_ids()))
    expected = buf[ids]
    assert sorted(rows) == sorted(expected)
    for name, value in expected.items():
        assert rows[name].dtype == value.dtype, name
        np.testing.assert_array_equal(rows[name], value, err_msg=name)


def test_a_reader_of_the_document_reads_a_wrapped_cleared_ring(tmp_path):
    path = tmp_path / "ring"
    buf = dr.ReplayBuffer.create(path, FIELDS, capacity=48, num_envs=3, chunk_rows=8, compression="zstd")
    buf.extend(steps(30, 3, 0))
    buf.extend(steps(5, 2, 30), env_ids=[0, 2])
    buf.flush()
    assert json.loads((path / "img" / "zarr.json").read_text())["codecs"][0]["name"] == "sharding_indexed"
    with dr.ReplayBuffer.open(path, "r") as ro:
        ids, rows = read_all(path)
        assert len(ids) == 48 and ids.max() == 34 * 3 + 2  # every lane wrapped: 16 steps each
        assert_same_rows(ro, ids, rows)
    buf.clear()  # lower = committed in every lane; then lane 2 wraps past its lower
    buf.extend(steps(3, 1, 100), env_ids=[1])
    buf.extend(steps(20, 1, 200), env_ids=[2])
    buf.flush()
    with dr.ReplayBuffer.open(path, "r") as ro:
        ids, rows = read_all(path)
        lower = FormatReader(path).commit["lower"]
        assert lower[:2] == [35, 30] and 35 <= lower[2] <= 55 - 16  # lane 2: raised by retire commits too
        np.testing.assert_array_equal(ids, np.sort(np.r_[np.arange(30, 33) * 3 + 1, np.arange(39, 55) * 3 + 2]))
        assert_same_rows(ro, ids, rows)
    buf.close()


@pytest.mark.parametrize("compression", [None, "lz4", "lz4hc"])
def test_a_reader_of_the_document_reads_a_dataset(tmp_path, compression):
    path = tmp_path / "dataset"
    with dr.ReplayBuffer.create(path, FIELDS, num_envs=2, chunk_rows=4, compression=compression) as buf:
        buf.extend(steps(7, 2, 0))
        buf.extend(steps(5, 1, 7), env_ids=[1])
    ids, rows = read_all(path)
    np.testing.assert_array_equal(ids, np.sort(np.r_[np.arange(7) * 2, np.arange(12) * 2 + 1]))
    with dr.ReplayBuffer.open(path, "r") as ro:
        assert_same_rows(ro, ids, rows)


def test_a_reader_of_the_document_reads_a_sharded_buffer(tmp_path):
    path = tmp_path / "sharded"
    dr.ReplayBuffer.create(path, FIELDS, capacity=24, num_envs=2, chunk_rows=4, shards=2).close()
    for shard, count in ((0, 15), (1, 5)):  # shard 0 wraps its lanes of 12 steps
        with dr.ReplayBuffer.open_shard(path, shard=shard) as actor:
            actor.extend(steps(count, 2, 0, seed=shard))
    ids, where, rows = read_sharded(path)
    assert len(ids) == 2 * 12 + 2 * 5
    with dr.ReplayBuffer.open(path, "r") as learner:
        assert_same_rows(learner, ids, rows)
        for got, expected in zip(where, learner.locate(ids)):
            np.testing.assert_array_equal(got, expected)


# ---- xarray and dimension_names ----------------------------------------------------------------

def test_xarray_opens_a_dataset_buffer(tmp_path, xr):
    path = tmp_path / "dataset"
    with dr.ReplayBuffer.create(path, FIELDS, num_envs=2, chunk_rows=4) as buf:
        buf.extend(steps(6, 2, 0))
        buf.extend(steps(3, 1, 6), env_ids=[0])
        expected = buf[buf.row_ids()]
    ds = xr.open_zarr(path, consolidated=False)
    assert ds["obs"].dims == ("lane", "step", "obs_dim0") and ds["img"].dims == ("lane", "step", "img_dim0", "img_dim1")
    assert ds["done"].dims == ("lane", "step") and dict(ds.sizes)["step"] >= 9
    for name in FIELDS:
        lane0, lane1 = ds[name].values[0, :9], ds[name].values[1, :6]
        np.testing.assert_array_equal(np.concatenate([lane0, lane1]), expected[name], err_msg=name)


def test_xarray_opens_a_ring_with_rows_at_their_slots(tmp_path, xr):
    path = tmp_path / "ring"
    with dr.ReplayBuffer.create(path, FIELDS, capacity=16, num_envs=2, chunk_rows=4) as buf:
        buf.extend(steps(11, 2, 0))  # 8 steps a lane: steps 3..10 at slots 3..7, 0..2
        ids = buf.row_ids()
        expected = buf[ids]
    ds = xr.open_zarr(path, consolidated=False)
    assert ds["obs"].dims == ("lane", "slot", "obs_dim0") and dict(ds.sizes) == {
        "lane": 2, "slot": 8, "obs_dim0": 3, "img_dim0": 32, "img_dim1": 64}
    lane, step = ids % 2, ids // 2
    for name in FIELDS:
        np.testing.assert_array_equal(ds[name].values[lane, step % 8], expected[name], err_msg=name)


def strip_dimension_names(path: Path) -> None:
    for name in FIELDS:
        meta_path = path / name / "zarr.json"
        meta = json.loads(meta_path.read_text())
        del meta["dimension_names"]
        meta_path.write_text(json.dumps(meta))


def test_buffers_without_dimension_names_still_open_grow_and_verify(tmp_path):
    """Buffers written before ``dimension_names`` open, read, grow (the grown ``zarr.json`` still
    has none) and pass `verify`."""
    path = tmp_path / "old"
    with dr.ReplayBuffer.create(path, FIELDS, num_envs=2, chunk_rows=4) as buf:
        buf.extend(steps(3, 2, 0))
    strip_dimension_names(path)
    with dr.ReplayBuffer.open(path, "r+") as buf:
        buf.extend(steps(9, 2, 3))
    assert "dimension_names" not in json.loads((path / "obs" / "zarr.json").read_text())
    assert verify(path).ok
    with dr.ReplayBuffer.open(path, "r") as ro:
        ids, rows = read_all(path)
        assert len(ids) == 24
        assert_same_rows(ro, ids, rows)


def test_new_arrays_name_their_dimensions(tmp_path):
    dr.ReplayBuffer.create(tmp_path / "ring", FIELDS, capacity=8, chunk_rows=4).close()
    names = {n: json.loads((tmp_path / "ring" / n / "zarr.json").read_text())["dimension_names"] for n in FIELDS}
    assert names == {"obs": ["lane", "slot", "obs_dim0"], "act": ["lane", "slot"], "done": ["lane", "slot"],
                     "img": ["lane", "slot", "img_dim0", "img_dim1"]}


# ---- no zarr-python warnings about diskreplay's own objects (docs/format.md, section 10) ----

def warned(call: Any) -> tuple[Any, list[str]]:
    """``call()`` and the names zarr-python warned were not Zarr nodes, sorted (other warnings,
    e.g. xarray's own, are left out)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call()
    prefix, suffix = "Object at ", " is not recognized as a component of a Zarr hierarchy."
    names = [str(w.message) for w in caught if str(w.message).startswith(prefix)]
    assert all(m.endswith(suffix) for m in names), names
    return result, sorted(m[len(prefix):-len(suffix)] for m in names)


def test_listing_a_buffer_finds_only_zarr_nodes(tmp_path, xr):
    """With a live writer, state objects and a side store, listing the group (recursively too,
    and through xarray) finds the fields, ``final/`` and the ``diskreplay`` group, and warns of nothing."""
    path = str(tmp_path / "buf")
    fields = {**FIELDS, "next_obs": FIELDS["obs"]}
    buf = dr.ReplayBuffer.create(path, fields, capacity=16, chunk_rows=4, derive_next=("obs",))
    buf.extend({**one_lane(6, 0), "next_obs": one_lane(6, 1)["obs"]})  # done at step 0: state/ has an end
    buf.flush()
    own = tmp_path / "buf" / "diskreplay" / "objects"
    assert {p.name for p in own.iterdir()} == {"zarr.json", "commit.json", "state", "writer.lock"}
    group, names = warned(lambda: zarr.open_group(path, mode="r"))
    assert names == [] and warned(lambda: group["obs"][...].shape) == ((1, 16, 3), [])
    assert warned(lambda: sorted(group.array_keys())) == (sorted(FIELDS), [])
    assert warned(lambda: sorted(group.group_keys())) == (["diskreplay", "final"], [])
    nodes = sorted([*FIELDS, "diskreplay", "diskreplay/objects", "final", "final/obs", "final/diskreplay",
                    "final/diskreplay/objects"])
    assert warned(lambda: sorted(k for k, _ in group.members(max_depth=None))) == (nodes, [])
    ds, opened = warned(lambda: xr.open_zarr(path, consolidated=False))
    assert opened == [] and sorted(ds.data_vars) == sorted(FIELDS)
    tree, opened = warned(lambda: xr.open_datatree(path, engine="zarr", consolidated=False))
    assert opened == [] and sorted(tree.children) == ["diskreplay", "final"]
    assert tree["diskreplay"]["objects"].shape == (0,) and sorted(tree["final"].children) == ["diskreplay"]
    buf.close()
    assert not (own / "writer.lock").exists()


def test_listing_a_sharded_root_finds_only_zarr_nodes(tmp_path):
    """A sharded root with a learner's ``learner.json`` and a live actor: no warning either."""
    path = str(tmp_path / "sharded")
    dr.ReplayBuffer.create(path, FIELDS, capacity=8, chunk_rows=4, shards=2).close()
    limiter = dr.RateLimiter(samples_per_insert=1.0, error_buffer=100.0)
    with dr.ReplayBuffer.open_shard(path, shard=0) as actor:
        actor.extend(one_lane(3, 0))
        actor.flush()
        with dr.ReplayBuffer.open(path, "r", rate_limiter=limiter) as learner:
            learner.sample(2)
        assert (tmp_path / "sharded" / "diskreplay" / "objects" / "learner.json").is_file()
        root = zarr.open_group(path, mode="r")
        assert warned(lambda: sorted(root.group_keys())) == (["diskreplay", "shard-00000", "shard-00001"], [])
        members, names = warned(lambda: [k for k, _ in root.members(max_depth=None)])
        assert names == [] and "shard-00000/diskreplay/objects" in members


def test_a_diskreplay_1_buffer_warns_of_its_own_objects(tmp_path):
    """Pinned: format ``diskreplay/1`` kept its own objects at the root, where zarr warns of each."""
    path = tmp_path / "old"
    with dr.ReplayBuffer.create(path, FIELDS, capacity=16, chunk_rows=4) as buf:
        buf.extend(one_lane(6, 0))
    downgrade(path)
    group = zarr.open_group(str(path), mode="r")
    assert warned(lambda: sorted(group.array_keys())) == (sorted(FIELDS), ["commit.json", "state"])


def read_table_as_documented(blob: bytes, inner: int) -> tuple[int, np.ndarray, dict[tuple[int, int], np.ndarray]]:
    """A shard index table (section 6) read from the page alone: (sequence, presence, the index
    of each held shard as its chunk file starts with it)."""
    import zstandard
    from google_crc32c import value as crc32c

    assert blob[:8] == b"DRSHIDX2" and int.from_bytes(blob[-4:], "little") == crc32c(blob[:-4])
    sequence = int.from_bytes(blob[8:16], "little")
    lanes, chunks, stored_inner = (int.from_bytes(blob[24 + 4 * i:28 + 4 * i], "little") for i in range(3))
    assert stored_inner == inner
    present = np.frombuffer(blob, np.uint8, lanes * chunks, 40).reshape(lanes, chunks)
    held = np.argwhere(present == 1)
    columns = np.frombuffer(zstandard.decompress(blob[40 + lanes * chunks:-4]), "<u8").reshape(2, len(held), inner)
    indexes = {}
    for (lane, chunk), residual, nbytes in zip(held.tolist(), columns[0], columns[1]):
        sizes = np.where(nbytes == 2**64 - 1, 0, nbytes).astype(np.uint64)
        expected = np.uint64(16 * inner + 4) + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.uint64)
        indexes[(lane, chunk)] = np.stack([residual + expected, nbytes], axis=-1)
    return sequence, present, indexes


def test_a_reader_of_the_document_reads_the_shard_index_tables(tmp_path):
    """Each table a closing writer leaves holds, for every shard of the last commit, the index
    its chunk file starts with."""
    path = tmp_path / "buf"
    rows = np.arange(3 * 256 + 40, dtype=np.float32)[:, None] * np.ones(17, np.float32)
    with dr.ReplayBuffer.create(path, {"obs": dr.Field((17,), "float32")}, capacity=None, chunk_rows=256,
                                compression="zstd", num_envs=2, episode_end=None) as buf:
        buf.extend({"obs": rows.reshape(-1, 2, 17)})
    sequence = json.loads((path / "diskreplay" / "objects" / "commit.json").read_text())["sequence"]
    inner = 256 // 64
    blob = (path / "diskreplay" / "objects" / "shard-index-tables" / "obs").read_bytes()
    stored, present, indexes = read_table_as_documented(blob, inner)
    assert stored == sequence and present.tolist() == [[1, 1], [1, 1]]
    for (lane, chunk), index in indexes.items():
        head = (path / "obs" / f"c.{lane}.{chunk}.0").read_bytes()[:16 * inner]
        np.testing.assert_array_equal(index, np.frombuffer(head, "<u8").reshape(inner, 2))
