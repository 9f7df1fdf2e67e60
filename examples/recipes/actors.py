"""Actors on several machines, one learner: examples/actors_learner.py, one command per host.

    # once, by the launcher (any host): the sharded buffer, one shard per actor
    python examples/recipes/actors.py create --run-dir /shared/apex --actors 4
    # on each actor host i (0..3): writes shard i only, until the learner is done
    python examples/recipes/actors.py actor --run-dir /shared/apex --actors 4 --shard i
    # on the learner host (a GPU): samples the union, publishes weights, checkpoints
    python examples/recipes/actors.py learner --run-dir /shared/apex --actors 4 --updates 20000

``examples/actors_learner.py`` starts its actors itself (local processes, or Ray actors with
``--launcher ray``); this front runs its parts as separate commands, for a cluster scheduler that
starts one job per host (SLURM arrays, Kubernetes jobs). ``--run-dir`` must be one folder every
host sees at the same path (NFS, Lustre, a shared volume): it holds the buffer (unless ``--url``
puts it on object storage), the learner's weights (``weights.pt``, read by the actors), its
checkpoints, each actor's episode returns (``returns-<i>.txt``) and the ``stop`` file the learner
writes when it is done (`FileBoard`: the example's processes share these through memory, its Ray
actors through a Ray actor). Every command takes the example's flags, and actors and learner must be
given the same rate-limit flags (``--samples-per-insert``, ``--learning-starts``, ``--flush-every``,
``--batch-size``). Kill any of them at any time and start it again: an actor reopens its shard
(the dead writer's lock is taken over), the learner resumes from its newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import actors_learner as al

ROLES = ("create", "actor", "learner")


class ElsewhereActors:
    """The learner's view of actors that run on other hosts: nothing to start or restart here
    (the scheduler restarts a dead actor), and stopping them is the ``stop`` file."""

    restarts = 0

    def revive(self) -> None:
        pass


class FileBoard:
    """What learner and actors share besides the buffer (the example's board), as files in the
    shared ``run_dir``: ``weights.pt`` (replaced atomically; its modification time is the version),
    ``stop``, and each actor's episode returns in ``returns-<shard>.txt``."""

    def __init__(self, run_dir: str, shard: int | None = None):
        self.run_dir, self.shard = run_dir, shard
        self.weights, self.stop_file = os.path.join(run_dir, "weights.pt"), os.path.join(run_dir, "stop")

    def publish(self, weights: Any) -> None:
        tmp = f"{self.weights}.tmp-{os.getpid()}"
        al.torch.save(weights, tmp)
        os.replace(tmp, self.weights)

    def poll(self, version: int) -> tuple[bool, int, Any]:
        stop = os.path.exists(self.stop_file)
        try:
            mtime = os.stat(self.weights).st_mtime_ns
            if mtime != version:
                return stop, mtime, al.torch.load(self.weights, weights_only=True)
        except FileNotFoundError:  # not published yet (or being replaced): ask again next time
            pass
        return stop, version, None

    def stop(self) -> None:
        with open(self.stop_file, "w"):
            pass

    def report(self, episode_return: float) -> None:
        with open(os.path.join(self.run_dir, f"returns-{self.shard}.txt"), "a") as f:
            f.write(f"{al.time.time():.6f} {episode_return:g}\n")

    def drain(self) -> list[tuple[float, float]]:
        return []  # the actors' returns stay in their files


def learner(args: Any, cfg: dict[str, Any]) -> int:
    """Train until ``--updates``, then write the stop file; returns the updates done."""
    al.torch.set_num_threads(args.torch_threads)
    board = FileBoard(args.run_dir)
    learner = al.Learner(args, cfg, board)
    stop = al.StopRequest()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        learner.train(ElsewhereActors(), stop)
    finally:
        if learner.update != learner.saved_update:
            learner.checkpoint()
        board.publish(al.flat_weights(learner.q))
        if not stop.signal:  # done: the actors stop (a stopped learner leaves them waiting for its restart)
            board.stop()
    learner.buf.close()
    al.say(f"learner done: {learner.update} updates (this run from update {learner.start_update})")
    return learner.update


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ROLES:
        raise SystemExit(f"usage: actors.py {{{','.join(ROLES)}}} [--shard I] [actors_learner.py flags]")
    role, rest, shard = argv[0], argv[1:], None
    if "--shard" in rest:
        at = rest.index("--shard")
        shard, rest = int(rest[at + 1]), rest[:at] + rest[at + 2:]
    args = al.parse_args(rest)
    cfg = al.settings(args)
    if role == "create":
        os.makedirs(args.run_dir, exist_ok=True)
        stop = os.path.join(args.run_dir, "stop")
        if os.path.exists(stop):
            os.unlink(stop)  # left by the run before
        al.open_or_create_buffer(args, args.storage_options)
        al.say(f"{args.url}: {args.actors} shards")
        return 0
    if role == "actor":
        if shard is None or not 0 <= shard < args.actors:
            raise SystemExit(f"actor: --shard must be one of 0..{args.actors - 1}")
        added = al.run_actor(FileBoard(args.run_dir, shard), shard, cfg)
        al.say(f"actor {shard} done: {added} steps added")
        return 0
    return learner(args, cfg)


if __name__ == "__main__":
    main()
