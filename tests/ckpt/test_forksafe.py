"""No fork begins while one of ckpt's threads starts or ends (ckpt._forksafe).

CPython 3.11 deadlocks the child of a fork taken while another thread holds the runtime's
thread-list lock, which starting and ending a thread take. A 2-process Accelerate run hung
that way in a DataLoader worker forked at an epoch start beside an async save. These tests
check the ordering itself, deterministically: with the lifecycle lock held (as while a ckpt
thread starts or ends) a fork that has begun does not complete, and a ckpt thread that is
done does not end until it may.
"""

from __future__ import annotations

import os
import threading

from hangs import hang_s

import ckpt._forksafe as forksafe
import ckpt._helpers as helpers
from ckpt._pipeline import OrderedFeeder

_watch = {"on": False, "began": threading.Event()}


def _fork_began() -> None:
    if _watch["on"]:
        _watch["began"].set()


# A before-fork hook registered after ckpt's runs before it (reverse order): it tells
# the test that a fork has begun and is about to wait for the lifecycle lock.
os.register_at_fork(before=_fork_began)


def test_a_fork_waits_while_a_ckpt_thread_starts_or_ends() -> None:
    done = threading.Event()
    pids: list[int] = []

    def fork() -> None:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        pids.append(pid)
        done.set()

    _watch["began"].clear()
    _watch["on"] = True
    forksafe.LIFECYCLE.acquire()  # as while a ckpt thread starts or ends
    try:
        forker = threading.Thread(target=fork, daemon=True)
        forker.start()
        assert _watch["began"].wait(hang_s(5.0)), "the fork never began"
        # the fork has begun and waits for the lock this test holds: it cannot have finished
        assert not done.is_set() and not pids
    finally:
        _watch["on"] = False
        forksafe.LIFECYCLE.release()
    assert done.wait(hang_s(5.0)), "the fork did not complete once the lock was free"
    forker.join(hang_s(5.0))
    _, status = os.waitpid(pids[0], 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_hashing_thread_ends_only_when_no_fork_can_begin() -> None:
    seen: list[int] = []
    feeder = OrderedFeeder(seen.append, "ckpt-test-feeder")
    feeder.feed(1)
    feeder.feed(2)
    forksafe.LIFECYCLE.acquire()  # as a fork that has begun holds it
    try:
        finisher = threading.Thread(target=feeder.finish, daemon=True)
        finisher.start()
        assert feeder._drained.wait(hang_s(5.0))
        # every item is processed, and the thread waits for leave to end: it is alive
        assert seen == [1, 2] and feeder._thread.is_alive() and finisher.is_alive()
    finally:
        forksafe.LIFECYCLE.release()
    finisher.join(hang_s(5.0))
    assert not finisher.is_alive() and not feeder._thread.is_alive()


def test_helper_threads_never_end() -> None:
    before = {t.ident for t in threading.enumerate() if t.name == helpers.NAME}
    barrier = threading.Barrier(6, timeout=hang_s(5.0))
    helpers.together([barrier.wait] * 6)  # five helpers busy at once, one on this thread
    helpers.wait_idle(hang_s(5.0))
    after = {t.ident for t in threading.enumerate() if t.name == helpers.NAME and t.is_alive()}
    assert before <= after and len(after) >= 5  # idle, parked, none ended


def test_a_forked_child_can_start_and_end_ckpt_threads() -> None:
    """The child gets a free lifecycle lock of its own (the parent's is held by the
    forking thread, which does not exist there)."""
    pid = os.fork()
    if pid == 0:
        try:
            out: list[int] = []
            f = OrderedFeeder(out.append, "ckpt-child-feeder")
            f.feed(7)
            f.finish()
            helpers.run(lambda: None).join()
            os._exit(0 if out == [7] else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
