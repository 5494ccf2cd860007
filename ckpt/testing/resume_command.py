"""``check_command``: kill an unmodified training command, resume it, compare ledgers.

The command runs as is, in the caller's working directory (so it finds its config and
data files where it always does), twice: once straight through, and once as a chain of
attempts, the first SIGKILLed right after step ``kill_at[0]`` (by the kill switch this
harness installs in the script's ledger: ``ckpt.testing.kill_switch``), the next resumed
by the script itself and killed at ``kill_at[1]``, and so on, the last run to the end. Each of the two runs writes to a
place of its own under ``work``: ``{run}`` in the command becomes that directory
(``WORK/straight``, ``WORK/resumed``), and the environment says it too
(``CKPT_CHECK_RUN``). ``{resume}`` becomes ``scratch`` for a run's first attempt and
``resume`` for the attempts that follow a kill (``--init_from={resume}``; also
``CKPT_CHECK_RESUME=0/1``). A step ledger that would land outside its run's place is
refused by the script's own ledger (``ckpt.ledger.Ledger``), naming both directories:
two runs writing one place would compare a run with itself.

Then, bit for bit: every step of every ledger directory the command wrote (straight
run against the resumed chain's newest record of each step: batch digest, loss bits,
parameter digests, each used RNG stream, plain values), and every committed checkpoint
both runs left at the same relative path (``ckpt.diff``; streams unused in both runs not
compared). Verdicts (``ckpt.testing.verdict``): ``IDENTICAL``, ``DIFFERENT`` (with the
first divergence and its likely cause), or ``NO CLAIM`` when the command wrote no ledger,
never reached a checkpoint before a kill, or failed: such a check does not pass.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..ledger.compare import ResumeReport, compare_runs, used_streams
from ..ledger.record import LedgerStep
from ..ledger.tapefile import LedgerTape, read_ledger_dir
from .kill_switch import kill_env
from .verdict import Verdict

__all__ = ["CommandCheck", "check_command", "expand", "ENV_RUN", "ENV_RESUME"]


@dataclass(frozen=True, slots=True)
class CommandCheck:
    """The outcome of ``check_command``: the verdict, the report lines ``ckpt check-resume`` prints,
    the kill steps and the ledgers' resume reports."""

    verdict: Verdict  # IDENTICAL, DIFFERENT or NO_CLAIM
    lines: tuple[str, ...]
    kill_at: tuple[int, ...] = ()
    reports: tuple[ResumeReport, ...] = field(default=(), repr=False)
    work: str = ""
    resume_checks: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    @property
    def text(self) -> str:
        return "\n".join([*self.lines, self.verdict])


#: the environment a command's attempt gets: its run directory, and whether it follows a kill
ENV_RUN = "CKPT_CHECK_RUN"
ENV_RESUME = "CKPT_CHECK_RESUME"


def expand(argv: Sequence[str], run: str, resume: bool) -> list[str]:
    """``argv`` with ``{run}`` -> ``run`` and ``{resume}`` -> ``resume``/``scratch``."""
    return [a.replace("{run}", run).replace("{resume}", "resume" if resume else "scratch") for a in argv]


def _tail(log: str, n: int = 3) -> str:
    try:
        with open(log, errors="replace") as f:
            lines = [ln.rstrip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    return ("; its last lines: " + " | ".join(lines[-n:])) if lines else ""


def _run(argv: list[str], cwd: str, env: dict[str, str], log: str, timeout: float) -> int:
    with open(log, "ab") as f:
        p = subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    return p.returncode


def _ledgers(root: str) -> dict[str, list[LedgerTape]]:
    """Ledger directories under ``root`` (relative path -> readable tapes, oldest first)."""
    found: dict[str, list[LedgerTape]] = {}
    for d, _dirs, files in os.walk(root):
        if any(f.endswith(".tape") and f[:-5].isdigit() for f in files):
            tapes, _ = read_ledger_dir(d)
            tapes = [t for t in tapes if t.meta.get("ledger") == 1]
            if tapes:
                found[os.path.relpath(d, root)] = tapes
    return found


def _checkpoints(root: str) -> list[str]:
    out = []
    for d, _dirs, files in os.walk(root):
        if "MANIFEST" in files:
            out.append(os.path.relpath(d, root))
    return sorted(out)


def _history(tapes: list[LedgerTape]) -> dict[int, LedgerStep]:
    steps: dict[int, LedgerStep] = {}
    for t in tapes:  # a later process's record of a step is the resumed history
        for s in t.steps:
            steps[s.step] = s
    return steps


def _env_diffs(a: list[LedgerTape], b: list[LedgerTape]) -> list[str]:
    from ..context.env import env_differences

    ea, eb = a[-1].meta.get("env") or {}, b[-1].meta.get("env") or {}
    return env_differences(ea, eb)


def check_command(argv: Sequence[str], *, kill_at: Sequence[int] = (), kills: int = 1, seed: int = 0,
                  work: str | None = None, timeout: float = 600.0,
                  progress: Callable[[int, int], None] | None = None) -> CommandCheck:
    """Run ``argv`` straight and killed-and-resumed; compare (see module doc).

    ``progress(done, total)`` counts the runs of the command (straight, each kill, the last)."""
    tick = progress or (lambda done, total: None)
    if not argv:
        raise ValueError("no command to check")
    given = work or tempfile.mkdtemp(prefix="ckpt-check-resume-")
    work = os.path.abspath(given)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_LEDGER_", "CKPT_CHECK_"))}
    lines = [f"command: {shlex.join(argv)}", f"work dir: {work}"]
    if not any("{run}" in a for a in argv):
        lines.append("the command has no {run}: the script must put its output under $CKPT_CHECK_RUN itself")
    straight = os.path.join(work, "straight")
    resumed = os.path.join(work, "resumed")
    for d in (straight, resumed):
        if os.path.isdir(d) and os.listdir(d):
            return CommandCheck(Verdict.NO_CLAIM, (*lines, f"{d} is not empty: a check needs fresh run directories (give "
                                             "another --work-dir); nothing is claimed"), work=work)
        os.makedirs(d, exist_ok=True)

    def run(place: str, log: str, resume: bool, extra: dict[str, str] | None = None) -> int:
        rel = os.path.join(given, os.path.basename(place))  # as the caller wrote the work dir
        env = {**base, ENV_RUN: place, ENV_RESUME: "1" if resume else "0", **(extra or {})}
        return _run(expand(argv, rel, resume), os.getcwd(), env, log, timeout)

    tick(0, 2 + max(len(set(kill_at)), kills if not kill_at else 0))
    slog = os.path.join(work, "straight.log")
    rc = run(straight, slog, False)
    if rc != 0:
        return CommandCheck(Verdict.NO_CLAIM, (*lines, f"the straight run exited with status {rc} (log: {slog}{_tail(slog)}); "
                                         "nothing is claimed"), work=work)
    ref = _ledgers(straight)
    if not ref:
        return CommandCheck(Verdict.NO_CLAIM, (*lines, f"the command wrote no step ledger under {straight} (its output "
                                         "goes elsewhere? give it {run}; or no ckpt.save/ckpt.load, no "
                                         "CheckpointManager and no ckpt.ledger.Ledger): nothing to compare, nothing "
                                         "is claimed"), work=work)
    ref_ckpts = _checkpoints(straight)
    if not ref_ckpts:
        return CommandCheck(Verdict.NO_CLAIM, (*lines, "the command never reached a checkpoint: a resume cannot be "
                                         "checked, nothing is claimed"), work=work)
    last = max(max(_history(t)) for t in ref.values() if _history(t))
    if kill_at:
        kills_at = tuple(sorted(set(kill_at)))
    else:
        rnd = random.Random(seed)
        # From the second half: a kill before the first checkpoint checks nothing (NO CLAIM).
        pool = list(range(max(2, last // 2), last)) or [1]
        kills_at = tuple(sorted(rnd.sample(pool, min(kills, len(pool)))))
    lines.append(f"straight run: {last} steps; kills at step {', '.join(map(str, kills_at))}")
    log = os.path.join(work, "resumed.log")
    runs = 2 + len(kills_at)
    tick(1, runs)
    for i, k in enumerate(kills_at):
        rc = run(resumed, log, i > 0, kill_env(k, base))
        tick(2 + i, runs)
        if rc != -signal.SIGKILL:
            # the switch rides on PYTHONPATH and sitecustomize: python -E, -I or -S skips it
            hint = (" (the kill switch was not installed, or the run ended before that step: does it run Python with "
                    "-E, -I or -S, which skip PYTHONPATH or sitecustomize?)") if rc == 0 else ""
            return CommandCheck(Verdict.NO_CLAIM, (*lines, f"the attempt told to die at step {k} exited with status {rc} "
                                             f"instead{hint} (log: {log}{_tail(log)}); nothing is claimed"), kills_at,
                                work=work)
    rc = run(resumed, log, True)
    tick(runs, runs)
    if rc != 0:
        return CommandCheck(Verdict.NO_CLAIM, (*lines, f"the last resumed attempt exited with status {rc} (log: {log}"
                                         f"{_tail(log)}); nothing is claimed"), kills_at, work=work)
    got = _ledgers(resumed)
    opens = [o for tapes in got.values() for t in tapes for o in t.opens]
    if not any(o.start_step > 0 for o in opens):
        return CommandCheck(Verdict.NO_CLAIM, (*lines, f"no attempt resumed from a checkpoint: the command never reached "
                                         f"a checkpoint before step {kills_at[0]}; nothing is claimed"), kills_at, work=work)
    different = False
    reports = []
    checks = tuple(c.report for tapes in got.values() for t in tapes for c in t.checks)
    for rel, tapes in sorted(ref.items()):
        if rel not in got:
            lines.append(f"ledger {rel}: missing in the resumed run")
            different = True
            continue
        rep = compare_runs(_history(tapes), _history(got[rel]),
                           expected_used=set().union(*(used_streams(t.opens, t.steps) for t in tapes)),
                           actual_used=set().union(*(used_streams(t.opens, t.steps) for t in got[rel])),
                           env_diffs=_env_diffs(tapes, got[rel]), label=f"ledger {rel}: resumed run")
        reports.append(rep)
        lines.append(rep.text)
        different |= rep.verdict != "exact"
    for c in checks:
        lines.append("resumed process said: " + c.splitlines()[0])
    from ..diff import diff_checkpoints, ledger_unused_streams

    for rel in ref_ckpts:
        a, b = os.path.join(straight, rel), os.path.join(resumed, rel)
        if not os.path.isdir(b):
            lines.append(f"checkpoint {rel}: missing in the resumed run")
            different = True
            continue
        d = diff_checkpoints(a, b, ignore=("env", "commit"), unused=ledger_unused_streams(a, b))
        config = sorted({k for p in d["parts"].values() if p["config"] for k in p["config"]["keys"]})
        if d["identical"] or d["state_identical"]:
            lines.append(f"checkpoint {rel}: identical (tensors and used RNG streams, bit for bit)")
        else:
            bad = [t["name"] for p in d["parts"].values() for t in p["tensors"] if t["status"] != "equal"]
            rng = sorted({s for p in d["parts"].values() for s in p["rng"]})
            lines.append(f"checkpoint {rel}: differs in {', '.join(c for c in d['differs'] if c != 'config')}"
                         + (f" ({len(bad)} tensors, first {bad[0]})" if bad else "")
                         + (f" (RNG streams {', '.join(rng)})" if rng else ""))
            different = True
        if "config" in d["differs"]:
            # the runs' own places (out_dir={run}) or init_from={resume} differ by design: not state
            lines.append(f"checkpoint {rel}: config differs in {', '.join(config) or 'its hash'} (not state; not "
                         "a difference of the resume)")
    return CommandCheck(Verdict.DIFFERENT if different else Verdict.IDENTICAL, tuple(lines), kills_at, tuple(reports), work,
                        checks)


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - `python -m ckpt.testing.resume_command -- CMD`
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    res = check_command(args)
    print(res.text)
    return res.exit_code
