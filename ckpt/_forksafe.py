"""No ``fork`` while one of ckpt's threads starts or ends.

CPython 3.11's child of ``fork`` re-initialises its thread states under the runtime's
thread-list lock *before* it resets that lock (``PyOS_AfterFork_Child``): a fork taken
while another thread holds it leaves the child blocked for ever. Starting a thread and
ending one both take it. A save in flight runs on background threads, and the training
loop forks DataLoader workers at every epoch start: a hashing thread started or ended by
the save at that instant hung a worker (seen in a 2-process Accelerate run: the worker
waiting in ``_PyThreadState_DeleteExcept``, still inside the fork call).

So every thread of ckpt starts under :data:`LIFECYCLE` (:func:`start`), and one that ends
before its process does ends under it too (:class:`Exit`); ``os.register_at_fork`` takes
the same lock before a fork. Threads of other libraries are theirs to order.
"""

from __future__ import annotations

import os
import threading

__all__ = ["LIFECYCLE", "start", "Exit"]

LIFECYCLE = threading.Lock()


def start(thread: threading.Thread) -> threading.Thread:
    """``thread.start()``, never beside a fork. ``Thread.start`` returns once the new
    thread runs, so its whole creation is inside the lock."""
    with LIFECYCLE:
        thread.start()
    return thread


class Exit:
    """Lets a thread end only while a fork cannot begin.

    The thread calls :meth:`wait` as its last statement (it blocks until allowed to
    return); whoever ends it calls :meth:`join_thread`, which allows it under the lock and
    joins it: ``join`` returns only after the thread's state is gone, so the thread-list
    lock is free again before the fork lock is."""

    __slots__ = ("_go",)

    def __init__(self) -> None:
        self._go = threading.Event()

    def wait(self) -> None:
        self._go.wait()

    def join_thread(self, thread: threading.Thread) -> None:
        if thread is threading.current_thread() or not thread.is_alive() and not thread.ident:
            return
        with LIFECYCLE:
            self._go.set()
            # Unbounded on purpose: the thread has nothing left to run but its return.
            thread.join()


def _before() -> None:
    LIFECYCLE.acquire()


def _after_in_parent() -> None:
    LIFECYCLE.release()


def _after_in_child() -> None:
    global LIFECYCLE
    LIFECYCLE = threading.Lock()  # held by the forking thread, which is not here


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before, after_in_parent=_after_in_parent, after_in_child=_after_in_child)
