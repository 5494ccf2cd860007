"""Launching a run's workers: processes (one gloo world, or any other job) and threads.

Every reference run starts its workers the same way, so they share one launcher:

- :class:`Workers`: worker processes started with ``spawn`` (a fork of a process that
  has touched torch's thread pools or gloo is unsafe), each running with one intra-op
  thread (:func:`worker_threads`), every one reaped at the end: the exit codes of those
  that ended (``-9``: SIGKILLed), the ones still alive killed;
- :func:`serve_store` and :func:`join_gloo`: the job's rendezvous, a c10d ``TCPStore`` the
  launching process serves on a port the OS assigns as it listens (a port found free,
  closed and handed to a worker to bind later can be taken in between: by gloo's own
  connections, by another job), and this process's rank of the job's torch.distributed
  gloo group over it; the store is returned with it (the snapshots' control plane rides
  on it: ``replay.snapshot.TorchStoreControl``);
- :class:`Threads`: workers as threads of this process (every replay, and the in-process
  transport): the first error re-raised, a thread that does not finish named.

No wait here judges speed: waits are on events (a process exit, a thread's end) and a
clock only catches a hang. ``Workers(watch=DIR)`` arms every worker for the progress
watchdog (``replay.watchdog``): each beats at its steps, and when none does for the hang
bound every process's Python stacks and ``hang.txt`` land in DIR and the wait raises
``HangError`` naming it.

Why one thread per worker: torch's default intra-op pool spin-waits (OpenMP); several
workers on a few cores then make tiny-model steps about 20x slower. torchrun sets
``OMP_NUM_THREADS=1`` for the same reason. It is set in each worker's entry (here), never
globally in the libraries. The threads' setting is the processes' one: the same kernels,
the same bits.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable

from replay.errors import HangError
from replay.watchdog import Watchdog, arm, hang_bound

__all__ = ["HOST", "serve_store", "worker_threads", "Workers", "join_gloo", "leave_gloo", "Threads"]

HOST = "127.0.0.1"


def serve_store(*, timeout_s: float) -> Any:
    """The job's rendezvous: a c10d ``TCPStore`` served by this (the launching) process on
    ``HOST``, on the port the OS gave it as it started listening (``store.port``: hand it
    to the workers). Keep it for the job's life; pass it to :func:`join_gloo` as this
    process's own."""
    import torch.distributed as dist

    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def worker_threads() -> None:
    """One intra-op thread: every worker's setting (see the module docstring)."""
    import torch

    torch.set_num_threads(1)


def _entry(target: Callable[..., Any], args: tuple[Any, ...], watch: str | None = None,
           name: str = "") -> None:  # pragma: no cover - child process
    if watch is not None:  # before anything that can block: a hang from here on names itself
        arm(watch, name)
    worker_threads()
    try:
        target(*args)
    except BaseException as e:  # noqa: BLE001 - reported here, the process ends with its code
        # A failed worker leaves at once with its error and code (1, or SystemExit's), as
        # multiprocessing would report it: the interpreter's teardown would destroy a gloo
        # group whose peer died, and gloo's threads then abort the process ("terminate
        # called ...", exit -6) instead (measured: 3 of 20 runs of a rank killed mid-collective).
        code = _exit_code(e)
        if not isinstance(e, SystemExit):
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(e: BaseException) -> int:
    """The exit code multiprocessing gives a process that raised ``e``."""
    if not isinstance(e, SystemExit) or e.code is None:
        return 0 if isinstance(e, SystemExit) else 1
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


class Workers:
    """The worker processes of one run, by name (``spawn``, daemonic: they die with us).

    Use as a context manager: on leaving, every process still alive is SIGKILLed and
    reaped, whatever happened (a worker never outlives the run that started it).

    ``watch``: a directory for the progress watchdog (``replay.watchdog``), usually beside
    the run's output. Every worker is armed (SIGUSR1 dumps its stacks there) and its
    heartbeats, with ``progress()`` (a probe of this process: a tape's length), are
    watched: no change for ``stall_s`` (default :func:`replay.watchdog.hang_bound` of
    ``quiet_s``) dumps every process's stacks, writes ``hang.txt``, kills the workers, and
    :meth:`join` / :meth:`check` raise ``HangError`` naming it."""

    def __init__(self, *, watch: str | Path | None = None, quiet_s: float = 10.0, stall_s: float | None = None,
                 progress: Callable[[], Hashable] | None = None, name: str = "orchestrator") -> None:
        import torch.multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, Any] = {}
        self.watchdog: Watchdog | None = None
        if watch is not None:
            self.watchdog = Watchdog(watch, stall_s=stall_s if stall_s is not None else hang_bound(quiet_s),
                                     name=name, progress=progress)

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> Any:
        """Start ``target(*args)`` in a new process called ``name`` (a module-level
        function: spawn imports it), with one intra-op thread."""
        if name in self.procs:
            raise ValueError(f"a worker named {name!r} was already started")
        watch = str(self.watchdog.dir) if self.watchdog is not None else None
        p = self.ctx.Process(target=_entry, args=(target, args, watch, name), name=name, daemon=True)
        p.start()
        self.procs[name] = p
        if self.watchdog is not None:
            self.watchdog.watch(name, p)
            self.watchdog.start()
        return p

    def __getitem__(self, name: str) -> Any:
        return self.procs[name]

    def __iter__(self) -> Any:
        return iter(self.procs.values())

    def ended(self, name: str) -> bool:
        return self.procs[name].exitcode is not None

    def failed(self) -> list[str]:
        """The workers that ended with a non-zero exit code (killed ones included)."""
        return [n for n, p in self.procs.items() if p.exitcode not in (None, 0)]

    def check(self) -> None:
        """Raise ``HangError`` if the watchdog has fired (a no-op without one)."""
        if self.watchdog is not None:
            self.watchdog.check()

    def join(self, grace_s: float | None = None) -> dict[str, int | None]:
        """Wait for every worker to exit (on their exits, not on a clock); the exit codes.

        ``grace_s``: stop waiting after that long and return the codes with None for those
        still running (the caller kills them: a worker that lingers after its goodbye).
        Without it the wait ends only when all have exited, or raises ``HangError`` when
        the watchdog fires (or, unwatched, after a generous hang bound)."""
        from multiprocessing.connection import wait

        deadline = None if grace_s is None else time.monotonic() + grace_s
        bound = None if self.watchdog is not None or grace_s is not None else time.monotonic() + hang_bound(60.0)
        while True:
            alive = [p.sentinel for p in self.procs.values() if p.exitcode is None]
            if not alive:
                break
            self.check()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if bound is not None and now >= bound:
                raise HangError(f"workers still running after the hang bound: {self.running()}")
            wait(alive, timeout=1.0 if deadline is None else max(0.0, min(1.0, deadline - now)))
        # A watchdog that fired while we waited killed the workers itself: their exits are
        # its kills, and the run hung. Without this check the last deaths could end the loop
        # before it looked, and a hang would read as workers that failed.
        self.check()
        return self.exitcodes()

    def running(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.exitcode is None]

    def exitcodes(self) -> dict[str, int | None]:
        """Name -> exit code: 0 done, -N ended by signal N (``-9``: SIGKILL), None alive."""
        return {n: p.exitcode for n, p in self.procs.items()}

    def close(self) -> None:
        """Kill and reap every worker still alive; stop the watchdog."""
        if self.watchdog is not None:
            self.watchdog.stop()
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
        for p in self.procs.values():
            p.join()  # SIGKILL cannot be ignored: the reap follows at once
        if self.watchdog is not None:
            self.watchdog.discard()  # a run that did not hang leaves no heartbeat files behind

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def join_gloo(rank: int, world: int, port: int, *, timeout_s: float, store_timeout_s: float | None = None,
              store: Any = None) -> Any:
    """Join the job's gloo group as ``rank`` of ``world`` over the store :func:`serve_store`
    serves on ``port`` (``store``: that store itself, in the process serving it; every
    other process connects as a client); the store, for the control plane. ``timeout_s``
    is the group's: a receiver thread waits on gloo that long, so it must exceed the run
    where a channel may idle for all of it."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=store_timeout_s if store_timeout_s is not None else timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return store


def leave_gloo() -> None:
    """Destroy this process's group, if it has one (a no-op otherwise)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Threads:
    """Workers as daemon threads of this process, each with the processes' thread setting.

    ``start(name, fn, *args)``; :meth:`join` waits until every one has ended, then re-raises
    the first error a worker raised (at once: a failed worker ends the wait). A clock only
    catches a hang: when no thread ends and ``progress()`` (a probe: a tape's length) does
    not change for ``stall_s``, every thread's stacks go to ``watch`` (a temporary directory
    when not given) and ``HangError`` names the threads still running and the file.
    ``on_error(name, exc)`` runs in the failing thread (e.g. to close its endpoint so that
    its peers stop waiting for it)."""

    def __init__(self, *, on_error: Callable[[str, BaseException], None] | None = None,
                 progress: Callable[[], Hashable] | None = None, watch: str | Path | None = None) -> None:
        self.on_error = on_error
        self.progress = progress
        self.watch = watch
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self._ended = 0
        self._cond = threading.Condition()

    def start(self, name: str, fn: Callable[..., Any], *args: Any) -> threading.Thread:
        def work() -> None:
            try:
                worker_threads()
                fn(*args)
            except BaseException as e:  # re-raised by join() in the caller's thread
                self.errors.append(e)
                if self.on_error is not None:
                    self.on_error(name, e)
            finally:
                with self._cond:
                    self._ended += 1
                    self._cond.notify_all()

        t = threading.Thread(target=work, name=name, daemon=True)
        t.start()
        self.threads.append(t)
        return t

    def join(self, stall_s: float | None = None, *, what: str = "workers") -> None:
        """Wait for every thread to end; re-raise the first worker error. ``stall_s``: the
        hang bound (default ``hang_bound(30)``), no progress and no thread ending for that
        long raises ``HangError`` naming the ``what`` still running."""
        import tempfile

        def token() -> Hashable:
            return (self._ended, self.progress() if self.progress is not None else None)

        # made only if the watchdog fires: a join that ends leaves nothing behind
        watch = self.watch if self.watch is not None else Path(tempfile.gettempdir()) / f"ckpt-hang-{os.getpid()}-{id(self):x}"
        dog = Watchdog(watch, stall_s=stall_s if stall_s is not None else hang_bound(30.0), name=what,
                       progress=token, kill=False)
        for t in self.threads:
            dog.watch(t.name)
        with dog, self._cond:
            try:
                dog.wait(lambda: bool(self.errors) or self._ended == len(self.threads), self._cond)
            except HangError as e:
                self.raise_first()  # a worker's error is the likelier cause
                stuck = [t.name for t in self.threads if t.is_alive()]
                raise HangError(f"{what} did not finish: {stuck}: {e.message}", report=e.context.get("report")) from None
        self.raise_first()
        for t in self.threads:  # each has left its work (its end was counted): the join is immediate
            t.join()

    def abandon(self, grace_s: float = 5.0) -> None:
        """The caller failed: give each thread ``grace_s`` to end (a thread blocked for
        good stays behind, a daemon), then re-raise a worker's error (the likelier cause)
        if there is one."""
        deadline = time.monotonic() + grace_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.raise_first()

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

    def __iter__(self) -> Iterable[threading.Thread]:
        return iter(self.threads)
