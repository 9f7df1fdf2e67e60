"""Object-storage benchmark (issues #6 and #41): diskreplay vs Lance on the same S3 server, side by side.

The script starts its own S3 server: moto's ``ThreadedMotoServer`` in a child process on
127.0.0.1, plus (in the same child) the proxy of ``tests/s3server.py`` that adds a fixed latency
to every request (``--latency-ms``, default 20: real S3 answers in ~10-30 ms to first byte, and
that latency is what requests in flight hide). moto is one Python process whose CPU per request
caps any client at a few hundred GETs/s, unlike S3; so the proxy serves repeated GETs (ranged ones
too) from its own copy of each object. Every client is still cold: a freshly opened reader with
an empty cache, every byte fetched over HTTP. The proxy counts what each run fetches: GETs, body
bytes, and the most GETs in flight at once. Every workload runs one untimed round first (which
fills the proxy's copy), then ``--repeats`` rounds, the contestants in turns; medians reported.

Data: ``--rows`` rows of obs (17,) f32, action (6,) f32, reward f32, next_obs (17,) f32, done
bool (165 B per row), written once per ``--compression`` (raw, zstd) as a diskreplay dataset
(``--chunk-rows`` per chunk; by default the library's for each store: 32,768 rows on S3, 4,096 on
local disk) and as a Lance dataset (the same rows; fixed-size lists; zstd: Lance's
``lance-encoding:compression`` field metadata), both to S3 and to local disk.

Workloads (one table each):
1. epoch from S3: open + every row once, rows/s and MB/s (165 B per row): diskreplay
   ``Loader(make_dataset(url, B, mode="epoch"), num_workers=0 / 2)`` (default block shuffle; and
   in order, ``shuffle="none"``, the scanner's order; and the epochs of one ``Loader``, w0 and w2,
   kept from round to round as a training run keeps it, its caches filled by the earlier rounds) vs
   Lance ``dataset.to_batches(batch_size=B)`` (each column to numpy), ``B = --epoch-batch``;
2. cold random batches from S3: a freshly opened dataset, ``sample(256)`` (diskreplay) vs
   ``dataset.take(256 random rows)`` (Lance): the first batch's time, GETs and bytes (and
   bytes fetched per byte sampled), then the next 20 random batches;
3. local disk: the same cold first batch after every file of both stores was evicted from the
   page cache (fsync + ``POSIX_FADV_DONTNEED``), and a warm epoch (Loader w0 / w2, kept or fresh,
   vs the scan);
   ``--local-only`` runs this table alone (no S3 server);
4. diskreplay only (the last compression's dataset, through the proxy): cold ``sample(256)`` with
   1 request in flight, warm ``sample(256)`` (every chunk cached) vs the same on local disk, and a
   cold in-order pass reading ahead (``--read-ahead`` chunks per gather, ``--ahead-threads`` in
   flight) vs one chunk at a time.

Further peers, where they import (`tools/cloud_peers.py`; they do not install beside the test
environment, so docs/benchmarks.md gives a separate virtual environment for this run): mosaic
streaming (MDS shards of its default 64 MB limit, read by a `StreamingDataset` through a DataLoader
into a fresh local cache: the epoch of a dataset of the first ``--peer-epoch-rows`` rows, as its
per-row reads make a full epoch take minutes; cold random batches by index from all the rows)
and Hugging Face datasets (one Parquet file, `load_dataset(..., streaming=True)`, as Arrow
batches: the whole epoch).

Usage: python tools/bench_cloud.py [--quick] [--rows 2M] [--compression raw,zstd] [--local-only] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))

import benchlib as bl  # noqa: E402
import cloud_peers as peers  # noqa: E402

import diskreplay as dr  # noqa: E402

os.environ.setdefault("LANCE_LOG", "error")  # not "No existing dataset ..., it will be created"
# Lance's threads never run in the Loader's forked workers (they read diskreplay only).
warnings.filterwarnings("ignore", message="lance is not fork-safe")

FIELDS = {"obs": dr.Field((17,), "float32"), "action": dr.Field((6,), "float32"),
          "reward": dr.Field((), "float32"), "next_obs": dr.Field((17,), "float32"),
          "done": dr.Field((), "bool")}
ROW_BYTES = sum(f.row_bytes for f in FIELDS.values())
BUCKET = "bench"
SAMPLE = 256
NEXT_BATCHES = 20
PACKAGES = ["numpy", "zarr", "fsspec", "s3fs", "aiobotocore", "moto", "pylance", "pyarrow", "torch"]

SERVER_CODE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from s3server import FaultProxy, MotoS3
s3 = MotoS3(sys.argv[2])
proxy = FaultProxy(s3.endpoint, latency_s=float(sys.argv[3]), cache=True)
print(json.dumps({"loopback": s3.endpoint, "latency": proxy.endpoint}), flush=True)
for line in sys.stdin:  # serve until the parent closes our stdin; "reset" / "stats" lines
    with proxy.lock:
        stats = {"gets": sum(n for (m, _), n in proxy.hits.items() if m == "GET"), "bytes": proxy.bytes_out,
                 "in_flight": proxy.max_in_flight}
    if line.strip() == "reset":
        proxy.reset_stats()
    print(json.dumps(stats), flush=True)
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Server:
    """moto + the latency proxy in a child process; the proxy's counters on request."""

    def __init__(self, latency_s: float):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(ROOT / "tests"), BUCKET, str(latency_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the moto server did not start (is moto[server] installed?)")
        self.endpoints = json.loads(line)

    def _ask(self, command: str) -> dict[str, int]:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def reset(self) -> None:
        self._ask("reset")

    def stats(self) -> dict[str, int]:
        """GETs, body bytes and the most GETs in flight since the last `reset`."""
        return self._ask("stats")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def dr_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}


def lance_options(endpoint: str) -> dict[str, str]:
    return {"aws_endpoint": endpoint, "aws_access_key_id": "bench", "aws_secret_access_key": "bench",
            "aws_region": "us-east-1", "allow_http": "true"}


def make_data(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.standard_normal((rows + 1, 17), dtype=np.float32)
    return {"obs": obs[:-1], "action": rng.uniform(-1, 1, (rows, 6)).astype(np.float32),
            "reward": rng.standard_normal(rows, dtype=np.float32), "next_obs": obs[1:],
            "done": rng.random(rows) < 0.001}


def write_buffer(url: str, data: dict, chunk_rows: int | None, compression: str | None, so: dict | None,
                 row_shards: bool = True) -> int:
    """The rows as a diskreplay dataset at ``url`` (``chunk_rows`` None: the store's default);
    returns its rows per chunk."""
    buf = dr.ReplayBuffer.create(url, FIELDS, capacity=None, chunk_rows=chunk_rows, compression=compression,
                                 storage_options=so, io_threads=16, overwrite=True, row_shards=row_shards)
    chunk_rows = buf.storage.layout.chunk_rows
    step = 64 * chunk_rows
    for start in range(0, len(data["obs"]), step):
        buf.extend({k: v[start:start + step] for k, v in data.items()})
    buf.close()
    return chunk_rows


def write_lance(uri: str, data: dict, compression: str | None, so: dict | None) -> None:
    import lance
    import pyarrow as pa

    meta = {"lance-encoding:compression": compression} if compression else None
    columns, fields = [], []
    for name, arr in data.items():
        col = peers.arrow_column(arr)
        columns.append(col)
        fields.append(pa.field(name, col.type, metadata=meta))
    lance.write_dataset(pa.table(columns, schema=pa.schema(fields)), uri, storage_options=so, mode="overwrite")


READER_CACHE_BYTES = 2**30


def open_reader(url: str, so: dict | None, threads: int | None = None) -> dr.ReplayBuffer:
    """A reader of ``url`` with `READER_CACHE_BYTES` and ``threads`` (default: the store's, 16 on
    S3 and at most 4 on local disk, what a user gets)."""
    return dr.ReplayBuffer.open(url, "r", storage_options=so, io_threads=threads, cache_bytes=READER_CACHE_BYTES)


def open_lance(uri: str, so: dict | None):
    import lance

    return lance.dataset(uri, storage_options=so)


# ---- contestants: each call is one repeat; returns {"total": seconds, phase: value, ...} -----


def counted(server: Server | None, fn: Callable[[], float]) -> dict[str, float]:
    """``fn()``'s seconds, with the proxy's GETs, MB and in-flight high-water mark of the call."""
    if server is not None:
        server.reset()
    secs = fn()
    st = server.stats() if server is not None else {"gets": 0, "bytes": 0, "in_flight": 0}
    return {"total": secs, "gets": st["gets"], "mb": st["bytes"] / 1e6, "in_flight": st["in_flight"]}


def dr_epoch(url: str, so: dict | None, workers: int, batch: int, rows: int,
             server: Server | None, shuffle: str = "block") -> Callable[[], Any]:
    def once() -> float:
        started = time.perf_counter()
        ds = dr.make_dataset(url, batch, mode="epoch", seed=0, shuffle=shuffle, storage_options=so,
                             cache_bytes=READER_CACHE_BYTES)
        secs = timed_epoch(dr.Loader(ds, num_workers=workers), rows, started)
        ds.reader.get().close()
        return secs
    return lambda: counted(server, once)


def timed_epoch(loader: dr.Loader, rows: int, started: float) -> float:
    """Seconds from ``started`` until ``loader`` has given one epoch (asserted: ``rows`` rows)."""
    got = sum(len(b["index"]) for b in loader)
    secs = time.perf_counter() - started
    assert got == rows, (got, rows)
    return secs


class KeptEpochs:
    """Epochs of one `Loader` (``workers`` processes) kept from call to call: its readers' caches
    filled by the first calls (the untimed round), as a training run's later epochs find them.
    `close` stops its workers."""

    def __init__(self, url: str, so: dict | None, workers: int, batch: int, rows: int, server: Server | None):
        self.url, self.so, self.workers, self.batch, self.rows, self.server = url, so, workers, batch, rows, server
        self.loader: dr.Loader | None = None

    def __call__(self) -> dict[str, float]:
        return counted(self.server, self._once)

    def _once(self) -> float:
        if self.loader is None:
            self.loader = dr.Loader(dr.make_dataset(self.url, self.batch, mode="epoch", seed=0, storage_options=self.so,
                                                    cache_bytes=READER_CACHE_BYTES), num_workers=self.workers)
        return timed_epoch(self.loader, self.rows, time.perf_counter())

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader.dataset.reader.get().close()


def lance_epoch(uri: str, so: dict | None, batch: int, rows: int, server: Server | None) -> Callable[[], Any]:
    def once() -> float:
        started = time.perf_counter()
        got = 0
        for b in open_lance(uri, so).to_batches(batch_size=batch):
            got += len(peers.numpy_columns(b)[2])
        secs = time.perf_counter() - started
        assert got == rows, (got, rows)
        return secs
    return lambda: counted(server, once)


def cold_random(opener: Callable[[], Any], draw: Callable[[Any, int], Any], server: Server | None,
                evict: str | None = None) -> Callable[[], Any]:
    """A fresh dataset: the open, the first random batch (the timed total), the next ones."""
    round_, box = [0], []

    def once() -> dict[str, float]:
        if evict:
            bl.evict_page_cache(evict)
        r = round_[0] = round_[0] + 1
        opened = counted(server, lambda: bl.timed(lambda: box.append(opener()))[0])
        handle = box.pop()
        first = counted(server, lambda: bl.timed(lambda: draw(handle, 1000 * r))[0])
        rest = counted(server, lambda: bl.timed(
            lambda: [draw(handle, 1000 * r + i) for i in range(1, 1 + NEXT_BATCHES)])[0])
        if hasattr(handle, "close"):
            handle.close()
        return {**first, "open": opened["total"], "open_gets": opened["gets"], "next": rest["total"],
                "next_gets": rest["gets"], "next_mb": rest["mb"]}
    return once


def lance_take(rows: int) -> Callable[[Any, int], Any]:
    def draw(ds, seed: int):
        return ds.take(np.random.default_rng(seed).integers(0, rows, SAMPLE))
    return draw


def dr_sample(buf: dr.ReplayBuffer, seed: int):
    return buf.sample(SAMPLE, seed=seed)


# ---- the workloads ------------------------------------------------------------------------


def run_rounds(contestants: dict[str, Callable[[], Any]], repeats: int, what: str) -> dict[str, bl.Stats]:
    """Interleaved rounds of the contestants; then those that hold something (a ``close``) closed."""
    log(f"{what} ...")
    try:
        return bl.interleaved(contestants, repeats, warmup=1, progress=log)
    finally:
        for one in contestants.values():
            if hasattr(one, "close"):
                one.close()


def med(stats: bl.Stats, phase: str | None = None) -> float:
    return stats.median if phase is None else stats.phases[phase].median


def spread(stats: bl.Stats) -> str:
    """The median, and the range of the rounds when there were several."""
    text = bl.format_seconds(stats.median)
    if len(stats.samples) > 1:
        text += f" ({bl.format_seconds(stats.min)}–{bl.format_seconds(stats.max)})"
    return text


def rate(stats: bl.Stats, rows: int) -> str:
    per_s = rows / stats.median
    count = f"{per_s / 1e6:.2f}M" if per_s >= 1e6 else f"{per_s / 1e3:,.0f}k"
    return f"{count} rows/s ({per_s * ROW_BYTES / 1e6:,.0f} MB/s)"


def markdown(title: str, columns: list[str], rows: list[tuple[str, list[str], str]],
             ratio: str = "diskreplay / Lance") -> str:
    lines = [f"| {title} | " + " | ".join(columns) + f" | {ratio} |", "|---|" + "---:|" * (len(columns) + 1)]
    lines += [f"| {label} | " + " | ".join(cells) + f" | {ratio} |" for label, cells, ratio in rows]
    return "\n".join(lines)


def epoch_table(title: str, st: dict[str, bl.Stats], rows: int) -> tuple[str, dict]:
    w0, w2, ordered, ln = st["dr w0"], st["dr w2"], st["dr in order"], st["lance"]
    lr = rows / ln.median

    def counts(s: bl.Stats) -> str:
        return f"{med(s, 'gets'):,.0f} GETs, {med(s, 'mb'):,.0f} MB, ≤{med(s, 'in_flight'):.0f} in flight"

    table = markdown(title, ["diskreplay", "Lance"], [
        ("rows/s: `Loader` num_workers=0 vs the scanner", [rate(w0, rows), rate(ln, rows)],
         bl.format_ratio(rows / w0.median / lr)),
        ("rows/s: `Loader` num_workers=2 vs the scanner", [rate(w2, rows), rate(ln, rows)],
         bl.format_ratio(rows / w2.median / lr)),
        ("rows/s: in order (`shuffle=\"none\"`), num_workers=0, vs the scanner", [rate(ordered, rows),
                                                                                rate(ln, rows)],
         bl.format_ratio(rows / ordered.median / lr)),
        *kept_rows(st, ln, rows),
        ("requests per epoch (w0 / w2; scanner)", [f"{counts(w0)} / {counts(w2)}", counts(ln)], ""),
        ("requests per epoch of the kept `Loader` (w0 / w2)", [f"{counts(st['dr kept w0'])} / "
                                                              f"{counts(st['dr kept w2'])}", ""], ""),
    ])
    data = {k: {"rows_per_s": rows / s.median, "seconds": s.samples,
                **{p: med(s, p) for p in ("gets", "mb", "in_flight")}} for k, s in st.items()}
    return table, data


def kept_rows(st: dict[str, bl.Stats], scan: bl.Stats, rows: int) -> list[tuple[str, list[str], str]]:
    """The table rows of the kept loaders' epochs against the scanner."""
    return [(f"epoch of a `Loader` kept from the epoch before (its cache filled), num_workers={w}, vs the scanner",
             [rate(kept, rows), rate(scan, rows)], bl.format_ratio(scan.median / kept.median))
            for w, kept in ((0, st["dr kept w0"]), (2, st["dr kept w2"]))]


def random_table(title: str, st: dict[str, bl.Stats]) -> tuple[str, dict]:
    d, ln = st["dr"], st["lance"]
    sampled = SAMPLE * ROW_BYTES / 1e6

    def per_byte(s: bl.Stats) -> float:
        return med(s, "mb") / sampled
    table = markdown(title, ["diskreplay `sample(256)`", "Lance `take(256 rows)`"], [
        ("open (fresh dataset)", [f"{bl.format_seconds(med(s, 'open'))}, {med(s, 'open_gets'):,.0f} GETs"
                                  for s in (d, ln)],
         bl.format_ratio(med(d, "open") / med(ln, "open"))),
        ("first batch", [spread(s) for s in (d, ln)],
         bl.format_ratio(d.median / ln.median)),
        ("first batch: GETs, MB fetched", [f"{med(s, 'gets'):,.0f}, {med(s, 'mb'):.2f} MB" for s in (d, ln)],
         bl.format_ratio(med(d, "gets") / max(1.0, med(ln, "gets")))),
        ("bytes fetched per byte sampled (first batch)", [f"{per_byte(s):,.0f}" for s in (d, ln)],
         bl.format_ratio(per_byte(d) / max(1e-9, per_byte(ln)))),
        (f"next {NEXT_BATCHES} random batches (all {NEXT_BATCHES})",
         [f"{spread(s.phases['next'])}, {med(s, 'next_gets'):,.0f} GETs" for s in (d, ln)],
         bl.format_ratio(med(d, "next") / med(ln, "next"))),
    ])
    data = {k: {"first_s": s.samples, **{p: med(s, p) for p in s.phases}} for k, s in st.items()}
    return table, data


def peers_table(title: str, ep: dict[str, bl.Stats], cold: dict[str, bl.Stats], rows: int,
                peer_rows: int) -> tuple[str, dict]:
    """mosaic streaming and HF datasets (those measured) against diskreplay's in-order epoch and
    cold random batches."""
    ordered, lines, data = ep["dr in order"], [], {}
    if "mosaic" in ep:
        mosaic, m_cold, d_cold = ep["mosaic"], cold["mosaic"], cold["dr"]
        lines += [
            (f"epoch rows/s: mosaic `StreamingDataset` (a dataset of the first {bl.format_count(peer_rows)} rows) vs "
             "diskreplay in order", [rate(mosaic, peer_rows), rate(ordered, rows)],
             bl.format_ratio(rows / ordered.median / (peer_rows / mosaic.median))),
            ("cold random batch of 256: mosaic `dataset[i]` vs diskreplay `sample(256)`, first batch",
             [f"{spread(m_cold)}, {med(m_cold, 'mb'):.1f} MB", f"{spread(d_cold)}, {med(d_cold, 'mb'):.2f} MB"],
             bl.format_ratio(d_cold.median / m_cold.median)),
            (f"cold random: the next {NEXT_BATCHES} batches", [spread(m_cold.phases["next"]),
                                                              spread(d_cold.phases["next"])],
             bl.format_ratio(med(d_cold, "next") / med(m_cold, "next"))),
        ]
        data["mosaic"] = {"epoch_rows_per_s": peer_rows / mosaic.median, "epoch_rows": peer_rows,
                          "first_s": m_cold.samples, **{p: med(m_cold, p) for p in m_cold.phases}}
    if "hf" in ep:
        hf = ep["hf"]
        lines.append(("epoch rows/s: HF datasets `load_dataset(parquet, streaming=True)` vs diskreplay in order",
                      [rate(hf, rows), rate(ordered, rows)], bl.format_ratio(hf.median / ordered.median)))
        data["hf"] = {"epoch_rows_per_s": rows / hf.median, "gets": med(hf, "gets"), "mb": med(hf, "mb")}
    return markdown(title, ["peer", "diskreplay"], lines, ratio="diskreplay / peer"), data


def local_table(title: str, cold: dict[str, bl.Stats], ep: dict[str, bl.Stats], rows: int) -> tuple[str, dict]:
    d, ln = cold["dr"], cold["lance"]
    w0, w2, ordered, scan = ep["dr w0"], ep["dr w2"], ep["dr in order"], ep["lance"]
    table = markdown(title, ["diskreplay", "Lance"], [
        ("cold first random batch (page cache evicted); the open before it",
         [f"{spread(s)}; open {bl.format_seconds(med(s, 'open'))}" for s in (d, ln)],
         bl.format_ratio(d.median / ln.median)),
        (f"next {NEXT_BATCHES} random batches (all {NEXT_BATCHES})", [spread(s.phases["next"]) for s in (d, ln)],
         bl.format_ratio(med(d, "next") / med(ln, "next"))),
        ("epoch (warm), `Loader` num_workers=0 vs the scanner", [rate(w0, rows), rate(scan, rows)],
         bl.format_ratio(scan.median / w0.median)),
        ("epoch (warm), `Loader` num_workers=2 vs the scanner", [rate(w2, rows), rate(scan, rows)],
         bl.format_ratio(scan.median / w2.median)),
        ("epoch (warm) in order (`shuffle=\"none\"`), num_workers=0, vs the scanner",
         [rate(ordered, rows), rate(scan, rows)], bl.format_ratio(scan.median / ordered.median)),
        *kept_rows(ep, scan, rows),
        ("epoch, `Loader` num_workers=2 / num_workers=0", [bl.format_ratio(w0.median / w2.median), ""], ""),
    ])
    data = {"cold": {k: {"first_s": s.samples, **{p: med(s, p) for p in s.phases}} for k, s in cold.items()},
            "epoch": {k: {"rows_per_s": rows / s.median, "seconds": s.samples} for k, s in ep.items()}}
    return table, data


def warm(buf: dr.ReplayBuffer, rows: int, chunk_rows: int) -> None:
    """Every row read once, then up to 30 s for the reader to settle: a cache that holds the
    whole window is rearranged behind the reads (`stats().resident`)."""
    for start in range(0, rows, 32 * chunk_rows):
        buf[np.arange(start, min(rows, start + 32 * chunk_rows))]
    deadline = time.monotonic() + 30
    while not buf.storage.stats().resident and time.monotonic() < deadline:
        time.sleep(0.05)


def sequential(url: str, so: dict, chunk_rows: int, rows: int, threads: int, per_gather: int) -> Callable[[], float]:
    """Seconds for a cold in-order pass over the first ``rows`` rows, ``per_gather`` chunks per read."""

    def once() -> float:
        buf = open_reader(url, so, threads)
        started = time.perf_counter()
        for start in range(0, rows, per_gather * chunk_rows):
            buf[np.arange(start, min(rows, start + per_gather * chunk_rows))]
        secs = time.perf_counter() - started
        buf.close()
        return secs
    return once


def extras(url: str, local: str, so: dict, args: argparse.Namespace, rows: int, repeats: int,
           comp: str, chunk_rows: int) -> tuple[str, dict]:
    """The diskreplay-only measurements on the ``comp`` dataset (``chunk_rows`` per chunk on S3):
    in flight, warm vs local, read-ahead."""
    def first_batch(threads: int) -> Callable[[], float]:
        def once() -> float:
            buf = open_reader(url, so, threads)
            secs, _ = bl.timed(lambda: buf.sample(SAMPLE, seed=int(time.time_ns() % 2**31)))
            buf.close()
            return secs
        return once
    cold = run_rounds({"1": first_batch(1), "16": first_batch(16)}, max(1, repeats - 2),
                      "diskreplay: cold sample(256), 1 vs 16 requests in flight")
    chunks = min(-(-rows // chunk_rows), args.seq_chunks)
    first = min(rows, chunks * chunk_rows)
    seq = run_rounds({"ahead": sequential(url, so, chunk_rows, first, args.ahead_threads, args.read_ahead),
                      "one": sequential(url, so, chunk_rows, first, 1, 1)}, max(1, repeats - 2),
                     f"diskreplay: in-order pass over {chunks} chunks, read-ahead vs one chunk at a time")
    hot_st = warm_samples(url, local, so, rows, chunk_rows, repeats)
    mb = first * ROW_BYTES / 1e6
    ahead, one = seq["ahead"].median, seq["one"].median
    warm_row = ("warm `sample(256)` (every chunk cached) vs the same on local disk, warm",
                [bl.format_seconds(hot_st["s3"].median), bl.format_seconds(hot_st["local"].median)],
                bl.format_ratio(hot_st["s3"].median / hot_st["local"].median)) if hot_st else (
        f"warm `sample(256)`: not measured (the rows exceed the readers' {READER_CACHE_BYTES >> 20} MiB cache)",
        ["", ""], "")
    table = markdown(f"diskreplay alone ({comp}, through the proxy)", ["measured", "against"], [
        ("cold `sample(256)`, 16 vs 1 request in flight (`io_threads`)",
         [bl.format_seconds(cold["16"].median), bl.format_seconds(cold["1"].median)],
         bl.format_ratio(cold["16"].median / cold["1"].median)),
        warm_row,
        (f"cold in-order pass, reading ahead ({args.read_ahead} chunks per gather, {args.ahead_threads} in flight) "
         "vs one chunk at a time", [f"{mb / ahead:.1f} MB/s", f"{mb / one:.1f} MB/s"], bl.format_ratio(one / ahead)),
    ], ratio="measured / against")
    data = {"cold_16_s": cold["16"].median, "cold_1_s": cold["1"].median,
            "warm_s3_s": hot_st["s3"].median if hot_st else None,
            "warm_local_s": hot_st["local"].median if hot_st else None,
            "read_ahead_mb_s": mb / ahead, "one_chunk_mb_s": mb / one}
    return table, data


def warm_samples(url: str, local: str, so: dict, rows: int, chunk_rows: int, repeats: int) -> dict | None:
    """``sample(256)`` of a reader holding every row in its cache, from S3 and from local disk
    (None: the rows do not fit the readers' cache, so every sample would go to the store)."""
    if rows * ROW_BYTES > READER_CACHE_BYTES:
        return None
    remote, loc = open_reader(url, so), open_reader(local, None)
    warm(remote, rows, chunk_rows)
    warm(loc, rows, chunk_rows)
    n = 1000

    def hot(buf):
        return lambda: [buf.sample(SAMPLE) for _ in range(n)] and None
    try:
        return bl.interleaved({"s3": hot(remote), "local": hot(loc)}, repeats, number=n, warmup=1)
    finally:
        remote.close()
        loc.close()


def mosaic_rows(args: argparse.Namespace, rows: int) -> int:
    """The rows of mosaic streaming's timed epoch: ``--peer-epoch-rows``, at most ``rows``."""
    return min(rows, args.peer_epoch_rows)


def peer_contestants(comp: str, data: dict, server: Server, args: argparse.Namespace,
                     rows: int) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
    """The epoch and cold-random contestants of the peers that import, their datasets written to S3."""
    found = peers.available()
    codec = None if comp == "raw" else comp
    loopback, latency = server.endpoints["loopback"], server.endpoints["latency"]
    epochs: dict[str, Callable[[], Any]] = {}
    randoms: dict[str, Callable[[], Any]] = {}
    if found["mosaic streaming"] is None:
        mds, head, n = f"s3://{BUCKET}/mds-{comp}", f"s3://{BUCKET}/mds-head-{comp}", mosaic_rows(args, rows)
        log(f"[{comp}] writing the MDS datasets (all rows; the first {n:,} for the epoch) ...")
        peers.write_mds(mds, data, codec, loopback)
        peers.write_mds(head, {k: v[:n] for k, v in data.items()}, codec, loopback)
        epochs["mosaic"] = lambda: counted(server, peers.mds_epoch(head, latency, args.epoch_batch, n))
        randoms["mosaic"] = cold_random(peers.mds_opener(mds, latency), lance_take(rows), server)
    if found["HF datasets"] is None:
        parquet = f"s3://{BUCKET}/parquet-{comp}"
        peers.write_parquet(parquet, data, codec, loopback)
        epochs["hf"] = lambda: counted(server, peers.hf_epoch(parquet, latency, args.epoch_batch, rows))
    return epochs, randoms


def one_compression(comp: str, data: dict, server: Server | None, tmp: str, args: argparse.Namespace,
                    repeats: int) -> tuple[list[str], dict]:
    """The tables of one compression: on S3 (unless ``server`` is None), then on local disk."""
    codec = None if comp == "raw" else comp
    rows = len(data["obs"])
    local, local_lance = os.path.join(tmp, f"dr-{comp}"), os.path.join(tmp, f"lance-{comp}")
    log(f"[{comp}] writing diskreplay and Lance datasets on local disk ...")
    chunk_rows = {"local": write_buffer(local, data, args.chunk_rows, codec, None, args.row_shards)}
    write_lance(local_lance, data, codec, None)
    tables, out = [], {"chunk_rows": chunk_rows, "urls": [None, None, local, local_lance]}
    if server is not None:
        tables, s3 = s3_tables(comp, data, server, args, repeats)
        chunk_rows["s3"] = s3.pop("chunk_rows")
        out = {**s3, **out, "urls": [*s3.pop("urls"), local, local_lance]}
    b, tag = args.epoch_batch, f"{comp}, {bl.format_count(rows)} rows"
    lcold = run_rounds({"dr": cold_random(lambda: open_reader(local, None), dr_sample, None, evict=local),
                        "lance": cold_random(lambda: open_lance(local_lance, None), lance_take(rows), None,
                                             evict=local_lance)}, repeats, f"[{comp}] local disk, cold random")
    lep = run_rounds({"dr w0": dr_epoch(local, None, 0, b, rows, None),
                       "dr w2": dr_epoch(local, None, 2, b, rows, None),
                       "dr in order": dr_epoch(local, None, 0, b, rows, None, "none"),
                       "dr kept w0": KeptEpochs(local, None, 0, b, rows, None),
                       "dr kept w2": KeptEpochs(local, None, 2, b, rows, None),
                       "lance": lance_epoch(local_lance, None, b, rows, None)}, repeats, f"[{comp}] local disk, epoch")
    t3, out["local"] = local_table(f"local disk ({tag})", lcold, lep, rows)
    return [*tables, t3], out


def s3_tables(comp: str, data: dict, server: Server, args: argparse.Namespace, repeats: int) -> tuple[list[str], dict]:
    """Epochs and cold random batches from S3, diskreplay and Lance (and the further peers)."""
    codec = None if comp == "raw" else comp
    rows = len(data["obs"])
    url, uri = f"s3://{BUCKET}/dr-{comp}", f"s3://{BUCKET}/lance-{comp}"
    log(f"[{comp}] writing diskreplay and Lance datasets on S3 ...")
    chunk_rows = write_buffer(url, data, args.chunk_rows, codec, dr_options(server.endpoints["loopback"]),
                              args.row_shards)
    log(f"[{comp}] diskreplay chunks: {chunk_rows:,} rows on S3")
    write_lance(uri, data, codec, lance_options(server.endpoints["loopback"]))
    so, lso = dr_options(server.endpoints["latency"]), lance_options(server.endpoints["latency"])
    b = args.epoch_batch
    tag = f"{comp}, {bl.format_count(rows)} rows"
    epochs, randoms = peer_contestants(comp, data, server, args, rows)
    ep = run_rounds({"dr w0": dr_epoch(url, so, 0, b, rows, server), "dr w2": dr_epoch(url, so, 2, b, rows, server),
                      "dr in order": dr_epoch(url, so, 0, b, rows, server, "none"),
                      "dr kept w0": KeptEpochs(url, so, 0, b, rows, server),
                      "dr kept w2": KeptEpochs(url, so, 2, b, rows, server),
                      "lance": lance_epoch(uri, lso, b, rows, server), **epochs}, repeats, f"[{comp}] epoch from S3")
    t1, d1 = epoch_table(f"epoch from S3 ({tag}, batches of {b})", ep, rows)
    cold = run_rounds({"dr": cold_random(lambda: open_reader(url, so), dr_sample, server),
                       "lance": cold_random(lambda: open_lance(uri, lso), lance_take(rows), server), **randoms},
                      repeats, f"[{comp}] cold random batches from S3")
    t2, d2 = random_table(f"cold random batches of 256 from S3 ({tag})", cold)
    if epochs:
        tp, dp = peers_table(f"further peers on S3 ({tag})", ep, cold, rows, mosaic_rows(args, rows))
        t2, d2 = t2 + "\n\n" + tp, {**d2, "peers": dp}
    return [t1, t2], {"epoch_s3": d1, "random_s3": d2, "chunk_rows": chunk_rows, "urls": [url, uri]}


def skipped_peers() -> str:
    """What the report says of the further peers."""
    missing = {name: why for name, why in peers.available().items() if why is not None}
    if not missing:
        return "further peers: mosaic streaming and HF datasets"
    return ("further peers not measured (they install in a separate virtual environment, see "
            "docs/benchmarks.md): " + "; ".join(f"{name}: {why}" for name, why in missing.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a small smoke run (about two minutes)")
    p.add_argument("--rows", type=bl.parse_count, default=None, help="rows (default 2M; --quick 40k), e.g. 20M")
    p.add_argument("--compression", default="raw,zstd", help="comma-separated: raw, zstd")
    p.add_argument("--chunk-rows", type=int, default=None,
                   help="rows per diskreplay chunk (default: the library's default for each store)")
    p.add_argument("--no-row-shards", dest="row_shards", action="store_false",
                   help="diskreplay buffers created with row_shards=False (compressed chunks of small rows: one frame)")
    p.add_argument("--epoch-batch", type=int, default=1024, help="rows per batch in the epochs")
    p.add_argument("--latency-ms", type=float, default=20.0, help="latency the proxy adds per request")
    p.add_argument("--read-ahead", type=int, default=32, help="chunks per gather in the read-ahead pass")
    p.add_argument("--ahead-threads", type=int, default=32, help="requests in flight in the read-ahead pass")
    p.add_argument("--seq-chunks", type=int, default=64, help="chunks read by the in-order passes")
    p.add_argument("--peer-epoch-rows", type=bl.parse_count, default=100_000,
                   help="rows of mosaic streaming's epoch dataset (its per-row reads: 2M rows take minutes)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds per workload (default 3; --quick 1)")
    p.add_argument("--local-only", action="store_true", help="only the local disk tables (no S3 server)")
    p.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = p.parse_args()
    if importlib.util.find_spec("lance") is None:
        print("bench_cloud: skipped: it measures diskreplay against Lance, and pylance is not installed "
              "(pip install pylance)", flush=True)
        return
    rows = args.rows or (40_000 if args.quick else 2_000_000)
    repeats = args.repeats or (1 if args.quick else 3)
    comps = [c.strip() for c in args.compression.split(",") if c.strip()]
    if not comps or set(comps) - {"raw", "zstd"}:
        p.error(f"--compression takes raw and/or zstd, not {args.compression!r}")

    where = ("local disk only" if args.local_only else
             f"moto {bl.package_versions(['moto'])['moto']} in a child process on 127.0.0.1 behind a proxy adding "
             f"{args.latency_ms:g} ms per request (repeat GETs served from its copy)")
    header = bl.report_header("diskreplay object-storage benchmark (vs Lance)", args.quick, PACKAGES, details=[
        f"workload: {rows:,} rows x {ROW_BYTES} B ({rows * ROW_BYTES / 1e6:,.0f} MB), diskreplay chunks of "
        f"{f'{args.chunk_rows} rows' if args.chunk_rows else 'the default rows for each store'}"
        f"{'' if args.row_shards else ' (row_shards=False)'}; {', '.join(comps)}; {where}; "
        f"{repeats} timed round(s) after one untimed, medians", *([] if args.local_only else [skipped_peers()])])
    print(header + "\n", flush=True)
    started = time.perf_counter()
    server = None if args.local_only else Server(args.latency_ms / 1000)
    tmp = tempfile.mkdtemp(prefix="diskreplay-cloud-")
    tables: list[str] = []
    results: dict[str, Any] = {"rows": rows, "row_bytes": ROW_BYTES, "latency_ms": args.latency_ms,
                               "repeats": repeats, "epoch_batch": args.epoch_batch, "command": bl.command_line()}
    try:
        data = make_data(rows, seed=0)
        for comp in comps:
            got, results[comp] = one_compression(comp, data, server, tmp, args, repeats)
            tables += got
        del data
        url, _, local, _ = results[comps[-1]].pop("urls")
        if server is not None:
            extra, results["diskreplay_alone"] = extras(url, local, dr_options(server.endpoints["latency"]), args,
                                                        rows, repeats, comps[-1],
                                                        results[comps[-1]]["chunk_rows"]["s3"])
            tables.append(extra)
        for comp in comps:
            results[comp].pop("urls", None)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
            log(f"results written to {args.out}")
        bl.publish_report(header, "\n\n".join(tables), None, started)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
