"""Reused helper threads: run one call beside the caller and wait for it later.

A save overlaps waits that have no order between them (two fsyncs, or an fsync and the
writing of the next file): fsync, write and xxh3 release the GIL. Starting a thread for
each of them is not free: ``Thread.start`` blocks until the new thread has run, and on a
busy machine (2 cores, a dozen runnable processes) that is a scheduling round trip of
milliseconds, twice per save, which is the whole budget of a small checkpoint. So idle
helpers are kept and reused; handing a call to one only wakes it and does not wait.

A helper runs one call at a time, and a call never waits for another helper's call, so
no call queues behind another (an async save's long fsync never delays a small save's).
Each process has its own helpers: a child made by ``fork`` (a DataLoader worker) starts
with none, since the parent's threads do not exist there.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Sequence

from . import _forksafe

__all__ = ["NAME", "Pending", "run", "share", "together", "wait_idle"]


class Pending:
    """One call running on a helper; ``join`` waits for it and re-raises its error."""

    __slots__ = ("_done", "result", "error")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()  # released by the helper when the call returns or raises
        self.result: Any = None
        self.error: BaseException | None = None

    def join(self) -> Any:
        # Unbounded on purpose: the call is a local fsync/close/hash that the calling
        # thread would otherwise run itself; it takes no lock and waits on no process.
        self._done.acquire()
        self._done.release()  # a second join returns at once
        if self.error is not None:
            raise self.error
        return self.result


class _Helper:
    __slots__ = ("_wake", "_job")

    def __init__(self) -> None:
        self._wake = threading.Lock()
        self._wake.acquire()
        self._job: tuple[Pending, Callable[..., Any], tuple[Any, ...]] | None = None
        _forksafe.start(threading.Thread(target=self._loop, name=NAME, daemon=True))

    def give(self, pending: Pending, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._job = (pending, fn, args)
        self._wake.release()

    def _loop(self) -> None:
        while True:
            self._wake.acquire()
            job, self._job = self._job, None
            assert job is not None
            pending, fn, args = job
            try:
                pending.result = fn(*args)
            except BaseException as e:  # re-raised by join() on the caller's thread
                pending.error = e
            del fn, args, job  # drop references to the caller's buffers before idling
            # Back on the idle list before the caller is told: a caller that submits
            # again right after join() finds this helper instead of starting another.
            _park(self)
            pending._done.release()
            del pending


_lock = threading.Lock()
_idle: list[_Helper] = []
#: calls handed to a helper and not finished yet
_busy = 0
_quiet = threading.Condition(_lock)

#: the name every helper thread has (tools that wait for a dead process's threads skip
#: idle helpers: they never exit, and :func:`wait_idle` says when none is running a call)
NAME = "ckpt-helper"


def _park(helper: _Helper) -> None:
    # Helpers never exit: a thread ending beside a fork can hang the child (ckpt._forksafe),
    # and there are never more than the most calls ever in flight at once (a few).
    global _busy
    with _lock:
        _busy -= 1
        if not _busy:
            _quiet.notify_all()
        _idle.append(helper)


def run(fn: Callable[..., Any], *args: Any) -> Pending:
    """Start ``fn(*args)`` on an idle helper thread (a new one if none is idle)."""
    global _busy
    pending = Pending()
    with _lock:
        helper = _idle.pop() if _idle else None
        _busy += 1
    if helper is None:
        try:
            helper = _Helper()
        except BaseException:
            with _lock:
                _busy -= 1
            raise
    helper.give(pending, fn, args)
    return pending


def together(calls: Sequence[Callable[[], Any]]) -> None:
    """Run ``calls`` at the same time: every one but the last on a helper, the last on
    this thread, so their waits overlap (fsync releases the GIL, and a journaling
    filesystem serves fsyncs issued together with one journal commit). Returns once all
    are done; raises the first error only after all have finished, so no call is still
    running on a file its caller then discards."""
    if not calls:
        return
    waits = [run(fn) for fn in calls[:-1]]
    error: BaseException | None = None
    try:
        calls[-1]()
    except BaseException as e:
        error = e
    for w in waits:
        try:
            w.join()
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


class _Shared:
    """The calls of one :func:`share`, handed out in order to whichever thread asks."""

    __slots__ = ("calls", "next", "lock", "running", "closed", "failed")

    def __init__(self, calls: Sequence[Callable[[], Any]]) -> None:
        self.calls = calls
        self.next = 0
        self.lock = threading.Lock()
        #: held by the helper while it runs a call: the caller waits on it, and only on it
        self.running = threading.Lock()
        self.closed = False  # the caller has returned or is returning: start nothing more
        self.failed: list[tuple[int, BaseException]] = []

    def take(self, helper: bool) -> int | None:
        with self.lock:
            if self.closed or self.failed or self.next >= len(self.calls):
                return None
            i = self.next
            self.next += 1
            if helper:
                # Taken under the lock: once the caller has closed, the helper either holds
                # this already (a call the caller must wait for) or starts nothing.
                self.running.acquire()
            return i

    def call(self, i: int) -> None:
        try:
            self.calls[i]()
        except BaseException as e:  # raised by the caller once every started call is done
            with self.lock:
                self.failed.append((i, e))

    def helper(self) -> None:
        while (i := self.take(True)) is not None:
            try:
                self.call(i)
            finally:
                self.running.release()

    def close(self) -> None:
        with self.lock:
            self.closed = True
        # Unbounded on purpose: only a call the helper already runs (a hash or a copy of
        # one piece in memory) is waited for; it takes no lock and waits on nothing.
        self.running.acquire()
        self.running.release()
        self.calls = ()  # a helper scheduled late finds nothing to run and holds no buffer


def share(calls: Sequence[Callable[[], Any]]) -> None:
    """Run ``calls`` on this thread and one helper at once, each thread taking the next
    call in order as soon as it is done with one. Returns when every call has run.

    Why not a fixed half for each thread: on a busy machine the scheduler often gives this
    process one core, not two, and a helper kept waiting would hold the caller up with a
    half still to do. Here the caller runs whatever the helper has not taken, and at the
    end waits only for the call the helper is running, never for a helper that has not
    started (it starts nothing once the caller is done). Calls start in order and none
    starts after one has failed, so every call before a failed one has run, and the error
    raised, that of the first failed call, is the one running them in order would raise.
    """
    if len(calls) < 2:
        for c in calls:
            c()
        return
    shared = _Shared(calls)
    run(shared.helper)  # not joined: close() waits for what it runs, and it stops there
    try:
        while (i := shared.take(False)) is not None:
            shared.call(i)
    finally:
        shared.close()
    if shared.failed:
        raise min(shared.failed, key=lambda f: f[0])[1]


def wait_idle(timeout: float) -> bool:
    """Wait until no helper is running a call (at most ``timeout`` seconds); True if none is.
    For a test harness that lets a crashed save's threads reach their next operation."""
    with _lock:
        return _quiet.wait_for(lambda: not _busy, timeout)


def _after_fork_in_child() -> None:
    # The parent's helpers are not running in the child; its lock may have been held
    # by a thread that does not exist here.
    global _lock, _quiet, _busy
    _lock = threading.Lock()
    _quiet = threading.Condition(_lock)
    _busy = 0
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
