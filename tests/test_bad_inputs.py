"""Bad input is refused before anything is written: a table of bad calls, each with the specific
exception and message it must raise, and a check that the store's files are byte-for-byte what
they were before the call (every file's bytes, lock file included)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import zarr

import diskreplay as dr
from conftest import dir_snapshot

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int16"), "done": dr.Field((), "bool"),
          "img": dr.Field((2, 2), "uint8")}
ENVS = 2


def steps(n: int) -> dict[str, np.ndarray]:
    i = np.arange(n * ENVS).reshape(n, ENVS)
    return {"obs": np.stack([i, i, i], -1).astype(np.float32), "act": i.astype(np.int16),
            "done": i % 5 == 4, "img": np.zeros((n, ENVS, 2, 2), np.uint8) + (i % 250).astype(np.uint8)[..., None, None]}


def one_step() -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in steps(1).items()}


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Closed buffers to copy per case: zstd ring (2 lanes, 40 steps), raw dataset, prioritized."""
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for name, kw in {"ring": dict(capacity=64, compression="zstd"),
                     "raw": dict(capacity=None, compression=None),
                     "per": dict(capacity=64, compression="zstd", sampler=dr.Prioritized())}.items():
        path = str(root / name)
        buf = dr.ReplayBuffer.create(path, FIELDS, num_envs=ENVS, chunk_rows=8, seed=0, **kw)
        buf.extend(steps(20))
        buf.close()
        out[name] = path
    empty = str(root / "empty")
    dr.ReplayBuffer.create(empty, FIELDS, num_envs=ENVS, capacity=64, chunk_rows=8).close()
    out["empty"] = empty
    return out


@dataclass
class Case:
    id: str
    call: Callable[[str], Any]  # gets the buffer path (already prepared); must raise
    exc: type[BaseException]
    match: str
    template: str = "ring"
    prepare: Callable[[str], None] | None = None  # damage the copy before hashing
    writer: bool = False  # call gets an open r+ buffer instead of the path


def edit_json(path: str, fn: Callable[[dict], None]) -> None:
    with open(path) as fh:
        data = json.load(fh)
    fn(data)
    with open(path, "w") as fh:
        json.dump(data, fh)


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)


def truncate(path: str, keep: int) -> None:
    with open(path, "rb") as fh:
        data = fh.read()
    write(path, data[:keep])


def plain_zarr_group(path: str) -> None:
    shutil.rmtree(path)
    zarr.open_group(path, mode="w").create_array("x", shape=(4,), dtype="float32")


def empty_dir(path: str) -> None:
    shutil.rmtree(path)
    os.makedirs(path)


def set_dtype(data: dict) -> None:
    data["data_type"] = "int8"


def bad_step(**changes: Any) -> dict[str, np.ndarray]:
    row = one_step()
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


def second_writer(buf: dr.ReplayBuffer) -> None:
    dr.ReplayBuffer.open(buf.url, "r+")


CASES = [
    # rows that do not fit the schema
    Case("add-wrong-shape", lambda b: b.add(**bad_step(obs=np.zeros((ENVS, 4), np.float32))), dr.SchemaError,
         r"field 'obs': expected shape \(2, 3\), got \(2, 4\)", writer=True),
    Case("add-missing-field", lambda b: b.add(**bad_step(done=None)), dr.SchemaError,
         r"missing \['done'\], unknown \[\]", writer=True),
    Case("add-unknown-field", lambda b: b.add(**bad_step(bogus=np.zeros(ENVS))), dr.SchemaError,
         r"unknown \['bogus'\]", writer=True),
    Case("add-float-into-int", lambda b: b.add(**bad_step(act=np.full(ENVS, 1.5))), dr.SchemaError,
         r"field 'act': expected dtype int16 \(or one that casts to it safely\), got float64", writer=True),
    Case("add-int-out-of-range", lambda b: b.add(**bad_step(img=np.full((ENVS, 2, 2), 300))), dr.SchemaError,
         r"field 'img': values in \[300, 300\] do not fit the stored dtype uint8", writer=True),
    Case("add-int-into-bool", lambda b: b.add(**bad_step(done=np.ones(ENVS, np.int64))), dr.SchemaError,
         r"field 'done': expected dtype bool", writer=True),
    Case("extend-ragged-leading-axes", lambda b: b.extend({**steps(5), "act": steps(4)["act"]}), dr.SchemaError,
         r"field 'act': expected shape \(5, 2\), got \(4, 2\)", writer=True),
    Case("extend-scalar", lambda b: b.extend({k: 1 for k in FIELDS}), dr.SchemaError,
         r"extend expects arrays with a leading step axis", writer=True),
    Case("env-id-out-of-range", lambda b: b.add(env_ids=[2], **{k: v[:1] for k, v in one_step().items()}),
         dr.SchemaError, r"env_ids: expected ids in \[0, 2\), got \[2\]", writer=True),
    Case("env-id-negative", lambda b: b.add(env_ids=[-1], **{k: v[:1] for k, v in one_step().items()}),
         dr.SchemaError, r"env_ids: expected ids in \[0, 2\), got \[-1\]", writer=True),
    # priorities
    Case("nan-priority", lambda b: b.update_priorities([0, 1], [0.5, np.nan]), ValueError,
         r"priorities must be finite, got nan at position 1", template="per", writer=True),
    Case("inf-priority", lambda b: b.update_priorities([0], [np.inf]), ValueError,
         r"priorities must be finite, got inf at position 0", template="per", writer=True),
    Case("priority-count-mismatch", lambda b: b.update_priorities([0, 1, 2], [1.0]), ValueError,
         r"expected 3 priorities \(one per index\)", template="per", writer=True),
    Case("priority-negative-index", lambda b: b.update_priorities([-3], [1.0]), IndexError,
         r"row ids must be non-negative integers", template="per", writer=True),
    Case("priorities-without-per", lambda b: b.update_priorities([0], [1.0]), TypeError,
         r"update_priorities needs a prioritized sampler; this buffer uses Uniform", writer=True),
    Case("bad-per-alpha", lambda p: dr.Prioritized(alpha=float("nan")), ValueError,
         r"alpha must be a finite number >= 0, got nan"),
    # reads
    Case("index-not-added-yet", lambda p: dr.ReplayBuffer.open(p)[[10**6]], IndexError,
         r"row id 1000000 is not in the buffer \(readable ids per lane"),
    Case("index-negative", lambda p: dr.ReplayBuffer.open(p)[[-1]], IndexError, r"row id -1 is not in the buffer"),
    Case("index-float", lambda p: dr.ReplayBuffer.open(p)[[1.0]], IndexError,
         r"row ids must be integers, got dtype float64"),
    Case("batch-size-0", lambda p: dr.ReplayBuffer.open(p).sample(0), ValueError,
         r"batch_size must be a positive int, got 0"),
    Case("sample-empty", lambda p: dr.ReplayBuffer.open(p).sample(4), dr.EmptyBufferError,
         r"cannot sample from an empty buffer", template="empty"),
    Case("seq-len-0", lambda p: dr.ReplayBuffer.open(p).sample(4, seq_len=0), ValueError,
         r"seq_len must be a positive int, got 0"),
    # modes, writers, locations
    Case("write-read-only", lambda p: dr.ReplayBuffer.open(p).add(**one_step()), dr.ReadOnlyError,
         r"opened read-only \(mode='r'\); open it with mode='r\+' to write"),
    Case("flush-read-only", lambda p: dr.ReplayBuffer.open(p).flush(), dr.ReadOnlyError, r"opened read-only"),
    Case("bad-mode", lambda p: dr.ReplayBuffer.open(p, "w"), ValueError, r"mode must be 'r' or 'r\+', got 'w'"),
    Case("second-writer", second_writer, dr.LockedError,
         r"already open for writing by this process .*break_lock=True", writer=True),
    Case("create-over-existing", lambda p: dr.ReplayBuffer.create(p, FIELDS), dr.BufferExistsError,
         r"already exists; pass overwrite=True to replace it"),
    Case("create-over-other-files", lambda p: dr.ReplayBuffer.create(p, FIELDS, overwrite=True),
         dr.BufferExistsError, r"exists and is not a diskreplay buffer; refusing to delete it",
         prepare=lambda p: (empty_dir(p), write(os.path.join(p, "notes.txt"), b"mine"))),
    Case("capacity-not-divisible", lambda p: dr.ReplayBuffer.create(p + "-new", FIELDS, capacity=63, num_envs=2),
         ValueError, r"capacity must be a multiple of num_envs=2, got 63"),
    Case("reserved-field-name", lambda p: dr.ReplayBuffer.create(p + "-new", {"index": dr.Field((), "int64")}),
         dr.SchemaError, r"field name 'index' is reserved"),
    # not a buffer
    Case("open-missing-path", lambda p: dr.ReplayBuffer.open(p + "-nowhere"), dr.NotABufferError,
         r"-nowhere' is not a diskreplay buffer \(no commit.json\)"),
    Case("open-empty-dir", lambda p: dr.ReplayBuffer.open(p), dr.NotABufferError,
         r"is not a diskreplay buffer \(no commit.json\)", prepare=empty_dir),
    Case("open-plain-zarr-group", lambda p: dr.ReplayBuffer.open(p), dr.NotABufferError,
         r"is not a diskreplay buffer \(no commit.json\)", prepare=plain_zarr_group),
    Case("open-zarr-group-with-commit", lambda p: dr.ReplayBuffer.open(p, "r+"), dr.NotABufferError,
         r"is a zarr group but not a diskreplay buffer \(no diskreplay/1 attributes\)",
         prepare=lambda p: (plain_zarr_group(p), write(os.path.join(p, "commit.json"), b"{}"))),
    # damaged metadata and chunks
    Case("garbage-commit-json", lambda p: dr.ReplayBuffer.open(p, "r+"), dr.CorruptBufferError,
         r"commit.json is unreadable", prepare=lambda p: write(os.path.join(p, "commit.json"), b"\x00{not json")),
    Case("commit-wrong-lanes", lambda p: dr.ReplayBuffer.open(p), dr.CorruptBufferError,
         r"commit.json field 'committed': expected 2 ints in \[0, \d+\] \(one per lane\), got \[1\]",
         prepare=lambda p: edit_json(os.path.join(p, "commit.json"), lambda d: d.update(committed=[1], lower=[0]))),
    Case("garbage-group-zarr-json", lambda p: dr.ReplayBuffer.open(p, "r+"), dr.CorruptBufferError,
         r"zarr.json is not valid JSON", prepare=lambda p: write(os.path.join(p, "zarr.json"), b"garbage")),
    Case("array-dtype-rewritten", lambda p: dr.ReplayBuffer.open(p, "r+"), dr.CorruptBufferError,
         r"done/zarr.json: data_type 'int8', the buffer records bool for field 'done'",
         prepare=lambda p: edit_json(os.path.join(p, "done", "zarr.json"), set_dtype)),
    Case("array-chunks-rewritten", lambda p: dr.ReplayBuffer.open(p), dr.CorruptBufferError,
         r"act/zarr.json: chunk shape \[1, 4\], expected \[1, 8\]",
         prepare=lambda p: edit_json(os.path.join(p, "act", "zarr.json"),
                                     lambda d: d["chunk_grid"]["configuration"].update(chunk_shape=[1, 4]))),
    Case("array-missing", lambda p: dr.ReplayBuffer.open(p), dr.CorruptBufferError,
         r"array for field 'img' is missing", prepare=lambda p: shutil.rmtree(os.path.join(p, "img"))),
    Case("truncated-raw-chunk", lambda p: dr.ReplayBuffer.open(p)[[2 * ENVS * 8 + 1]], dr.CorruptBufferError,
         r"chunk 'obs/c.1.2.0' has 40 bytes, expected 100", template="raw",
         prepare=lambda p: truncate(os.path.join(p, "obs", "c.1.2.0"), 40)),
    Case("truncated-zstd-chunk", lambda p: dr.ReplayBuffer.open(p)[[3]], dr.CorruptBufferError,
         r"chunk 'act/c.1.0' does not decode",
         prepare=lambda p: truncate(os.path.join(p, "act", "c.1.0"), 5)),
    Case("deleted-chunk", lambda p: dr.ReplayBuffer.open(p).sample(256, seed=0), dr.CorruptBufferError,
         r"chunk 'done/c.0.1' is missing, but the last commit says it holds rows",
         prepare=lambda p: os.remove(os.path.join(p, "done", "c.0.1"))),
    Case("missing-state-object", lambda p: dr.ReplayBuffer.open(p), dr.CorruptBufferError,
         r"state object 'state/\d+-[0-9a-f]+\.safetensors' is missing",
         prepare=lambda p: shutil.rmtree(os.path.join(p, "state"))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_call_is_refused_and_changes_nothing(case: Case, templates, tmp_path):
    path = str(tmp_path / "buf")
    shutil.copytree(templates[case.template], path)
    if case.prepare:
        case.prepare(path)
    buf = dr.ReplayBuffer.open(path, "r+") if case.writer else None
    before = dir_snapshot(path)
    total = buf.state_dict()["total"].copy() if buf else None
    with pytest.raises(case.exc, match=case.match):
        case.call(buf if case.writer else path)
    assert dir_snapshot(path) == before, "the store changed"
    assert not os.path.exists(path + "-new")
    if buf is not None:
        np.testing.assert_array_equal(buf.state_dict()["total"], total)  # nothing staged either
        buf.extend(steps(3))  # and the writer still works
        buf.close()
        assert len(dr.ReplayBuffer.open(path)) == min(64, (20 + 3) * ENVS)


def test_table_is_big_enough():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


# ---- verify() finds the same damage, without raising or writing ------------------------------

VERIFY_CASES = {
    "garbage-commit-json": r"commit.json is unreadable",
    "commit-wrong-lanes": r"commit.json field 'committed': expected 2 ints",
    "garbage-group-zarr-json": r"zarr.json is not valid JSON",
    "array-dtype-rewritten": r"done/zarr.json: data_type 'int8', the buffer records bool",
    "array-chunks-rewritten": r"act/zarr.json: chunk shape \[1, 4\], expected \[1, 8\]",
    "array-missing": r"img/zarr.json is missing",
    "truncated-raw-chunk": r"chunk 'obs/c.1.2.0' does not decode to 96 bytes",
    "truncated-zstd-chunk": r"chunk 'act/c.1.0' does not decode",
    "deleted-chunk": r"chunk 'done/c.0.1' is missing, but commit.json says it holds rows",
    "missing-state-object": r"state object 'state/\d+-[0-9a-f]+\.safetensors' referenced by commit.json is missing",
    "open-empty-dir": r"no commit.json: not a diskreplay buffer",
    "open-zarr-group-with-commit": r"a zarr group but not a diskreplay buffer",
}


@pytest.mark.parametrize("case_id", list(VERIFY_CASES))
def test_verify_reports_damage(case_id, templates, tmp_path):
    import re

    from diskreplay.verify import verify
    case = next(c for c in CASES if c.id == case_id)
    path = str(tmp_path / "buf")
    shutil.copytree(templates[case.template], path)
    case.prepare(path)
    before = dir_snapshot(path)
    report = verify(path)
    assert not report.ok
    assert any(re.search(VERIFY_CASES[case_id], p) for p in report.problems), report.problems
    assert dir_snapshot(path) == before


@pytest.mark.parametrize("template", ["ring", "raw", "per", "empty"])
def test_verify_accepts_healthy_buffers(template, templates):
    from diskreplay.verify import verify
    report = verify(templates[template])
    assert report.ok, str(report)
    assert report.rows == (0 if template == "empty" else 20 * ENVS)
    assert report.chunks_checked == (0 if template == "empty" else 3 * ENVS * len(FIELDS))
    assert report.episodes == (0 if template == "empty" else len(dr.ReplayBuffer.open(templates[template]).episodes()))
    assert report.notes == []
