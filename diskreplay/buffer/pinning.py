"""`Pinning`: the part of `ReplayBuffer`'s API that keeps commits readable while the writer
goes on (`pin`, `unpin`, `pins`; ``ReplayBuffer.open(url, "r", at_commit=n)`` reads them). Its
own module: the storage's `Pins` does the work, this is the buffer's front door to it."""

from __future__ import annotations

from ..storage import BufferStorage, Storage


class Pinning:
    """`ReplayBuffer`'s pinning methods (a buffer's `storage`, `flush` and `_require_open`)."""

    storage: Storage

    def flush(self, durable: bool = True) -> None:
        raise NotImplementedError

    def _require_open(self) -> None:
        raise NotImplementedError

    @property
    def at_commit(self) -> int | None:
        """The commit this reader was opened at and stays at (``open(url, "r", at_commit=n)``),
        or None: it follows the newest (a writer: makes them)."""
        return self.storage.at_commit

    def pin(self, name: str | None = None) -> int:
        """Writer: `flush`, then keep the commit this made readable (``open(url, "r",
        at_commit=n)``, or ``at_commit=name``) until `unpin`, however far the writer goes on.
        Returns its sequence ``n``. The pin is a copy of what the commit names (its record,
        saved state and the chunks of its rows), made now under the writer's lock: it costs the
        bytes of those rows once, in the buffer's location. Raises ValueError for a bad
        ``name`` or one another pin has (before anything is written); as `flush`."""
        self._require_open()
        self.storage.require_writable()
        return self._single("pin").pin(name, self.flush)

    def unpin(self, commit: int | str) -> None:
        """Writer: remove the pin of ``commit`` (its sequence or name) and delete its copy at once
        (readers still reading it then fail). Raises CommitNotKeptError if no such pin exists;
        ReadOnlyError for a reader."""
        self._require_open()
        self._single("unpin").unpin(commit)

    def pins(self) -> dict[int, str | None]:
        """The pinned commits that `open` can read ``at_commit``: sequence -> name (or None)."""
        self._require_open()
        return {pin.commit: pin.name for pin in self._single("pins").pins().kept()}

    def _single(self, what: str) -> BufferStorage:
        if not isinstance(self.storage, BufferStorage):
            raise ValueError(f"{self.storage.url!r} is a sharded buffer's union: its shards commit on their own; "
                             f"{what} a shard's commits through its writer (open_shard)")
        return self.storage
