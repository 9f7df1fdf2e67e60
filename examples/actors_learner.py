"""Distributed prioritized DQN on CartPole-v1: actor processes and one learner that share one sharded buffer.

    python examples/actors_learner.py --run-dir runs/apex --actors 4 --updates 20000   # kill it, rerun to resume
    python examples/actors_learner.py --launcher ray --url s3://bucket/apex             # Ray actors, rows on S3
    RAY_ADDRESS=head:6379 python examples/actors_learner.py --launcher ray --url s3://bucket/apex   # a cluster

Each actor runs its own CartPole-v1 with an epsilon-greedy copy of the Q-network (Ape-X style:
actor i of N explores with epsilon 0.4 ** (1 + 7 i / (N - 1))) and writes its transitions to its
own shard of one sharded diskreplay buffer at ``--url`` (a local folder, or ``s3://...`` with
``--storage-options``), committing every ``--flush-every`` steps. The learner (the main process)
samples the union of the shards with prioritized replay (optionally n-step returns), updates the
priorities from its TD errors, adopts the shards' newest commits every ``--refresh-every``
updates, and publishes its weights for the actors. A ``dr.RateLimiter`` keeps about
``--samples-per-insert`` sampled rows per inserted row: the learner waits in ``sample`` when it
runs ahead, the actors wait before inserting when they do.

The rows go only through the buffer. Everything else goes through the launcher, never through a
shared filesystem: with ``--launcher process`` (spawned processes) the weights are a tensor in
shared memory, the stop signal an event and the episode returns a queue; with ``--launcher ray``
they live in one Ray actor (`Board`), and the rate limiter's counts in another
(``diskreplay.ray.EngineCounts``): an actor's rate-limit check is a message, not a store request.

``--run-dir`` is the learner's own folder (its disk only):

    checkpoints/update-NNNNNNNN/  model.pt (networks, optimizer, update count) + buffer/ (the
                                  learner's buffer state: priorities, generator, rows sampled),
                                  written to a temporary folder that is then renamed: a kill
                                  never leaves a half-written checkpoint; the newest two are kept
    returns.txt                   the return of every episode the actors finished
    summary.json                  written when the learner finishes
    buffer/                       the buffer, unless ``--url`` puts it elsewhere

Kill-and-restart: kill everything at any time (``kill -9`` of the process group, power off) and
run the same command again: the learner restarts from its newest checkpoint (rows the actors
committed since are new rows to it, at the highest priority) and every actor reopens its shard
(the writer lock the killed actor left is taken over, with a warning, and its cut episode is
closed as truncated; a lock left on another host is taken over once its lease expired). An
existing buffer is never created anew. An actor that dies while the learner runs is restarted.
Ctrl-C or SIGTERM stop the learner after its current update (a second one: at once), then it
checkpoints. When the learner has done ``--updates`` updates, the actors are stopped, and a
summary is printed and written to ``summary.json``.
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


def rate_limiter(cfg: dict[str, Any], timeout_s: float = 600.0) -> dr.RateLimiter:
    """The one limit learner and actors keep to (both must build it from the same settings)."""
    # the limiter's rule of thumb, doubled: a batch plus what an actor adds between two checks
    error_buffer = float(cfg["batch_size"] + cfg["samples_per_insert"] * cfg["flush_every"])
    return dr.RateLimiter(samples_per_insert=cfg["samples_per_insert"], error_buffer=error_buffer,
                          min_size=cfg["learning_starts"], timeout_s=timeout_s, counts=cfg["counts"])


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


def flat_weights(q: nn.Module) -> torch.Tensor:
    return nn.utils.parameters_to_vector(q.parameters()).detach()


# ---- what the learner and the actors share besides the buffer ------------------------------------


class ProcessBoard:
    """Weights, stop signal and episode returns for actor processes: a tensor in shared memory
    with a version counter, an event and a queue (they travel to spawned processes as arguments)."""

    def __init__(self, ctx: Any):
        self.weights = flat_weights(qnet()).share_memory_()
        self.version = ctx.Value("q", 0)
        self.stopped = ctx.Event()
        self.returns = ctx.Queue()

    def publish(self, weights: torch.Tensor) -> None:
        with self.version.get_lock():
            self.weights.copy_(weights)
            self.version.value += 1

    def poll(self, version: int) -> tuple[bool, int, torch.Tensor | None]:
        """``(stop, newest version, its weights if newer than ``version``)``."""
        with self.version.get_lock():
            newest = self.version.value
            return self.stopped.is_set(), newest, self.weights.clone() if newest != version else None

    def stop(self) -> None:
        self.stopped.set()

    def report(self, episode_return: float) -> None:
        self.returns.put((time.time(), episode_return))

    def drain(self) -> list[tuple[float, float]]:
        """The episode returns reported since the last drain, as ``(time, return)``."""
        out = []
        while not self.returns.empty():
            out.append(self.returns.get())
        return out


class Board:
    """The same, kept by one Ray actor (`RayBoard` is its client)."""

    def __init__(self) -> None:
        self.version, self.weights, self.stopped = 0, None, False
        self.returns: list[tuple[float, float]] = []

    def publish(self, weights: torch.Tensor) -> None:
        self.version, self.weights = self.version + 1, weights

    def poll(self, version: int) -> tuple[bool, int, torch.Tensor | None]:
        return self.stopped, self.version, self.weights if self.version != version else None

    def stop(self) -> None:
        self.stopped = True

    def report(self, when: float, episode_return: float) -> None:
        self.returns.append((when, episode_return))

    def drain(self) -> list[tuple[float, float]]:
        out, self.returns = self.returns, []
        return out


class RayBoard:
    """`ProcessBoard`'s interface over a `Board` actor: one message per call."""

    def __init__(self, ray: Any):
        self.ray, self.actor = ray, ray.remote(num_cpus=0)(Board).remote()

    def publish(self, weights: torch.Tensor) -> None:
        self.actor.publish.remote(weights)

    def poll(self, version: int) -> tuple[bool, int, torch.Tensor | None]:
        return self.ray.get(self.actor.poll.remote(version))

    def stop(self) -> None:
        self.ray.get(self.actor.stop.remote())

    def report(self, episode_return: float) -> None:
        self.actor.report.remote(time.time(), episode_return)

    def drain(self) -> list[tuple[float, float]]:
        return self.ray.get(self.actor.drain.remote())


# ---- actors ----------------------------------------------------------------------------------


def actor_epsilon(shard: int, actors: int) -> float:
    """Ape-X's fixed exploration rates: 0.4 for actor 0 down to 0.4 ** 8 for the last one."""
    return 0.4 ** (1 + 7 * shard / (actors - 1)) if actors > 1 else 0.4


def open_shard(shard: int, cfg: dict[str, Any]) -> dr.ReplayBuffer:
    """Shard ``shard`` as its writer. Reopening the shard of a killed actor takes its writer lock
    over (with a warning) and closes the episode the kill cut as truncated; the rows it committed
    stay. A Ray actor may be restarted on another host: `ShardOwner` then waits until the dead
    writer's lease has expired."""
    options = {"storage_options": cfg["storage_options"], "rate_limiter": rate_limiter(cfg)}
    if cfg["launcher"] == "ray":
        from diskreplay.ray import ShardOwner

        return ShardOwner(cfg["url"], shard, lease_s=cfg["lease_s"], **options).buffer
    return dr.ReplayBuffer.open_shard(cfg["url"], shard, lease_s=cfg["lease_s"], **options)


def run_actor(board: ProcessBoard | RayBoard, shard: int, cfg: dict[str, Any], parent_pid: int | None = None) -> int:
    """Actor ``shard``: play CartPole-v1 and write every step to shard ``shard`` until the board
    says stop (or, with ``parent_pid``, that process is gone). Returns the steps it added. Run it
    again after a kill: it reopens its shard."""
    import gymnasium as gym  # imported here: the learner does not need it

    torch.set_num_threads(1)
    if parent_pid is not None:  # a process of ours: Ctrl-C is the main process's to handle (it stops us)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    buf = open_shard(shard, cfg)
    # a restarted actor draws new random numbers: the steps its shard holds are part of the seed
    steps = int(buf.window()[1].sum())
    say(f"actor {shard} (pid {os.getpid()}) opened shard {shard} ({steps} rows were committed before)")
    rng = np.random.default_rng([cfg["seed"], shard, steps])
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=int(rng.integers(2**31)))
    epsilon = actor_epsilon(shard, cfg["actors"])
    q, version = qnet(), 0
    episode_return, added = 0.0, 0

    def stopping() -> bool:
        nonlocal version
        stop, newest, weights = board.poll(version)
        if weights is not None:
            nn.utils.vector_to_parameters(weights, q.parameters())
            version = newest
        return stop or (parent_pid is not None and os.getppid() != parent_pid)

    try:
        while not stopping():
            if not buf.insert_allowed(cfg["flush_every"]):
                # The learner is behind: wait for it. Our staged rows are committed first, as the
                # learner counts committed rows only (and we count ours, staged ones too).
                buf.flush()
                while not buf.insert_allowed(cfg["flush_every"]) and not stopping():
                    time.sleep(0.01)
                continue
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
                    board.report(episode_return)
                    obs, episode_return = env.reset()[0], 0.0
            buf.flush()  # a commit: the learner sees these rows at its next refresh
    finally:
        buf.close()
        env.close()
    return added


class ProcessActors:
    """Actors as processes (torch.multiprocessing, spawn), restarted when one dies."""

    def __init__(self, cfg: dict[str, Any]):
        import torch.multiprocessing as mp

        self.cfg, self.ctx = cfg, mp.get_context("spawn")
        self.board = ProcessBoard(self.ctx)
        self.procs: list[Any] = [None] * cfg["actors"]
        self.restarts = 0

    def start(self, shard: int) -> None:
        proc = self.ctx.Process(target=run_actor, args=(self.board, shard, self.cfg, os.getpid()),
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

    def stop(self, timeout_s: float = 30.0) -> list[tuple[float, float]]:
        """Tell the actors to stop and wait for them (terminating those that do not stop in
        time); the episode returns they reported last."""
        self.board.stop()
        returns, deadline = [], time.monotonic() + timeout_s
        for proc in self.procs:
            while proc is not None and proc.is_alive() and time.monotonic() < deadline:
                returns += self.board.drain()  # an exiting actor waits until its queue is read
                proc.join(0.05)
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join()
        return returns + self.board.drain()


class RayActors:
    """Actors as Ray actors (``ray.remote``) running the same `run_actor`. A local Ray instance
    is started; with ``RAY_ADDRESS`` set, that cluster is joined (``--url`` must then be a
    location every node reaches: object storage, or a folder every node sees at the same path)."""

    def __init__(self, ray: Any, cfg: dict[str, Any]):
        self.ray, self.cfg = ray, cfg
        self.board = RayBoard(ray)
        self.remote_class = ray.remote(num_cpus=1, max_restarts=0)(RayActor)
        self.handles: list[Any] = [None] * cfg["actors"]
        self.runs: list[Any] = [None] * cfg["actors"]
        self.restarts = 0

    def start(self, shard: int) -> None:
        self.handles[shard] = self.remote_class.remote()
        self.runs[shard] = self.handles[shard].run.remote(self.board, shard, self.cfg)
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

    def stop(self, timeout_s: float = 30.0) -> list[tuple[float, float]]:
        self.board.stop()
        runs = [run for run in self.runs if run is not None]
        _, late = self.ray.wait(runs, num_returns=len(runs), timeout=timeout_s) if runs else ([], [])
        for shard, run in enumerate(self.runs):
            if run in late:
                self.ray.kill(self.handles[shard])
        returns = self.board.drain()
        self.ray.shutdown()
        return returns


class RayActor:
    """The Ray actor class (made remote by `RayActors`): one `run_actor` call."""

    def run(self, board: RayBoard, shard: int, cfg: dict[str, Any]) -> int:
        return run_actor(board, shard, cfg)


# ---- learner ---------------------------------------------------------------------------------


def checkpoints(root: str) -> list[str]:
    """Complete checkpoints, oldest first (a temporary folder is complete once renamed)."""
    return sorted(glob.glob(os.path.join(root, CHECKPOINT_PREFIX + "[0-9]" * 8)))


class Learner:
    """DQN (double, prioritized, optionally n-step) from the union of the shards."""

    def __init__(self, args: argparse.Namespace, cfg: dict[str, Any], board: ProcessBoard | RayBoard):
        self.args, self.cfg, self.board = args, cfg, board
        self.root = os.path.join(args.run_dir, "checkpoints")
        torch.manual_seed(args.seed)
        self.q, self.target = qnet(), qnet()
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=args.lr)
        # a short timeout: the main loop then restarts dead actors, and waits again
        options = {"sampler": dr.Prioritized(alpha=args.alpha, beta=args.beta),
                   "rate_limiter": rate_limiter(cfg, timeout_s=5.0), "storage_options": cfg["storage_options"]}
        os.makedirs(self.root, exist_ok=True)
        for leftover in glob.glob(os.path.join(self.root, ".tmp-*")):
            shutil.rmtree(leftover)  # a checkpoint a kill interrupted
        saved = checkpoints(self.root)
        self.update = self.start_update = 0
        if saved:
            state = torch.load(os.path.join(saved[-1], "model.pt"), weights_only=True)
            self.q.load_state_dict(state["q"])
            self.target.load_state_dict(state["target"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.update = self.start_update = int(state["update"])
            # the learner's side of the buffer as it was: priorities, generator, rows sampled
            self.buf = dr.ReplayBuffer.load_snapshot(os.path.join(saved[-1], "buffer"), mode="r", url=cfg["url"],
                                                     **options)
            say(f"resumed from checkpoint {os.path.basename(saved[-1])} at update {self.update} "
                f"({len(self.buf):,} rows committed in {self.buf.shards} shards)")
        else:
            self.target.load_state_dict(self.q.state_dict())
            self.buf = dr.ReplayBuffer.open(cfg["url"], "r", seed=args.seed, **options)
            say(f"starting at update 0 with {self.buf.shards} shards")
        self.saved_update = self.update
        self.losses: list[float] = []
        self.board.publish(flat_weights(self.q))

    def checkpoint(self) -> None:
        """Networks, optimizer and the buffer's learner state, together, in a new folder."""
        tmp = tempfile.mkdtemp(dir=self.root, prefix=".tmp-")
        torch.save({"q": self.q.state_dict(), "target": self.target.state_dict(),
                    "optimizer": self.optimizer.state_dict(), "update": self.update}, os.path.join(tmp, "model.pt"))
        self.buf.save_snapshot(os.path.join(tmp, "buffer"))
        fsync_tree(tmp)  # the rows it refers to are durable already: the actors' commits are
        os.rename(tmp, os.path.join(self.root, f"{CHECKPOINT_PREFIX}{self.update:08d}"))
        fsync_dir(self.root)
        for old in checkpoints(self.root)[:-KEEP_CHECKPOINTS]:
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
                record_returns(args.run_dir, self.board.drain())
                actors.revive()
            if self.update % args.target_every == 0:
                self.target.load_state_dict(self.q.state_dict())
            if self.update % args.publish_every == 0:
                self.board.publish(flat_weights(self.q))
            if self.update % args.checkpoint_every == 0:
                self.checkpoint()
                say(f"update {self.update:6d}  loss {np.mean(self.losses[-100:]):8.4f}  "
                    f"rows {len(self.buf):,}  {recent_returns(args.run_dir)}  checkpoint saved")


# ---- main ------------------------------------------------------------------------------------


class StopRequest:
    """SIGINT/SIGTERM: the learner stops after its current update (a second one stops it at once)."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signum  # no print here: the signal may have come in the midst of one


def record_returns(run_dir: str, returns: list[tuple[float, float]]) -> None:
    """Append ``(time, return)`` pairs to ``returns.txt`` (a line a kill cut is skipped when read)."""
    if returns:
        with open(os.path.join(run_dir, "returns.txt"), "a") as f:
            f.writelines(f"{when:.6f} {value:g}\n" for when, value in returns)


def read_returns(run_dir: str) -> list[tuple[float, float]]:
    """``(time, return)`` of every episode the actors finished, oldest first."""
    try:
        with open(os.path.join(run_dir, "returns.txt")) as f:
            pairs = [line.split() for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []
    return sorted((float(when), float(value)) for when, value in pairs)


def recent_returns(run_dir: str, last: int = 20) -> str:
    returns = read_returns(run_dir)
    recent = [r for _, r in returns[-last:]]
    return f"episodes {len(returns):,}  mean return (last {len(recent)}) {np.mean(recent) if recent else 0.0:6.1f}"


def open_or_create_buffer(args: argparse.Namespace, storage_options: dict[str, Any] | None) -> None:
    """Open the sharded buffer at ``--url``, or create it where there is none. An existing buffer
    is never created anew; a create that a kill interrupted never opens (a sharded buffer's root
    is written last), so it is created again."""
    try:
        union = dr.ReplayBuffer.open(args.url, storage_options=storage_options)
    except dr.NotABufferError:
        dr.ReplayBuffer.create(args.url, FIELDS, capacity=args.capacity, shards=args.actors,
                               chunk_rows=args.chunk_rows, storage_options=storage_options, overwrite=True).close()
        union = dr.ReplayBuffer.open(args.url, storage_options=storage_options)
    with union:
        if union.shards != args.actors:
            raise SystemExit(f"{args.url} has {union.shards} shards: run with --actors {union.shards}")


def start_ray(cfg: dict[str, Any]) -> Any:
    """A local Ray instance, or the cluster ``RAY_ADDRESS`` names; the rate limiter's counts in a Ray actor."""
    try:
        import ray

        from diskreplay.ray import EngineCounts
    except ImportError:
        raise SystemExit('--launcher ray needs Ray: pip install "diskreplay[ray]"') from None
    if os.environ.get("RAY_ADDRESS"):
        ray.init(configure_logging=False)
    else:
        ray.init(num_cpus=max(cfg["actors"], os.cpu_count() or 1), include_dashboard=False, configure_logging=False)
    cfg["counts"] = EngineCounts()
    return ray


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter,
        epilog="Kill it at any time (all of it, or single actors) and rerun it with the same --run-dir: the "
               "learner resumes\nfrom its newest checkpoint, the actors reopen their shards. The module "
               "docstring describes --run-dir.")
    p.add_argument("--run-dir", default="runs/actors_learner", help="the learner's checkpoints and returns")
    p.add_argument("--url", default=None, help="the buffer: a folder or s3://... (default: RUN_DIR/buffer)")
    p.add_argument("--storage-options", type=json.loads, default=None,
                   help='JSON for fsspec, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\'')
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
    g.add_argument("--lease-s", type=float, default=30.0,
                   help="an actor's writer lease: how soon another host may take a dead actor's shard over")
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


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What actors and learner share (``args`` as `parse_args` gave them): local paths made
    absolute (the actors may not share our working directory), the buffer's URL resolved."""
    args.run_dir = os.path.abspath(args.run_dir)
    args.url = args.url or os.path.join(args.run_dir, "buffer")
    if "://" not in args.url:
        args.url = os.path.abspath(args.url)
    return {"actors": args.actors, "seed": args.seed, "batch_size": args.batch_size, "flush_every": args.flush_every,
            "samples_per_insert": args.samples_per_insert, "learning_starts": args.learning_starts,
            "max_actor_restarts": args.max_actor_restarts, "url": args.url, "storage_options": args.storage_options,
            "lease_s": args.lease_s, "launcher": args.launcher, "counts": None}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cfg = settings(args)
    torch.set_num_threads(args.torch_threads)
    os.makedirs(args.run_dir, exist_ok=True)
    open_or_create_buffer(args, args.storage_options)
    actors = RayActors(start_ray(cfg), cfg) if args.launcher == "ray" else ProcessActors(cfg)
    learner = Learner(args, cfg, actors.board)
    stop = StopRequest()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        actors.start_all()
        learner.train(actors, stop)
    finally:
        record_returns(args.run_dir, actors.stop())
    if learner.update != learner.saved_update:
        learner.checkpoint()
    if stop.signal:
        say(f"{signal.Signals(stop.signal).name}: stopped at update {learner.update}, checkpoint saved; "
            f"run again to resume")
    rows_sampled = int(learner.buf.state_dict()["samples"])
    learner.buf.close()
    with dr.ReplayBuffer.open(args.url, storage_options=args.storage_options) as union:
        rows = [int(n) for n in union.window()[1].reshape(union.shards, -1).sum(axis=1)]  # steps each shard added
    returns = read_returns(args.run_dir)
    recent = [r for _, r in returns[-20:]]
    summary = {"updates": learner.update, "start_update": learner.start_update, "rows_per_shard": rows,
               "episodes": len(returns), "mean_recent_return": float(np.mean(recent)) if recent else None,
               "rows_sampled": rows_sampled, "actor_restarts": actors.restarts,
               "stopped_by_signal": signal.Signals(stop.signal).name if stop.signal else None}
    summary_path = os.path.join(args.run_dir, "summary.json")
    with open(summary_path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(summary_path + ".tmp", summary_path)
    say(f"done: {learner.update} updates (this run from update {learner.start_update}), rows per shard {rows}, "
        f"{recent_returns(args.run_dir)}")
    return summary


if __name__ == "__main__":
    sys.exit(1 if main()["stopped_by_signal"] else 0)
