"""Export a buffer's episodes as a Minari dataset folder in Minari's ``arrow`` data format.

The folder holds ``data/metadata.json`` (``data_format`` ``"arrow"``, Box observation and action
spaces from the fields' shapes and dtypes, ``dataset_id`` the Minari id, see `minari_dataset_id`)
and one ``data/<id>/part-0.arrow`` per episode (Arrow IPC, T + 1 rows: the observations, then
actions, rewards, terminations and truncations padded by one row), as Minari writes them: at the
id's path under Minari's datasets folder (``MINARI_DATASETS_PATH``, else ``~/.minari/datasets``),
``minari.load_dataset(id)`` opens it and ``minari.list_local_datasets()`` lists it; the
``"minari"`` import reads it back.

Needs fields ``obs``, ``action`` and ``reward`` (non-bool numbers); ``terminated`` and
``truncated`` are written when present (else False). An episode ends after a row whose end flag
is set; a lane's last, unfinished episode is written truncated. An episode's last observation is
its last row's ``next_obs`` when that field exists, else its ``obs`` repeated. Other fields are
not written (a warning names them). Minari reads an episode as one record batch, so each episode
is held in memory whole while it is written (memory: one episode plus one slice).
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..audit.rows import episode_fields, iter_rows, readable
from ..episodes import end_flags
from .formats.parquet import require_arrow

REQUIRED = ("obs", "action", "reward")
WRITTEN = (*REQUIRED, "terminated", "truncated", "next_obs")
MINARI_VERSION = "0.5.0"  # the dataset layout written: read by Minari 0.5 and later
DATASET_ID = re.compile(r"(?:[-_\w][-_\w/]*[-_\w]+/)?[-_\w]+?-v\d+")
"""A Minari dataset id, ``(namespace/)name-vN``, as ``minari.parse_dataset_id`` accepts it."""


def minari_dataset_id(dest: str, chosen: str | None) -> str:
    """The Minari id of a dataset exported to the folder ``dest``: ``chosen``, else ``dest``'s path
    under Minari's datasets folder (``MINARI_DATASETS_PATH``, else ``~/.minari/datasets``), else
    ``dest``'s name.

    Raises ValueError for an id that is not ``(namespace/)name-vN``, or for a ``dest`` under the
    datasets folder at another path than the id's (Minari would not find it there)."""
    root = os.path.realpath(os.environ.get("MINARI_DATASETS_PATH")
                            or os.path.join(os.path.expanduser("~"), ".minari", "datasets"))
    path = os.path.realpath(dest)
    under = os.path.relpath(path, root).replace(os.sep, "/") if path.startswith(root + os.sep) else None
    dataset_id = chosen or under or os.path.basename(path)
    if not DATASET_ID.fullmatch(dataset_id):
        raise ValueError(f"Minari dataset id {dataset_id!r} is malformed: expected (namespace/)name-vN, e.g. "
                         f"'diskreplay/pendulum-v0' (choose it with dataset_id=, --dataset-id)")
    if under is not None and under != dataset_id:
        raise ValueError(f"{dest!r} is {under!r} under Minari's datasets folder {root!r}, but its dataset id is "
                         f"{dataset_id!r}: Minari finds a dataset at its id's path only, export it to "
                         f"{os.path.join(root, dataset_id)!r}")
    return dataset_id


def box_space(spec: Any) -> str:
    """The JSON of a Box space (Minari's serialization) holding rows of field ``spec``."""
    dtype = np.dtype(spec.dtype)
    if dtype.kind == "f":
        low, high = -np.inf, np.inf
    elif dtype.kind in "iu":
        low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
    else:
        raise ValueError(f"a field of dtype {dtype} cannot be a Minari Box space")
    bounds = np.full(spec.shape, low, dtype=np.float64 if dtype.kind == "f" else dtype)
    return json.dumps({"type": "Box", "dtype": str(dtype), "shape": list(spec.shape),
                       "low": bounds.tolist(), "high": np.full(spec.shape, high, dtype=bounds.dtype).tolist()})


def write_minari(buf: Any, path: str, batch_rows: int, compress: bool, bar: Any, dataset_id: str) -> None:
    """Writes the episodes of ``buf`` as the new Minari dataset folder ``path`` (module docstring),
    of id ``dataset_id`` (`minari_dataset_id`)."""
    pa = require_arrow()

    missing = [name for name in REQUIRED if name not in buf.fields]
    if missing:
        raise ValueError(f"a Minari export needs fields {list(REQUIRED)}; missing {missing}")
    skipped = sorted(set(buf.fields) - set(WRITTEN))
    if skipped:
        warnings.warn(f"fields {skipped} are not written to the Minari dataset", stacklevel=3)
    meta = {"data_format": "arrow", "jpeg_encoding": False, "dataset_id": dataset_id,
            "minari_version": MINARI_VERSION, "algorithm_name": "diskreplay export",
            "observation_space": box_space(buf.fields["obs"]), "action_space": box_space(buf.fields["action"])}
    data = os.path.join(path, "data")
    os.makedirs(data)
    episodes, steps = 0, 0
    for episode in _episodes(buf, batch_rows):
        _write_episode(pa, os.path.join(data, str(episodes)), episodes, episode, compress)
        n = len(episode["reward"])
        episodes, steps = episodes + 1, steps + n
        bar.update(n)
    meta.update(total_episodes=episodes, total_steps=steps, dataset_size=0.0)
    with open(os.path.join(data, "metadata.json"), "w") as f:
        json.dump(meta, f)


def _episodes(buf: Any, batch_rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Each episode's rows of the written fields, lane after lane; a lane's unfinished last
    episode comes with ``truncated`` set at its last row."""
    names = [name for name in WRITTEN if name in buf.fields]
    ends = episode_fields(buf)
    read = names + [k for k in ends if k not in names]
    for lane, lo, hi in readable(buf):
        parts: list[dict[str, np.ndarray]] = []
        for part in iter_rows(buf, read, lane, lo, hi, batch_rows):
            done = end_flags(part, ends) if ends else np.zeros(len(part[read[0]]), bool)
            start = 0
            for stop in (np.flatnonzero(done) + 1).tolist():
                parts.append({k: part[k][start:stop] for k in names})
                yield _joined(parts, False)
                parts, start = [], stop
            if start < len(done):
                parts.append({k: part[k][start:] for k in names})
        if parts:
            yield _joined(parts, True)


def _joined(parts: list[dict[str, np.ndarray]], unfinished: bool) -> dict[str, np.ndarray]:
    """One episode from its parts; ``unfinished``: marked truncated at its last row."""
    episode = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if unfinished:
        episode["truncated"] = episode.get("truncated", np.zeros(len(episode["reward"]), bool)).copy()
        episode["truncated"][-1] = True
    return episode


def _write_episode(pa: Any, folder: str, episode_id: int, ep: dict[str, np.ndarray], compress: bool) -> None:
    """One episode folder: ``part-0.arrow`` (one record batch of T + 1 rows) and ``metadata.json``."""
    steps = len(ep["reward"])
    last = ep["next_obs"][-1:] if "next_obs" in ep else ep["obs"][-1:]
    flags = {k: np.append(ep.get(k, np.zeros(steps, bool)).astype(bool), False)
             for k in ("terminated", "truncated")}
    columns = {"observations": _box_column(pa, np.concatenate([ep["obs"], last])),
               "actions": _box_column(pa, np.concatenate([ep["action"], np.zeros_like(ep["action"][:1])])),
               "rewards": pa.array(np.append(ep["reward"], np.zeros(1, ep["reward"].dtype))),
               "terminations": pa.array(flags["terminated"]), "truncations": pa.array(flags["truncated"])}
    batch = pa.RecordBatch.from_pydict(columns)
    os.makedirs(folder)
    options = pa.ipc.IpcWriteOptions(compression="zstd") if compress else None
    with pa.ipc.new_file(os.path.join(folder, "part-0.arrow"), batch.schema, options=options) as writer:
        writer.write_batch(batch)
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"id": episode_id, "total_steps": steps}, f)


def _box_column(pa: Any, values: np.ndarray) -> Any:
    """Rows of a Box space as Minari stores them: fixed-size lists of the flattened row."""
    flat = np.ascontiguousarray(values).reshape(len(values), -1)
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
