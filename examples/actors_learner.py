"""Distributed prioritized DQN on CartPole-v1: actor processes and one learner that share nothing but a folder.

    python examples/actors_learner.py --run-dir runs/apex --actors 4 --updates 20000   # kill it, rerun to resume
    python examples/actors_learner.py --run-dir runs/apex --launcher ray     # Ray actors: pip install "diskreplay[ray]"

Each actor runs its own CartPole-v1 with an epsilon-greedy copy of the Q-network (Ape-X style:
actor i of N explores with epsilon 0.4 ** (1 + 7 i / (N - 1))) and writes its transitions to its
own shard of one sharded diskreplay buffer (``dr.ReplayBuffer.open_shard``), committing every
``--flush-every`` steps. The learner (the main process) samples the union of the shards with
prioritized replay (optionally n-step returns), updates the priorities from its TD errors,
adopts the shards' newest commits every ``--refresh-every`` updates, and publishes its
weights for the actors. A ``dr.RateLimiter`` keeps about ``--samples-per-insert`` sampled rows
per inserted row: the learner waits in ``sample`` when it runs ahead, the actors wait before
inserting when they do. There is no server: the processes only share ``--run-dir``.

``--run-dir`` holds:

    buffer/                       the sharded buffer (shard i is written by actor i only)
    weights.pt                    the learner's latest Q-network (replaced atomically; actors reload it)
    checkpoints/update-NNNNNNNN/  model.pt (networks, optimizer, update count) + buffer/ (the
                                  learner's buffer state: priorities, generator, rows sampled),
                                  written to a temporary folder that is then renamed: a kill
                                  never leaves a half-written checkpoint; the newest two are kept
    returns-<i>.txt               the return of every episode actor i finished
    stop                          written by the main process when the learner is done: the actors stop
    summary.json                  written when the learner finishes

Kill-and-restart: kill everything at any time (``kill -9`` of the process group, power off) and
run the same command again: the learner restarts from its newest checkpoint (rows the actors
committed since are new rows to it, at the highest priority) and every actor reopens its shard
(the writer lock the killed actor left is taken over, with a warning, and its cut episode is
closed as truncated). An actor that dies while the learner runs is restarted by the main
process. Ctrl-C or SIGTERM stop the learner after its current update (a second one: at once),
then it checkpoints. When the learner has done ``--updates`` updates, the actors are stopped,
and a summary is printed and written to ``summary.json``.

``--launcher ray`` runs the same actor function as Ray actors (``ray.remote``) in a local Ray
instance (Ray's own processes; the rows still go only through ``--run-dir``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch
from torch import nn

import diskreplay as dr

FIELDS = {"obs": dr.Field((4,), "float32"), "action": dr.Field((), "int64"), "reward": dr.Field((), "float32"),
          "next_obs": dr.Field((4,), "float32"), "terminated": dr.Field((), "bool"),
          "truncated": dr.Field((), "bool")}
CHECKPOINT_PREFIX = "update-"
KEEP_CHECKPOINTS = 2


def say(line: str) -> None:
    """Print one line in one write: the actors and the learner share stdout, and a ``print``
    there (unbuffered) writes the text and its newline apart, so lines could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def qnet() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def paths(run_dir: str) -> dict[str, str]:
    return {"buffer": os.path.join(run_dir, "buffer"), "weights": os.path.join(run_dir, "weights.pt"),
            "checkpoints": os.path.join(run_dir, "checkpoints"), "stop": os.path.join(run_dir, "stop"),
            "summary": os.path.join(run_dir, "summary.json")}


def rate_limiter(cfg: dict[str, Any], timeout_s: float = 600.0) -> dr.RateLimiter:
    """The one limit learner and actors keep to (both must build it from the same settings)."""
    # the limiter's rule of thumb, doubled: a batch plus what an actor adds between two checks
    error_buffer = float(cfg["batch_size"] + cfg["samples_per_insert"] * cfg["flush_every"])
    return dr.RateLimiter(samples_per_insert=cfg["samples_per_insert"], error_buffer=error_buffer,
                          min_size=cfg["learning_starts"], timeout_s=timeout_s)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under ``path`` (and ``path``): their bytes survive a power loss."""
    for folder, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(folder, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(folder)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str) -> None:
    """Write ``obj`` to a temporary file beside ``path``, then rename it over ``path``: a reader
    sees the old file or the new one, never a part of it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# ---- actors ----------------------------------------------------------------------------------


def actor_epsilon(shard: int, actors: int) -> float:
    """Ape-X's fixed exploration rates: 0.4 for actor 0 down to 0.4 ** 8 for the last one."""
    return 0.4 ** (1 + 7 * shard / (actors - 1)) if actors > 1 else 0.4


def run_actor(run_dir: str, shard: int, cfg: dict[str, Any], parent_pid: int | None = None) -> int:
    """Actor ``shard``: play CartPole-v1 and write every step to shard ``shard`` until the
    ``stop`` file appears in ``run_dir`` (or, with ``parent_pid``, that process is gone).
    Returns the steps it added. Run it again after a kill: it reopens its shard."""
    import gymnasium as gym  # imported here: the learner does not need it

    torch.set_num_threads(1)
    if parent_pid is not None:  # a process of ours: Ctrl-C is the main process's to handle (it stops us)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    where = paths(run_dir)
    limiter = rate_limiter(cfg)
    # Reopening the shard of a killed actor takes its writer lock over (with a warning) and
    # closes the episode the kill cut as truncated; the rows it committed stay.
    buf = dr.ReplayBuffer.open_shard(where["buffer"], shard, rate_limiter=limiter)
    # a restarted actor draws new random numbers: the steps its shard holds are part of the seed
    steps = int(buf.window()[1].sum())
    say(f"actor {shard} (pid {os.getpid()}) opened shard {shard} ({steps} rows were committed before)")
    rng = np.random.default_rng([cfg["seed"], shard, steps])
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=int(rng.integers(2**31)))
    epsilon = actor_epsilon(shard, cfg["actors"])
    q, loaded_mtime = qnet(), None
    episode_return, added = 0.0, 0
    returns_file = open(os.path.join(run_dir, f"returns-{shard}.txt"), "a")

    def stopping() -> bool:
        return os.path.exists(where["stop"]) or (parent_pid is not None and os.getppid() != parent_pid)

    def load_weights() -> None:
        nonlocal loaded_mtime
        try:
            mtime = os.stat(where["weights"]).st_mtime_ns
            if mtime != loaded_mtime:
                q.load_state_dict(torch.load(where["weights"], weights_only=True))
                loaded_mtime = mtime
        except FileNotFoundError:
            pass  # the learner has not published any yet: act with the initial network

    try:
        while not stopping():
            if not buf.insert_allowed(cfg["flush_every"]):
                # The learner is behind: wait for it. Our staged rows are committed first, as the
                # learner counts committed rows only (and we count ours, staged ones too).
                buf.flush()
                while not buf.insert_allowed(cfg["flush_every"]) and not stopping():
                    time.sleep(0.01)
                continue
            load_weights()
            for _ in range(cfg["flush_every"]):
                if rng.random() < epsilon:
                    action = int(rng.integers(2))
                else:
                    with torch.no_grad():
                        action = int(q(torch.as_tensor(obs)).argmax())
                next_obs, reward, terminated, truncated, _ = env.step(action)
                buf.add(obs=obs, action=action, reward=reward, next_obs=next_obs, terminated=terminated,
                        truncated=truncated)
                added += 1
                episode_return += float(reward)
                obs = next_obs
                if terminated or truncated:
                    returns_file.write(f"{time.time():.6f} {episode_return:g}\n")
                    returns_file.flush()
                    obs, episode_return = env.reset()[0], 0.0
            buf.flush()  # a commit: the learner sees these rows at its next refresh
    finally:
        returns_file.close()
        buf.close()
        env.close()
    return added


class ProcessActors:
    """Actors as processes (torch.multiprocessing, spawn), restarted when one dies."""

    def __init__(self, run_dir: str, cfg: dict[str, Any]):
        import torch.multiprocessing as mp

        self.run_dir, self.cfg, self.ctx = run_dir, cfg, mp.get_context("spawn")
        self.procs: list[Any] = [None] * cfg["actors"]
        self.restarts = 0

    def start(self, shard: int) -> None:
        proc = self.ctx.Process(target=run_actor, args=(self.run_dir, shard, self.cfg, os.getpid()),
                                name=f"actor-{shard}", daemon=True)
        proc.start()
        self.procs[shard] = proc
        say(f"actor {shard} started (pid {proc.pid})")

    def start_all(self) -> None:
        for shard in range(len(self.procs)):
            self.start(shard)

    def revive(self) -> None:
        """Restart every actor that died."""
        for shard, proc in enumerate(self.procs):
            if not proc.is_alive():
                say(f"actor {shard} (pid {proc.pid}) exited with code {proc.exitcode}: restarting it")
                self.restarts += 1
                if self.restarts > self.cfg["max_actor_restarts"]:
                    raise RuntimeError(f"actors were restarted {self.restarts - 1} times: giving up")
                self.start(shard)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Wait for the actors to see the stop file; terminate those that do not in time."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            if proc is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.terminate()
                    proc.join()


class RayActors:
    """Actors as Ray actors (``ray.remote``) running the same `run_actor`. A local Ray instance
    is started; with ``RAY_ADDRESS`` set, that cluster is joined (``--run-dir`` must then be a
    folder every node sees at the same path)."""

    def __init__(self, run_dir: str, cfg: dict[str, Any]):
        try:
            import ray
        except ImportError:
            raise SystemExit('--launcher ray needs Ray: pip install "diskreplay[ray]"') from None

        self.ray, self.run_dir, self.cfg = ray, run_dir, cfg
        if os.environ.get("RAY_ADDRESS"):
            ray.init(configure_logging=False)
        else:
            ray.init(num_cpus=max(cfg["actors"], os.cpu_count() or 1), include_dashboard=False,
                     configure_logging=False)
        self.remote_class = ray.remote(num_cpus=1, max_restarts=0)(RayActor)
        self.handles: list[Any] = [None] * cfg["actors"]
        self.runs: list[Any] = [None] * cfg["actors"]
        self.restarts = 0

    def start(self, shard: int) -> None:
        self.handles[shard] = self.remote_class.remote()
        self.runs[shard] = self.handles[shard].run.remote(self.run_dir, shard, self.cfg)
        say(f"actor {shard} started (ray actor)")

    def start_all(self) -> None:
        for shard in range(len(self.handles)):
            self.start(shard)

    def revive(self) -> None:
        for shard, run in enumerate(self.runs):
            done, _ = self.ray.wait([run], timeout=0)
            if done:
                try:
                    result = f"returned {self.ray.get(run)}"
                except Exception as exc:  # the actor died (killed, or raised)
                    result = f"failed ({type(exc).__name__})"
                say(f"actor {shard} {result}: restarting it")
                self.restarts += 1
                if self.restarts > self.cfg["max_actor_restarts"]:
                    raise RuntimeError(f"actors were restarted {self.restarts - 1} times: giving up")
                self.start(shard)

    def stop(self, timeout_s: float = 30.0) -> None:
        runs = [run for run in self.runs if run is not None]
        _, late = self.ray.wait(runs, num_returns=len(runs), timeout=timeout_s) if runs else ([], [])
        for shard, run in enumerate(self.runs):
            if run in late:
                self.ray.kill(self.handles[shard])
        self.ray.shutdown()


class RayActor:
    """The Ray actor class (made remote by `RayActors`): one `run_actor` call."""

    def run(self, run_dir: str, shard: int, cfg: dict[str, Any]) -> int:
        return run_actor(run_dir, shard, cfg)


# ---- learner ---------------------------------------------------------------------------------


def checkpoints(root: str) -> list[str]:
    """Complete checkpoints, oldest first (a temporary folder is complete once renamed)."""
    return sorted(glob.glob(os.path.join(root, CHECKPOINT_PREFIX + "[0-9]" * 8)))


class Learner:
    """DQN (double, prioritized, optionally n-step) from the union of the shards."""

    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any]):
        self.args, self.cfg, self.where = args, cfg, paths(args.run_dir)
        torch.manual_seed(args.seed)
        self.q, self.target = qnet(), qnet()
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=args.lr)
        self.sampler = lambda: dr.Prioritized(alpha=args.alpha, beta=args.beta)
        # a short timeout: the main loop then restarts dead actors, and waits again
        self.limiter = rate_limiter(cfg, timeout_s=5.0)
        os.makedirs(self.where["checkpoints"], exist_ok=True)
        for leftover in glob.glob(os.path.join(self.where["checkpoints"], ".tmp-*")):
            shutil.rmtree(leftover)  # a checkpoint a kill interrupted
        saved = checkpoints(self.where["checkpoints"])
        self.update = self.start_update = 0
        if saved:
            state = torch.load(os.path.join(saved[-1], "model.pt"), weights_only=True)
            self.q.load_state_dict(state["q"])
            self.target.load_state_dict(state["target"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.update = self.start_update = int(state["update"])
            # the learner's side of the buffer as it was: priorities, generator, rows sampled
            self.buf = dr.ReplayBuffer.load_snapshot(os.path.join(saved[-1], "buffer"), mode="r",
                                                     url=self.where["buffer"], sampler=self.sampler(),
                                                     rate_limiter=self.limiter)
            say(f"resumed from checkpoint {os.path.basename(saved[-1])} at update {self.update} "
                f"({len(self.buf):,} rows committed in {self.buf.shards} shards)")
        else:
            self.target.load_state_dict(self.q.state_dict())
            self.buf = dr.ReplayBuffer.open(self.where["buffer"], "r", sampler=self.sampler(), seed=args.seed,
                                            rate_limiter=self.limiter)
            say(f"starting at update 0 with {self.buf.shards} shards")
        self.saved_update = self.update
        self.losses: list[float] = []
        self.publish_weights()

    def publish_weights(self) -> None:
        atomic_torch_save(self.q.state_dict(), self.where["weights"])

    def checkpoint(self) -> None:
        """Networks, optimizer and the buffer's learner state, together, in a new folder."""
        root = self.where["checkpoints"]
        tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-")
        torch.save({"q": self.q.state_dict(), "target": self.target.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "update": self.update}, os.path.join(tmp, "model.pt"))
        self.buf.save_snapshot(os.path.join(tmp, "buffer"))
        fsync_tree(tmp)  # the rows it refers to are durable already: the actors' commits are
        os.rename(tmp, os.path.join(root, f"{CHECKPOINT_PREFIX}{self.update:08d}"))
        fsync_dir(root)
        for old in checkpoints(root)[:-KEEP_CHECKPOINTS]:
            shutil.rmtree(old)
        self.saved_update = self.update

    def step(self) -> float:
        """One update from one prioritized batch. Raises dr.RateLimitTimeout when the actors fall behind."""
        args = self.args
        beta = args.beta + (1.0 - args.beta) * min(1.0, self.update / max(1, args.updates))
        raw = self.buf.sample(args.batch_size, n_step=args.n_step, gamma=args.gamma, beta=beta)
        b = {k: torch.as_tensor(v) for k, v in raw.items()}
        with torch.no_grad():  # double DQN: the online net picks, the target net values
            best = self.q(b["next_obs"]).argmax(1, keepdim=True)
            y = b["reward"] + b["discount"] * self.target(b["next_obs"]).gather(1, best).squeeze(1)
        q_taken = self.q(b["obs"]).gather(1, b["action"][:, None]).squeeze(1)
        td = q_taken - y
        loss = (b["weight"] * nn.functional.smooth_l1_loss(q_taken, y, reduction="none")).mean()
        self.optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(self.q.parameters(), 10.0)
        self.optimizer.step()
        self.buf.update_priorities(raw["index"], td.detach().abs().numpy())
        self.update += 1
        return loss.item()

    def train(self, actors: ProcessActors | RayActors, stop: StopRequest) -> None:
        args = self.args
        while self.update < args.updates and not stop.signal:
            try:
                self.losses.append(self.step())
            except dr.RateLimitTimeout:
                actors.revive()  # the actors may have died: the learner waits for rows
                continue
            if self.update % args.refresh_every == 0:
                self.buf.refresh()  # adopt every shard's newest commit
                actors.revive()
            if self.update % args.target_every == 0:
                self.target.load_state_dict(self.q.state_dict())
            if self.update % args.publish_every == 0:
                self.publish_weights()
            if self.update % args.checkpoint_every == 0:
                self.checkpoint()
                say(f"update {self.update:6d}  loss {np.mean(self.losses[-100:]):8.4f}  "
                    f"rows {len(self.buf):,}  {recent_returns(args.run_dir, args.actors)}  checkpoint saved")


# ---- main ------------------------------------------------------------------------------------


class StopRequest:
    """SIGINT/SIGTERM: the learner stops after its current update (a second one stops it at once)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum  # no print here: the signal may have come in the midst of one


def recent_returns(run_dir: str, actors: int, last: int = 20) -> str:
    returns = read_returns(run_dir, actors)
    recent = [r for _, r in returns[-last:]]
    return f"episodes {len(returns):,}  mean return (last {len(recent)}) {np.mean(recent) if recent else 0.0:6.1f}"


def read_returns(run_dir: str, actors: int) -> list[tuple[float, float]]:
    """``(time, return)`` of every episode the actors finished, oldest first."""
    out = []
    for shard in range(actors):
        try:
            with open(os.path.join(run_dir, f"returns-{shard}.txt")) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 2 and line.endswith("\n"):  # a kill may cut the last line
                        out.append((float(parts[0]), float(parts[1])))
        except FileNotFoundError:
            pass
    return sorted(out)


def open_or_create_buffer(url: str, args: argparse.Namespace) -> None:
    # A sharded buffer's root group (zarr.json) is written last at create: without it there is
    # no buffer yet, or a create that a kill interrupted (which never opens): create it anew.
    if not os.path.exists(os.path.join(url, "zarr.json")):
        dr.ReplayBuffer.create(url, FIELDS, capacity=args.capacity, shards=args.actors, chunk_rows=args.chunk_rows,
                               overwrite=True).close()
    with dr.ReplayBuffer.open(url) as union:
        if union.shards != args.actors:
            raise SystemExit(f"{url} has {union.shards} shards: run with --actors {union.shards}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog="Kill it at any time (all of it, or single actors) and rerun it with the same --run-dir: the "
               "learner resumes\nfrom its newest checkpoint, the actors reopen their shards. The module "
               "docstring describes --run-dir.")
    p.add_argument("--run-dir", default="runs/actors_learner", help="buffer, weights, checkpoints and returns")
    p.add_argument("--actors", type=int, default=2, help="actors, one shard each (fixed once the buffer exists)")
    p.add_argument("--launcher", choices=("process", "ray"), default="process",
                   help='actors as spawned processes, or as Ray actors (pip install "diskreplay[ray]")')
    p.add_argument("--updates", type=int, default=2000, help="stop when the learner has done this many updates")
    p.add_argument("--torch-threads", type=int, default=1, help="the learner's torch threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the networks, the sampler and the actors")
    g = p.add_argument_group("learner")
    g.add_argument("--batch-size", type=int, default=64, help="rows per update")
    g.add_argument("--lr", type=float, default=5e-4, help="Adam's learning rate")
    g.add_argument("--gamma", type=float, default=0.99, help="discount")
    g.add_argument("--n-step", type=int, default=3, help="n-step returns (1: one-step TD)")
    g.add_argument("--alpha", type=float, default=0.6, help="priority exponent")
    g.add_argument("--beta", type=float, default=0.4, help="importance-weight exponent, annealed to 1 over --updates")
    g.add_argument("--target-every", type=int, default=100, help="copy the network to the target net (updates)")
    g.add_argument("--refresh-every", type=int, default=10, help="adopt the shards' newest commits (updates)")
    g.add_argument("--publish-every", type=int, default=20, help="write weights.pt for the actors (updates)")
    g.add_argument("--checkpoint-every", type=int, default=500, help="checkpoint period (updates)")
    g = p.add_argument_group("replay and rate limit")
    g.add_argument("--capacity", type=int, default=50_000, help="rows per shard, a ring (at buffer creation)")
    g.add_argument("--chunk-rows", type=int, default=1024, help="rows per stored chunk (at buffer creation)")
    g.add_argument("--samples-per-insert", type=float, default=8.0,
                   help="sampled rows per inserted row that the rate limiter keeps")
    g.add_argument("--learning-starts", type=int, default=1000,
                   help="rows inserted (all shards) before the learner samples")
    g.add_argument("--flush-every", type=int, default=32,
                   help="an actor commits, and checks the rate limit, every this many steps")
    g.add_argument("--max-actor-restarts", type=int, default=20,
                   help="give up after restarting dead actors this many times")
    args = p.parse_args(argv)
    for name in ("actors", "updates", "batch_size", "n_step", "target_every", "refresh_every", "publish_every",
                 "checkpoint_every", "capacity", "chunk_rows", "learning_starts", "flush_every", "torch_threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.samples_per_insert <= 0:
        p.error("--samples-per-insert must be > 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.run_dir = os.path.abspath(args.run_dir)  # the actors may not share our working directory (Ray)
    torch.set_num_threads(args.torch_threads)
    where = paths(args.run_dir)
    os.makedirs(args.run_dir, exist_ok=True)
    if os.path.exists(where["stop"]):
        os.unlink(where["stop"])  # left by the run before
    open_or_create_buffer(where["buffer"], args)
    cfg = {"actors": args.actors, "seed": args.seed, "batch_size": args.batch_size, "flush_every": args.flush_every,
           "samples_per_insert": args.samples_per_insert, "learning_starts": args.learning_starts,
           "max_actor_restarts": args.max_actor_restarts}
    actors = RayActors(args.run_dir, cfg) if args.launcher == "ray" else ProcessActors(args.run_dir, cfg)
    learner = Learner(args, cfg)
    stop = StopRequest()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        actors.start_all()
        learner.train(actors, stop)
    finally:
        with open(where["stop"], "w"):
            pass
        actors.stop()
    if learner.update != learner.saved_update:
        learner.checkpoint()
    if stop.signal:
        say(f"{signal.Signals(stop.signal).name}: stopped at update {learner.update}, checkpoint saved; "
            f"run again to resume")
    learner.publish_weights()
    rows_sampled = int(learner.buf.state_dict()["samples"])
    learner.buf.close()
    with dr.ReplayBuffer.open(where["buffer"]) as union:
        rows = [int(n) for n in union.window()[1].reshape(union.shards, -1).sum(axis=1)]  # steps each shard added
    returns = read_returns(args.run_dir, args.actors)
    recent = [r for _, r in returns[-20:]]
    summary = {"updates": learner.update, "start_update": learner.start_update, "rows_per_shard": rows,
               "episodes": len(returns), "mean_recent_return": float(np.mean(recent)) if recent else None,
               "rows_sampled": rows_sampled, "actor_restarts": actors.restarts,
               "stopped_by_signal": signal.Signals(stop.signal).name if stop.signal else None}
    with open(where["summary"] + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(where["summary"] + ".tmp", where["summary"])
    say(f"done: {learner.update} updates (this run from update {learner.start_update}), rows per shard {rows}, "
        f"{recent_returns(args.run_dir, args.actors)}")
    return summary


if __name__ == "__main__":
    sys.exit(1 if main()["stopped_by_signal"] else 0)
