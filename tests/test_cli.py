"""The `diskreplay` command, mostly through subprocesses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import OWN
from s3server import s3

import diskreplay as dr
from diskreplay import cli
from diskreplay.audit import INCOMPLETE_KEY

ROOT = Path(__file__).resolve().parents[1]
h5py = pytest.importorskip("h5py")


def cli_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra}
    env.pop("DISKREPLAY_TRACEBACK", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(*args: str, cwd: str | os.PathLike | None = None, timeout: float = 120,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diskreplay.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env or cli_env(), timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, proc
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("diskreplay: error:")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def write_d4rl(path: Path, n: int = 103) -> None:
    rng = np.random.default_rng(0)
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    terminals[[9, 40, 41]] = True
    timeouts[[19, 70]] = True
    with h5py.File(path, "w") as f:
        f["observations"] = rng.normal(size=(n, 3)).astype(np.float32)
        f["actions"] = rng.normal(size=(n, 2)).astype(np.float32)
        f["rewards"] = np.ones(n, np.float32)
        f["terminals"], f["timeouts"] = terminals, timeouts


@pytest.mark.parametrize("command", ["import", "export", "info", "verify", "unlock", "demo", "bench"])
def test_help_for_every_command(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: diskreplay {command}") and len(out.splitlines()) > 4


def test_module_and_entry_point_help():
    proc = run("--help")
    assert proc.returncode == 0 and all(c in proc.stdout
                                        for c in ("import", "export", "info", "verify", "demo", "bench"))
    assert run("frobnicate").returncode == 2
    exe = shutil.which("diskreplay")
    if exe:
        assert subprocess.run([exe, "--help"], capture_output=True, text=True).returncode == 0


def test_import_info_verify_export(tmp_path):
    write_d4rl(tmp_path / "d.hdf5")
    proc = run("import", str(tmp_path / "d.hdf5"), str(tmp_path / "buf"), "--chunk-rows", "16", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("imported 103 rows") and "next_obs (3,) float32" in proc.stdout
    assert proc.stderr == ""

    proc = run("info", str(tmp_path / "buf"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "103 in 1 lane; dataset mode" in out
    assert "terminated  ()" in out and "obs         (3,)           float32" in out
    # episodes end at rows 9, 19, 40, 41, 70; rows 71..102 are an unfinished episode
    assert "episodes    5 complete, 1 in progress; length mean 14.2, min 1, max 29; mean return 14.200" in out
    assert "7 per field x 6 fields (16 rows each); 42 chunk objects stored" in out
    assert "sampler     Uniform" in out and "zstd level 3" in out and "last commit #" in out
    info = json.loads(run("info", "--json", str(tmp_path / "buf")).stdout)
    assert info["rows"] == 103 and info["episodes"]["count"] == 5 and info["bytes_on_disk"] > 0

    proc = run("verify", str(tmp_path / "buf"))
    assert proc.returncode == 0 and "OK" in proc.stdout.splitlines()[0] and "42 chunks checked" in proc.stdout

    proc = run("export", str(tmp_path / "buf"), str(tmp_path / "out.hdf5"), "--no-progress")
    assert proc.returncode == 0 and "exported 103 rows" in proc.stdout
    assert_one_line_error(run("export", str(tmp_path / "buf"), str(tmp_path / "out.hdf5")), "already exists")
    proc = run("import", str(tmp_path / "out.hdf5"), str(tmp_path / "back"), "--compression", "lz4hc",
               "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "lz4hc level 6" in run("info", str(tmp_path / "back")).stdout
    a, b = dr.ReplayBuffer.open(tmp_path / "buf"), dr.ReplayBuffer.open(tmp_path / "back")
    for k, v in a[a.row_ids()].items():
        np.testing.assert_array_equal(v, b[b.row_ids()][k])


def test_import_and_export_show_progress_in_rows_on_stderr(tmp_path):
    pytest.importorskip("tqdm")
    write_d4rl(tmp_path / "d.hdf5")
    proc = run("import", str(tmp_path / "d.hdf5"), str(tmp_path / "buf"))
    assert proc.returncode == 0 and "rows/s" in proc.stderr and "import d4rl" in proc.stderr
    assert "| 103/103 [" in proc.stderr, proc.stderr
    for fmt in ("npz", "hdf5"):
        proc = run("export", str(tmp_path / "buf"), str(tmp_path / f"o.{fmt}"), "--batch-rows", "10")
        assert proc.returncode == 0 and f"export {fmt}: 100%" in proc.stderr
        assert "| 103/103 [" in proc.stderr, proc.stderr  # rows, not rows x fields


def test_import_d4rl_npz_and_mismatched_formats(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", observations=rng.normal(size=(20, 3)).astype(np.float32),
             actions=np.zeros((20, 2), np.float32), rewards=np.ones(20, np.float32),
             terminals=np.arange(20) == 9, timeouts=np.arange(20) == 19)
    proc = run("import", "--format", "d4rl", str(tmp_path / "d.npz"), str(tmp_path / "b"), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (f"imported 20 rows into {tmp_path / 'b'} (1 lane): obs (3,) float32, action (2,) float32, "
                           f"reward () float32, terminated () bool, truncated () bool, next_obs (3,) float32\n")
    write_d4rl(tmp_path / "d.hdf5")
    assert_one_line_error(run("import", "--format", "npz", str(tmp_path / "d.hdf5"), str(tmp_path / "c")),
                          "d.hdf5' is not an .npz file (not a zip archive)")
    (tmp_path / "notes.txt").write_text("hello")
    assert_one_line_error(run("import", "--format", "d4rl", str(tmp_path / "notes.txt"), str(tmp_path / "c")),
                          "notes.txt' is not an HDF5 file", "expected a D4RL-layout .hdf5/.h5 or .npz file")


def test_output_into_a_closed_pipe_exits_quietly(tmp_path):
    dr.ReplayBuffer.create(tmp_path / "b", {"x": dr.Field((), "int8")}).close()
    read_end, write_end = os.pipe()
    os.close(read_end)  # like `| head -1` once head has exited: every write to stdout fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "diskreplay.cli", "info", str(tmp_path / "b")],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, env=cli_env(), timeout=120)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_verify_reports_missing_and_corrupt_chunks(tmp_path):
    buf = dr.ReplayBuffer.create(tmp_path / "b", {"x": dr.Field((2,), "float32"), "y": dr.Field((), "int64")},
                                 chunk_rows=8, cache_bytes=2**16)
    buf.extend({"x": np.ones((30, 2)), "y": np.arange(30)})
    buf.close()
    os.remove(tmp_path / "b" / "x" / "c.0.1.0")
    (tmp_path / "b" / "y" / "c.0.3").write_bytes(b"not zstd at all")
    proc = run("verify", str(tmp_path / "b"))
    assert proc.returncode == 1
    assert "8 chunks checked" in proc.stderr
    assert "chunk 'x/c.0.1.0' is missing" in proc.stderr and "chunk 'y/c.0.3' does not decode" in proc.stderr


def test_user_errors_are_one_line(tmp_path):
    assert_one_line_error(run("import", str(tmp_path / "nope.hdf5"), str(tmp_path / "b")), "does not exist")
    assert_one_line_error(run("info", str(tmp_path)), "is not a diskreplay buffer")
    assert_one_line_error(run("export", str(tmp_path / "nope"), str(tmp_path / "o.npz")), "not a diskreplay buffer")
    assert_one_line_error(run("export", str(tmp_path / "nope"), str(tmp_path / "o.csv")),
                          "cannot tell the export format")
    write_d4rl(tmp_path / "d.hdf5")
    dr.ReplayBuffer.create(tmp_path / "b", {"x": dr.Field((), "int8")}).close()
    assert_one_line_error(run("import", str(tmp_path / "d.hdf5"), str(tmp_path / "b")), "--overwrite")
    proc = run("import", "--chunk-rows", "0", str(tmp_path / "d.hdf5"), str(tmp_path / "c"))
    assert proc.returncode == 2 and "positive integer" in proc.stderr


def test_a_url_that_loops_is_named_by_every_command(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    looping = f"'{loop}' is not a diskreplay buffer (its path runs into a loop of symbolic links)"
    assert_one_line_error(run("info", str(loop)), looping)
    assert_one_line_error(run("unlock", str(loop)), looping)
    assert_one_line_error(run("export", str(loop), str(tmp_path / "o.npz")), looping)
    write_d4rl(tmp_path / "d.hdf5")
    assert_one_line_error(run("import", str(tmp_path / "d.hdf5"), str(loop)),
                          f"'{loop}' cannot hold a buffer (its path runs into a loop of symbolic links)")
    proc = run("verify", str(loop))
    assert proc.returncode == 1 and proc.stderr == (f"{loop}: PROBLEMS - 0 rows, 0 chunks checked\n  problem: "
                                                    f"not a diskreplay buffer (its path runs into a loop of symbolic "
                                                    f"links)\n")


def test_interrupted_import_is_reported(tmp_path):
    buf = dr.ReplayBuffer.create(tmp_path / "b", {"x": dr.Field((), "int8")})
    buf.close()
    (tmp_path / "b" / INCOMPLETE_KEY).write_text(json.dumps({"source": "big.hdf5", "started": 0, "pid": 7}))
    os.remove(tmp_path / "b" / OWN / "commit.json")
    assert_one_line_error(run("info", str(tmp_path / "b")), "interrupted import", "big.hdf5")
    proc = run("verify", str(tmp_path / "b"))
    assert proc.returncode == 1 and "interrupted import" in proc.stderr


def test_demo_without_dir_removes_its_temp_dir(tmp_path):
    pytest.importorskip("torch")
    os.makedirs(tmp_path / "tmp")
    env = cli_env(TMPDIR=str(tmp_path / "tmp"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "torch-cache"))
    proc = run("demo", "--steps", "40", "--envs", "2", "--seconds", "0.01", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"buffer at {tmp_path / 'tmp'}" in proc.stdout and "removed as the demo ends" in proc.stdout
    assert os.listdir(tmp_path / "tmp") == []


def test_demo_runs_and_resumes(tmp_path):
    pytest.importorskip("torch")
    proc = run("demo", str(tmp_path), "--steps", "150", "--envs", "2", "--seconds", "0.05")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for needle in ("rows added/s", "uniform samples/s", "DataLoader rows/s", "MB on disk",
                   "resume: closed at 300 rows", "added 74 more -> 374 rows", "diskreplay info"):
        assert needle in out, out
    info = json.loads(run("info", "--json", str(tmp_path / "cartpole.zarr")).stdout)
    assert info["rows"] == 374 and info["lanes"] == 2
    if hasattr(dr, "Prioritized"):
        assert info["sampler"] == "Prioritized" and "prioritized" in out


def test_bench_runs_tools_or_says_why(tmp_path):
    assert_one_line_error(run("bench", "--tools", str(tmp_path)), "no benchmarks found")
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "bench_core.py").write_text("import sys\n# supports --quick\nprint('| core |', sys.argv[1:])\n")
    (tools / "bench_other.py").write_text("import sys\nprint('| other |', sys.argv[1:])\n")
    (tools / "benchlib.py").write_text("raise SystemExit('not a benchmark')\n")
    proc = run("bench", "--quick", "--tools", str(tools))
    assert proc.returncode == 0, proc.stderr
    assert "| core | ['--quick']" in proc.stdout and "| other | []" in proc.stdout
    assert proc.stdout.index("bench_core.py") < proc.stdout.index("bench_other.py")
    proc = run("bench", "--only", "other", "--tools", str(tools))
    assert "| other |" in proc.stdout and "core" not in proc.stdout
    (tools / "bench_broken.py").write_text("raise SystemExit(3)\n")
    assert_one_line_error(run("bench", "--tools", str(tools)), "bench_broken.py (exit 3)")


def test_bench_without_the_bench_extra_says_which_to_install(monkeypatch, capsys):
    for module in cli.BENCH_EXTRA:
        monkeypatch.setitem(sys.modules, module, None)  # as after the README's install of .[test] only
    monkeypatch.setattr(cli.subprocess, "call", lambda *a, **k: pytest.fail(f"ran a benchmark: {a}"))
    assert cli.main(["bench", "--quick"]) == 1
    assert capsys.readouterr().err == ("diskreplay: error: the benchmarks need the 'bench' extra (missing: cpprb, "
                                       "torchrl, tensordict, psutil): pip install -e \".[bench]\"\n")


def test_unlock_without_lock(tmp_path):
    pytest.importorskip("diskreplay.io.lock")
    dr.ReplayBuffer.create(tmp_path / "b", {"x": dr.Field((), "int8")}).close()
    proc = run("unlock", str(tmp_path / "b"))
    assert proc.returncode == 0 and "no writer lock" in proc.stdout


@pytest.mark.parametrize("fmt", ["npz", "hdf5", "parquet", "minari"])
def test_export_writes_derived_next_obs_in_each_format(tmp_path, fmt):
    pytest.importorskip("pyarrow", reason="Parquet and Minari exports need pyarrow")
    from test_importers import derive_next_buffer

    _, rows = derive_next_buffer(tmp_path / "b")
    dest, extra = tmp_path / f"out.{fmt}", (["--dataset-id", "diskreplay/out-v3"] if fmt == "minari" else [])
    proc = run("export", str(tmp_path / "b"), str(dest), "--format", fmt, "--batch-rows", "5", "--no-progress", *extra)
    assert proc.returncode == 0 and proc.stdout == f"exported 16 rows to {dest}\n", proc.stderr
    back = dr.offline.import_dataset(dest, tmp_path / "back", progress=False)
    if fmt in ("parquet", "minari"):  # the unfinished last episode comes back truncated
        rows["truncated"][-1] = True
    for name, values in rows.items():
        np.testing.assert_array_equal(back[back.row_ids()][name], values, err_msg=name)
    back.close()
    if fmt == "minari":
        assert json.loads((dest / "data" / "metadata.json").read_text())["dataset_id"] == "diskreplay/out-v3"


# ---- remote URLs: storage options, credentials, buckets -----------------------------------------


def s3_env(**extra: str) -> dict[str, str]:
    """The CLI's environment without AWS settings (none from files or instance metadata either)."""
    env = {k: v for k, v in cli_env().items() if not k.startswith("AWS_")}
    return {**env, "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull, **extra}


def test_storage_option_values_are_json_when_they_parse():
    assert cli._storage_option("anon=true") == ("anon", True)
    assert cli._storage_option("endpoint_url=http://127.0.0.1:9000") == ("endpoint_url", "http://127.0.0.1:9000")
    assert cli._storage_option('client_kwargs={"region_name": "eu-west-1"}') == (
        "client_kwargs", {"region_name": "eu-west-1"})
    assert cli._storage_option("key=a=b") == ("key", "a=b")
    args = cli.build_parser().parse_args(["info", "s3://b/x", "--storage-option", "a=1", "--storage-option", "b=x"])
    assert cli._storage_options(args) == {"a": 1, "b": "x"}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["info", "s3://b/x", "--storage-option", "novalue"])


def test_storage_options_reach_every_command_that_opens_a_url(s3, tmp_path):
    options = [f"--storage-option={k}={v}" for k, v in s3.storage_options().items()]
    url, env = s3.new_url(), s3_env()
    (tmp_path / "spec.json").write_text(json.dumps({"fields": {"x": {"shape": [], "dtype": "int8"}}}))
    proc = run("create", url, "--config", str(tmp_path / "spec.json"), *options, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith(f"created {url}: unbounded"), proc.stderr
    assert "0 in 1 lane" in run("info", url, *options, env=env).stdout
    write_d4rl(tmp_path / "d.hdf5")
    proc = run("import", str(tmp_path / "d.hdf5"), url, "--overwrite", "--no-progress", *options, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("imported 103 rows"), proc.stderr
    proc = run("verify", url, "--no-progress", *options, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr
    proc = run("export", url, str(tmp_path / "o.npz"), "--no-progress", *options, env=env)
    assert proc.returncode == 0 and "exported 103 rows" in proc.stdout, proc.stderr
    assert run("unlock", url, *options, env=env).stdout == f"{url}: no writer lock\n"


def test_missing_credentials_and_bucket_are_one_line_naming_the_url(s3, tmp_path):
    url = s3.new_url()
    (tmp_path / "spec.json").write_text(json.dumps({"fields": {"x": {"shape": [], "dtype": "int8"}}}))
    no_credentials = s3_env(AWS_ENDPOINT_URL=s3.endpoint)
    for command in (["info", url], ["verify", url], ["unlock", url],
                    ["create", url, "--config", str(tmp_path / "spec.json")]):
        assert_one_line_error(run(*command, env=no_credentials), f"{url}: no credentials found",
                              "AWS_ACCESS_KEY_ID", "--storage-option key=")
    credentials = s3_env(AWS_ENDPOINT_URL=s3.endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    missing = "s3://no-such-bucket-here/buf"
    for command in (["info", missing], ["create", missing, "--config", str(tmp_path / "spec.json")]):
        assert_one_line_error(run(*command, env=credentials),
                              f"{missing}: bucket 'no-such-bucket-here' does not exist", "create it first")
    # the environment variables alone reach the server
    proc = run("create", url, "--config", str(tmp_path / "spec.json"), env=credentials)
    assert proc.returncode == 0, proc.stderr


def test_verify_shows_progress_in_chunks_on_stderr(tmp_path):
    pytest.importorskip("tqdm")
    write_d4rl(tmp_path / "d.hdf5")
    assert run("import", str(tmp_path / "d.hdf5"), str(tmp_path / "buf"), "--chunk-rows", "16",
               "--no-progress").returncode == 0
    proc = run("verify", str(tmp_path / "buf"))
    assert proc.returncode == 0 and "verify: 42 chunks [" in proc.stderr, proc.stderr
    proc = run("verify", str(tmp_path / "buf"), "--no-progress")
    assert proc.returncode == 0 and proc.stderr == "" and "42 chunks checked" in proc.stdout


def test_access_problems_are_found_among_the_causes():
    from botocore.exceptions import ClientError, NoCredentialsError

    from diskreplay.io.access import access_problem

    def wrapped(cause: BaseException) -> OSError:
        try:
            try:
                raise cause
            except Exception as exc:
                raise OSError("s3fs says something") from exc
        except OSError as outer:
            return outer

    assert access_problem(wrapped(NoCredentialsError())) == "credentials"
    rejected = ClientError({"Error": {"Code": "InvalidAccessKeyId", "Message": "no"}}, "GetObject")
    assert access_problem(wrapped(rejected)) == "rejected InvalidAccessKeyId"
    missing = ClientError({"Error": {"Code": "NoSuchBucket", "Message": "no"}}, "PutObject")
    assert access_problem(wrapped(missing)) == "bucket"
    assert access_problem(FileNotFoundError("s3://b/x/zarr.json")) is None
    args = cli.build_parser().parse_args(["info", "s3://b/x"])
    assert cli._user_message(wrapped(rejected), args) == (
        "s3://b/x: the store rejected the credentials (InvalidAccessKeyId): check AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL, or the key/secret/endpoint_url --storage-option values")
    assert cli._user_message(RuntimeError("a bug"), args) is None  # not the user's: the traceback stays
