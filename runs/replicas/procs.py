"""The recorded run: torchft's lighthouse in this process, every rank of every replica
group in its own process, the tape here (the ranks' logs arrive over pipes).

A group is SIGKILLed at a logical point (its kill step, right after its quorum): every rank
of it flushes its log and says so, then the orchestrator SIGKILLs all of them at once, for
real (exit -9) while the other groups train on. A joiner group is started once the run has
committed its ``after_step``; it asks torchft for a quorum and recovers from a live peer.

Who is in a quorum is decided by events, not by who started faster: no rank asks for its
first quorum before the lighthouse has heard from every initial group, and none asks for
the quorum of step ``after_step + 1`` before it has heard from the joiner (the lighthouse
then waits for the joiner's request, as for any replica it knows to be alive).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Callable

from replay.watchdog import hang_bound
from runs.common.procs import HOST, Workers, serve_store
from runs.replicas.config import ReplicaConfig
from runs.replicas.tapeio import Applier, Hub, RemoteSink

__all__ = ["run_processes"]


def _rank_main(actor: str, group_size: int, cfg_d: dict[str, Any], lighthouse: str, store_port: int, conn: Any,
               start: Any, first_quorum: Any, joined: list[tuple[int, Any]], ckpt_dir: str | None,
               log_dir: str | None) -> None:  # pragma: no cover - child process
    if log_dir:  # torchft's logging (its Rust logger writes to fd 2) goes to the rank's log file
        fd = os.open(os.path.join(log_dir, f"{actor}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    import torch.distributed as dist

    from runs.replicas.coord import FtCoordinator
    from runs.replicas.worker import build_state, run_rank

    cfg = ReplicaConfig.from_dict(cfg_d)
    # the group's store, served by the run's process (run_processes); every rank is a client.
    # Its timeout is a hang bound, widened by CKPT_TIMEOUT_SCALE on a loaded machine.
    store = dist.TCPStore(HOST, store_port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=hang_bound(12)))
    sink = RemoteSink(conn, actor)
    st = build_state(cfg)
    sink.flush()  # ready: imported and built; a joiner is a hot spare from here on
    start.wait()
    # the Manager (and its heartbeat to the lighthouse) starts only once the group is let in

    def before_quorum(step: int) -> None:
        # A joiner let in once step k is committed is in the quorum of step k + 1: no rank asks
        # for it before the lighthouse has heard from the joiner, which then waits for its request.
        for after_step, up in joined:
            if after_step < step:
                up.wait()

    coord = FtCoordinator(actor, group_size, st, sink, lighthouse=lighthouse, store=store, store_port=store_port,
                          before_quorum=before_quorum)
    # The lighthouse forms a quorum at once when every replica it hears from has asked: a
    # group whose manager is up first would train alone while the others still start theirs
    # (a second quorum from step 0 later: two runs). So no rank asks before the lighthouse
    # has heard from every initial group; then the first quorum waits for all of them.
    coord.announce()
    sink.flush(up=True)
    first_quorum.wait()
    stamps: list[float] = []  # when each step committed, on this rank's clock (bench/replicas.py)
    res = run_rank(actor, group_size, st, coord, sink, on_commit=lambda s, loss: stamps.append(time.perf_counter()),
                   ckpt_dir=ckpt_dir)
    sink.flush(final=True, result={"outcome": res.outcome, "steps": res.steps, "params": res.params,
                                   "recovered_from": res.recovered_from, "commit_times": stamps,
                                   "sdc_s": res.sdc_s})
    os._exit(0)  # torchft's server threads need no orderly goodbye


def run_processes(hub: Hub, cfg: ReplicaConfig, *, on_commit: Callable[[str, int], None] | None = None,
                  stall_s: float | None = None, ckpt_dir: str | None = None, log_dir: str | None = None,
                  watch_dir: str | None = None) -> dict[str, Any]:
    """Run every rank as a process. No wait here has a deadline: the run ends when every
    rank has; a hang is caught by the progress watchdog (each rank beats at each quorum,
    this process at each commit): no progress for ``stall_s`` (default a hang bound of
    the collectives' ``cfg.timeout_s``) dumps every process's stacks to ``watch_dir``
    (default ``log_dir/watchdog``) and raises ``HangError`` naming the file."""
    from torchft._torchft import LighthouseServer

    t0 = time.monotonic()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=cfg.min_replicas, join_timeout_ms=cfg.join_timeout_ms,
                                  quorum_tick_ms=cfg.quorum_tick_ms, heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)
    watch = watch_dir or (os.path.join(log_dir, "watchdog") if log_dir else None)
    committed = [-1]
    workers = Workers(watch=watch, quiet_s=cfg.timeout_s, stall_s=stall_s, name="run", progress=lambda: committed[0])
    ctx = workers.ctx  # the pipes and gates the ranks share come from the same (spawn) context
    procs = workers.procs
    lock = threading.Condition()
    ready: set[str] = set()
    dying: set[str] = set()
    results: dict[str, Any] = {}
    finished: set[str] = set()
    started_joins: set[str] = set()
    killed: dict[str, list[int]] = {}
    initial = [f"{g}.{r}" for g, n in cfg.groups for r in range(n)]
    start_initial = ctx.Event()
    first_quorum = ctx.Event()  # set once every initial rank's torchft manager is up
    joiner_up = {j.group: ctx.Event() for j in cfg.joins}  # set once each of its ranks' is
    joined = [(j.after_step, joiner_up[j.group]) for j in cfg.joins]
    up: set[str] = set()
    sizes = dict(cfg.all_groups())

    def on_message(name: str, msg: dict) -> None:
        with lock:
            ready.add(name)
            if msg.get("dying"):
                dying.add(name)
            if msg.get("up"):
                up.add(name)
                g = name.split(".")[0]
                if g in joiner_up and all(f"{g}.{r}" in up for r in range(sizes[g])):
                    joiner_up[g].set()
            if msg.get("final"):
                finished.add(name)
                results[name] = msg.get("result") or {"error": msg.get("error")}
            lock.notify_all()

    def on_applied(actor: str, method: str, args: tuple) -> None:
        if method == "event" and args[0] == "step_commit" and args[2] == 1:
            step = hub.rec.actor(actor).current_step
            with lock:
                if step > committed[0]:
                    committed[0] = step
                    lock.notify_all()
            if on_commit is not None:
                on_commit(actor, step)

    hub.listeners.append(on_applied)
    applier = Applier(hub, on_message)

    def pending_groups() -> set[str]:
        return {j.group for j in cfg.joins if j.group not in started_joins}

    stores: list[Any] = []  # each group's rendezvous, served here until the run ends

    def spawn(group: str, n: int, start: Any) -> None:
        stores.append(serve_store(timeout_s=hang_bound(12)))
        port = stores[-1].port
        for r in range(n):
            actor = f"{group}.{r}"
            parent, child = ctx.Pipe(duplex=False)
            workers.start(actor, _rank_main, actor, n, cfg.to_dict(), lighthouse.address(), port, child, start,
                          first_quorum, joined, ckpt_dir, log_dir)
            child.close()
            applier.attach(actor, parent)

    gates = {j.group: ctx.Event() for j in cfg.joins}
    try:
        for g, n in cfg.groups:
            spawn(g, n, start_initial)
        for j in cfg.joins:  # started now, let in later: process start-up is not part of a join
            spawn(j.group, j.ranks, gates[j.group])
        everyone = initial + [f"{j.group}.{r}" for j in cfg.joins for r in range(j.ranks)]

        def wait(done: Callable[[], bool]) -> None:
            with lock:
                workers.watchdog.wait(done, lock) if workers.watchdog else lock.wait_for(done)

        # every rank is built, then every initial rank's manager is up, before any asks for a
        # quorum: the first quorum holds all initial groups (a crash ends either wait)
        wait(lambda: set(everyone) <= ready or bool(workers.failed()))
        start_initial.set()
        wait(lambda: set(initial) <= up or bool(workers.failed()))
        first_quorum.set()  # a joiner, let in later, finds it set
        while True:
            workers.check()
            with lock:
                lock.wait(timeout=0.2)  # a poll of the exit codes too (a rank that crashed says nothing)
                for g, n in cfg.all_groups():
                    ranks = [f"{g}.{r}" for r in range(n)]
                    if g not in killed and all(a in dying for a in ranks):
                        for a in ranks:  # the whole group at once, for real
                            os.kill(procs[a].pid, signal.SIGKILL)
                        killed[g] = [procs[a].pid for a in ranks]
                go = [j for j in cfg.joins if j.group not in started_joins and committed[0] >= j.after_step]
                alive = [a for a, p in procs.items() if a not in finished and p.exitcode is None
                         and a.split(".")[0] not in killed and a.split(".")[0] not in pending_groups()]
                pending_joins = [j for j in cfg.joins if j.group not in started_joins]
            for j in go:
                started_joins.add(j.group)
                gates[j.group].set()
            crashed = [a for a, p in procs.items() if p.exitcode not in (None, 0) and a.split(".")[0] not in killed]
            if crashed:
                raise RuntimeError(f"replica ranks crashed: {crashed} (exit codes "
                                   f"{[procs[a].exitcode for a in crashed]}; their logs: {log_dir})")
            if not alive and not go:
                if pending_joins:  # the run ended before the joiner's turn: it never asked to join
                    for j in pending_joins:
                        for r in range(j.ranks):
                            procs[f"{j.group}.{r}"].kill()
                            killed.setdefault(j.group, []).append(procs[f"{j.group}.{r}"].pid)
                break
        workers.join()  # each has sent its final log and exits on its own
        applier.join(hang_bound(cfg.timeout_s))
        if applier.errors:
            raise applier.errors[0]
    finally:
        workers.close()
        lighthouse.shutdown()
    return {"results": results, "exitcodes": workers.exitcodes(), "killed": killed,
            "wall_s": time.monotonic() - t0}
