"""``StepHook``: what a ``CheckpointManager`` asks of an object attached to it
(``CheckpointManager.attach``); ``ckpt.guard.LossGuard`` is one. Neither side touches
the other's fields: the manager calls these methods, and the hook drives the manager
through its public methods and the ``StepCall`` that ``attach`` returned."""

from __future__ import annotations

from typing import Any, Mapping, Protocol

__all__ = ["StepCall", "StepHook"]


class StepHook(Protocol):
    """An object that takes over the loop's per-step call of a manager (it judges the
    step first, then calls the ``StepCall`` it got from ``attach``; while it is
    attached, ``CheckpointManager.after_step`` refuses)."""

    def retention_floor(self) -> int | None:
        """Retention keeps a verified checkpoint at or below this step and every one above
        it (spec/loss-guard.md §8); ``None``: nothing beyond the policy. Asked at every
        retention pass, on the save thread when saves are asynchronous."""
        ...

    def before_save(self, step: int) -> Mapping[str, Any]:
        """Entries to add to the ``meta`` of the checkpoint of ``step`` (the guard's: ``guard``,
        spec/loss-guard.md §5). Called on the loop's thread, before the save is handed on."""
        ...

    def on_restore(self, result: Any) -> None:
        """``resume()`` loaded ``result`` (a ``LoadResult``: its ``manifest.meta`` holds what
        ``before_save`` returned then)."""
        ...


class StepCall(Protocol):
    """``CheckpointManager.after_step`` without the refusal: the attached hook's way to end a
    step it accepted (ledger record, save if due)."""

    def __call__(self, step: int, *, batch: Any = None, loss: Any = None, metrics: Mapping[str, Any] | None = None,
                 extra: Any = None, values: Mapping[str, Any] | None = None) -> bool: ...
