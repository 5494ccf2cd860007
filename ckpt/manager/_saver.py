"""Saving: one save as a job (:class:`SaveJob`), its write and commit (:func:`write`), the one
background thread that runs asynchronous saves in order (:class:`SaveWorker`), and the
timings each save reports (:class:`SaveReport`)."""

from __future__ import annotations

import os
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import _forksafe
from ..context.record import SaveContext
from ..knobs import knobs
from ..save_options import SaveOptions
from ..storage import Storage

__all__ = ["SaveJob", "SaveReport", "SaveWorker", "with_stall", "write"]


@dataclass(frozen=True, slots=True)
class SaveReport:
    """Timings of one save. ``stall_s``: time the loop was blocked; ``background_s``:
    time spent writing, hashing and committing (in the background when async)."""

    step: int
    path: str
    asynchronous: bool
    stall_s: float
    background_s: float
    nbytes: int
    deleted: tuple[str, ...] = ()


@dataclass(slots=True)
class SaveJob:
    """One save, from the loop's snapshot to its report (or error); ``done`` is set when it is over."""

    step: int
    path: str
    state: dict[str, Any]
    #: the part's context: step, config, the frozen loader state, the RNG captured at the
    #: step, extra, lineage, code_dir (written as it is, on the save thread)
    context: SaveContext
    meta: dict[str, Any]
    stall_s: float
    nbytes: int
    asynchronous: bool
    report: SaveReport | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class SaveWorker:
    """The one long-lived thread that runs a manager's asynchronous saves, in order.

    A thread started per save would make ``save`` wait until the new thread had been
    scheduled and had run (``Thread.start`` blocks for that): on a busy 2-core machine,
    milliseconds of stall beyond the staging copy. This thread is started once, at the
    first async save, at a lower CPU priority, and is handed each job through a queue,
    which does not wait. Interpreter exit waits for a save in flight: the thread is not
    a daemon, and once the main thread has ended it finishes what it
    was given and stops (an idle one notices within ``_POLL_S``).
    """

    _POLL_S = 0.5

    def __init__(self, run: Callable[[Any], None]) -> None:
        self._run = run
        self._start()

    def _start(self) -> None:
        self._jobs: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread = _forksafe.start(threading.Thread(target=self._loop, args=(self._jobs,), name="ckpt-save",
                                                        daemon=False))

    def _loop(self, jobs: "queue.SimpleQueue[Any]") -> None:
        _lower_thread_priority(knobs().save_thread_nice)
        main = threading.main_thread()
        while True:
            try:
                job = jobs.get(timeout=self._POLL_S)
            except queue.Empty:
                if not main.is_alive():
                    return
                continue
            if job is None:
                return
            self._run(job)

    def submit(self, job: Any) -> None:
        if not self._thread.is_alive():  # a forked child, or a worker that saw the main thread end
            self._start()
        self._jobs.put(job)

    def stop(self, *, join: bool = True) -> None:
        """Stop after the jobs given; with ``join``, wait for that (the job in flight is
        done: the loop only has to see the sentinel; bounded all the same)."""
        self._jobs.put(None)
        if join and self._thread is not threading.current_thread() and self._thread.is_alive():
            self._thread.join(knobs().save_timeout_s)

    def where(self) -> str:
        """The save thread's innermost frames, for a hang report."""
        frame = sys._current_frames().get(self._thread.ident or -1)
        if frame is None:
            return "no frame (the thread has ended)"
        stack = traceback.extract_stack(frame)[-4:]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack))


def _lower_thread_priority(nice: int) -> None:
    """Make the calling (background save) thread yield the CPU to the training loop.

    On two cores the loop's intra-op threads use both; a save thread at the same
    priority takes one of them for its write copies and hashing, and every parallel
    operation of the step then waits for its slowest thread. With a higher nice value
    the scheduler runs the save in the gaps of the step (its Python parts, its waits)
    and the step keeps both cores; the save takes longer but finishes long before the
    next one is due (bench/async_save.py). Linux applies nice per thread, and threads
    this one starts (the digest thread) inherit it. Never lowers the loop's own thread:
    only an asynchronous save's thread calls this.
    """
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError):  # not Linux, or not permitted: run at the loop's priority
        pass


def write(job: SaveJob, *, dist: Any, storage: Storage, options: SaveOptions) -> None:
    """Write and commit ``job``'s checkpoint: through ``dist`` (``ckpt.distributed``: every
    rank writes its part, rank 0 commits) or as this process's one part, aborted (its
    temporary directory removed) if anything fails before the commit."""
    from ..writer import abort, begin, commit, write_part_with

    if dist is not None:
        dist.save_with(job.path, job.state, job.context, meta=job.meta, storage=storage, options=options)
        return
    pending = begin(job.path, overwrite=options.overwrite, storage=storage)
    try:
        part = write_part_with(pending, "rank-00000", job.state, job.context, storage=storage, options=options)
        commit(pending, [part], step=job.step, meta=job.meta, storage=storage)
    except BaseException:
        abort(pending, storage=storage)
        raise


def with_stall(report: SaveReport, stall: float) -> SaveReport:
    return SaveReport(report.step, report.path, report.asynchronous, stall, report.background_s, report.nbytes, report.deleted)
