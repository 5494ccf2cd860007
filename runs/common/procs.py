"""Launching a run's workers: processes (one gloo world, or any other job) and threads.

Every reference run starts its workers the same way, so they share one launcher:

- :class:`Workers`: worker processes started with ``spawn`` (a fork of a process that
  has touched torch's thread pools or gloo is unsafe), each running with one intra-op
  thread (:func:`worker_threads`), every one reaped at the end: the exit codes of those
  that ended (``-9``: SIGKILLed), the ones still alive killed;
- :func:`join_gloo`: this process's rank of the job's torch.distributed gloo group, over a
  c10d ``TCPStore`` that is returned with it (the snapshots' control plane rides on it:
  ``replay.snapshot.TorchStoreControl``);
- :class:`Threads`: workers as threads of this process (every replay, and the in-process
  transport): the first error re-raised, a thread that does not finish named.

Why one thread per worker: torch's default intra-op pool spin-waits (OpenMP); several
workers on a few cores then make tiny-model steps about 20x slower. torchrun sets
``OMP_NUM_THREADS=1`` for the same reason. It is set in each worker's entry (here), never
globally in the libraries. The threads' setting is the processes' one: the same kernels,
the same bits.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable

__all__ = ["HOST", "free_port", "worker_threads", "Workers", "join_gloo", "leave_gloo", "Threads"]

HOST = "127.0.0.1"


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` now (the rendezvous port of a new world)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def worker_threads() -> None:
    """One intra-op thread: every worker's setting (see the module docstring)."""
    import torch

    torch.set_num_threads(1)


def _entry(target: Callable[..., Any], args: tuple[Any, ...]) -> None:  # pragma: no cover - child process
    worker_threads()
    target(*args)


class Workers:
    """The worker processes of one run, by name (``spawn``, daemonic: they die with us).

    Use as a context manager: on leaving, every process still alive is SIGKILLed and
    reaped, whatever happened (a worker never outlives the run that started it)."""

    def __init__(self) -> None:
        import torch.multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.procs: dict[str, Any] = {}

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> Any:
        """Start ``target(*args)`` in a new process called ``name`` (a module-level
        function: spawn imports it), with one intra-op thread."""
        if name in self.procs:
            raise ValueError(f"a worker named {name!r} was already started")
        p = self.ctx.Process(target=_entry, args=(target, args), name=name, daemon=True)
        p.start()
        self.procs[name] = p
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

    def join(self, timeout_s: float) -> dict[str, int | None]:
        """Wait for every worker, ``timeout_s`` in all; the exit codes (None: still running)."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs.values():
            p.join(max(0.1, deadline - time.monotonic()))
        return self.exitcodes()

    def exitcodes(self) -> dict[str, int | None]:
        """Name -> exit code: 0 done, -N ended by signal N (``-9``: SIGKILL), None alive."""
        return {n: p.exitcode for n, p in self.procs.items()}

    def close(self) -> None:
        """Kill and reap every worker still alive."""
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def join_gloo(rank: int, world: int, port: int, *, timeout_s: float, store_timeout_s: float | None = None) -> Any:
    """Join the job's gloo group as ``rank`` of ``world`` (rank 0 hosts the ``TCPStore``
    on ``port``); the store, for the control plane. ``timeout_s`` is the group's: a
    receiver thread waits on gloo that long, so it must exceed the run where a channel
    may idle for all of it."""
    import torch.distributed as dist

    store = dist.TCPStore(HOST, port, world, is_master=rank == 0,
                          timeout=timedelta(seconds=store_timeout_s if store_timeout_s is not None else timeout_s),
                          wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    return store


def leave_gloo() -> None:
    """Destroy this process's group, if it has one (a no-op otherwise)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Threads:
    """Workers as daemon threads of this process, each with the processes' thread setting.

    ``start(name, fn, *args)``; :meth:`join` waits ``timeout_s`` for every one, then re-raises
    the first error a worker raised, or raises ``TimeoutError`` naming the ones still
    running. ``on_error(name, exc)`` runs in the failing thread (e.g. to close its
    endpoint so that its peers stop waiting for it)."""

    def __init__(self, *, on_error: Callable[[str, BaseException], None] | None = None) -> None:
        self.on_error = on_error
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def start(self, name: str, fn: Callable[..., Any], *args: Any) -> threading.Thread:
        def work() -> None:
            try:
                worker_threads()
                fn(*args)
            except BaseException as e:  # re-raised by join() in the caller's thread
                self.errors.append(e)
                if self.on_error is not None:
                    self.on_error(name, e)

        t = threading.Thread(target=work, name=name, daemon=True)
        t.start()
        self.threads.append(t)
        return t

    def join(self, timeout_s: float, *, what: str = "workers") -> None:
        for t in self.threads:
            t.join(timeout_s)
        self.raise_first()
        stuck = [t.name for t in self.threads if t.is_alive()]
        if stuck:
            raise TimeoutError(f"{what} did not finish: {stuck}")

    def abandon(self, timeout_s: float = 5.0) -> None:
        """The caller failed: give each thread ``timeout_s`` to end, then re-raise a
        worker's error (the likelier cause) if there is one."""
        for t in self.threads:
            t.join(timeout_s)
        self.raise_first()

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0]

    def __iter__(self) -> Iterable[threading.Thread]:
        return iter(self.threads)
