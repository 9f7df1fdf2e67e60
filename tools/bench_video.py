"""Encoded frames (issue #44): bytes per frame and random reads of camera-like frames stored as
video (AV1, H.264: one group of pictures per row chunk of a lane), as PNG or JPEG images, and
as LZ4-compressed raw frames.

The frames: a smooth textured background panning slowly, a soft bright blob circling over it,
and faint sensor noise (`camera_frames`), at 96x96 and 480x640 RGB.

The codec level (`codec_table`) encodes ``--frames`` frames in chunks of ``--chunk-rows``
(video: one stream per chunk, as a writer stores them) and times a cold ``sample(32)``: 32
random frames, each from its own chunk, decoded by ``--threads`` threads (video: the whole
chunk up to the end; images: the 32 frames; LZ4: the 32 frames' blocks). A warm read finds the
decoded frames in the cache and only gathers them.

Usage: python tools/bench_video.py [--frames 512] [--chunk-rows 32] [--threads 2] [--sizes 96x96,480x640]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lz4.block
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl

from diskreplay.format.frame_codecs import FrameCodec

CODECS = ("lz4", "png", "jpeg", "h264", "av1")
log = bl.log


def camera_frames(n: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """``n`` camera-like RGB frames: smooth texture panning, a soft blob moving, sensor noise."""
    rng = np.random.default_rng(seed)
    cell = max(height, width) // 6
    grid = rng.random((height // cell + 3, width // cell + 3 + n // cell + 1, 3))
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((n, height, width, 3), np.uint8)
    for t in range(n):
        gy, gx = y / cell, (x + t * 0.5) / cell
        y0, x0 = gy.astype(int), gx.astype(int)
        fy, fx = (gy - y0)[..., None], (gx - x0)[..., None]
        background = ((grid[y0, x0] * (1 - fx) + grid[y0, x0 + 1] * fx) * (1 - fy)
                      + (grid[y0 + 1, x0] * (1 - fx) + grid[y0 + 1, x0 + 1] * fx) * fy)
        cx, cy = width * (0.5 + 0.3 * np.cos(t / 12)), height * (0.5 + 0.3 * np.sin(t / 12))
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * (min(height, width) / 10) ** 2))[..., None]
        frame = 40 + 170 * background * (1 - blob) + 230 * blob * np.array([0.9, 0.6, 0.3])
        out[t] = np.clip(frame + rng.normal(0, 1.0, frame.shape), 0, 255)
    return out


class Stored:
    """Frames stored in chunks by one codec: encoded bytes per chunk, and the cold read of rows."""

    def __init__(self, codec: str, frames: np.ndarray, chunk_rows: int):
        self.codec, self.chunk_rows, self.shape = codec, chunk_rows, frames.shape[1:]
        self.frame = None if codec == "lz4" else FrameCodec(codec, frames.shape[1:])
        start = time.perf_counter()
        self.chunks = [self._encode(frames[i:i + chunk_rows]) for i in range(0, len(frames), chunk_rows)]
        self.encode_s = (time.perf_counter() - start) / len(frames)
        self.nbytes = sum(len(values) for values, _ in self.chunks)

    def _encode(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.frame is not None:
            return self.frame.encode_rows(rows)
        blobs = [lz4.block.compress(row.tobytes(), store_size=False) for row in rows]
        return np.frombuffer(b"".join(blobs), np.uint8), np.cumsum([len(b) for b in blobs])

    def read(self, rows: np.ndarray, pool: ThreadPoolExecutor) -> np.ndarray:
        """The frames of ``rows``, decoded from their chunks (a video chunk up to its last row)."""
        chunk, offset = np.divmod(rows, self.chunk_rows)
        if self.frame is not None and self.frame.video:
            jobs = [(self.chunks[c], o) for c, o in zip(chunk.tolist(), offset.tolist())]
            return np.stack(list(pool.map(lambda job: self.frame.decode_rows(  # type: ignore[union-attr]
                job[0][0][:job[0][1][job[1]]], job[0][1][:job[1] + 1])[-1], jobs)))
        return np.stack(list(pool.map(lambda co: self._one(*co), zip(chunk.tolist(), offset.tolist()))))

    def _one(self, chunk: int, offset: int) -> np.ndarray:
        values, ends = self.chunks[chunk]
        blob = values[ends[offset - 1] if offset else 0:ends[offset]].tobytes()
        if self.frame is not None:
            return self.frame.decode_frame(blob)
        nbytes = int(np.prod(self.shape))
        return np.frombuffer(lz4.block.decompress(blob, uncompressed_size=nbytes), np.uint8).reshape(self.shape)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def codec_table(size: tuple[int, int], n: int, chunk_rows: int, threads: int, repeats: int) -> list[str]:
    frames = camera_frames(n, *size)
    rng = np.random.default_rng(1)
    lines = []
    with ThreadPoolExecutor(threads) as pool:
        for codec in CODECS:
            stored = Stored(codec, frames, chunk_rows)
            picks = [rng.choice(n // chunk_rows, 32, replace=n // chunk_rows < 32) * chunk_rows
                     + rng.integers(0, chunk_rows, 32) for _ in range(repeats)]
            start = time.perf_counter()
            got = [stored.read(rows, pool) for rows in picks]
            cold = (time.perf_counter() - start) / repeats
            quality = psnr(np.concatenate(got), frames[np.concatenate(picks)])
            cache = np.stack([frames[r] for r in picks[0]])
            start = time.perf_counter()
            for _ in range(repeats):
                cache.take(rng.integers(0, 32, 32), axis=0)
            warm = (time.perf_counter() - start) / repeats
            log(f"{size}: {codec}: {stored.nbytes / n:,.0f} B/frame, cold {cold * 1e3:.2f} ms")
            lines.append(f"| {size[0]}×{size[1]} | {codec} | {stored.nbytes / n:,.0f} | "
                         f"{frames[0].nbytes / (stored.nbytes / n):.1f}× | "
                         f"{'lossless' if quality == float('inf') else f'{quality:.1f} dB'} | "
                         f"{bl.format_seconds(stored.encode_s)} | {bl.format_seconds(cold)} | "
                         f"{bl.format_seconds(warm)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=512)
    parser.add_argument("--chunk-rows", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="96x96,480x640")
    args = parser.parse_args()
    sizes = [tuple(int(s) for s in size.split("x")) for size in args.sizes.split(",")]
    lines = [f"Codec level: {args.frames} frames in chunks of {args.chunk_rows}, sample(32) of rows in 32 "
             f"chunks decoded by {args.threads} threads (mean of {args.repeats}).", "",
             "| frames | codec | bytes / frame | vs raw | PSNR | encode / frame | sample(32) cold | warm |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        lines += codec_table(size, args.frames, args.chunk_rows, args.threads, args.repeats)  # type: ignore[arg-type]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
