"""A Minari dataset (``<dir>/data/main_data.hdf5``, one ``episode_<id>`` group per episode, in id order;
the arrow and parquet data formats are read by `MinariArrowSource`).

``observations[:-1]`` -> ``obs``, ``observations[1:]`` -> ``next_obs``, ``actions`` -> ``action``,
``rewards`` -> ``reward``, ``terminations`` -> ``terminated``, ``truncations`` -> ``truncated``,
``infos/<key>`` -> ``info_<key>``; dict spaces flattened (``obs_<key>``, ``action_<key>``, ...).
Infos with T + 1 entries (the reset's info first) keep their last T. Text (UTF-8 string datasets,
gymnasium ``Text`` spaces) becomes text fields (``Field((), "str")``); JPEG- or PNG-encoded image
observations (Minari's ``jpeg_encoding``: one encoded image per row) become ``codec="jpeg"`` /
``"png"`` frame fields of the first image's shape that keep each image's bytes as they are
(`diskreplay.offline.images`): reads decode them with Pillow, as Minari does.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...format.schema import Field
from ...io import local_path
from ..hdf5 import (
    has_episode_groups,
    hdf5_datasets,
    looks_like_hdf5,
    open_hdf5,
    refuse_link,
    require_h5py,
)
from ..images import image_codec, image_field, image_rows
from ..naming import field_name
from ..source import Batch, ImportFormatError, PendingSlices, Source, field_for
from .minari_arrow import MinariArrowSource, arrow_metadata

MINARI_NAMES = {"actions": "action", "rewards": "reward", "terminations": "terminated",
                "truncations": "truncated"}


class MinariSource(Source):
    """The episodes of a Minari dataset, concatenated in id order into one lane."""

    def __init__(self, src: str, batch_rows: int):
        h5py = require_h5py()
        self.h5py = h5py
        self.batch_rows = batch_rows
        path = local_path(src)
        file = minari_file(path) if os.path.isdir(path) else path
        if file is None:
            raise ImportFormatError(f"{src!r}: not a Minari dataset (no data/main_data.hdf5, and no "
                                    f"data/metadata.json of the arrow or parquet data format)")
        self.file = open_hdf5(h5py, file, src, "a Minari dataset (folder or its main_data.hdf5)")
        self.episodes = self._checked_episodes(src, file)
        self.rows = 0
        for ep in self.episodes:
            self.rows += self._steps(src, ep)
        self._set_fields(src)

    def _steps(self, src: str, ep: Any) -> int:
        """The steps of one episode: the length of its ``rewards`` dataset (ImportFormatError if none)."""
        rewards = ep.get("rewards")
        if not isinstance(rewards, self.h5py.Dataset) or rewards.ndim != 1:
            got = "none" if rewards is None else getattr(rewards, "shape", "a group")
            raise ImportFormatError(f"{src!r}: episode {ep.name!r}: 'rewards' is {got}, expected a dataset of "
                                    f"one value per step")
        return int(rewards.shape[0])

    def _checked_episodes(self, src: str, file: str) -> list[Any]:
        """The episode groups in id order, after refusing every link that leads out of the file."""
        keyed = []
        for key in self.file:
            match = re.fullmatch(r"episode_([0-9]{1,18})", key)
            if match:
                keyed.append((int(match.group(1)), key))
        if not keyed:
            raise ImportFormatError(f"{src!r}: no episode_<id> groups in {file!r}")
        for _, key in keyed:  # by name, h5py follows every link: check them all before the first access
            refuse_link(self.h5py, self.file, key, repr(src), follows_soft=True)
            hdf5_datasets(self.h5py, self.file[key], repr(src), follows_soft=True)
        return [self.file[k] for _, k in sorted(keyed)]

    def _set_fields(self, src: str) -> None:
        """Fields (and the info offsets) from the first episode; ``next_obs*`` beside each ``obs*``."""
        self.fields = {}
        first = self.episodes[0]
        self.info_offset: dict[str, int] = {}
        self.decoders: dict[str, Any] = {}  # field -> how its raw rows become values
        for name, ds, offset in self._columns(first, self._steps(src, first)):
            field = self._field(name, ds, f"{src!r}: {ds.name!r}")
            if field is not None:
                self.fields[name] = field
                self.info_offset[name] = offset
        if "observations" in first:
            for name in list(self.fields):
                if name == "obs" or name.startswith("obs_"):
                    self.fields["next_" + name] = self.fields[name]

    def _field(self, name: str, ds: Any, where: str) -> Field | None:
        """The field of one dataset: text, encoded images (one JPEG / PNG per row, of variable or
        fixed byte length), else its values as stored (`field_for`)."""
        if self.h5py.check_string_dtype(ds.dtype) is not None and ds.ndim == 1:
            self.decoders[name] = _texts
            return Field((), "str")
        varying = ds.ndim == 1 and self.h5py.check_vlen_dtype(ds.dtype) == np.dtype(np.uint8)
        fixed = ds.ndim == 2 and ds.dtype == np.uint8  # every image encoded to the same byte length
        if (varying or fixed) and len(ds) and image_codec(ds[0]) is not None:
            try:
                field = image_field(ds[0], where)
            except ImportFormatError:
                if varying:
                    raise
            else:  # raw bytes that only happen to start like an image stay raw
                self.decoders[name] = lambda rows, where: image_rows(list(rows), field, where)
                return field
        return field_for(name, ds.shape[1:], ds.dtype, where)

    def _columns(self, ep: Any, steps: int) -> Iterator[tuple[str, Any, int]]:
        """(field name, dataset, offset of row t of the episode) for every column of one episode."""
        for key in ep:
            if key == "observations":
                yield from ((n, d, 0) for n, d in self._flatten(ep[key], "obs"))
            elif key == "infos":
                yield from self._info_columns(ep, steps)
            elif key in MINARI_NAMES or key == "actions":
                yield from ((n, d, 0) for n, d in self._flatten(ep[key], MINARI_NAMES[key]))

    def _info_columns(self, ep: Any, steps: int) -> Iterator[tuple[str, Any, int]]:
        """Info columns of T (offset 0) or T + 1 entries (offset 1); others skipped with a warning."""
        for n, d in self._flatten(ep["infos"], "info"):
            length = d.shape[0] if d.ndim else -1
            if length == steps + 1:
                yield n, d, 1
            elif length == steps:
                yield n, d, 0
            else:
                warnings.warn(f"{ep.name}/{d.name}: info skipped ({length} entries for {steps} steps)",
                              stacklevel=4)

    def _flatten(self, obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        if isinstance(obj, self.h5py.Dataset):
            yield prefix, obj
            return
        for key in obj:
            yield from self._flatten(obj[key], f"{prefix}_{field_name(key)}")

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        pending = PendingSlices(self.batch_rows)
        for ep in self.episodes:
            steps = self._steps(self.file.filename, ep)
            columns = {name: (ds, off) for name, ds, off in self._columns(ep, steps) if name in self.fields}
            expected = {n for n in self.fields if not n.startswith("next_obs")}
            if set(columns) != expected:
                raise ImportFormatError(f"{ep.name}: fields {sorted(columns)} differ from the first "
                                        f"episode's {sorted(expected)}")
            for start in range(0, steps, self.batch_rows):
                end = min(start + self.batch_rows, steps)
                yield from pending.add(_episode_slice(ep, columns, start, end, steps, self.decoders))
        yield from pending.drain()

    def close(self) -> None:
        """Releases the files the source holds open."""
        self.file.close()


def _episode_slice(ep: Any, columns: dict[str, tuple[Any, int]], start: int, end: int, steps: int,
                   decoders: dict[str, Any]) -> Batch:
    """Steps ``[start, end)`` of one episode; each ``obs*`` column also gives ``next_obs*``.
    Columns with a decoder (text, encoded images) are decoded."""
    batch = {}
    for name, (ds, off) in columns.items():
        obs = name == "obs" or name.startswith("obs_")
        values = ds[start:end + 1] if obs else ds[start + off:end + off]
        if name in decoders:
            values = decoders[name](values, f"{ep.file.filename!r}: {ds.name}: rows from {start + (0 if obs else off)}")
        if obs:
            if len(values) != end - start + 1:
                raise ImportFormatError(f"{ep.name}: {ds.name} has {ds.shape[0]} entries, "
                                        f"expected {steps + 1} (one more than steps)")
            batch[name], batch["next_" + name] = values[:-1], values[1:]
        else:
            batch[name] = values
    return batch


def _texts(rows: Any, where: str) -> np.ndarray:
    """UTF-8 strings (h5py gives bytes) as an object array of str."""
    try:
        return np.array([r.decode("utf-8") if isinstance(r, bytes) else str(r) for r in rows], dtype=object)
    except UnicodeDecodeError as e:
        raise ImportFormatError(f"{where}: a string that is not UTF-8 ({e})") from None


def minari_file(path: str) -> str | None:
    """The ``main_data.hdf5`` of the Minari dataset folder ``path`` (or its ``data`` folder), or None."""
    for candidate in (os.path.join(path, "data", "main_data.hdf5"), os.path.join(path, "main_data.hdf5")):
        if os.path.isfile(candidate):
            return candidate
    return None


def open_minari(src: str, batch_rows: int) -> Source:
    """The source of a Minari dataset: `MinariArrowSource` for the arrow / parquet data formats,
    else `MinariSource` (HDF5)."""
    path = local_path(src)
    if os.path.isdir(path) and minari_file(path) is None and arrow_metadata(path) is not None:
        return MinariArrowSource(src, batch_rows)
    return MinariSource(src, batch_rows)


def is_minari(path: str) -> bool:
    """``path`` is a Minari dataset folder (any data format), or an HDF5 file with ``episode_*`` groups."""
    if os.path.isdir(path):
        return minari_file(path) is not None or arrow_metadata(path) is not None
    return os.path.isfile(path) and looks_like_hdf5(path) and has_episode_groups(path)
