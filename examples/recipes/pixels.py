"""Pixels: Atari-like 84x84 uint8 frames, frame stacks, compression and the cache size.

    python examples/recipes/pixels.py                      # 2,000 synthetic frames, in a temp dir
    python examples/recipes/pixels.py --frames 100000 --workdir runs/pixels --cache-mib 256

Writes the same frames into one buffer per codec (none, lz4, lz4hc, zstd), prints the bytes each
stores for ``obs`` and the ratio to the raw frames, then samples frame stacks from each buffer
opened with a cache of ``--cache-mib`` MiB and prints what the storage did (``buf.stats()``).
``next_obs`` is not stored (``derive_next=("obs",)``: it is the next step's ``obs``), and stacks
are not stored either: ``sample(32, stack=4)`` gathers each row's last 4 frames.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import numpy as np

import diskreplay as dr

FRAME = (84, 84)
CODECS = (None, "lz4", "lz4hc", "zstd")


def synthetic_frames(n: int, seed: int = 0) -> np.ndarray:
    """``n`` frames like a simple Atari game: a flat background, a floor, a moving 6x6 sprite and
    2% salt noise (real games compress less well than these; 3-6x with zstd)."""
    rng = np.random.default_rng(seed)
    frames = np.full((n, *FRAME), 40, np.uint8)
    frames[:, 70:74, :] = 120
    for t in range(n):
        y, x = 10 + (2 * t) % 50, 10 + (3 * t) % 60
        frames[t, y:y + 6, x:x + 6] = 220
    frames[rng.random(frames.shape) < 0.02] = 255
    return frames


def write(url: str, frames: np.ndarray, compression: str | None, episode: int = 500) -> None:
    """One step per frame (the last frame is only a ``next_obs``), episodes of ``episode`` steps."""
    steps = len(frames) - 1
    fields = {"obs": dr.Field(FRAME, "uint8"), "next_obs": dr.Field(FRAME, "uint8"),
              "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
              "terminated": dr.Field((), "bool"), "truncated": dr.Field((), "bool")}
    with dr.ReplayBuffer.create(url, fields, capacity=None, compression=compression, derive_next=("obs",),
                                seed=0, overwrite=True) as buf:
        buf.extend({"obs": frames[:-1], "next_obs": frames[1:], "action": np.arange(steps) % 4,
                    "reward": np.zeros(steps, np.float32), "terminated": np.arange(steps) % episode == episode - 1,
                    "truncated": np.zeros(steps, bool)})


def stored_bytes(url: str, field: str = "obs") -> int:
    """Bytes of the field's chunk files (a local buffer: one folder per field)."""
    return sum(os.path.getsize(os.path.join(folder, name))
               for folder, _, names in os.walk(os.path.join(url, field)) for name in names)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frames", type=int, default=2001, help="frames written (steps + 1)")
    p.add_argument("--cache-mib", type=int, default=4, help="the readers' cache_bytes, MiB")
    p.add_argument("--workdir", help="where the buffers go (default: a temp dir, removed at the end)")
    args = p.parse_args(argv)
    frames = synthetic_frames(args.frames)
    with tempfile.TemporaryDirectory(prefix="pixels-") as tmp:
        workdir = args.workdir or tmp
        raw = frames[:-1].nbytes
        print(f"{len(frames) - 1:,} steps of {FRAME[0]}x{FRAME[1]} uint8 frames: {raw:,} bytes raw")
        for codec in CODECS:
            url = os.path.join(workdir, f"frames-{codec or 'none'}")
            write(url, frames, codec)
            size = stored_bytes(url)
            print(f"{codec or 'none':6s} obs stored in {size:>12,} bytes ({raw / size:5.2f}x)")
        for codec in CODECS:
            with dr.ReplayBuffer.open(os.path.join(workdir, f"frames-{codec or 'none'}"),
                                      cache_bytes=args.cache_mib << 20) as buf:
                batch = buf.sample(32, stack=4)
                buf.warm()  # the fill the first read started, finished: the reads below do not race it
                for _ in range(9):
                    batch = buf.sample(32, stack=4)
                s = buf.stats()
                print(f"{codec or 'none':6s} stack batch obs {batch['obs'].shape}, next_obs {batch['next_obs'].shape}; "
                      f"resident {s.resident}, mapped {s.mapped} ({s.maps} files), frames row by row "
                      f"{bool(s.row_fields)}, chunks loaded {s.chunks_loaded}, cached {s.cached_chunks}")


if __name__ == "__main__":
    main()
