"""Edits of an epoch's batch order: skip some global steps, or serve them later.

The loss-spike guard (``ckpt.guard``) applies its data policy through these: after a
rollback, the batches of the offending window are either **skipped** (never served in
that epoch) or **deferred** (served ``delay`` batches later than they would have been).
An edit names global-order steps (``BatchInfo.step``: step ``s`` of epoch ``e`` is the
positions ``[s*B, (s+1)*B)`` of ``EpochOrder(n, seed, e)``), never slots, so it means the
same whatever edits came before it.

**The schedule** of epoch ``e`` is the sequence of steps it serves, a pure function of
the unedited step count ``n`` and the edits of ``e`` in the order they were made:
start from ``[0, 1, ..., n-1]``; for each edit, remove its steps (they keep their
relative order); a skip stops there; a defer reinserts them as one block at index
``min(first + delay, len(rest))`` of what remains, where ``first`` is the index the
first of them had before the removal. So ``delay`` other batches are served between
where the block was and where it is now (fewer if the epoch ends first).

The loader's cursor counts **slots** of the schedule: ``position == slot * B``. An edit
may only move steps the cursor has not reached (the consumed prefix of the schedule
never changes), which is what makes an edit safe to apply mid-epoch and a resumed run
serve exactly what the uninterrupted one did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

__all__ = ["DataEdit", "ACTIONS", "MAX_EDITS", "apply_edit", "epoch_schedule"]

ACTIONS = ("skip", "defer")
#: edits a state may hold (the guard bounds its episodes far below this)
MAX_EDITS = 4096

Action = Literal["skip", "defer"]


@dataclass(frozen=True, slots=True)
class DataEdit:
    """Skip (``action="skip"``) or defer by ``delay`` batches (``action="defer"``) the
    global-order ``steps`` of ``epoch``, in the order they are listed."""

    epoch: int
    steps: tuple[int, ...]
    action: Action = "skip"
    delay: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.epoch, int) or isinstance(self.epoch, bool) or self.epoch < 0:
            raise ValueError(f"DataEdit.epoch must be an int >= 0, got {self.epoch!r}")
        if not isinstance(self.steps, tuple) or not self.steps:
            raise ValueError(f"DataEdit.steps must be a non-empty tuple of steps, got {self.steps!r}")
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.steps):
            raise ValueError(f"DataEdit.steps must hold ints >= 0, got {self.steps!r}")
        if len(set(self.steps)) != len(self.steps):
            raise ValueError(f"DataEdit.steps lists a step twice: {self.steps!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"DataEdit.action must be 'skip' or 'defer', got {self.action!r}")
        if not isinstance(self.delay, int) or isinstance(self.delay, bool):
            raise ValueError(f"DataEdit.delay must be an int, got {self.delay!r}")
        if self.action == "skip" and self.delay != 0:
            raise ValueError(f"a skip has no delay (DataEdit.delay must be 0, got {self.delay})")
        if self.action == "defer" and self.delay < 1:
            raise ValueError(f"a defer needs DataEdit.delay >= 1, got {self.delay}")

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "steps": list(self.steps), "action": self.action, "delay": self.delay}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataEdit:
        return cls(d["epoch"], tuple(d["steps"]), d["action"], d["delay"])


def apply_edit(order: Sequence[int], edit: DataEdit, *, consumed: int = 0) -> list[int]:
    """``order`` (a schedule) with ``edit`` applied. ``consumed``: slots already served,
    which the edit must not touch. ``ValueError`` names a step that is not there (or is
    already served)."""
    where = {s: i for i, s in enumerate(order)}
    for s in edit.steps:
        i = where.get(s)
        if i is None:
            raise ValueError(f"step {s} of epoch {edit.epoch} is not in its schedule of {len(order)} steps "
                             f"(skipped before, or not a step of the epoch)")
        if i < consumed:
            raise ValueError(f"step {s} of epoch {edit.epoch} was already served (slot {i}, the cursor is at "
                             f"slot {consumed})")
    removed = set(edit.steps)
    first = min(where[s] for s in edit.steps)
    rest = [s for s in order if s not in removed]
    if edit.action == "skip":
        return rest
    block = [s for s in order if s in removed]
    at = min(first + edit.delay, len(rest))
    return rest[:at] + block + rest[at:]


def epoch_schedule(num_steps: int, edits: Sequence[DataEdit], epoch: int) -> list[int] | None:
    """The steps epoch ``epoch`` serves, in order; ``None`` when no edit applies to it
    (the identity ``range(num_steps)``, kept implicit so an unedited epoch costs nothing)."""
    mine = [e for e in edits if e.epoch == epoch]
    if not mine:
        return None
    order: list[int] = list(range(num_steps))
    for e in mine:
        order = apply_edit(order, e)
    return order
