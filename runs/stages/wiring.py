"""What the threads and the processes wire the same way: the recorder of a tape, the
snapshot store and agent, and the record of a finished run."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from replay import Recorder
from replay.channel import Endpoint
from replay.snapshot import CkptSnapshotStore, Pending, SnapshotAgent
from runs.stages.config import StagesConfig
from runs.stages.ctl import CtlResult

__all__ = ["ENTRY_POINT", "RunOutcome", "RunStore", "open_recorder", "make_agent", "restore_actor"]

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
        # exactness "off": a restore in threads of parts written by gloo processes differs in
        # world size only, which no number of this run depends on (it has no collective);
        # that the restore is exact is proven event by event under the tape instead.
        self.inner = CkptSnapshotStore(os.path.join(self.run_dir, "snapshots"), exactness="off")

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
