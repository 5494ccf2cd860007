"""What every reference run's report shares: named checks, the tape's fault tally,
checkpoint verification, wording, and the progress bar a demo draws.

A demo ends with a list of named checks (``runs.DEMOS``); :class:`Checks` keeps them in
report order and leaves out a check that was not run (``None``), so a report never
claims something it did not test.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

__all__ = ["Checks", "FaultTally", "fault_tally", "verify_checkpoints", "yes", "gap_words", "ProgressBar"]


def yes(ok: bool | None) -> str:
    return "yes" if ok else "NO"


def gap_words(gap: float, *, subject: str = "chaos") -> str:
    """A one-sided relative gap in words: ``chaos worse by 3.1%`` / ``chaos better by 7.9%``."""
    return f"{subject} worse by {gap:.1%}" if gap > 0 else f"{subject} better by {-gap:.1%}"


class Checks:
    """A demo's verdict: ``(name, passed)`` in the order they were added."""

    def __init__(self) -> None:
        self._items: list[tuple[str, bool]] = []

    def add(self, name: str, ok: bool | None) -> "Checks":
        """Add a check; ``None`` (not run) adds nothing."""
        if ok is not None:
            self._items.append((name, bool(ok)))
        return self

    def items(self) -> list[tuple[str, bool]]:
        return list(self._items)

    def failed(self) -> list[str]:
        return [n for n, ok in self._items if not ok]

    def ok(self) -> bool:
        return not self.failed()


@dataclass
class FaultTally:
    """One fault class as the tape tells it."""

    kind: str
    injected: int = 0
    targets: list[str] = field(default_factory=list)  # one per injection event, in tape order
    detected: int = 0
    recovered: list[str] = field(default_factory=list)  # targets of fault_recovered events


def fault_tally(events: Iterable[Any], kinds: Sequence[str]) -> dict[str, FaultTally]:
    """Per fault kind: injections (and their targets), detections and recoveries on the tape."""
    out = {k: FaultTally(k) for k in kinds}
    for e in events:
        name = e.kind.name
        if name not in ("fault_injected", "fault_detected", "fault_recovered"):
            continue
        t = out.get(e.payload["fault"])
        if t is None:
            continue
        if name == "fault_injected":
            t.injected += 1
            t.targets.append(str(e.payload["target"]))
        elif name == "fault_detected":
            t.detected += 1
        else:
            t.recovered.append(str(e.payload["target"]))
    return out


def verify_checkpoints(paths: Iterable[str]) -> list[tuple[str, bool]]:
    """``ckpt.open(path).verify()`` for each: (path, passed); a failure is reported, never hidden."""
    import ckpt

    out = []
    for p in paths:
        try:
            ckpt.open(p).verify()
            out.append((p, True))
        except Exception:  # any refusal is a failed verification
            out.append((p, False))
    return out


class ProgressBar:
    """``bar(label, done, total)``: one redrawn line on a terminal, nothing otherwise."""

    def __init__(self, echo: Callable[[str], None], enabled: bool, *, width: int = 30) -> None:
        self.echo = echo
        self.enabled = enabled
        self.width = width

    def __call__(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        n = self.width * done // max(total, 1)
        # stderr, like every progress bar of the CLI (spec/cli.md §1): stdout carries the report only
        sys.stderr.write(f"\r  {label:<22} [{'#' * n}{'.' * (self.width - n)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
