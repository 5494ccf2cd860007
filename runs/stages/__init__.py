"""Pipeline stage skipping (the Templar/Crucible seed): R replicas x S stages of a tiny
transformer, inner stages bypassed while offline, SparseLoCo-style replica exchanges, low-rank
pipeline compression, seeded chaos; taped and replayed exactly (spec/stages.md)."""

from __future__ import annotations

from runs.stages.chaos import Outage, Schedule, make_schedule
from runs.stages.config import StagesConfig
from runs.stages.run import RunOutcome, main, record, restore_run

__all__ = ["StagesConfig", "Outage", "Schedule", "make_schedule", "RunOutcome", "record", "main", "restore_run"]
