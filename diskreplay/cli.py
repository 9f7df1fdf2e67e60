"""The ``diskreplay`` command: create, import, export, info, verify, unlock, demo, bench.

User mistakes (missing files, bad options, a path that is not a buffer, a missing optional
package, ...) print one line on stderr, ``diskreplay: error: ...``, and exit with status 1 (2 for
bad command-line usage, 130 for Ctrl-C). Set ``DISKREPLAY_TRACEBACK=1`` to see the full traceback
instead. A remote URL that the store refuses for want of credentials, for credentials it
rejects or for a missing bucket is one line too, naming the URL and the fix. When stdout is a
pipe its reader closed early (``diskreplay info URL | head -1``), the command stops quietly with
status 1.

Field names in files: ``import`` and ``export`` share one convention, D4RL's (``observations``,
``actions``, ``rewards``, ``terminals``, ``timeouts``, ``next_observations``, ``infos/<key>``),
mapped to and from the buffer's ``obs``, ``action``, ``reward``, ``terminated``, ``truncated``,
``next_obs``, ``info_<key>`` in ``.hdf5`` and ``.npz`` files alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO, TypeAlias

USER_ERRORS = (OSError, ValueError, KeyError, ImportError, LookupError)
BENCH_EXTRA = ("cpprb", "torchrl", "tensordict", "psutil")  # the "bench" extra, by import name
NAMING = ("Field names: .hdf5 and .npz files alike use D4RL's names (observations, actions, rewards, terminals, "
          "timeouts, next_observations, infos/KEY), which map to and from the buffer's (obs, action, reward, "
          "terminated, truncated, next_obs, info_KEY); other names are kept.")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.showwarning = _one_line_warning
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _silence_stdout()
        return 1
    except KeyboardInterrupt:
        print("diskreplay: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = None if os.environ.get("DISKREPLAY_TRACEBACK") else _user_message(exc, args)
        if message is None:
            raise
        print(f"diskreplay: error: {message}", file=sys.stderr)
        return 1


def _user_message(exc: Exception, args: argparse.Namespace) -> str | None:
    """The one line that explains ``exc``, a user's mistake (`USER_ERRORS`, DiskReplayError
    subclasses these builtins too) or a remote store refusing the user's setup; else None."""
    remote = _remote_problem(exc, args)
    if remote is not None:
        return remote
    if not isinstance(exc, USER_ERRORS):
        return None
    return str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc)


def _remote_problem(exc: Exception, args: argparse.Namespace) -> str | None:
    """Missing or rejected credentials, or a missing bucket, for the command's remote URL."""
    from .errors import NotABufferError
    from .io import is_local
    from .io.access import access_problem, bucket_missing, bucket_of

    url = getattr(args, "url", None) or getattr(args, "dest", None)
    if not isinstance(url, str) or is_local(url):
        return None
    problem = access_problem(exc)
    if problem is None and isinstance(exc, (NotABufferError, FileNotFoundError)) \
            and bucket_missing(url, _storage_options(args)):
        problem = "bucket"
    if problem == "bucket":
        return (f"{url}: bucket {bucket_of(url)!r} does not exist (or is not visible with these credentials): "
                f"create it first (diskreplay creates objects, not buckets), or check the URL and the endpoint "
                f"(AWS_ENDPOINT_URL or --storage-option endpoint_url=...)")
    if problem == "credentials":
        return (f"{url}: no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
                f"AWS_ENDPOINT_URL for an S3-compatible server, AWS_REGION if needed), or pass --storage-option "
                f"key=... --storage-option secret=... (--storage-option anon=true for a public bucket)")
    if problem is not None:
        return (f"{url}: the store rejected the credentials ({problem.split()[1]}): check AWS_ACCESS_KEY_ID, "
                f"AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL, or the key/secret/endpoint_url --storage-option values")
    return None


def _silence_stdout() -> None:
    """The reader of stdout is gone: point stdout at devnull so that the flush at exit cannot fail
    (what Python's documentation of SIGPIPE recommends)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: TextIO | None = None, line: str | None = None) -> None:
    print(f"diskreplay: warning: {message}", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diskreplay",
        description="Zarr-backed RL replay buffers: create, import datasets, inspect, verify, export, demo, bench.",
        epilog="Run 'diskreplay COMMAND --help' for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_create, _add_import, _add_export, _add_inspection, _add_demo, _add_bench):
        add(sub)
    return parser


Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _remote_options() -> argparse.ArgumentParser:
    """The option every command that opens a URL takes: fsspec storage options."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--storage-option", action="append", type=_storage_option, default=[], metavar="KEY=VALUE",
                   dest="storage_options",
                   help="an fsspec storage option for a remote URL, repeatable; VALUE is parsed as JSON when it "
                        "parses, else kept as a string (e.g. endpoint_url=http://localhost:9000, anon=true, "
                        "client_kwargs='{\"region_name\": \"eu-west-1\"}'). S3 also reads AWS_ACCESS_KEY_ID, "
                        "AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL and AWS_REGION from the environment")
    return p


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except ValueError:
        return key.strip(), value


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``--storage-option`` values as a dict (None: none given)."""
    return dict(getattr(args, "storage_options", None) or []) or None


def _add_create(sub: Subcommands) -> None:
    p = sub.add_parser("create", parents=[_remote_options()],
                       help="create an empty buffer from a spec file (.yaml or .json)",
                       description="Create an empty buffer at URL as the spec file says: its fields, capacity, "
                                   "num_envs, chunk_rows, compression, episode_end, derive_next, episodic_return "
                                   "and shards (dr.BufferSpec.to_yaml / to_json write one). YAML needs pyyaml.")
    p.add_argument("url", metavar="URL", help="where to create the buffer (path or fsspec URL)")
    p.add_argument("--config", required=True, metavar="SPEC",
                   help="the buffer spec: a .yaml/.yml or .json file, e.g. fields: {obs: {shape: [4], dtype: float32}}")
    p.add_argument("--overwrite", action="store_true", help="replace an existing buffer at URL")
    p.set_defaults(run=_cmd_create)


def _add_import(sub: Subcommands) -> None:
    p = sub.add_parser("import", parents=[_remote_options()],
                       help="import a dataset (D4RL hdf5/npz, Minari, npz, npy folder, Parquet, LeRobot v3, zarr) "
                            "into a new buffer",
                       description="Import a dataset into a new dataset-mode buffer at DEST, streaming it in "
                                   "slices of --batch-rows rows (at most 32 MiB each). The rows are written to "
                                   "DEST.import-partial and moved to DEST when the import finishes: a failed or "
                                   "interrupted import leaves DEST as it was (with --overwrite too); the next "
                                   "import into DEST replaces what an interrupted one left. " + NAMING)
    p.add_argument("src", metavar="SRC", help="D4RL-style .hdf5 or .npz, Minari dataset folder, .npz, folder of "
                                              ".npy, LeRobot / HF .parquet file or folder, LeRobot v3 "
                                              "dataset folder, or a diskreplay buffer / zarr group")
    p.add_argument("dest", metavar="DEST", help="where to write the buffer (path or fsspec URL)")
    p.add_argument("--format", choices=("d4rl", "minari", "npz", "npy", "parquet", "lerobot", "zarr"),
                   help="source format (default: detected from SRC; .npz is 'npz'). 'd4rl' reads .hdf5 or .npz "
                        "and derives next_obs when next_observations is missing; 'npz' derives nothing; "
                        "'lerobot': a LeRobot v3 dataset folder (meta/info.json), camera keys decoded with PyAV")
    p.add_argument("--chunk-rows", type=_positive_int, default=None,
                   help="rows per stored chunk (default 4096, longer for datasets of over 16,384 chunk files)")
    p.add_argument("--compression", choices=("zstd", "lz4", "lz4hc", "none"), default="zstd",
                   help="chunk codec (default zstd; lz4hc: slower to write, faster to read than lz4)")
    p.add_argument("--batch-rows", type=_positive_int, default=65536,
                   help="rows read per slice, fewer where they would hold over 32 MiB; bounds memory "
                        "(default 65536)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing buffer or interrupted import at DEST")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_cmd_import)


def _add_export(sub: Subcommands) -> None:
    p = sub.add_parser("export", parents=[_remote_options()],
                       help="write a buffer's rows to D4RL-layout .npz or .hdf5, Parquet, Minari or LeRobot v3",
                       description="Export the committed rows of the buffer at URL, lane by lane, to DEST, "
                                   "one array per field; 'diskreplay import DEST' reads either format back "
                                   "with the same field names and values. " + NAMING)
    p.add_argument("url", metavar="URL", help="the buffer")
    p.add_argument("dest", metavar="DEST",
                   help="output file (.npz, .h5 or .hdf5) or folder (.parquet, minari, lerobot)")
    p.add_argument("--format", choices=("npz", "hdf5", "parquet", "minari", "lerobot"),
                   help="output format (default: from DEST's suffix). 'parquet': a folder of LeRobot / HF-style "
                        "Parquet files; 'minari': a Minari dataset folder (arrow data format) named DEST; "
                        "'lerobot': a LeRobot v3 dataset folder, uint8 [H, W, 3] fields as AV1 video")
    p.add_argument("--dataset-id", help="the Minari dataset id, (namespace/)name-vN (default: DEST's path under "
                                        "Minari's datasets folder, else DEST's name)")
    p.add_argument("--fps", type=float, default=None,
                   help="--format lerobot: frames per second (default: from the timestamp field, else 30)")
    p.add_argument("--compress", action="store_true",
                   help="deflate npz members / gzip HDF5 datasets / zstd Parquet and Arrow data")
    p.add_argument("--batch-rows", type=_positive_int, default=65536, help="rows per slice (default 65536)")
    p.add_argument("--overwrite", action="store_true", help="replace DEST if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=_cmd_export)


def _add_inspection(sub: Subcommands) -> None:
    p = sub.add_parser("info", parents=[_remote_options()],
                       help="summarize a buffer: fields, rows, episodes, chunks, size, sampler",
                       description="Print fields (shape, dtype), rows, lanes, episodes (count, lengths, mean "
                                   "return, from done/terminated/truncated and reward fields), chunks, bytes on "
                                   "disk vs raw, compression ratio, sampler type and the last commit. A sharded "
                                   "buffer: its shards together, then per shard its rows (readable, ever added) "
                                   "and last commit, and the learner's published progress (learner.json).")
    p.add_argument("url", metavar="URL", nargs="?", help="the buffer (not needed with --build)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--no-episodes", action="store_true", help="skip the episode scan (reads the done fields)")
    p.add_argument("--build", action="store_true",
                   help="instead: which compiled fast paths (C extensions) are active, and why one is not")
    p.set_defaults(run=_cmd_info)

    p = sub.add_parser("verify", parents=[_remote_options()],
                       help="check every committed chunk exists and decodes (exit 1 if not)",
                       description="Read every chunk of every field that the last commit covers and decode it. "
                                   "A sharded buffer: every shard (a missing one is a problem) and learner.json. "
                                   "Prints a report; exit status 1 when anything is missing or corrupt.")
    p.add_argument("url", metavar="URL", help="the buffer")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (chunks checked)")
    p.add_argument("--at-commit", metavar="N", default=None,
                   help="check this commit (a sequence, or a pin's name) instead of the newest: a pinned one's copy")
    p.set_defaults(run=_cmd_verify)

    p = sub.add_parser("unlock", parents=[_remote_options()],
                       help="remove the writer lock left by a writer that was killed",
                       description="Remove the buffer's writer lock (writer.lock) when its holder is gone: a "
                                   "lock whose process no longer runs on this host is removed; a lock that "
                                   "looks alive (or is on another host) needs --force.")
    p.add_argument("url", metavar="URL", help="the buffer")
    p.add_argument("--force", action="store_true", help="remove the lock even if its holder looks alive")
    p.set_defaults(run=_cmd_unlock)


def _add_demo(sub: Subcommands) -> None:
    p = sub.add_parser("demo", help="a ten-second tour: collect CartPole, sample, resume",
                       description="Collect CartPole-v1 experience into a buffer, sample it (uniform, "
                                   "prioritized, DataLoader), print throughput, then close, reopen and resume.")
    p.add_argument("dir", metavar="DIR", nargs="?",
                   help="where to put the buffer, kept (default: a temp dir, removed at the end)")
    p.add_argument("--steps", type=_positive_int, default=4000, help="env steps per lane to collect (default 4000)")
    p.add_argument("--envs", type=_positive_int, default=4, help="env lanes (default 4)")
    p.add_argument("--seconds", type=float, default=1.0, help="time per sampling measurement (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.set_defaults(run=_cmd_demo)


def _add_bench(sub: Subcommands) -> None:
    p = sub.add_parser("bench", help="run the benchmarks in the source checkout's tools/ folder",
                       description="Run tools/bench_core.py, then the other tools/bench_*.py, as subprocesses, "
                                   "printing their tables. Needs the source tree (a git checkout) and the "
                                   "'bench' extra: pip install -e \".[bench]\". The numbers of a recorded run, "
                                   "and how to read them: docs/benchmarks.md.")
    p.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks that support it")
    p.add_argument("--only", action="append", metavar="NAME", help="run only bench_NAME.py (repeatable)")
    p.add_argument("--tools", metavar="DIR", help="the tools/ folder (default: next to the package)")
    p.set_defaults(run=_cmd_bench)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


# ---- commands --------------------------------------------------------------------------------


def _cmd_create(args: argparse.Namespace) -> int:
    from .buffer import BufferSpec, ReplayBuffer
    from .errors import BufferExistsError

    spec = BufferSpec.from_file(args.config)
    try:
        buf = ReplayBuffer.create(args.url, **spec, overwrite=args.overwrite, storage_options=_storage_options(args))
    except BufferExistsError as exc:
        raise BufferExistsError(str(exc).replace("overwrite=True", "--overwrite")) from None
    with buf:
        fields = ", ".join(f"{n} {tuple(f.shape)} {f.dtype.name}" for n, f in buf.fields.items())
        size = "unbounded (dataset)" if buf.capacity is None else f"capacity {buf.capacity:,} rows"
        shards = f", {buf.shards} shards" if spec.shards else ""
        print(f"created {args.url}: {size}, {spec.num_envs} lane{'s' * (spec.num_envs > 1)}{shards}: {fields}")
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    from .errors import BufferExistsError
    from .offline import import_dataset

    try:
        buf = import_dataset(args.src, args.dest, format=args.format, chunk_rows=args.chunk_rows,
                             compression=None if args.compression == "none" else args.compression,
                             batch_rows=args.batch_rows, progress=not args.no_progress, overwrite=args.overwrite,
                             storage_options=_storage_options(args))
    except BufferExistsError as exc:
        raise BufferExistsError(str(exc).replace("overwrite=True", "--overwrite")) from None
    with buf:
        fields = ", ".join(f"{n} {tuple(f.shape)} {f.dtype.name}" for n, f in buf.fields.items())
        print(f"imported {len(buf):,} rows into {args.dest} ({buf.num_envs} lane{'s' * (buf.num_envs > 1)}): {fields}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from .offline import export_buffer

    rows = export_buffer(args.url, args.dest, format=args.format, batch_rows=args.batch_rows,
                         progress=not args.no_progress, overwrite=args.overwrite, compress=args.compress,
                         dataset_id=args.dataset_id, fps=args.fps, storage_options=_storage_options(args))
    print(f"exported {rows:,} rows to {args.dest}")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .audit import buffer_info, format_info
    from .build import build_info, format_build_info

    if args.build:
        print(json.dumps(build_info(), indent=2) if args.json else format_build_info(build_info()))
        return 0
    if args.url is None:
        raise ValueError("info needs the URL of a buffer (or --build)")
    info = buffer_info(args.url, _storage_options(args), episodes=not args.no_episodes)
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from .audit import describe_incomplete, import_status, verify

    at = args.at_commit
    report = verify(args.url, _storage_options(args), progress=not args.no_progress,
                    at_commit=int(at) if at is not None and at.isdigit() else at)
    text = str(report)
    if not report.ok:
        marker = import_status(args.url, _storage_options(args))
        if marker is not None:
            text += f"\n  problem: {describe_incomplete(args.url, marker)}"
    print(text, file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


def _cmd_unlock(args: argparse.Namespace) -> int:
    from .io.lock import break_lock, lock_holder
    from .storage import own_stores

    stores = own_stores(args.url, _storage_options(args))
    holder = lock_holder(args.url, stores)
    if holder is None:
        print(f"{args.url}: no writer lock")
        return 0
    stale = holder.stale_reason()
    if not stale and not args.force:
        raise ValueError(f"{args.url} is locked by {holder.describe()}, which looks alive; "
                         f"pass --force only if you know that writer is gone")
    break_lock(args.url, stores)
    print(f"{args.url}: removed the writer lock held by {holder.describe()}" + (f" ({stale})" if stale else ""))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    run_demo(args.dir, steps=args.steps, num_envs=args.envs, seed=args.seed, seconds=args.seconds)
    return 0


def find_tools(explicit: str | None = None) -> Path:
    """The folder holding bench_*.py: ``explicit``, $DISKREPLAY_TOOLS, the checkout, or ./tools."""
    candidates = [explicit] if explicit else [os.environ.get("DISKREPLAY_TOOLS"),
                                              Path(__file__).resolve().parents[1] / "tools", Path.cwd() / "tools"]
    for candidate in candidates:
        if candidate and any(Path(candidate).glob("bench_*.py")):
            return Path(candidate)
    where = explicit or "next to the installed package or in ./tools"
    raise FileNotFoundError(f"no benchmarks found ({where}): 'diskreplay bench' runs tools/bench_*.py from a "
                            f"source checkout; clone the repository and run it there, or pass --tools DIR")


def missing_modules(files: Sequence[Path], modules: Sequence[str]) -> list[str]:
    """Those of ``modules`` that a line of ``files`` imports (``import m``, ``from m...``) and that
    cannot be found."""
    text = "\n".join(f.read_text() for f in files)
    return [m for m in modules if re.search(rf"^\s*(?:import|from)\s+{re.escape(m)}\b", text, re.M)
            and importlib.util.find_spec(m) is None]


def _cmd_bench(args: argparse.Namespace) -> int:
    tools = find_tools(args.tools)
    scripts = sorted(tools.glob("bench_*.py"), key=lambda p: (p.name != "bench_core.py", p.name))
    if args.only:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in args.only}
        wanted = {n[:-3] if n.endswith(".py") else n for n in wanted}
        scripts = [s for s in scripts if s.stem in wanted]
        if not scripts:
            raise ValueError(f"no benchmark named {sorted(wanted)} in {tools}")
    helpers = [p for p in tools.glob("*.py") if not p.name.startswith("bench_")]
    missing = missing_modules([*scripts, *helpers], BENCH_EXTRA)
    if missing:
        raise ImportError(f"the benchmarks need the 'bench' extra (missing: {', '.join(missing)}): "
                          f"pip install -e \".[bench]\"")
    failed = []
    for script in scripts:
        cmd = [sys.executable, str(script)]
        if args.quick and "--quick" in script.read_text():
            cmd.append("--quick")
        print(f"\n## {script.name}  ({' '.join(cmd[1:])})", flush=True)
        code = subprocess.call(cmd, cwd=tools.parent)
        if code:
            failed.append(f"{script.name} (exit {code})")
    if failed:
        print(f"diskreplay: error: benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
