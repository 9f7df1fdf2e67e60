"""An ``.npz`` file: one field per member, named by `d4rl_field_name`, streamed member by member."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from typing import Any

from ...io import local_path
from ..naming import EXPORT_ATTR
from ..npyfile import STREAM_ERRORS, NpyStream
from ..source import (
    Batch,
    ColumnsSource,
    ImportFormatError,
    as_bool_flags,
    derives_next_obs,
    file_magic,
    with_next_obs,
)


class NpzSource(ColumnsSource):
    """An ``.npz`` file; ``d4rl=True`` (format "d4rl") also derives a missing ``next_obs``."""

    def __init__(self, src: str, batch_rows: int, d4rl: bool = False):
        self.batch_rows = batch_rows
        try:
            self.zip = zipfile.ZipFile(local_path(src))
        except (zipfile.BadZipFile, UnicodeDecodeError, ValueError) as e:
            raise ImportFormatError(f"{src!r} is not an .npz file (not a zip archive); expected an .npz "
                                    f"written by numpy.savez or 'diskreplay export' (zipfile: {e})") from None
        self.streams: dict[str, NpyStream] = {}
        try:
            for member in self.zip.namelist():
                if member.endswith(".npy"):
                    size = self.zip.getinfo(member).file_size
                    self.streams[member[:-4]] = NpyStream(self._open_member(src, member), size, f"{src!r}: {member}")
            names = self._setup(src, {k: (s.shape, s.dtype) for k, s in self.streams.items()})
        except BaseException:
            self.close()
            raise
        self.streams = {names[k]: s for k, s in self.streams.items()}
        self.derive_next = d4rl and derives_next_obs(self.fields, self.zip.comment == EXPORT_ATTR.encode())
        if self.derive_next:
            self.fields["next_obs"] = self.fields["obs"]

    def _open_member(self, src: str, member: str) -> Any:
        """The stream of one member; ImportFormatError for an encrypted, damaged or unsupported one."""
        try:
            return self.zip.open(member)
        except (zipfile.BadZipFile, RuntimeError, NotImplementedError, *STREAM_ERRORS) as e:
            raise ImportFormatError(f"{src!r}: {member}: cannot be read ({e})") from None

    def batches(self) -> Iterator[tuple[int, Batch]]:
        """Yields ``(lane, {field: rows})`` slices in order, each at most about batch_rows rows."""
        columns = [name for name in self.fields if name in self.streams]
        slices = (as_bool_flags({name: self.streams[name].read(self.batch_rows) for name in columns}, self.fields)
                  for _ in range(0, self.rows, self.batch_rows))
        for batch in with_next_obs(slices) if self.derive_next else slices:
            yield 0, batch

    def close(self) -> None:
        """Releases the files the source holds open."""
        for stream in self.streams.values():
            stream.close()
        self.zip.close()


def is_npz(path: str) -> bool:
    """``path`` is a zip file (by its signature) or named ``.npz``."""
    return os.path.isfile(path) and (file_magic(path)[:2] == b"PK" or path.endswith(".npz"))
