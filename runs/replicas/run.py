"""Recording a replica run, and its tape entry point ``main(rec)`` (the replay).

``record(tape, cfg)`` runs the real thing (torchft lighthouse, a process per rank, real
SIGKILLs) and records one tape. ``ckpt replay TAPE --mode force`` calls :func:`main`, which
runs every rank as a thread of one process: the taped decisions (quorums, all-reduce
outcomes, commits, faults, the bytes of each recovery) make the outcome independent of
timing, and the same torchft gloo groups reduce in the same order, so losses, parameter
and state digests come out bit-identical.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import torch

from replay import Recorder
from replay.watchdog import Watchdog, hang_bound
from runs.replicas.config import ReplicaConfig, check
from runs.replicas.tapeio import Hub, LocalSink
from runs.replicas.worker import RankResult

__all__ = ["ENTRY_POINT", "RunResult", "record", "main", "run_threads", "open_recorder", "stderr_to"]

ENTRY_POINT = "runs.replicas.run:main"


@dataclass
class RunResult:
    cfg: ReplicaConfig
    mode: str  # processes | threads
    ranks: dict[str, dict[str, Any]] = field(default_factory=dict)  # actor -> outcome, steps, params, ...
    exitcodes: dict[str, Any] = field(default_factory=dict)
    killed: dict[str, list[int]] = field(default_factory=dict)
    wall_s: float = 0.0
    tape: str | None = None


def open_recorder(tape: str | os.PathLike[str], cfg: ReplicaConfig, **opts: Any) -> Recorder:
    return Recorder.open(str(tape), entry_point=ENTRY_POINT, config={"replicas": cfg.to_dict()}, actor="run",
                         rng_every=0, param_digest_every=0, rng_sources=(), **opts)


@contextlib.contextmanager
def stderr_to(path: str | os.PathLike[str]) -> Iterator[None]:
    """File descriptor 2 of this process goes to ``path`` (appended) for the block: torchft's
    Rust logger and its Python loggers write every quorum and commit there, not on the
    demo's terminal. An exception still propagates (and prints) after the block."""
    sys.stderr.flush()
    fd = os.open(str(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)


def record(tape: str | os.PathLike[str], cfg: ReplicaConfig, *, transport: str = "processes", **kw: Any) -> RunResult:
    """Run ``cfg`` with torchft and record ``tape``: a process per rank (``processes``, the
    real thing, SIGKILLs included) or a thread per rank (``threads``: torchft's Managers in
    one process, as torchft's own integration tests run them; no kills)."""
    check(cfg)
    Path(tape).parent.mkdir(parents=True, exist_ok=True)
    if cfg.ckpt_every:  # the run's periodic checkpoints, beside its tape (run.tape -> run.ckpt/)
        d = Path(kw.setdefault("ckpt_dir", str(Path(tape).with_suffix(".ckpt"))))
        if d.exists() and any(d.iterdir()):
            raise FileExistsError(f"{d} is not empty: a run's checkpoints never mix with another's")
    logs = Path(tape).with_suffix(".logs")  # torchft's own logging (Rust and Python), per process
    logs.mkdir(parents=True, exist_ok=True)
    with open_recorder(tape, cfg) as rec, stderr_to(logs / "run.log"):
        hub = Hub(rec, wait_s=max(120.0, 6 * cfg.timeout_s))
        if transport == "threads":
            res = _ft_threads(hub, cfg, **kw)
        else:
            from runs.replicas.procs import run_processes

            out = run_processes(hub, cfg, log_dir=str(logs), **kw)
            res = RunResult(cfg, "processes", {a: dict(r) for a, r in out["results"].items()}, out["exitcodes"],
                            out["killed"], out["wall_s"])
    res.tape = str(tape)
    return res


def _ft_threads(hub: Hub, cfg: ReplicaConfig, *, on_commit: Any = None, ckpt_dir: str | None = None) -> RunResult:
    """torchft's Managers as threads of this process (recording; no SIGKILL possible here)."""
    import torch.distributed as dist
    from torchft._torchft import LighthouseServer

    from runs.replicas.coord import FtCoordinator
    from runs.replicas.worker import build_state, run_rank

    if cfg.kills:
        raise ValueError("a thread cannot be SIGKILLed: record kills with transport='processes'")
    torch.set_num_threads(1)
    t0 = time.monotonic()
    lh = LighthouseServer(bind="[::]:0", min_replicas=cfg.min_replicas, join_timeout_ms=cfg.join_timeout_ms,
                          quorum_tick_ms=cfg.quorum_tick_ms, heartbeat_timeout_ms=cfg.heartbeat_timeout_ms)
    sizes = dict(cfg.all_groups())
    masters = {g: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=120)) for g in sizes}
    committed = [-1]
    cond = threading.Condition()

    def on_applied(actor: str, method: str, args: tuple) -> None:
        if method == "event" and args[0] == "step_commit" and args[2] == 1:
            with cond:
                committed[0] = max(committed[0], hub.rec.actor(actor).current_step)
                cond.notify_all()

    hub.listeners.append(on_applied)
    results: dict[str, RankResult] = {}
    errors: list[BaseException] = []
    after = {j.group: j.after_step for j in cfg.joins}
    initial = {a for a in cfg.actors() if a.split(".")[0] not in after}
    up: set[str] = set()  # ranks the lighthouse has heard from (see procs.run_processes)

    def before_quorum(step: int) -> None:
        # a joiner let in after step k is in the quorum of step k + 1 (see procs.run_processes)
        due = {f"{j.group}.{r}" for j in cfg.joins if j.after_step < step for r in range(j.ranks)}
        with cond:
            cond.wait_for(lambda: due <= up or bool(errors))

    def rank_thread(actor: str) -> None:
        try:
            g = actor.split(".")[0]
            st = build_state(cfg)
            if g in after:
                with cond:
                    cond.wait_for(lambda: committed[0] >= after[g] or bool(errors))
                if errors:
                    return
            sink = LocalSink(hub, actor)
            # a client of its own: one TCPStore object is not for two threads' rendezvous at once
            store = dist.TCPStore("127.0.0.1", masters[g].port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=120))
            coord = FtCoordinator(actor, sizes[g], st, sink, lighthouse=lh.address(), store=store,
                                  store_port=masters[g].port, before_quorum=before_quorum)
            coord.announce()
            with cond:  # no quorum asked before the lighthouse knows every initial group
                up.add(actor)
                cond.notify_all()
                cond.wait_for(lambda: initial <= up or bool(errors))
            if errors:
                return
            results[actor] = run_rank(actor, sizes[g], st, coord, sink,
                                      on_commit=(lambda s, loss: on_commit(actor, s)) if on_commit else None,
                                      ckpt_dir=ckpt_dir)
        except BaseException as e:  # the main thread reports it
            errors.append(e)
            with cond:
                cond.notify_all()

    threads = [threading.Thread(target=rank_thread, args=(a,), name=a, daemon=True) for a in cfg.actors()]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(1800)
    finally:
        lh.shutdown()
    if errors:
        raise errors[0]
    ranks = {a: {"outcome": r.outcome, "steps": r.steps, "params": r.params, "recovered_from": r.recovered_from,
                 "losses": r.losses} for a, r in results.items()}
    return RunResult(cfg, "threads", ranks, wall_s=time.monotonic() - t0)


def run_threads(hub: Hub, cfg: ReplicaConfig, ckpt_dir: str | None = None) -> RunResult:
    """Every rank (joiners and the killed included) as a thread of this process, driven by
    the tape's decisions (force mode). The replay's own periodic checkpoints (a rollback
    loads one) go to ``ckpt_dir``."""
    import torch.distributed as dist

    from runs.replicas.coord import Rendezvous, ReplayCoordinator
    from runs.replicas.worker import build_state, run_rank

    torch.set_num_threads(1)
    t0 = time.monotonic()
    master = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    sizes = dict(cfg.all_groups())
    results: dict[str, RankResult] = {}
    errors: list[BaseException] = []
    rdv = Rendezvous()
    done = threading.Condition()
    ended: list[str] = []

    def rank_thread(actor: str) -> None:
        try:
            store = dist.TCPStore("localhost", master.port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=600))
            st = build_state(cfg)
            sink = LocalSink(hub, actor)
            g = actor.split(".")[0]
            coord = ReplayCoordinator(actor, sizes[g], st, sink, store=store, store_port=master.port, rdv=rdv)
            results[actor] = run_rank(actor, sizes[g], st, coord, sink, ckpt_dir=ckpt_dir)
        except BaseException as e:  # the main thread reports it
            errors.append(e)
        finally:
            rdv.ended(actor)
            with done:
                ended.append(actor)
                done.notify_all()

    threads = [threading.Thread(target=rank_thread, args=(a,), name=a, daemon=True) for a in cfg.actors()]
    for t in threads:
        t.start()
    # The wait is on the ranks' ends, never on a clock; a hang is caught by the watchdog
    # (progress: the ranks that ended, the tape calls the ranks made), which dumps every
    # thread's stacks and raises HangError naming the file.
    calls = [0]
    hub.listeners.append(lambda *_: calls.__setitem__(0, calls[0] + 1))
    dog = Watchdog(Path(tempfile.gettempdir()) / f"replicas-replay-hang-{os.getpid()}", name="replay threads",
                   stall_s=hang_bound(cfg.timeout_s), kill=False, progress=lambda: (len(ended), calls[0]))
    for t in threads:
        dog.watch(t.name)
    with dog, done:  # the first error ends the replay: ranks it left waiting in a collective are daemons
        dog.wait(lambda: bool(errors) or len(ended) == len(threads), done)
    if errors:
        raise errors[0]
    for t in threads:
        # Each rank has said it ended, from its last lines: the join is immediate. (Judging
        # is_alive() right after the notification raced the threads' exit under load:
        # "replay threads did not finish: ['g0.0']" from a replay that had finished.)
        t.join()
    ranks = {a: {"outcome": r.outcome, "steps": r.steps, "params": r.params, "recovered_from": r.recovered_from,
                 "losses": r.losses} for a, r in results.items()}
    return RunResult(cfg, "threads", ranks, wall_s=time.monotonic() - t0)


def main(rec: Recorder) -> RunResult:
    """The tape entry point (force mode): re-run the recorded replica run as threads."""
    cfg = ReplicaConfig.from_dict(dict(rec.config["replicas"]))
    if not cfg.ckpt_every:
        return run_threads(Hub(rec, wait_s=600.0), cfg)
    with tempfile.TemporaryDirectory(prefix="replicas-replay-") as d:  # never the recorded run's checkpoints
        return run_threads(Hub(rec, wait_s=600.0), cfg, ckpt_dir=d)
