"""One writer per run directory: the writer's lock (an ``flock`` on a filesystem, a lease on
an object store, spec/object-storage.md §O.6), the storage a writer commits through, and
the cleanup of crashed saves' leftovers that taking the lock allows. A follower
(``writer=False``) holds none of it."""

from __future__ import annotations

from typing import Any

from ..storage import Storage
from ..writer import recover
from .listing import is_checkpoint_name

__all__ = ["WriterRole"]


class WriterRole:
    """Whether a manager writes ``run_dir``, its lock, and the storage its I/O goes through."""

    def __init__(self, storage: Storage, run_dir: str, *, writer: bool) -> None:
        self.run_dir = run_dir
        #: the run as this manager sees it: while it holds the lock on an object store, every
        #: commit and deletion proves the lease first (``LeaseLostError`` once another took over)
        self.storage = storage
        self._unlocked = storage
        self.writer = writer
        self.lock: Any = None  # what storage.commit.run_lock returned (an flock, a lock object)
        self.removed_orphans: tuple[str, ...] = ()
        #: (temporary name, step name) of complete copies put back after a crash
        self.restored_orphans: tuple[tuple[str, str], ...] = ()

    def take(self, *, wait: bool, owner: dict[str, Any]) -> None:
        """Take the run's lock (``wait``: until the holder closes or dies), then clean the
        leftovers of crashed saves, which no live writer can own any more."""
        self.storage.makedirs(self.run_dir)
        self.lock = self.storage.commit.run_lock(self.run_dir, owner=owner, wait=wait)
        self._unlocked = self.storage
        self.storage = self.storage.commit.holding(self.lock)
        rec = recover(self.run_dir, names=is_checkpoint_name, storage=self.storage)
        self.removed_orphans, self.restored_orphans = rec.removed, rec.restored

    def release(self) -> None:
        if self.lock is not None:
            self.storage = self._unlocked
            self.lock.release()
            self.lock = None
