"""Ragged (variable-length) and text fields: exact values against plain Python lists through
add/extend/flush/reopen/ring overwrite, sampling next to fixed fields, `dr.Ragged`, the bad-input
table, verify of a tampered store, torch outputs, and a reader written from docs/format.md alone."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import diskreplay as dr
from diskreplay.audit import verify


def tokens(i: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int32) + 1000 * i) % 30000


def make(path: Path, **kw: Any) -> dr.ReplayBuffer:
    fields = {"obs": dr.Field((2,), "float32"), "tok": dr.Field((None,), "int32"),
              "lp": dr.Field((None,), "float32", length_of="tok"), "txt": dr.Field((), "str"),
              "pts": dr.Field((None, 3), "float16")}
    return dr.ReplayBuffer.create(str(path), fields, **kw)


def row(i: int) -> dict[str, Any]:
    n = i % 6
    return {"obs": np.full(2, i, np.float32), "tok": tokens(i, n), "lp": tokens(i, n) / 8,
            "txt": f"step {i} ✓" * (i % 3), "pts": np.full((i % 4, 3), i % 50, np.float16)}


def check_rows(rows: dict[str, Any], ids: list[int]) -> None:
    for j, i in enumerate(ids):
        want = row(i)
        assert rows["obs"][j].tolist() == want["obs"].tolist()
        assert rows["tok"][j].tolist() == want["tok"].tolist()
        assert rows["lp"][j].tolist() == want["lp"].astype(np.float32).tolist()
        assert rows["txt"][j] == want["txt"]
        assert rows["pts"][j].tolist() == want["pts"].tolist()


# ---- round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("capacity", [None, 24])
def test_add_extend_flush_reopen(tmp_path: Path, capacity: int | None) -> None:
    buf = make(tmp_path / "b", capacity=capacity, chunk_rows=4)
    for i in range(9):
        buf.add(**row(i))
    batch = [row(i) for i in range(9, 30)]
    buf.extend({name: [r[name] for r in batch] for name in batch[0]} | {"obs": np.stack([r["obs"] for r in batch])})
    ids = buf.row_ids().tolist()
    check_rows(buf[np.array(ids)], ids)
    buf.flush()
    buf.close()
    reader = dr.ReplayBuffer.open(str(tmp_path / "b"))
    assert reader.row_ids().tolist() == ids
    check_rows(reader[np.array(ids)], ids)
    assert verify(str(tmp_path / "b")).ok
    writer = dr.ReplayBuffer.open(str(tmp_path / "b"), "r+")
    for i in range(30, 37):
        writer.add(**row(i))
    writer.flush()
    ids = writer.row_ids().tolist()
    assert ids[-1] == 36
    check_rows(writer[np.array(ids)], ids)
    check_rows(dr.ReplayBuffer.open(str(tmp_path / "b"))[np.array(ids)], ids)


def test_ring_keeps_one_round_per_row_chunk(tmp_path: Path) -> None:
    """A ring retires the old rows of a row chunk when it starts overwriting it: 12 slots of 4-row
    chunks show 9 to 12 rows."""
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), {"tok": dr.Field((None,), "int32")}, capacity=12, chunk_rows=4)
    for i in range(13):
        buf.add(tok=tokens(i, i % 5))
    assert buf.row_ids().tolist() == list(range(4, 13))
    rows = buf[buf.row_ids()]
    assert [r.tolist() for r in rows["tok"]] == [tokens(i, i % 5).tolist() for i in range(4, 13)]
    for i in range(13, 16):
        buf.add(tok=tokens(i, i % 5))
    assert buf.row_ids().tolist() == list(range(4, 16))


def test_values_and_lengths_input_and_text_arrays(tmp_path: Path) -> None:
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), {"tok": dr.Field((None,), "int64"), "t": dr.Field((), "str")},
                                 num_envs=2, capacity=None, chunk_rows=3)
    buf.extend({"tok": (np.arange(10), np.array([[1, 2], [3, 0], [4, 0]])),
                "t": np.array([["a", "bé"], ["", "c"], ["dd", "e"]])})
    buf.add(tok=[np.array([7]), np.array([], np.int64)], t=[b"x", "y"])
    rows = buf[np.arange(8)]
    assert [r.tolist() for r in rows["tok"]] == [[0], [1, 2], [3, 4, 5], [], [6, 7, 8, 9], [], [7], []]
    assert rows["t"].tolist() == ["a", "bé", "", "c", "dd", "e", "x", "y"]
    assert rows["t"].dtype == object


def test_many_value_chunks_per_row(tmp_path: Path) -> None:
    """Rows that span several value chunks (65536 int32 each) read back exactly, cold and warm."""
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), {"tok": dr.Field((None,), "int32")}, capacity=None,
                                 chunk_rows=8)
    lengths = [70000, 1, 0, 140000, 5, 65536, 65535, 3]
    for i, n in enumerate(lengths * 2):
        buf.add(tok=tokens(i, n))
    buf.flush()
    for b in (buf, dr.ReplayBuffer.open(str(tmp_path / "b"))):
        for _ in range(2):
            got = b[np.array([3, 12, 0, 15, 5])]["tok"]
            assert [len(r) for r in got] == [140000, 5, 70000, 3, 65536]
            for r, i in zip(got, [3, 12, 0, 15, 5]):
                assert np.array_equal(r, tokens(i, (lengths * 2)[i]))


# ---- dr.Ragged -------------------------------------------------------------------------------

def test_ragged_type() -> None:
    r = dr.Ragged.from_rows([[1, 2], [], [3, 4, 5]], dtype=np.int32)
    assert r.offsets.tolist() == [0, 2, 2, 5] and r.offsets.dtype == np.int64
    assert r.lengths.tolist() == [2, 0, 3] and len(r) == 3
    assert r[2].tolist() == [3, 4, 5] and r[-1].tolist() == [3, 4, 5]
    padded, lengths = r.to_padded(-1)
    assert padded.tolist() == [[1, 2, -1], [-1, -1, -1], [3, 4, 5]] and lengths.tolist() == [2, 0, 3]
    assert [x.tolist() for x in r[1:]] == [[], [3, 4, 5]]
    assert [x.tolist() for x in r[np.array([2, 0])]] == [[3, 4, 5], [1, 2]]
    with pytest.raises(IndexError, match="row 3 of a Ragged of 3 rows"):
        r[3]


@pytest.mark.parametrize("extension", [True, False])
def test_gather_runs(monkeypatch: pytest.MonkeyPatch, extension: bool) -> None:
    """Runs of rows end to end, by the C extension's copy_runs and by the numpy fallback."""
    from diskreplay.format import ragged
    if not extension:
        monkeypatch.setattr(ragged, "_COPY_RUNS", None)
    elif ragged._COPY_RUNS is None:
        pytest.skip("the _batch extension is not built with copy_runs")
    source = np.arange(30, dtype=np.int16).reshape(10, 3)
    got = ragged.gather_runs(source, np.array([7, 0, 4]), np.array([2, 0, 3]))
    assert got.tolist() == source[[7, 8, 4, 5, 6]].tolist()
    if extension:
        with pytest.raises(ValueError, match="run 0 falls outside the source or the target"):
            ragged._COPY_RUNS(source, np.empty(6, np.int16), np.array([54]), np.array([8]))


# ---- schema ----------------------------------------------------------------------------------

def test_field_json_round_trip_and_old_json() -> None:
    for f in (dr.Field((None,), "int32"), dr.Field((None, 3), "float16"), dr.Field((), "str"),
              dr.Field((None,), "float32", length_of="tok"), dr.Field((4,), "uint8")):
        assert dr.Field.from_json(json.loads(json.dumps(f.to_json()))) == f
    assert dr.Field((), "str").to_json() == {"shape": [], "dtype": "str"}
    assert dr.Field((None, 3), "float32").to_json() == {"shape": [None, 3], "dtype": "<f4"}
    assert dr.Field.from_json({"shape": [17], "dtype": "<f4"}) == dr.Field((17,), "float32")
    assert not dr.Field.from_json({"shape": [17], "dtype": "<f4"}).ragged


@pytest.mark.parametrize(("fields", "match"), [
    ({"a": dr.Field((None,), "int32", length_of="b")}, "length_of='b' must name a ragged"),
    ({"a": dr.Field((), "str"), "b": dr.Field((None,), "uint8", length_of="a")}, "length_of='a' must name"),
])
def test_bad_length_of(tmp_path: Path, fields: dict[str, dr.Field], match: str) -> None:
    with pytest.raises(dr.SchemaError, match=match):
        dr.ReplayBuffer.create(str(tmp_path / "b"), fields)
    assert not (tmp_path / "b").exists()


def test_length_of_needs_ragged_and_text_needs_scalar() -> None:
    with pytest.raises(dr.SchemaError, match=r"length_of='x' needs a ragged field \(shape \(None, ...\)\)"):
        dr.Field((3,), "int32", length_of="x")
    with pytest.raises(dr.SchemaError, match=r"a text field is declared Field\(\(\), 'str'\), got shape \(4,\)"):
        dr.Field((4,), "str")


@pytest.mark.parametrize(("option", "kw"), [
    ("derive_next", {"derive_next": ("tok",), "episode_end": "done"}),
    ("episode_end", {"episode_end": "flag"}),
])
def test_ragged_fields_refused_where_a_fixed_shape_is_needed(tmp_path: Path, option: str, kw: dict) -> None:
    fields = {"tok": dr.Field((None,), "int32"), "next_tok": dr.Field((None,), "int32"),
              "done": dr.Field((), "bool"), "flag": dr.Field((None,), "bool")}
    with pytest.raises((dr.SchemaError, ValueError), match=f"{option}: .*field '(tok|flag)'"):
        dr.ReplayBuffer.create(str(tmp_path / "b"), fields, **kw)


def test_stacking_a_ragged_field_is_refused(tmp_path: Path) -> None:
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), {"tok": dr.Field((None,), "int32"), "done": dr.Field((), "bool")},
                                 episode_end="done")
    for i in range(5):
        buf.add(tok=tokens(i, i), done=False)
    with pytest.raises(dr.SchemaError, match="stack_fields: field 'tok' is ragged"):
        buf.sample(2, stack=2, stack_fields=("tok",))


# ---- bad input: refused before anything is written --------------------------------------------

@pytest.mark.parametrize(("change", "match"), [
    ({"lp": np.zeros(3, np.float32)}, r"field 'lp' \(length_of='tok'\): row lengths \[3\] differ from those of "
                                      r"'tok': \[2\]"),
    ({"pts": np.zeros((2, 4), np.float16)}, r"field 'pts': expected each row shaped \(n, \*\(3,\)\), got row 0 "
                                            r"shaped \(2, 4\)"),
    ({"txt": b"\xff\xfe"}, r"field 'txt': bytes b'\\xff\\xfe' are not valid UTF-8 \(invalid start byte at byte 0\)"),
    ({"txt": 5}, r"field 'txt': expected str \(or UTF-8 bytes\), got int"),
    ({"tok": np.array([1.5, 2.5])}, "field 'tok': expected dtype int32"),
    ({"tok": (np.arange(3), np.array([2]))}, r"field 'tok': expected lengths of non-negative ints shaped \(\)"),
])
def test_bad_input_is_refused(tmp_path: Path, change: dict[str, Any], match: str) -> None:
    buf = make(tmp_path / "b", capacity=None, chunk_rows=4)
    buf.add(**row(1))
    buf.flush()
    step = row(2) | change
    with pytest.raises(dr.SchemaError, match=match):
        buf.add(**step)
    assert len(buf) == 1
    buf.add(**row(1))
    check_rows(buf[np.array([0, 1])], [1, 1])


def test_extend_lengths_must_match_length_of(tmp_path: Path) -> None:
    buf = make(tmp_path / "b", capacity=None, chunk_rows=4)
    with pytest.raises(dr.SchemaError, match=r"field 'lp' \(length_of='tok'\): row lengths \[1, 1\] differ from "
                                             r"those of 'tok': \[1, 2\]"):
        buf.extend({"obs": np.zeros((2, 2), np.float32), "tok": [np.zeros(1, np.int32), np.zeros(2, np.int32)],
                    "lp": [np.zeros(1), np.zeros(1)], "txt": ["a", "b"], "pts": [np.zeros((0, 3))] * 2})
    assert len(buf) == 0


# ---- sampling next to fixed fields ------------------------------------------------------------

@pytest.mark.parametrize("sampler", [None, dr.Prioritized()])
def test_sampling_uniform_prioritized_and_slices(tmp_path: Path, sampler: Any) -> None:
    fields = {"obs": dr.Field((2,), "float32"), "done": dr.Field((), "bool"), "tok": dr.Field((None,), "int32"),
              "txt": dr.Field((), "str")}
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), fields, capacity=40, chunk_rows=8, episode_end="done",
                                 sampler=sampler)
    for i in range(70):
        buf.add(obs=np.full(2, i, np.float32), done=i % 7 == 6, tok=tokens(i, i % 5), txt=str(i))
    batch = buf.sample(16, seed=3)
    for j, i in enumerate(batch["index"].tolist()):
        assert batch["tok"][j].tolist() == tokens(i, i % 5).tolist() and batch["txt"][j] == str(i)
        assert batch["obs"][j, 0] == i
    if sampler is not None:
        buf.update_priorities(batch["index"], np.arange(16) + 1.0)
    sliced = buf.sample(4, seq_len=3, seed=1)
    assert isinstance(sliced["tok"], dr.Ragged) and len(sliced["tok"]) == 12
    for j, i in enumerate(sliced["index"].reshape(-1).tolist()):
        assert sliced["tok"][j].tolist() == tokens(i, i % 5).tolist()
        assert sliced["txt"].reshape(-1)[j] == str(i)
    stacked = buf.sample(4, stack=2, seed=2)
    assert stacked["obs"].shape == (4, 2, 2)
    for j, i in enumerate(stacked["index"].tolist()):
        assert stacked["tok"][j].tolist() == tokens(i, i % 5).tolist()


# ---- verify and reads of a tampered store ------------------------------------------------------

def test_tampered_ends_are_found(tmp_path: Path) -> None:
    url = str(tmp_path / "b")
    buf = dr.ReplayBuffer.create(url, {"tok": dr.Field((None,), "int32")}, capacity=None, chunk_rows=4)
    for i in range(10):
        buf.add(tok=tokens(i, i))
    buf.flush()
    buf.close()
    ends = zarr.open_array(url + "/tok.ends", mode="r+")
    assert ends[0, :].tolist() == [0, 1, 3, 6, 4, 9, 15, 22, 8, 17]
    ends[0, 5] = 2
    assert verify(url).problems == [
        "ragged field 'tok': row chunk 1 of lane 0: row 1 has values [4, 2) in tok.ends: ends that do not add up "
        "(a start after its end) or pass the 65536 values of tok/zarr.json"]
    reader = dr.ReplayBuffer.open(url)
    with pytest.raises(dr.CorruptBufferError, match=r"ragged field 'tok': row chunk 1 of lane 0 has values \[4, 2\): "
                                                    r"ends that do not add up"):
        reader[np.array([5])]
    ends[0, 5] = 1 << 20
    with pytest.raises(dr.CorruptBufferError, match=r"ragged field 'tok': row chunk 1 of lane 0 has a row ending at "
                                                    r"value 1048576, beyond the 65536 values its array holds"):
        dr.ReplayBuffer.open(url)[np.array([5])]
    assert "pass the 65536 values" in verify(url).problems[0]


def test_missing_value_chunk(tmp_path: Path) -> None:
    url = str(tmp_path / "b")
    buf = dr.ReplayBuffer.create(url, {"tok": dr.Field((None,), "int32")}, capacity=None, chunk_rows=4)
    for i in range(6):
        buf.add(tok=tokens(i, 3))
    buf.flush()
    (tmp_path / "b" / "tok" / "c.0.1.0").unlink()
    assert verify(url).problems == [
        "ragged field 'tok': row chunk 1 of lane 0: value chunk 'tok/c.0.1.0' is missing, but visible rows reach it"]
    with pytest.raises(dr.CorruptBufferError, match=r"chunk 'tok/c.0.1.0' is missing"):
        dr.ReplayBuffer.open(url)[np.array([4])]


# ---- torch ----------------------------------------------------------------------------------

def test_torch_nested_and_packed(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    buf = make(tmp_path / "b", capacity=None, chunk_rows=4)
    for i in range(12):
        buf.add(**row(i))
    buf.flush()
    got = buf.rows(np.array([3, 7, 2]), format="torch")
    assert got["tok"].is_nested and got["tok"].layout == torch.jagged
    assert [t.tolist() for t in got["tok"].unbind()] == [tokens(i, i % 6).tolist() for i in (3, 7, 2)]
    assert got["txt"].tolist() == [row(i)["txt"] for i in (3, 7, 2)]
    ds = buf.as_dataset(4, mode="epoch", shuffle="none", ragged="packed")
    first = next(iter(ds))
    assert first["tok"].tolist() == np.concatenate([tokens(i, i % 6) for i in range(4)]).tolist()
    assert first["tok_cu_seqlens"].dtype == torch.int32
    assert first["tok_cu_seqlens"].tolist() == [0, 0, 1, 3, 6]
    assert first["tok_max_seqlen"] == 3
    with pytest.raises(ValueError, match="ragged must be 'nested' or 'packed', got 'flat'"):
        buf.as_dataset(4, ragged="flat")


# ---- a reader written from docs/format.md, section 12, alone -----------------------------------

def read_ragged_as_documented(url: str, name: str, lane: int, step: int) -> np.ndarray | str:
    """Section 12 with zarr-python and numpy only."""
    config = zarr.open_group(url, mode="r").attrs["diskreplay"]
    spec = config["fields"][name]
    owner = spec.get("length_of") or name
    capacity, chunk_rows = config["lane_capacity"], config["chunk_rows"]
    s = step % capacity if capacity else step
    c, r = divmod(s, chunk_rows)
    ends = zarr.open_array(f"{url}/{owner}.ends", mode="r")
    end = int(ends[lane, s])
    start = int(ends[lane, s - 1]) if r > 0 else 0
    values = zarr.open_array(f"{url}/{name}", mode="r")[lane, c, start:end]
    return bytes(values).decode("utf-8") if spec["dtype"] == "str" else values


def test_reader_from_the_format_document(tmp_path: Path) -> None:
    url = str(tmp_path / "b")
    buf = make(tmp_path / "b", capacity=16, num_envs=2, chunk_rows=4, compression="zstd")
    for i in range(21):
        buf.add(**{k: [v, v] if k != "obs" else np.stack([v, v]) for k, v in row(i).items()})
    buf.flush()
    commit = json.loads((tmp_path / "b" / "diskreplay" / "objects" / "commit.json").read_text())
    for lane in range(2):
        first = max(commit["lower"][lane], commit["committed"][lane] - 8)
        for step in range(first, commit["committed"][lane]):
            want = row(step)
            for name in ("tok", "lp", "pts"):
                assert read_ragged_as_documented(url, name, lane, step).tolist() == want[name].tolist()
            assert read_ragged_as_documented(url, "txt", lane, step) == want["txt"]


# ---- a model: add/extend/flush/reopen/ring overwrite against a list of arrays ------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 9)),
    st.tuples(st.just("extend"), st.lists(st.integers(0, 9), min_size=1, max_size=9)),
    st.tuples(st.just("flush"), st.none()),
    st.tuples(st.just("reopen"), st.none())), max_size=25)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, capacity=st.sampled_from([None, 6, 10]), chunk_rows=st.sampled_from([2, 3, 4]))
def test_model(tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, Any]], capacity: int | None,
               chunk_rows: int) -> None:
    url = str(tmp_path_factory.mktemp("m") / "b")
    fields = {"tok": dr.Field((None, 2), "int16"), "txt": dr.Field((), "str")}
    buf = dr.ReplayBuffer.create(url, fields, capacity=capacity, chunk_rows=min(chunk_rows, capacity or chunk_rows))
    model: list[np.ndarray] = []

    def value(n: int) -> np.ndarray:
        return (np.arange(2 * n, dtype=np.int16) + 7 * len(model)).reshape(n, 2)

    for op, arg in ops:
        if op == "add":
            v = value(arg)
            buf.add(tok=v, txt="é" * arg)
            model.append(v)
        elif op == "extend":
            vs = []
            for n in arg:
                vs.append(value(n))
                model.append(vs[-1])
            buf.extend({"tok": vs, "txt": ["é" * n for n in arg]})
        elif op == "flush":
            buf.flush()
        else:  # close flushes
            buf.close()
            buf = dr.ReplayBuffer.open(url, "r+")
        ids = buf.row_ids()
        assert ids.tolist() == list(range(len(model)))[-len(ids):] if len(ids) else True
        if capacity is not None:
            assert capacity - min(chunk_rows, capacity) < len(ids) <= capacity or len(model) < capacity
        rows = buf[ids]
        for j, i in enumerate(ids.tolist()):
            assert np.array_equal(rows["tok"][j], model[i])
            assert rows["txt"][j] == "é" * len(model[i])
    buf.close()


# ---- readers of a live writer, shards ---------------------------------------------------------

def test_reader_follows_rows_appended_to_a_cached_row_chunk(tmp_path: Path) -> None:
    """A reader that cached a value chunk reads it again for rows its writer appended since."""
    url = str(tmp_path / "b")
    writer = dr.ReplayBuffer.create(url, {"tok": dr.Field((None,), "int32")}, capacity=None, chunk_rows=64)
    writer.add(tok=tokens(0, 3))
    writer.flush()
    reader = dr.ReplayBuffer.open(url)
    assert reader[np.array([0])]["tok"][0].tolist() == tokens(0, 3).tolist()
    writer.add(tok=tokens(1, 5))
    writer.flush()
    reader.refresh()
    assert [r.tolist() for r in reader[np.array([0, 1])]["tok"]] == [tokens(0, 3).tolist(), tokens(1, 5).tolist()]


def test_sharded_union(tmp_path: Path) -> None:
    url = str(tmp_path / "b")
    fields = {"tok": dr.Field((None,), "int32"), "txt": dr.Field((), "str")}
    dr.ReplayBuffer.create(url, fields, capacity=64, shards=2, chunk_rows=4).close()
    writers = [dr.ReplayBuffer.open_shard(url, shard, "r+") for shard in range(2)]
    for step in range(10):
        for shard, writer in enumerate(writers):
            writer.add(tok=tokens(100 * shard + step, step % 4), txt=f"{shard}-{step}")
    for writer in writers:
        writer.close()
    batch = dr.ReplayBuffer.open(url).sample(32, seed=0)
    for text, got in zip(batch["txt"].tolist(), batch["tok"]):
        shard, step = map(int, text.split("-"))
        assert got.tolist() == tokens(100 * shard + step, step % 4).tolist()


def test_buffer_spec_round_trip() -> None:
    spec = dr.BufferSpec(fields={"t": dr.Field((None, 2), "int32"), "lp": dr.Field((None, 2), "float32", length_of="t"),
                                 "s": dr.Field((), "str"), "o": dr.Field((3,), "float32")})
    data = spec.to_dict()
    assert data["fields"]["t"] == {"shape": [None, 2], "dtype": "int32"}
    assert data["fields"]["lp"] == {"shape": [None, 2], "dtype": "float32", "length_of": "t"}
    assert data["fields"]["s"] == {"shape": [], "dtype": "str"}
    assert dr.BufferSpec.from_dict(data).fields == spec.fields
    assert dr.BufferSpec.from_json(spec.to_json()).fields == spec.fields


def test_n_step_and_derive_next_beside_a_ragged_field(tmp_path: Path) -> None:
    fields = {"obs": dr.Field((2,), "float32"), "reward": dr.Field((), "float32"), "done": dr.Field((), "bool"),
              "next_obs": dr.Field((2,), "float32"), "tok": dr.Field((None,), "int32")}
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), fields, capacity=64, chunk_rows=8, episode_end="done",
                                 derive_next=("obs",))
    for i in range(50):
        buf.add(obs=np.full(2, i, np.float32), reward=1.0, done=i % 9 == 8, next_obs=np.full(2, i + 1, np.float32),
                tok=tokens(i, i % 3))
    for batch in (buf.sample(8, n_step=3, seed=0), buf.sample(8, n_step=3, stack=2, seed=1)):
        for j, i in enumerate(batch["index"].tolist()):
            assert batch["tok"][j].tolist() == tokens(i, i % 3).tolist()


def test_rows_of_2d_ids_and_out_refused_for_ragged(tmp_path: Path) -> None:
    buf = make(tmp_path / "b", capacity=None, chunk_rows=4)
    for i in range(6):
        buf.add(**row(i))
    got = buf.rows(np.array([[0, 1], [4, 5]]))
    assert got["obs"].shape == (2, 2, 2) and got["txt"].shape == (2, 2)
    assert [r.tolist() for r in got["tok"]] == [tokens(i, i % 6).tolist() for i in (0, 1, 4, 5)]
    with pytest.raises(ValueError, match=r"out\['tok'\]: field 'tok' is ragged: its rows come as a dr.Ragged"):
        buf.rows(np.array([0, 1]), out={"tok": np.zeros(2, np.int32)})


def test_writer_writes_held_values_between_flushes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past HELD_BYTES of staged values an append writes them (not only at a flush); rows read
    back exactly, from the writer and after reopening."""
    import diskreplay.storage.buffer_storage as buffer_storage
    monkeypatch.setattr(buffer_storage, "HELD_BYTES", 1 << 16)
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), {"tok": dr.Field((None,), "int32")}, capacity=None)
    want = [tokens(i, i % 700) for i in range(3000)]
    for first in range(0, 3000, 100):
        buf.extend({"tok": want[first:first + 100]})
        assert buf.storage._values.held_bytes <= (1 << 16) + 100 * 700 * 4
    got = buf[np.arange(3000)]["tok"]
    assert all(np.array_equal(got[i], want[i]) for i in range(3000))
    buf.close()
    got = dr.ReplayBuffer.open(str(tmp_path / "b"))[np.arange(3000)]["tok"]
    assert all(np.array_equal(got[i], want[i]) for i in range(3000))


def test_ring_reader_never_gets_values_of_overwritten_rows(tmp_path: Path) -> None:
    """A ring reader that did not refresh while its writer wrapped: every row it samples holds its
    own values (a stale read makes it adopt the newest commit and draw again)."""
    url = str(tmp_path / "b")
    writer = dr.ReplayBuffer.create(url, {"x": dr.Field((), "int64"), "tok": dr.Field((None,), "int32")},
                                    capacity=16, chunk_rows=4)
    step = 0
    for _ in range(12):
        writer.add(x=step, tok=tokens(step, step % 5 + 1))
        step += 1
    writer.flush()
    reader = dr.ReplayBuffer.open(url)
    steps = np.arange(12)  # the ends (a fixed field) cached at the first commit, not the values
    reader.storage.gather(np.zeros(12, np.int64), steps, ("x", "tok.ends"))
    for round_ in range(6):
        for _ in range(7):
            writer.add(x=step, tok=tokens(step, step % 5 + 1))
            step += 1
        writer.flush()
        batch = reader.sample(8, seed=round_)
        for j, i in enumerate(batch["index"].tolist()):
            assert batch["x"][j] == i and batch["tok"][j].tolist() == tokens(i, i % 5 + 1).tolist()
    assert reader.stats().stale_reads > 0


def test_extend_needs_a_row_axis(tmp_path: Path) -> None:
    buf = dr.ReplayBuffer.create(str(tmp_path / "b"), {"o": dr.Field((), "float32"), "t": dr.Field((), "str")})
    with pytest.raises(dr.SchemaError, match=r"extend expects arrays with a leading step axis \(N, \*field.shape\); "
                                             r"got shapes {'o': \(\), 't': \(\)}"):
        buf.extend({"o": 1.0, "t": "abc"})
    with pytest.raises(dr.SchemaError, match=r"field 'o': expected shape \(2,\), got \(\)"):
        buf.extend({"o": 1.0, "t": ["a", "bc"]})
    assert len(buf) == 0


def test_xarray_opens_a_buffer_with_ragged_fields(tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    buf = make(tmp_path / "b", capacity=None, chunk_rows=4)
    for i in range(9):
        buf.add(**row(i))
    buf.close()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = xr.open_zarr(str(tmp_path / "b"), consolidated=False)
    assert ds["tok"].dims == ("lane", "tok_chunk", "tok_value")
    assert ds["pts"].dims == ("lane", "pts_chunk", "pts_value", "pts_dim0")
    assert ds["tok.ends"].dims == ("lane", "step") and "lp.ends" not in ds


def test_info_and_export(tmp_path: Path) -> None:
    from diskreplay.audit.info import buffer_info
    buf = make(tmp_path / "b", capacity=None, chunk_rows=4)
    for i in range(5):
        buf.add(**row(i))
    buf.close()
    fields = buffer_info(str(tmp_path / "b"))["fields"]
    assert fields["tok"] == {"shape": [None], "dtype": "int32"}
    assert fields["lp"] == {"shape": [None], "dtype": "float32"}
    assert fields["pts"] == {"shape": [None, 3], "dtype": "float16"}
    assert fields["txt"] == {"shape": [], "dtype": "str"}
    with pytest.raises(ValueError, match=r"export to 'npz' does not support ragged or text fields; .* has "
                                         r"\['tok', 'lp', 'txt', 'pts'\]: export to 'parquet'"):
        dr.export_buffer(str(tmp_path / "b"), str(tmp_path / "out.npz"), progress=False)
    assert not (tmp_path / "out.npz").exists() and not (tmp_path / "out.npz.partial").exists()


def test_value_chunks_stay_cached_within_cache_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader keeps up to half its ``cache_bytes`` of value chunks: once every row was read, batches
    read no value chunk again (64 MiB of values, far more than its chunk cache of the ends)."""
    from diskreplay.io.local import LocalChunkStore

    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 1024, 32_768)
    with dr.ReplayBuffer.create(tmp_path / "b", {"tokens": dr.Field((None,), "int32")}, capacity=None,
                                chunk_rows=64) as buf:  # the chunk cache of its ends holds at most 64 MiB
        buf.extend({"tokens": (rng.integers(0, 50_000, int(lengths.sum()), dtype=np.int32), lengths)})
    reads: list[str] = []

    def counted(method: Any) -> Any:
        def read(self: LocalChunkStore, key: str, *args: Any, **kw: Any) -> Any:
            if self.root.startswith(str(tmp_path)):  # not another test's writer renewing its lease meanwhile
                reads.append(key)
            return method(self, key, *args, **kw)
        return read

    with dr.ReplayBuffer.open(tmp_path / "b", cache_bytes=256 << 20) as reader:
        for first in range(0, len(lengths), 4096):
            reader[np.arange(first, min(first + 4096, len(lengths)))]
        for name in ("get", "read_into"):
            monkeypatch.setattr(LocalChunkStore, name, counted(getattr(LocalChunkStore, name)))
        for seed in range(20):
            got = reader.sample(256, seed=seed)
            np.testing.assert_array_equal(got["tokens"].lengths, lengths[got["index"]])
    assert reads == []
