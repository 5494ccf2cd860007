"""Orchestration of a Decoupled-DiLoCo run, and the tape entry point ``main(rec)``.

``record(tape, cfg)`` runs the syncer and the learners and records the tape; with
``cfg.transport == "threads"`` every actor is a thread of this process over the
in-process transport, with ``"gloo"`` every learner incarnation is a process (see
``procs.py``). ``ckpt replay TAPE --mode force`` calls :func:`main`, which always
runs the actors as threads: the taped decisions make the outcome independent of the
transport and of timing, so the parameters and losses come out bit-identical.

Set ``CKPT_DILOCO_REPLAY_DELAY_S`` to slow every learner step down during a replay (the
"slower replay machine" check).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from replay.channel import Endpoint, InProcessNetwork
from runs.diloco.chaos import Schedule, learner_names
from runs.diloco.config import DiLoCoConfig
from runs.diloco.learner import LearnerCtx, LearnerOutcome, run_learner
from runs.diloco.outcome import RunResult, decide_schedule, spares_of
from replay.channel import Inbox
from runs.diloco.model import initial_state, val_corpus
from runs.diloco.syncer import SyncerCtx, run_syncer
from replay.channel import TapeHub, endpoint_name
from replay import Recorder
from replay.errors import HangError
from replay.watchdog import hang_bound
from runs.common.procs import Threads, worker_threads

__all__ = ["RunResult", "record", "main", "run_actors", "ENTRY_POINT", "DELAY_ENV"]

ENTRY_POINT = "runs.diloco.run:main"
DELAY_ENV = "CKPT_DILOCO_REPLAY_DELAY_S"


def run_actors(hub: TapeHub, cfg: DiLoCoConfig, *, step_delay_s: float = 0.0,
               delay_of: Callable[[str, int], float] | None = None,
               on_step: Callable[[int, dict[str, Any]], None] | None = None,
               after_step: Callable[[int, Any], None] | None = None,
               snapshots: Any = None, restore: Any = None) -> RunResult:
    """Every actor as a thread of this process over the in-process transport.

    ``delay_of(actor, incarnation)`` slows chosen learners down per inner step (tests of
    timing independence); ``step_delay_s`` slows every learner (a slower replay machine).
    ``snapshots`` (a :class:`~runs.diloco.snapshots.Snapshots`) writes the snapshots
    taken every ``cfg.snapshot_every`` syncer steps; ``restore`` (a committed snapshot,
    :class:`~runs.diloco.snapshots.Restored`) starts every actor at its cut instead of at
    the beginning."""
    worker_threads()
    t0 = time.monotonic()
    if restore is not None:
        schedule = Schedule.from_json(restore.syncer["schedule"])
    else:
        schedule = decide_schedule(hub, cfg)
    theta0 = initial_state(cfg)
    names = learner_names(cfg)
    spares = spares_of(cfg, schedule)
    endpoints = ["syncer"] + [e for a in names for e in [a, *spares[a]]]
    net = InProcessNetwork.complete(endpoints)
    # restore: which incarnation of each learner starts, which endpoints start afresh
    first_inc = {a: 0 for a in names}
    rejoin: set[str] = set()
    if restore is not None:
        first_inc, rejoin = restore.incarnations(names)
    outcomes: list[LearnerOutcome] = []
    done: dict[str, threading.Event] = {e: threading.Event() for e in endpoints}
    lock = threading.Lock()

    def learner_thread(actor: str, inc: int) -> None:
        ep_name = endpoint_name(actor, inc)
        try:
            link = Inbox(Endpoint(net.transport(ep_name)), hub.local(actor), timeout_s=cfg.io_timeout_s, markers=True)
            prev = endpoint_name(actor, inc - 1) if inc > first_inc[actor] else None
            part = restore if restore is not None and inc == first_inc[actor] and actor in restore.learners else None
            ctx = LearnerCtx(cfg, actor, inc, link, theta0, schedule.for_learner(actor),
                             die=lambda: net.kill(ep_name),
                             predecessor_done=(lambda: _wait(done[prev], cfg.io_timeout_s, prev)) if prev else
                             (lambda: None),
                             step_delay_s=delay_of(actor, inc) if delay_of is not None else step_delay_s,
                             parts=snapshots, restore=part, rejoin=ep_name in rejoin,
                             dropped=tuple(sorted(rejoin)))
            o = run_learner(ctx)
            with lock:
                outcomes.append(o)
        except BaseException as e:  # re-raised in the main thread (Threads.join)
            net.kill(ep_name, f"crashed: {e!r}")
            raise
        finally:
            done[ep_name].set()

    for a in names:
        for k in range(first_inc[a]):  # incarnations that died before the cut
            net.kill(endpoint_name(a, k), "dead before the snapshot")
            done[endpoint_name(a, k)].set()
    link = Inbox(Endpoint(net.transport("syncer")), hub.local("syncer"), timeout_s=cfg.io_timeout_s, markers=True)
    if restore is not None:
        restore.register_stamps(hub)
    threads = Threads()
    for a in names:
        for k in range(first_inc[a], len(spares[a]) + 1):
            threads.start(endpoint_name(a, k), learner_thread, a, k)
    try:
        sy = run_syncer(SyncerCtx(cfg, link, theta0, schedule, spares, val_corpus(cfg), on_step=on_step,
                                  after_step=after_step, snapshots=snapshots,
                                  endpoint_gone=lambda e: _wait(done[e], hang_bound(cfg.io_timeout_s), e),
                                  restore=restore))
    except BaseException:
        # every learner thread's receive fails at once: none stays blocked (a hot spare's
        # wait for its activation has no clock of its own)
        net.shutdown("syncer failed")
        raise
    threads.join(what="learner threads")
    outcomes.sort(key=lambda o: (int(o.actor.rsplit("-", 1)[1]), o.incarnation))
    res = RunResult(cfg, schedule, sy, outcomes, time.monotonic() - t0)
    if snapshots is not None:
        res.extra["snapshots"] = list(snapshots.outcomes)
    return res


def _wait(ev: threading.Event, bound: float, what: str | None) -> None:
    if not ev.wait(bound):  # a hang bound (10x the I/O timeout), not a speed verdict
        raise HangError(f"predecessor incarnation {what} did not finish within {bound:.0f} s")


def open_recorder(tape: str | os.PathLike[str], cfg: DiLoCoConfig, **opts: Any) -> Recorder:
    return Recorder.open(str(tape), entry_point=ENTRY_POINT, config={"diloco": cfg.to_dict()}, actor="syncer",
                         rng_every=0, param_digest_every=0, rng_sources=(), **opts)


def record(tape: str | os.PathLike[str], cfg: DiLoCoConfig, *, snapshot_dir: str | os.PathLike[str] | None = None,
           **kw: Any) -> RunResult:
    """Run and record. ``kw`` goes to :func:`run_actors` (or the process launcher).

    With ``cfg.snapshot_every`` the snapshots are committed under ``snapshot_dir``
    (default: ``checkpoints/`` next to the tape)."""
    Path(tape).parent.mkdir(parents=True, exist_ok=True)
    if cfg.snapshot_every:
        from runs.diloco.snapshots import Snapshots

        root = Path(snapshot_dir) if snapshot_dir is not None else Path(tape).parent / "checkpoints"
        kw["snapshots"] = Snapshots(root, keep_last=cfg.snapshot_keep, config={"diloco": cfg.to_dict()})
    with open_recorder(tape, cfg) as rec:
        hub = TapeHub(rec, wait_s=cfg.io_timeout_s)
        if cfg.transport == "gloo":
            from runs.diloco.procs import run_processes

            res = run_processes(hub, cfg, **kw)
        else:
            res = run_actors(hub, cfg, **kw)
    res.tape = str(tape)
    return res


def main(rec: Recorder) -> RunResult:
    """The tape entry point: re-run the recorded run as threads (verify/force/fork); the
    result comes back to the caller of ``replay`` as ``ReplayResult.value``."""
    cfg = DiLoCoConfig.from_dict(dict(rec.config["diloco"]))
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    hub = TapeHub(rec, wait_s=cfg.io_timeout_s)
    return run_actors(hub, cfg, step_delay_s=delay)

