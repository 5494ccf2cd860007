"""The run directory's writer lock: one writing job per run directory.

``RunLock.acquire(run_dir)`` takes an exclusive ``flock`` on ``<run_dir>/.ckpt-writer.lock``
without waiting. The kernel drops the lock when the last descriptor of it closes, which
includes the holder's death by any signal (SIGKILL too), so a crash never leaves a stale
lock to clean up by hand. The holder writes its pid, host and start time into the file
so a refused writer can name it; the file is left in place on release (unlinking a lock
file races with a process about to lock it).

``flock`` locks belong to the open file description: a second open of the file in the
same process conflicts too, so two managers in one process are refused like two
processes. A child made by ``fork`` (DataLoader workers) would share the description
and keep the lock alive after its parent was SIGKILLed, so the descriptor is closed in
every child right after ``os.fork`` (``os.register_at_fork``) and is ``O_CLOEXEC`` for
programs started by ``exec``. On NFS, Linux maps
``flock`` to POSIX byte-range locks, held by the server (NFSv4 leases expire when the
client dies).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import weakref

from ._locks import unlock_and_close
from .errors import CkptError, RunDirLockedError

__all__ = ["RunLock", "LOCK_NAME"]

LOCK_NAME = ".ckpt-writer.lock"
_MAX_INFO = 4096  # bytes of holder description read back (the file is ours; bound it anyway)


class RunLock:
    """An exclusive, process-lifetime lock on a run directory. ``release()`` is idempotent."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd
        # If the owner is dropped without release(), the descriptor (and lock) goes too.
        # LOCK_UN, then close: the lock goes even where a child forked without our at-fork
        # hook (which closes the child's copy) still holds the description (ckpt._locks).
        self._finalizer = weakref.finalize(self, unlock_and_close, fd)
        _held.add(self)

    def _drop_in_child(self) -> None:
        # The child's copy of the descriptor only: the parent keeps its lock.
        if self._finalizer.detach() is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass

    @classmethod
    def acquire(cls, run_dir: str, *, owner: dict[str, object] | None = None, wait: bool = False) -> RunLock:
        """Take the lock; ``RunDirLockedError`` while another holds it, or with ``wait``,
        block until the holder releases it (or dies: the kernel drops its lock)."""
        path = os.path.join(run_dir, LOCK_NAME)
        # O_NONBLOCK: a FIFO planted at the lock's name must not block the open.
        flags = (os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NOFOLLOW", 0))
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirLockedError("the writer lock file is a symbolic link; refusing to follow it", path=path) from None
            if e.errno == errno.EISDIR:
                raise RunDirLockedError("the writer lock file is a directory; refusing to use it", path=path) from None
            raise CkptError(f"cannot open the writer lock file ({e.strerror})", path=path) from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a socket, a device: not a lock we can write
            os.close(fd)
            raise RunDirLockedError("the writer lock file is not a regular file; refusing to use it", path=path)
        try:
            # wait=True (set_writer(wait=True), a standby taking over) blocks on purpose for
            # as long as the previous writer lives: on the caller's thread, never in a save.
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirLockedError(
                f"another CheckpointManager writes this run directory: {_describe(holder)}; "
                "one writer per run directory (close it, or use another directory)",
                path=path,
                holder=holder,
            ) from None
        except OSError as e:
            os.close(fd)
            # ENOLCK/EOPNOTSUPP: a filesystem without flock; writing unlocked is what
            # let two jobs destroy each other's checkpoints, so refuse.
            raise CkptError(f"cannot lock the run directory ({e.strerror}); use a filesystem with flock(2)", path=path) from e
        except BaseException:
            os.close(fd)
            raise
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), **(owner or {})}
        try:
            blob = json.dumps(info, sort_keys=True).encode() + b"\n"
            os.ftruncate(fd, 0)
            os.pwrite(fd, blob, 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        if not self._finalizer.alive:
            return
        try:
            # Clear the holder description while still holding the lock, so a later
            # refusal never names a process that has gone.
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        self._finalizer()  # unlocks and closes the descriptor


_held: weakref.WeakSet[RunLock] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock._drop_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _read_holder(fd: int) -> dict[str, object]:
    try:
        raw = os.pread(fd, _MAX_INFO, 0)
        got = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _describe(holder: dict[str, object]) -> str:
    if not holder:
        # The holder locks first and writes its description right after.
        return "held by a process that has not yet written its pid and host"
    parts = [f"pid {holder.get('pid')} on host {holder.get('host')}"]
    if isinstance(holder.get("since"), (int, float)):
        parts.append("since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder["since"]))))
    if holder.get("run_id"):
        parts.append(f"run_id {holder['run_id']}")
    return ", ".join(parts)
