"""When a save is due: every N steps, every T seconds, and never twice for one state."""

from __future__ import annotations

from typing import Callable

__all__ = ["Cadence"]


class Cadence:
    """The manager's save cadence and the last state it saved (or resumed from)."""

    def __init__(self, every_steps: int | None, every_seconds: float | None, clock: Callable[[], float]) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._clock = clock
        #: the step of the state saved (or loaded) last: saving it again is never due
        self.last_step: int | None = None
        self._last_time = clock()

    def due(self, step: int) -> bool:
        """Due by step count or by time since the last save (this rank's view)."""
        due = bool(self.every_steps and step % self.every_steps == 0)
        if self.every_seconds is not None and self._clock() - self._last_time >= self.every_seconds:
            due = True
        return due

    def mark(self, step: int) -> None:
        """A save of ``step`` started, or ``step``'s checkpoint was loaded."""
        self.last_step = step
        self._last_time = self._clock()
