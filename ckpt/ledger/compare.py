"""Compare ledger steps and name what diverged and its likely cause. Pure.

What is compared (issue "compare what matters"): the batch digest when both sides
recorded one, the loss bits when both recorded a loss, the parameter digest when both
recorded one, and each RNG stream that was drawn from in at least one of the two runs.
A stream whose digest never moved from its value at ledger start in either run
(CPython seeds ``random`` differently in every process; a script may never touch
numpy) is "unused, not compared": it cannot have influenced the run.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from .record import LedgerOpen, LedgerStep

__all__ = ["StepDiff", "ResumeReport", "CAUSES", "used_streams", "compare_step", "likely_cause", "compare_runs",
           "find_batch"]

#: The documented cause table (README "Porting a training script"): what diverged -> likely cause.
CAUSES: dict[str, str] = {
    "batch-shift": "the batch is the one the first run consumed at step {other}: the data position is "
                   "{ahead} at the resume (a batch prefetched before the step boundary and not saved? an "
                   "iterator restarted?); put in-flight state into the checkpoint",
    "batch": "the batch differs: the data position was not captured at the checkpoint (a batch prefetched "
             "before the step boundary and not saved? an iterator recreated on resume?); put in-flight state "
             "into the checkpoint",
    "rng-batch": "the batch and RNG stream(s) {streams} differ, and the batch is none the first run consumed: "
                 "a draw outside the checkpointed state moved the stream the batch is drawn from (an evaluation "
                 "or sampling run again on resume? an augmentation? run it inside ckpt.rng.isolated()), and/or "
                 "the data position was not captured (a batch prefetched before the step boundary and not saved? "
                 "put in-flight state into the checkpoint)",
    "rng": "RNG stream(s) {streams} differ while the batch is equal: something drew from them outside the "
           "checkpointed state between the checkpoint and this step (an evaluation or sampling run again on "
           "resume? an augmentation?); run it inside ckpt.rng.isolated()",
    "loss": "batch and RNG streams are equal but the loss differs: a nondeterministic kernel or a different "
            "environment{env}",
    "params": "the parameter digest differs while everything recorded before it was equal: state that the "
              "checkpoint does not hold (pass batch= to after_step to find the first step)",
}


@dataclass(frozen=True, slots=True)
class StepDiff:
    """What differs at one step (empty fields: equal or not compared)."""

    step: int
    batch: bool = False
    rng: tuple[str, ...] = ()
    loss: tuple[float, float] | None = None
    params: bool = False
    not_compared: tuple[str, ...] = ()

    @property
    def differs(self) -> bool:
        return self.batch or bool(self.rng) or self.loss is not None or self.params

    def what(self) -> str:
        parts = []
        if self.batch:
            parts.append("batch differs")
        if self.rng:
            parts.append("RNG stream " + ", ".join(self.rng) + " differs")
        if self.loss is not None:
            parts.append(f"loss differs ({self.loss[0]!r} vs {self.loss[1]!r})")
        if self.params:
            parts.append("parameter digest differs")
        return "; ".join(parts) or "equal"


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def used_streams(opens: Sequence[LedgerOpen], steps: Iterable[LedgerStep]) -> set[str]:
    """Streams whose digest changed at some point after the ledger started."""
    last: dict[str, bytes] = {}
    for o in opens:
        last.update(dict(o.rng))
    used: set[str] = set()
    for s in steps:
        for name, d in s.rng:
            if name in last and last[name] != d:
                used.add(name)
            last[name] = d
    return used


def compare_step(expected: LedgerStep, actual: LedgerStep, compared: set[str] | None) -> StepDiff:
    """``compared``: the RNG streams to compare (None: every stream both recorded)."""
    nc: list[str] = []
    batch = False
    if expected.batch is not None and actual.batch is not None:
        batch = expected.batch != actual.batch
    elif expected.batch is not None or actual.batch is not None:
        nc.append("batch (recorded on one side only)")
    exp, act = dict(expected.rng), dict(actual.rng)
    rng = []
    for name in sorted(set(exp) | set(act)):
        if name not in exp or name not in act:
            nc.append(f"rng {name} (recorded on one side only)")
        elif compared is not None and name not in compared:
            nc.append(f"rng {name} (unused)")
        elif exp[name] != act[name]:
            rng.append(name)
    loss = None
    if expected.loss is not None and actual.loss is not None and _bits(expected.loss) != _bits(actual.loss):
        loss = (expected.loss, actual.loss)
    params = expected.params is not None and actual.params is not None and expected.params != actual.params
    return StepDiff(expected.step, batch, tuple(rng), loss, params, tuple(nc))


def find_batch(expected: Mapping[int, LedgerStep], batch: bytes | None, step: int) -> int | None:
    """The step nearest to ``step`` whose recorded batch equals ``batch`` (None if none)."""
    if batch is None:
        return None
    hits = [k for k, v in expected.items() if v.batch == batch and k != step]
    return min(hits, key=lambda k: (abs(k - step), k)) if hits else None


def likely_cause(d: StepDiff, env_diffs: Sequence[str] = (), *, batch_seen_at: int | None = None) -> str:
    """The row of ``CAUSES`` for a divergence. ``batch_seen_at``: the step whose batch in
    the expected run equals this step's batch, if any (a shifted data position)."""
    if d.batch and batch_seen_at is not None:
        k = batch_seen_at - d.step
        ahead = f"{k} batch{'es' if abs(k) != 1 else ''} ahead" if k > 0 else f"{-k} batch{'es' if k != -1 else ''} behind"
        return CAUSES["batch-shift"].format(other=batch_seen_at, ahead=ahead)
    if d.batch and d.rng:
        return CAUSES["rng-batch"].format(streams=", ".join(d.rng))
    if d.batch:
        return CAUSES["batch"]
    if d.rng:
        return CAUSES["rng"].format(streams=", ".join(d.rng))
    if d.loss is not None:
        env = ("; environment differences: " + ", ".join(env_diffs)) if env_diffs else " (no environment difference recorded)"
        return CAUSES["loss"].format(env=env)
    if d.params:
        return CAUSES["params"]
    return ""


@dataclass(frozen=True, slots=True)
class ResumeReport:
    """Outcome of verifying resumed steps against a ledger.

    ``verdict``: ``exact`` (every compared step equal), ``diverged`` (``divergence`` is
    the first differing step) or ``skipped`` (``reason`` says why nothing was compared).
    """

    verdict: str
    first: int = 0
    last: int = 0
    divergence: StepDiff | None = None
    cause: str = ""
    reason: str = ""
    unused: tuple[str, ...] = ()
    planned_last: int = 0
    label: str = "resume"

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"

    @property
    def text(self) -> str:
        if self.verdict == "skipped":
            return f"{self.label} not verified: {self.reason}"
        if self.verdict == "exact":
            s = f"{self.label} verified exact over steps {self.first}..{self.last}"
            if self.planned_last > self.last:
                s += f" (the ledger went on to step {self.planned_last}; the run stopped before)"
            if self.unused:
                s += f"; unused, not compared: rng {', '.join(self.unused)}"
            return s
        d = self.divergence
        assert d is not None
        lines = [f"{self.label} diverged at step {d.step} (first compared step {self.first}): {d.what()}",
                 f"  likely cause: {self.cause}"]
        if d.not_compared:
            lines.append("  not compared: " + ", ".join(d.not_compared))
        return "\n".join(lines)


def compare_runs(expected: Mapping[int, LedgerStep], actual: Mapping[int, LedgerStep], *,
                 expected_used: set[str], actual_used: set[str], env_diffs: Sequence[str] = (),
                 label: str = "resume") -> ResumeReport:
    """Compare the steps both runs recorded, in order; the first divergence ends it."""
    steps = sorted(set(expected) & set(actual))
    if not steps:
        return ResumeReport("skipped", reason="the two ledgers have no step in common", label=label)
    compared = expected_used | actual_used
    all_streams = {n for s in steps for n, _ in expected[s].rng} | {n for s in steps for n, _ in actual[s].rng}
    unused = tuple(sorted(all_streams - compared))
    for s in steps:
        d = compare_step(expected[s], actual[s], compared)
        if d.differs:
            cause = likely_cause(d, env_diffs, batch_seen_at=find_batch(expected, actual[s].batch, s))
            return ResumeReport("diverged", steps[0], s, d, cause, unused=unused, label=label)
    return ResumeReport("exact", steps[0], steps[-1], unused=unused, label=label)
