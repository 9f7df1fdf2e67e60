"""Ray Data reads and writes of buffers (`diskreplay.ray`), on a real two-node Ray cluster on
127.0.0.1 (tests/ray_cluster.py), against local buffers and a moto S3 server: every committed row
exactly once and bit-equal to ``buf[row_id]``, pinned to the commits of the plan, also when Ray
retries a read task whose worker died; sharded buffers written one shard per write task."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray.data")
import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from ray.data.block import BlockAccessor
from ray.data.datasource import ReadTask
from ray_cluster import ray_cluster, ray_driver
from s3server import s3

import diskreplay as dr
from diskreplay.audit import verify
from diskreplay.errors import BufferExistsError, NotABufferError, SchemaError, StaleReadError
from diskreplay.format.keys import FAILED_WRITE_KEY
from diskreplay.io import open_chunkstore
from diskreplay.ray import BufferDatasink, BufferDatasource, read_buffer, write_buffer
from diskreplay.storage.chunk_io import ChunkIO

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int16"), "done": dr.Field((), "bool"),
          "img": dr.Field((2, 2), "uint8")}
LOCAL = {"plain": {"chunk_rows": 8, "compression": None, "num_envs": 3},
         "ring": {"capacity": 96, "chunk_rows": 8, "compression": None, "num_envs": 3},
         "compressed": {"capacity": 60, "chunk_rows": 7, "compression": "zstd", "num_envs": 2},
         "sharded": {"capacity": 40, "chunk_rows": 8, "compression": "lz4", "num_envs": 2, "shards": 3}}


def steps(first: int, n: int, lanes: int, salt: int = 0) -> dict[str, np.ndarray]:
    """Steps ``first..first+n`` of ``lanes`` lanes (``[n, lanes, ...]``): every value tells its step, lane and salt."""
    code = (np.arange(first, first + n)[:, None] * 16 + np.arange(lanes) + 1000 * salt).astype(np.int64)
    return {"obs": np.stack([code, code + 0.5, -code], -1).astype(np.float32), "act": (code % 30000).astype(np.int16),
            "done": code % 7 == 3, "img": (code[..., None, None] % 251 + np.eye(2, dtype=np.int64)).astype(np.uint8)}


def make_buffer(url: str, kind: dict, rows: int = 130, storage_options: dict | None = None) -> None:
    """A buffer of ``kind`` holding ``rows`` steps per lane (a ring: wrapped); a sharded one gets
    different rows per shard."""
    options = {k: v for k, v in kind.items() if k != "shards"}
    shards = kind.get("shards")
    buf = dr.ReplayBuffer.create(url, FIELDS, shards=shards, storage_options=storage_options, **options)
    buf.close()
    for shard in range(shards or 1):
        with (dr.ReplayBuffer.open_shard(url, shard, storage_options=storage_options) if shards else
              dr.ReplayBuffer.open(url, "r+", storage_options=storage_options)) as writer:
            lanes = kind["num_envs"]
            writer.extend(steps(0, rows + 5 * shard, lanes, salt=shard), env_ids=list(range(lanes)))


def collect(ds: ray.data.Dataset) -> dict[str, np.ndarray]:
    parts: dict[str, list[np.ndarray]] = {}
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for name, values in batch.items():
            parts.setdefault(name, []).append(values)
    return {name: np.concatenate(values) for name, values in parts.items()}


def check_exactly_once(url: str, got: dict[str, np.ndarray], storage_options: dict | None = None,
                       fields: tuple[str, ...] = tuple(FIELDS)) -> None:
    """``got`` holds every committed row of ``url`` once, each equal (bits, dtype) to ``buf[row_id]``."""
    assert set(got) == {*fields, "row_id"}
    with dr.ReplayBuffer.open(url, storage_options=storage_options) as buf:
        assert np.array_equal(np.sort(got["row_id"]), np.sort(buf.row_ids()))
        expected = buf[got["row_id"]]
    for name in fields:
        assert got[name].dtype == FIELDS[name].dtype and got[name].shape == (len(got["row_id"]), *FIELDS[name].shape)
        assert np.array_equal(got[name], expected[name]), name


@pytest.mark.parametrize("kind", list(LOCAL))
def test_every_committed_row_once_bit_equal(ray_driver, tmp_path, kind):
    url = str(tmp_path / kind)
    make_buffer(url, LOCAL[kind])
    ds = read_buffer(url, override_num_blocks=3)
    check_exactly_once(url, collect(ds))


@pytest.mark.parametrize("kind", list(LOCAL))
def test_s3_buffers_read_by_the_cluster(ray_driver, s3, kind):
    url, options = s3.new_url(f"ray-{kind}"), s3.storage_options()
    make_buffer(url, LOCAL[kind], storage_options=options)
    got = collect(read_buffer(url, storage_options=options, override_num_blocks=2))
    check_exactly_once(url, got, options)


def test_rows_committed_after_the_plan_are_not_read(ray_driver, tmp_path):
    url = str(tmp_path / "grows")
    make_buffer(url, LOCAL["plain"], rows=20)
    ds = read_buffer(url, override_num_blocks=2)
    with dr.ReplayBuffer.open(url, "r+") as writer:
        writer.extend(steps(20, 30, 3), env_ids=[0, 1, 2])
    got = collect(ds)
    assert np.array_equal(np.sort(got["row_id"]), np.arange(60))  # 20 steps x 3 lanes, as planned
    with dr.ReplayBuffer.open(url) as buf:
        assert len(buf) == 150 and np.array_equal(got["img"], buf[got["row_id"]]["img"])


def test_rows_a_ring_overwrote_after_the_plan_raise(ray_driver, tmp_path):
    url = str(tmp_path / "ring")
    make_buffer(url, LOCAL["ring"])
    ds = read_buffer(url, override_num_blocks=2)
    with dr.ReplayBuffer.open(url, "r+") as writer:  # a whole new round: every planned row is gone
        writer.extend(steps(130, 40, 3, salt=1), env_ids=[0, 1, 2])
    with pytest.raises(StaleReadError, match=r"\(lane 0, steps 98 to 129\) are no longer in the buffer: the read was "
                                             r"planned at commit \d+, and commit \d+ holds steps 138 to 169"):
        collect(ds)


class KillFirstTry(BufferDatasource):
    """Read tasks whose first try SIGKILLs its own worker after handing Ray its first block
    (once for the whole read: the marker file says it happened)."""

    def __init__(self, url: str, marker: str):
        super().__init__(url)
        self.marker = marker

    def get_read_tasks(self, parallelism, per_task_row_limit=None, data_context=None):
        tasks = super().get_read_tasks(parallelism, per_task_row_limit, data_context)
        return [ReadTask(_KillAfterFirstBlock(task.read_fn, self.marker), task.metadata, schema=task.schema)
                for task in tasks]


class _KillAfterFirstBlock:
    def __init__(self, read, marker: str):
        self.read, self.marker = read, marker

    def __call__(self):
        for i, block in enumerate(self.read()):
            if i == 1 and not os.path.exists(self.marker):
                Path(self.marker).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            yield block


def test_a_read_task_whose_worker_dies_is_retried_exactly_once(ray_driver, tmp_path):
    url = str(tmp_path / "plain")
    make_buffer(url, LOCAL["plain"], rows=300)
    marker = tmp_path / "killed"
    ds = ray.data.read_datasource(KillFirstTry(url, str(marker)), override_num_blocks=2)
    got = collect(ds)
    assert marker.exists()  # a worker died mid-task...
    check_exactly_once(url, got)  # ...and its task's rows came once all the same


def test_projection_reads_only_the_chosen_fields(tmp_path, monkeypatch):
    url = str(tmp_path / "ring")
    make_buffer(url, LOCAL["compressed"])
    keys: list[str] = []
    read = ChunkIO.read
    monkeypatch.setattr(ChunkIO, "read", lambda io, work, must_exist: (keys.extend(k for k, _, _ in work),
                                                                       read(io, work, must_exist))[1])
    source = BufferDatasource(url, fields=["img", "done"])
    tasks = source.get_read_tasks(4)
    blocks = [block for task in tasks for block in task()]  # the tasks' work, run here
    columns = [BlockAccessor.for_block(block).to_numpy() for block in blocks]
    got = {name: np.concatenate([c[name] for c in columns]) for name in ("img", "done", "row_id")}
    assert {key.split("/")[0] for key in keys} == {"img", "done"}
    # every chunk of the two fields, 5 per lane: a lane's window (a wrapped ring of 30 steps, chunks of 7)
    # starts and ends inside one chunk, which the lane's first and last task both read
    assert len(set(keys)) == 2 * 2 * 5 and len(keys) == 2 * 2 * 5 + 2 * 2
    check_exactly_once(url, got, fields=("img", "done"))
    assert source.estimate_inmemory_data_size() == 60 * (4 + 1 + 8) == sum(t.metadata.size_bytes for t in tasks)


def test_read_tasks_follow_the_requested_count(tmp_path):
    url = str(tmp_path / "plain")
    make_buffer(url, LOCAL["plain"], rows=64)  # 3 lanes x 8 chunks
    source = BufferDatasource(url)
    assert [len(source.get_read_tasks(n)) for n in (1, 5, 24, 200)] == [1, 5, 24, 24]
    assert source.num_rows == 192 and source.estimate_inmemory_data_size() == 192 * (12 + 2 + 1 + 4 + 8)
    schema = source.get_read_tasks(1)[0].schema
    assert schema.names == ["obs", "act", "done", "img", "row_id"]
    assert schema.field("act").type == pa.int16() and schema.field("img").type.shape == (2, 2)


def test_bad_reads_name_what_is_wrong(tmp_path):
    url = str(tmp_path / "plain")
    make_buffer(url, LOCAL["plain"], rows=4)
    with pytest.raises(SchemaError, match=r"fields must name distinct stored fields .* \('nope' is not one\)"):
        read_buffer(url, fields=["obs", "nope"])
    with pytest.raises(NotABufferError):
        read_buffer(str(tmp_path / "nothing"))
    dr.ReplayBuffer.create(tmp_path / "row_id", {"row_id": dr.Field((), "int64")}).close()
    with pytest.raises(SchemaError, match="a field is named 'row_id'"):
        read_buffer(tmp_path / "row_id")


def source_table(n: int) -> pa.Table:
    """``n`` rows: episodes of 10 steps (``terminated`` on the last), ``act`` the row's number."""
    i = np.arange(n)
    obs = np.stack([i, -i, i * 0.5], -1).astype(np.float32)
    return pa.table({"obs": pa.FixedSizeListArray.from_arrays(obs.reshape(-1), 3), "act": i.astype(np.int64),
                     "reward": (i % 3).astype(np.float32), "terminated": i % 10 == 9, "truncated": np.zeros(n, bool)})


def check_written(url: str, table: pa.Table, shards: int) -> None:
    """The sharded buffer at ``url`` holds ``table``'s rows, shard ``i`` the i-th of ``shards`` runs, in order."""
    report = verify(url)
    assert report.ok, report
    n = table.num_rows
    with dr.ReplayBuffer.open(url) as buf:
        assert buf.shards == shards and len(buf) == n and set(buf.fields) == set(table.column_names)
        shard, _, step = buf.locate(buf.row_ids())
        order = np.lexsort((step, shard))  # shard by shard, in time order: the source's order
        rows = buf[buf.row_ids()[order]]
        episodes = buf.episodes()
    assert np.array_equal(rows["act"], np.arange(n))
    assert np.array_equal(rows["obs"], np.stack(table.column("obs").to_numpy(zero_copy_only=False)))
    assert np.array_equal(rows["terminated"], table.column("terminated").to_numpy())
    assert rows["reward"].dtype == np.float32 and rows["terminated"].dtype == bool
    assert int(episodes.complete.sum()) == n // 10 and int(episodes.length.sum()) == n


def test_write_buffer_makes_one_shard_per_task(ray_driver, tmp_path):
    path = tmp_path / "source.parquet"
    pq.write_table(source_table(20_000), path)
    url = str(tmp_path / "written")
    write_buffer(ray.data.read_parquet(str(path)), url, shards=4, chunk_rows=512)
    check_written(url, source_table(20_000), 4)
    torch = pytest.importorskip("torch")
    with dr.ReplayBuffer.open(url) as buf:  # an ordinary sharded buffer: an epoch reads every row once
        epoch = torch.cat([batch["act"] for batch in buf.as_dataset(1000, mode="epoch", seed=0)])
    assert np.array_equal(np.sort(epoch.numpy()), np.arange(20_000))


@pytest.mark.slow
def test_two_million_parquet_rows_into_eight_shards(ray_driver, tmp_path):
    path = tmp_path / "source.parquet"
    table = source_table(2_000_000)
    pq.write_table(table, path)
    url = str(tmp_path / "written")
    write_buffer(ray.data.read_parquet(str(path)), url, shards=8)
    check_written(url, table, 8)


def test_write_buffer_on_s3_reads_back(ray_driver, s3):
    url, options = s3.new_url("ray-written"), s3.storage_options()
    ds = ray.data.from_items([{"obs": np.full(2, i, np.float32), "done": i % 4 == 3} for i in range(100)])
    write_buffer(ds, url, shards=2, capacity=64, storage_options=options)
    assert verify(url, options).ok
    got = collect(read_buffer(url, storage_options=options))
    assert np.array_equal(np.sort(got["obs"][:, 0]), np.arange(100, dtype=np.float32))


def failing_batch(batch: dict) -> dict:
    if 700 in batch["act"]:
        raise RuntimeError("bad batch")
    return batch


def test_a_failed_write_leaves_nothing_that_opens(ray_driver, tmp_path):
    url = tmp_path / "failed"
    ds = ray.data.from_arrow(source_table(1000)).repartition(4).map_batches(failing_batch)
    with pytest.raises(Exception, match="bad batch"):
        write_buffer(ds, url, shards=None)
    with pytest.raises(NotABufferError, match=r"is not a diskreplay buffer: a write there failed \(\w+: "):
        dr.ReplayBuffer.open(url)
    assert_only_the_failure_note(url)
    write_buffer(ray.data.from_arrow(source_table(1000)), url, shards=2)  # the note is no buffer: no overwrite=
    check_written(str(url), source_table(1000), 2)


def assert_only_the_failure_note(url: Path) -> None:
    """``url`` holds the note of a failed write and nothing else."""
    files = [os.path.relpath(os.path.join(top, name), url) for top, _, names in os.walk(url) for name in names]
    assert files == [FAILED_WRITE_KEY]
    assert re.fullmatch(r"\w+: [^\n]+", json.loads((url / FAILED_WRITE_KEY).read_text())["error"])


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_write_task_stopped_midway_removes_its_shard(tmp_path, stop: type[BaseException]):
    """What a task cancelled by Ray (a KeyboardInterrupt in it) or failing had written of its shard is
    gone when it raises: its close may commit what it staged after the driver cleared the failed write."""
    table = source_table(100)
    url = tmp_path / "stopped"
    sink = BufferDatasink(url, chunk_rows=16)
    sink.on_write_start(table.schema)

    def blocks():
        yield table.slice(0, 60)
        raise stop("stopped")

    with pytest.raises(stop, match="stopped"):
        sink.write(blocks(), SimpleNamespace(task_idx=1))
    sink.write([table.slice(60)], SimpleNamespace(task_idx=0))
    assert sorted(os.listdir(url)) == ["shard-00000"]
    sink.on_write_failed(RuntimeError("stopped"))
    assert_only_the_failure_note(url)


def test_a_task_that_commits_after_the_write_failed_removes_its_shard(tmp_path):
    """The driver clears a failed write while a task that Ray has not yet cancelled goes on: that task
    commits its shard afterwards, finds the failure's note and removes the shard; the location is
    then free for a new write without overwrite=, local and on S3."""
    table = source_table(100)
    url = tmp_path / "late"
    sink = BufferDatasink(url, chunk_rows=16)
    sink.on_write_start(table.schema)
    sink.write([table.slice(0, 50)], SimpleNamespace(task_idx=0))
    sink.on_write_failed(RuntimeError("task 2 failed"))
    assert_only_the_failure_note(url)
    with pytest.raises(RuntimeError, match=r"the write failed while task 1 ran; its shard is removed"):
        sink.write([table.slice(50)], SimpleNamespace(task_idx=1))
    assert_only_the_failure_note(url)
    with pytest.raises(NotABufferError, match=r"a write there failed \(RuntimeError: task 2 failed\)"):
        dr.ReplayBuffer.open(url)
    again = BufferDatasink(url, chunk_rows=16)
    again.on_write_start(table.schema)
    assert not url.exists()
    results = [again.write([table.slice(0, 50)], SimpleNamespace(task_idx=0)),
               again.write([table.slice(50)], SimpleNamespace(task_idx=1))]
    again.on_write_complete(SimpleNamespace(write_returns=results))
    check_written(str(url), table, 2)


@pytest.mark.parametrize("blocks_before", [1, 3])
def test_a_task_writing_while_the_driver_clears_removes_its_shard(tmp_path, blocks_before: int):
    """The driver fails the write and clears the shards while a task is between two blocks (its shard
    half written, chunks of it already stored): the task's writer finds its lock gone and stops
    before it writes again, and only the note stays."""
    table = source_table(160)
    url = tmp_path / "midway"
    sink = BufferDatasink(url, chunk_rows=16, compression=None)
    sink.on_write_start(table.schema)

    def blocks():
        for i in range(4):
            if i == blocks_before:
                assert (url / "shard-00000").is_dir()
                sink.on_write_failed(RuntimeError("task 1 failed"))
                assert_only_the_failure_note(url)
            yield table.slice(40 * i, 40)

    with pytest.raises(dr.LockedError, match=r"shard-00000': this writer no longer holds the writer lock"):
        sink.write(blocks(), SimpleNamespace(task_idx=0))
    assert_only_the_failure_note(url)


def test_a_failed_write_on_s3_leaves_its_note_and_frees_the_location(s3):
    table = source_table(100)
    url, options = s3.new_url("late"), s3.storage_options()
    sink = BufferDatasink(url, chunk_rows=16, storage_options=options)
    sink.on_write_start(table.schema)
    sink.write([table.slice(0, 50)], SimpleNamespace(task_idx=0))
    failure = RuntimeError("task 1 failed")
    failure.__cause__ = ValueError("row 70 is bad\n(the rest of its message)")
    sink.on_write_failed(failure)
    with pytest.raises(RuntimeError, match=r"the write failed while task 1 ran"):
        sink.write([table.slice(50)], SimpleNamespace(task_idx=1))
    root = open_chunkstore(url, options)
    assert list(root.sizes()) == [FAILED_WRITE_KEY]
    assert json.loads(root.get(FAILED_WRITE_KEY)) == {"error": "ValueError: row 70 is bad"}  # the first cause
    with dr.ReplayBuffer.create(url, {"obs": dr.Field((3,), "float32")}, storage_options=options) as buf:
        buf.add(obs=np.ones(3, np.float32))  # a plain buffer replaces the note, without overwrite=
    assert FAILED_WRITE_KEY not in open_chunkstore(url, options).sizes()
    with dr.ReplayBuffer.open(url, storage_options=options) as buf:
        assert len(buf) == 1


def test_bad_writes_name_what_is_wrong(ray_driver, tmp_path):
    text = ray.data.from_items([{"obs": 1.0, "name": "a"}])
    with pytest.raises(SchemaError, match=r"column 'name' cannot be a buffer field: expected a bool, integer or "
                                          r"float column.*got Arrow type string"):
        write_buffer(text, tmp_path / "text")
    ragged = ray.data.from_items([{"obs": np.zeros(2)}, {"obs": np.zeros(3)}])
    with pytest.raises(SchemaError, match=r"column 'obs' cannot be a buffer field.*got Arrow type"):
        write_buffer(ragged, tmp_path / "ragged")
    ds = ray.data.from_items([{"obs": 1.0}])
    write_buffer(ds, tmp_path / "once")
    with pytest.raises(BufferExistsError):
        write_buffer(ds, tmp_path / "once")
    with pytest.raises(ValueError, match="shards must be"):
        write_buffer(ds, tmp_path / "zero", shards=0)
    with pytest.raises(ValueError, match=r"the dataset has no schema to make fields from \(no rows\?\): pass fields="):
        write_buffer(ray.data.from_items([]), tmp_path / "zero")
    assert not (tmp_path / "text").exists() and not (tmp_path / "zero").exists()


def test_an_empty_buffer_reads_no_row(tmp_path):
    dr.ReplayBuffer.create(tmp_path / "empty", FIELDS).close()
    source = BufferDatasource(tmp_path / "empty")
    tasks = source.get_read_tasks(8)
    assert len(tasks) == 1 and list(tasks[0]()) == [] and source.estimate_inmemory_data_size() == 0


def test_import_diskreplay_does_not_import_ray():
    code = "import sys, diskreplay; assert 'ray' not in sys.modules and 'diskreplay.ray' not in sys.modules"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_relative_local_paths_are_the_drivers(ray_driver, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the tasks' working directory is Ray's: they are given absolute paths
    write_buffer(ray.data.from_items([{"obs": float(i)} for i in range(50)]), "rel/written", shards=2)
    got = collect(read_buffer("rel/written"))
    assert np.array_equal(np.sort(got["obs"]), np.arange(50, dtype=np.float64))


def test_the_datasink_alone_takes_its_fields_from_the_schema(ray_driver, tmp_path):
    ds = ray.data.from_items([{"obs": np.full((2, 2), i, np.uint8), "done": i % 3 == 2} for i in range(30)])
    ds.repartition(3).write_datasink(BufferDatasink(tmp_path / "sink"))
    with dr.ReplayBuffer.open(tmp_path / "sink") as buf:
        assert buf.shards == 3 and len(buf) == 30
        assert buf.fields == {"obs": dr.Field((2, 2), "uint8"), "done": dr.Field((), "bool")}
        episodes = buf.episodes()  # 10 ended by done (row 29 the last of shard 2), shards 0 and 1 end open
    assert (len(episodes), int(episodes.complete.sum())) == (12, 10)


def test_frames_stored_as_zarr_shards_read_whole(tmp_path):
    # compressed rows of 1 KiB or more are Zarr shards of inner chunks: a task reads and decodes them whole
    fields = {"frame": dr.Field((32, 32), "uint8"), "done": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(tmp_path / "frames", fields, capacity=300, chunk_rows=64, compression="zstd") as buf:
        n = np.arange(400)
        buf.extend({"frame": (n[:, None, None] + np.arange(32 * 32).reshape(32, 32)).astype(np.uint8),
                    "done": n % 9 == 8})
        assert buf.storage.codecs["frame"].inner_rows  # the layout this test is about
    tasks = BufferDatasource(tmp_path / "frames").get_read_tasks(3)
    columns = [BlockAccessor.for_block(block).to_numpy() for task in tasks for block in task()]
    got = {name: np.concatenate([c[name] for c in columns]) for name in ("frame", "done", "row_id")}
    with dr.ReplayBuffer.open(tmp_path / "frames") as buf:
        assert np.array_equal(np.sort(got["row_id"]), buf.row_ids())
        assert np.array_equal(got["frame"], buf[got["row_id"]]["frame"])


class KillFirstWrite(BufferDatasink):
    """Write tasks whose first try (once for the whole write: the marker file) SIGKILLs its own
    worker after adding its first block to its shard, before the shard's commit."""

    def __init__(self, url, marker: str):
        super().__init__(url, chunk_rows=64)
        self.marker = marker

    def write(self, blocks, ctx):
        return super().write(self._killing(blocks), ctx)

    def _killing(self, blocks):
        for block in blocks:
            yield block
            if not os.path.exists(self.marker):  # the block was added: its chunks are written
                Path(self.marker).write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)


def test_a_write_task_whose_worker_dies_writes_its_shard_again(ray_driver, tmp_path):
    marker = tmp_path / "killed"
    ds = ray.data.from_arrow(source_table(2_000)).repartition(2)
    ds.write_datasink(KillFirstWrite(tmp_path / "written", str(marker)))
    assert marker.exists()  # a worker died with its shard half written...
    check_written(str(tmp_path / "written"), source_table(2_000), 2)  # ...and the retry wrote it whole


def test_a_buffer_read_and_written_again_reads_the_same(ray_driver, tmp_path):
    url = str(tmp_path / "ring")
    make_buffer(url, LOCAL["compressed"])
    write_buffer(read_buffer(url), tmp_path / "copy", shards=2)  # row_id is left out of the fields
    with dr.ReplayBuffer.open(tmp_path / "copy") as copy:
        assert copy.fields == FIELDS
    got = collect(read_buffer(tmp_path / "copy"))
    original = collect(read_buffer(url))
    assert np.array_equal(np.sort(got["obs"][:, 0]), np.sort(original["obs"][:, 0]))
