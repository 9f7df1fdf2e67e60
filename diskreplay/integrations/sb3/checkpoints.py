"""`CheckpointCallback`: SB3's checkpoints with the disk buffer committed at each model save."""

from __future__ import annotations

from stable_baselines3.common import callbacks

from .buffer import DiskReplayBuffer


class CheckpointCallback(callbacks.CheckpointCallback):
    """SB3's ``CheckpointCallback`` (same arguments) that also commits the model's
    `DiskReplayBuffer` each time it saves the model, and only then: when training starts it sets
    the buffer's ``flush_every`` to None. After a kill, the buffer holds exactly the steps of the
    last checkpoint but its last one (SB3 runs callbacks before it stores the step they run in;
    the saved model's last observation is that step's), instead of rows ahead of the model.

    ``model.save`` alone leaves the replay buffer out (SB3 excludes it), so nothing commits it
    then; ``model.save_replay_buffer`` (``save_replay_buffer=True`` here) and
    ``model.replay_buffer.flush()`` do. Other replay buffers are left as they are.
    """

    def _init_callback(self) -> None:
        super()._init_callback()
        buffer = self._disk_buffer()
        if buffer is not None:
            buffer.flush_every = None

    def _on_step(self) -> bool:
        result = super()._on_step()
        buffer = self._disk_buffer()
        if buffer is not None and self.n_calls % self.save_freq == 0:
            buffer.flush()
        return result

    def _disk_buffer(self) -> DiskReplayBuffer | None:
        buffer = getattr(self.model, "replay_buffer", None)
        return buffer if isinstance(buffer, DiskReplayBuffer) else None
