"""Shared helpers for the benchmarks in ``tools/``: timing, tables, machine info, child RSS.

Nothing here knows about replay buffers. The pieces:

* `interleaved` — median-of-repeats timing with ``perf_counter_ns``. Each repeat runs every
  contestant once, in a rotating order, so slow phases of a shared, noisy machine hit all
  contestants alike instead of whichever happened to run then.
* `Stats` — the per-operation samples of one contestant, with median/min/max and named phases.
* `Table` / `Target` — markdown output: absolute times with ratios against a named baseline
  column, and PASS/FAIL lines for performance targets.
* `machine_info` — the command line, CPU, memory, Python and package versions, for quoting.
* `run_child` — run a command in a subprocess; get its stdout, wall time and peak RSS (its
  ``VmHWM``, polled); `self_peak_rss` reads ``VmHWM`` for a process measuring itself (exact);
  `self_status` reads private (``RssAnon``) and file-backed (``RssFile``) memory separately.
* `read_files` / `evict_page_cache` / `resident_bytes` — put a directory's files in the OS page
  cache, drop them from it (fsync + ``POSIX_FADV_DONTNEED``), and check how much of them it holds
  (``mincore``), for warm and cold timings.
"""

from __future__ import annotations

import gc
import importlib.metadata
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 2**20
GB = 10**9

WORKLOAD_FIELDS = {  # issue #2's five fields: name -> (shape, dtype), 165 bytes per row
    "obs": ((17,), "float32"),
    "action": ((6,), "float32"),
    "reward": ((), "float32"),
    "next_obs": ((17,), "float32"),
    "done": ((), "bool"),
}

# ---- timing ---------------------------------------------------------------------------------


@dataclass
class Stats:
    """Seconds per operation of one contestant, one sample per repeat."""

    samples: list[float] = field(default_factory=list)
    phases: dict[str, Stats] = field(default_factory=dict)

    @property
    def median(self) -> float:
        s = sorted(self.samples)
        n = len(s)
        if n == 0:
            return math.nan
        return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else math.nan

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else math.nan

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        m = self.median
        return (self.max - self.min) / m if m and not math.isnan(m) else math.nan

    def phase(self, name: str) -> Stats:
        return self.phases.setdefault(name, Stats())


Outcome = None | float | Mapping[str, float]
"""What a contestant's repeat returns: None (the helper times the call), seconds it timed
itself (to leave setup out), or a mapping with ``"total"`` seconds plus named phase seconds."""


def interleaved(contestants: Mapping[str, Callable[[], Outcome]], repeats: int, *, number: int = 1,
                warmup: int = 0, rotate: bool = True, disable_gc: bool = False,
                progress: Callable[[str], None] | None = None) -> dict[str, Stats]:
    """Time each contestant ``repeats`` times, interleaved; return seconds per operation.

    One call of a contestant is one repeat and performs ``number`` operations; its time is divided
    by ``number``. Repeats are interleaved (A B C, B C A, C A B, ... with ``rotate``) so machine
    noise is spread over all contestants. ``warmup`` untimed rounds run first.
    """
    names = list(contestants)
    for _ in range(warmup):
        for name in names:
            contestants[name]()
    out = {name: Stats() for name in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)] if rotate else names
        for name in order:
            gc_was = gc.isenabled()
            if disable_gc:
                gc.collect()
                gc.disable()
            try:
                start = time.perf_counter_ns()
                got = contestants[name]()
                elapsed = (time.perf_counter_ns() - start) / 1e9
            finally:
                if disable_gc and gc_was:
                    gc.enable()
            if got is None:
                total = elapsed
            elif isinstance(got, Mapping):
                total = float(got["total"])
                for phase, secs in got.items():
                    if phase != "total":
                        out[name].phase(phase).samples.append(float(secs) / number)
            else:
                total = float(got)
            out[name].samples.append(total / number)
            if progress:
                progress(f"  repeat {r + 1}/{repeats} {name}: {format_seconds(total / number)}")
    return out


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, with ``perf_counter_ns``."""
    start = time.perf_counter_ns()
    result = fn()
    return (time.perf_counter_ns() - start) / 1e9, result


# ---- formatting -----------------------------------------------------------------------------


def format_seconds(seconds: float | None, unit: str | None = None) -> str:
    """A time with a fitting unit (or a fixed one: "ns", "us", "ms", "s"); 3 significant digits."""
    if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)):
        return "—"
    scales = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    names = {"ns": "ns", "us": "µs", "ms": "ms", "s": "s"}
    if unit is None:
        a = abs(seconds)
        unit = "ns" if a < 1e-6 else "us" if a < 1e-3 else "ms" if a < 1 else "s"
    return f"{_sig(seconds / scales[unit])} {names[unit]}"


def parse_count(text: str) -> int:
    """``"16M"`` -> 16,000,000 (suffixes k, M, G: powers of 1,000)."""
    t = text.strip().lower()
    scale = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}.get(t[-1:])
    return int(float(t[:-1]) * scale) if scale else int(t)


def format_count(rows: int) -> str:
    """16,000,000 -> ``"16M"``."""
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if rows >= scale:
            return f"{rows / scale:g}{unit}"
    return str(rows)


def format_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "—"
    return f"{_sig(n / 1e6)} MB"


def format_ratio(r: float) -> str:
    if r is None or math.isnan(r) or math.isinf(r):
        return "—"
    return f"{r:.2f}×" if r < 10 else f"{r:.1f}×" if r < 100 else f"{r:.0f}×"


def _sig(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


# ---- tables ---------------------------------------------------------------------------------


@dataclass
class _Row:
    label: str
    values: dict[str, float | None]
    kind: str
    unit: str | None
    baseline: str | None
    notes: dict[str, str]


class Table:
    """A markdown table: one row per measurement, one column per contestant.

    Cells show the absolute value and, when the row names a ``baseline`` column, the ratio
    value / baseline (so for times, ``2.00×`` means twice as slow as the baseline).
    """

    def __init__(self, columns: Sequence[str], corner: str = "measurement"):
        self.columns = list(columns)
        self.corner = corner
        self.rows: list[_Row] = []

    def add(self, label: str, values: Mapping[str, float | None], *, kind: str = "time",
            unit: str | None = None, baseline: str | None = None,
            notes: Mapping[str, str] | None = None) -> None:
        """``kind``: "time" (seconds), "bytes", "count" or "text" (values preformatted strings)."""
        unknown = set(values) - set(self.columns)
        if unknown:
            raise KeyError(f"values for unknown columns {sorted(unknown)}; columns are {self.columns}")
        if baseline is not None and baseline not in self.columns:
            raise KeyError(f"baseline {baseline!r} is not a column")
        self.rows.append(_Row(label, dict(values), kind, unit, baseline, dict(notes or {})))

    def _cell(self, row: _Row, col: str) -> str:
        v = row.values.get(col)
        if v is None:
            text = "—"
        elif row.kind == "time":
            text = format_seconds(v, row.unit)
        elif row.kind == "bytes":
            text = format_bytes(v)
        elif row.kind == "count":
            text = f"{v:,}"
        else:
            text = str(v)
        if v is not None and row.baseline and row.kind in ("time", "bytes"):
            base = row.values.get(row.baseline)
            if base:
                text += f" ({format_ratio(v / base)})"
        if col in row.notes:
            text += f" {row.notes[col]}"
        return text

    def render(self) -> str:
        head = [self.corner] + self.columns
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(self.columns)) + "|"]
        for row in self.rows:
            label = row.label + (f" (ratio vs {row.baseline})" if row.baseline else "")
            lines.append("| " + " | ".join([label] + [self._cell(row, c) for c in self.columns]) + " |")
        return "\n".join(lines)


@dataclass
class Target:
    """One performance target: what it asks, what was measured, whether it holds."""

    description: str
    measured: str
    passed: bool | None  # None: not evaluated (e.g. skipped)

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else "PASS" if self.passed else "FAIL"


def render_targets(targets: Iterable[Target]) -> str:
    lines = ["| target | measured | verdict |", "|---|---|:---:|"]
    for t in targets:
        lines.append(f"| {t.description} | {t.measured} | **{t.verdict}** |")
    return "\n".join(lines)


# ---- machine info ---------------------------------------------------------------------------


def command_line() -> str:
    """The command that started this process, as one shell line relative to the cwd."""
    script = sys.argv[0]
    try:
        rel = os.path.relpath(script)
        script = rel if not rel.startswith("..") else script
    except ValueError:
        pass
    return shlex.join(["python", script, *sys.argv[1:]])


def package_versions(names: Iterable[str]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _total_ram() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _git_describe(path: str) -> str:
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return f"{head}{' (+ uncommitted changes)' if dirty else ''}" if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def report_header(title: str, quick: bool, packages: Iterable[str], data_dir: str | None = None,
                  details: Iterable[str] = ()) -> str:
    """A report's top: ``# title`` (marked ``(--quick)``), `machine_info` of this checkout, then a
    ``- detail`` line each."""
    head = f"# {title}{' (--quick)' if quick else ''}\n\n"
    return head + machine_info(packages, repo=str(Path(__file__).resolve().parents[1]), data_dir=data_dir) + "".join(
        f"\n- {line}" for line in details)


def machine_info(packages: Iterable[str], repo: str | None = None, data_dir: str | None = None) -> str:
    """Markdown lines: command, date, CPU, RAM, OS, Python, package versions, git commit."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    ram = _total_ram()
    lines = [
        f"- command: `{command_line()}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- CPU: {_cpu_model()}; os.cpu_count()={os.cpu_count()}, usable by this process={usable}",
        f"- RAM: {format_bytes(ram) if ram else 'unknown'}; OS: {platform.platform()}",
        f"- load average at start: {load_average()} (other processes compete for the CPUs when it exceeds "
        f"the CPU count)",
        f"- Python {platform.python_version()} ({platform.python_implementation()})",
        "- packages: " + ", ".join(f"{k} {v}" for k, v in package_versions(packages).items()),
    ]
    if repo:
        lines.append(f"- git: {_git_describe(repo)}")
    if data_dir:
        lines.append(f"- data dir: `{data_dir}` ({filesystem_of(data_dir)})")
    return "\n".join(lines)


def load_average() -> str:
    """The 1/5/15-minute load averages, for judging how busy a shared machine was."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except (OSError, AttributeError):
        return "unknown"


def filesystem_of(path: str) -> str:
    """The mount (device, fs type) holding ``path``, from /proc/mounts."""
    path = os.path.realpath(path)
    best = ("?", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                    best = (dev, fstype, mnt)
    except OSError:
        return "unknown filesystem"
    return f"{best[0]} {best[1]} mounted at {best[2]}"


def read_ahead_kb(path: str) -> int | None:
    """The read-ahead (KiB) of the block device holding ``path``; a page fault on a file mapping
    reads about this much around the faulting page. None where it cannot be found."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt = line.split()[:2]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt)
        block = os.path.realpath(f"/sys/class/block/{os.path.basename(os.path.realpath(best[0]))}")
        for queue in (os.path.join(block, "queue"), os.path.join(os.path.dirname(block), "queue")):
            if os.path.exists(os.path.join(queue, "read_ahead_kb")):
                with open(os.path.join(queue, "read_ahead_kb")) as f:
                    return int(f.read())
    except (OSError, ValueError):
        pass
    return None


# ---- disk and memory ------------------------------------------------------------------------


def free_bytes(path: str) -> int:
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "."
    return shutil.disk_usage(probe).free


def require_free_space(path: str, needed: int, margin: int = 1 * GB) -> None:
    """Raise SystemExit with a clear message if ``path``'s filesystem lacks ``needed + margin``."""
    free = free_bytes(path)
    if free < needed + margin:
        raise SystemExit(f"not enough free disk under {path!r}: need {format_bytes(needed + margin)} "
                         f"(data + margin), have {format_bytes(free)}; use --dir elsewhere or --quick")


def self_peak_rss() -> int | None:
    """This process's peak resident set size in bytes (``VmHWM``), or None where unavailable."""
    return _proc_status_kb("VmHWM")


def self_rss() -> int | None:
    """This process's current resident set size in bytes (``VmRSS``)."""
    return _proc_status_kb("VmRSS")


def _read_status_kb(path: str, key: str) -> int | None:
    """A ``kB`` line of a /proc status file, in bytes (None if absent: the process may be a zombie)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _proc_status_kb(key: str) -> int | None:
    got = _read_status_kb("/proc/self/status", key)
    if got is not None:
        return got
    try:
        import resource
        if key == "VmHWM":
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except ImportError:
        pass
    return None


def self_status(keys: Iterable[str] = ("RssAnon", "RssFile", "RssShmem", "VmRSS", "VmHWM")) -> dict[str, int | None]:
    """``kB`` lines of /proc/self/status, in bytes. ``RssAnon`` is private memory; ``RssFile``
    file-backed pages mapped by the process (the page cache: shared and reclaimable)."""
    return {key: _read_status_kb("/proc/self/status", key) for key in keys}


def mem_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes: what can be allocated without swapping."""
    return _read_status_kb("/proc/meminfo", "MemAvailable")


# ---- page cache -----------------------------------------------------------------------------


def files_under(path: str) -> list[str]:
    """Every regular file under ``path`` (or ``path`` itself if it is a file), sorted."""
    if os.path.isfile(path):
        return [path]
    out = []
    for root, _, names in os.walk(path):
        out += [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n))]
    return sorted(out)


def allocated_bytes(path: str) -> int:
    """Bytes the files under ``path`` take on disk, as ``du`` counts them (allocated blocks:
    sparse holes not counted)."""
    return sum(os.stat(name).st_blocks * 512 for name in files_under(path))


def stored_bytes(path: str) -> int:
    """Bytes the files under ``path`` hold (their sizes; ``du --apparent-size``)."""
    return sum(os.stat(name).st_size for name in files_under(path))


def held_array_bytes(obj: object) -> int:
    """Bytes of the numpy arrays ``obj`` holds, through its attributes, dicts, lists and tuples
    (each array's memory counted once: views count their base)."""
    import numpy as np
    seen, roots, todo = set(), {}, [obj]
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, np.ndarray):
            while isinstance(item.base, np.ndarray):
                item = item.base
            roots[id(item)] = item.nbytes
        elif item is obj or isinstance(item, (dict, list, tuple)):
            todo += gc.get_referents(item)
    return sum(roots.values())


def read_files(path: str) -> tuple[int, float]:
    """Read every file under ``path`` once (puts it in the page cache, as far as RAM allows).
    Returns (bytes read, seconds)."""
    view = memoryview(bytearray(8 * MiB))
    total = 0
    start = time.perf_counter()
    for name in files_under(path):
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - start


def evict_page_cache(path: str) -> int:
    """Drop every file under ``path`` from the OS page cache; returns the number of files.

    Each file is fsynced first (``POSIX_FADV_DONTNEED`` skips dirty pages), then advised
    ``DONTNEED``. Pages some process still maps (an open memmap) stay: unmap before evicting,
    and check with `resident_bytes`.
    """
    files = files_under(path)
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)


_RESIDENT_BIT = bytes(b & 1 for b in range(256))


def resident_bytes(path: str) -> tuple[int, int]:
    """(bytes in the page cache, total bytes) of the files under ``path``, from mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for name in files_under(path):
        size = os.path.getsize(name)
        if size == 0:
            continue
        total += size
        fd = os.open(name, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {name} failed")
            try:
                vec = ctypes.create_string_buffer(-(-size // page))
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {name} failed")
                resident += min(size, vec.raw.translate(_RESIDENT_BIT).count(1) * page)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident, total


@dataclass
class ChildResult:
    returncode: int
    stdout: str
    stderr: str
    peak_rss: int | None  # bytes: the child's VmHWM, polled from /proc/<pid>/status while it ran
    wall: float


def run_child(argv: Sequence[str], *, timeout: float | None = None, env: Mapping[str, str] | None = None,
              echo_stderr: bool = True, poll_s: float = 0.01) -> ChildResult:
    """Run ``argv`` to completion; return its output, wall time and peak RSS.

    The peak is the child's ``VmHWM`` (kernel high-water mark of its resident set) read from
    ``/proc/<pid>/status`` every ``poll_s`` until it exits, so growth in its last few milliseconds
    can be missed: for an exact figure have the child print `self_peak_rss()` before exiting.
    Not used: ``ru_maxrss`` from ``wait4``/``getrusage(RUSAGE_CHILDREN)``; on Linux it includes
    the *parent's* resident set at fork/exec time (the exec'ing mm's high-water mark is kept), so
    it reports a big benchmark parent's size, not the child's.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(list(argv), stdout=out, stderr=err, env=None if env is None else dict(env))
        status_path = f"/proc/{proc.pid}/status"
        peak = None
        deadline = None if timeout is None else start + timeout
        try:
            while proc.poll() is None:
                hwm = _read_status_kb(status_path, "VmHWM")
                if hwm is not None:
                    peak = hwm if peak is None else max(peak, hwm)
                if deadline is not None and time.perf_counter() > deadline:
                    raise subprocess.TimeoutExpired(list(argv), timeout)
                time.sleep(poll_s)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        result = ChildResult(proc.returncode, out.read(), err.read(), peak, wall)
    if echo_stderr and result.stderr.strip():
        sys.stderr.write(result.stderr if result.stderr.endswith("\n") else result.stderr + "\n")
    return result


def import_torchrl(level: int = logging.WARNING) -> None:
    """Import torchrl, then quiet its logger to ``level`` (torchrl sets the level on import)."""
    import torchrl.data  # noqa: F401

    logging.getLogger("torchrl").setLevel(level)


def as_tensordict(data: Mapping[str, Any]):
    """Columns of equal length as a TensorDict sharing their memory (TorchRL's input)."""
    import torch
    from tensordict import TensorDict

    n = len(next(iter(data.values())))
    return TensorDict({k: torch.from_numpy(v) for k, v in data.items()}, batch_size=[n])


def log(message: str) -> None:
    """Progress on stderr (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def publish_report(header: str, body: str, out: str | None, started: float) -> None:
    """Print a benchmark's report (with its run time and the load at the end) and write
    ``header`` + report to ``out`` when given."""
    body += (f"\n\nTotal benchmark time: {time.perf_counter() - started:.0f} s; "
             f"load average at the end: {load_average()}.\n")
    print(body, flush=True)
    if out:
        Path(out).write_text(header + "\n\n" + body)
        log(f"report written to {out}")
