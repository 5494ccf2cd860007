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
from typing import Any, Iterable, Mapping, Sequence

from .record import LedgerOpen, LedgerStep

__all__ = ["StepDiff", "ResumeReport", "CAUSES", "used_streams", "compare_step", "likely_cause", "compare_runs",
           "find_batch", "find_hint", "SAMPLE", "RNG_BEFORE"]

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
    "rng": "RNG stream(s) {streams} differ{while_batch}: something drew from them outside the "
           "checkpointed state between the checkpoint and this step (an evaluation or sampling run again on "
           "resume? an augmentation?); run it inside ckpt.rng.isolated()",
    "rng-moved": "RNG stream(s) {streams} moved between the resume (the load restored {them} at step {start}) and "
                 "step {step}, and not as the first run's moved between its save and step {step}: something drew "
                 "from {them} after the load and before the step (a batch drawn after ckpt.load, e.g. the first "
                 "batch fetched after it? an evaluation run again on resume? a model built after the load?); "
                 "load where the first run saved (after those draws), or load with restore_rng=False and restore "
                 "the streams right before the loop (ckpt.rng.restore_rng(result.context['rng']))",
    "rng-held": "the RNG streams were held back at the resume ({how}) and never restored before step {step}: "
                "restore them before the first step ({fix})",
    "value": "{names} differ{while_equal}: a value carried across steps that the checkpoint does not hold "
             "(a learning rate set outside the optimizer and scheduler? a best-so-far metric?); save it with the "
             "checkpoint (extra= or the state) and restore it on resume",
    "env": "{what}{while_equal}, in a different environment: a nondeterministic kernel or the environment "
           "difference ({env})",
    "state": "{what}{while_equal}, in the same environment: state that the checkpoint does not hold (a "
             "variable carried across steps: a recurrent hidden state, a learning rate outside the optimizer and "
             "scheduler, a best-so-far metric); {hint}",
    "params": "the parameter digest differs while everything recorded before it was equal: state that the "
              "checkpoint does not hold (pass batch= to after_step to find the first step)",
}
"""The documented cause table (docs/porting.md): what diverged -> the likely cause named."""
#: the old name of "state" when only the loss differs (kept: tools match on it)
CAUSES["loss"] = CAUSES["state"]

#: values the ledger records itself (spec/tape-format.md §6.3): digests, not shown as values
SAMPLE = "ckpt.params_sample"
RNG_BEFORE = "ckpt.rng_before."


@dataclass(frozen=True, slots=True)
class StepDiff:
    """What differs at one step (empty fields: equal or not compared). ``values``:
    (name, expected, actual) of each plain value that differs; ``sample``: the ledger's
    per-step parameter sample differs; ``rng_before``: streams that differ just before
    the optimizer step (recorded at the first step after a save or resume)."""

    step: int
    batch: bool = False
    rng: tuple[str, ...] = ()
    loss: tuple[float, float] | None = None
    params: bool = False
    not_compared: tuple[str, ...] = ()
    values: tuple[tuple[str, Any, Any], ...] = ()
    sample: bool = False
    rng_before: tuple[str, ...] = ()
    batch_compared: bool = True

    @property
    def differs(self) -> bool:
        return (self.batch or bool(self.rng) or self.loss is not None or self.params or bool(self.values)
                or self.sample or bool(self.rng_before))

    def what(self) -> str:
        parts = []
        if self.batch:
            parts.append("batch differs")
        if self.rng_before:
            parts.append("RNG stream " + ", ".join(self.rng_before) + " differs before the optimizer step")
        if self.rng:
            parts.append("RNG stream " + ", ".join(self.rng) + " differs")
        if self.loss is not None:
            parts.append(f"loss differs ({self.loss[0]!r} vs {self.loss[1]!r})")
        for name, a, b in self.values:
            parts.append(f"{name} differs ({a!r} vs {b!r})")
        if self.sample:
            parts.append("parameters differ after the step (sampled)")
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


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return _bits(a) == _bits(b)
    return type(a) is type(b) and a == b


def compare_step(expected: LedgerStep, actual: LedgerStep, compared: set[str] | None) -> StepDiff:
    """``compared``: the RNG streams to compare (None: every stream both recorded)."""
    nc: list[str] = []
    batch = False
    batch_compared = expected.batch is not None and actual.batch is not None
    if batch_compared:
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
    ev, av = dict(expected.values), dict(actual.values)
    values, before, sample = [], [], False
    for name in sorted(set(ev) & set(av)):
        if _same(ev[name], av[name]):
            continue
        if name == SAMPLE:
            sample = True
        elif name.startswith(RNG_BEFORE):
            stream = name[len(RNG_BEFORE):]
            if compared is None or stream in compared:
                before.append(stream)
        else:
            values.append((name, ev[name], av[name]))
    nc += [f"value {n} (recorded on one side only)" for n in sorted(set(ev) ^ set(av))
           if not n.startswith(RNG_BEFORE)]
    return StepDiff(expected.step, batch, tuple(rng), loss, params, tuple(nc), tuple(values), sample, tuple(before),
                    batch_compared)


def find_batch(expected: Mapping[int, LedgerStep], batch: bytes | None, step: int) -> int | None:
    """The step nearest to ``step`` whose recorded batch equals ``batch`` (None if none)."""
    if batch is None:
        return None
    hits = [k for k, v in expected.items() if v.batch == batch and k != step]
    return min(hits, key=lambda k: (abs(k - step), k)) if hits else None


def _them(streams: Sequence[str]) -> str:
    return "it" if len(streams) == 1 else "them"


def likely_cause(d: StepDiff, env_diffs: Sequence[str] = (), *, batch_seen_at: int | None = None,
                 held: str = "", moved: Sequence[str] = (), start: int | None = None, hint: str = "") -> str:
    """The row of ``CAUSES`` for a divergence. ``batch_seen_at``: the step whose batch in
    the expected run equals this step's batch, if any (a shifted data position).
    ``held``: how the RNG streams were held back at the resume and never restored (empty:
    they were restored). ``moved``: streams that moved between the resume (at ``start``)
    and this step in this process. ``hint``: how to find state the checkpoint does not
    hold (which logged values or parameter digests first differ)."""
    if d.batch and batch_seen_at is not None:
        k = batch_seen_at - d.step
        ahead = f"{k} batch{'es' if abs(k) != 1 else ''} ahead" if k > 0 else f"{-k} batch{'es' if k != -1 else ''} behind"
        return CAUSES["batch-shift"].format(other=batch_seen_at, ahead=ahead)
    if d.batch and d.rng:
        return CAUSES["rng-batch"].format(streams=", ".join(d.rng))
    if d.batch:
        return CAUSES["batch"]
    if held and (d.rng or d.rng_before or d.sample or d.loss is not None or d.params):
        how, fix = held.split("|", 1) if "|" in held else (held, "")
        return CAUSES["rng-held"].format(how=how, step=d.step, fix=fix or "restore the saved streams")
    rng = d.rng_before or d.rng
    if rng and start is not None and (d.rng_before or set(moved) & set(rng)):
        streams = d.rng_before or tuple(s for s in d.rng if s in moved)
        return CAUSES["rng-moved"].format(streams=", ".join(streams), them=_them(streams), start=start, step=d.step)
    while_batch = " while the batch is equal" if d.batch_compared else ""
    if rng:
        return CAUSES["rng"].format(streams=", ".join(rng), while_batch=while_batch)
    equal = "batch and RNG streams are equal" if d.batch_compared else "the RNG streams are equal (the batch is not recorded)"
    while_equal = f" while {equal}"
    if d.values:
        names = ", ".join(n for n, _, _ in d.values)
        return CAUSES["value"].format(names=f"the logged value{'s' if len(d.values) > 1 else ''} {names}",
                                      while_equal=while_equal)
    if d.loss is not None or d.sample or d.params:
        what = "the loss and the parameters differ" if d.loss is not None and (d.sample or d.params) else (
            "the loss differs" if d.loss is not None else "the parameters after the step differ")
        if env_diffs:
            return CAUSES["env"].format(what=what, while_equal=while_equal, env=", ".join(env_diffs))
        find = hint or ("to find it, log the variables carried across steps with values= (after_step(step, "
                        "values={'lr': lr}) or Ledger.step): the ledger names the first that differs")
        if not d.batch_compared:
            find = ("or the batch (pass batch= to compare it); " + find)
        return CAUSES["state"].format(what=what, while_equal=while_equal, hint=find)
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
    matched: int = 0  # steps compared equal (exact: all of them)

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"

    @property
    def text(self) -> str:
        if self.verdict == "skipped":
            return f"{self.label} not verified: {self.reason}"
        if self.verdict == "exact":
            n = self.matched or self.last - self.first + 1
            s = (f"{self.label} verified exact over steps {self.first}..{self.last}: {n} re-run step"
                 f"{'s' if n != 1 else ''} matched; state used only later, such as a best-so-far metric, is not "
                 "covered")
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
    for i, s in enumerate(steps):
        d = compare_step(expected[s], actual[s], compared)
        if d.differs:
            cause = likely_cause(d, env_diffs, batch_seen_at=find_batch(expected, actual[s].batch, s),
                                 hint=find_hint(expected, actual, s))
            return ResumeReport("diverged", steps[0], s, d, cause, unused=unused, label=label, matched=i)
    return ResumeReport("exact", steps[0], steps[-1], unused=unused, label=label, matched=len(steps))


def find_hint(expected: Mapping[int, LedgerStep], actual: Mapping[int, LedgerStep], step: int) -> str:
    """How to find state the checkpoint does not hold, from what the two ledgers hold:
    the logged values, and the last parameter digest that agreed before ``step``."""
    names = sorted({n for s in (expected.get(step), actual.get(step)) if s is not None for n, _ in s.values
                    if not n.startswith("ckpt.")})
    agreed = [k for k in sorted(set(expected) & set(actual)) if k <= step and expected[k].params is not None
              and actual[k].params is not None and expected[k].params == actual[k].params]
    parts = []
    if names:
        parts.append(f"the logged values ({', '.join(names)}) are equal at this step, so the state is none of them")
    if agreed:
        parts.append(f"the parameter digests last agreed at step {agreed[-1]}")
    parts.append("log each variable carried across steps with values= (after_step(step, values={'lr': lr}) or "
                 "Ledger.step): the ledger names the first that differs")
    return "; ".join(parts)
