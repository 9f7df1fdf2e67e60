"""Cloud benchmark (issue #6): a buffer on S3 (moto over HTTP on loopback) vs the same on local disk.

The script starts its own S3 server: moto's ``ThreadedMotoServer`` in a child process on
127.0.0.1, plus (in the same child) the proxy of ``tests/s3server.py`` that adds a fixed latency
to every request — loopback answers in well under a millisecond, real S3 in ~10-30 ms to first
byte, and that latency is what concurrency hides. Every measurement runs on both: "loopback"
(straight to moto) and "+N ms" (through the proxy; ``--latency-ms``). moto is one Python
process whose CPU per request (several ms) caps any client at a few hundred GETs/s however many
are in flight, unlike S3; so the proxy serves repeat GETs of an object from its own copy (the
*client* is still cold: a fresh reader with an empty cache, every chunk fetched over HTTP).

Workload: dataset-mode buffer, five fields — obs (17,) f32, action (6,) f32, reward f32,
next_obs (17,) f32, done bool (165 B per row) — zstd, ``--chunk-rows`` per chunk.

Measured (median of repeats):
1. sample(256), cold: a freshly opened reader, nothing cached; 1 vs 16 requests in flight
   (``io_threads``);
2. bytes fetched per sampled byte (cold sample(256): compressed bytes GETted / 256 rows' bytes);
3. sample(256), warm: every chunk in the cache; vs the same on local disk (warm too);
4. sequential epoch, cold: rows in order, with read-ahead (``--read-ahead`` chunks per gather,
   ``--ahead-threads`` requests in flight) vs one chunk at a time (one chunk per gather, 1 request
   in flight), over ``--seq-chunks`` chunks;
5. epoch, cold: every row once through ``Loader(make_dataset(url, 256, mode="epoch"))`` in this
   process (block shuffle), a fresh reader each time, reading ahead by bytes (``--epoch-ahead-mib``).

Targets: warm sampling within 1.5x of local disk; cold sequential iteration with read-ahead at
least 8x faster than one chunk at a time (judged on the latency run, where the network is what
costs; on bare loopback moto's own CPU per request is the bottleneck and is reported as is).

Usage: python tools/bench_cloud.py [--quick] [--latency-ms 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import benchlib as bl  # noqa: E402

import diskreplay as dr  # noqa: E402

FIELDS = {"obs": dr.Field((17,), "float32"), "action": dr.Field((6,), "float32"),
          "reward": dr.Field((), "float32"), "next_obs": dr.Field((17,), "float32"),
          "done": dr.Field((), "bool")}
ROW_BYTES = sum(f.row_bytes for f in FIELDS.values())
BUCKET = "bench"
PACKAGES = ["numpy", "zarr", "fsspec", "s3fs", "aiobotocore", "moto"]

SERVER_CODE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from s3server import FaultProxy, MotoS3
s3 = MotoS3(sys.argv[2])
proxy = FaultProxy(s3.endpoint, latency_s=float(sys.argv[3]), cache=True)
print(json.dumps({"loopback": s3.endpoint, "latency": proxy.endpoint}), flush=True)
sys.stdin.read()  # serve until the parent closes our stdin
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start_server(latency_s: float) -> tuple[subprocess.Popen, dict[str, str]]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(ROOT / "tests"), BUCKET, str(latency_s)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError("the moto server did not start (is moto[server] installed?)")
    return proc, json.loads(line)


def options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}


def make_data(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((rows + 1, 17), dtype=np.float32)
    return {"obs": obs[:-1], "action": rng.uniform(-1, 1, (rows, 6)).astype(np.float32),
            "reward": rng.standard_normal(rows, dtype=np.float32), "next_obs": obs[1:],
            "done": rng.random(rows) < 0.001}


def write_buffer(url: str, data: dict, chunk_rows: int, storage_options: dict | None,
                 compression: str | None = "zstd") -> None:
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=chunk_rows, compression=compression,
                                 storage_options=storage_options, io_threads=16, overwrite=True)
    step = 64 * chunk_rows
    for start in range(0, len(data["obs"]), step):
        buf.extend({k: v[start:start + step] for k, v in data.items()})
    buf.close()


def open_reader(url: str, so: dict | None, threads: int) -> dr.ReplayBuffer:
    return dr.ReplayBuffer.open(url, "r", storage_options=so, io_threads=threads, cache_bytes=2**30)


def count_fetched(buf: dr.ReplayBuffer) -> list[int]:
    """Instrument the reader's store: returns a cell that accumulates bytes GETted."""
    store = buf.storage.store
    original = store.get_many
    cell = [0]

    def get_many(keys):
        out = original(keys)
        cell[0] += sum(len(b) for b in out if b is not None)
        return out

    store.get_many = get_many
    return cell


def bench_cold_sample(url: str, so: dict, threads: int, repeats: int) -> tuple[bl.Stats, float]:
    stats, ratios = bl.Stats(), []
    for r in range(repeats):
        buf = open_reader(url, so, threads)
        fetched = count_fetched(buf)
        secs, _ = bl.timed(lambda buf=buf, r=r: buf.sample(256, seed=1000 + r))
        stats.samples.append(secs)
        ratios.append(fetched[0] / (256 * ROW_BYTES))
        buf.close()
    return stats, float(np.median(ratios))


def warm(buf: dr.ReplayBuffer, rows: int, chunk_rows: int) -> None:
    for start in range(0, rows, 32 * chunk_rows):
        buf[np.arange(start, min(rows, start + 32 * chunk_rows))]


def bench_warm_sample(readers: dict[str, dr.ReplayBuffer], batches: int, repeats: int) -> dict[str, bl.Stats]:
    def run(buf):
        return lambda: [buf.sample(256) for _ in range(batches)] and None
    return bl.interleaved({k: run(b) for k, b in readers.items()}, repeats, number=batches, warmup=1)


def bench_sequential(url: str, so: dict, chunk_rows: int, chunks: int, read_ahead: int, ahead_threads: int,
                     repeats: int) -> dict[str, bl.Stats]:
    """Seconds per row for a cold in-order pass over ``chunks`` chunks."""
    rows = chunks * chunk_rows

    def run(threads: int, per_gather: int):
        def once():
            buf = open_reader(url, so, threads)
            started = time.perf_counter()
            for start in range(0, rows, per_gather * chunk_rows):
                buf[np.arange(start, min(rows, start + per_gather * chunk_rows))]
            secs = time.perf_counter() - started
            buf.close()
            return secs
        return once

    stats = bl.interleaved({"read-ahead": run(ahead_threads, read_ahead), "one chunk at a time": run(1, 1)},
                           repeats, number=rows, warmup=1)
    return stats


def bench_epoch(url: str, so: dict, rows: int, ahead_mib: float | None, repeats: int) -> bl.Stats:
    """Seconds per row of one cold epoch in this process (every row once, batches of 256)."""
    from diskreplay.torch import Loader, make_dataset

    def once() -> float:
        ds = make_dataset(url, 256, mode="epoch", storage_options=so, cache_bytes=2**30, io_threads=16)
        if ahead_mib is not None:
            ds.read_ahead_bytes = int(ahead_mib * 2**20)
        started = time.perf_counter()
        seen = sum(len(batch["index"]) for batch in Loader(ds))
        secs = time.perf_counter() - started
        assert seen == rows, (seen, rows)
        ds.reader.get().close()
        return secs
    return bl.interleaved({"epoch": once}, repeats, number=rows)["epoch"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small buffer, few repeats (about a minute)")
    p.add_argument("--rows", type=int, default=None, help="rows in the buffer (default 400k; --quick 100k)")
    p.add_argument("--chunk-rows", type=int, default=4096)
    p.add_argument("--latency-ms", type=float, default=20.0, help="latency the proxy adds per request")
    p.add_argument("--read-ahead", type=int, default=32, help="chunks per gather in the read-ahead pass")
    p.add_argument("--ahead-threads", type=int, default=32, help="requests in flight in the read-ahead pass")
    p.add_argument("--seq-chunks", type=int, default=None, help="chunks read by the sequential passes")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--compression", default="zstd", help="codec of the buffer: zstd, lz4 or none")
    p.add_argument("--epoch-ahead-mib", type=float, default=None,
                   help="epoch read-ahead budget (default: the library's)")
    p.add_argument("--out", default=None, help="also write the report to this file")
    args = p.parse_args()
    q = args.quick
    rows = args.rows or (100_000 if q else 400_000)
    repeats = args.repeats or (3 if q else 5)
    total_chunks = -(-rows // args.chunk_rows)
    seq_chunks = min(total_chunks, args.seq_chunks or (24 if q else 64))

    header = bl.report_header("diskreplay cloud benchmark", q, PACKAGES, details=[
        f"workload: {rows:,} rows x {ROW_BYTES} B, chunks of {args.chunk_rows} rows (zstd), "
        f"{total_chunks} chunks per field; moto {bl.package_versions(['moto'])['moto']} in a child "
        f"process on 127.0.0.1; latency run: +{args.latency_ms:g} ms per request via a proxy"])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    proc, endpoints = start_server(args.latency_ms / 1000)
    tmp = tempfile.mkdtemp(prefix="diskreplay-cloud-")
    try:
        data = make_data(rows, seed=0)
        local = os.path.join(tmp, "local")
        url = f"s3://{BUCKET}/bench"
        log("writing the buffer (local disk and S3) ...")
        compression = None if args.compression == "none" else args.compression
        write_buffer(local, data, args.chunk_rows, None, compression)
        write_buffer(url, data, args.chunk_rows, options(endpoints["loopback"]), compression)
        del data
        runs = {"loopback": options(endpoints["loopback"]), f"+{args.latency_ms:g} ms": options(endpoints["latency"])}
        table = bl.Table(list(runs), corner="S3 (moto)")
        results: dict[str, dict[str, Any]] = {}
        for name, so in runs.items():
            log(f"[{name}] cold sample(256) ...")
            cold1, amp = bench_cold_sample(url, so, 1, max(2, repeats - 2))
            cold16, _ = bench_cold_sample(url, so, 16, repeats)
            log(f"[{name}] sequential epoch ({seq_chunks} chunks) ...")
            seq = bench_sequential(url, so, args.chunk_rows, seq_chunks, args.read_ahead, args.ahead_threads,
                                   max(2, repeats - 2))
            log(f"[{name}] epoch ({rows:,} rows) ...")
            epoch = bench_epoch(url, so, rows, args.epoch_ahead_mib, max(2, repeats - 2))
            log(f"[{name}] warm sample(256) ...")
            remote = open_reader(url, so, 16)
            warm(remote, rows, args.chunk_rows)
            loc = open_reader(local, None, 16)
            warm(loc, rows, args.chunk_rows)
            hot = bench_warm_sample({"s3": remote, "local": loc}, 200 if q else 1000, repeats)
            remote.close()
            loc.close()
            results[name] = {"cold1": cold1.median, "cold16": cold16.median, "amp": amp,
                             "warm": hot["s3"].median, "local": hot["local"].median,
                             "ahead": seq["read-ahead"].median, "one": seq["one chunk at a time"].median,
                             "epoch": epoch.median}
        col = list(runs)
        table.add("sample(256) cold, 1 request in flight", {c: results[c]["cold1"] for c in col}, unit="ms")
        table.add("sample(256) cold, 16 in flight", {c: results[c]["cold16"] for c in col}, unit="ms")
        table.add("cold speed-up, 16 vs 1 in flight",
                  {c: f"{results[c]['cold1'] / results[c]['cold16']:.1f}x" for c in col}, kind="text")
        table.add("bytes fetched per sampled byte (cold sample(256))",
                  {c: f"{results[c]['amp']:,.0f}" for c in col}, kind="text")
        table.add("sample(256) warm (all chunks cached)", {c: results[c]["warm"] for c in col}, unit="us")
        table.add("same on local disk, warm", {c: results[c]["local"] for c in col}, unit="us")
        table.add("warm S3 / warm local", {c: f"{results[c]['warm'] / results[c]['local']:.2f}x" for c in col},
                  kind="text")
        mb = ROW_BYTES / 1e6
        table.add(f"sequential epoch, cold, read-ahead ({args.read_ahead} chunks/gather, "
                  f"{args.ahead_threads} in flight)",
                  {c: f"{mb / results[c]['ahead']:.1f} MB/s ({1 / results[c]['ahead'] / 1e3:,.0f}k rows/s)"
                   for c in col}, kind="text")
        table.add("sequential epoch, cold, one chunk at a time",
                  {c: f"{mb / results[c]['one']:.1f} MB/s ({1 / results[c]['one'] / 1e3:,.0f}k rows/s)"
                   for c in col}, kind="text")
        table.add("epoch, cold, Loader in this process (read-ahead by bytes)",
                  {c: f"{mb / results[c]['epoch']:.1f} MB/s ({1 / results[c]['epoch'] / 1e3:,.0f}k rows/s)"
                   for c in col}, kind="text")
        table.add("read-ahead speed-up", {c: f"{results[c]['one'] / results[c]['ahead']:.1f}x" for c in col},
                  kind="text")
        lat = f"+{args.latency_ms:g} ms"
        worst_warm = max(results[c]["warm"] / results[c]["local"] for c in col)
        seq_gain = results[lat]["one"] / results[lat]["ahead"]
        targets = [
            bl.Target("warm-cache sample(256) within 1.5x of local disk (worse of both runs)",
                      f"{worst_warm:.2f}x", worst_warm <= 1.5),
            bl.Target(f"cold sequential iteration >= 8x faster than one chunk at a time ({lat} run)",
                      f"{seq_gain:.1f}x (loopback: {results['loopback']['one'] / results['loopback']['ahead']:.1f}x)",
                      seq_gain >= 8),
        ]
        bl.publish_report(header, table.render() + "\n\n" + bl.render_targets(targets), args.out, started)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
