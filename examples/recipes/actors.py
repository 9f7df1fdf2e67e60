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
host sees at the same path (NFS, Lustre, a shared volume): it holds the buffer, the learner's
weights (``weights.pt``, read by the actors), its checkpoints and the ``stop`` file the learner
writes when it is done. Every command takes the example's flags, and actors and learner must be
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


def config(args: Any) -> dict[str, Any]:
    """The settings actors and learner share (`actors_learner.main` builds the same)."""
    return {"actors": args.actors, "seed": args.seed, "batch_size": args.batch_size, "flush_every": args.flush_every,
            "samples_per_insert": args.samples_per_insert, "learning_starts": args.learning_starts,
            "max_actor_restarts": args.max_actor_restarts}


def learner(args: Any) -> int:
    """Train until ``--updates``, then write the stop file; returns the updates done."""
    where = al.paths(args.run_dir)
    al.torch.set_num_threads(args.torch_threads)
    learner = al.Learner(args, config(args))
    stop = al.StopRequest()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        learner.train(ElsewhereActors(), stop)
    finally:
        if learner.update != learner.saved_update:
            learner.checkpoint()
        learner.publish_weights()
        if not stop.signal:  # done: the actors stop (a stopped learner leaves them waiting for its restart)
            with open(where["stop"], "w"):
                pass
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
    args.run_dir = os.path.abspath(args.run_dir)
    where = al.paths(args.run_dir)
    if role == "create":
        os.makedirs(args.run_dir, exist_ok=True)
        if os.path.exists(where["stop"]):
            os.unlink(where["stop"])  # left by the run before
        al.open_or_create_buffer(where["buffer"], args)
        al.say(f"{where['buffer']}: {args.actors} shards")
        return 0
    if role == "actor":
        if shard is None or not 0 <= shard < args.actors:
            raise SystemExit(f"actor: --shard must be one of 0..{args.actors - 1}")
        added = al.run_actor(args.run_dir, shard, config(args))
        al.say(f"actor {shard} done: {added} steps added")
        return 0
    return learner(args)


if __name__ == "__main__":
    main()
