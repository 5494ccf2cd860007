"""Running the pipeline: every actor as a thread over the in-process transport, or as a
process over gloo (``procs.py``); recording, the tape entry point, and restores.

``record(cfg, run_dir)`` leaves the job tape at ``run_dir/run.tape`` either way (with gloo,
merged from the per-process tapes under ``run_dir/tapes``). ``ckpt replay run.tape --mode
force`` calls :func:`main`, which runs every actor as a thread: every receive is
``recv_from`` and every timing-dependent choice is on the tape, so the events come out the
same as the processes taped them, byte for byte.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from replay import Recorder, ReplayResult, replay
from replay.channel import Endpoint, InProcessNetwork, RecorderSink
from replay.snapshot import MemoryControl
from runs.common.procs import Threads, worker_threads
from runs.stages.config import StagesConfig
from runs.stages.ctl import Controller, snapshot_name
from runs.stages.model import Data
from runs.stages.wiring import ENTRY_POINT, RunOutcome, RunStore, make_agent, open_recorder, restore_actor
from runs.stages.worker import Worker

__all__ = ["ENTRY_POINT", "RunOutcome", "RunStore", "record", "run_threads", "open_recorder", "main", "restore_run",
           "config_of_tape"]

def run_threads(cfg: StagesConfig, rec: Recorder, run_dir: str | os.PathLike[str], *, restore: str | None = None,
                on_step: Callable[[int], None] | None = None) -> RunOutcome:
    """Every actor as a thread of this process, all recording on ``rec``."""
    worker_threads()  # the processes' setting: the same kernels, the same bits
    t0 = time.monotonic()
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    net = InProcessNetwork(cfg.edges(), actors=cfg.actors)
    sink = RecorderSink(rec)
    control = MemoryControl()
    data = Data(cfg)
    eps = {a: Endpoint(net.transport(a), sink=sink) for a in cfg.actors}
    workers = {w: Worker(cfg, w, eps[w], sink.actor(w), run_dir, data=data) for w in cfg.workers}
    ctl = Controller(cfg, eps["ctl"], sink.actor("ctl"), on_step=on_step)
    agents = {w: make_agent(cfg, eps[w], workers[w].entries(), run_dir, control) for w in cfg.workers}
    agents["ctl"] = ctl.agent = make_agent(cfg, eps["ctl"], {"ctl": ctl.state}, run_dir, control)
    if restore is not None:
        for a in cfg.actors:
            restore_actor(cfg, agents[a], restore)
    threads = Threads(on_error=lambda w, e: net.kill(w, f"crashed: {e!r}"))
    for w in cfg.workers:
        threads.start(w, workers[w].run)
    try:
        res = ctl.run(restored=restore is not None)
    except BaseException:
        for a in cfg.actors:
            net.kill(a, "ctl failed")
        threads.abandon(5)
        raise
    threads.join(what="stage workers")
    for ag in agents.values():
        ag.close()
    return RunOutcome(res, {w: workers[w].named_state() for w in cfg.workers}, str(run_dir),
                      wall_s=time.monotonic() - t0)


def record(cfg: StagesConfig, run_dir: str | os.PathLike[str], *, on_step: Callable[[int], None] | None = None
           ) -> RunOutcome:
    """Run ``cfg`` and record it; the job tape is ``run_dir/run.tape``."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tape = run_dir / "run.tape"
    if cfg.transport == "gloo":
        from runs.stages.procs import run_processes

        out = run_processes(cfg, run_dir, on_step=on_step)
    else:
        with open_recorder(tape, cfg) as rec:
            out = run_threads(cfg, rec, run_dir, on_step=on_step)
    out.tape = str(tape)
    return out


def config_of_tape(tape: str | os.PathLike[str]) -> StagesConfig:
    from replay import TapeReader

    return StagesConfig.from_dict(dict(TapeReader(tape).meta["config"]["stages"]))


def main(rec: Recorder) -> RunOutcome:
    """The tape entry point (``ckpt replay``): every actor as a thread, in a scratch run
    directory (recovery checkpoints and snapshots are written again there)."""
    cfg = StagesConfig.from_dict(dict(rec.config["stages"]))
    with tempfile.TemporaryDirectory(prefix="stages-replay-") as d:
        return run_threads(cfg, rec, d)


def restore_run(tape: str | os.PathLike[str], snapshot_dir: str | os.PathLike[str]) -> ReplayResult:
    """Start every actor from the committed snapshot at ``snapshot_dir`` and continue the run
    in force mode under ``tape``, each actor aligned just after its own cut: identical when
    every event after every cut is the tape's (the result's value is the :class:`RunOutcome`)."""
    cfg = config_of_tape(tape)
    name = Path(snapshot_dir).name
    with tempfile.TemporaryDirectory(prefix="stages-restore-") as d:
        shutil.copytree(snapshot_dir, Path(d) / "snapshots" / name)
        return replay(tape, mode="force", align_snapshot=name,
                      entry=lambda rec: run_threads(cfg, rec, d, restore=name))


def snapshot_dirs(run_dir: str | os.PathLike[str], cfg: StagesConfig) -> list[Path]:
    return [Path(run_dir) / "snapshots" / snapshot_name(t) for t in cfg.snapshot_at]
