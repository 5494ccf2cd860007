"""Loss-spike rollback with anticipatory MoE routing (spec/loss-guard.md).

``LossGuard(manager, GuardConfig(...))`` judges every optimizer step's loss by a robust
z-score over a window of accepted losses (non-finite losses always trip) and, on a
spike, rolls the run back to the newest verified checkpoint before it, restores the
model, optimizer, LR schedule, data position and RNG, and applies the data policy (skip
or reorder the offending window) through ``ckpt.data.ResumableLoader.edit``. At most
``max_rollbacks`` episodes per run. Each episode is taped: on the manager's step ledger
and, given ``tape=`` (a ``replay.Recorder``), on the recorder's tape, whose forced
replay follows the taped decisions. With ``warmup_batches=K``, the routing of the next K
batches is computed with the restored weights and replayed when they train
(``ckpt.guard.select_experts(layer, logits, k)`` is the MoE layers' call).

Importing this package does not import torch; ``LossGuard`` loads it on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import GuardConfig
from .routing import select as select_experts
from .rule import Verdict, judge

__all__ = ["GuardConfig", "LossGuard", "Rollback", "TapeSink", "Verdict", "judge", "select_experts", "routing",
           "events"]

if TYPE_CHECKING:  # pragma: no cover
    from .guard import LossGuard, Rollback, TapeSink


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("LossGuard", "Rollback", "TapeSink"):
        value = getattr(importlib.import_module(".guard", __name__), name)
        globals()[name] = value
        return value
    if name in ("routing", "events"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'ckpt.guard' has no attribute {name!r}")
