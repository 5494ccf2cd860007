"""``GuardConfig``: the thresholds and policies of the loss-spike guard (spec/loss-guard.md §9)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..errors import GuardConfigError

__all__ = ["GuardConfig"]


def _int(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise GuardConfigError(f"GuardConfig.{name} must be an int >= {lo}, got {v!r}", key=name)


def _float(name: str, v: Any, *, positive: bool) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (v > 0 if positive else v >= 0)
    if not ok:
        rule = "a finite number > 0" if positive else "a finite number >= 0"
        raise GuardConfigError(f"GuardConfig.{name} must be {rule}, got {v!r}", key=name)


def _choice(name: str, v: Any, choices: tuple[str, ...]) -> None:
    if v not in choices:
        raise GuardConfigError(f"GuardConfig.{name} must be one of {', '.join(map(repr, choices))}, got {v!r}", key=name)


@dataclass(frozen=True, slots=True)
class GuardConfig:
    """How the guard detects a spike and what an episode does about it.

    Detection (spec §2): a non-finite loss always trips; otherwise, once ``min_history``
    accepted losses are in the ``window``, a loss whose robust z-score
    ``(x - median) / max(1.4826 * MAD, min_scale * |median|, 1e-12)`` exceeds
    ``z_threshold`` trips. An episode (spec §3) rolls back to the newest checkpoint
    whose step is below ``detected - lookback``, then applies ``policy`` to the window of
    batches from ``skip_before`` before the spiking step's batches to ``skip_after``
    after them: ``"skip"`` drops them, ``"reorder"`` serves them ``reorder_delay``
    batches later. At most ``max_rollbacks`` episodes per run; the next spike raises
    ``RollbackLimitError``. ``on_no_checkpoint``: ``"raise"`` (``NoRollbackTargetError``)
    or ``"continue"`` (accept the step). ``warmup_batches``: K batches whose MoE routing
    is computed with the restored weights and replayed when they are trained (spec §7).
    """

    window: int = 32
    min_history: int = 8
    z_threshold: float = 6.0
    min_scale: float = 0.01
    lookback: int = 0
    policy: Literal["skip", "reorder"] = "skip"
    skip_before: int = 0
    skip_after: int = 0
    reorder_delay: int = 16
    max_rollbacks: int = 3
    on_no_checkpoint: Literal["raise", "continue"] = "raise"
    warmup_batches: int = 0

    def __post_init__(self) -> None:
        _int("window", self.window, 3)
        _int("min_history", self.min_history, 3)
        if self.min_history > self.window:
            raise GuardConfigError(f"GuardConfig.min_history ({self.min_history}) must be <= window ({self.window})",
                                   key="min_history")
        _float("z_threshold", self.z_threshold, positive=True)
        _float("min_scale", self.min_scale, positive=False)
        _int("lookback", self.lookback, 0)
        _choice("policy", self.policy, ("skip", "reorder"))
        _int("skip_before", self.skip_before, 0)
        _int("skip_after", self.skip_after, 0)
        _int("reorder_delay", self.reorder_delay, 1)
        _int("max_rollbacks", self.max_rollbacks, 1)
        _choice("on_no_checkpoint", self.on_no_checkpoint, ("raise", "continue"))
        _int("warmup_batches", self.warmup_batches, 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
