"""Device path benchmark (issue #5): batches per second reaching a CUDA device, by route.

Routes, over the same buffer (local, uncompressed), batch 256, ``sample`` mode:
- ``plain .to()``: iterate the dataset, ``{k: v.to(device)}`` (pageable memory, synchronous);
- ``DataLoader pin_memory``: ``DataLoader(ds, num_workers=0, pin_memory=True)`` then
  ``.to(device, non_blocking=True)`` (torch pins a fresh buffer per batch);
- ``to_device(loader)``: a DataLoader (num_workers=0) into `dr.to_device` (one host copy into the
  pinned slot ring);
- ``to_device(ds)``: the dataset itself into `dr.to_device` (rows gathered straight into the slots).
The consumer runs a stand-in training step (``--matmuls`` 2048² products, launched asynchronously)
on each batch, so routes that overlap loading with the GPU's work gain. Needs CUDA.

Usage: python tools/bench_device.py [--rows 200000] [--obs 84x84] [--batches 2000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

import diskreplay as dr


def build(path: str, rows: int, obs_shape: tuple[int, ...]) -> dr.ReplayBuffer:
    obs_dtype = "uint8" if len(obs_shape) > 1 else "float32"
    fields = {"obs": dr.Field(obs_shape, obs_dtype), "action": dr.Field((6,), "float32"),
              "reward": dr.Field((), "float32"), "done": dr.Field((), "bool")}
    buf = dr.ReplayBuffer.create(path, fields, None, chunk_rows=4096, compression=None)
    rng = np.random.default_rng(0)
    for start in range(0, rows, 50_000):
        n = min(50_000, rows - start)
        buf.extend({"obs": rng.integers(0, 255, (n, *obs_shape)).astype(obs_dtype),
                    "action": rng.standard_normal((n, 6), dtype=np.float32),
                    "reward": rng.standard_normal(n, dtype=np.float32), "done": rng.random(n) < 0.01})
    buf.flush()
    return buf


class TrainStep:
    """A stand-in for a training step: ``matmuls`` 2048² fp32 products on the GPU, launched
    asynchronously (as a real step is), plus a use of the batch."""

    def __init__(self, matmuls: int):
        self.x = torch.randn(2048, 2048, device="cuda")
        self.matmuls = matmuls

    def __call__(self, batch) -> torch.Tensor:
        y = self.x
        for _ in range(self.matmuls):
            y = torch.tanh(y @ self.x)
        return y[0, 0] + batch["reward"].sum() + batch["obs"].float().mean()

    def seconds(self, count: int = 50) -> float:
        self(_fake_batch()).item()
        start = time.perf_counter()
        for _ in range(count):
            out = self(_fake_batch())
        out.item()
        return (time.perf_counter() - start) / count


def _fake_batch() -> dict[str, torch.Tensor]:
    return {"reward": torch.zeros(256, device="cuda"), "obs": torch.zeros(256, 1, device="cuda")}


def timed(batches, count: int, step: TrainStep) -> float:
    it = iter(batches)
    for _ in range(20):  # warm-up
        step(next(it))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        out = step(next(it))
    out.item()
    return count / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--obs", default="84x84", help="obs shape, e.g. 17 or 84x84 (uint8)")
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--matmuls", type=int, default=4, help="GPU work per training step (0: none)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_device: skipped, no CUDA device here")
        return
    obs_shape = tuple(int(x) for x in args.obs.split("x"))
    path = os.path.join(tempfile.mkdtemp(), "buf")
    buf = build(path, args.rows, obs_shape)

    def ds():
        return buf.as_dataset(batch_size=256, mode="sample", seed=0)

    def plain():
        for b in ds():
            yield {k: v.to("cuda") for k, v in b.items()}

    def pinned_loader():
        for b in DataLoader(ds(), batch_size=None, num_workers=0, pin_memory=True):
            yield {k: v.to("cuda", non_blocking=True) for k, v in b.items()}

    routes = {
        "plain .to()": plain,
        "DataLoader pin_memory": pinned_loader,
        "to_device(loader)": lambda: dr.to_device(DataLoader(ds(), batch_size=None, num_workers=0), "cuda"),
        "to_device(ds)": lambda: dr.to_device(ds(), "cuda"),
    }
    row_bytes = sum(f.row_bytes for f in buf.fields.values())
    step = TrainStep(args.matmuls)
    print(f"# device path: {torch.cuda.get_device_name()}, obs {obs_shape}, {row_bytes} B/row, "
          f"batch 256 ({row_bytes * 256 / 2**20:.2f} MiB), {args.rows:,} rows; training step alone "
          f"{step.seconds() * 1e3:.2f} ms on the GPU ({args.matmuls} matmuls)\n")
    print("| route | batches/s | ratio vs plain .to() |\n|---|---:|---:|")
    base = None
    for name, make in routes.items():
        rate = max(timed(make(), args.batches, step) for _ in range(3))
        base = base or rate
        print(f"| {name} | {rate:,.0f} | {rate / base:.2f}× |")
    buf.close()


if __name__ == "__main__":
    main()
