"""Pixel-observation benchmark (issue #13): Atari-like frames in diskreplay vs cpprb vs TorchRL memmap.

Workload: transitions obs (84, 84) uint8, action () int64, reward () float32, done () bool,
next_obs (84, 84) uint8; 1,000,000 of them by default (7 GB of frames; ``--quick``: 100,000), in
a ring whose capacity equals that count. Episodes of 100-1000 steps (uniform). Frames are "noise
plus structure", deterministic and not trivially compressible (zstd level 3 packs them ~6×, frame by frame): a
flat background, a striped ground, six moving rectangular sprites and 5% salt-noise pixels, taken
from a pool of 4,096 distinct frames (each episode starts at its own offset in the pool and walks
it step by step) with the frame's own id written in its first 8 bytes. Generated per 1000-row
piece, outside every timed region. ``--frames atari`` takes the pool from MsPacman instead
(`atari_pool`: 4,096 consecutive frames, recorded with ale-py, grayscale, 84x84 by area).

Contestants, side by side in one process, repeats interleaved (rotating order), medians:
- diskreplay raw: ``ReplayBuffer.create(dir, fields, capacity, compression=None,
  derive_next=("obs",), episode_end="done")``, chunk_rows left at its default (automatic):
  next_obs is not stored but read from obs at t+1 (each episode's last next_obs in a side store);
- diskreplay zstd / lz4 / lz4hc: the same with ``compression="zstd"`` / ``"lz4"`` / ``"lz4hc"``
  (LZ4-HC at its default level 6: slower to write, the same LZ4 blocks decoded faster). Their
  writers keep the library's default ``cache_bytes``; for sampling, a read-only reader of zstd and
  lz4 whose ``cache_bytes`` holds every decompressed row ("resident") is opened too where RAM allows;
- cpprb: ``cpprb.ReplayBuffer(size, env_dict, next_of="obs")`` in RAM; for frame stacks a second
  one with obs shaped (84, 84, 4) and ``stack_compress="obs"`` (stack on the last axis, cpprb's
  convention), fed the stacks, with ``next_of="obs"``;
- TorchRL: ``ReplayBuffer(storage=LazyMemmapStorage(size, scratch_dir=...))`` holding TensorDicts
  with obs and next_obs both stored;
- numpy: every field (obs and next_obs) in RAM arrays, ``np.take`` (only where it fits in RAM).

Measured:
1. bytes per transition: the bytes the store's files hold / capacity, and what ``du`` counts
   (whole 4 KiB blocks); cpprb: the bytes of the numpy arrays it holds once built (its ring and
   the cache of each episode's last next_obs) / size. cpprb is fed episode by episode, calling
   ``on_episode_end()`` after each (without it an episode's last next_obs is the next episode's
   first frame);
2. extend of every transition in pieces of 1,000 (construction included; diskreplay also the
   flush that writes and commits the rest, not fsynced);
3. ``sample(256)`` once full (diskreplay returns obs and next_obs, like the others);
4. ``sample(32, stack=4)``: diskreplay obs/next_obs (32, 4, 84, 84); cpprb from its
   stack_compress buffer (32, 84, 84, 4); TorchRL has no frame stacking: plain sample(32), noted;
5. the gather of only the distinct frames such a batch needs (per drawn step t: t-3..t clamped to
   the episode start, and t+1), through ``buf.view.gather(lane, step, ("obs",))`` with the draws
   made beforehand, a fresh one for every batch (as ``stack=4`` reads frames no batch read
   before): the floor that ``stack=4`` is compared with; also the public ``buf[row_ids]`` of
   those rows (all fields, next_obs derived);
6. single ``add`` latency into the FULL ring: ``--adds`` calls (default 20,000) per contestant in
   4 interleaved rounds, each call timed: p50, p99, p99.9, max. diskreplay is not flushed in the
   loop: it writes each chunk as it fills;
7. memory of a fresh diskreplay reader process (default ``cache_bytes``) after sampling: private
   (RssAnon) and file-backed (RssFile) from /proc/self/status.

Prints the machine and the command, markdown tables (ratios vs cpprb, and vs TorchRL in each cell)
and PASS/FAIL for the issue's targets; ``--out FILE`` also writes the report there. The data
under ``--dir`` is deleted at the end unless ``--keep``.

Usage: python tools/bench_pixels.py [--quick] [--rows N] [--frames noise|atari] [--dir /tmp/diskreplay-pixels]
       [--out FILE] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import benchlib as bl

import diskreplay as dr

H = W = 84
FRAME = H * W  # 7,056 bytes
STACK = 4
PIECE = 1000  # transitions per extend call
POOL = 4096  # distinct base frames
FIELDS = {"obs": dr.Field((H, W), "uint8"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "done": dr.Field((), "bool"), "next_obs": dr.Field((H, W), "uint8")}
ROW_BYTES = sum(f.row_bytes for f in FIELDS.values())  # 14,125 with next_obs
CACHE_BYTES = inspect.signature(dr.ReplayBuffer.create).parameters["cache_bytes"].default
SLOW_REPEATS = 5
"""Interleaved repeats of the writers sampled past their cache (compressed frames) and the raw one."""

DR_RAW, DR_ZSTD, DR_LZ4, DR_LZ4HC = "diskreplay raw", "diskreplay zstd", "diskreplay lz4", "diskreplay lz4hc"
CPPRB, TRL, NUMPY = "cpprb", "TorchRL memmap", "numpy (RAM)"
COLUMNS = [DR_RAW, DR_ZSTD, DR_LZ4, DR_LZ4HC, CPPRB, TRL, NUMPY]
CODEC = {DR_RAW: None, DR_ZSTD: "zstd", DR_LZ4: "lz4", DR_LZ4HC: "lz4hc"}
WRITERS = tuple(CODEC)
PACKED = (DR_LZ4HC, DR_LZ4, DR_ZSTD)
PACKAGES = ["diskreplay", "numpy", "zarr", "numcodecs", "torch", "torchrl", "tensordict", "cpprb"]
log = bl.log


# ---- frames -------------------------------------------------------------------------------------


def make_pool(count: int, seed: int = 0, source: str = "noise") -> np.ndarray:
    """``count`` frames (count, 84, 84) uint8 from ``source``: "noise" (`noise_pool`) or "atari"
    (`atari_pool`)."""
    return atari_pool(count, seed) if source == "atari" else noise_pool(count, seed)


def noise_pool(count: int, seed: int = 0) -> np.ndarray:
    """``count`` distinct frames: background, ground, six moving sprites, 5% salt noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(count)
    frames = np.full((count, H, W), 24, np.uint8)
    frames[:, 68:, :] = 92
    frames[:, 68:, ::6] = 110
    rows, cols = np.arange(H)[None, :, None], np.arange(W)[None, None, :]
    for _ in range(6):
        h, w = rng.integers(4, 11, 2)
        value = rng.integers(120, 250)
        x0, y0 = rng.integers(0, W - w), rng.integers(4, 64 - h)
        vx, vy = rng.uniform(-1.5, 1.5, 2)
        x = (x0 + np.round(vx * t)).astype(np.int64) % (W - w)
        y = (y0 + np.round(vy * t)).astype(np.int64) % (64 - h)
        frames[(rows >= y[:, None, None]) & (rows < (y + h)[:, None, None])
               & (cols >= x[:, None, None]) & (cols < (x + w)[:, None, None])] = value
    salt = rng.random((count, H, W)) < 0.05
    frames[salt] = rng.integers(0, 256, int(salt.sum()), dtype=np.uint8)
    return frames


def atari_pool(count: int, seed: int = 0, game: str = "MsPacman") -> np.ndarray:
    """``count`` consecutive frames of ``game`` played by random actions (ale-py; ``ALE/<game>-v5``:
    frame skip 4, sticky actions 0.25, reset at each episode's end), in grayscale, shrunk from
    210x160 to 84x84 by area averaging (the DQN preprocessing; cv2's INTER_AREA). MsPacman is the
    least LZ4-compressible of Pong, Breakout, SpaceInvaders, Seaquest and MsPacman (3.2x)."""
    try:
        import ale_py
        import gymnasium
    except ImportError as exc:
        raise SystemExit(f"--frames atari needs ale-py and gymnasium (pip install -e '.[bench]'): {exc}") from exc
    gymnasium.register_envs(ale_py)
    env = gymnasium.make(f"ALE/{game}-v5", obs_type="grayscale")
    env.action_space.seed(seed)
    shrink_rows, shrink_cols = area_weights(210, H), area_weights(160, W)
    frames = np.empty((count, H, W), np.uint8)
    obs, _ = env.reset(seed=seed)
    for i in range(count):
        frames[i] = np.rint(shrink_rows @ obs.astype(np.float64) @ shrink_cols.T)
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    return frames


def area_weights(size: int, to: int) -> np.ndarray:
    """(to, size) weights: output pixel o averages the input pixels its span [o, o+1) * size/to
    covers, each by the length it covers."""
    edges = np.arange(to + 1) * (size / to)
    left, right = edges[:-1, None], edges[1:, None]
    pixels = np.arange(size)[None, :]
    covered = np.clip(np.minimum(right, pixels + 1) - np.maximum(left, pixels), 0, None)
    return covered / covered.sum(axis=1, keepdims=True)


class Frames:
    """The deterministic transition stream: ``rows(t0, n)`` gives transitions t0..t0+n-1.

    Episode e of length L shows frames (e, 0..L): transition i of it has obs = frame (e, i) and
    next_obs = frame (e, i+1), so next_obs is the following obs inside an episode and the last
    one is a frame no obs shows (as after a real episode's final step)."""

    def __init__(self, total: int, seed: int = 0, source: str = "noise"):
        rng = np.random.default_rng(seed)
        self.pool = make_pool(POOL, seed, source)
        lengths = rng.integers(100, 1001, total // 100 + 2)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        count = int(np.searchsorted(starts, total)) + 1
        self.starts, self.lengths = starts[:count], lengths[:count]
        self.offsets = rng.integers(0, POOL, count)
        self.total = total

    def _where(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        e = np.searchsorted(self.starts, t, side="right") - 1
        return e, t - self.starts[e]

    def frames(self, e: np.ndarray, k: np.ndarray) -> np.ndarray:
        out = self.pool[(self.offsets[e] + k) % POOL]
        out.reshape(len(out), -1)[:, :8] = (e * 1024 + k).astype("<u8").view(np.uint8).reshape(-1, 8)
        return out

    def rows(self, t0: int, n: int) -> dict[str, np.ndarray]:
        t = np.arange(t0, t0 + n)
        e, i = self._where(t)
        return {"obs": self.frames(e, i), "action": (t * 2654435761 >> 7) % 18,
                "reward": (t % 7 == 0).astype(np.float32), "done": i == self.lengths[e] - 1,
                "next_obs": self.frames(e, i + 1)}

    def stacked(self, t0: int, n: int) -> dict[str, np.ndarray]:
        """Like `rows`, obs and next_obs as (n, 84, 84, 4) stacks (the episode's first frame
        repeated before its start), for cpprb's stack_compress."""
        lo = max(t0 - (STACK - 1), 0)
        rows = self.rows(lo, t0 + n - lo)
        cut = t0 - lo
        t = np.arange(t0, t0 + n)
        first = self.starts[self._where(t)[0]]
        at = np.maximum(t[:, None] + np.arange(-(STACK - 1), 1)[None, :], first[:, None]) - lo
        obs = [rows["obs"][at[:, j]] for j in range(STACK)]
        out = {k: v[cut:] for k, v in rows.items()}
        out["obs"], out["next_obs"] = stack_last(obs), stack_last(obs[1:] + [out["next_obs"]])
        return out

    def episode_first(self, t: np.ndarray) -> np.ndarray:
        e, _ = self._where(t)
        return self.starts[e]


def stack_last(frames: list[np.ndarray]) -> np.ndarray:
    """Four (n, 84, 84) uint8 frames as one (n, 84, 84, 4) array, packed as little-endian uint32
    (much faster than a transposing copy)."""
    acc = frames[0].astype("<u4")
    for j, f in enumerate(frames[1:], 1):
        acc |= f.astype("<u4") << np.uint32(8 * j)
    return acc.view(np.uint8).reshape(*acc.shape, STACK)


def zstd_ratio(frames: Frames) -> float:
    """How much zstd level 3 packs the first 4,096 obs, each frame alone (as the stores do)."""
    import numcodecs
    obs = frames.rows(0, 4096)["obs"]
    return obs.nbytes / sum(len(numcodecs.Zstd(level=3).encode(frame)) for frame in obs)


# ---- contestants --------------------------------------------------------------------------------


def episode_pieces(rows: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """``rows`` cut after each episode's last step."""
    cuts = [0, *(np.flatnonzero(rows["done"]) + 1).tolist(), len(rows["done"])]
    return [{k: v[a:b] for k, v in rows.items()} for a, b in zip(cuts, cuts[1:]) if b > a]


def add_episode_piece(rb, rows: dict[str, np.ndarray]) -> None:
    """cpprb ``add``, then ``on_episode_end()`` if the piece ends an episode: without it cpprb
    gives an episode's last transition the next episode's first frame as next_obs."""
    rb.add(**rows)
    if rows["done"][-1]:
        rb.on_episode_end()


def dr_create(path: str, codec: str | None, capacity: int, **kw) -> dr.ReplayBuffer:
    shutil.rmtree(path, ignore_errors=True)
    return dr.ReplayBuffer.create(path, FIELDS, capacity, compression=codec, derive_next=("obs",),
                                  episode_end="done", seed=0, **kw)


def cpprb_buffer(size: int, stacked: bool = False):
    import cpprb
    shape = (H, W, STACK) if stacked else (H, W)
    env = {"obs": {"shape": shape, "dtype": np.uint8}, "action": {"dtype": np.int64},
           "reward": {"dtype": np.float32}, "done": {"dtype": np.bool_}}
    return cpprb.ReplayBuffer(size, env, next_of="obs", **({"stack_compress": "obs"} if stacked else {}))


def trl_buffer(size: int, scratch: str):
    from torchrl.data import LazyMemmapStorage, ReplayBuffer
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    return ReplayBuffer(storage=LazyMemmapStorage(size, scratch_dir=scratch))


def resident_cache(capacity: int) -> int:
    """cache_bytes for a reader holding every decompressed row of a full buffer."""
    stored = capacity * (ROW_BYTES - FRAME)
    return int(stored * 1.05) + 64 * bl.MiB


class Live:
    """The contestants' buffers from the last extend repeat, and what building them cost."""

    def __init__(self, work: str, rows: int, with_numpy: bool):
        self.work, self.rows, self.with_numpy = work, rows, with_numpy
        self.bufs: dict[str, Any] = {}
        self.cpprb_bytes: int | None = None

    def path(self, name: str) -> str:
        return os.path.join(self.work, name.replace(" ", "_").replace("(", "").replace(")", ""))

    def drop(self, name: str) -> None:
        old = self.bufs.pop(name, None)
        if isinstance(old, dr.ReplayBuffer):
            old.close()
        del old
        gc.collect()


def extend_cases(live: Live, frames: Frames) -> dict[str, Callable[[], dict[str, float]]]:
    rows = live.rows

    def dr_case(name: str):
        def run():
            live.drop(name)
            total = 0.0
            start = time.perf_counter_ns()
            buf = dr_create(live.path(name), CODEC[name], rows)
            create = (time.perf_counter_ns() - start) / 1e9
            for t0 in range(0, rows, PIECE):
                piece = frames.rows(t0, min(PIECE, rows - t0))
                secs, _ = bl.timed(lambda piece=piece: buf.extend(piece))
                total += secs
            flush, _ = bl.timed(lambda: buf.flush(durable=False))
            live.bufs[name] = buf
            return {"total": create + total + flush, "extend": create + total, "flush": flush}
        return run

    def cpprb_case():
        live.drop(CPPRB)
        secs, rb = bl.timed(lambda: cpprb_buffer(rows))
        for t0 in range(0, rows, PIECE):
            for episode in episode_pieces(frames.rows(t0, min(PIECE, rows - t0))):
                secs += bl.timed(lambda episode=episode: add_episode_piece(rb, episode))[0]
        live.cpprb_bytes = bl.held_array_bytes(rb)
        live.bufs[CPPRB] = rb
        return secs

    def trl_case():
        live.drop(TRL)
        secs, rb = bl.timed(lambda: trl_buffer(rows, live.path(TRL)))
        for t0 in range(0, rows, PIECE):
            td = bl.as_tensordict(frames.rows(t0, min(PIECE, rows - t0)))
            secs += bl.timed(lambda td=td: rb.extend(td))[0]
        live.bufs[TRL] = rb
        return secs

    def numpy_case():
        live.drop(NUMPY)
        secs, store = bl.timed(lambda: {k: np.zeros((rows, *f.shape), f.dtype) for k, f in FIELDS.items()})
        for t0 in range(0, rows, PIECE):
            piece = frames.rows(t0, min(PIECE, rows - t0))

            def copy(piece=piece, t0=t0):
                for k, v in piece.items():
                    store[k][t0:t0 + len(v)] = v
            secs += bl.timed(copy)[0]
        live.bufs[NUMPY] = store
        return secs

    cases = {**{name: dr_case(name) for name in WRITERS}, CPPRB: cpprb_case, TRL: trl_case}
    if live.with_numpy:
        cases[NUMPY] = numpy_case
    return cases


# ---- sampling -----------------------------------------------------------------------------------


def repeat(fn: Callable[[], Any], n: int) -> Callable[[], None]:
    def run():
        for _ in range(n):
            fn()
    return run


def time_sampling(fns: dict[str, Callable[[], Any]], repeats: int, number: int, warm: int) -> dict[str, bl.Stats]:
    for name, fn in fns.items():
        secs, _ = bl.timed(repeat(fn, warm))
        log(f"      warm-up {name}: {warm} batches in {secs:.1f} s")
    return bl.interleaved({k: repeat(f, number) for k, f in fns.items()}, repeats, number=number)


def numpy_sample(store: dict[str, np.ndarray], rng: np.random.Generator, batch: int) -> Callable[[], Any]:
    n = len(store["obs"])
    return lambda: {k: np.take(v, idx, axis=0) for idx in [rng.integers(0, n, batch)] for k, v in store.items()}


def numpy_stack(store: dict[str, np.ndarray], first: np.ndarray, rng: np.random.Generator,
                batch: int) -> Callable[[], Any]:
    n = len(store["obs"])
    back = np.arange(-(STACK - 1), 1)

    def run():
        idx = rng.integers(0, n, batch)
        steps = np.maximum(idx[:, None] + back[None, :], first[idx][:, None])
        obs = np.take(store["obs"], steps, axis=0)
        out = {k: np.take(v, idx, axis=0) for k, v in store.items() if k not in ("obs", "next_obs")}
        out["obs"] = obs
        out["next_obs"] = np.concatenate([obs[:, 1:], np.take(store["next_obs"], idx, axis=0)[:, None]], axis=1)
        return out
    return run


def resident_readers(live: Live, note: list[str], fills: dict[str, float]) -> dict[str, dr.ReplayBuffer]:
    """Read-only readers of the compressed stores with a cache holding every row, where RAM allows."""
    out = {}
    cache = resident_cache(live.rows)
    for name in (DR_ZSTD, DR_LZ4):
        avail = bl.mem_available() or 0
        if cache > 0.6 * avail:
            note.append(f"{name} resident reader not run: it needs cache_bytes={bl.format_bytes(cache)}, "
                        f"{bl.format_bytes(avail)} available")
            continue
        secs, reader = bl.timed(lambda name=name: dr.ReplayBuffer.open(live.path(name), "r", cache_bytes=cache))
        # the first read decompresses every chunk into the cache
        warm, _ = bl.timed(lambda reader=reader: reader.sample(1))
        log(f"      {name} resident reader: opened in {secs:.1f} s, first read (fills the cache) {warm:.1f} s")
        fills[name] = warm
        out[name] = reader
    return out


def bench_sample(live: Live, readers: dict[str, dr.ReplayBuffer], args) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    b = live.bufs
    res: dict[str, Any] = {}
    fns: dict[str, Callable[[], Any]] = {DR_RAW: lambda: b[DR_RAW].sample(256)}
    for name, reader in readers.items():
        fns[name] = lambda r=reader: r.sample(256)
    fns[CPPRB] = lambda: b[CPPRB].sample(256)
    fns[TRL] = lambda: b[TRL].sample(256)
    if NUMPY in b:
        fns[NUMPY] = numpy_sample(b[NUMPY], rng, 256)
    log(f"[4/6] sample(256): warm-up, then {args.repeats} interleaved repeats x {args.batches} batches")
    res["main"] = time_sampling(fns, args.repeats, args.batches, args.warm)
    # the compressed writers with the default cache_bytes: every batch decompresses chunks again;
    # the raw writer interleaved with them, for ratios measured in the same minutes
    slow = {name: (lambda n=name: b[n].sample(256)) for name in WRITERS}
    log(f"[4/6] sample(256) from the compressed writers (default cache_bytes) and the raw one: {args.slow_warm} "
        f"untimed batches, {SLOW_REPEATS} interleaved repeats x {args.slow_batches} batches")
    res["default_cache"] = time_sampling(slow, SLOW_REPEATS, args.slow_batches, args.slow_warm)
    return res


def bench_add(live: Live, frames: Frames, adds: int) -> dict[str, np.ndarray]:
    """Per-call seconds of single adds into the full rings, ``adds`` per contestant in 4 rounds."""
    pool = 512
    first = live.rows  # the transitions after those already stored: episodes go on
    rows = frames.rows(first, pool)
    step_rows = [{k: v[i] for k, v in rows.items()} for i in range(pool)]
    td = bl.as_tensordict(rows)
    td_rows = [td[i] for i in range(pool)]
    cpprb_rows = [{k: v[i:i + 1] for k, v in rows.items()} for i in range(pool)]
    rounds = 4
    per_round = adds // rounds
    lat = {name: [] for name in (*WRITERS, CPPRB, TRL)}
    done = dict.fromkeys(lat, 0)

    def case(name: str, add: Callable[[Any], Any], inputs: list):
        def run():
            out = np.empty(per_round)
            clock = time.perf_counter_ns
            k0 = done[name]
            for j in range(per_round):
                x = inputs[(k0 + j) % pool]
                start = clock()
                add(x)
                out[j] = clock() - start
            done[name] += per_round
            lat[name].append(out / 1e9)
            return float(out.sum() / 1e9)
        return run

    b = live.bufs
    cases = {name: case(name, lambda x, buf=b[name]: buf.add(**x), step_rows) for name in WRITERS}
    cases[CPPRB] = case(CPPRB, lambda x: add_episode_piece(b[CPPRB], x), cpprb_rows)
    cases[TRL] = case(TRL, b[TRL].add, td_rows)
    log(f"[3/6] single add into the full rings: {rounds} interleaved rounds x {per_round:,} adds")
    bl.interleaved(cases, rounds)
    return {name: np.concatenate(v) for name, v in lat.items()}


def distinct_draws(buf: dr.ReplayBuffer, rng: np.random.Generator, count: int, batch: int) -> list[tuple]:
    """``count`` draws of ``batch`` rows as sample(stack=4) makes them, each reduced to the distinct
    (lane, step) of "obs" its stacks and next_obs need; and their row ids."""
    lo, hi = buf.storage.window()
    out = []
    back = np.arange(-(STACK - 1), 1)
    for _ in range(count):
        draw = buf.sampler.sample(rng, batch, lo, hi)
        lane, step = draw.lane, draw.step
        first = np.maximum(buf.episode_index.episode_start(lane, step), lo[lane])
        steps = np.maximum(step[:, None] + back[None, :], first[:, None])
        follow = (buf.episode_index.next_end(lane, step) != step) & (step + 1 < hi[lane])
        all_steps = np.concatenate([steps.reshape(-1), step[follow] + 1])
        all_lanes = np.concatenate([np.repeat(lane, STACK), lane[follow]])
        key = np.unique(all_steps * buf.num_envs + all_lanes)
        out.append((key % buf.num_envs, key // buf.num_envs, key))
    return out


def bench_stack(live: Live, readers: dict[str, dr.ReplayBuffer], frames: Frames, args) -> dict[str, Any]:
    b = live.bufs
    res: dict[str, Any] = {}
    live.drop(CPPRB)  # its job is done: room for cpprb's stack buffer
    start = time.perf_counter()
    stacked = cpprb_buffer(live.rows, stacked=True)
    for t0 in range(0, live.rows, PIECE):
        for episode in episode_pieces(frames.stacked(t0, min(PIECE, live.rows - t0))):
            add_episode_piece(stacked, episode)
    res["cpprb_stack_bytes"] = bl.held_array_bytes(stacked)
    res["cpprb_stack_build"] = time.perf_counter() - start
    log(f"[5/6] cpprb stack_compress buffer built in {res['cpprb_stack_build']:.1f} s (stacks generated included)")
    rng = np.random.default_rng(2)
    draws = distinct_draws(b[DR_RAW], rng, args.warm + args.repeats * args.batches, 32)
    res["distinct_frames"] = float(np.mean([len(d[2]) for d in draws]))
    cursor = {"raw": 0, "pub": 0}

    def gather(buf: dr.ReplayBuffer, which: str):
        def run():
            lane, step, _ = draws[cursor[which] % len(draws)]
            cursor[which] += 1
            return buf.view.gather(lane, step, ("obs",))
        return run

    def public():
        _, _, ids = draws[cursor["pub"] % len(draws)]
        cursor["pub"] += 1
        return b[DR_RAW][ids]

    fns: dict[str, Callable[[], Any]] = {DR_RAW: lambda: b[DR_RAW].sample(32, stack=STACK)}
    for name, reader in readers.items():
        fns[name] = lambda r=reader: r.sample(32, stack=STACK)
    fns[CPPRB] = lambda: stacked.sample(32)
    fns[TRL] = lambda: b[TRL].sample(32)
    if NUMPY in b:
        fns[NUMPY] = numpy_stack(b[NUMPY], frames.episode_first(np.arange(live.rows)), rng, 32)
    fns["gather " + DR_RAW] = gather(b[DR_RAW], "raw")
    fns["public " + DR_RAW] = public
    log(f"[5/6] sample(32, stack=4) and distinct-frame gathers: {args.repeats} interleaved repeats x "
        f"{args.batches} batches")
    res["stats"] = time_sampling(fns, args.repeats, args.batches, args.warm)
    check_stack(b[DR_RAW], frames, live.rows)
    fns.clear()  # cpprb's stack buffer goes with the closure over it, when this returns
    return res


def check_stack(buf: dr.ReplayBuffer, frames: Frames, generated: int) -> None:
    """Check that diskreplay's stacks are the frames the stream defines (each frame's id is in its
    first 8 bytes), for sampled rows among the first ``generated`` transitions (the adds after
    them repeat a small pool)."""
    batch = buf.sample(256, stack=STACK, seed=5)
    t = batch["index"]
    keep = t + 1 < generated
    t = t[keep]
    got = {name: batch[name][keep].reshape(len(t), STACK, -1)[:, :, :8].copy().view("<u8")[..., 0]
           for name in ("obs", "next_obs")}
    e, _ = frames._where(t)
    first = np.maximum(frames.starts[e], buf.storage.window()[0][0])  # a ring's oldest row may start a stack
    back = np.arange(-(STACK - 1), 1)
    ok = np.ones(len(t), bool)
    for name, shift in (("obs", 0), ("next_obs", 1)):
        k = np.maximum(t[:, None] + shift + back, first[:, None]) - frames.starts[e][:, None]
        ok &= (got[name] == e[:, None] * 1024 + k).all(axis=1)
    if not ok.all():
        log(f"      WARNING: {int((~ok).sum())} of {len(t)} diskreplay stacks differ from the generated stream "
            f"(rows {t[~ok][:5].tolist()})")
    else:
        log(f"      checked {len(t)} diskreplay stacks against the generated frames: all match")


# ---- memory (child process) ---------------------------------------------------------------------


def child_memory(path: str, batches: int, stack_batches: int) -> None:
    """Subprocess: open read-only with the default cache, sample, print one JSON line."""
    status0 = bl.self_status()
    start = time.perf_counter()
    buf = dr.ReplayBuffer.open(path, "r")
    for _ in range(batches):
        buf.sample(256)
    for _ in range(stack_batches):
        buf.sample(32, stack=STACK)
    secs = time.perf_counter() - start
    print(json.dumps({"start": status0, "end": bl.self_status(), "seconds": secs, "batches": batches,
                      "stack_batches": stack_batches, "mapped": buf.storage.mapped is not None}))
    buf.close()


def bench_memory(live: Live, args) -> dict[str, Any]:
    out = {}
    for name, batches, stacks in ((DR_RAW, args.mem_batches, args.mem_batches // 4),
                                  (DR_ZSTD, args.mem_batches // 20, 3)):
        log(f"[6/6] memory: fresh read-only {name} process, {batches} x sample(256) + {stacks} x sample(32, stack=4)")
        res = bl.run_child([sys.executable, __file__, "--child-memory", live.path(name), str(batches), str(stacks)])
        if res.returncode:
            out[name] = {"error": res.stderr.strip()[-300:]}
            continue
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
        out[name]["peak_polled"] = res.peak_rss
    return out


# ---- report -------------------------------------------------------------------------------------


def with_trl(table: bl.Table, label: str, values: dict[str, float | None], kind: str = "time",
             unit: str | None = None, trl_value: float | None = None, notes: dict[str, str] | None = None) -> None:
    """A row with ratios vs cpprb (the column baseline) and, in each cell, vs TorchRL."""
    trl = values.get(TRL) if trl_value is None else trl_value
    extra = dict(notes or {})
    base = values.get(CPPRB)
    for col, v in values.items():
        if kind == "count" and v is not None and base:
            extra[col] = (f"({bl.format_ratio(v / base)}) " + extra.get(col, "")).strip()
    for col, v in values.items():
        if v is not None and trl and col not in (TRL,):
            extra[col] = (extra.get(col, "") + f" [{bl.format_ratio(v / trl)} TorchRL]").strip()
    table.add(label, values, kind=kind, unit=unit, baseline=CPPRB if values.get(CPPRB) else None, notes=extra)


def pct(lat: np.ndarray) -> dict[str, float]:
    return {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
            "p99.9": float(np.percentile(lat, 99.9)), "max": float(lat.max()), "mean": float(lat.mean())}


def build_report(args, live: Live, ext, sizes, sample, add, stack, mem, notes, ratio: float) -> str:
    cols = [c for c in COLUMNS if c != NUMPY or live.with_numpy]
    t = bl.Table(cols)
    us = lambda s: bl.format_seconds(s, "us")  # noqa: E731
    with_trl(t, "bytes per transition (files: bytes stored / capacity; cpprb: its arrays' bytes / size)",
             {c: sizes.get(c) for c in cols}, kind="count")
    with_trl(t, "… on disk, as du counts them (whole 4 KiB blocks)", {DR_RAW: sizes["du " + DR_RAW],
                                                                    CPPRB: sizes[CPPRB]}, kind="count")
    with_trl(t, f"extend {live.rows:,} transitions in pieces of {PIECE:,} (+ flush for diskreplay)",
             {c: ext[c].median for c in cols}, unit="s")
    main = sample["main"]
    vals = {c: main[c].median if c in main else None for c in cols}
    with_trl(t, "sample(256), per batch (zstd/lz4: resident reader)", vals, unit="us")
    dc = sample["default_cache"]
    with_trl(t, f"sample(256) from the writer with default cache_bytes ({CACHE_BYTES // bl.MiB} MiB)",
             {**{name: dc[name].median for name in WRITERS}, CPPRB: main[CPPRB].median}, unit="us",
             trl_value=main[TRL].median)
    st = stack["stats"]
    vals = {c: st[c].median if c in st else None for c in cols}
    with_trl(t, "sample(32, stack=4), per batch (TorchRL: unstacked sample(32); cpprb: stack_compress buffer)",
             vals, unit="us", notes={TRL: "(unstacked)"})
    with_trl(t, f"gather of the {stack['distinct_frames']:.0f} distinct obs frames a stack=4 batch of 32 needs "
             "(`buf.view.gather`, draws made beforehand)", {DR_RAW: st["gather " + DR_RAW].median,
                                                            CPPRB: st[CPPRB].median}, unit="us",
             trl_value=st[TRL].median, notes={CPPRB: "(its stack sample, for the ratio)"})
    with_trl(t, "… the same rows through the public `buf[row_ids]` (all fields, next_obs derived)",
             {DR_RAW: st["public " + DR_RAW].median, CPPRB: st[CPPRB].median}, unit="us", trl_value=st[TRL].median,
             notes={CPPRB: "(its stack sample, for the ratio)"})
    lat = {c: pct(v) for c, v in add.items()}
    for q in ("p50", "p99", "p99.9", "max"):
        with_trl(t, f"single add into the full ring, {q} of {args.adds:,}", {c: lat[c][q] for c in lat}, unit="us")
    for name, m in mem.items():
        if "error" in m:
            t.add(f"fresh {name} reader process: memory", {name: "failed, see notes"}, kind="text")
            continue
        what = f"fresh {name} reader process after {m['batches']:,} x sample(256) + {m['stack_batches']} stacks:"
        t.add(f"{what} private (RssAnon)", {name: m["end"]["RssAnon"]}, kind="bytes")
        t.add(f"{what} file-backed (RssFile)", {name: m["end"]["RssFile"]}, kind="bytes")

    raw_s, cp_s = main[DR_RAW].median, main[CPPRB].median
    raw_k, cp_k = st[DR_RAW].median, st[CPPRB].median
    gat = st["gather " + DR_RAW].median
    e_raw, e_trl = ext[DR_RAW].median, ext[TRL].median
    targets = [
        bl.Target("sample(256) ≤ 1.5× cpprb (diskreplay raw)",
                  f"{us(raw_s)} vs {us(cp_s)}: {bl.format_ratio(raw_s / cp_s)}", raw_s <= 1.5 * cp_s),
        bl.Target("sample(32, stack=4) ≤ 2× cpprb stack_compress (diskreplay raw)",
                  f"{us(raw_k)} vs {us(cp_k)}: {bl.format_ratio(raw_k / cp_k)}", raw_k <= 2 * cp_k),
        bl.Target("extend ≤ 0.5× TorchRL (diskreplay raw, + flush)",
                  f"{e_raw:.2f} s vs {e_trl:.2f} s: {bl.format_ratio(e_raw / e_trl)}", e_raw <= 0.5 * e_trl),
        bl.Target("bytes per transition ≤ cpprb's (diskreplay raw, bytes its files hold)",
                  f"{sizes[DR_RAW]:,} vs {sizes[CPPRB]:,}: {bl.format_ratio(sizes[DR_RAW] / sizes[CPPRB])}; "
                  f"du {sizes['du ' + DR_RAW]:,}: {bl.format_ratio(sizes['du ' + DR_RAW] / sizes[CPPRB])} "
                  f"(zstd: {sizes[DR_ZSTD]:,}, {bl.format_ratio(sizes[DR_ZSTD] / sizes[CPPRB])})",
                  sizes[DR_RAW] <= sizes[CPPRB]),
    ]
    raw_dc = dc[DR_RAW].median  # timed interleaved with the compressed writers
    for name in PACKED:
        codec = CODEC[name]
        targets.append(bl.Target(f"{codec} sample(256) ≤ 3× raw, default cache_bytes ({CACHE_BYTES // bl.MiB} MiB, "
                                 "the writer: frames not in the cache)",
                                 f"{us(dc[name].median)} vs {us(raw_dc)}: {bl.format_ratio(dc[name].median / raw_dc)}",
                                 dc[name].median <= 3 * raw_dc))
    if DR_ZSTD in main:
        z = main[DR_ZSTD].median
        targets.append(bl.Target("zstd sample(256) ≤ 3× raw, reader whose cache_bytes holds every decompressed row",
                                 f"{us(z)} vs {us(raw_s)}: {bl.format_ratio(z / raw_s)}", z <= 3 * raw_s))
    else:
        targets.append(bl.Target("zstd sample(256) ≤ 3× raw, resident reader", "not run (RAM)", None))
    targets.append(bl.Target("sample(32, stack=4) ≤ 1.5× the gather of its distinct frames (diskreplay raw)",
                             f"{us(raw_k)} vs {us(gat)}: {bl.format_ratio(raw_k / gat)}", raw_k <= 1.5 * gat))
    for name in WRITERS:
        m = lat[name]
        targets.append(bl.Target(f"single add into a full ring: max ≤ 20 ms ({name})",
                                 f"max {bl.format_seconds(m['max'])}, p99.9 {bl.format_seconds(m['p99.9'])}, "
                                 f"p99 {bl.format_seconds(m['p99'])}, p50 {bl.format_seconds(m['p50'])}",
                                 m["max"] <= 0.020))

    def spread(stats):
        name = max(stats, key=lambda c: stats[c].spread)
        return f"{stats[name].spread:.0%} ({name})"
    raw_buf = live.bufs[DR_RAW]
    chunk_rows = raw_buf.storage.layout.chunk_rows
    lines = [
        f"- data: {live.rows:,} transitions of {args.frames} frames in one full ring, "
        f"episodes 100-1000 steps; zstd level 3 packs 4,096 of its obs {ratio:.1f}×, frame by frame. "
        f"diskreplay chunk_rows (automatic) = {chunk_rows:,}: a chunk of obs is "
        f"{bl.format_bytes(chunk_rows * FRAME)}; the writers' cache_bytes = {CACHE_BYTES // bl.MiB} MiB "
        f"(default).",
        f"- bytes: diskreplay's count the whole store directory (the obs/scalar chunks with their checksums, "
        f"the side store of each episode's final next_obs, metadata), as bytes its files hold and as du "
        f"counts them (whole 4 KiB blocks: a chunk file of {chunk_rows:,} bools takes one); TorchRL's its "
        f"scratch_dir (obs and next_obs both stored); cpprb's the numpy arrays it holds: obs stored once "
        f"with next_of, and each episode's last next_obs, cached by on_episode_end(); its stack_compress buffer: "
        f"{stack['cpprb_stack_bytes'] / live.rows:,.0f} bytes per transition. numpy stores obs and next_obs.",
        f"- extend: median of {args.extend_repeats} interleaved repeats, each into fresh buffers, "
        f"construction included; generating the frames is outside the timing. diskreplay: extend calls + "
        f"`flush(durable=False)` (every row written and committed, not fsynced; none of the others syncs). "
        + "; ".join(f"{c}: extend {ext[c].phases['extend'].median:.2f} s + flush {ext[c].phases['flush'].median:.2f} s"
                    for c in WRITERS) + ".",
        f"- sampling: median of {args.repeats} interleaved repeats x {args.batches} batches after {args.warm} "
        "untimed batches each. diskreplay raw: the writer that extended (it reads written chunks through "
        "memory maps). zstd/lz4 in the main rows: a read-only reader opened with cache_bytes holding every "
        "decompressed row (its first read fills the cache: "
        + (", ".join(f"{c} {s:.1f} s" for c, s in sample["fills"].items()) or "not run")
        + f", for {bl.format_bytes(live.rows * (ROW_BYTES - FRAME))} of rows); the 'default cache_bytes' row "
        f"samples the writers, whose cache holds {live.bufs[DR_ZSTD].stats().cache_slots:,} chunk slots of the "
        f"small fields (the ring has {-(-live.rows // chunk_rows):,} chunks): each batch reads and decodes "
        f"every frame it needs from its inner chunk ({args.slow_warm} untimed batches, then {SLOW_REPEATS} repeats x "
        f"{args.slow_batches} batches, interleaved with the raw writer's, which that row and the ≤ 3× raw "
        f"targets use). TorchRL: "
        "`rb.sample(256)` of a `ReplayBuffer(LazyMemmapStorage)` (a TensorDict of obs, next_obs, ...). cpprb: "
        "`rb.sample(256)`. numpy: `rng.integers` + `np.take` per field.",
        f"- stacks: cpprb's stack buffer was built by adding (84, 84, 4) stacks (the episode's first frame "
        f"repeated before its start) in {stack['cpprb_stack_build']:.1f} s; its batches are stack-last "
        f"(32, 84, 84, 4). diskreplay repeats the episode's first frame the same way. The distinct-frame gather "
        f"reads {stack['distinct_frames']:.0f} frames per batch on average (of the 32 x 5 = 160 frames obs and "
        "next_obs stacks name), through the internal `buf.view.gather(lane, step, ('obs',))`: no public call "
        "reads one field of given rows (`buf[ids]` reads every field, next_obs derived from obs at t+1 "
        "again). The draws (sampler + episode starts + np.unique) are made beforehand, outside the timing.",
        f"- add: {args.adds:,} single adds per contestant into its full ring (capacity {live.rows:,}) in 4 "
        "interleaved rounds, inputs prebuilt in each library's native form (numpy rows; TensorDict rows for "
        "TorchRL); each call timed with perf_counter_ns, the garbage collector left on. diskreplay writes a "
        f"chunk when it fills (every {chunk_rows:,} adds) behind the add, on its background thread (with the "
        "fsynced retire commit first), and, going round the ring, reads the chunk it is about to overwrite "
        "into its staging slot in the add that starts one.",
        f"- noise, worst (max−min)/median of the repeats: extend {spread(ext)}, sample {spread(main)}, "
        f"stack {spread(st)}. Ratios hold better than absolute times on this shared machine.",
    ]
    for m_name, m in mem.items():
        if "error" in m:
            lines.append(f"- memory {m_name}: the child failed: {m['error']}")
        else:
            lines.append(f"- memory {m_name}: `ReplayBuffer.open(path, 'r')` in a fresh process (default cache_bytes; "
                         f"{'memory-mapped chunks' if m['mapped'] else 'chunk cache'}), {m['seconds']:.1f} s; at the "
                         f"start (imports) RssAnon {bl.format_bytes(m['start']['RssAnon'])}; at the end VmHWM "
                         f"{bl.format_bytes(m['end']['VmHWM'])}. RssFile are page-cache pages of the chunk files "
                         "(shared, reclaimable).")
    for key in ("sample", "stack", "setup"):
        lines += [f"- {n}" for n in notes.get(key, [])]
    return "\n\n".join([t.render(),
                        "Cells: value (ratio vs cpprb) [ratio vs TorchRL]. Times per operation unless in s.",
                        "## Targets (issue #13)", bl.render_targets(targets), "\n".join(lines)])


# ---- main ---------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default="/tmp/diskreplay-pixels", help="work directory on the local disk to test")
    p.add_argument("--out", help="also write the markdown report to this file")
    p.add_argument("--quick", action="store_true", help="100,000 transitions, fewer repeats")
    p.add_argument("--keep", action="store_true", help="keep the stores under --dir (default: delete them)")
    p.add_argument("--rows", type=int, help="transitions (= ring capacity); default 1,000,000, quick 100,000")
    p.add_argument("--frames", choices=("noise", "atari"), default="noise",
                   help="noise plus structure (default), or MsPacman frames recorded with ale-py")
    p.add_argument("--repeats", type=int, help="sampling repeats (default 7; quick 5)")
    p.add_argument("--batches", type=int, help="batches per sampling repeat (default 300; quick 200)")
    p.add_argument("--warm", type=int, help="untimed batches per sampler first (default 500; quick 200)")
    p.add_argument("--slow-batches", type=int, default=50, help="batches per repeat of the default-cache "
                   "compressed sampling (default 50: codec work swings with the load of a shared host)")
    p.add_argument("--slow-warm", type=int, default=200, help="untimed batches before it (default 200: the shard "
                   "files mapped, the inner chunks read before checked, as in a run under way)")
    p.add_argument("--extend-repeats", type=int, help="extend repeats (default 1; quick 2)")
    p.add_argument("--adds", type=int, default=20_000, help="single adds per contestant (default 20,000)")
    p.add_argument("--mem-batches", type=int, help="sample(256) batches of the memory child (default 2000; quick 500)")
    p.add_argument("--child-memory", nargs=3, metavar=("PATH", "BATCHES", "STACKS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_memory:
        return child_memory(args.child_memory[0], int(args.child_memory[1]), int(args.child_memory[2]))
    q = args.quick
    args.rows = args.rows or (100_000 if q else 1_000_000)
    args.repeats = args.repeats or (5 if q else 7)
    args.batches = args.batches or (200 if q else 300)
    args.warm = args.warm or (200 if q else 500)
    args.extend_repeats = args.extend_repeats or (2 if q else 1)
    args.mem_batches = args.mem_batches or (500 if q else 2000)
    if args.rows % PIECE:
        raise SystemExit(f"--rows must be a multiple of {PIECE}")

    work = os.path.join(args.dir, "pixels")
    os.makedirs(work, exist_ok=True)
    n = args.rows
    # diskreplay raw ~1x the frames, zstd/lz4/lz4hc ~0.15-0.3x, TorchRL 2x: ~3.8x the obs bytes on disk
    disk_need = int(3.8 * n * FRAME)
    free = bl.free_bytes(work)
    log(f"disk: {bl.format_bytes(free)} free under {work}, the stores need ~{bl.format_bytes(disk_need)}")
    bl.require_free_space(work, disk_need)
    avail = bl.mem_available() or 0
    numpy_bytes = n * ROW_BYTES
    with_numpy = numpy_bytes < 0.25 * avail
    notes: dict[str, list[str]] = {"setup": []}
    if not with_numpy:
        notes["setup"].append(f"numpy column not run: its arrays need {bl.format_bytes(numpy_bytes)}, "
                              f"{bl.format_bytes(avail)} available")
    resident = n * FRAME * 1 + n * 2 * FRAME + n * FRAME  # cpprb RAM + TorchRL files + diskreplay raw files
    if resident > avail:
        notes["setup"].append(
            f"**the working set does not fit in RAM**: cpprb ({bl.format_bytes(n * FRAME)} private) + TorchRL's files "
            f"({bl.format_bytes(2 * n * FRAME)}) + diskreplay raw's files ({bl.format_bytes(n * FRAME)}) exceed the "
            f"{bl.format_bytes(avail)} available at the start: memory-mapped samplers (TorchRL, diskreplay raw) may "
            "read from disk, whichever the page cache evicted.")

    bl.import_torchrl()
    import torch
    header = bl.report_header("diskreplay pixel benchmark (issue #13)", q, PACKAGES, args.dir, [
        f"torch intra-op threads: {torch.get_num_threads()}; MemAvailable at start {bl.format_bytes(avail)}; "
        f"free disk {bl.format_bytes(free)}",
        f"settings: {n:,} transitions of {args.frames} frames, sampling {args.repeats}x{args.batches} batches "
        f"(warm-up {args.warm}), "
        f"extend x{args.extend_repeats}, {args.adds:,} adds, memory child {args.mem_batches} batches"])
    print(header + "\n", flush=True)
    started = time.perf_counter()

    frames = Frames(n + PIECE, source=args.frames)
    ratio = zstd_ratio(frames)
    log(f"frames: pool of {POOL} {args.frames} frames built; zstd level 3 packs them {ratio:.1f}×, frame by frame")
    live = Live(work, n, with_numpy)
    log(f"[1/6] extend {n:,} transitions: {args.extend_repeats} interleaved repeats")
    ext = bl.interleaved(extend_cases(live, frames), args.extend_repeats,
                         progress=lambda m: log("    " + m.strip()))

    log("[2/6] bytes per transition")
    sizes: dict[str, float | None] = {c: bl.stored_bytes(live.path(c)) / n for c in (*WRITERS, TRL)}
    sizes[CPPRB] = live.cpprb_bytes / n
    sizes["du " + DR_RAW] = bl.allocated_bytes(live.path(DR_RAW)) / n
    if with_numpy:
        sizes[NUMPY] = sum(v.nbytes for v in live.bufs[NUMPY].values()) / n
    sizes = {k: round(v) for k, v in sizes.items()}
    log("      " + ", ".join(f"{k}: {v:,}" for k, v in sizes.items()))

    add = bench_add(live, frames, args.adds)
    for c, v in add.items():
        m = pct(v)
        log(f"      {c}: p50 {bl.format_seconds(m['p50'])}, p99.9 {bl.format_seconds(m['p99.9'])}, "
            f"max {bl.format_seconds(m['max'])}")
    for name in WRITERS:
        live.bufs[name].flush(durable=False)  # the readers below see every row
    fills: dict[str, float] = {}
    log("[4/6] opening the compressed stores' resident readers")
    readers = resident_readers(live, notes.setdefault("sample", []), fills)
    sample = bench_sample(live, readers, args)
    sample["fills"] = fills
    log("      " + ", ".join(f"{c}: {bl.format_seconds(s.median, 'us')}" for c, s in sample["main"].items()))
    log("      default cache: " + ", ".join(f"{c}: {bl.format_seconds(s.median)}"
                                           for c, s in sample["default_cache"].items()))
    stack = bench_stack(live, readers, frames, args)
    log("      " + ", ".join(f"{c}: {bl.format_seconds(s.median, 'us')}" for c, s in stack["stats"].items()))
    for reader in readers.values():
        reader.close()
    del readers
    gc.collect()
    for name in WRITERS:
        live.bufs[name].flush()
    mem = bench_memory(live, args)

    report = build_report(args, live, ext, sizes, sample, add, stack, mem, notes, ratio)
    for name in list(live.bufs):
        live.drop(name)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
        log(f"deleted {work}")
    bl.publish_report(header, report, args.out, started)


if __name__ == "__main__":
    main()
