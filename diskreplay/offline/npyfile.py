"""Streaming ``.npy`` data (a file, or an ``.npz`` member) front to back, trusting no header."""

from __future__ import annotations

import math
import warnings
import zipfile
import zlib
from typing import Any

import numpy as np

from .source import ImportFormatError

STREAM_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError)
"""What a damaged zip member raises while it is read (bad CRC, corrupt or cut deflate data)."""
READ_PIECE_BYTES = 1 << 20
FORTRAN_WHOLE_BYTES = 16 * 2**20  # a Fortran-ordered .npz member up to this size is read whole, larger refused


def npy_header(fileobj: Any, size: int, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype of a ``.npy`` stream of ``size`` bytes, read from its header.

    Raises ImportFormatError for object arrays, scalars, and a header claiming more data than the
    stream holds (nothing is allocated on a header's word).
    """
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fileobj)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(fileobj)
        else:
            shape, fortran, dtype = fmt.read_array_header_2_0(fileobj)
    except (ValueError, TypeError, SyntaxError, *STREAM_ERRORS) as e:
        raise ImportFormatError(f"{where}: not a valid .npy header ({e})") from None
    if not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ImportFormatError(f"{where}: the header's shape {tuple(shape)} has a negative size")
    if dtype.hasobject:
        raise ImportFormatError(f"{where}: object arrays cannot be imported")
    if not shape:
        raise ImportFormatError(f"{where}: a scalar, expected an array with a step axis")
    claimed, held = math.prod(shape) * dtype.itemsize, size - fileobj.tell()
    if claimed > held:
        raise ImportFormatError(f"{where}: the header claims shape {tuple(shape)} of {dtype} ({claimed} bytes) "
                                f"but only {held} bytes of data follow; expected a complete .npy array")
    return tuple(shape), fortran, dtype


class NpyStream:
    """Row slices of one ``.npy`` stream read front to back (works inside a compressed zip).

    A Fortran-ordered array (rows not contiguous) is read whole when it holds at most
    `FORTRAN_WHOLE_BYTES`, refused with ImportFormatError when larger.
    """

    def __init__(self, fileobj: Any, size: int, where: str):
        shape, fortran, dtype = npy_header(fileobj, size, where)
        self.file, self.shape, self.dtype, self.where = fileobj, shape, dtype, where
        self.row_bytes = math.prod(shape[1:]) * dtype.itemsize
        self.whole = self._read_whole() if fortran and len(shape) > 1 else None
        self.pos = 0

    def _read_whole(self) -> np.ndarray:
        nbytes = math.prod(self.shape) * self.dtype.itemsize
        if nbytes > FORTRAN_WHOLE_BYTES:
            raise ImportFormatError(f"{self.where}: Fortran-ordered array of shape {self.shape} ({nbytes} bytes) "
                                    f"could only be read whole; expected C order above "
                                    f"{FORTRAN_WHOLE_BYTES} bytes: save it as np.ascontiguousarray(array)")
        warnings.warn(f"{self.where}: Fortran-ordered, read whole into memory", stacklevel=4)
        data = np.empty(tuple(reversed(self.shape)), self.dtype)
        if self._fill(data.reshape(-1).view(np.uint8)) != nbytes:
            raise ImportFormatError(f"{self.where}: truncated data (fewer than {nbytes} bytes)")
        return data.transpose()

    def read(self, rows: int) -> np.ndarray:
        """The next ``rows`` rows (fewer at the end). Raises ImportFormatError if the data is cut short."""
        if self.whole is not None:
            out = self.whole[self.pos:self.pos + rows]
        else:
            out = np.empty((min(rows, self.shape[0] - self.pos), *self.shape[1:]), self.dtype)
            got = self._fill(out.reshape(-1).view(np.uint8)) // max(self.row_bytes, 1)
            if got != len(out):
                raise ImportFormatError(f"{self.where}: truncated data ({got} of {len(out)} rows read)")
        self.pos += len(out)
        return out

    def _fill(self, out: np.ndarray) -> int:
        """Reads into the bytes ``out`` a piece of at most `READ_PIECE_BYTES` at a time (a zip
        member's ``read(n)`` holds about three times ``n``); returns the bytes read."""
        done = 0
        try:
            while done < len(out):
                piece = self.file.read(min(READ_PIECE_BYTES, len(out) - done))
                if not piece:
                    break
                out[done:done + len(piece)] = np.frombuffer(piece, np.uint8)
                done += len(piece)
        except STREAM_ERRORS as e:
            raise ImportFormatError(f"{self.where}: corrupt data ({e})") from None
        return done

    def close(self) -> None:
        """Closes the underlying stream."""
        self.file.close()
