"""``flock`` with a bounded wait, and a release that survives ``fork``.

A ``flock`` lock belongs to the open file description, not to the descriptor: a child
made by ``fork`` (a DataLoader worker started while a save holds the lock) shares the
description, and closing the parent's descriptor does not release the lock while the
child's copy is open. ``LOCK_UN`` does: it acts on the description, which every copy
shares. So a lock is always released by :func:`unlock_and_close`, never by ``close``
alone. ``O_CLOEXEC`` (which ``os.open`` sets) covers programs started by ``exec``.

Waits poll ``LOCK_NB`` up to a deadline instead of blocking in the kernel: a blocked
``flock`` cannot be interrupted from another thread, and a wait that can end in an
error naming the holders is a bug report, where an endless one is a hung job.
"""

from __future__ import annotations

import fcntl
import os
import time

from .errors import WaitTimeoutError

__all__ = ["flock_bounded", "unlock_and_close", "lock_holders"]

_MAX_LOCKS_BYTES = 1 << 20  # /proc/locks read back for an error message: bounded
_POLL_MAX_S = 0.05


def flock_bounded(fd: int, *, exclusive: bool, timeout_s: float, what: str, path: str) -> None:
    """``flock(fd)`` shared or exclusive, waiting at most ``timeout_s`` seconds; then
    ``WaitTimeoutError`` naming ``what`` is waited for at ``path`` and the processes
    the kernel lists as holding locks on it. Other ``OSError``s propagate."""
    op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            holders = lock_holders(fd)
            me = os.getpid()
            who = ", ".join(f"pid {p} ({c}{', this process or a child it forked' if p == me else ''})"
                            for p, c in holders) or "no process the kernel names"
            raise WaitTimeoutError(
                f"could not take {'an exclusive' if exclusive else 'a shared'} lock on {what} within {timeout_s:g} s; "
                f"held by {who}. A process forked while a lock is held keeps it until it exits; raise "
                "CKPT_LOCK_TIMEOUT_S if the holder is only slow",
                path=path, waited_on=what, timeout_s=timeout_s, holders=[p for p, _ in holders],
            )
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_MAX_S)


def unlock_and_close(fd: int) -> None:
    """Release the lock on the open file description (every forked copy included), then
    close this descriptor."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass  # closing still releases it where no other copy exists
    finally:
        os.close(fd)


def lock_holders(fd: int) -> list[tuple[int, str]]:
    """(pid, command name) of the processes ``/proc/locks`` lists as holding a lock on
    the file of ``fd``; empty where that is not known (not Linux). For error messages."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks", "rb") as f:
            raw = f.read(_MAX_LOCKS_BYTES)
    except OSError:
        return []
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}".encode()
    out: list[tuple[int, str]] = []
    for line in raw.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  READ 1234 00:2a:5678 0 EOF"; a blocked request has "->" first
        if len(fields) < 6 or fields[1] == b"->" or fields[5] != want:
            continue
        try:
            pid = int(fields[4])
        except ValueError:
            continue
        try:
            with open(f"/proc/{pid}/comm", "rb") as f:
                comm = f.read(64).decode(errors="replace").strip()
        except OSError:
            comm = "?"
        if (pid, comm) not in out:
            out.append((pid, comm))
    return out
