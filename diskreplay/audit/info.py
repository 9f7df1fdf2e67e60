"""The `info` report: what a buffer holds (fields, rows, episodes, chunks, size on disk, sampler,
last commit), of one buffer or of all the shards of a sharded one, read with the chunk-level
reader of `rows`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..buffer import ReplayBuffer
from ..buffer.setup import read_sharded_root
from ..episodes import end_flags
from ..errors import CorruptBufferError
from ..format.commit import CommitRecord
from ..format.shards import LearnerProgress, shard_name
from ..storage import Storage
from .rows import episode_fields, iter_rows, open_readonly, readable


@dataclass
class EpisodeStats:
    """Per-slice arrays of complete episodes' lengths (steps) and returns, and the lanes whose
    last episode is still running."""

    done_fields: tuple[str, ...]
    lengths: list[np.ndarray] = field(default_factory=list)
    returns: list[np.ndarray] = field(default_factory=list)
    in_progress: int = 0


def episode_stats(buf: ReplayBuffer, batch_rows: int = 65536) -> EpisodeStats | None:
    """Lengths and returns of every complete episode, from the done flags (and ``reward``).

    An episode whose first step is no longer readable (an overwritten ring) is not counted.
    """
    done_names = episode_fields(buf)
    if not done_names:
        return None
    reward = "reward" if "reward" in buf.fields and buf.fields["reward"].shape == () else None
    stats = EpisodeStats(done_names)
    names = list(done_names) + ([reward] if reward else [])
    for lane, lo, hi in readable(buf):
        carry_len, carry_ret, partial_first = 0, 0.0, lo > 0
        for rows in iter_rows(buf, names, lane, lo, hi, batch_rows):
            done = end_flags(rows, done_names)
            r = rows[reward].astype(np.float64) if reward else np.zeros(len(done))
            ends = np.flatnonzero(done)
            if ends.size == 0:
                carry_len += len(done)
                carry_ret += float(r.sum())
                continue
            cs = np.cumsum(r)
            lengths = np.diff(ends, prepend=-1)
            lengths[0] += carry_len
            rets = np.diff(cs[ends], prepend=0.0)
            rets[0] += carry_ret
            if partial_first:
                lengths, rets, partial_first = lengths[1:], rets[1:], False
            stats.lengths.append(lengths)
            stats.returns.append(rets)
            carry_len = len(done) - ends[-1] - 1
            carry_ret = float(cs[-1] - cs[ends[-1]])
        stats.in_progress += int(carry_len > 0)
    return stats


def _disk_usage(buf: ReplayBuffer) -> tuple[int, dict[str, int]]:
    """(bytes of every object under the buffer, every shard's for a sharded one; chunk objects
    per field)."""
    sharded = buf.storage.sharded  # keys begin with the shard's child group
    sizes = buf.storage.store.sizes()
    chunk_files = dict.fromkeys(buf.fields, 0)
    prefix = "c" + buf.storage.config.chunk_key_separator
    for key in sizes:
        field, _, rest = (key.partition("/")[2] if sharded else key).partition("/")
        if field in chunk_files and rest.startswith(prefix) and not rest.endswith(".partial"):
            chunk_files[field] += 1
    return sum(sizes.values()), chunk_files


def buffer_info(url: str, storage_options: dict | None = None, episodes: bool = True) -> dict[str, Any]:
    """Everything `diskreplay info` reports, as plain data (sizes in bytes, times in epoch seconds).

    ``episodes=False`` skips the episode statistics (which read the done flags of every row).
    Of a sharded buffer (all its shards together): instead of ``commit_sequence`` and
    ``last_commit_time``, ``sharded`` (True), ``shards`` (the count), ``per_shard`` (rows readable,
    rows ever added, commit sequence and time of each) and ``learner`` (``learner.json``: samples,
    inserts per shard, time, and ``sampler`` when the learner recorded it; None if absent,
    ``{"error": ...}`` if damaged); its ``sampler`` is then the learner's, and ``sampler_source``
    says whose it is (``"learner"``, or ``"shards"``: the learner's is not recorded).
    A field made by the buffer has ``"derived"`` (what it is made from) in ``fields``: a
    ``derive_next`` twin (rebuilt from the next step, not stored) or the episodic return.
    Raises NotABufferError if ``url`` holds no buffer (or an interrupted import), CorruptBufferError
    if it is damaged (a sharded one: any of its shards).
    """
    buf = open_readonly(url, storage_options)
    try:
        info = _layout_info(buf)
        info.update(_shards_info(buf.storage) if buf.storage.sharded else _commit_info(buf.storage.record))
        if buf.storage.sharded:
            learner = info["learner"] or {}
            info["sampler_source"] = "learner" if learner.get("sampler") else "shards"
            info["sampler"] = learner.get("sampler") or info["sampler"]
        stats = episode_stats(buf) if episodes else None
        info["episodes"] = None if stats is None else _episode_summary(buf, stats)
        return info
    finally:
        buf.close()


def _layout_info(buf: ReplayBuffer) -> dict[str, Any]:
    """The report's rows, fields, chunking, sizes and sampler (of every shard together)."""
    storage = buf.storage
    config = storage.config
    layout = storage.layout
    rows = len(buf)
    windows = readable(buf)
    on_disk, chunk_files = _disk_usage(buf)
    raw = rows * storage.schema.row_bytes
    return {
        "url": buf.url,
        "rows": rows,
        "lanes": buf.num_envs,
        "rows_per_lane": [hi - lo for _, lo, hi in windows],
        "capacity": buf.capacity,
        "fields": {n: {"shape": list(f.declared_shape), "dtype": "str" if f.text else f.dtype.name,
                       **_derivation(buf, n)} for n, f in buf.fields.items()},
        "chunk_rows": layout.chunk_rows,
        "chunks_per_field": sum(len(layout.chunks_between(lo, hi)) for _, lo, hi in windows),
        "inner_chunk_rows": {name: codec.inner_rows for name, codec in storage.codecs.items()
                             if codec.inner_rows is not None},
        "chunk_files": chunk_files,
        "compression": config.compression,
        "compression_level": config.level,
        "bytes_on_disk": on_disk,
        "bytes_raw": raw,
        "compression_ratio": raw / on_disk if on_disk else None,
        "sampler": ", ".join(dict.fromkeys(_sampler_name(record) for record in storage.shard_records())),
    }


def _derivation(buf: ReplayBuffer, name: str) -> dict[str, str]:
    """``{"derived": how}`` for a field the buffer makes (a ``derive_next`` twin, the episodic
    return), else nothing."""
    base = buf.view.derived.get(name)
    if base is not None:
        return {"derived": f"{base} of the next step (derive_next; not stored)"}
    returns = buf.episodic_return
    if returns is not None and returns.name == name:
        return {"derived": f"discounted return of {returns.reward}, gamma {returns.gamma:g} (episodic_return)"}
    return {}


def _sampler_name(record: CommitRecord) -> str:
    """The type of the sampler saved with ``record`` (``Uniform`` when none is)."""
    return str(((record.state or {}).get("sampler") or {}).get("type", "Uniform"))


def _commit_info(record: CommitRecord) -> dict[str, Any]:
    """The report's last commit, of a buffer that is not sharded."""
    return {"commit_sequence": record.sequence, "last_commit_time": record.time}


def _shards_info(union: Storage) -> dict[str, Any]:
    """The report's shards: per shard its rows and last commit (`_shard_rows`), and the
    learner's progress (`_learner_info`)."""
    return {"sharded": True, "shards": union.shards, "per_shard": _shard_rows(union),
            "learner": _learner_info(union)}


def _shard_rows(union: Storage) -> list[dict[str, Any]]:
    """Per shard of ``union`` (a sharded buffer's storage), in shard order: its index and child
    group name, the rows readable in the commit it shows, the rows ever committed to it
    (``added``, overwritten ones included), and that commit's sequence number and time (epoch
    seconds)."""
    records = union.shard_records()
    envs = union.layout.num_envs // len(records)
    lo, hi = union.window()
    rows = []
    for shard, record in enumerate(records):
        lanes = slice(shard * envs, (shard + 1) * envs)
        rows.append({"shard": shard, "name": shard_name(shard), "rows": int((hi[lanes] - lo[lanes]).sum()),
                     "added": int(union.total[lanes].sum()), "commit_sequence": record.sequence,
                     "last_commit_time": record.time})
    return rows


def _learner_info(union: Storage) -> dict[str, Any] | None:
    """``learner.json`` in the root of ``union``: rows sampled, inserts seen per shard and the
    time it was published (None if no learner published; ``{"error": why}`` if it is damaged)."""
    root = read_sharded_root(union.store, union.url)
    blob = None if root is None else union.store.get(root.learner_key, limit=1 << 20)
    if blob is None:
        return None
    try:
        progress = LearnerProgress.from_bytes(blob, union.url, union.shards)
    except CorruptBufferError as exc:
        return {"error": str(exc).removeprefix(f"{union.url!r}: ")}
    out = {"samples": progress.samples, "inserts": list(progress.inserts), "time": progress.time}
    return out if progress.sampler is None else {**out, "sampler": progress.sampler}


def _episode_summary(buf: ReplayBuffer, stats: EpisodeStats) -> dict[str, Any]:
    """Count and length / return statistics of the complete episodes in ``stats``."""
    lengths = np.concatenate(stats.lengths) if stats.lengths else np.zeros(0, np.int64)
    returns = np.concatenate(stats.returns) if stats.returns else np.zeros(0)
    has_reward = "reward" in buf.fields and buf.fields["reward"].shape == ()
    return {
        "done_fields": list(stats.done_fields),
        "count": int(lengths.size),
        "in_progress": stats.in_progress,
        "length_mean": float(lengths.mean()) if lengths.size else None,
        "length_min": int(lengths.min()) if lengths.size else None,
        "length_max": int(lengths.max()) if lengths.size else None,
        "return_mean": float(returns.mean()) if lengths.size and has_reward else None,
    }


def _mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


def format_info(info: dict[str, Any]) -> str:
    """The human-readable `info` report (of a sharded buffer: its shards and learner at the end)."""
    sharded = bool(info.get("sharded"))
    head = f"buffer      {info['url']}" + (f" (sharded: {info['shards']} shards)" if sharded else "")
    lines = [head, _rows_line(info), "fields"]
    width = max(len(n) for n in info["fields"])
    for name, spec in info["fields"].items():
        derived = f" derived: {spec['derived']}" if "derived" in spec else ""
        lines.append(f"  {name:<{width}}  {tuple(spec['shape'])!s:<14} {spec['dtype']:<8}{derived}".rstrip())
    lines.append(_episodes_line(info["episodes"]))
    files = sum(info["chunk_files"].values())
    lines.append(f"chunks      {info['chunks_per_field']:,} per field x {len(info['fields'])} fields "
                 f"({info['chunk_rows']:,} rows each); {files:,} chunk objects stored")
    if info["inner_chunk_rows"]:
        inner = ", ".join(f"{name} {rows:,} row{'s' * (rows != 1)}" for name, rows in info["inner_chunk_rows"].items())
        lines.append(f"            Zarr shards read row by row, inner chunks: {inner}")
    comp = info["compression"] or "none"
    if info["compression"]:
        comp += f" level {info['compression_level']}"
    ratio = f"{info['compression_ratio']:.2f}x" if info["compression_ratio"] else "-"
    lines.append(f"size        {_mb(info['bytes_on_disk'])} on disk, {_mb(info['bytes_raw'])} raw "
                 f"(ratio {ratio}, {comp})")
    lines.append(f"sampler     {info['sampler']}" + _SAMPLER_SOURCES.get(info.get("sampler_source", ""), ""))
    if sharded:
        lines += _shard_lines(info["per_shard"], info["learner"])
    else:
        lines.append(f"last commit #{info['commit_sequence']} at {_when(info['last_commit_time'])}")
    return "\n".join(lines)


_SAMPLER_SOURCES = {"learner": " (the learner's, from learner.json)",
                    "shards": " (the shards'; the learner's own is recorded in learner.json only by a learner "
                              "with a rate_limiter)"}


def _when(seconds: float) -> str:
    """Epoch seconds as local time, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _rows_line(info: dict[str, Any]) -> str:
    """Rows, lanes (their rows, the first 8) and the capacity."""
    cap = "dataset mode (grows)" if info["capacity"] is None else f"ring, capacity {info['capacity']:,}"
    if info["capacity"] is not None and info.get("sharded"):
        cap += f" ({info['capacity'] // info['shards']:,} per shard)"
    per_lane = info["rows_per_lane"]
    lanes = f"{info['lanes']} lane" + ("s" if info["lanes"] > 1 else "")
    if info["lanes"] > 1:
        lanes += f" ({', '.join(f'{r:,}' for r in per_lane[:8])}{', ...' if len(per_lane) > 8 else ''})"
    return f"rows        {info['rows']:,} in {lanes}; {cap}"


def _episodes_line(ep: dict[str, Any] | None) -> str:
    """The complete episodes: count, lengths and mean return."""
    if ep is None:
        return "episodes    - (no done / terminated / truncated field)"
    if ep["count"] == 0:
        return f"episodes    0 complete, {ep['in_progress']} in progress (ends: {' | '.join(ep['done_fields'])})"
    text = (f"episodes    {ep['count']:,} complete, {ep['in_progress']} in progress; length mean "
            f"{ep['length_mean']:.1f}, min {ep['length_min']:,}, max {ep['length_max']:,}")
    if ep["return_mean"] is not None:
        text += f"; mean return {ep['return_mean']:.3f}"
    return text


def _shard_lines(shards: list[dict[str, Any]], learner: dict[str, Any] | None) -> list[str]:
    """A table of the shards (rows readable and ever added, last commit, the inserts the learner
    had seen), then the learner's progress."""
    seen = learner.get("inserts") if learner else None
    header = ["shard", "rows", "added", "commit", "last commit"] + (["learner saw"] if seen else [])
    table = [header] + [[s["name"], f"{s['rows']:,}", f"{s['added']:,}", f"#{s['commit_sequence']}",
                         _when(s["last_commit_time"])] + ([f"{seen[s['shard']]:,}"] if seen else []) for s in shards]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    lines = [f"shards      {len(shards)}"]
    for row in table:
        cells = [cell.ljust(w) if c in (0, 4) else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  " + "  ".join(cells).rstrip())
    if learner is None:
        lines.append("learner     - (no learner.json: no learner has published its progress)")
    elif "error" in learner:
        lines.append(f"learner     damaged: {learner['error']}")
    else:
        lines.append(f"learner     {learner['samples']:,} rows sampled, {sum(learner['inserts']):,} inserts seen, "
                     f"published at {_when(learner['time'])}")
    return lines
