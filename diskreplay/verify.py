"""`verify`: check a buffer's stored objects against its last commit, reading every chunk.

What it checks (each failure is one line in `VerifyReport.problems`; it never raises for a bad
buffer and never writes):

- ``commit.json`` exists and parses, with cursors for every lane and ``lower <= committed``;
- the Zarr group is a diskreplay buffer, and each field's array metadata (``zarr.json``: data
  type, shape, chunk shape, codecs, byte order) matches the buffer's recorded config;
- every chunk that holds a committed, visible row exists and decodes to exactly one chunk's bytes
  (diskreplay writes every chunk it fills, whatever its values, so a missing one is an error,
  never "all fill value");
- the state object the commit references (sampler, generator, episode index) exists and loads;
- the buffer opens read-only and, if it keeps an episode index, lists its episodes.

Things that are harmless but worth knowing go to `VerifyReport.notes`: a writer lock left
behind, orphaned temporary files (``*.partial``) of a writer killed mid-write.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import snapshot
from .chunkstore import LocalChunkStore, open_chunkstore
from .lanes import LaneLayout
from .lock import LOCK_KEY, LockInfo
from .schema import Schema
from .storage import COMMIT_KEY, Commit
from .zarr_layout import FORMAT, Codec, chunk_key

BATCH_CHUNKS = 256  # chunk objects fetched (and held) at once


@dataclass
class VerifyReport:
    """The outcome of `verify`. ``ok`` is True when ``problems`` is empty."""

    url: str
    ok: bool = True
    rows: int = 0
    episodes: int | None = None
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.problems.append(text)
        self.ok = False

    def __str__(self) -> str:
        head = (f"{self.url}: {'OK' if self.ok else 'PROBLEMS'} - {self.rows} rows, "
                f"{self.chunks_checked} chunks checked"
                + (f", {self.episodes} episodes" if self.episodes is not None else ""))
        lines = [head] + [f"  problem: {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def verify(url: str | os.PathLike, storage_options: dict | None = None) -> VerifyReport:
    """Check the buffer at ``url`` (see the module docstring). Reads every committed chunk."""
    url = os.fspath(url)
    report = VerifyReport(url)
    store = open_chunkstore(url, storage_options)
    commit_blob = store.get(COMMIT_KEY)
    if commit_blob is None:
        report.problem(f"no {COMMIT_KEY}: not a diskreplay buffer (or its creation never finished)")
        return report
    config = _read_config(store, report)
    if config is None:
        return report
    try:
        schema = Schema.from_json(config["fields"])
        layout = LaneLayout(int(config["num_envs"]), config["lane_capacity"], int(config["chunk_rows"]))
        codec = Codec(config["compression"], int(config["level"]))
    except Exception as exc:
        report.problem(f"group zarr.json: the diskreplay config is invalid ({exc})")
        return report
    try:
        commit = Commit.from_bytes(commit_blob, url, layout.num_envs)
    except Exception as exc:
        report.problem(str(exc))
        return report
    if (commit.lower < 0).any() or (commit.committed < 0).any():
        report.problem(f"{COMMIT_KEY}: negative cursors (committed {commit.committed.tolist()}, "
                       f"lower {commit.lower.tolist()})")
        return report
    hi = commit.committed
    lo = np.minimum(np.maximum(commit.lower, layout.oldest(hi)), hi)
    report.rows = int((hi - lo).sum())
    lane_rows = _check_arrays(store, schema, layout, codec, config, report)
    if lane_rows is not None and layout.lane_capacity is None and int(hi.max(initial=0)) > lane_rows:
        report.problem(f"arrays hold {lane_rows} steps per lane, but {COMMIT_KEY} commits "
                       f"{int(hi.max())}")
    _check_chunks(store, schema, layout, codec, config["chunk_key_separator"], lo, hi, report)
    _check_state(store, commit, report)
    _notes(store, report)
    if report.ok:
        _count_episodes(url, storage_options, report)
    return report


def _read_json(store: Any, key: str, report: VerifyReport) -> dict | None:
    blob = store.get(key)
    if blob is None:
        report.problem(f"{key} is missing")
        return None
    try:
        data = json.loads(blob)
    except ValueError as exc:
        report.problem(f"{key} is not valid JSON ({exc})")
        return None
    if not isinstance(data, dict):
        report.problem(f"{key} is not a JSON object")
        return None
    return data


def _read_config(store: Any, report: VerifyReport) -> dict | None:
    group = _read_json(store, "zarr.json", report)
    if group is None:
        return None
    if group.get("zarr_format") != 3 or group.get("node_type") != "group":
        report.problem("zarr.json: not a Zarr v3 group")
        return None
    config = group.get("attributes", {}).get("diskreplay")
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        report.problem(f"zarr.json: a Zarr group but not a diskreplay buffer (no {FORMAT} attributes)")
        return None
    missing = [k for k in ("fields", "num_envs", "lane_capacity", "chunk_rows", "compression", "level")
               if k not in config]
    if missing:
        report.problem(f"zarr.json: the diskreplay config lacks {missing}")
        return None
    config.setdefault("chunk_key_separator", "/")  # buffers from before the "." keys
    return config


def _check_arrays(store: Any, schema: Schema, layout: LaneLayout, codec: Codec, config: dict,
                  report: VerifyReport) -> int | None:
    """Each field's array metadata against the config; returns the smallest step-axis length."""
    lane_rows: list[int] = []
    for name, f in schema.items():
        key = f"{name}/zarr.json"
        meta = _read_json(store, key, report)
        if meta is None:
            continue
        if meta.get("node_type") != "array":
            report.problem(f"{key}: not an array")
            continue
        try:
            stored = np.dtype(meta["data_type"])
        except (KeyError, TypeError):
            report.problem(f"{key}: data_type {meta.get('data_type')!r} is not a plain numeric type")
            continue
        if stored != f.dtype.newbyteorder("="):
            report.problem(f"{key}: data_type {meta['data_type']!r}, the buffer records {f.dtype.name} "
                           f"for field {name!r}")
        shape = tuple(meta.get("shape", ()))
        if len(shape) != 2 + len(f.shape) or shape[0] != layout.num_envs or tuple(shape[2:]) != f.shape:
            report.problem(f"{key}: shape {list(shape)}, expected {[layout.num_envs, 'steps', *f.shape]}")
        else:
            lane_rows.append(int(shape[1]))
            if layout.lane_capacity is not None and shape[1] != layout.lane_capacity:
                report.problem(f"{key}: {shape[1]} steps per lane, the ring holds {layout.lane_capacity}")
        grid = meta.get("chunk_grid", {})
        chunks = tuple(grid.get("configuration", {}).get("chunk_shape", ()))
        expected = (1, layout.chunk_rows, *f.shape)
        if grid.get("name") != "regular" or chunks != expected:
            report.problem(f"{key}: chunk shape {list(chunks)}, expected {list(expected)}")
        encoding = meta.get("chunk_key_encoding", {})
        separator = config["chunk_key_separator"]
        if encoding.get("name") != "default" or encoding.get("configuration", {}).get("separator", "/") != separator:
            report.problem(f"{key}: chunk key encoding {encoding}, expected default with {separator!r}")
        codecs = meta.get("codecs", [])
        try:
            got = Codec.from_zarr_codecs(name, codecs)
            if got != codec:
                report.problem(f"{key}: codecs {[c.get('name') for c in codecs]} differ from the buffer's "
                               f"({config['compression']!r})")
            endian = codecs[0].get("configuration", {}).get("endian", "little")
            if f.dtype.itemsize > 1 and endian != "little":
                report.problem(f"{key}: {endian}-endian chunks, diskreplay writes little-endian")
        except Exception as exc:
            report.problem(f"{key}: {exc}")
    return min(lane_rows) if lane_rows else None


def _check_chunks(store: Any, schema: Schema, layout: LaneLayout, codec: Codec, separator: str,
                  lo: np.ndarray, hi: np.ndarray, report: VerifyReport) -> None:
    work = [(lane, int(c)) for lane in range(layout.num_envs)
            for c in layout.chunks_between(int(lo[lane]), int(hi[lane]))]
    fields = list(schema.items())
    buffers = {name: np.empty((layout.chunk_rows, *f.shape), f.dtype) for name, f in fields}
    keys = [(chunk_key(name, f, lane, c, separator), name) for lane, c in work for name, f in fields]
    for start in range(0, len(keys), BATCH_CHUNKS):
        batch = keys[start:start + BATCH_CHUNKS]
        blobs = store.get_many([k for k, _ in batch])
        for (key, name), blob in zip(batch, blobs):
            report.chunks_checked += 1
            if blob is None:
                report.problem(f"chunk {key!r} is missing, but {COMMIT_KEY} says it holds rows")
                continue
            try:
                codec.decode_into(blob, buffers[name])
            except Exception as exc:
                report.problem(f"chunk {key!r} does not decode to {buffers[name].nbytes} bytes ({exc})")


def _check_state(store: Any, commit: Commit, report: VerifyReport) -> None:
    key = commit.extra.get("state_arrays") if isinstance(commit.extra, dict) else None
    if not key:
        return
    blob = store.get(key)
    if blob is None:
        report.problem(f"state object {key!r} referenced by {COMMIT_KEY} is missing")
        return
    try:
        snapshot.arrays_from_bytes(blob)
    except Exception as exc:
        report.problem(f"state object {key!r} does not load ({exc})")


def _notes(store: Any, report: VerifyReport) -> None:
    lock = store.get(LOCK_KEY)
    if lock is not None:
        holder = LockInfo.from_bytes(lock)
        stale = holder.stale_reason()
        report.notes.append(f"{LOCK_KEY} present: held by {holder.describe()}"
                            + (f" (stale: {stale})" if stale else ""))
    if isinstance(store, LocalChunkStore):
        partial = []
        for root, _, files in os.walk(store.root):
            partial += [os.path.relpath(os.path.join(root, f), store.root) for f in files if f.endswith(".partial")]
        if partial:
            report.notes.append(f"{len(partial)} orphaned temporary file(s) from an interrupted write, "
                                f"e.g. {sorted(partial)[0]!r} (harmless; safe to delete when no writer runs)")


def _count_episodes(url: str, storage_options: dict | None, report: VerifyReport) -> None:
    from .buffer import ReplayBuffer

    try:
        buf = ReplayBuffer.open(url, "r", storage_options=storage_options, cache_bytes=1)
    except Exception as exc:
        report.problem(f"the buffer does not open read-only: {type(exc).__name__}: {exc}")
        return
    try:
        if buf.episode_index.enabled:
            report.episodes = len(buf.episodes())
    except Exception as exc:
        report.problem(f"the episode index is unreadable: {type(exc).__name__}: {exc}")
    finally:
        buf.close()
