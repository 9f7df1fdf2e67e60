"""`LocalChunkStore`: a buffer's objects as plain files under a directory.

Writes are atomic (a temp file beside the object, then a rename), fsynced on request; reads go
straight into preallocated memory (``readv``), and files can be memory-mapped (``path``).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Collection, Iterable, Iterator, Sequence

from .store import Blob, Data, ParallelMap, Range, Ranged, digest, parts_of

SYNC_FILES_ONE_BY_ONE = 32
"""Above this many files to make durable, one ``syncfs`` is cheaper than an fsync per file."""
FILES_AT_ONCE = 256
"""Files one `LocalChunkStore.get_ranges` holds open at once (a batch may touch thousands, past
the process's limit on open files)."""
_NOATIME = getattr(os, "O_NOATIME", 0)
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
"""The most buffers one ``writev`` takes (a shard of many inner chunks has more parts)."""


def open_for_reading(path: str) -> int:
    """A read-only descriptor of ``path``. Where this process owns the file it is opened with
    ``O_NOATIME``: reads and maps of it never update its access time, which would make them wait
    for the filesystem's journal (a commit behind writes and discards can take 100s of ms).
    Raises as ``os.open``."""
    if _NOATIME:
        try:
            return os.open(path, os.O_RDONLY | _NOATIME)
        except PermissionError:  # O_NOATIME is the owner's only
            pass
    return os.open(path, os.O_RDONLY)


def _read(fd: int, size: int) -> bytes | None:
    """``size`` bytes from the start of the open file ``fd`` (fewer where it is shorter), or
    None where it is a folder."""
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(size)
    except IsADirectoryError:
        return None


class LocalChunkStore:
    """Files under a directory. Writes are atomic (temp file in the same directory + rename)."""

    supports_mmap = True
    needs_sync = True
    request_bytes = 1
    """A ``pread`` costs about the pages it reads, no more."""

    def __init__(self, root: str):
        self.root = root
        self.url = root

    def path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The object's bytes (at most ``limit`` of them), or None if it does not exist."""
        try:
            with os.fdopen(open_for_reading(self.path(key)), "rb") as f:
                if limit is None:
                    return f.read()
                return f.read(min(limit, os.fstat(f.fileno()).st_size))  # read(n) would allocate n
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):  # no such file (a folder is none)
            return None

    def get_many(self, keys: list[str], limit: int | None = None) -> list[Blob | None]:
        """Each object's bytes (at most ``limit`` of them), None where it does not exist; the
        files go in runs of at most `FILES_AT_ONCE` held open at once, each run asked of the OS
        first (``POSIX_FADV_WILLNEED``), so that cold ones are read together."""
        found: list[Blob | None] = []
        for start in range(0, len(keys), FILES_AT_ONCE):
            found += self._get_run(keys[start:start + FILES_AT_ONCE], limit)
        return found

    def _get_run(self, keys: list[str], limit: int | None) -> list[Blob | None]:
        files: dict[str, tuple[int, int] | None] = {}
        try:
            for key in keys:
                if (opened := self._opened(files, key)) is not None:
                    with contextlib.suppress(OSError):  # 0 bytes: to the end of the file
                        os.posix_fadvise(opened[0], 0, limit or 0, os.POSIX_FADV_WILLNEED)
            return [None if (opened := files[key]) is None
                    else _read(opened[0], opened[1] if limit is None else min(limit, opened[1])) for key in keys]
        finally:
            for opened in files.values():
                if opened is not None:
                    os.close(opened[0])

    def get_ranges(self, ranges: Sequence[Range]) -> list[Ranged | None]:
        """Each range's bytes (``pread``) and its file's size, each file opened once; the ranges
        go in runs of at most `FILES_AT_ONCE` files held open at once, every range of a run asked
        of the OS first (``POSIX_FADV_WILLNEED``), so that cold ones are read together."""
        found: list[Ranged | None] = []
        start, keys = 0, set[str]()
        for i, (key, _, _) in enumerate(ranges):
            if key not in keys and len(keys) == FILES_AT_ONCE:
                found += self._get_ranges(ranges[start:i])
                start, keys = i, set()
            keys.add(key)
        return found + self._get_ranges(ranges[start:])

    def _get_ranges(self, ranges: Sequence[Range]) -> list[Ranged | None]:
        files: dict[str, tuple[int, int] | None] = {}
        try:
            for key, start, stop in ranges:
                if (opened := self._opened(files, key)) is not None and stop > start:
                    os.posix_fadvise(opened[0], start, stop - start, os.POSIX_FADV_WILLNEED)
            return [None if (opened := files[key]) is None else (os.pread(opened[0], max(stop - start, 0), start),
                                                                  opened[1])
                    for key, start, stop in ranges]
        finally:
            for opened in files.values():
                if opened is not None:
                    os.close(opened[0])

    def _opened(self, files: dict[str, tuple[int, int] | None], key: str) -> tuple[int, int] | None:
        """The descriptor and size of ``key``'s file, opened once into ``files`` (None: no such file)."""
        if key not in files:
            try:
                fd = open_for_reading(self.path(key))
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                files[key] = None
            else:
                files[key] = (fd, os.fstat(fd).st_size)
        return files[key]

    def prefetch(self, keys: list[str]) -> None:
        """Ask the OS to start reading these files into its page cache (in the background, all at
        once: many requests in flight); missing files are skipped."""
        for key in keys:
            try:
                fd = open_for_reading(self.path(key))
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read_into(self, key: str, out: list[memoryview]) -> int | None:
        """Read the object into the buffers ``out``, one after the other; returns the bytes read
        (fewer than they hold if the object is shorter), or None if it does not exist."""
        try:
            fd = open_for_reading(self.path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return os.readv(fd, out)
        except IsADirectoryError:
            return None
        finally:
            os.close(fd)

    def put(self, key: str, data: Data, durable: bool = False) -> None:
        """Replace the object atomically: a new temp file beside it, then a rename. If writing
        fails (a full disk), the temp file is removed and the old object is untouched."""
        path = self.path(key)
        tmp = self._write_beside(path, data, durable)
        os.replace(tmp, path)
        if durable:
            fsync_dir(os.path.dirname(path))

    @staticmethod
    def _write_beside(path: str, data: Data, durable: bool) -> str:
        """Write ``data`` to a new temp file next to ``path`` (fsynced if ``durable``); its name."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{uuid.uuid4().hex}.partial"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, parts_of(data))
            if durable:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.remove(tmp)
            raise
        os.close(fd)
        return tmp

    def delete(self, key: str) -> None:
        try:
            os.remove(self.path(key))
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def sizes(self) -> dict[str, int]:
        """Every file under the root: its key (``/``-separated) and its size in bytes."""
        return {os.path.relpath(os.path.join(d, f), self.root).replace(os.sep, "/"): os.path.getsize(os.path.join(d, f))
                for d, _, files in os.walk(self.root) for f in files}

    def clear(self) -> None:
        """Remove every file under the root, and the root itself (a missing root is no error)."""
        try:
            shutil.rmtree(self.root)
        except FileNotFoundError:
            pass

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if it does not exist, complete or not at all. False if it did.

        The bytes go to a fsynced temp file that is then hard-linked to the key (``link`` fails if
        the name exists, atomically), so a process killed half-way never leaves an empty or
        partial object behind. Where hard links are not supported, ``O_CREAT | O_EXCL``.
        """
        path = self.path(key)
        tmp = self._write_beside(path, data, durable=True)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            return self._create_exclusive(path, data)
        finally:
            os.remove(tmp)
        fsync_dir(os.path.dirname(path))
        return True

    @staticmethod
    def _create_exclusive(path: str, data: bytes) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(os.path.dirname(path))
        return True

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        """The file's bytes and their digest (`digest`), or None if it does not exist."""
        blob = self.get(key, limit)
        return None if blob is None else (blob, digest(blob))

    def put_if_version(self, key: str, data: bytes, version: str | None, durable: bool = False) -> str | None:
        """Compare the file's digest with ``version`` and replace it (temp file + rename), both
        under an exclusive ``flock`` of its directory, which every `put_if_version` of that
        directory takes: no other one can replace the file in between. None: another version."""
        path = self.path(key)
        with directory_locked(os.path.dirname(path)):
            current = self.get(key)
            if current == data:  # written already (as a remote store's retry finds it)
                return digest(data)
            if version is None:  # create: never over anything there (a directory too), never half-written
                return digest(data) if self.put_if_absent(key, data) else None
            if current is None or digest(current) != version:
                return None
            self.put(key, data, durable)
        return digest(data)

    def put_in_place(self, key: str, data: Data) -> None:
        """Write the object's bytes over the existing file (or a new one), without truncating.

        Not atomic: only for objects no commit refers to yet (a torn write is then invisible).
        Far cheaper than `put`: no temp file, no rename, the file's pages are reused. A file is
        cut only when the new bytes are shorter (compressed chunks, which are never mapped).
        """
        path = self.path(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            size = _write_all(fd, parts_of(data))
            if os.fstat(fd).st_size > size:  # compressed chunks vary in size; raw ones never do
                os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def sync(self, keys: Collection[str], parallel_map: ParallelMap = map) -> None:
        """Make these files (written with ``durable=False``) and their directories durable: an
        fsync per file (run through ``parallel_map``), or one ``syncfs`` for many files."""
        if len(keys) > SYNC_FILES_ONE_BY_ONE:
            self.sync_all()
        elif keys:
            list(parallel_map(self.sync_file, keys))
            self.sync_dirs(keys)

    def sync_all(self) -> None:
        """Make everything written on this store's filesystem durable: one ``syncfs`` (Linux),
        far cheaper than an fsync per file when many files were written."""
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

    def sync_file(self, key: str) -> None:
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_dirs(self, keys: Iterable[str]) -> None:
        for directory in {os.path.dirname(self.path(k)) for k in keys}:
            fsync_dir(directory)


FLOCK_WAIT_S = 60.0
"""How long `put_if_version` waits for another process's compare-and-swap (microseconds unless
that process was stopped in the middle of one)."""


@contextlib.contextmanager
def directory_locked(directory: str) -> Iterator[None]:
    """An exclusive ``flock`` of ``directory`` (released on exit, or when the process dies).
    Raises TimeoutError after `FLOCK_WAIT_S` (its holder was stopped: SIGSTOP, a frozen VM)."""
    os.makedirs(directory, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY)
    try:
        deadline = time.monotonic() + FLOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{directory!r}: another process has been replacing an object here for "
                                       f"{FLOCK_WAIT_S:g} s (it is stopped?)") from None
                time.sleep(0.002)
        yield
    finally:
        os.close(fd)


def _write_all(fd: int, parts: list[memoryview]) -> int:
    """Write every part at the file's position (``writev`` of at most `IOV_MAX` parts, repeated
    after a short write)."""
    size = sum(part.nbytes for part in parts)
    while parts:
        written = os.writev(fd, parts[:IOV_MAX])
        while parts and written >= parts[0].nbytes:
            written -= parts[0].nbytes
            parts = parts[1:]
        if parts and written:
            parts[0] = parts[0][written:]
    return size


def _syncfs(fd: int) -> int:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syncfs(fd))
    except (OSError, AttributeError):
        return -1


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

