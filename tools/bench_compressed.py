"""Random sampling from a compressed buffer larger than its reader's cache, by chunk layout.

A zstd buffer of the core benchmark's five fields (165 B per row, default 4M rows: 660 MB) is
read by a fresh reader with ``cache_bytes`` well below its size (default 128 MiB), so most rows
of a random batch miss the cache. Contestants, each warmed up, then ``sample(256)`` timed in
interleaved repeats (medians):

- diskreplay zstd, the default layout (``row_shards=True``: small compressed rows stored as Zarr
  shards of ~8 KiB inner chunks; a missed row decodes its inner chunk),
- diskreplay zstd with ``row_shards=False`` (each chunk one zstd frame: a missed row loads and
  decodes its whole chunk),
- diskreplay raw (memory-mapped, the uncompressed reference),
- TorchRL's ``TensorDictReplayBuffer(LazyMemmapStorage)`` over the same rows (uncompressed).

Also the stored bytes of each and the reader's CPU per batch. The page cache is warm (every file
read once first): what is measured is decoding, not the disk.

Usage: python tools/bench_compressed.py [--quick] [--rows 4M] [--cache-mib 128] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import bench_scale as bs
import benchlib as bl

import diskreplay as dr

BATCH = 256
SHARDED, ONE_FRAME, RAW, TRL = "zstd, sharded (default)", "zstd, row_shards=False", "raw (mapped)", "TorchRL memmap"
LAYOUTS = {SHARDED: ("zstd", True), ONE_FRAME: ("zstd", False), RAW: (None, True)}


def build(path: str, rows: int, data: bs.Rows, compression: str | None, row_shards: bool) -> None:
    with dr.ReplayBuffer.create(path, bs.FIELDS, capacity=rows, compression=compression, row_shards=row_shards,
                                seed=0) as buf:
        for block in data.blocks(rows):
            buf.extend(block)


def sampler(name: str, path: str, rows: int, cache_bytes: int) -> Callable[[], Any]:
    if name == TRL:
        rb = bs.open_trl(path, rows)
        return rb.sample
    buf = dr.ReplayBuffer.open(path, "r", cache_bytes=cache_bytes)
    return lambda: buf.sample(BATCH)


def cpu_per_call(fn: Callable[[], Any], calls: int) -> float:
    started = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - started) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/diskreplay-bench-compressed", help="work directory on the local disk")
    p.add_argument("--rows", type=bl.parse_count, default=4_000_000)
    p.add_argument("--cache-mib", type=int, default=128, help="the readers' cache_bytes, MiB")
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats of --calls batches each")
    p.add_argument("--calls", type=int, default=20, help="sample(256) calls per repeat")
    p.add_argument("--quick", action="store_true", help="a smoke run: 300k rows, an 8 MiB cache, 2 repeats")
    p.add_argument("--out", help="also write the markdown report to this file")
    args = p.parse_args()
    if args.quick:
        args.rows, args.cache_mib, args.repeats, args.calls = 300_000, 8, 2, 5
    import torch

    bl.import_torchrl()
    torch.set_num_threads(1)
    header = bl.report_header("diskreplay: sampling a compressed buffer past its cache", args.quick,
                              ["diskreplay", "numpy", "zarr", "zstandard", "torch", "torchrl"], args.dir,
                              [f"{bl.format_count(args.rows)} rows x {bs.ROW_BYTES} B; cache_bytes "
                               f"{args.cache_mib} MiB; sample({BATCH}); page cache warm"])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    data, paths = bs.Rows(), {}
    for i, (name, (compression, row_shards)) in enumerate(LAYOUTS.items()):
        paths[name] = f"{args.dir}/dr{i}"
        bl.log(f"writing {name} ...")
        build(paths[name], args.rows, data, compression, row_shards)
    paths[TRL] = f"{args.dir}/trl"
    bl.log(f"writing {TRL} ...")
    bs.build_trl(paths[TRL], args.rows, data)
    for path in paths.values():
        bl.read_files(path)
    fns = {name: sampler(name, path, args.rows, args.cache_mib * bl.MiB) for name, path in paths.items()}
    for fn in fns.values():
        bs.warm_up(fn, 50, 2.0)
    stats = bl.interleaved({name: bs.repeat(fn, args.calls) for name, fn in fns.items()}, args.repeats,
                           number=args.calls, progress=bl.log)
    table = bl.Table(list(fns), corner=f"{bl.format_count(args.rows)} rows, cache {args.cache_mib} MiB")
    table.add(f"`sample({BATCH})`, median", {n: s.median for n, s in stats.items()}, baseline=TRL)
    table.add("reader CPU per batch", {n: cpu_per_call(fn, args.calls) for n, fn in fns.items()}, baseline=TRL)
    table.add("stored bytes", {n: bl.stored_bytes(path) for n, path in paths.items()}, kind="bytes")
    bl.publish_report(header, table.render(), args.out, started)
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
