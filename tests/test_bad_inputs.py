"""Bad input is refused before anything is written: a table of bad calls, each with the specific
exception and message it must raise, and a check that the store's files are byte-for-byte what
they were before the call (every file's bytes, lock file included).

Sections: rows that do not fit the schema, priorities, reads, modes/writers/locations, not a
buffer, damaged chunks, then (issue #11) tampered ``commit.json``, tampered group config,
tampered array metadata, tampered state objects, lock files, snapshots, `create` arguments,
calls on writers/readers and on closed buffers. Every case runs in a directory of its own:
``<case>/site/buf`` is the store, so a crafted key ``../../x`` names ``<case>/x``; every file
under ``<case>`` (the store, a snapshot beside it, a planted victim file) must be unchanged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import zarr
from conftest import OWN, dir_snapshot, same_state
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

import diskreplay as dr
from diskreplay.episodes.index import END_RECORD
from diskreplay.format.codecs import checksum
from diskreplay.sampling.prioritized import PRIORITY_RECORD

FIELDS = {"obs": dr.Field((3,), "float32"), "act": dr.Field((), "int16"), "done": dr.Field((), "bool"),
          "img": dr.Field((2, 2), "uint8"), "temp": dr.Field((), "float16")}
ENVS = 2
STEPS = 20  # steps per lane in every template but "empty"
METADATA_LIMIT = 16 << 20  # format.keys.MAX_METADATA_BYTES
STATE_OBJECT = r"state object 'state/\d{12}-[0-9a-f]{16}\.safetensors'"
CLOSED = r"buffer '[^']*buf' is closed; open it again to use it"
UNREADABLE_LOCK = r"already open for writing by an unreadable lock object .*break_lock=True"


def steps(n: int) -> dict[str, np.ndarray]:
    i = np.arange(n * ENVS).reshape(n, ENVS)
    return {"obs": np.stack([i, i, i], -1).astype(np.float32), "act": i.astype(np.int16),
            "done": i % 5 == 4,
            "img": np.zeros((n, ENVS, 2, 2), np.uint8) + (i % 250).astype(np.uint8)[..., None, None],
            "temp": (i % 100).astype(np.float16)}


def one_step() -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in steps(1).items()}


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Closed buffers to copy per case: zstd ring (2 lanes, 20 steps each), raw dataset,
    prioritized (alpha 0.6 and 1), without-replacement (lz4, one batch drawn), empty."""
    root = tmp_path_factory.mktemp("templates")
    out = {}
    for name, kw in {"ring": dict(capacity=64, compression="zstd"),
                     "raw": dict(capacity=None, compression=None),
                     "per": dict(capacity=64, compression="zstd", sampler=dr.Prioritized()),
                     "per1": dict(capacity=64, compression="zstd", sampler=dr.Prioritized(alpha=1.0)),
                     "wor": dict(capacity=64, compression="lz4", sampler=dr.WithoutReplacement())}.items():
        path = str(root / name)
        buf = dr.ReplayBuffer.create(path, FIELDS, num_envs=ENVS, chunk_rows=8, seed=0, **kw)
        buf.extend(steps(STEPS))
        if name == "wor":
            buf.sample(4)  # an epoch in progress: its bounds and cursor are saved
        buf.close()
        out[name] = path
    empty = str(root / "empty")
    dr.ReplayBuffer.create(empty, FIELDS, num_envs=ENVS, capacity=64, chunk_rows=8).close()
    out["empty"] = empty
    return out


@dataclass
class Case:
    id: str
    call: Callable[[Any], Any]  # gets the buffer path (already prepared), or a buffer (writer/closed); must raise
    exc: type[BaseException] | tuple[type[BaseException], ...]
    match: str
    template: str = "ring"
    prepare: Callable[[str], None] | None = None  # damage the copy before hashing
    writer: bool = False  # call gets an open r+ buffer instead of the path
    closed: bool = False  # call gets an r+ buffer that was closed (flushed) before hashing
    second: str | None = None  # a template copied to "<path>-2" (a second location)
    after: Callable[[str], None] | None = None  # a further check, once the files are shown unchanged


# ---- helpers that build damaged files ---------------------------------------------------------

DELETE = object()  # as a value in edit_*: remove the key


def edit_json(path: str, fn: Callable[[dict], None]) -> None:
    with open(path) as fh:
        data = json.load(fh)
    fn(data)
    with open(path, "w") as fh:
        json.dump(data, fh)


def set_path(data: Any, dotted: str, value: Any) -> None:
    """``data["a"]["b"] = value`` for ``dotted="a.b"`` (DELETE removes it)."""
    *parents, last = [int(k) if k.isdigit() else k for k in dotted.split(".")]  # digits index lists
    for key in parents:
        data = data[key]
    if value is DELETE:
        del data[last]
    else:
        data[last] = value


def edit_doc(key: str, changes: dict[str, Any]) -> Callable[[str], None]:
    """A prepare step that sets dotted paths in the JSON document ``key`` of the store."""
    return lambda p: edit_json(os.path.join(p, key), lambda d: [set_path(d, k, v) for k, v in changes.items()])


def edit_commit(**changes: Any) -> Callable[[str], None]:
    """``edit_commit(lower=[21, 0])``; nested keys with ``**{"extra.state_arrays": ...}``."""
    return edit_doc(OWN + "commit.json", changes)


def edit_state_json(**changes: Any) -> Callable[[str], None]:
    """The JSON part of the saved state (commit.json ``extra.state``), by dotted path."""
    return edit_doc(OWN + "commit.json", {f"extra.state.{k}": v for k, v in changes.items()})


def edit_config(**changes: Any) -> Callable[[str], None]:
    """The group's ``attributes.diskreplay`` config, by dotted path."""
    return edit_doc("zarr.json", {f"attributes.diskreplay.{k}": v for k, v in changes.items()})


def edit_group(**changes: Any) -> Callable[[str], None]:
    return edit_doc("zarr.json", changes)


def edit_array(field: str, **changes: Any) -> Callable[[str], None]:
    return edit_doc(f"{field}/zarr.json", changes)


def state_key(p: str) -> str:
    with open(os.path.join(p, OWN, "commit.json")) as fh:
        return json.load(fh)["extra"]["state_arrays"]


def edit_arrays(path: str, **changes: Any) -> None:
    """Rewrite a safetensors file (still valid) with some arrays changed: a value is the new
    array, a function of the old one, or DELETE."""
    with open(path, "rb") as fh:
        arrays = dict(st_load(fh.read()))
    for name, value in changes.items():
        if value is DELETE:
            del arrays[name]
        else:
            arrays[name] = np.ascontiguousarray(value(arrays[name]) if callable(value) else value)
    write(path, st_save(arrays))


def journal_file(p: str, path: str, name: str | None = None) -> str:
    """The file of one object of the journal at state ``path`` (default: its tail)."""
    with open(os.path.join(p, OWN, "commit.json")) as fh:
        ref = json.load(fh)["extra"]["state"]
    for part in path.split("."):
        ref = ref[part]
    ref = ref["__journal__"]
    return os.path.join(p, OWN, "state", path, ref["generation"], name or f"tail-{ref['tail']}")


def edit_journal(path: str, dtype: np.dtype, change: Callable[[np.ndarray], np.ndarray]) -> Callable[[str], None]:
    """Rewrite the records of a journal's tail (crafted: with a matching checksum)."""
    def prepare(p: str) -> None:
        with open(journal_file(p, path), "rb") as fh:
            records = np.frombuffer(fh.read()[:-4], dtype).copy()
        write_journal_object(journal_file(p, path), np.ascontiguousarray(change(records)).tobytes())
    return prepare


def write_journal_object(path: str, body: bytes) -> None:
    """A journal object of ``body`` and its CRC32C, as diskreplay writes one."""
    write(path, body + checksum(body))


def reseal_state(p: str) -> None:
    """Record the state object's present CRC32C in commit.json: the object is crafted, not damaged."""
    with open(os.path.join(p, OWN, state_key(p)), "rb") as fh:
        crc = int.from_bytes(checksum(fh.read()), "little")
    edit_commit(**{"extra.state_arrays_crc32c": crc})(p)


def flip_bit(file: Callable[[str], str], at: int) -> Callable[[str], None]:
    """Flip the lowest bit of byte ``at`` of the file ``file(path)``: damage no other check sees."""
    def prepare(p: str) -> None:
        with open(file(p), "rb") as fh:
            data = bytearray(fh.read())
        data[at] ^= 1
        write(file(p), bytes(data))
    return prepare


def set_record(records: np.ndarray, at: int, name: str, value: Any) -> np.ndarray:
    records[name][at] = value
    return records


def nested(depth: int) -> dict:
    """A JSON object nesting ``depth`` objects."""
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def set_at(array: np.ndarray, at: int, value: Any) -> np.ndarray:
    array = array.copy()
    array[at] = value
    return array


def edit_state(**changes: Any) -> Callable[[str], None]:
    """The buffer's state object, rewritten by `edit_arrays` (crafted: commit.json records its checksum)."""
    return lambda p: (edit_arrays(os.path.join(p, OWN, state_key(p)), **changes), reseal_state(p))


def damage_state(data: bytes | Callable[[bytes], bytes]) -> Callable[[str], None]:
    """Replace the state object's bytes (or transform them), crafted: commit.json records their checksum."""
    def prepare(p: str) -> None:
        path = os.path.join(p, OWN, state_key(p))
        with open(path, "rb") as fh:
            old = fh.read()
        write(path, data(old) if callable(data) else data)
        reseal_state(p)
    return prepare


def write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)


def write_key(key: str, data: bytes) -> Callable[[str], None]:
    return lambda p: write(os.path.join(p, key), data)


def truncate(path: str, keep: int) -> None:
    with open(path, "rb") as fh:
        data = fh.read()
    write(path, data[:keep])


def truncate_key(key: str, keep: int) -> Callable[[str], None]:
    return lambda p: truncate(os.path.join(p, key), keep)


def oversize_key(key: str) -> Callable[[str], None]:
    """The document, still valid JSON, padded past the metadata limit."""
    def prepare(p: str) -> None:
        with open(os.path.join(p, key), "rb") as fh:
            data = fh.read()
        write(os.path.join(p, key), data + b" " * (METADATA_LIMIT + 1))
    return prepare


def replace_by_dir(key: str) -> Callable[[str], None]:
    """A directory where the object ``key`` should be."""
    def prepare(p: str) -> None:
        path = os.path.join(p, key)
        if os.path.exists(path):
            os.remove(path)
        os.makedirs(path)
    return prepare


def chain(*prepares: Callable[[str], None]) -> Callable[[str], None]:
    def prepare(p: str) -> None:
        for step in prepares:
            step(p)
    return prepare


def symlink_loop(p: str) -> None:
    """``<p>-loop``: a symbolic link to itself."""
    os.symlink(p + "-loop", p + "-loop")


def failed_write_note(p: str, note: bytes) -> None:
    """``p`` holds only the note a failed distributed write leaves."""
    empty_dir(p)
    write(os.path.join(p, "diskreplay", "objects", "write-failed.json"), note)


def symlink_to_nothing(p: str) -> None:
    os.symlink(p + "-nowhere", p + "-dangling")


def plain_zarr_group(path: str) -> None:
    shutil.rmtree(path)
    zarr.open_group(path, mode="w").create_array("x", shape=(4,), dtype="float32")


def empty_dir(path: str) -> None:
    shutil.rmtree(path)
    os.makedirs(path)


def regular_file(path: str) -> None:
    shutil.rmtree(path)
    write(path, b"not a buffer")


def set_dtype(data: dict) -> None:
    data["data_type"] = "int8"


def bad_step(**changes: Any) -> dict[str, np.ndarray]:
    row = one_step()
    row.update(changes)
    return {k: v for k, v in row.items() if v is not None}


def bad_steps(n: int = 3, **changes: Any) -> dict[str, np.ndarray]:
    data = steps(n)
    data.update(changes)
    return data


def second_writer(buf: dr.ReplayBuffer) -> None:
    dr.ReplayBuffer.open(buf.url, "r+")


def open_ro(p: str) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.open(p)


def open_rw(p: str) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.open(p, "r+")


def open_with(mode: str = "r", **options: Any) -> Callable[[str], dr.ReplayBuffer]:
    return lambda p: dr.ReplayBuffer.open(p, mode, **options)


def open_and_flush(p: str) -> None:
    dr.ReplayBuffer.open(p, "r+").flush()


def victim_path(p: str) -> str:
    """Where the crafted key ``../../victim.safetensors`` of the store at ``p`` points."""
    return os.path.normpath(os.path.join(p, OWN, "..", "..", "victim.safetensors"))


def plant_victim(p: str) -> None:
    """A copy of the real state object outside the store: if a crafted key made the library read
    it, open would succeed; if it made a writer delete it, it would be gone."""
    shutil.copyfile(os.path.join(p, OWN, state_key(p)), victim_path(p))


def victim_intact(p: str) -> None:
    assert os.path.isfile(victim_path(p)), "the file the crafted state_arrays key names was deleted"


def reader_still_opens(p: str) -> None:
    with dr.ReplayBuffer.open(p) as buf:
        assert len(buf) == STEPS * ENVS
        assert buf[[0]]["act"].tolist() == [0]


def lock_record(**record: Any) -> Callable[[str], None]:
    """A lock object whose holder looks alive (this host), with ``record`` overriding fields."""
    data = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "token": "t" * 32, **record}
    return write_key(OWN + "writer.lock", json.dumps(data).encode())


# ---- helpers for snapshots and states -------------------------------------------------------


def snap(p: str) -> str:
    return p + "-snap"


def take_snapshot(p: str) -> None:
    with dr.ReplayBuffer.open(p) as reader:
        reader.save_snapshot(snap(p))


def grow(n: int) -> Callable[[str], None]:
    def prepare(p: str) -> None:
        with dr.ReplayBuffer.open(p, "r+") as buf:
            buf.extend(steps(n))
    return prepare


def snapshot_file(name: str, fn: Callable[[str], None]) -> Callable[[str], None]:
    """Take a snapshot of the store, then damage its file ``name`` (``"state.json"``, or
    ``"arrays"``: the arrays file it names) with ``fn(path)``."""
    def damage(p: str) -> None:
        with open(os.path.join(snap(p), "state.json")) as fh:
            arrays = json.load(fh)["arrays"]
        fn(os.path.join(snap(p), arrays if name == "arrays" else name))
    return chain(take_snapshot, damage)


def load_snapshot(p: str, **options: Any) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.load_snapshot(snap(p), **options)


def changed(state: dict, **changes: Any) -> dict:
    """``state`` with dotted paths set (``**{"episodes.count": ...}``)."""
    for key, value in changes.items():
        set_path(state, key, value)
    return state


def load_changed(**changes: Any) -> Callable[[dr.ReplayBuffer], None]:
    return lambda b: b.load_state_dict(changed(b.state_dict(), **changes))


def tree(path: str) -> dict[str, bytes | None]:
    """`dir_snapshot` plus every directory (None): an empty directory made by a refused call shows."""
    out: dict[str, bytes | None] = dict(dir_snapshot(path))
    for root, dirs, _ in os.walk(path):
        out.update({os.path.relpath(os.path.join(root, d), path): None for d in dirs})
    return out


# ---- helpers for create -----------------------------------------------------------------------


def create_over(fields: Any = None, **options: Any) -> Callable[[str], dr.ReplayBuffer]:
    """create over the existing buffer with overwrite=True: refused before anything is deleted.
    ``fields`` may be a function (Fields that raise when built are built inside the call)."""
    def call(p: str) -> dr.ReplayBuffer:
        kw = dict(capacity=64, num_envs=ENVS, chunk_rows=8, overwrite=True)
        kw.update(options)
        given = FIELDS if fields is None else fields() if callable(fields) else fields
        return dr.ReplayBuffer.create(p, given, **kw)
    return call


def fields_with(**extra: Any) -> Callable[[], dict]:
    return lambda: {**FIELDS, **{k: v() if callable(v) else v for k, v in extra.items()}}


NEXT_FIELDS = {**FIELDS, "next_obs": dr.Field((3,), "float32")}


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
    Case("extend-scalar", lambda b: b.extend(dict.fromkeys(FIELDS, 1)), dr.SchemaError,
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
         r"batch_size must be an int >= 1, got 0"),
    Case("sample-empty", lambda p: dr.ReplayBuffer.open(p).sample(4), dr.EmptyBufferError,
         r"cannot sample from an empty buffer", template="empty"),
    Case("seq-len-0", lambda p: dr.ReplayBuffer.open(p).sample(4, seq_len=0), ValueError,
         r"seq_len must be an int >= 1, got 0"),
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
    Case("field-name-too-long", lambda p: dr.ReplayBuffer.create(p + "-new", {"a" * 256: dr.Field((), "int64")}),
         dr.SchemaError, r"field name 'a{256}' has 256 bytes \(UTF-8\); at most 255 fit a file or object name"),
    Case("field-name-too-long-unicode", lambda p: dr.ReplayBuffer.create(p + "-new", {"é" * 128: dr.Field((), "int8")},
                                                                          overwrite=True),
         dr.SchemaError, r"field name 'é{128}' has 256 bytes \(UTF-8\); at most 255"),
    Case("create-symlink-loop", lambda p: dr.ReplayBuffer.create(p + "-loop", FIELDS), dr.NotABufferError,
         r"buf-loop' cannot hold a buffer \(its path runs into a loop of symbolic links\)", prepare=symlink_loop),
    Case("create-symlink-loop-overwrite", lambda p: dr.ReplayBuffer.create(p + "-loop", FIELDS, overwrite=True),
         dr.NotABufferError, r"buf-loop' cannot hold a buffer \(its path runs into a loop", prepare=symlink_loop),
    Case("create-inside-symlink-loop", lambda p: dr.ReplayBuffer.create(p + "-loop/b", FIELDS, shards=2),
         dr.NotABufferError, r"buf-loop/b' cannot hold a buffer \(its path runs into a loop of symbolic links\)",
         prepare=symlink_loop),
    Case("create-symlink-to-nothing", lambda p: dr.ReplayBuffer.create(p + "-dangling", FIELDS), dr.NotABufferError,
         r"buf-dangling' cannot hold a buffer \(a symbolic link to '[^']*buf-nowhere', which does not exist\)",
         prepare=symlink_to_nothing),
    # not a buffer
    Case("open-missing-path", lambda p: dr.ReplayBuffer.open(p + "-nowhere"), dr.NotABufferError,
         r"-nowhere' is not a diskreplay buffer \(no zarr.json\)"),
    Case("open-symlink-loop", lambda p: dr.ReplayBuffer.open(p + "-loop"), dr.NotABufferError,
         r"buf-loop' is not a diskreplay buffer \(its path runs into a loop of symbolic links\)",
         prepare=symlink_loop),
    Case("open-symlink-loop-writer", lambda p: dr.ReplayBuffer.open(p + "-loop", "r+"), dr.NotABufferError,
         r"buf-loop' is not a diskreplay buffer \(its path runs into a loop", prepare=symlink_loop),
    Case("open-inside-symlink-loop", lambda p: dr.ReplayBuffer.open(p + "-loop/b"), dr.NotABufferError,
         r"buf-loop/b' is not a diskreplay buffer \(its path runs into a loop", prepare=symlink_loop),
    Case("open-shard-symlink-loop", lambda p: dr.ReplayBuffer.open_shard(p + "-loop", shard=0), dr.NotABufferError,
         r"buf-loop' is not a diskreplay buffer \(its path runs into a loop", prepare=symlink_loop),
    Case("open-symlink-to-nothing", lambda p: dr.ReplayBuffer.open(p + "-dangling"), dr.NotABufferError,
         r"buf-dangling' is not a diskreplay buffer \(a symbolic link to '[^']*buf-nowhere', which does not exist\)",
         prepare=symlink_to_nothing),
    Case("open-empty-dir", lambda p: dr.ReplayBuffer.open(p), dr.NotABufferError,
         r"is not a diskreplay buffer \(no zarr.json\)", prepare=empty_dir),
    Case("open-failed-write", lambda p: dr.ReplayBuffer.open(p), dr.NotABufferError,
         r"is not a diskreplay buffer: a write there failed \(RayTaskError: task 3 failed\); a buffer made there "
         r"replaces what it left", prepare=lambda p: failed_write_note(p, b'{"error": "RayTaskError: task 3 failed"}')),
    Case("open-failed-write-bad-note", lambda p: dr.ReplayBuffer.open(p, "r+"), dr.CorruptBufferError,
         r"diskreplay/objects/write-failed.json holds no error string, got \[3\]",
         prepare=lambda p: failed_write_note(p, b'{"error": [3]}')),
    Case("open-plain-zarr-group", lambda p: dr.ReplayBuffer.open(p), dr.NotABufferError,
         r"is a zarr group but not a diskreplay buffer \(no diskreplay/1 or diskreplay/2 attributes\)",
         prepare=plain_zarr_group),
    Case("open-zarr-group-with-commit", lambda p: dr.ReplayBuffer.open(p, "r+"), dr.NotABufferError,
         r"is a zarr group but not a diskreplay buffer \(no diskreplay/1 or diskreplay/2 attributes\)",
         prepare=lambda p: (plain_zarr_group(p), write(os.path.join(p, OWN, "commit.json"), b"{}"))),
    # damaged metadata and chunks
    Case("garbage-commit-json", lambda p: dr.ReplayBuffer.open(p, "r+"), dr.CorruptBufferError,
         r"commit.json is not valid JSON", prepare=write_key(OWN + "commit.json", b"\x00{not json")),
    Case("commit-wrong-lanes", lambda p: dr.ReplayBuffer.open(p), dr.CorruptBufferError,
         r"commit.json field 'committed': expected 2 ints in \[0, \d+\] \(one per lane\), got \[1\]",
         prepare=edit_commit(committed=[1], lower=[0])),
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
         r"state object 'state/episodes\.ends/\d{12}-[0-9a-f]{16}/tail-\d{12}-[0-9a-f]{16}' is missing",
         prepare=lambda p: shutil.rmtree(os.path.join(p, OWN, "state"))),
]

# ---- tampered commit.json: every field validated before use, naming commit.json and the field ----

COMMIT = r"commit\.json field "
CASES += [
    Case("commit-committed-negative", open_ro, dr.CorruptBufferError,
         COMMIT + r"'committed': expected 2 ints in \[0, \d+\] \(one per lane\), got \[-1, 20\]",
         prepare=edit_commit(committed=[-1, 20])),
    Case("commit-lower-negative", open_rw, dr.CorruptBufferError,
         COMMIT + r"'lower': expected 2 ints in \[0, \d+\] \(one per lane\), got \[-1, 0\]",
         prepare=edit_commit(lower=[-1, 0])),
    Case("commit-lower-above-committed", open_rw, dr.CorruptBufferError,
         COMMIT + r"'lower': expected lower <= committed per lane, got lower \[21, 0\] and committed \[20, 20\]",
         prepare=edit_commit(lower=[21, 0])),
    Case("commit-cursor-float", open_ro, dr.CorruptBufferError,
         COMMIT + r"'committed': expected 2 ints .*got \[20\.0, 20\]",
         prepare=edit_commit(committed=[20.0, 20])),
    Case("commit-cursor-string", open_ro, dr.CorruptBufferError,
         COMMIT + r"'committed': expected 2 ints .*got \['20', 20\]",
         prepare=edit_commit(committed=["20", 20])),
    Case("commit-cursor-bool", open_ro, dr.CorruptBufferError, COMMIT + r"'lower': expected 2 ints .*got \[True, 0\]",
         prepare=edit_commit(lower=[True, 0])),
    Case("commit-cursor-null", open_ro, dr.CorruptBufferError,
         COMMIT + r"'committed': expected 2 ints .*got \[None, 20\]",
         prepare=edit_commit(committed=[None, 20])),
    Case("commit-cursors-not-a-list", open_ro, dr.CorruptBufferError, COMMIT + r"'committed': expected 2 ints .*got 40",
         prepare=edit_commit(committed=40)),
    Case("commit-cursors-missing", open_ro, dr.CorruptBufferError, COMMIT + r"'lower': expected 2 ints .*got None",
         prepare=edit_commit(lower=DELETE)),
    Case("commit-cursor-2-60", open_rw, dr.CorruptBufferError,
         COMMIT + r"'committed': expected 2 ints in \[0, 70368744177664\] .*got \[1152921504606846976, 20\]",
         prepare=edit_commit(committed=[2**60, 20])),
    Case("commit-lower-2-60", open_ro, dr.CorruptBufferError,
         COMMIT + r"'lower': expected 2 ints in \[0, 70368744177664\]",
         prepare=edit_commit(lower=[2**60, 0])),
    Case("commit-three-lanes", open_ro, dr.CorruptBufferError,
         COMMIT + r"'committed': expected 2 ints .*got \[20, 20, 20\]",
         prepare=edit_commit(committed=[20, 20, 20], lower=[0, 0, 0])),
    Case("commit-lower-one-lane", open_ro, dr.CorruptBufferError, COMMIT + r"'lower': expected 2 ints .*got \[0\]",
         prepare=edit_commit(lower=[0])),
    Case("commit-sequence-negative", open_rw, dr.CorruptBufferError,
         COMMIT + r"'sequence': expected an int >= 0, got -1",
         prepare=edit_commit(sequence=-1)),
    Case("commit-sequence-float", open_ro, dr.CorruptBufferError,
         COMMIT + r"'sequence': expected an int >= 0, got 2\.5",
         prepare=edit_commit(sequence=2.5)),
    Case("commit-sequence-string", open_ro, dr.CorruptBufferError,
         COMMIT + r"'sequence': expected an int >= 0, got '2'",
         prepare=edit_commit(sequence="2")),
    Case("commit-sequence-huge", open_ro, dr.CorruptBufferError,
         COMMIT + r"'sequence': expected an int >= 0, got 4611686018427387904",
         prepare=edit_commit(sequence=2**62)),
    Case("commit-time-nan", open_ro, dr.CorruptBufferError, COMMIT + r"'time': expected a finite number, got nan",
         prepare=edit_commit(time=float("nan"))),
    Case("commit-time-infinite", open_ro, dr.CorruptBufferError, COMMIT + r"'time': expected a finite number, got inf",
         prepare=edit_commit(time=float("inf"))),
    Case("commit-time-string", open_rw, dr.CorruptBufferError,
         COMMIT + r"'time': expected a finite number, got 'yesterday'",
         prepare=edit_commit(time="yesterday")),
    Case("commit-extra-list", open_ro, dr.CorruptBufferError, COMMIT + r"'extra': expected an object, got \[\]",
         prepare=edit_commit(extra=[])),
    Case("commit-extra-null", open_rw, dr.CorruptBufferError, COMMIT + r"'extra': expected an object, got None",
         prepare=edit_commit(extra=None)),
    Case("commit-extra-state-not-object", open_ro, dr.CorruptBufferError,
         COMMIT + r"'extra\.state': expected an object, got \[1, 2\]", prepare=edit_commit(**{"extra.state": [1, 2]})),
    # a crafted state key can neither make a reader read another file nor a writer delete one
    Case("commit-state-arrays-parent-path", open_and_flush, dr.CorruptBufferError,
         COMMIT + r"'extra\.state_arrays': expected a key like 'state/<sequence>-<token>\.safetensors', "
                  r"got '\.\./\.\./victim\.safetensors'",
         template="wor", prepare=chain(plant_victim, edit_commit(**{"extra.state_arrays": "../../victim.safetensors"})),
         after=victim_intact),
    Case("commit-state-arrays-absolute", open_rw, dr.CorruptBufferError,
         COMMIT + r"'extra\.state_arrays': .*got '/etc/passwd'",
         prepare=edit_commit(**{"extra.state_arrays": "/etc/passwd"})),
    Case("commit-state-arrays-other-name", open_ro, dr.CorruptBufferError,
         COMMIT + r"'extra\.state_arrays': .*got 'state/x\.safetensors'",
         prepare=edit_commit(**{"extra.state_arrays": "state/x.safetensors"})),
    Case("commit-state-arrays-later-sequence", open_ro, dr.CorruptBufferError,
         COMMIT + r"'extra\.state_arrays': .*got 'state/000000000009-0123456789abcdef\.safetensors'",
         prepare=edit_commit(**{"extra.state_arrays": "state/000000000009-0123456789abcdef.safetensors"})),
    Case("commit-state-arrays-not-string", open_ro, dr.CorruptBufferError, COMMIT + r"'extra\.state_arrays': .*got 42",
         prepare=edit_commit(**{"extra.state_arrays": 42})),
    Case("commit-dataset-beyond-arrays", open_ro, dr.CorruptBufferError,
         COMMIT + r"'committed': 21 steps in a lane, but the arrays hold 20", template="raw",
         prepare=edit_commit(committed=[21, 20])),
    Case("commit-too-large", open_rw, dr.CorruptBufferError,
         r"commit\.json has \d+ bytes, expected at most 16777216", prepare=oversize_key(OWN + "commit.json")),
    Case("commit-empty-file", open_ro, dr.CorruptBufferError, r"commit\.json is not valid JSON",
         prepare=write_key(OWN + "commit.json", b"")),
    Case("commit-truncated", open_rw, dr.CorruptBufferError, r"commit\.json is not valid JSON",
         prepare=truncate_key(OWN + "commit.json", 40)),
    Case("commit-not-an-object", open_ro, dr.CorruptBufferError, r"commit\.json is not a JSON object, got list",
         prepare=write_key(OWN + "commit.json", b"[20, 20]")),
    Case("commit-deeply-nested", open_ro, dr.CorruptBufferError, r"commit\.json is not valid JSON",
         prepare=write_key(OWN + "commit.json", b"[" * 100_000 + b"]" * 100_000)),
    Case("commit-is-a-directory", open_ro, dr.NotABufferError, r"is not a diskreplay buffer \(no commit\.json\)",
         prepare=replace_by_dir(OWN + "commit.json")),
    Case("commit-deleted", open_rw, dr.NotABufferError, r"is not a diskreplay buffer \(no commit\.json\)",
         prepare=lambda p: os.remove(os.path.join(p, OWN, "commit.json"))),
]

# ---- tampered group zarr.json (attributes.diskreplay): CorruptBufferError naming zarr.json and the field ----

CONFIG = r"zarr\.json field diskreplay\."
CHECKSUM_DROPPED = r"obs/zarr\.json has a crc32c checksum codec and act/zarr\.json has none"
# lane_capacity=2**40 with chunk_rows=8: too many chunks; the message must name lane_capacity and its value
HUGE_LANE_CAPACITY = CONFIG + (r"lane_capacity: expected at most 67108864 chunks of chunk_rows=8 over 2 lanes, "
                               r"got 1099511627776")
CASES += [
    Case("config-num-envs-0", open_ro, dr.CorruptBufferError,
         CONFIG + r"num_envs: expected an int in \[1, 65536\], got 0",
         prepare=edit_config(num_envs=0)),
    Case("config-num-envs-huge", open_rw, dr.CorruptBufferError,
         CONFIG + r"num_envs: expected an int in \[1, 65536\], got 1099511627776", prepare=edit_config(num_envs=2**40)),
    Case("config-num-envs-string", open_ro, dr.CorruptBufferError, CONFIG + r"num_envs: expected an int .*got '2'",
         prepare=edit_config(num_envs="2")),
    Case("config-num-envs-disagrees", open_ro, dr.CorruptBufferError,
         r"obs/zarr\.json: shape \[2, 32, 3\], expected \[3, 32, 3\]", prepare=edit_config(num_envs=3)),
    Case("config-lane-capacity-0", open_ro, dr.CorruptBufferError,
         CONFIG + r"lane_capacity: expected an int in \[1, 70368744177664\] or null, got 0",
         prepare=edit_config(lane_capacity=0)),
    Case("config-lane-capacity-negative", open_rw, dr.CorruptBufferError,
         CONFIG + r"lane_capacity: expected an int .*got -32",
         prepare=edit_config(lane_capacity=-32)),
    Case("config-lane-capacity-beyond-steps", open_ro, dr.CorruptBufferError,
         CONFIG + r"lane_capacity: expected an int .*got 1125899906842624", prepare=edit_config(lane_capacity=2**50)),
    Case("config-lane-capacity-huge-chunk-table", open_ro, dr.CorruptBufferError, HUGE_LANE_CAPACITY,
         prepare=edit_config(lane_capacity=2**40)),
    Case("config-lane-capacity-disagrees", open_ro, dr.CorruptBufferError,
         r"obs/zarr\.json: 32 steps per lane, the ring holds 16", prepare=edit_config(lane_capacity=16)),
    Case("config-chunk-rows-0", open_ro, dr.CorruptBufferError,
         CONFIG + r"chunk_rows: expected an int in \[1, 32\], got 0",
         prepare=edit_config(chunk_rows=0)),
    Case("config-chunk-rows-above-capacity", open_rw, dr.CorruptBufferError,
         CONFIG + r"chunk_rows: expected an int in \[1, 32\], got 33", prepare=edit_config(chunk_rows=33)),
    Case("config-chunk-rows-huge", open_ro, dr.CorruptBufferError,
         CONFIG + r"chunk_rows: expected an int in \[1, 16777216\], got 1073741824", template="raw",
         prepare=edit_config(chunk_rows=2**30)),
    Case("config-chunk-rows-float", open_ro, dr.CorruptBufferError, CONFIG + r"chunk_rows: expected an int .*got 8\.0",
         prepare=edit_config(chunk_rows=8.0)),
    Case("config-compression-unknown", open_ro, dr.CorruptBufferError,
         CONFIG + r"compression: expected one of \[None, 'zstd', 'lz4', 'lz4hc'\], got 'gzip'",
         prepare=edit_config(compression="gzip")),
    Case("config-compression-disagrees", open_ro, dr.CorruptBufferError,
         r"obs/zarr\.json: codecs \['bytes', 'zstd', 'crc32c'\] differ from the buffer's "
         r"\(compression 'lz4', level 3\)",
         prepare=edit_config(compression="lz4")),
    Case("config-level-23", open_rw, dr.CorruptBufferError,
         CONFIG + r"level: expected an int in \[0, 22\] for zstd, got 23", prepare=edit_config(level=23)),
    Case("config-level-negative", open_ro, dr.CorruptBufferError,
         CONFIG + r"level: expected an int in \[0, 22\] for zstd, got -1",
         prepare=edit_config(level=-1)),
    Case("config-level-lz4-10", open_ro, dr.CorruptBufferError,
         CONFIG + r"level: expected an int in \[0, 9\] for lz4, got 10", template="wor", prepare=edit_config(level=10)),
    Case("config-fields-not-mapping", open_ro, dr.CorruptBufferError, CONFIG + r"fields: expected dict, got \['obs'\]",
         prepare=edit_config(fields=["obs"])),
    Case("config-field-bad-dtype", open_ro, dr.CorruptBufferError,
         CONFIG + r"fields: expected a valid field table \(field 'obs': Field dtype must be one of .*got complex64\)",
         prepare=edit_config(**{"fields.obs.dtype": "<c8"})),
    Case("config-field-negative-shape", open_rw, dr.CorruptBufferError,
         CONFIG + r"fields: expected a valid field table "
                  r"\(field 'obs': Field shape must be non-negative, got \(-3,\)\)",
         prepare=edit_config(**{"fields.obs.shape": [-3]})),
    Case("config-field-huge-shape", open_ro, dr.CorruptBufferError,
         CONFIG + r"fields: expected a valid field table "
                  r"\(field 'obs': Field shape \(1000000000000,\) of float32 holds",
         prepare=edit_config(**{"fields.obs.shape": [10**12]})),
    Case("config-field-float-shape", open_ro, dr.CorruptBufferError, CONFIG + r"fields: expected a valid field table",
         prepare=edit_config(**{"fields.obs.shape": [3.7]})),
    Case("config-field-no-dtype", open_ro, dr.CorruptBufferError, CONFIG + r"fields: expected a valid field table",
         prepare=edit_config(**{"fields.obs.dtype": DELETE})),
    Case("config-field-name-is-a-path", open_ro, dr.CorruptBufferError,
         CONFIG + r"fields: expected a valid field table "
                  r"\(field names must be Python identifiers, got '\.\./\.\./victim'\)",
         prepare=edit_config(fields={**{k: f.to_json() for k, f in FIELDS.items()},
                                     "../../victim": {"shape": [], "dtype": "|b1"}})),
    Case("config-field-renamed", open_ro, dr.CorruptBufferError,
         r"array for field 'observation' is missing \(observation/zarr\.json\)",
         prepare=edit_config(fields={"observation" if k == "obs" else k: f.to_json() for k, f in FIELDS.items()})),
    Case("config-field-dtype-disagrees", open_ro, dr.CorruptBufferError,
         r"obs/zarr\.json: data_type 'float32', the buffer records float64 for field 'obs'",
         prepare=edit_config(**{"fields.obs.dtype": "<f8"})),
    Case("config-episode-end-missing-field", open_ro, dr.CorruptBufferError,
         CONFIG + r"episode_end: expected a list of distinct names of suitable fields, got \['terminated'\]",
         prepare=edit_config(episode_end=["terminated"])),
    Case("config-episode-end-not-bool", open_rw, dr.CorruptBufferError, CONFIG + r"episode_end: .*got \['act'\]",
         prepare=edit_config(episode_end=["act"])),
    Case("config-episode-end-string", open_ro, dr.CorruptBufferError, CONFIG + r"episode_end: .*got 'done'",
         prepare=edit_config(episode_end="done")),
    Case("config-derive-next-missing-field", open_ro, dr.CorruptBufferError,
         CONFIG + r"derive_next: expected a list of distinct names of suitable fields, got \['pixels'\]",
         prepare=edit_config(derive_next=["pixels"])),
    Case("config-derive-next-store-missing", open_ro, dr.CorruptBufferError, r"final",
         prepare=edit_config(derive_next=["obs"])),
    Case("config-episodic-return-gamma", open_ro, dr.CorruptBufferError,
         CONFIG + r"episodic_return: expected null or \{gamma",
         prepare=edit_config(episodic_return={"gamma": 2.0, "reward": "temp", "name": "obs", "default_return": 0.0,
                                              "clip": None})),
    Case("config-episodic-return-string", open_ro, dr.CorruptBufferError, CONFIG + r"episodic_return: .*got 'return'",
         prepare=edit_config(episodic_return="return")),
    Case("config-separator-unknown", open_ro, dr.CorruptBufferError,
         CONFIG + r"chunk_key_separator: expected one of \['/', '\.'\], got '\\\\'",
         prepare=edit_config(chunk_key_separator="\\")),
    Case("config-separator-disagrees", open_rw, dr.CorruptBufferError,
         r"obs/zarr\.json: chunk key encoding .* expected default with '/'",
         prepare=edit_config(chunk_key_separator="/")),
    Case("config-format-missing", open_ro, dr.NotABufferError,
         r"is a zarr group but not a diskreplay buffer \(no diskreplay/1 or diskreplay/2 attributes\)",
         prepare=edit_config(format=DELETE)),
    Case("group-node-type-array", open_ro, dr.NotABufferError,
         r"is not a diskreplay buffer \(zarr\.json is not a Zarr v3 group\)",
         prepare=edit_group(node_type="array")),
    Case("group-zarr-format-2", open_ro, dr.NotABufferError, r"zarr\.json is not a Zarr v3 group",
         prepare=edit_group(zarr_format=2)),
    Case("group-attributes-not-object", open_ro, dr.NotABufferError,
         r"not a diskreplay buffer \(no diskreplay/1 or diskreplay/2 attributes\)",
         prepare=edit_group(attributes=[1])),
    Case("group-zarr-json-truncated", open_rw, dr.CorruptBufferError, r"zarr\.json is not valid JSON",
         prepare=truncate_key("zarr.json", 50)),
    Case("group-zarr-json-not-object", open_ro, dr.CorruptBufferError, r"zarr\.json is not a JSON object, got list",
         prepare=write_key("zarr.json", b"[1, 2]")),
    Case("group-zarr-json-too-large", open_ro, dr.CorruptBufferError,
         r"zarr\.json has \d+ bytes, expected at most 16777216",
         prepare=oversize_key("zarr.json")),
    Case("group-zarr-json-is-a-directory", open_rw, dr.NotABufferError, r"is not a diskreplay buffer \(no zarr\.json\)",
         prepare=replace_by_dir("zarr.json")),
    Case("group-zarr-json-deleted", open_ro, dr.NotABufferError, r"is not a diskreplay buffer \(no zarr\.json\)",
         prepare=lambda p: os.remove(os.path.join(p, "zarr.json"))),
]

# ---- tampered array <field>/zarr.json: CorruptBufferError naming the document and what differs ----

CASES += [
    Case("array-shape-steps", open_ro, dr.CorruptBufferError, r"obs/zarr\.json: 16 steps per lane, the ring holds 32",
         prepare=edit_array("obs", shape=[2, 16, 3])),
    Case("array-shape-lanes", open_rw, dr.CorruptBufferError,
         r"obs/zarr\.json: shape \[3, 32, 3\], expected \[2, 32, 3\]",
         prepare=edit_array("obs", shape=[3, 32, 3])),
    Case("array-shape-field-dims", open_ro, dr.CorruptBufferError,
         r"img/zarr\.json: shape \[2, 32, 2, 3\], expected \[2, 32, 2, 2\]",
         prepare=edit_array("img", shape=[2, 32, 2, 3])),
    Case("array-shape-float", open_ro, dr.CorruptBufferError, r"act/zarr\.json: shape \[2, 32\.0\], expected \[2, 32\]",
         prepare=edit_array("act", shape=[2, 32.0])),
    Case("array-shape-string", open_ro, dr.CorruptBufferError, r"act/zarr\.json: shape '2x32', expected \[2, 32\]",
         prepare=edit_array("act", shape="2x32")),
    Case("array-shape-huge", open_ro, dr.CorruptBufferError,
         r"act/zarr\.json: shape \[2, 1152921504606846976\], expected \[2, 'steps'\]", template="raw",
         prepare=edit_array("act", shape=[2, 2**60])),
    Case("array-shape-negative", open_rw, dr.CorruptBufferError,
         r"act/zarr\.json: shape \[2, -1\], expected \[2, 'steps'\]",
         template="raw", prepare=edit_array("act", shape=[2, -1])),
    Case("array-codecs-unknown", open_ro, dr.CorruptBufferError,
         r"obs/zarr\.json: unsupported zarr codecs \['bytes', 'gzip', 'crc32c'\]",
         prepare=edit_array("obs", **{"codecs.1": {"name": "gzip", "configuration": {"level": 5}}})),
    Case("array-codecs-big-endian", open_rw, dr.CorruptBufferError,
         r"obs/zarr\.json: big-endian chunks, diskreplay writes little-endian",
         prepare=edit_array("obs", **{"codecs.0.configuration.endian": "big"})),
    Case("array-codecs-level", open_ro, dr.CorruptBufferError,
         r"act/zarr\.json: codecs \['bytes', 'zstd', 'crc32c'\] differ from the buffer's "
         r"\(compression 'zstd', level 3\)",
         prepare=edit_array("act", **{"codecs.1.configuration.level": 9})),
    Case("array-codecs-lz4-level-12", open_ro, dr.CorruptBufferError,
         r"act/zarr\.json: compression_level for lz4 must be an int in \[0, 9\], got 12", template="wor",
         prepare=edit_array("act", **{"codecs.1.configuration.clevel": 12})),
    Case("array-codecs-lz4hc-for-lz4", open_ro, dr.CorruptBufferError,
         r"act/zarr\.json: codecs \['bytes', 'blosc', 'crc32c'\] differ from the buffer's "
         r"\(compression 'lz4', level 3\)",
         template="wor", prepare=edit_array("act", **{"codecs.1.configuration.cname": "lz4hc"})),
    Case("array-codecs-zstd-checksum", open_ro, dr.CorruptBufferError,
         r"act/zarr\.json: zstd with its own checksum \(configuration\.checksum true\) is not a codec",
         prepare=edit_array("act", **{"codecs.1.configuration.checksum": True})),
    Case("array-codecs-transpose-first", open_ro, dr.CorruptBufferError,
         r"img/zarr\.json: unsupported zarr codecs \['transpose'",
         prepare=edit_array("img", **{"codecs.0": {"name": "transpose", "configuration": {"order": [2, 1, 0, 3]}}})),
    Case("array-codecs-not-list", open_ro, dr.CorruptBufferError, r"obs/zarr\.json: codecs: expected a list of objects",
         prepare=edit_array("obs", codecs={"name": "bytes"})),
    Case("array-codecs-checksum-dropped", open_ro, dr.CorruptBufferError, CHECKSUM_DROPPED,
         prepare=edit_array("act", codecs=[{"name": "bytes", "configuration": {"endian": "little"}},
                                           {"name": "zstd", "configuration": {"level": 3, "checksum": False}}])),
    Case("array-chunk-key-separator", open_ro, dr.CorruptBufferError,
         r"act/zarr\.json: chunk key encoding .*'separator': '/'.* expected default with '\.'",
         prepare=edit_array("act", **{"chunk_key_encoding.configuration.separator": "/"})),
    Case("array-chunk-key-v2", open_rw, dr.CorruptBufferError, r"act/zarr\.json: chunk key encoding .*'v2'",
         prepare=edit_array("act", **{"chunk_key_encoding.name": "v2"})),
    Case("array-chunk-grid-name", open_ro, dr.CorruptBufferError, r"obs/zarr\.json: .*(chunk_grid|'rectilinear')",
         prepare=edit_array("obs", **{"chunk_grid.name": "rectilinear"})),
    Case("array-dimension-names-renamed", open_ro, dr.CorruptBufferError,
         r"obs/zarr\.json: dimension_names \['lane', 'step', 'obs_dim0'\], expected \['lane', 'slot', 'obs_dim0'\] "
         r"\(or none\) for field 'obs'",
         prepare=edit_array("obs", **{"dimension_names.1": "step"})),
    Case("array-dimension-names-not-list", open_rw, dr.CorruptBufferError,
         r"img/zarr\.json: dimension_names 'lane', expected \['lane', 'slot', 'img_dim0', 'img_dim1'\]",
         prepare=edit_array("img", dimension_names="lane")),
    Case("array-dimension-names-short", open_ro, dr.CorruptBufferError,
         r"act/zarr\.json: dimension_names \['lane'\], expected \['lane', 'slot'\]",
         prepare=edit_array("act", dimension_names=["lane"])),
    Case("array-node-type-missing", open_ro, dr.CorruptBufferError, r"obs/zarr\.json: not a Zarr v3 array",
         prepare=edit_array("obs", node_type=DELETE)),
    Case("array-is-a-group", open_rw, dr.CorruptBufferError, r"done/zarr\.json: not a Zarr v3 array",
         prepare=edit_array("done", node_type="group")),
    Case("array-data-type-unknown", open_ro, dr.CorruptBufferError,
         r"temp/zarr\.json: data_type 'bfloat16', the buffer records float16",
         prepare=edit_array("temp", data_type="bfloat16")),
    Case("array-json-truncated", open_ro, dr.CorruptBufferError, r"img/zarr\.json is not valid JSON",
         prepare=truncate_key("img/zarr.json", 30)),
    Case("array-json-not-object", open_ro, dr.CorruptBufferError, r"img/zarr\.json is not a JSON object, got list",
         prepare=write_key("img/zarr.json", b"[]")),
    Case("array-json-is-a-directory", open_ro, dr.CorruptBufferError,
         r"obs/zarr\.json", prepare=replace_by_dir("obs/zarr.json")),
    Case("array-json-too-large", open_ro, dr.CorruptBufferError,
         r"img/zarr\.json has \d+ bytes, expected at most 16777216",
         prepare=oversize_key("img/zarr.json")),
]

# ---- tampered state objects: CorruptBufferError naming the state object (and what is wrong) ----

OF_STATE = r"the (state object 'state/\d{12}-[0-9a-f]{16}\.safetensors'|state) of commit \d+: "
OF_STATE_JSON = r"the state of commit \d+ does not load \("
CASES += [
    Case("state-garbage", open_ro, dr.CorruptBufferError, STATE_OBJECT + r" does not load \(not a safetensors file",
         template="wor", prepare=damage_state(b"\x00garbage, not safetensors")),
    Case("state-empty", open_rw, dr.CorruptBufferError, STATE_OBJECT + r" does not load", template="wor",
         prepare=damage_state(b"")),
    Case("state-truncated", open_ro, dr.CorruptBufferError, STATE_OBJECT + r" does not load", template="wor",
         prepare=damage_state(lambda b: b[:len(b) // 2])),
    Case("state-header-huge-length", open_ro, dr.CorruptBufferError, STATE_OBJECT + r" does not load",
         template="wor", prepare=damage_state(lambda b: (2**62).to_bytes(8, "little") + b[8:])),
    Case("state-object-is-a-directory", open_ro, dr.CorruptBufferError, STATE_OBJECT, template="wor",
         prepare=lambda p: replace_by_dir(OWN + state_key(p))(p)),
    Case("state-array-missing", open_ro, dr.CorruptBufferError,
         STATE_OBJECT + r" does not load \(.*'sampler\.epoch_lo', which its array file lacks",
         template="wor", prepare=edit_state(**{"sampler.epoch_lo": DELETE})),
    # journals: the episode ends and the priorities, appended commit by commit
    Case("state-ends-not-increasing", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'episodes\.ends' of lane 0: expected increasing steps in \[0, 20\)",
         prepare=edit_journal("episodes.ends", END_RECORD, lambda r: r[::-1])),
    Case("state-ends-beyond-commit", open_rw, dr.CorruptBufferError,
         OF_STATE + r"'episodes\.ends' of lane 1: expected increasing steps in \[0, 20\), got \[4, 9, 14, 20\]",
         prepare=edit_journal("episodes.ends", END_RECORD, lambda r: set_record(r, -1, "step", 20))),
    Case("state-ends-float", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'episodes\.ends' \(journal\): expected int64 \(lane, step\) pairs, got base int64 shaped "
                    r"\(0,\) and records \[\('lane', '<i8'\), \('step', '<f8'\)\]",
         prepare=edit_state_json(**{"episodes.ends.__journal__.record_dtype": [["lane", "<i8"], ["step", "<f8"]]})),
    Case("state-ends-lane-out-of-range", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'episodes\.ends' \(journal\): expected lanes in \[0, 2\), got 0 to 5",
         prepare=edit_journal("episodes.ends", END_RECORD, lambda r: set_record(r, 0, "lane", 5))),
    Case("state-ended-mismatch", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'episodes\.ended': expected base_pruned plus the journal's ends per lane \(\[4, 4\]\), "
                    r"got \[4, 9\]",
         prepare=edit_state_json(**{"episodes.ended": [4, 9]})),
    Case("state-base-pruned-wrong-lanes", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'episodes\.ended': expected base_pruned plus the journal's ends per lane \(\[0, 0, 0\]\)",
         prepare=edit_state_json(**{"episodes.base_pruned": [0, 0, 0]})),
    Case("journal-tail-truncated", open_ro, dr.CorruptBufferError,
         r"journal object 'state/episodes\.ends/\d{12}-[0-9a-f]{16}/tail-\d{12}-[0-9a-f]{16}': expected 132 bytes "
         r"\(8 of .*, then a CRC32C\), got 100",
         prepare=lambda p: truncate(journal_file(p, "episodes.ends"), 100)),
    Case("journal-generation-parent-path", open_ro, dr.CorruptBufferError,
         OF_STATE_JSON + r"'episodes\.ends\.__journal__' field 'generation': expected '<sequence>-<16 hex digits>' "
                         r"of a commit up to \d+, got '\.\./\.\./victim'",
         prepare=edit_state_json(**{"episodes.ends.__journal__.generation": "../../victim"})),
    Case("journal-records-huge", open_rw, dr.CorruptBufferError,
         OF_STATE_JSON + r"'sampler\.leaves\.__journal__' fields 'base', 'records': expected ints in "
                         r"\[0, 1099511627776\], got \[64, 2199023255552\]",
         template="per", prepare=edit_state_json(**{"sampler.leaves.__journal__.records": 2**41})),
    Case("journal-records-beyond-objects", open_ro, dr.CorruptBufferError,
         r"state object 'state/sampler\.leaves/\d{12}-[0-9a-f]{16}/log\.0' is missing",
         template="per", prepare=edit_state_json(**{"sampler.leaves.__journal__.records": 2**22 + 40})),
    Case("journal-base-dtype-object", open_ro, dr.CorruptBufferError,
         OF_STATE_JSON + r"'sampler\.leaves\.__journal__' field 'base_dtype': expected one of .*, got '\|O'",
         template="per", prepare=edit_state_json(**{"sampler.leaves.__journal__.base_dtype": "|O"})),
    Case("journal-tail-dropped", open_ro, dr.CorruptBufferError,
         OF_STATE_JSON + r"'sampler\.leaves\.__journal__' field 'tail': expected a tail exactly when 'records' \(40\)",
         template="per", prepare=edit_state_json(**{"sampler.leaves.__journal__.tail": None})),
    Case("state-leaves-wrong-length", open_ro, dr.CorruptBufferError,
         r"journal object 'state/sampler\.leaves/\d{12}-[0-9a-f]{16}/base\.0': expected 44 bytes \(10 of float32, "
         r"then a CRC32C\), got more",
         template="per", prepare=edit_state_json(**{"sampler.leaves.__journal__.base": 10})),
    Case("state-leaves-nan", open_rw, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.leaves' \(journal record 3\): expected a leaf in \[0, 64\) and a finite value >= 0, "
                    r"got leaf 3, value nan",
         template="per", prepare=edit_journal("sampler.leaves", PRIORITY_RECORD,
                                              lambda r: set_record(r, 3, "value", np.nan))),
    Case("state-leaves-negative", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.leaves' \(journal base\): expected 64 finite float32 values >= 0",
         template="per", prepare=lambda p: write_journal_object(journal_file(p, "sampler.leaves", "base.0"),
                                                                np.full(64, -1, np.float32).tobytes())),
    Case("state-leaves-beyond-slots", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.leaves' \(journal record 0\): expected a leaf in \[0, 64\) and a finite value >= 0, "
                    r"got leaf 64",
         template="per",
         prepare=edit_journal("sampler.leaves", PRIORITY_RECORD, lambda r: set_record(r, 0, "leaf", 64))),
    # priorities of rows that were never committed (a sample would draw them)
    Case("state-leaves-record-uncommitted-row", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.leaves' \(journal record 0\): leaf 25 is slot 25 of lane 0, which holds steps in "
                    r"slots \[0, 20\) only",
         template="per",
         prepare=edit_journal("sampler.leaves", PRIORITY_RECORD, lambda r: set_record(r, 0, "leaf", 25))),
    Case("state-leaves-base-uncommitted-row", open_rw, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.leaves' \(journal base\): leaf 57 \(slot 25 of lane 1\) holds priority 2\.0, but "
                    r"the lane holds steps in slots \[0, 20\) only",
         template="per", prepare=lambda p: write_journal_object(journal_file(p, "sampler.leaves", "base.0"),
                                                                set_at(np.zeros(64, np.float32), 57, 2.0).tobytes())),
    Case("state-epoch-beyond-commit", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.epoch_lo/epoch_hi': expected 2 steps per lane with 0 <= lo <= hi <= \[20, 20\], "
                    r"got \[0, 0\] and \[25, 20\]",
         template="wor", prepare=edit_state(**{"sampler.epoch_hi": np.array([25, 20])})),
    Case("state-epoch-lo-above-hi", open_rw, dr.CorruptBufferError, OF_STATE + r"'sampler\.epoch_lo/epoch_hi'",
         template="wor",
         prepare=edit_state(**{"sampler.epoch_lo": np.array([15, 0]), "sampler.epoch_hi": np.array([10, 20])})),
    # the JSON part of the state (commit.json extra.state)
    Case("state-json-names-missing-array", open_ro, dr.CorruptBufferError,
         STATE_OBJECT + r" does not load \(.*'episodes\.nope', which its array file lacks",
         template="wor", prepare=edit_state_json(**{"episodes.ends": {"__array__": "episodes.nope"}})),
    Case("state-json-rng-missing", open_ro, dr.CorruptBufferError, OF_STATE + r"'rng' is missing",
         prepare=edit_state_json(rng=DELETE)),
    Case("state-json-rng-other-generator", open_rw, dr.CorruptBufferError, OF_STATE + r".*\b(rng|RNG)\b",
         prepare=edit_state_json(**{"rng.bit_generator": "MT19937"})),
    Case("state-json-rng-garbage", open_ro, dr.CorruptBufferError, OF_STATE + r".*\b(rng|RNG)\b",
         prepare=edit_state_json(**{"rng.state": "x"})),
    Case("state-json-episodes-not-object", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'episodes': expected a mapping, got list", prepare=edit_state_json(episodes=[])),
    Case("state-json-end-fields", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'episodes\.end_fields': expected \['done'\], got \['act'\]",
         prepare=edit_state_json(**{"episodes.end_fields": ["act"]})),
    Case("state-json-last-next-unknown", open_ro, dr.CorruptBufferError, OF_STATE + r"'last_next\.next_obs'",
         template="wor", prepare=edit_state_json(**{"last_next.next_obs": {"__array__": "sampler.epoch_lo"}})),
    Case("state-json-sampler-stride", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.stride': expected 32, got 16",
         template="per", prepare=edit_state_json(**{"sampler.stride": 16})),
    Case("state-json-max-priority-nan", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.max_priority': expected a finite number > 0, got nan",
         template="per", prepare=edit_state_json(**{"sampler.max_priority": float("nan")})),
    Case("state-json-sampler-alpha-negative", open_ro, dr.CorruptBufferError, r"(state object|commit\.json).*alpha",
         template="per", prepare=edit_state_json(**{"sampler.alpha": -1})),
    Case("state-json-sampler-not-object", open_ro, dr.CorruptBufferError, r"(state object|commit\.json).*sampler",
         prepare=edit_state_json(sampler=5)),
    Case("state-json-sampler-unknown-type", open_ro, ValueError,
         r"the buffer was saved with sampler 'Bogus'; pass sampler= to open",
         prepare=edit_state_json(**{"sampler.type": "Bogus"})),
    Case("state-json-cursor-beyond-epoch", open_rw, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.cursor': expected an int in \[0, 40\], got 1000", template="wor",
         prepare=edit_state_json(**{"sampler.cursor": 1000})),
    Case("state-json-epoch-string", open_ro, dr.CorruptBufferError,
         OF_STATE + r"'sampler\.epoch': expected an int, got 'x'",
         template="wor", prepare=edit_state_json(**{"sampler.epoch": "x"})),
    Case("state-json-nested-500", open_ro, dr.CorruptBufferError,
         r"commit\.json nests objects and arrays more than 64 levels deep",
         prepare=edit_state_json(**{"episodes.extra": nested(500)})),
]

# ---- one flipped bit in any object a commit names: CorruptBufferError naming the object ----

TAIL = r"tail-\d{12}-[0-9a-f]{16}"
GENERATION = r"\d{12}-[0-9a-f]{16}"
MISMATCH = r" is damaged: checksum mismatch \(stored [0-9a-f]{8}, computed [0-9a-f]{8}\)"
STATE_MISMATCH = (STATE_OBJECT + r" is damaged: checksum mismatch \(commit\.json records [0-9a-f]{8}, "
                  r"the object has [0-9a-f]{8}\)")
PRIORITY_TAIL_FLIPPED = rf"journal object 'state/sampler\.leaves/{GENERATION}/{TAIL}'" + MISMATCH
ENDS_TAIL_FLIPPED = rf"journal object 'state/episodes\.ends/{GENERATION}/{TAIL}'" + MISMATCH
PRIORITY_BASE_FLIPPED = rf"journal object 'state/sampler\.leaves/{GENERATION}/base\.0'" + MISMATCH
CASES += [
    Case("bit-flip-state-object", open_ro, dr.CorruptBufferError, STATE_MISMATCH, template="wor",
         prepare=flip_bit(lambda p: os.path.join(p, OWN, state_key(p)), -20)),
    Case("bit-flip-priority-value", open_rw, dr.CorruptBufferError, PRIORITY_TAIL_FLIPPED, template="per",
         prepare=flip_bit(lambda p: journal_file(p, "sampler.leaves"), 3 * PRIORITY_RECORD.itemsize + 8)),
    Case("bit-flip-episode-end", open_ro, dr.CorruptBufferError, ENDS_TAIL_FLIPPED,
         prepare=flip_bit(lambda p: journal_file(p, "episodes.ends"), 2 * END_RECORD.itemsize + 8)),
    Case("bit-flip-priority-base", open_ro, dr.CorruptBufferError, PRIORITY_BASE_FLIPPED, template="per",
         prepare=flip_bit(lambda p: journal_file(p, "sampler.leaves", "base.0"), 4 * 7)),
    Case("bit-flip-journal-checksum", open_ro, dr.CorruptBufferError, ENDS_TAIL_FLIPPED,
         prepare=flip_bit(lambda p: journal_file(p, "episodes.ends"), -1)),
    Case("commit-state-checksum-string", open_ro, dr.CorruptBufferError,
         COMMIT + r"'extra\.state_arrays_crc32c': expected an int in \[0, 2\*\*32\) beside a state object, got 'x'",
         template="wor", prepare=edit_commit(**{"extra.state_arrays_crc32c": "x"})),
    Case("commit-state-checksum-huge", open_rw, dr.CorruptBufferError,
         COMMIT + r"'extra\.state_arrays_crc32c': expected an int in \[0, 2\*\*32\) .*got 4294967296",
         template="wor", prepare=edit_commit(**{"extra.state_arrays_crc32c": 2**32})),
    Case("journal-checksum-unknown", open_ro, dr.CorruptBufferError,
         OF_STATE_JSON + r"'episodes\.ends\.__journal__' field 'checksum': expected 'crc32c' \(or none, in journals "
                         r"written before checksums\), got 'md5'",
         prepare=edit_state_json(**{"episodes.ends.__journal__.checksum": "md5"})),
]

# ---- lock files: never trusted; a second writer gets LockedError (never OverflowError), readers open ----

CASES += [
    Case("lock-garbage", open_rw, dr.LockedError, UNREADABLE_LOCK,
         prepare=write_key(OWN + "writer.lock", b"\x00\xffgarbage"),
         after=reader_still_opens),
    Case("lock-empty", open_rw, dr.LockedError, UNREADABLE_LOCK, prepare=write_key(OWN + "writer.lock", b""),
         after=reader_still_opens),
    Case("lock-not-an-object", open_rw, dr.LockedError, UNREADABLE_LOCK,
         prepare=write_key(OWN + "writer.lock", b"[4242]"),
         after=reader_still_opens),
    Case("lock-deeply-nested", open_rw, dr.LockedError, UNREADABLE_LOCK,
         prepare=write_key(OWN + "writer.lock", b"[" * 100_000 + b"]" * 100_000), after=reader_still_opens),
    Case("lock-huge-pid", open_rw, dr.LockedError, UNREADABLE_LOCK, prepare=lock_record(pid=2**80),
         after=reader_still_opens),
    Case("lock-string-pid", open_rw, dr.LockedError, UNREADABLE_LOCK, prepare=lock_record(pid="4242"),
         after=reader_still_opens),
    Case("lock-pid-zero", open_rw, dr.LockedError, UNREADABLE_LOCK, prepare=lock_record(pid=0),
         after=reader_still_opens),
    Case("lock-negative-pid", open_rw, dr.LockedError, UNREADABLE_LOCK, prepare=lock_record(pid=-1),
         after=reader_still_opens),
    Case("lock-time-1e300", open_rw, dr.LockedError, r"already open for writing by this process on host .* since \?",
         prepare=lock_record(time=1e300), after=reader_still_opens),
    Case("lock-time-string", open_rw, dr.LockedError, r"already open for writing by this process on host .* since \?",
         prepare=lock_record(time="soon", start_ticks=2**80), after=reader_still_opens),
    Case("lock-is-a-directory", open_rw, dr.LockedError, r"writer\.lock", prepare=replace_by_dir(OWN + "writer.lock"),
         after=reader_still_opens),
    Case("lock-create-over", create_over(), dr.LockedError, UNREADABLE_LOCK, prepare=lock_record(pid=2**80),
         after=reader_still_opens),
]

# ---- snapshots: ReplayBuffer.load_snapshot(dir) and load_state_dict ----

SNAP_FILE = r"snapshot file '[^']*buf-snap/"
SNAP_ARRAYS = r"state-[0-9a-f]{16}\.safetensors"
SNAP_DIR = r"snapshot '[^']*buf-snap' \(state\.json, " + SNAP_ARRAYS + r"\)"
CASES += [
    Case("snapshot-missing-dir", load_snapshot, FileNotFoundError, r"buf-snap/state\.json"),
    Case("snapshot-missing-json", load_snapshot, FileNotFoundError, r"buf-snap/state\.json",
         prepare=snapshot_file("state.json", os.remove)),
    Case("snapshot-missing-arrays", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + SNAP_ARRAYS + r"', which state\.json field 'arrays' names, is missing \(FileNotFoundError\)",
         prepare=snapshot_file("arrays", os.remove)),
    Case("snapshot-json-nested-500", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + r"state\.json' is unreadable \(objects and arrays nest more than 64 levels deep\)",
         prepare=snapshot_file("state.json", lambda f: edit_json(
             f, lambda d: set_path(d, "state.episodes.extra", nested(500))))),
    Case("snapshot-leaves-uncommitted-row", load_snapshot, dr.CorruptBufferError,
         SNAP_DIR + r": 'sampler\.leaves': leaf 25 \(slot 25 of lane 0\) holds priority 1000000\.0, but the lane "
                    r"holds steps in slots \[0, 20\) only",
         template="per",
         prepare=snapshot_file("arrays", lambda f: edit_arrays(f, **{"sampler.leaves": lambda a: set_at(a, 25, 1e6)}))),
    Case("snapshot-arrays-name-outside", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + r"state\.json' field 'arrays': expected a file name like 'state-<16 hex>\.safetensors', "
                     r"got '\.\./\.\./victim\.safetensors'",
         prepare=snapshot_file("state.json",
                               lambda f: edit_json(f, lambda d: d.update(arrays="../../victim.safetensors")))),
    Case("snapshot-garbage-json", load_snapshot, dr.CorruptBufferError, SNAP_FILE + r"state\.json' is unreadable",
         prepare=snapshot_file("state.json", lambda f: write(f, b"\x00garbage"))),
    Case("snapshot-json-not-object", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + r"state\.json' is unreadable \(expected an object with 'url' \(a string\)",
         prepare=snapshot_file("state.json", lambda f: write(f, b"[1]"))),
    Case("snapshot-url-not-string", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + r"state\.json' is unreadable \(expected an object with 'url' \(a string\)",
         prepare=snapshot_file("state.json", lambda f: edit_json(f, lambda d: d.update(url=5)))),
    Case("snapshot-state-not-object", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + r"state\.json' is unreadable \(.*'state' \(an object\)",
         prepare=snapshot_file("state.json", lambda f: edit_json(f, lambda d: d.update(state="x")))),
    Case("snapshot-garbage-arrays", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + SNAP_ARRAYS + r"' is unreadable",
         prepare=snapshot_file("arrays", lambda f: write(f, b"\x00garbage"))),
    Case("snapshot-json-names-missing-array", load_snapshot, dr.CorruptBufferError,
         SNAP_FILE + SNAP_ARRAYS + r"' is unreadable \(.*'nope'",
         prepare=snapshot_file("state.json", lambda f: edit_json(
             f, lambda d: set_path(d, "state.episodes.ends", {"__array__": "nope"})))),
    Case("snapshot-arrays-do-not-fit", load_snapshot, dr.CorruptBufferError,
         SNAP_DIR + r": 'episodes\.count': expected 2 ints >= 0, got float64",
         prepare=snapshot_file("arrays", lambda f: edit_arrays(f, **{"episodes.count": np.array([1.5, 2.5])}))),
    Case("snapshot-of-another-point", load_snapshot, ValueError,
         r"state is for a buffer with \[20, 20\] steps per lane; this buffer has \[22, 22\]",
         prepare=chain(take_snapshot, grow(2))),
    Case("snapshot-into-another-buffer", lambda p: load_snapshot(p, url=p + "-2"), ValueError,
         r"state is for a buffer with \[20, 20\] steps per lane; this buffer has \[0, 0\]",
         second="empty", prepare=take_snapshot),
    Case("snapshot-url-not-a-buffer", load_snapshot, dr.NotABufferError, r"nowhere' is not a diskreplay buffer",
         prepare=snapshot_file("state.json", lambda f: edit_json(f, lambda d: d.update(url=f + "-nowhere")))),
    Case("load-state-not-mapping", lambda b: b.load_state_dict([1, 2]), ValueError,
         r"state: expected the mapping ReplayBuffer\.state_dict\(\) returns \(with 'total'\)", writer=True),
    Case("load-state-total-shape", load_changed(total=np.zeros(3, np.int64)), ValueError,
         r"state is for a buffer with \[0, 0, 0\] steps per lane; this buffer has \[20, 20\]", writer=True),
    Case("load-state-count-dtype", load_changed(**{"episodes.count": np.array([4.0, 4.0])}), ValueError,
         r"state for '[^']*buf' does not fit this buffer: 'episodes\.count': expected 2 ints >= 0, got float64",
         writer=True),
    Case("load-state-ends-shape", load_changed(**{"episodes.ends": np.zeros((2, 4), np.int64)}), ValueError,
         r"does not fit this buffer: 'episodes\.ends': expected 8 ints \(the counts' sum\), got int64 shaped \(2, 4\)",
         writer=True),
    Case("load-state-leaves-shape", load_changed(**{"sampler.leaves": np.ones(65)}), ValueError,
         r"does not fit this buffer: 'sampler\.leaves': expected 64 finite float32 values >= 0, "
         r"got float64 shaped \(65,\)",
         template="per", writer=True),
    Case("load-state-leaves-dtype", load_changed(**{"sampler.leaves": np.ones(64, np.int64)}), ValueError,
         r"does not fit this buffer: 'sampler\.leaves': .*got int64", template="per", writer=True),
    Case("load-state-leaves-above-float32", load_changed(**{"sampler.leaves": np.full(64, 1e39)}), ValueError,
         r"does not fit this buffer: 'sampler\.leaves': expected 64 finite float32 values", template="per",
         writer=True),
    Case("load-state-rng-garbage", load_changed(rng={"bit_generator": "PCG64", "state": "x"}), ValueError,
         r"state for '[^']*buf' does not fit this buffer: .*\b(rng|RNG)\b", writer=True),
    Case("load-state-epoch-beyond", load_changed(**{"sampler.epoch_hi": np.array([21, 20])}), ValueError,
         r"does not fit this buffer: 'sampler\.epoch_lo/epoch_hi'", template="wor", writer=True),
]

# ---- create: every argument checked before anything at the URL is touched (overwrite=True) ----

CASES += [
    Case("create-compression-unknown", create_over(compression="gzip"), ValueError,
         r"compression must be one of \(None, 'zstd', 'lz4', 'lz4hc'\), got 'gzip'"),
    Case("create-level-23", create_over(compression_level=23), ValueError,
         r"compression_level for zstd must be an int in \[0, 22\], got 23"),
    Case("create-level-negative", create_over(compression_level=-1), ValueError,
         r"compression_level for zstd must be an int in \[0, 22\], got -1"),
    Case("create-level-float", create_over(compression_level=3.5), ValueError,
         r"compression_level for zstd must be an int in \[0, 22\], got 3\.5"),
    Case("create-level-lz4-10", create_over(compression="lz4", compression_level=10), ValueError,
         r"compression_level for lz4 must be an int in \[0, 9\], got 10"),
    Case("create-level-lz4hc-10", create_over(compression="lz4hc", compression_level=10), ValueError,
         r"compression_level for lz4hc must be an int in \[0, 9\], got 10"),
    Case("create-field-dtype-complex", create_over(fields_with(z=lambda: dr.Field((), "complex64"))), dr.SchemaError,
         r"Field dtype must be one of \[.*\], got complex64"),
    Case("create-field-dtype-string", create_over(fields_with(z=lambda: dr.Field((), "U8"))), dr.SchemaError,
         r"Field dtype must be one of \[.*\], got <U8"),
    Case("create-field-not-a-field", create_over(fields_with(z=(3,))), dr.SchemaError,
         r"field 'z': expected a dr\.Field, got tuple"),
    Case("create-zero-size-field", create_over(fields_with(z=dr.Field((0, 3), "float32"))), dr.SchemaError,
         r"field 'z': zero-sized fields cannot be stored, got shape \(0, 3\)"),
    Case("create-field-named-diskreplay", create_over(fields_with(diskreplay=dr.Field((), "float32"))),
         dr.SchemaError, r"field name 'diskreplay' is taken: diskreplay's own objects are kept under diskreplay/"),
    Case("create-field-named-final",
         create_over({**NEXT_FIELDS, "final": dr.Field((), "float32")}, derive_next=("obs",)),
         dr.SchemaError, r"field name 'final' is taken: with derive_next"),
    Case("create-no-fields", create_over({}), dr.SchemaError, r"a buffer needs at least one field, got none"),
    Case("create-field-name-path", create_over(fields_with(**{"../x": dr.Field((), "float32")})), dr.SchemaError,
         r"field names must be Python identifiers, got '\.\./x'"),
    Case("create-reserved-name-over", create_over(fields_with(weight=dr.Field((), "float32"))), dr.SchemaError,
         r"field name 'weight' is reserved"),
    Case("create-fields-not-mapping", create_over([("obs", dr.Field((3,), "float32"))]), dr.SchemaError, r"fields"),
    Case("create-field-too-big", create_over(fields_with(z=lambda: dr.Field((10**12,), "float32"))), dr.SchemaError,
         r"Field shape \(1000000000000,\) of float32 holds 4,000,000,000,000 bytes per step"),
    Case("create-field-negative-shape", create_over(fields_with(z=lambda: dr.Field((-2,), "float32"))), dr.SchemaError,
         r"Field shape must be non-negative, got \(-2,\)"),
    Case("create-field-float-shape", create_over(fields_with(z=lambda: dr.Field((3.5,), "float32"))), dr.SchemaError,
         r"shape"),
    Case("create-chunk-rows-0", create_over(chunk_rows=0), ValueError,
         r"chunk_rows must be an int in \[1, 16777216\], got 0"),
    Case("create-chunk-rows-float", create_over(chunk_rows=8.0), ValueError,
         r"chunk_rows must be an int in \[1, 16777216\], got 8\.0"),
    Case("create-chunk-rows-huge", create_over(chunk_rows=2**30, capacity=None), ValueError,
         r"chunk_rows must be an int in \[1, 16777216\], got 1073741824"),
    Case("create-capacity-not-divisible-over", create_over(capacity=65), ValueError,
         r"capacity must be a multiple of num_envs=2, got 65"),
    Case("create-capacity-0", create_over(capacity=0), ValueError, r"capacity must be a positive int or None, got 0"),
    Case("create-capacity-float", create_over(capacity=64.0), ValueError,
         r"capacity must be a positive int or None, got 64\.0"),
    Case("create-capacity-too-many-chunks", create_over(capacity=2**40, chunk_rows=1), ValueError,
         r"capacity=1,099,511,627,776 with chunk_rows=1 needs 1,099,511,627,776 chunks"),
    Case("create-num-envs-0", create_over(num_envs=0), ValueError, r"num_envs must be an int in \[1, 65536\], got 0"),
    Case("create-num-envs-too-many", create_over(num_envs=65537, capacity=None), ValueError,
         r"num_envs must be an int in \[1, 65536\], got 65537"),
    Case("create-cache-bytes-too-small", create_over(cache_bytes=1000), ValueError,
         r"cache_bytes=1,000 is too small for a writer: staging needs 6 chunks"),
    Case("create-cache-bytes-negative", create_over(cache_bytes=-1), ValueError,
         r"cache_bytes must be an int >= 0, got -1"),
    Case("create-io-threads-0", create_over(io_threads=0), ValueError,
         r"io_threads must be None or an int in \[1, 256\], got 0"),
    Case("create-memory-map-string", create_over(memory_map="yes"), ValueError,
         r"memory_map must be None, True or False, got 'yes'"),
    Case("create-storage-options-list", create_over(storage_options=[1]), ValueError,
         r"storage_options must be a dict or None, got list"),
    Case("create-retry-wrong-type", create_over(retry={"attempts": 3}), ValueError,
         r"retry must be a dr\.RetryPolicy or None, got dict"),
    Case("create-retry-policy-attempts", lambda p: create_over(retry=dr.RetryPolicy(attempts=0))(p), ValueError,
         r"RetryPolicy\.attempts must be an int >= 1, got 0"),
    Case("create-retry-policy-budget-nan",
         lambda p: create_over(retry=dr.RetryPolicy(budget_s=float("nan")))(p), ValueError,
         r"RetryPolicy\.budget_s must be a finite number of seconds > 0, got nan"),
    Case("create-episode-end-not-bool", create_over(episode_end="act"), dr.SchemaError,
         r"episode_end: expected scalar bool fields, got 'act'"),
    Case("create-episode-end-missing", create_over(episode_end=("done", "truncated")), dr.SchemaError,
         r"episode_end: expected scalar bool fields, got 'truncated' \(None\)"),
    Case("create-derive-next-without-twin", create_over(derive_next=("obs",)), ValueError,
         r"derive_next: expected fields 'obs' and 'next_obs' with the same shape and dtype"),
    Case("create-derive-next-without-ends",
         create_over(NEXT_FIELDS, derive_next=("obs",), episode_end=None), ValueError,
         r"derive_next and episodic_return need episode ends"),
    Case("create-episodic-return-missing-reward", create_over(episodic_return=dr.EpisodicReturn()), dr.SchemaError,
         r"episodic_return: expected a scalar reward field 'reward', got None"),
    Case("create-episodic-return-name-clash", create_over(episodic_return=dr.EpisodicReturn(reward="temp", name="obs")),
         dr.SchemaError, r"episodic_return: field 'obs' is computed by the buffer"),
    Case("create-sampler-wrong-type", create_over(sampler="prioritized"), (TypeError, ValueError), r"sampler"),
]

# ---- calls on writers and readers ----

CASES += [
    Case("sample-huge-batch", lambda b: b.sample(10**12), ValueError,
         r"batch_size=1,000,000,000,000 needs [\d,]+ bytes for one batch \(\d+ per row\), more than this machine's",
         writer=True),
    Case("sample-batch-float", lambda b: b.sample(1.5), ValueError,
         r"batch_size must be an int >= 1, got 1\.5", writer=True),
    Case("sample-batch-negative", lambda p: open_ro(p).sample(-4), ValueError,
         r"batch_size must be an int >= 1, got -4"),
    Case("sample-batch-bool", lambda p: open_ro(p).sample(True), ValueError,
         r"batch_size must be an int >= 1, got True"),
    Case("sample-batch-string", lambda p: open_ro(p).sample("4"), ValueError,
         r"batch_size must be an int >= 1, got '4'"),
    Case("sample-slices-too-big", lambda b: b.sample(10**6, seq_len=10**7), ValueError,
         r"batch_size \* seq_len=10,000,000,000,000 needs", writer=True),
    Case("sample-seq-len-float", lambda p: open_ro(p).sample(4, seq_len=2.5), ValueError,
         r"seq_len must be an int >= 1, got 2\.5"),
    Case("sample-beta-nan", lambda b: b.sample(4, beta=float("nan")), ValueError,
         r"beta must be a finite number >= 0, got nan",
         template="per", writer=True),
    Case("sample-beta-negative", lambda b: b.sample(4, beta=-1), ValueError,
         r"beta must be a finite number >= 0, got -1",
         template="per", writer=True),
    Case("sample-beta-string", lambda p: open_ro(p).sample(4, beta="0.5"), ValueError,
         r"beta must be a finite number >= 0, got '0\.5'", template="per"),
    Case("sample-out-unknown-name", lambda b: b.sample(4, out={"bogus": np.zeros(4)}), ValueError,
         r"out: unknown names \['bogus'\]", writer=True),
    Case("sample-out-wrong-shape", lambda b: b.sample(4, out={"obs": np.zeros((4, 2), np.float32)}), ValueError,
         r"out\['obs'\]: expected a C-contiguous float32 array shaped \(4, 3\)", writer=True),
    Case("priority-overflows-float32", lambda b: b.update_priorities([0], [1e39]), ValueError,
         r"TD error 1e\+39 gives priority 1e\+39, above 3\.4e\+38, the largest float32 priority",
         template="per1", writer=True),
    Case("priority-overflow-after-good-one", lambda b: b.update_priorities([0, 1], [0.5, 1e308]), ValueError,
         r"TD error 1e\+308 gives priority", template="per1", writer=True),
    Case("priority-float-index", lambda b: b.update_priorities([0.0], [1.0]), IndexError,
         r"row ids must be non-negative integers", template="per", writer=True),
    Case("add-overflows-float32", lambda b: b.add(**bad_step(obs=np.full((ENVS, 3), 1e300))), dr.SchemaError,
         r"field 'obs': value 1e\+300 overflows the stored dtype float32", writer=True),
    Case("add-int-overflows-float16", lambda b: b.add(**bad_step(temp=np.full(ENVS, 70000))), dr.SchemaError,
         r"field 'temp': value 70000 overflows the stored dtype float16", writer=True),
    Case("extend-overflows-float16", lambda b: b.extend(bad_steps(temp=np.full((3, ENVS), 1e6))), dr.SchemaError,
         r"field 'temp': value 1000000\.0 overflows the stored dtype float16", writer=True),
    Case("extend-list", lambda b: b.extend([1, 2, 3]), dr.SchemaError,
         r"extend expects a mapping of field name to array \(fields \[.*\]\), got list", writer=True),
    Case("extend-string", lambda b: b.extend("obs"), dr.SchemaError,
         r"extend expects a mapping .*got str", writer=True),
    Case("extend-read-only", lambda p: open_ro(p).extend(steps(2)), dr.ReadOnlyError, r"opened read-only \(mode='r'\)"),
    Case("add-mapping-as-env-ids", lambda b: b.add(one_step()), dr.SchemaError,
         r"env_ids: expected a 1-D array of ints, got object", writer=True),
    Case("env-ids-duplicate", lambda b: b.add(env_ids=[0, 0], **one_step()), dr.SchemaError,
         r"env_ids: expected distinct ids, got \[0, 0\]", writer=True),
    Case("env-ids-float", lambda b: b.add(env_ids=[0.5], **{k: v[:1] for k, v in one_step().items()}), dr.SchemaError,
         r"env_ids: expected a 1-D array of ints, got float64", writer=True),
    Case("rows-out-wrong-dtype", lambda p: open_ro(p).rows([0, 1], out={"act": np.zeros(2, np.int32)}), ValueError,
         r"out\['act'\]: expected a C-contiguous int16 array shaped \(2,\)"),
    Case("index-uint64-overflow", lambda p: open_ro(p)[np.array([2**64 - 1], np.uint64)], IndexError,
         r"is not in the buffer"),
    Case("index-huge", lambda p: open_ro(p)[[2**62]], IndexError, r"row id 4611686018427387904 is not in the buffer"),
    # open: locations and options
    Case("open-regular-file", open_rw, dr.NotABufferError,
         r"buf' is a file, not a diskreplay buffer \(a buffer is a directory\)",
         prepare=regular_file),
    Case("open-file-in-buffer", lambda p: open_ro(os.path.join(p, OWN, "commit.json")), dr.NotABufferError,
         r"commit\.json' is a file, not a diskreplay buffer"),
    Case("open-dir-of-other-files", open_rw, dr.NotABufferError, r"is not a diskreplay buffer \(no zarr\.json\)",
         prepare=lambda p: (empty_dir(p), write(os.path.join(p, "notes.txt"), b"mine"))),
    Case("open-url-not-a-path", lambda p: dr.ReplayBuffer.open(42), TypeError,
         r"expected str, bytes or os\.PathLike object"),
    Case("open-mode-append", open_with("a"), ValueError, r"mode must be 'r' or 'r\+', got 'a'"),
    Case("open-mode-none", open_with(None), ValueError, r"mode must be 'r' or 'r\+', got None"),
    Case("open-io-threads-0", open_with("r+", io_threads=0), ValueError,
         r"io_threads must be None or an int in \[1, 256\], got 0"),
    Case("open-io-threads-float", open_with(io_threads=1.5), ValueError,
         r"io_threads must be None or an int in \[1, 256\], got 1\.5"),
    Case("open-io-threads-huge", open_with(io_threads=10**6), ValueError,
         r"io_threads must be None or an int in \[1, 256\], got 1000000"),
    Case("open-memory-map-string", open_with(memory_map="no"), ValueError,
         r"memory_map must be None, True or False, got 'no'"),
    Case("open-memory-map-2", open_with("r+", memory_map=2), ValueError,
         r"memory_map must be None, True or False, got 2"),
    Case("open-retry-wrong-type", open_with(retry=3), ValueError, r"retry must be a dr\.RetryPolicy or None, got int"),
    Case("open-cache-bytes-negative", open_with(cache_bytes=-1), ValueError,
         r"cache_bytes must be an int >= 0, got -1"),
    Case("open-writer-cache-too-small", open_with("r+", cache_bytes=1000), ValueError,
         r"cache_bytes=1,000 is too small for a writer: staging needs 6 chunks"),
]

# ---- calls on closed buffers: ClosedError naming the URL ----

CASES += [
    Case("closed-add", lambda b: b.add(**one_step()), dr.ClosedError, CLOSED, closed=True),
    Case("closed-extend", lambda b: b.extend(steps(2)), dr.ClosedError, CLOSED, closed=True),
    Case("closed-flush", lambda b: b.flush(), dr.ClosedError, CLOSED, closed=True),
    Case("closed-sample", lambda b: b.sample(4), dr.ClosedError, CLOSED, closed=True),
    Case("closed-update-priorities", lambda b: b.update_priorities([0], [1.0]), dr.ClosedError, CLOSED,
         template="per", closed=True),
    Case("closed-rows", lambda b: b.rows([0, 1]), dr.ClosedError, CLOSED, closed=True),
    Case("closed-getitem", lambda b: b[[0]], dr.ClosedError, CLOSED, closed=True),
    Case("closed-episodes", lambda b: b.episodes(), dr.ClosedError, CLOSED, closed=True),
    Case("closed-len", lambda b: len(b), dr.ClosedError, CLOSED, closed=True),
    Case("closed-row-ids", lambda b: b.row_ids(), dr.ClosedError, CLOSED, closed=True),
    Case("closed-state-dict", lambda b: b.state_dict(), dr.ClosedError, CLOSED, closed=True),
    Case("closed-refresh", lambda b: b.refresh(), dr.ClosedError, CLOSED, closed=True),
    Case("closed-save-snapshot", lambda b: b.save_snapshot(b.url + "-snap"), dr.ClosedError, CLOSED, closed=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_call_is_refused_and_changes_nothing(case: Case, templates, tmp_path):
    path = str(tmp_path / "site" / "buf")  # the case's files all lie under tmp_path
    shutil.copytree(templates[case.template], path)
    if case.second:
        shutil.copytree(templates[case.second], path + "-2")
    if case.prepare:
        case.prepare(path)
    buf = dr.ReplayBuffer.open(path, "r+") if case.writer or case.closed else None
    if case.closed:
        buf.close()
    before, everything = dir_snapshot(path), tree(str(tmp_path))
    total = buf.state_dict()["total"].copy() if buf is not None and not case.closed else None
    state = buf.state_dict() if buf is not None and not case.closed else None
    with pytest.raises(case.exc, match=case.match):
        case.call(buf if buf is not None else path)
    assert dir_snapshot(path) == before, "the store changed"
    assert tree(str(tmp_path)) == everything, "files beside the store changed"
    assert not os.path.exists(path + "-new")
    if buf is not None:
        if case.closed:
            buf = dr.ReplayBuffer.open(path, "r+")
        else:
            np.testing.assert_array_equal(buf.state_dict()["total"], total)  # nothing staged either
            assert same_state(buf.state_dict(), state), "the writer's state changed"
        buf.extend(steps(3))  # and the writer still works
        buf.close()
        assert len(dr.ReplayBuffer.open(path)) == min(64, (20 + 3) * ENVS)
    if case.after:
        case.after(path)


def test_table_is_big_enough():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


def test_table_has_at_least_120_kinds():
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids), sorted({i for i in ids if ids.count(i) > 1})
    assert len(set(ids)) >= 120, len(set(ids))
    print(f"\nbad-input kinds: {len(ids)} calls refused with the store unchanged, {len(VERIFY_CASES)} also "
          f"reported by verify")


# ---- verify() finds the same damage, without raising or writing ------------------------------

VERIFY_CASES = {
    "garbage-commit-json": r"commit.json is not valid JSON",
    "commit-wrong-lanes": r"commit.json field 'committed': expected 2 ints",
    "garbage-group-zarr-json": r"zarr.json is not valid JSON",
    "array-dtype-rewritten": r"done/zarr.json: data_type 'int8', the buffer records bool",
    "array-chunks-rewritten": r"act/zarr.json: chunk shape \[1, 4\], expected \[1, 8\]",
    "array-missing": r"array for field 'img' is missing \(img/zarr\.json\)",
    "truncated-raw-chunk": r"chunk 'obs/c.1.2.0' does not decode to 96 bytes",
    "truncated-zstd-chunk": r"chunk 'act/c.1.0' does not decode",
    "deleted-chunk": r"chunk 'done/c.0.1' is missing, but commit.json says it holds rows",
    "missing-state-object": r"state object 'state/episodes\.ends/[^']+' referenced by commit.json is missing",
    "open-empty-dir": r"no zarr.json: not a diskreplay buffer",
    "open-symlink-loop": r"^not a diskreplay buffer \(its path runs into a loop of symbolic links\)$",
    "open-symlink-to-nothing": r"^not a diskreplay buffer \(a symbolic link to '[^']*', which does not exist\)$",
    "open-zarr-group-with-commit": r"a zarr group but not a diskreplay buffer",
    # commit.json
    "commit-committed-negative": COMMIT + r"'committed': expected 2 ints",
    "commit-lower-above-committed": COMMIT + r"'lower': expected lower <= committed per lane",
    "commit-cursor-float": COMMIT + r"'committed': expected 2 ints",
    "commit-cursor-2-60": COMMIT + r"'committed': expected 2 ints in \[0, 70368744177664\]",
    "commit-sequence-negative": COMMIT + r"'sequence': expected an int >= 0",
    "commit-time-nan": COMMIT + r"'time': expected a finite number, got nan",
    "commit-extra-list": COMMIT + r"'extra': expected an object",
    "commit-extra-state-not-object": COMMIT + r"'extra\.state': expected an object",
    "commit-state-arrays-parent-path": COMMIT + r"'extra\.state_arrays': .*'\.\./\.\./victim\.safetensors'",
    "commit-state-arrays-absolute": COMMIT + r"'extra\.state_arrays': .*'/etc/passwd'",
    "commit-dataset-beyond-arrays": COMMIT + r"'committed': 21 steps in a lane, but the arrays hold 20",
    "commit-not-an-object": r"commit\.json is not a JSON object, got list",
    "commit-too-large": r"commit\.json has \d+ bytes, expected at most 16777216",
    "commit-is-a-directory": r"no commit\.json: not a diskreplay buffer",
    # group config
    "config-num-envs-0": CONFIG + r"num_envs: expected an int in \[1, 65536\], got 0",
    "config-lane-capacity-huge-chunk-table": HUGE_LANE_CAPACITY,
    "config-chunk-rows-above-capacity": CONFIG + r"chunk_rows: expected an int in \[1, 32\], got 33",
    "config-compression-unknown": CONFIG + r"compression: expected one of",
    "config-field-huge-shape": CONFIG + r"fields: expected a valid field table "
                               r"\(field 'obs': Field shape \(1000000000000,\)",
    "config-episode-end-not-bool": CONFIG + r"episode_end: .*got \['act'\]",
    "config-separator-unknown": CONFIG + r"chunk_key_separator: expected one of",
    "group-zarr-json-not-object": r"zarr\.json is not a JSON object, got list",
    # array metadata
    "array-shape-lanes": r"obs/zarr\.json: shape \[3, 32, 3\], expected \[2, 32, 3\]",
    "array-shape-float": r"act/zarr\.json: shape \[2, 32\.0\], expected \[2, 32\]",
    "array-codecs-big-endian": r"obs/zarr\.json: big-endian chunks",
    "array-codecs-unknown": r"obs/zarr\.json: unsupported zarr codecs",
    "array-codecs-checksum-dropped": CHECKSUM_DROPPED,
    "array-chunk-key-separator": r"act/zarr\.json: chunk key encoding",
    "array-is-a-group": r"done/zarr\.json: not a Zarr v3 array",
    "array-json-not-object": r"img/zarr\.json is not a JSON object, got list",
    "array-json-is-a-directory": r"obs/zarr\.json",
    # state objects
    "state-garbage": STATE_OBJECT + r" does not load",
    "state-truncated": STATE_OBJECT + r" does not load",
    "state-object-is-a-directory": STATE_OBJECT,
    "state-ends-not-increasing": r"does not open read-only: CorruptBufferError: .*" + OF_STATE
                                 + r"'episodes\.ends' of lane 0",
    "state-leaves-nan": r"does not open read-only: CorruptBufferError: .*" + OF_STATE + r"'sampler\.leaves'",
    "state-epoch-beyond-commit": r"does not open read-only: CorruptBufferError: .*'sampler\.epoch_lo/epoch_hi'",
    "state-json-names-missing-array": r"(does not open read-only: CorruptBufferError: .*)?" + STATE_OBJECT
                                      + r" does not load \(.*'episodes\.nope'",
    "state-json-max-priority-nan": r"does not open read-only: CorruptBufferError: .*'sampler\.max_priority'",
    # one flipped bit
    "bit-flip-state-object": STATE_MISMATCH,
    "bit-flip-priority-value": "^" + PRIORITY_TAIL_FLIPPED,
    "bit-flip-episode-end": "^" + ENDS_TAIL_FLIPPED,
    "bit-flip-priority-base": "^" + PRIORITY_BASE_FLIPPED,
    "bit-flip-journal-checksum": "^" + ENDS_TAIL_FLIPPED,
    "state-leaves-record-uncommitted-row": r"does not open read-only: CorruptBufferError: .*" + OF_STATE
                                           + r"'sampler\.leaves' \(journal record 0\): leaf 25 is slot 25 of lane 0",
    "state-leaves-base-uncommitted-row": r"does not open read-only: CorruptBufferError: .*" + OF_STATE
                                         + r"'sampler\.leaves' \(journal base\): leaf 57",
    "state-json-nested-500": r"commit\.json nests objects and arrays more than 64 levels deep",
}


@pytest.mark.parametrize("case_id", list(VERIFY_CASES))
def test_verify_reports_damage(case_id, templates, tmp_path):
    from diskreplay.audit import verify
    case = next(c for c in CASES if c.id == case_id)
    path = str(tmp_path / "site" / "buf")
    shutil.copytree(templates[case.template], path)
    case.prepare(path)
    before, everything = dir_snapshot(path), tree(str(tmp_path))
    url = re.match(r"buf(-loop|-dangling)'", case.match)  # the case's url is beside the store
    report = verify(path + url.group(1) if url else path)
    assert not report.ok
    assert any(re.search(VERIFY_CASES[case_id], p) for p in report.problems), report.problems
    assert dir_snapshot(path) == before
    assert tree(str(tmp_path)) == everything


def test_verify_cases_cover_tampered_metadata():
    tampered = [i for i in VERIFY_CASES if i.split("-")[0] in ("commit", "config", "group", "array", "state")]
    assert len(tampered) >= 20, tampered


@pytest.mark.parametrize("template", ["ring", "raw", "per", "per1", "wor", "empty"])
def test_verify_accepts_healthy_buffers(template, templates):
    from diskreplay.audit import verify
    report = verify(templates[template])
    assert report.ok, str(report)
    assert report.rows == (0 if template == "empty" else 20 * ENVS)
    assert report.chunks_checked == (0 if template == "empty" else 3 * ENVS * len(FIELDS))
    assert report.episodes == (0 if template == "empty" else len(dr.ReplayBuffer.open(templates[template]).episodes()))
    assert report.notes == []


# ---- ragged and text fields (issue #44) -------------------------------------------------------

RAGGED_FIELDS = {"obs": dr.Field((3,), "float32"), "tok": dr.Field((None,), "int32"),
                 "lp": dr.Field((None,), "float32", length_of="tok"), "pts": dr.Field((None, 3), "float16"),
                 "txt": dr.Field((), "str")}


def ragged_step(i: int) -> dict[str, Any]:
    n = i % 4
    return {"obs": np.full(3, i, np.float32), "tok": np.arange(n, dtype=np.int32), "lp": np.zeros(n, np.float32),
            "pts": np.zeros((n, 3), np.float16), "txt": "é" * n}


def tamper_ends(path: str) -> None:
    ends = zarr.open_array(os.path.join(path, "tok.ends"), mode="r+")
    row = ends[0, :]
    row[6] = 0  # row 6 (row chunk 1, rows [0, 1, 3, 6] ends) now ends before its start, 1
    ends[0, :] = row


RAGGED_CASES = {
    "ragged-lengths-differ-from-length-of": (
        lambda b: b.add(**ragged_step(5) | {"lp": np.zeros(3, np.float32)}), dr.SchemaError,
        r"field 'lp' \(length_of='tok'\): row lengths \[3\] differ from those of 'tok': \[1\]"),
    "ragged-wrong-trailing-shape": (
        lambda b: b.add(**ragged_step(5) | {"pts": np.zeros((1, 2), np.float16)}), dr.SchemaError,
        r"field 'pts': expected each row shaped \(n, \*\(3,\)\), got row 0 shaped \(1, 2\)"),
    "text-not-utf8-bytes": (
        lambda b: b.add(**ragged_step(5) | {"txt": b"ok \xc3("}), dr.SchemaError,
        r"field 'txt': bytes b'ok \\xc3\(' are not valid UTF-8 \(invalid continuation byte at byte 3\)"),
    "ragged-extend-values-not-lengths": (
        lambda b: b.extend({"obs": np.zeros((2, 3), np.float32), "tok": (np.arange(5), np.array([1, 1])),
                            "lp": (np.zeros(2), np.array([1, 1])), "pts": [np.zeros((1, 3))] * 2, "txt": ["a", "b"]}),
        dr.SchemaError, r"field 'tok': expected values shaped \(2,\) \(the sum of the lengths, then the trailing "
                        r"shape\), got \(5,\)"),
    "ragged-tampered-ends-read": (
        lambda b: b[np.array([6])], dr.CorruptBufferError,
        r"ragged field 'tok': row chunk 1 of lane 0 has values \[1, 0\): ends that do not add up"),
}


@pytest.mark.parametrize("case_id", list(RAGGED_CASES))
def test_bad_ragged_input_is_refused_and_changes_nothing(case_id: str, tmp_path) -> None:
    call, exc, match = RAGGED_CASES[case_id]
    path = str(tmp_path / "buf")
    with dr.ReplayBuffer.create(path, RAGGED_FIELDS, capacity=None, chunk_rows=4) as buf:
        for i in range(10):
            buf.add(**ragged_step(i))
    if case_id == "ragged-tampered-ends-read":
        tamper_ends(path)
    buf = dr.ReplayBuffer.open(path, "r+")
    before = dir_snapshot(path)
    with pytest.raises(exc, match=match):
        call(buf)
    assert dir_snapshot(path) == before, "the store changed"
    assert len(buf) == 10
    buf.close()
