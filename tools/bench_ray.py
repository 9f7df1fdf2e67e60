"""Ray Data benchmark: `diskreplay.ray.read_buffer` against ``ray.data.read_parquet`` of the same rows.

The same ``--rows`` rows (obs (17,) f32, action (6,) f32, reward f32, next_obs (17,) f32, done bool:
165 B per row) are written once as a diskreplay buffer (``--chunk-rows`` per chunk) and once as 8
Parquet files (fixed-size list columns, one row group per 64k rows), on the same disk, per
``--compression`` (raw: an uncompressed buffer and uncompressed Parquet; zstd: both zstd). A local
Ray instance (``ray.init(num_cpus=<CPUs>)``) then reads each, 2 and 8 read tasks
(``override_num_blocks``): the dataset made and every batch of ``ds.iter_batches(batch_size=None,
batch_format="numpy")`` taken; rows per second, the contestants in turns, medians of
``--repeats`` rounds after an untimed one (which also brings the files into the page cache).

Usage: python tools/bench_ray.py [--quick] [--rows 2M] [--compression raw,zstd] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl

import diskreplay as dr

PACKAGES = ["diskreplay", "ray", "pyarrow", "numpy", "zarr"]
ROW_BYTES = 165
FILES = 8


def make_data(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = {name: rng.standard_normal((rows, *shape)).astype(dtype) for name, (shape, dtype)
            in bl.WORKLOAD_FIELDS.items() if dtype != "bool"}
    return {**data, "done": rng.random(rows) < 0.01}


def write_buffer(url: str, data: dict[str, np.ndarray], chunk_rows: int, compression: str | None) -> None:
    fields = {name: dr.Field(shape, dtype) for name, (shape, dtype) in bl.WORKLOAD_FIELDS.items()}
    with dr.ReplayBuffer.create(url, fields, chunk_rows=chunk_rows, compression=compression) as buf:
        step = 1 << 18
        for start in range(0, len(data["done"]), step):
            buf.extend({name: values[start:start + step] for name, values in data.items()})


def write_parquet(folder: str, data: dict[str, np.ndarray], compression: str | None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder)
    rows = len(data["done"])
    for i in range(FILES):
        a, b = i * rows // FILES, (i + 1) * rows // FILES
        columns = {name: pa.FixedSizeListArray.from_arrays(values[a:b].reshape(-1), values.shape[1])
                   if values.ndim == 2 else pa.array(values[a:b]) for name, values in data.items()}
        pq.write_table(pa.table(columns), f"{folder}/part-{i}.parquet", compression=compression or "none",
                       row_group_size=1 << 16)


def epoch(make, rows: int) -> None:
    """Every batch of a freshly made dataset taken; raises AssertionError unless they hold ``rows`` rows."""
    got = 0
    for batch in make().iter_batches(batch_size=None, batch_format="numpy"):
        got += len(batch["done"])
    assert got == rows, f"read {got} rows, expected {rows}"


def rate(rows: int, seconds: float) -> str:
    return f"{rows / seconds / 1e6:.2f}M ({rows * ROW_BYTES / seconds / 1e6:,.0f} MB/s)"


def one_compression(comp: str, data: dict[str, np.ndarray], tmp: str, args: argparse.Namespace,
                    repeats: int) -> tuple[str, dict]:
    import ray.data

    from diskreplay.ray import read_buffer

    rows = len(data["done"])
    codec = None if comp == "raw" else comp
    url, folder = f"{tmp}/{comp}.zarr", f"{tmp}/{comp}-parquet"
    bl.log(f"{comp}: writing {rows:,} rows as a buffer and as {FILES} Parquet files")
    write_buffer(url, data, args.chunk_rows, codec)
    write_parquet(folder, data, codec)
    table = bl.Table(["diskreplay `read_buffer`", "`read_parquet`"], corner=f"{comp}: every row once")
    results = {}
    for tasks in (2, 8):
        contestants = {
            "diskreplay `read_buffer`": lambda n=tasks: epoch(lambda: read_buffer(url, override_num_blocks=n), rows),
            "`read_parquet`": lambda n=tasks: epoch(lambda: ray.data.read_parquet(folder, override_num_blocks=n), rows),
        }
        st = bl.interleaved(contestants, repeats, warmup=1, progress=bl.log)  # warm-up: page cache, Ray's workers
        table.add(f"{tasks} read tasks: seconds per epoch", {k: s.median for k, s in st.items()},
                  baseline="`read_parquet`")
        table.add(f"{tasks} read tasks: rows/s", {k: rate(rows, s.median) for k, s in st.items()}, kind="text")
        results[tasks] = {k: {"seconds": s.samples, "rows_per_s": rows / s.median} for k, s in st.items()}
    return table.render(), results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small smoke run (about a minute)")
    p.add_argument("--rows", type=bl.parse_count, default=None, help="rows (default 2M; --quick 200k)")
    p.add_argument("--compression", default="raw,zstd", help="comma-separated: raw, zstd")
    p.add_argument("--chunk-rows", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3; --quick 1)")
    p.add_argument("--dir", default=None, help="where the data goes (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = p.parse_args()
    try:
        import ray
    except ImportError:
        print('bench_ray: skipped: Ray is not installed (pip install "diskreplay[ray]")', flush=True)
        return
    rows = args.rows or (200_000 if args.quick else 2_000_000)
    repeats = args.repeats or (1 if args.quick else 3)
    comps = [c.strip() for c in args.compression.split(",") if c.strip()]
    if not comps or set(comps) - {"raw", "zstd"}:
        p.error(f"--compression takes raw and/or zstd, not {args.compression!r}")
    cpus = len(os.sched_getaffinity(0))
    header = bl.report_header("diskreplay on Ray Data (vs read_parquet)", args.quick, PACKAGES, data_dir=args.dir,
                              details=[f"workload: {rows:,} rows x {ROW_BYTES} B ({rows * ROW_BYTES / 1e6:,.0f} MB), "
                                       f"chunks of {args.chunk_rows} rows, {FILES} Parquet files; a local Ray "
                                       f"instance of {cpus} CPUs; {repeats} timed round(s) after one untimed, medians"])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="diskreplay-ray-", dir=args.dir)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    tables, results = [], {"rows": rows, "command": bl.command_line()}
    try:
        data = make_data(rows, seed=0)
        for comp in comps:
            table, results[comp] = one_compression(comp, data, tmp, args, repeats)
            tables.append(table)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        bl.publish_report(header, "\n\n".join(tables), None, started)
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
