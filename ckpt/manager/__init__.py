"""``CheckpointManager``: a run directory of ``step-NNNNNNNN/`` checkpoints that resume exactly.

docs/manager.md is the user guide (what it guarantees, and the exact-resume checklist).
One module per concern:

- ``manager``: the façade (``after_step``, ``save``, ``resume``, ``rewind``, ``close``);
- ``options``: ``ManagerOptions``, every constructor option, validated once;
- ``hooks``: ``StepHook``, what the manager asks of an attached ``LossGuard``;
- ``listing``: checkpoint names, ``list_checkpoints``, ``latest``;
- ``retention``: ``RetentionPolicy``, the plan, the one deletion routine, a manager's floor
  and damaged-checkpoint rules;
- ``_resume``: the fallback rule and ``ResumeMismatchError``; ``_saver``: the save job and the
  background worker; ``_signals``; ``_cadence``; ``_dedup``; ``_role``: the writer lock and
  the follower role.
"""

from __future__ import annotations

from .._linkcheck import SharedFileDamagedWarning
# config_changes and warn_config_changed: not in __all__, imported by the integrations
from ._resume import ConfigChangedWarning, ResumeFallbackWarning, config_changes, warn_config_changed  # noqa: F401
from ._saver import SaveReport
from .hooks import StepCall, StepHook
from .listing import CheckpointRecord, LatestCheckpoint, checkpoint_name, latest, list_checkpoints
from .manager import CheckpointManager, Rewind
from .options import ManagerOptions
from .retention import RetentionPolicy, apply_retention, delete_checkpoints, plan_retention

__all__ = [
    "CheckpointManager",
    "ManagerOptions",
    "StepHook",
    "StepCall",
    "RetentionPolicy",
    "CheckpointRecord",
    "SaveReport",
    "Rewind",
    "ResumeFallbackWarning",
    "ConfigChangedWarning",
    "LatestCheckpoint",
    "latest",
    "SharedFileDamagedWarning",
    "list_checkpoints",
    "plan_retention",
    "apply_retention",
    "delete_checkpoints",
    "checkpoint_name",
]
