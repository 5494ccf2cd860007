"""A Decoupled-DiLoCo reference run: learners, a syncer, seeded chaos, exact replay.

See ``run.py`` for the orchestration and ``spec``-level notes in each module.
"""

from __future__ import annotations

from replay.diloco.chaos import Fault, Schedule, make_schedule
from replay.diloco.config import DiLoCoConfig
from replay.diloco.fragments import Fragment, pack_fragments
from replay.diloco.run import RunResult, main, record
from replay.diloco.snapshots import RestoreResult, continue_run, list_snapshots, restore_run

__all__ = ["DiLoCoConfig", "Fault", "Schedule", "make_schedule", "Fragment", "pack_fragments", "RunResult",
           "record", "main", "restore_run", "continue_run", "RestoreResult", "list_snapshots"]
