"""A Decoupled-DiLoCo reference run: learners, a syncer, seeded chaos, exact replay.

See ``run.py`` for the orchestration and ``spec``-level notes in each module.
"""

from __future__ import annotations

from runs.diloco.chaos import Fault, Schedule, make_schedule
from runs.diloco.config import DiLoCoConfig
from runs.diloco.fragments import Fragment, pack_fragments
from runs.diloco.run import RunResult, main, record
from runs.diloco.restore import RestoreResult, continue_run, restore_run
from runs.diloco.snapshots import list_snapshots

__all__ = ["DiLoCoConfig", "Fault", "Schedule", "make_schedule", "Fragment", "pack_fragments", "RunResult",
           "record", "main", "restore_run", "continue_run", "RestoreResult", "list_snapshots"]
