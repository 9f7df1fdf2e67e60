"""Object-store client benchmark: s3fs (diskreplay's `FsspecChunkStore`), the same store's plain GETs
(`S3Gets`) and obstore (Rust ``object_store``, the client of zarr-python's ``ObjectStore``) on the
same server.

The script starts moto's ``ThreadedMotoServer`` in a child process on 127.0.0.1 with the proxy of
``tests/s3server.py`` in front of it (``--latency-ms`` per request, default 20 ms). The proxy
answers repeat GETs from its own copy (here byte ranges too: they are cut out of the cached
object), so moto's CPU per request does not cap either client; every object is fetched through
the proxy once before the clock starts. The objects are random bytes (incompressible).

The GET patterns diskreplay makes:
  a. many small objects (122 KB, one chunk): 256 of them with 16, 32 and 64 requests in flight;
  b. a few large objects (5 MB): 8 of them, all in flight;
  c. byte ranges: 256 ranges of 4 KB out of the 8 large objects, all in flight (s3fs: one ranged
     ``_cat_file`` each under the store's retry layer; obstore: one ``get_range_async`` each, and
     ``get_ranges_async`` per object with its default 1 MB coalescing as a further row).

s3fs runs through ``FsspecChunkStore`` with ``plain_gets=False`` (its semaphore, retry layer and
connection pool of ``concurrency`` connections); the plain GETs through the same store with its
default ``plain_gets`` (whole objects only: patterns a and b); obstore runs ``get_async`` /
``get_range_async`` under an asyncio semaphore of the same size, on an ``S3Store`` with the same
endpoint and ``allow_http``.

Reported per pattern and client (median of interleaved rounds after a warm-up round): wall time,
MB/s of bytes asked for, requests/s, the requests and bytes the proxy served, and the client's
CPU seconds per GB asked for (process CPU time of this process, every thread included: what
competes with training). Ratios are against s3fs (> 1: better than s3fs).

Usage: python tools/bench_client.py [--quick] [--latency-ms 20] [--rounds 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import benchlib as bl  # noqa: E402

from diskreplay.io import FsspecChunkStore  # noqa: E402

BUCKET = "bench"
KEY = {"key": "bench", "secret": "bench"}
PACKAGES = ["s3fs", "aiobotocore", "botocore", "obstore", "moto"]
SMALL, LARGE, RANGE = 122 * 1024, 5 * 1024 * 1024, 4096
PLAIN = "plain GETs (s3fs store)"

SERVER_CODE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from s3server import FaultProxy, MotoS3

s3 = MotoS3(sys.argv[2])
proxy = FaultProxy(s3.endpoint, latency_s=float(sys.argv[3]), cache=True)
print(json.dumps({"moto": s3.endpoint, "proxy": proxy.endpoint}), flush=True)
for line in sys.stdin:  # "stats": requests and bytes served since the last "stats"
    with proxy.lock:
        n = sum(proxy.hits.values())
        proxy.hits.clear()
    print(json.dumps({"requests": n}), flush=True)
"""


class Server:
    """The moto server and its proxy in a child process."""

    def __init__(self, latency_s: float):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(ROOT / "tests"), BUCKET, str(latency_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the moto server did not start (is moto[server] installed?)")
        self.endpoints = json.loads(line)

    def requests(self) -> int:
        """Requests the proxy served since the last call."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return int(json.loads(self.proc.stdout.readline())["requests"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def upload(server: Server, prefix: str, small: int, large: int) -> tuple[list[str], list[str]]:
    import boto3

    client = boto3.client("s3", endpoint_url=server.endpoints["moto"], region_name="us-east-1",
                          aws_access_key_id=KEY["key"], aws_secret_access_key=KEY["secret"])
    client.create_bucket(Bucket=BUCKET)
    rng = np.random.default_rng(0)
    small_keys = [f"small/{i}" for i in range(small)]
    large_keys = [f"large/{i}" for i in range(large)]
    for key, size in [(k, SMALL) for k in small_keys] + [(k, LARGE) for k in large_keys]:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=rng.bytes(size))
    return small_keys, large_keys


# ---- the two clients ----------------------------------------------------------------------------


class S3fsClient:
    def __init__(self, endpoint: str, prefix: str, concurrency: int, plain_gets: bool = False):
        self.store = FsspecChunkStore(f"s3://{BUCKET}/{prefix}", {"endpoint_url": endpoint, **KEY},
                                      concurrency=concurrency, plain_gets=plain_gets)

    def get_many(self, keys: list[str]) -> int:
        return sum(len(b or b"") for b in self.store.get_many(keys))

    def get_ranges(self, ranges: list[tuple[str, int, int]]) -> int:
        import fsspec.asyn

        store = self.store

        def one(key: str, start: int, end: int) -> Callable[[], Any]:
            path = store.path(key)
            return partial(store._call_async, f"read of {key!r}",
                           lambda: store.fs._cat_file(path, start=start, end=end, max_concurrency=1))

        found = fsspec.asyn.sync(store.fs.loop, store._gather_bounded, [one(*r) for r in ranges])
        return sum(len(b) for b in found)


class ObstoreClient:
    def __init__(self, endpoint: str, prefix: str, concurrency: int):
        from obstore.store import S3Store

        self.store = S3Store(BUCKET, prefix=prefix, endpoint=endpoint, access_key_id=KEY["key"],
                             secret_access_key=KEY["secret"], region="us-east-1",
                             client_options={"allow_http": True})
        self.concurrency = concurrency
        self.loop = asyncio.new_event_loop()

    def _bounded(self, makers: list[Callable[[], Any]]) -> list[Any]:
        async def run() -> list[Any]:
            gate = asyncio.Semaphore(self.concurrency)

            async def one(make: Callable[[], Any]) -> Any:
                async with gate:
                    return await make()

            return await asyncio.gather(*(one(m) for m in makers))

        return self.loop.run_until_complete(run())

    def get_many(self, keys: list[str]) -> int:
        import obstore

        async def one(key: str) -> int:
            result = await obstore.get_async(self.store, key)
            return len(await result.bytes_async())

        return sum(self._bounded([partial(one, k) for k in keys]))

    def get_ranges(self, ranges: list[tuple[str, int, int]]) -> int:
        import obstore

        async def one(key: str, start: int, end: int) -> int:
            return len(await obstore.get_range_async(self.store, key, start=start, end=end))

        return sum(self._bounded([partial(one, *r) for r in ranges]))

    def get_ranges_coalesced(self, ranges: list[tuple[str, int, int]]) -> int:
        import obstore

        by_key: dict[str, list[tuple[int, int]]] = {}
        for key, start, end in ranges:
            by_key.setdefault(key, []).append((start, end))

        async def one(key: str, spans: list[tuple[int, int]]) -> int:
            got = await obstore.get_ranges_async(self.store, key, starts=[s for s, _ in spans],
                                                 ends=[e for _, e in spans])
            return sum(len(b) for b in got)

        return sum(self._bounded([partial(one, k, v) for k, v in by_key.items()]))


# ---- measuring ----------------------------------------------------------------------------------


def measure(server: Server, contestants: dict[str, Callable[[], int]], rounds: int) -> dict[str, dict[str, float]]:
    """Per contestant: medians of seconds, CPU seconds, bytes and proxy requests per round."""
    samples: dict[str, list[tuple[float, float, int, int]]] = {name: [] for name in contestants}
    names = list(contestants)
    for name in names:  # warm-up: connections opened, pools filled
        contestants[name]()
    server.requests()
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cpu, wall = time.process_time(), time.perf_counter()
            nbytes = contestants[name]()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            samples[name].append((wall, cpu, nbytes, server.requests()))
    out = {}
    for name, rows in samples.items():
        wall, cpu, nbytes, reqs = (float(np.median([row[i] for row in rows])) for i in range(4))
        out[name] = {"s": wall, "MB/s": nbytes / wall / 1e6, "req/s": reqs / wall, "requests": reqs,
                     "cpu_s_per_GB": cpu / (nbytes / 1e9)}
    return out


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| pattern | client | time | MB/s | requests/s | requests | CPU s/GB | against s3fs: MB/s, CPU/GB |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for pattern, rows in results.items():
        base = rows["s3fs"]
        for name, row in rows.items():
            ratio = "" if name == "s3fs" else (f"**{row['MB/s'] / base['MB/s']:.2f}×** faster, "
                                               f"**{base['cpu_s_per_GB'] / row['cpu_s_per_GB']:.2f}×** less CPU")
            lines.append(f"| {pattern} | {name} | {row['s'] * 1e3:.0f} ms | {row['MB/s']:.0f} | {row['req/s']:.0f} | "
                         f"{row['requests']:.0f} | {row['cpu_s_per_GB']:.2f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer objects and rounds (a smoke test)")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args()
    started = time.perf_counter()
    small_n, rounds = (64, 3) if args.quick else (256, args.rounds)
    server = Server(args.latency_ms / 1e3)
    try:
        prefix = f"client-{uuid.uuid4().hex[:8]}"
        small, large = upload(server, prefix, small_n, 8)
        endpoint = server.endpoints["proxy"]
        S3fsClient(endpoint, prefix, 64).get_many(small + large)  # the proxy's copies
        rng = np.random.default_rng(1)
        starts = rng.integers(0, LARGE - RANGE, 256)
        ranges = [(large[i % len(large)], int(s), int(s) + RANGE) for i, s in enumerate(starts)]
        results: dict[str, dict[str, dict[str, float]]] = {}
        for n in (16, 32, 64):
            s3fs_c, plain_c = S3fsClient(endpoint, prefix, n), S3fsClient(endpoint, prefix, n, plain_gets=True)
            obs_c = ObstoreClient(endpoint, prefix, n)
            bl.log(f"small objects, {n} in flight")
            results[f"a. {len(small)} × 122 KB, {n} in flight"] = measure(
                server, {"s3fs": partial(s3fs_c.get_many, small), PLAIN: partial(plain_c.get_many, small),
                         "obstore": partial(obs_c.get_many, small)}, rounds)
        s3fs_c, obs_c = S3fsClient(endpoint, prefix, 256), ObstoreClient(endpoint, prefix, 256)
        plain_c = S3fsClient(endpoint, prefix, 256, plain_gets=True)
        bl.log("large objects")
        results["b. 8 × 5 MB, 8 in flight"] = measure(
            server, {"s3fs": partial(s3fs_c.get_many, large), PLAIN: partial(plain_c.get_many, large),
                     "obstore": partial(obs_c.get_many, large)}, rounds)
        bl.log("byte ranges")
        results["c. 256 × 4 KB ranges of 5 MB objects, 256 in flight"] = measure(
            server, {"s3fs": partial(s3fs_c.get_ranges, ranges), "obstore": partial(obs_c.get_ranges, ranges),
                     "obstore get_ranges (1 MB coalescing)": partial(obs_c.get_ranges_coalesced, ranges)}, rounds)
    finally:
        server.close()
    header = bl.report_header("Object-store client: s3fs, plain GETs and obstore", args.quick, PACKAGES, details=[
        f"moto + proxy on 127.0.0.1 in a child process, {args.latency_ms:g} ms per request, repeat GETs and ranges "
        f"served from the proxy's copy; median of {rounds} interleaved rounds after a warm-up round",
        "MB/s: bytes asked for per second; CPU s/GB: this process's CPU time (every thread) per GB asked for"])
    bl.publish_report(header, table(results), args.out, started)


if __name__ == "__main__":
    main()
