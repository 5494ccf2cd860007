"""What a DiLoCo run is decided to be before it starts (the chaos schedule, each learner's
spare endpoints) and what it returns; shared by the thread and the process launchers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runs.common.chaos import Schedule, taped_schedule
from runs.diloco.chaos import learner_names, make_schedule
from runs.diloco.config import DiLoCoConfig
from runs.diloco.learner import LearnerOutcome
from runs.diloco.syncer import SyncerOutcome
from replay.channel import TapeHub, endpoint_name

__all__ = ["RunResult", "decide_schedule", "spares_of"]


@dataclass
class RunResult:
    cfg: DiLoCoConfig
    schedule: Schedule
    syncer: SyncerOutcome
    learners: list[LearnerOutcome]
    wall_s: float
    tape: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def final_learner_states(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """The last incarnation's final state of every learner that finished."""
        out: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for o in self.learners:
            if o.state:
                out[o.actor] = o.state
        return out


def decide_schedule(hub: TapeHub, cfg: DiLoCoConfig) -> Schedule:
    return taped_schedule(hub.local("chaos"), lambda: make_schedule(cfg))


def spares_of(cfg: DiLoCoConfig, schedule: Schedule) -> dict[str, list[str]]:
    return {a: [endpoint_name(a, k) for k in range(1, schedule.deaths(a) + 1)] for a in learner_names(cfg)}
