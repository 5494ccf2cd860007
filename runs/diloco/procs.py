"""The run with real processes: the syncer in this process, every learner incarnation in
its own process, all on one torch.distributed gloo group (``TorchDistTransport``).

A SIGKILLed learner cannot rejoin a gloo group (the world is fixed when the group
forms), so each planned death has a *replacement process* that joins the group at the
start and idles until the syncer activates it: a hot spare, as production fleets keep.
The killed process really is gone (SIGKILL, exit -9); its replacement starts with no
state and recovers it from a healthy peer.

Learners record through :class:`~replay.channel.RemoteTape`; their logs ride on
their messages to the syncer, whose :class:`~replay.channel.LogApplier` puts them
on the one tape. A learner about to be killed flushes its log and waits for the
syncer's acknowledgement first (the kill point is a logical step, so that a replay can
stop the learner at the same point), and a finishing learner does the same.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from replay.channel import Endpoint
from replay.watchdog import hang_bound
from runs.diloco.chaos import Schedule, learner_names
from runs.diloco.config import DiLoCoConfig
from runs.diloco.learner import LearnerCtx, run_learner, sigkill_self
from replay.channel import Inbox
from runs.diloco.model import initial_state, val_corpus
from runs.diloco.syncer import SyncerCtx, run_syncer
from replay.channel import LogApplier, RemoteTape, TapeHub, endpoint_name
from runs.common.procs import Workers, join_gloo, leave_gloo, serve_store, worker_threads

__all__ = ["run_processes"]


def _timeout_s(cfg: DiLoCoConfig) -> float:
    # A receiver thread waits on gloo with the group's timeout; spares and learner<->learner
    # channels idle for the whole run, so the timeout must exceed the run: a hang bound
    # (20 min at the demo's 60 s I/O timeout, 10x and more its quiet length), which a
    # loaded machine widens with CKPT_TIMEOUT_SCALE like every other bound.
    return hang_bound(max(60.0, 2 * cfg.io_timeout_s))


def _join(cfg: DiLoCoConfig, rank: int, world: int, port: int, store: Any = None) -> Any:
    return join_gloo(rank, world, port, timeout_s=_timeout_s(cfg), store=store)


def watch_dir(hub: TapeHub) -> str | None:
    """Where the progress watchdog of a run recording ``hub``'s tape writes: beside the
    tape (``kill -USR1`` a learner's pid to see its stacks there while it runs)."""
    writer = hub.rec.writer
    return None if writer is None else str(writer.path) + ".watchdog"


def _control(store: Any) -> Any:
    # the c10d store the group was built on: the snapshots' control plane (no sockets of our own)
    from replay.snapshot import TorchStoreControl

    return TorchStoreControl(store, prefix="diloco/")


def _learner_proc(rank: int, world: int, port: int, actors: list[str], cfg_d: dict[str, Any], actor: str,
                  inc: int, schedule_d: dict[str, Any], snap_root: str | None = None,
                  restore_path: str | None = None, rejoin: bool = False,
                  dropped: tuple[str, ...] = ()) -> None:  # pragma: no cover - child
    cfg = DiLoCoConfig.from_dict(cfg_d)
    schedule = Schedule.from_json(schedule_d)
    store = _join(cfg, rank, world, port)
    from replay.channel import TorchDistTransport

    transport = TorchDistTransport(actors)
    remote = RemoteTape(actor)
    link = Inbox(Endpoint(transport), remote, timeout_s=cfg.io_timeout_s * 10, markers=True)
    parts = None
    if snap_root is not None:
        from runs.diloco.snapshots import Snapshots

        parts = Snapshots(snap_root, control=_control(store), keep_last=cfg.snapshot_keep,
                          config={"diloco": cfg.to_dict()})
    restore = None
    if restore_path is not None:  # relaunched from a snapshot: this incarnation starts from its part
        from runs.diloco.snapshots import Restored

        restore = Restored.open(restore_path)
    ctx = LearnerCtx(cfg, actor, inc, link, initial_state(cfg), schedule.for_learner(actor), die=sigkill_self,
                     remote=remote, parts=parts, restore=restore, rejoin=rejoin, dropped=dropped)
    out = run_learner(ctx)  # its snapshot parts are durable when it returns
    if out.state or inc == 0 or out.started_at:
        link.first_from("syncer", ("ack",))
    os._exit(0)


def run_processes(hub: TapeHub, cfg: DiLoCoConfig, *, on_step: Callable[[int, dict[str, Any]], None] | None = None,
                  after_step: Callable[[int, Any], None] | None = None, snapshots: Any = None,
                  restore: Any = None) -> Any:
    """Every learner incarnation a process. ``restore`` (a ``snapshots.Restored``): the
    processes are launched afresh from that snapshot (after a syncer fault), each
    incarnation of the cut from its part, a learner left out alive afresh to rejoin; the
    ones dead before the cut are not launched."""
    from replay.channel import TorchDistTransport
    from runs.diloco.outcome import RunResult, decide_schedule, spares_of

    worker_threads()
    t0 = time.monotonic()
    schedule = Schedule.from_json(restore.syncer["schedule"]) if restore is not None else decide_schedule(hub, cfg)
    names = learner_names(cfg)
    spares = spares_of(cfg, schedule)
    first_inc, rejoin = restore.incarnations(names) if restore is not None else ({a: 0 for a in names}, set())
    incs = [(a, k) for a in names for k in range(first_inc[a], len(spares[a]) + 1)]
    actors = ["syncer"] + [endpoint_name(a, k) for a, k in incs]
    world = len(actors)
    served = serve_store(timeout_s=_timeout_s(cfg))  # the rendezvous, held until the run ends
    port = served.port
    # the progress watchdog: learners beat at each inner step, this process at each taped
    # receive; a stall dumps every process's stacks beside the tape (<tape>.watchdog/)
    workers = Workers(watch=watch_dir(hub), quiet_s=cfg.io_timeout_s / 10, name="syncer",
                      progress=lambda: len(hub.received))
    for rank, (a, k) in enumerate(incs, start=1):
        e = endpoint_name(a, k)
        from_part = restore is not None and k == first_inc[a] and a in restore.learners
        workers.start(e, _learner_proc, rank, world, port, actors, cfg.to_dict(), a, k, schedule.to_json(),
                      snapshots.root if snapshots is not None else None,
                      restore.path if from_part else None, e in rejoin, tuple(sorted(rejoin)))
    try:
        store = _join(cfg, 0, world, port, served)
        transport = TorchDistTransport(actors)
        if snapshots is not None:
            snapshots.control = _control(store)
        link = Inbox(Endpoint(transport), hub.local("syncer"), timeout_s=cfg.io_timeout_s, markers=True)
        applier = LogApplier(hub)
        byes_acked: set[str] = set()

        def dead_probe() -> list[str]:
            # The orchestrator sees a process exit at once; gloo may notice a dead peer
            # only when it next sends to it.
            return workers.failed()

        link.gone = lambda e: e in workers.procs and workers.ended(e)

        if restore is not None:
            restore.register_stamps(hub)
        try:
            sy = run_syncer(SyncerCtx(cfg, link, initial_state(cfg), schedule, spares, val_corpus(cfg),
                                      applier=applier, on_step=on_step, after_step=after_step, dead_probe=dead_probe,
                                      snapshots=snapshots, restore=restore))
        except BaseException as e:
            workers.check()  # the watchdog fired and killed the learners: the hang is the cause
            raise e
        workers.check()
        for e in sorted(set(actors[1:])):
            # a process that has ended (killed, or a spare that was told to stop) needs no
            # goodbye, and a gloo send to it can wait for a receive that never comes
            if e not in byes_acked and not workers.ended(e):
                try:
                    link.send(e, {"kind": "ack"}, taped=False)
                except Exception:  # a dead or finished peer needs no goodbye
                    pass
        exitcodes = workers.join(grace_s=cfg.io_timeout_s)  # those still running after their goodbye are killed
        try:
            # Every peer is gone now, so each receiver thread has ended on its closed
            # connection; destroying the group under a thread still inside gloo aborts.
            transport.close(timeout=10.0, gone=[n for n, c in exitcodes.items() if c is not None])
        except Exception:
            pass
        if applier.pending():
            raise RuntimeError(f"{applier.pending()} remote tape entries could not be applied")
    finally:
        workers.close()
        leave_gloo()
    res = RunResult(cfg, schedule, sy, [], time.monotonic() - t0)
    res.extra["exitcodes"] = exitcodes
    if snapshots is not None:
        res.extra["snapshots"] = list(snapshots.outcomes)
    return res
