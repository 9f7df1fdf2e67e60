"""The object-storage benchmark's further peers: mosaic streaming (MDS shards) and Hugging Face
datasets (Parquet, streamed), written and read on the same S3 server as diskreplay and Lance.

Neither installs beside the project's test environment (each replaces its numpy or fsspec, and
mosaic streaming imports torchvision, whose PyPI wheel needs the torch of its own release), so
`tools/bench_cloud.py` measures them only where they import: a separate virtual environment
(docs/benchmarks.md gives its install command). `available()` names what is missing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

MDS_COLUMNS = {"obs": "ndarray:float32:17", "action": "ndarray:float32:6", "reward": "float32",
               "next_obs": "ndarray:float32:17", "done": "uint8"}


def available() -> dict[str, str | None]:
    """Each peer's name, and None where it imports, else why it does not."""
    found = {}
    for name, module in (("mosaic streaming", "streaming"), ("HF datasets", "datasets")):
        if importlib.util.find_spec(module) is None:
            found[name] = f"{module} is not installed"
            continue
        try:
            importlib.import_module(module)
            found[name] = None
        except Exception as exc:  # whatever stops the import: not measured
            found[name] = f"import {module} fails: {type(exc).__name__}: {exc}"
    return found


@contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """boto3's settings (mosaic streaming reads through boto3) pointed at ``endpoint``."""
    saved = {k: os.environ.get(k) for k in ("S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                            "AWS_DEFAULT_REGION")}
    os.environ.update({"S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def s3fs_options(endpoint: str) -> dict[str, Any]:
    return {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint}}


def arrow_column(arr: np.ndarray) -> Any:
    """A field's rows as an Arrow array: scalars as they are, vectors as fixed-size lists."""
    import pyarrow as pa

    return pa.array(arr) if arr.ndim == 1 else pa.FixedSizeListArray.from_arrays(pa.array(arr.ravel()), arr.shape[1])


def numpy_columns(batch: Any) -> list[np.ndarray]:
    """Every column of an Arrow record batch or table as numpy (fixed-size lists flattened)."""
    import pyarrow as pa

    columns = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in batch.columns]
    return [c.flatten().to_numpy() if hasattr(c, "flatten") else c.to_numpy(zero_copy_only=False) for c in columns]


# ---- mosaic streaming ---------------------------------------------------------------------


def write_mds(url: str, data: dict[str, np.ndarray], compression: str | None, endpoint: str) -> None:
    """The rows as MDS shards (mosaic's default 64 MB shard limit), written locally, then uploaded to ``url``."""
    import s3fs
    from streaming import MDSWriter

    local = tempfile.mkdtemp(prefix="mds-")
    try:
        with MDSWriter(out=local, columns=MDS_COLUMNS, compression=compression) as out:
            done = data["done"].astype(np.uint8)
            for i in range(len(data["obs"])):
                out.write({"obs": data["obs"][i], "action": data["action"][i], "reward": data["reward"][i],
                           "next_obs": data["next_obs"][i], "done": done[i]})
        fs = s3fs.S3FileSystem(**s3fs_options(endpoint))
        fs.put(local + "/", url.removeprefix("s3://") + "/", recursive=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _mds_dataset(url: str, batch: int, cache: str):
    from streaming import StreamingDataset

    return StreamingDataset(remote=url, local=cache, shuffle=False, batch_size=batch)


def _fresh_cache() -> str:
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    return tempfile.mkdtemp(prefix="mds-cache-")


def mds_epoch(url: str, endpoint: str, batch: int, rows: int) -> Callable[[], float]:
    """Seconds for a cold epoch of the ``rows`` rows at ``url``: a fresh local cache, a
    `StreamingDataset` in order through a DataLoader (``batch`` rows per batch, no workers),
    every column to numpy. (Stopping a larger dataset's epoch early would leave its download
    threads running into the next contestant's time.)"""
    from torch.utils.data import DataLoader

    def once() -> float:
        cache = _fresh_cache()
        try:
            with s3_environment(endpoint):
                started = time.perf_counter()
                got = 0
                for b in DataLoader(_mds_dataset(url, batch, cache), batch_size=batch, num_workers=0):
                    got += len([column.numpy() for column in b.values()][2])
                secs = time.perf_counter() - started
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        assert got == rows, (got, rows)
        return secs
    return once


def mds_opener(url: str, endpoint: str) -> Callable[[], Any]:
    """A freshly opened `StreamingDataset` (a fresh local cache) for random access by index."""
    def opener() -> Any:
        cache = _fresh_cache()
        with s3_environment(endpoint):
            ds = _mds_dataset(url, 256, cache)
        return _Cached(ds, cache, endpoint)
    return opener


class _Cached:
    """A `StreamingDataset` and its local cache, removed at `close`."""

    def __init__(self, ds: Any, cache: str, endpoint: str):
        self.ds, self.cache, self.endpoint = ds, cache, endpoint

    def take(self, rows: np.ndarray) -> list[dict]:
        with s3_environment(self.endpoint):
            return [self.ds[int(i)] for i in rows]

    def close(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)


# ---- Hugging Face datasets ----------------------------------------------------------------


def write_parquet(url: str, data: dict[str, np.ndarray], compression: str | None, endpoint: str) -> None:
    """The rows as one Parquet file (fixed-size lists; ``compression`` or none) at ``url``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import s3fs

    columns = {name: arrow_column(arr) for name, arr in data.items()}
    fs = s3fs.S3FileSystem(**s3fs_options(endpoint))
    with fs.open(url.removeprefix("s3://") + "/data.parquet", "wb") as f:
        pq.write_table(pa.table(columns), f, compression=compression or "none")


def hf_epoch(url: str, endpoint: str, batch: int, rows: int) -> Callable[[], float]:
    """Seconds for an epoch of `load_dataset("parquet", streaming=True)` from ``url``, ``batch``
    rows at a time as Arrow, every column to numpy."""
    import datasets

    def once() -> float:
        started = time.perf_counter()
        ds = datasets.load_dataset("parquet", data_files=url + "/data.parquet", split="train", streaming=True,
                                   storage_options=s3fs_options(endpoint)).with_format("arrow")
        got = 0
        for b in ds.iter(batch_size=batch):
            got += len(numpy_columns(b)[2])
        secs = time.perf_counter() - started
        assert got == rows, (got, rows)
        return secs
    return once
