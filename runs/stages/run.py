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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from replay import (
    CkptSnapshotStore,
    Endpoint,
    InProcessNetwork,
    MemoryControl,
    Pending,
    Recorder,
    RecorderSink,
    ReplayResult,
    SnapshotAgent,
    replay,
)
from runs.stages.config import StagesConfig
from runs.stages.ctl import Controller, CtlResult, snapshot_name
from runs.stages.model import Data
from runs.stages.worker import Worker

__all__ = ["ENTRY_POINT", "RunOutcome", "RunStore", "record", "run_threads", "open_recorder", "main", "restore_run",
           "config_of_tape"]

ENTRY_POINT = "runs.stages.run:main"


@dataclass
class RunOutcome:
    ctl: CtlResult
    states: dict[str, list[tuple[str, torch.Tensor]]] | None  # worker -> final named state (threads only)
    run_dir: str
    tape: str = ""
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class RunStore:
    """The snapshot store of a run: ``ckpt`` checkpoints under ``run_dir/snapshots``, named on
    the tape and in markers by their path relative to ``run_dir`` (spec/stages.md §8), so that
    a replay in another directory tapes the same bytes."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.run_dir = os.path.abspath(os.fspath(run_dir))
        self.inner = CkptSnapshotStore(os.path.join(self.run_dir, "snapshots"))

    def _abs(self, p: Pending) -> Pending:
        return Pending(os.path.join(self.run_dir, p.final), os.path.join(self.run_dir, p.tmp_dir), p.overwrite)

    def begin(self, name: str) -> Pending:
        p = self.inner.begin(name)
        return Pending(os.path.relpath(p.final, self.run_dir), os.path.relpath(p.tmp_dir, self.run_dir), p.overwrite)

    def write_part(self, pending: Pending, part: str, state: Any, **kw: Any) -> dict[str, Any]:
        return self.inner.write_part(self._abs(pending), part, state, **kw)

    def commit(self, pending: Pending, records: Any, **kw: Any) -> None:
        self.inner.commit(self._abs(pending), records, **kw)

    def abort(self, pending: Pending) -> None:
        self.inner.abort(self._abs(pending))

    def __getattr__(self, name: str) -> Any:  # read_meta, part_names, read_extra, read_entry, load_into, ...
        return getattr(self.inner, name)


def open_recorder(path: str | os.PathLike[str], cfg: StagesConfig, *, actor: str = "ctl", **opts: Any) -> Recorder:
    # No RNG digests (the run draws none after initialisation, and threads share the global
    # generators) and no automatic parameter digests (workers tape their own at the end).
    return Recorder.open(str(path), entry_point=ENTRY_POINT, config={"stages": cfg.to_dict()}, actor=actor,
                         rng_every=0, param_digest_every=0, rng_sources=(), **opts)


def make_agent(cfg: StagesConfig, ep: Endpoint, entries: dict[str, Any], run_dir: str | os.PathLike[str],
               control: Any) -> SnapshotAgent:
    return SnapshotAgent(ep, entries, store=RunStore(run_dir), control=control, participants=cfg.actors,
                         deadline_s=cfg.io_timeout_s)


def restore_actor(cfg: StagesConfig, agent: SnapshotAgent, name: str) -> None:
    """Start an actor from its part of snapshot ``name`` and re-tape what the original taped
    after its cut: its channel state (empty at a step boundary) and, on ctl, the outcome."""
    info = agent.restore(name, announce=False)
    if any(info.inflight.values()):
        raise ValueError(f"snapshot {name}: {agent.actor} has in-flight messages recorded, but this run cuts only "
                         "at step boundaries (spec/stages.md §8)")
    agent.ep.record("snapshot.local_done", {"snapshot": name, "inflight": {}, "inflight_refs": []})
    if agent.actor == "ctl":
        meta = agent.store.read_meta(name)
        agent.ep.record("snapshot.commit", {"snapshot": name, "path": os.path.join("snapshots", name),
                                            "parts": sorted(meta["parts"]), "excluded": sorted(meta["excluded"])})


def run_threads(cfg: StagesConfig, rec: Recorder, run_dir: str | os.PathLike[str], *, restore: str | None = None,
                on_step: Callable[[int], None] | None = None) -> RunOutcome:
    """Every actor as a thread of this process, all recording on ``rec``."""
    torch.set_num_threads(1)  # the processes' setting: the same kernels, the same bits
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
    errors: list[BaseException] = []

    def work(w: str) -> None:
        try:
            torch.set_num_threads(1)
            workers[w].run()
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            net.kill(w, f"crashed: {e!r}")

    threads = [threading.Thread(target=work, args=(w,), name=w, daemon=True) for w in cfg.workers]
    for t in threads:
        t.start()
    try:
        res = ctl.run(restored=restore is not None)
    except BaseException:
        for a in cfg.actors:
            net.kill(a, "ctl failed")
        for t in threads:
            t.join(5)
        if errors:
            raise errors[0]
        raise
    for t in threads:
        t.join(cfg.io_timeout_s)
    if errors:
        raise errors[0]
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raise TimeoutError(f"workers did not finish: {stuck}")
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
