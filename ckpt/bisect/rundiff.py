"""Two runs of one script, compared step by step from their ledgers (``ckpt ledger diff``).

Any two runs, not only a resume and the run it resumes: the first step whose recorded
batch, RNG streams, loss bits or parameter digest differ, what differed there, the
environment differences (torch, threads, flags, the commit), and whether the runs were
ever equal. Each run's history is the last record of every step across its tapes (a
resumed process's record of a step replaces the killed one's, as in ``check-resume``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointNotFoundError, NotACheckpointError
from ..ledger import LedgerStep, LedgerTape, read_ledger_dir
from ..ledger.compare import StepDiff, compare_step, used_streams

__all__ = ["RunDiff", "diff_runs", "ledger_dir_of"]


def ledger_dir_of(path: str) -> str:
    """A ledger directory: ``path`` itself (it holds ``NNNNN.tape`` files) or ``path/ledger``
    (a run directory of ``CheckpointManager``)."""
    p = os.path.abspath(path)
    if not os.path.exists(p):
        raise CheckpointNotFoundError("no such run or ledger directory", path=p)
    for d in (p, os.path.join(p, "ledger")):
        if os.path.isdir(d) and any(n.endswith(".tape") for n in os.listdir(d)):
            return d
    raise NotACheckpointError("no step ledger here (neither NNNNN.tape files nor a ledger/ folder of them)", path=p)


def _history(tapes: list[LedgerTape]) -> dict[int, LedgerStep]:
    steps: dict[int, LedgerStep] = {}
    for t in tapes:
        for s in t.steps:
            steps[s.step] = s
    return steps


@dataclass(frozen=True)
class RunDiff:
    a: str
    b: str
    first: StepDiff | None  # the first common step that differs
    common: int  # steps both runs recorded
    equal_through: int | None  # the last step of the equal prefix (None: differ from the first)
    first_step: int | None  # the first common step
    only_a: int = 0
    only_b: int = 0
    env_differences: tuple[str, ...] = ()
    not_compared: tuple[str, ...] = ()
    problems: tuple[str, ...] = field(default_factory=tuple)

    @property
    def identical(self) -> bool:
        return self.first is None and self.common > 0

    def summary(self) -> str:
        lines = []
        if self.common == 0:
            lines.append("NOTHING TO COMPARE: the two ledgers share no step")
        elif self.first is None:
            lines.append(f"IDENTICAL over {self.common} common steps ({self.first_step}..{self.first_step + self.common - 1 if self.first_step is not None else ''})")
        else:
            lines.append(f"DIFFERENT from step {self.first.step}: {self.first.what()}")
            if self.equal_through is None:
                lines.append("  the runs were never equal: the first common step already differs")
            else:
                lines.append(f"  equal through step {self.equal_through} ({self.first_step}..{self.equal_through})")
            if self.first.loss is None and not self.first.batch and not self.first.rng and self.first.params:
                lines.append("  (only the parameters differ: this step's update differs while its loss agreed to the bit)")
        if self.env_differences:
            lines.append("  environments differ: " + "; ".join(self.env_differences))
        else:
            lines.append("  environments: no recorded difference (torch, threads, flags, commit)")
        if self.only_a or self.only_b:
            lines.append(f"  steps in one run only: {self.only_a} in A, {self.only_b} in B")
        for p in self.problems:
            lines.append(f"  unreadable tape left out: {p}")
        if self.first is not None:
            lines.append(f"  next: ckpt bisect run {self.a} {self.b} --entry MODULE:FUNCTION  (names the operation)")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        f = self.first
        return {
            "identical": self.identical, "common_steps": self.common, "first_common_step": self.first_step,
            "equal_through": self.equal_through,
            "first_difference": None if f is None else {
                "step": f.step, "batch": f.batch, "rng": list(f.rng), "params": f.params,
                "loss": None if f.loss is None else list(f.loss), "what": f.what()},
            "only_a": self.only_a, "only_b": self.only_b, "env_differences": list(self.env_differences),
            "problems": list(self.problems),
        }


def diff_runs(a: str, b: str) -> RunDiff:
    """Compare the ledgers of runs ``a`` and ``b`` (run directories or ledger directories)."""
    from ..context.env import env_differences

    da, db = ledger_dir_of(a), ledger_dir_of(b)
    ta, pa = read_ledger_dir(da)
    tb, pb = read_ledger_dir(db)
    ha, hb = _history(ta), _history(tb)
    common = sorted(set(ha) & set(hb))
    # A stream neither run drew from (an unseeded Python or NumPy generator the script never
    # uses) differs between processes without meaning anything: compare only streams used.
    used = used_streams([o for t in ta for o in t.opens], ha.values()) | used_streams(
        [o for t in tb for o in t.opens], hb.values())
    first = None
    last_equal = None
    notes: set[str] = set()
    for s in common:
        d = compare_step(ha[s], hb[s], used)
        notes.update(d.not_compared)
        if d.differs:
            first = d
            break
        last_equal = s
    ea = ta[-1].meta.get("env") if ta else None
    eb = tb[-1].meta.get("env") if tb else None
    envd = tuple(env_differences(ea or {}, eb or {})) if ea and eb else ()
    return RunDiff(a, b, first, len(common), last_equal, common[0] if common else None,
                   len(set(ha) - set(hb)), len(set(hb) - set(ha)), envd, tuple(sorted(notes)), tuple(pa + pb))
