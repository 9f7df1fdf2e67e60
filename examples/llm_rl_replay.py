"""LLM-style RL from a crash-durable replay buffer: an async generator and a learner that share a folder.

    python examples/llm_rl_replay.py --run-dir runs/llm                  # both: a generator process + the learner
    python examples/llm_rl_replay.py generator --run-dir runs/llm        # or each on its own (any order)
    python examples/llm_rl_replay.py learner --run-dir runs/llm --steps 300

A toy stands in for the language model: a "policy" that is a table of bigram logits over a
vocabulary of ``--vocab`` tokens (numpy only). Rewards favour responses that repeat the prompt's
last token, so the learner's policy visibly improves in a few hundred steps.

The **generator** draws a prompt, samples ``--group`` responses of random lengths from the newest
policy it has read, scores them, computes group-relative advantages (GRPO) and appends each
rollout as one row (prompt tokens, response tokens, per-token log-probs sharing the response's
length through ``length_of``, reward, advantage, the policy version that generated it), then
commits (``flush``): every group is durable once ``flush`` returns. Killed, it reopens the
buffer with ``mode="r+"`` (the dead writer's lock is taken over) and goes on.

The **learner** opens the buffer read-only, adopts the generator's commits (``refresh``), and
each step samples a token-budgeted batch: rows drawn uniformly, in draw order, as many as fit
``--max-tokens`` prompt + response tokens, only rows at most ``--max-lag`` versions behind its
policy (``where={"version": (version - max_lag, None)}``), packed with ``cu_seqlens``. It takes
a clipped policy-gradient step (importance ratios against the stored log-probs) and publishes
the new policy with the next version. After every step it writes ``learner.json`` (policy,
version, step, its generator's state, statistics) to a temporary file, fsyncs it and renames
it: killed, it resumes from its last step with the very batches it would have drawn.

``--run-dir`` holds ``buffer/`` (the replay buffer: a ring of the newest ``--capacity``
rollouts), ``learner.json`` (the learner's checkpoint, which the generator reads for the policy
and the stop flag) and ``summary.json`` (statistics: steps, starts, the largest batch in
tokens, the largest version lag seen).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

import diskreplay as dr

FIELDS = {
    "prompt": dr.Field((None,), "int32"),
    "response": dr.Field((None,), "int32"),
    "logprobs": dr.Field((None,), "float32", length_of="response"),
    "reward": dr.Field((), "float32"),
    "advantage": dr.Field((), "float32"),
    "version": dr.Field((), "int64"),
}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", nargs="?", default="run", choices=["run", "generator", "learner"])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300, help="learner steps (policy versions) in all")
    p.add_argument("--max-tokens", type=int, default=512, help="token budget of a batch (prompt + response)")
    p.add_argument("--max-lag", type=int, default=4, help="sample rows at most this many versions behind")
    p.add_argument("--group", type=int, default=8, help="responses per prompt (one commit)")
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--max-response", type=int, default=16)
    p.add_argument("--capacity", type=int, default=2048,
                   help="a ring of the newest rollouts, so that most rows pass the version filter; 0: keep all")
    p.add_argument("--lr", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ---- files the two processes share -------------------------------------------------------------

def write_json(path: str, data: dict[str, Any]) -> None:
    """Replace ``path`` whole: a temporary file, fsynced, renamed over it."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
            return data
    except FileNotFoundError:
        return None


def policy_of(run_dir: str, vocab: int) -> tuple[np.ndarray, int, bool]:
    """The learner's newest policy (bigram logits), its version, and whether the learner is done."""
    state = read_json(os.path.join(run_dir, "learner.json"))
    if state is None:
        return np.zeros((vocab, vocab)), 0, False
    return np.array(state["logits"]), int(state["version"]), bool(state["done"])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    out: np.ndarray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


# ---- the generator -------------------------------------------------------------------------------

def open_buffer(url: str, capacity: int) -> dr.ReplayBuffer:
    """The buffer to append to: reopened (``mode="r+"``) if it exists, else created."""
    try:
        return dr.ReplayBuffer.open(url, mode="r+")
    except dr.NotABufferError:
        return dr.ReplayBuffer.create(url, FIELDS, capacity=capacity or None, chunk_rows=256)


def rollouts(rng: np.random.Generator, logits: np.ndarray, group: int, max_response: int) -> dict[str, Any]:
    """One prompt and ``group`` responses sampled from the bigram policy, scored, with advantages."""
    vocab = len(logits)
    prompt = rng.integers(0, vocab, rng.integers(2, 6)).astype(np.int32)
    lengths = rng.integers(1, max_response + 1, group)
    logp = log_softmax(logits)
    tokens = np.zeros((group, max_response), np.int32)
    token_logp = np.zeros((group, max_response), np.float32)
    prev = np.full(group, prompt[-1])
    for t in range(max_response):  # one step of every response at once
        u = rng.random(group)[:, None]
        tok = np.minimum((u > np.exp(logp[prev]).cumsum(axis=1)).sum(axis=1), vocab - 1)
        tokens[:, t], token_logp[:, t], prev = tok, logp[prev, tok], tok
    mask = np.arange(max_response) < lengths[:, None]
    reward = ((tokens == prompt[-1]) & mask).sum(axis=1) / lengths
    advantage = (reward - reward.mean()) / (reward.std() + 1e-6)
    return {"prompt": [prompt] * group, "response": (tokens[mask], lengths),
            "logprobs": (token_logp[mask], lengths), "reward": reward.astype(np.float32),
            "advantage": advantage.astype(np.float32)}


def generator(args: argparse.Namespace) -> None:
    buf = open_buffer(os.path.join(args.run_dir, "buffer"), args.capacity)
    rng = np.random.default_rng([args.seed, int(buf.window()[1].sum())])  # a restart: new rollouts
    while True:
        logits, version, done = policy_of(args.run_dir, args.vocab)
        if done:
            break
        rows = rollouts(rng, logits, args.group, args.max_response)
        buf.extend({**rows, "version": np.full(args.group, version)})
        buf.flush()  # committed: these rollouts survive a kill from here on
    print(f"generator: {len(buf)} rollouts committed", flush=True)
    buf.close()


# ---- the learner ---------------------------------------------------------------------------------

def open_reader(url: str) -> dr.ReplayBuffer:
    """The generator's buffer, read-only, once it exists."""
    while True:
        try:
            return dr.ReplayBuffer.open(url, mode="r")
        except dr.NotABufferError:
            time.sleep(0.05)


def next_batch(buf: dr.ReplayBuffer, args: argparse.Namespace, version: int, rng: np.random.Generator) -> Any:
    """A token-budgeted, packed batch of rows at most ``max_lag`` versions behind ``version``,
    waiting for the generator while it has committed none."""
    while True:
        buf.refresh()  # adopt the generator's newest commit
        try:
            return buf.sample_tokens(args.max_tokens, ("prompt", "response"), packed=True, rng=rng,
                                     where={"version": (version - args.max_lag, None)})
        except dr.EmptyBufferError:
            time.sleep(0.02)


def policy_gradient(logits: np.ndarray, batch: dict[str, Any], lr: float, clip: float = 0.2) -> float:
    """A clipped policy-gradient step on the packed responses (in place); returns the mean reward."""
    tokens, cu = batch["response"], batch["response_cu_seqlens"]
    lengths = np.diff(cu)
    prev = np.empty_like(tokens)
    prev[1:] = tokens[:-1]
    prev[cu[:-1]] = batch["prompt"][batch["prompt_cu_seqlens"][1:] - 1]  # each response follows its prompt
    logp = log_softmax(logits)
    ratio = np.exp(logp[prev, tokens] - batch["logprobs"])
    adv = np.repeat(batch["advantage"], lengths)
    live = np.where(adv > 0, ratio < 1 + clip, ratio > 1 - clip)  # PPO's clip: no gradient past it
    weight = np.where(live, adv * ratio, 0.0)
    grad = np.zeros_like(logits)
    np.add.at(grad, (prev, tokens), weight)  # d log p(tok | prev) / d logits[prev] = onehot(tok) - p(prev)
    grad -= np.bincount(prev, weights=weight, minlength=len(logits))[:, None] * np.exp(logp)
    logits += lr * grad / max(len(tokens), 1)
    return float(batch["reward"].mean())


def learner(args: argparse.Namespace) -> dict[str, Any]:
    path = os.path.join(args.run_dir, "learner.json")
    state = read_json(path) or {"logits": np.zeros((args.vocab, args.vocab)).tolist(), "version": 0, "step": 0,
                                "done": False, "rng": np.random.default_rng(args.seed).bit_generator.state,
                                "stats": {"starts": [], "batches": 0, "rows": 0, "max_batch_tokens": 0,
                                          "max_version_lag": 0, "rewards": []}}
    logits, stats = np.array(state["logits"]), state["stats"]
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    stats["starts"].append(state["step"])  # where each run (the first, each resume) began
    buf = open_reader(os.path.join(args.run_dir, "buffer"))
    for step in range(state["step"], args.steps):
        version = step  # the policy after `step` updates
        batch = next_batch(buf, args, version, rng)
        reward = policy_gradient(logits, batch, args.lr)
        tokens = int(batch["prompt_cu_seqlens"][-1] + batch["response_cu_seqlens"][-1])
        stats.update(batches=stats["batches"] + 1, rows=stats["rows"] + len(batch["index"]),
                     max_batch_tokens=max(stats["max_batch_tokens"], tokens), max_tokens=args.max_tokens,
                     max_version_lag=max(stats["max_version_lag"], version - int(batch["version"].min())),
                     max_lag=args.max_lag, steps=step + 1, rewards=stats["rewards"][-99:] + [reward])
        state.update(logits=logits.tolist(), version=step + 1, step=step + 1, rng=rng.bit_generator.state,
                     done=step + 1 >= args.steps, stats=stats)
        write_json(path, state)  # the checkpoint, and the policy the generator reads
        write_json(os.path.join(args.run_dir, "summary.json"), stats)
        if (step + 1) % 50 == 0:
            print(f"step {step + 1:5d}  rows {len(batch['index']):3d}  tokens {tokens:4d}  "
                  f"reward {np.mean(stats['rewards'][-50:]):.3f}", flush=True)
    buf.close()
    if state["step"] >= args.steps and not state["done"]:
        write_json(path, {**state, "done": True})
    return stats


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    os.makedirs(args.run_dir, exist_ok=True)
    if args.role == "generator":
        generator(args)
        return None
    if args.role == "learner":
        return learner(args)
    given = [a for a in (sys.argv[1:] if argv is None else argv) if a != "run"]
    gen = subprocess.Popen([sys.executable, __file__, "generator", *given])
    try:
        stats = learner(args)  # its last checkpoint says done: the generator stops
    except BaseException:
        gen.kill()
        raise
    finally:
        gen.wait(timeout=60)
    print(f"done: {stats['steps']} steps, {stats['rows']} rows sampled, mean reward of the last 50 steps "
          f"{np.mean(stats['rewards'][-50:]):.3f}")
    return stats


if __name__ == "__main__":
    main()
