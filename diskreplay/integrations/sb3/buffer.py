"""`DiskReplayBuffer`: SB3's ``ReplayBuffer`` / ``DictReplayBuffer`` API over a `ReplayBuffer` on disk."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from ...buffer import ReplayBuffer as DiskBuffer
from ...errors import NotABufferError
from ...sampling import Uniform
from .fields import Layout, Obs, make_layout, sample_arrays, slot_rows, step_rows, timeouts_of

if TYPE_CHECKING:
    import torch as th

CREATE_ONLY = ("chunk_rows", "compression", "compression_level")
"""`ReplayBuffer.create` options that an existing buffer already has (ignored when reopening)."""


_MOVED: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("moved_buffers", default=None)


@contextlib.contextmanager
def moved_buffers(urls: Mapping[str, str | os.PathLike[str]]) -> Iterator[None]:
    """Within this block, an unpickled buffer (``load_replay_buffer``) whose url is a key of
    ``urls`` opens the buffer at its value instead: for rows copied to another machine or moved,
    ``with dr.sb3.moved_buffers({"old/url": "new/url"}): model.load_replay_buffer(path)``."""
    token = _MOVED.set({**(_MOVED.get() or {}), **{os.fspath(k): os.fspath(v) for k, v in urls.items()}})
    try:
        yield
    finally:
        _MOVED.reset(token)


def open_buffer(url: str, layout: Layout, capacity: int, n_envs: int, overwrite: bool, seed: int | None,
                options: dict[str, Any]) -> DiskBuffer:
    """Reopen the buffer at ``url`` to go on writing it (``mode="r+"``), or create it there.

    Raises ValueError when the buffer there holds other fields, capacity or lanes."""
    if not overwrite:
        try:
            return reopen_buffer(url, layout, capacity, n_envs, options)
        except NotABufferError:
            pass
    if seed is None:  # SB3 seeds numpy's global generator (``seed=`` of the algorithm): follow it
        seed = int(np.random.randint(0, 2**31 - 1))
    return DiskBuffer.create(url, layout.fields(), capacity, num_envs=n_envs, overwrite=overwrite, seed=seed,
                             episode_end=("done",), **options)


def reopen_buffer(url: str, layout: Layout, capacity: int, n_envs: int, options: dict[str, Any],
                  mode: str = "r+") -> DiskBuffer:
    """The existing buffer at ``url``, opened with ``mode`` (``"r"``: any sampler, to look at it).

    Raises NotABufferError naming ``url`` when no buffer is there, ValueError as `checked`."""
    opening = {k: v for k, v in options.items() if k not in CREATE_ONLY}
    if mode == "r":
        opening = {"storage_options": options.get("storage_options"), "sampler": Uniform()}
    try:
        buf = DiskBuffer.open(url, mode, **opening)
    except NotABufferError as e:
        raise NotABufferError(f"the SB3 replay buffer's rows are missing: {url!r} holds no buffer ({e}); if it "
                              f"moved, load it within `with dr.sb3.moved_buffers({{old_url: new_url}}):`") from e
    return checked(buf, layout, capacity, n_envs)


def checked(buf: DiskBuffer, layout: Layout, capacity: int, n_envs: int) -> DiskBuffer:
    """``buf`` if it was made for this layout, capacity and lane count; else closed, ValueError."""
    want = (layout.fields(), capacity, n_envs)
    have = (buf.fields, buf.capacity, buf.num_envs)
    if want != have:
        buf.close()
        raise ValueError(f"the buffer at {buf.url!r} holds (fields, capacity, n_envs) = {have}, not the {want} "
                         f"these spaces, buffer_size and n_envs need (overwrite=True replaces it)")
    return buf


class DiskReplayBuffer(ReplayBuffer):
    """SB3's replay buffer whose rows live in a diskreplay buffer at ``url``: a drop-in for
    ``ReplayBuffer`` and ``DictReplayBuffer`` (``replay_buffer_class=DiskReplayBuffer,
    replay_buffer_kwargs={"url": ...}``) in DQN, SAC, TD3 and the other off-policy algorithms.

    It stores what SB3's buffer stores (observations and next observations in the observation
    space's dtype, actions as SB3 casts them, float32 rewards, dones and time-limit timeouts) in a
    ring of ``buffer_size`` rows; `sample` returns the same ``ReplayBufferSamples`` (Dict spaces:
    ``DictReplayBufferSamples``) on ``device``, with ``dones = done * (1 - timeout)`` and the
    observations and rewards normalized by a ``VecNormalize`` env. Rows are drawn by the disk
    buffer's own generator, seeded from numpy's global one (which SB3's ``seed=`` sets) unless
    ``seed`` is given, and restored with the buffer.

    Rows are committed every ``flush_every`` `add` calls (None: only by `flush`, pickling and
    `close`); rows added since the last commit are lost when the process ends without `close`
    (or `flush`), as in a crash: call ``model.replay_buffer.close()`` when training ends.
    ``model.save`` does not commit (SB3 leaves the replay buffer out of it), so the buffer may be
    behind or ahead of the last checkpoint after a kill: `diskreplay.sb3.CheckpointCallback`
    commits it with each model save instead. After a
    crash, constructing the algorithm again with the same ``url`` reopens the buffer with every
    committed row (``overwrite=True`` starts afresh). Pickling
    (``save_replay_buffer``) commits and keeps only the url and small state, not the rows;
    unpickling (``load_replay_buffer``) reopens the url, after the old writer closed it, and
    raises NotABufferError when no buffer is there (`moved_buffers` points it at a new url).

    Other keyword ``options`` go to `diskreplay.ReplayBuffer.create` (``chunk_rows``,
    ``compression``, ``cache_bytes``, ``storage_options``...) or `open`.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: th.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, url: str | os.PathLike[str], overwrite: bool = False,
                 flush_every: int | None = 1000, seed: int | None = None, **options: Any):
        """Raises ValueError for ``optimize_memory_usage`` (the disk buffer needs no such trade),
        a bad ``flush_every``, or a buffer at ``url`` made for other spaces or sizes."""
        if optimize_memory_usage:
            raise ValueError("DiskReplayBuffer does not support optimize_memory_usage=True; rows live on disk")
        if flush_every is not None and (not isinstance(flush_every, int) or flush_every < 1):
            raise ValueError(f"flush_every must be an int >= 1 or None, got {flush_every!r}")
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = handle_timeout_termination
        self.layout = make_layout(observation_space, action_space)
        self.url = os.fspath(url)
        self.flush_every = flush_every
        self._options = options
        self._adds = 0
        self._disk: DiskBuffer | None = open_buffer(self.url, self.layout, self.buffer_size * n_envs, n_envs,
                                                    overwrite, seed, options)
        self._sync_cursor()

    @property
    def disk(self) -> DiskBuffer:
        """The diskreplay buffer holding the rows (reopened with ``mode="r+"`` after unpickling)."""
        if self._disk is None:
            self._disk = reopen_buffer(self.url, self.layout, self.buffer_size * self.n_envs, self.n_envs,
                                       self._options)
            self._sync_cursor()
        return self._disk

    def _sync_cursor(self) -> None:
        lo, hi = self.disk.window()
        self.pos = int(hi[0]) % self.buffer_size
        self.full = int(hi[0] - lo[0]) >= self.buffer_size

    # ---- SB3's API ---------------------------------------------------------------------------

    def add(self, obs: Obs, next_obs: Obs, action: np.ndarray, reward: np.ndarray,
            done: np.ndarray, infos: list[dict[str, Any]]) -> None:
        """Store one step of every env (as SB3's ``ReplayBuffer.add``); commits every ``flush_every``."""
        timeouts = timeouts_of(infos, self.n_envs, self.handle_timeout_termination)
        rows = step_rows(self.layout, self.n_envs, obs, next_obs, action, reward, done, timeouts)
        self.disk.add(**({k: v[0] for k, v in rows.items()} if self.n_envs == 1 else rows))
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full, self.pos = True, 0
        self._adds += 1
        if self.flush_every is not None and self._adds % self.flush_every == 0:
            self.disk.flush()

    def size(self) -> int:
        """Rows per env lane the buffer holds (at most ``buffer_size``)."""
        return len(self.disk) // self.n_envs

    def reset(self) -> None:
        """Forget every row (`diskreplay.ReplayBuffer.clear`)."""
        self.disk.clear()
        self._sync_cursor()

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> Any:
        """``batch_size`` transitions drawn uniformly from the rows held, as SB3's tensors on
        ``device``: ``ReplayBufferSamples`` (Dict spaces: ``DictReplayBufferSamples``)."""
        return self._samples(self._draw(batch_size), env)

    def _draw(self, batch_size: int) -> dict[str, np.ndarray]:
        return self.disk.sample(batch_size)

    def _get_samples(self, batch_inds: np.ndarray, env: VecNormalize | None = None) -> Any:
        """SB3's hook: the rows at ring slots ``batch_inds`` of random envs (numpy's global generator)."""
        env_indices = np.random.randint(0, high=self.n_envs, size=(len(batch_inds),))
        return self.samples_at(batch_inds, env_indices, env)

    def samples_at(self, batch_inds: np.ndarray, env_indices: np.ndarray, env: VecNormalize | None = None) -> Any:
        """The transitions at SB3's ring slots ``batch_inds`` of envs ``env_indices``: what SB3's
        ``ReplayBuffer`` holds at ``[batch_inds, env_indices]``, as `sample` returns them.

        Raises IndexError for a slot that holds no row yet."""
        lo, hi = self.disk.window()
        ids = slot_rows(lo, hi, self.buffer_size, self.n_envs, batch_inds, env_indices)
        return self._samples(self.disk.rows(ids), env)

    def _samples(self, rows: dict[str, np.ndarray], env: VecNormalize | None) -> Any:
        obs, actions, next_obs, dones, rewards = sample_arrays(self.layout, rows)
        obs, next_obs = self._normalize_obs(obs, env), self._normalize_obs(next_obs, env)
        rewards = self._normalize_reward(rewards, env)
        if isinstance(obs, dict) and isinstance(next_obs, dict):
            return DictReplayBufferSamples({k: self.to_torch(v) for k, v in obs.items()}, self.to_torch(actions),
                                           {k: self.to_torch(v) for k, v in next_obs.items()},
                                           self.to_torch(dones), self.to_torch(rewards))
        assert isinstance(obs, np.ndarray) and isinstance(next_obs, np.ndarray)
        return ReplayBufferSamples(*map(self.to_torch, (obs, actions, next_obs, dones, rewards)))

    # ---- lifecycle ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Commit every row added so far: a crash after this loses none of them."""
        self.disk.flush()

    def close(self) -> None:
        """Commit and release the disk buffer (and its writer lock); it reopens on next use."""
        if self._disk is not None:
            self._disk.close()
            self._disk = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickles the url, spaces and counters, never the rows: they are committed first."""
        if self._disk is not None:
            self._disk.flush()
        state = self.__dict__.copy()
        state["_disk"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restores the pickled state; the buffer at ``url`` (or where `moved_buffers` says it
        moved) is reopened when first used. Raises NotABufferError naming the url when no buffer
        is there, ValueError when it holds another buffer: the rows must not silently vanish."""
        self.__dict__.update(state)
        self.url = (_MOVED.get() or {}).get(self.url, self.url)
        reopen_buffer(self.url, self.layout, self.buffer_size * self.n_envs, self.n_envs, self._options,
                      mode="r").close()
