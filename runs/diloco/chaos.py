"""The DiLoCo run's seeded fault schedule: one fault of each class (``runs.common.chaos``).

Learner faults fire at a learner's own inner step (so the point where a learner dies is
the same in every replay); rejoins fire at the syncer step ``rejoin_after`` steps after
the syncer *detected* the death, and detection time is part of the syncer's taped plan.
The loss fault takes ``learners - quorum`` learners at once, so the run goes on at the
quorum minimum.
"""

from __future__ import annotations

from runs.common.chaos import FAULT_CLASSES, NO_FAULTS, Fault, Schedule, describe, place_faults  # noqa: F401
from runs.diloco.config import DiLoCoConfig

__all__ = ["Fault", "Schedule", "make_schedule", "describe", "learner_names", "NO_FAULTS", "FAULT_CLASSES"]


def learner_names(cfg: DiLoCoConfig) -> list[str]:
    return [f"learner-{i}" for i in range(cfg.learners)]


def make_schedule(cfg: DiLoCoConfig) -> Schedule:
    """One fault of each class, placed by ``cfg.chaos_seed``; no faults when ``cfg.chaos`` is off."""
    if not cfg.chaos:
        return Schedule((), cfg.rejoin_after)
    return place_faults(learner_names(cfg), steps=cfg.steps, period=cfg.inner_h, lost=cfg.learners - cfg.quorum,
                        shards=cfg.shards_per_learner, seed=cfg.chaos_seed, jitter_s=cfg.jitter_s,
                        rejoin_after=cfg.rejoin_after)
