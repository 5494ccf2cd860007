"""``Ledger``: one process's step ledger, and the verification of a resume against it.

Usage without a manager (``CheckpointManager`` does all of this itself)::

    led = ckpt.ledger.Ledger("out/ledger", params=model)   # after seeding
    if os.path.exists("out/ckpt"):
        r = ckpt.load("out/ckpt", state)
        led.resumed(r.step, source="out/ckpt")              # after the RNG restore
    for step in range(start + 1, total + 1):
        ...
        led.step(step, batch=(x, y), loss=loss)
    led.close()

Environment instructions (how ``ckpt check-resume -- COMMAND`` drives an unmodified
script): ``CKPT_LEDGER_DIR`` replaces the ledger directory (a manager's ledger then
lives in ``$CKPT_LEDGER_DIR/<basename of its run_dir>``), ``CKPT_LEDGER_VERIFY`` overrides
the verification policy. Once a step is done (recorded, and a manager's save of it
started) the ledger calls the hooks in ``STEP_HOOKS``: the seam where the check's kill
switch (``ckpt.testing.kill_switch``) is installed.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Iterable, Literal, Mapping, Protocol

from ..errors import ResumeDivergedError
from ..knobs import ledger_verify
from .compare import RNG_BEFORE, ResumeReport, compare_step, find_batch, find_hint, likely_cause, used_streams
from .digest import batch_digest, params_digest, rng_digests
from .record import GuardEntry, LedgerOpen, LedgerStep, ResumeCheck, Value
from .tapefile import LedgerTapeWriter, read_ledger_dir

__all__ = ["Ledger", "ResumeVerificationWarning", "ResumeVerified", "ResumeNotice", "announce", "plain_values",
           "ENV_DIR", "ENV_VERIFY", "StepHook", "STEP_HOOKS"]

ENV_DIR = "CKPT_LEDGER_DIR"
"""The variable that puts step ledgers in another directory than next to the checkpoints."""
ENV_VERIFY = "CKPT_LEDGER_VERIFY"
"""The variable that overrides the resume verification policy: ``strict``, ``warn`` or ``off``."""
_MISSING: Any = object()
Policy = Literal["strict", "warn", "off"]


class StepHook(Protocol):
    """Called with the ledger and the step once that step is done."""

    def __call__(self, ledger: Ledger, step: int) -> None: ...


#: the hooks every ledger of this process calls after each done step (ckpt.testing
#: installs its kill switch here; production code registers none)
STEP_HOOKS: list[StepHook] = []


class ResumeVerificationWarning(RuntimeWarning):
    """A resume was not exact, or could not be verified (the message is the whole report)."""


#: OWN_LEDGER[0]: a Ledger of the script's own (or a manager's) exists in this process;
#: ON_OWN_LEDGER: called when one is created (ckpt.ledger.auto stands down then)
OWN_LEDGER: list[bool] = [False]
ON_OWN_LEDGER: list[Callable[[], None]] = []


class ResumeNotice(UserWarning):
    """The verdict line of a resume that needs no action; filter it with
    ``warnings.filterwarnings("ignore", category=ckpt.ledger.ResumeNotice)``."""


class ResumeVerified(ResumeNotice):
    """A resume was verified exact over the re-run steps it names."""


log = logging.getLogger("ckpt.ledger")


def announce(report: ResumeReport, *, ok: bool) -> None:
    """One line on stderr for a verdict, filterable by its warning category
    (``ResumeVerified`` for exact, ``ResumeVerificationWarning`` otherwise), and the same
    text to the ``ckpt.ledger`` logger at INFO (for a configured log; INFO is not
    printed by default, so the console shows the line once). The warning carries no
    source line: the verdict is about the run, not about a line of ckpt."""
    text = report.text
    log.info("%s", text)
    category: type[Warning] = ResumeVerified if ok else ResumeVerificationWarning
    warnings.warn_explicit(text, category, filename="ckpt.ledger", lineno=0, module="ckpt.ledger")


def _refuse_outside_check_run(directory: str) -> None:
    """Under ``ckpt check-resume -- COMMAND``, a ledger outside the attempt's run directory
    is refused: every attempt would write (and later compare) one shared place."""
    from ..errors import CkptError
    from ..knobs import knobs

    run = knobs().check_run_dir
    if not run:
        return
    a, b = os.path.realpath(directory), os.path.realpath(run)
    if os.path.commonpath([a, b]) != b:
        raise CkptError(f"ckpt check-resume: this run's step ledger {directory} (and so its checkpoints) is outside "
                        f"the attempt's run directory {run}: give the command its output directory as {{run}} "
                        f"(--out {{run}}) or write under $CKPT_CHECK_RUN", path=directory)


def plain_values(values: Mapping[str, Any] | None) -> tuple[tuple[str, Value], ...]:
    """``values`` as the ledger tapes them: sorted (name, value); a tensor of one element
    becomes its number; anything else that is not nil/bool/int/float/str/bytes is refused."""
    if not values:
        return ()
    out = []
    for k, v in values.items():
        if not isinstance(k, str):
            raise TypeError(f"ledger value names must be str, got {k!r}")
        if hasattr(v, "numel") and hasattr(v, "item") and v.numel() == 1:
            v = v.detach().item() if hasattr(v, "detach") else v.item()
        elif hasattr(v, "item") and hasattr(v, "dtype") and getattr(v, "shape", None) == ():
            v = v.item()  # a numpy scalar
        if not isinstance(v, (bool, int, float, str, bytes, type(None))):
            raise TypeError(f"ledger value {k!r} must be a plain number, string or bytes, got {type(v).__name__}")
        out.append((k, v))
    return tuple(sorted(out))


def _named_tensors(params: Any) -> Callable[[], Iterable[tuple[str, Any]]]:
    """``params``: a module, a mapping name -> module/tensor, or a callable giving (name, tensor) pairs."""
    if callable(params) and not hasattr(params, "state_dict"):
        return params

    def items() -> Iterable[tuple[str, Any]]:
        entries = params.items() if isinstance(params, Mapping) else [("", params)]
        for name, v in entries:
            if hasattr(v, "state_dict") and hasattr(v, "named_parameters"):
                pre = f"{name}/" if name else ""
                for k, t in v.state_dict(keep_vars=True).items():
                    if hasattr(t, "dtype"):
                        yield pre + k, t
            elif hasattr(v, "dtype"):
                yield name, v

    return items


class Ledger:
    """Records every step of this process on a tape of its own in ``directory``.

    ``params``: what the periodic parameter digest covers (every ``params_every``
    steps; 0 turns it off). ``generators``: registered ``torch.Generator`` streams.
    ``verify``: what a divergent resume does: ``strict`` raises ``ResumeDivergedError``,
    ``warn`` warns once with the whole report, ``off`` skips the comparison.
    """

    def __init__(self, directory: str | os.PathLike[str], *, params: Any = None, params_every: int = 10,
                 generators: Mapping[str, Any] | None = None, verify: Policy = "warn",
                 run_id: str | None = None, meta: Mapping[str, Any] | None = None, _auto: bool = False) -> None:
        if not _auto:  # the script keeps its own ledger (or a manager does): the default one stands down
            OWN_LEDGER[0] = True
            for f in list(ON_OWN_LEDGER):
                f()
        verify = ledger_verify() or verify  # type: ignore[assignment]
        if verify not in ("strict", "warn", "off"):
            raise ValueError(f"verify must be 'strict', 'warn' or 'off', not {verify!r}")
        if params_every < 0:
            raise ValueError(f"params_every must be >= 0, got {params_every}")
        self.directory = os.path.abspath(os.fspath(directory))
        _refuse_outside_check_run(self.directory)
        self.params_every = params_every if params is not None else 0
        self._params = _named_tensors(params) if params is not None else None
        self.generators = dict(generators or {})
        self.verify = verify
        self.run_id = run_id
        self._meta = dict(meta or {})
        self._writer: LedgerTapeWriter | None = None
        self._baseline = tuple(rng_digests(self.generators))  # after seeding: the streams' start values
        self._last_rng = dict(self._baseline)
        self._used: set[str] = set()
        # resume verification state
        self._expected: dict[int, LedgerStep] = {}
        self._expected_all: dict[int, LedgerStep] = {}  # every step the earlier tapes hold
        self._expected_used: set[str] = set()
        self._env_diffs: list[str] = []
        self._first = 0
        self._last = 0
        self._done = True
        self._checked = 0
        self._matched = 0
        self._seen: dict[int, LedgerStep] = {}
        self._start: int | None = None  # the step resumed from (None: a fresh start)
        self._held = ""
        self._first_after = False
        self.report: ResumeReport | None = None
        self.problems: list[str] = []

    # -- starting ------------------------------------------------------------------------
    @property
    def path(self) -> str | None:
        """This process's ledger tape (None until the first record)."""
        return self._writer.path if self._writer is not None else None

    def _open(self, start_step: int, source: str) -> None:
        from ..context.env import capture_env

        if self._writer is not None:
            return
        if self.run_id is None:
            import uuid

            self.run_id = uuid.uuid4().hex[:16]
        meta = {"ledger": 1, "run_id": self.run_id, "env": capture_env(), "pid": os.getpid(), **self._meta}
        self._writer = LedgerTapeWriter(self.directory, meta)
        self._writer.append(LedgerOpen(self.run_id, start_step, source, self._baseline))

    def touch(self, step: int) -> None:
        """Start this process's tape now (at ``step``) if no step has started it yet."""
        self._open(step, "")

    def resumed(self, step: int, *, source: str = "", run_id: str | None = None,
                baseline: tuple[tuple[str, bytes], ...] | None = None, rng_held: str = "") -> None:
        """Call right after a checkpoint of ``step`` was loaded and its RNG restored: the
        ledger's earlier tapes for this run become the expectation for steps after it.
        ``baseline``: the streams' digests right after the load (default: now).
        ``rng_held``: the load held the RNG streams back (how, and after ``|`` how to
        restore them); :meth:`rng_restored` says they were restored; a step before that
        names it as the cause of any difference."""
        from ..context.env import capture_env, env_differences

        self._baseline = tuple(baseline) if baseline is not None else tuple(rng_digests(self.generators))
        self._last_rng = dict(self._baseline)
        self._used = set()
        self._done = True
        self._start = step
        self._held = rng_held
        self._first_after = True
        self._matched = 0
        self._seen = {}
        tapes, problems = read_ledger_dir(self.directory)
        self.problems = problems
        if run_id is None and tapes:
            run_id = tapes[-1].run_id  # a plain ckpt.save run: the directory is the run
        if run_id is not None:
            self.run_id = run_id
        self._open(step, source)
        if self.verify != "off":
            mine = [t for t in tapes if t.run_id == self.run_id]
            others = sorted({t.run_id for t in tapes} - {self.run_id})
            expected: dict[int, LedgerStep] = {}
            for t in mine:  # newer tapes overwrite older ones: the newest history of each step
                if not t.opens:
                    problems.append(f"{t.path}: no ledger_open event (torn before its first record)")
                    continue
                cuts = list(t.rollbacks)
                for i, s in enumerate(t.steps):
                    while cuts and cuts[0][0] <= i:  # a rollback voids the abandoned timeline
                        _void(cuts.pop(0)[1], expected, self._expected_all)
                    self._expected_all[s.step] = s
                    if s.step > step:
                        expected[s.step] = s
                for _, to_step in cuts:
                    _void(to_step, expected, self._expected_all)
                self._expected_used |= used_streams(t.opens, t.steps)
                if t.steps and t.steps[-1].step > step:
                    self._env_diffs = env_differences(t.meta.get("env") or {}, capture_env())
            if expected:
                self._expected = expected
                self._first, self._last = min(expected), max(expected)
                self._done = False
            else:
                why = (f"no steps to compare: the ledger in {self.directory} has no step after step {step} (the "
                       "run stopped right after that checkpoint)")
                if problems:
                    why += "; unreadable tapes: " + "; ".join(problems)
                if others and not mine:
                    why = (f"the ledger in {self.directory} belongs to another run (run id {', '.join(others)}, "
                           f"this run {self.run_id})")
                elif not tapes and not problems:
                    why = f"no ledger in {self.directory}"
                self._finish(ResumeReport("skipped", reason=why), warn=True)

    def rng_restored(self) -> None:
        """The RNG streams held back at the resume were restored just now: they are the
        baseline the steps after it are measured from."""
        self._held = ""
        self._baseline = tuple(rng_digests(self.generators))
        self._last_rng = dict(self._baseline)

    # -- the loop's call -----------------------------------------------------------------
    def step(self, step: int, *, batch: Any = _MISSING, loss: Any = None, values: Mapping[str, Any] | None = None,
             done: bool = True, kill: bool | None = None) -> None:
        """Record step ``step`` (after the optimizer step). ``values``: plain values the
        step used that the checkpoint may not hold (``{"lr": lr, "best_val": best}``):
        compared exactly on a resume, and named when they differ. With ``done`` (the
        default) the step is over and the step hooks run; a manager passes False and calls
        :meth:`step_done` after its save. ``kill`` is the deprecated name of ``done``."""
        if kill is not None:
            warnings.warn("Ledger.step(kill=...) is now Ledger.step(done=...)", DeprecationWarning, stacklevel=2)
            done = kill
        if self._writer is None:
            self._open(step - 1, "")
        rng = tuple(rng_digests(self.generators))
        for name, d in rng:
            if self._last_rng.get(name, d) != d:
                self._used.add(name)
            self._last_rng[name] = d
        params = None
        if self._params is not None and self.params_every and step % self.params_every == 0:
            params = params_digest(self._params())
        rec = LedgerStep(
            step,
            rng,
            batch_digest(batch) if batch is not _MISSING and batch is not None else None,
            float(loss.detach().double().item()) if hasattr(loss, "detach") else (None if loss is None else float(loss)),
            params,
            plain_values(values),
        )
        assert self._writer is not None
        self._writer.append(rec)
        first_after, self._first_after = self._first_after, False
        if first_after and self._held and self.verify != "off":
            how, _, fix = self._held.partition("|")
            warnings.warn_explicit(f"resume at step {self._start}: the RNG streams were held back ({how}) and never "
                                   f"restored before step {rec.step}" + (f": {fix}" if fix else ""),
                                   ResumeVerificationWarning, filename="ckpt.ledger", lineno=0, module="ckpt.ledger")
        if not self._done:
            self._check(rec, first_after)
            self._checked = max(self._checked, rec.step)
        if done:
            self.step_done(step)

    def record_guard(self, step: int, record: Any) -> None:
        """Tape a loss-spike guard event (``ckpt.guard.events``) at ``step``. A rollback
        also ends the validity of every expectation of a later step (the run left that
        timeline) and re-bases the RNG streams on their restored values."""
        from ..guard.events import RollbackEvent

        if self._writer is None:
            self._open(step - 1, "")
        assert self._writer is not None
        self._writer.append(GuardEntry(step, record))
        if isinstance(record, RollbackEvent):
            self._writer.sync()
            self._last_rng = dict(rng_digests(self.generators))
            if not self._done:
                _void(record.to_step, self._expected, {})
                if not any(s > self._checked for s in self._expected):
                    if self._checked >= self._first:
                        self._finish(self._exact(self._checked))
                    else:
                        self._finish(ResumeReport("skipped", reason=f"the run rolled back to step {record.to_step} "
                                                                    f"before step {self._first}"), warn=False)

    def step_done(self, step: int) -> None:
        """Step ``step`` is done (recorded, and any save of it started): run the step hooks."""
        for hook in list(STEP_HOOKS):
            hook(self, step)

    def maybe_kill(self, step: int) -> None:
        """Deprecated name of :meth:`step_done`."""
        warnings.warn("Ledger.maybe_kill(step) is now Ledger.step_done(step)", DeprecationWarning, stacklevel=2)
        self.step_done(step)

    def flush(self) -> None:
        """Make every record so far durable (a process killed right after loses none)."""
        if self._writer is not None:
            self._writer.sync()

    def _check(self, rec: LedgerStep, first_after: bool) -> None:
        exp = self._expected.get(rec.step)
        if exp is None:
            return
        d = compare_step(exp, rec, self._expected_used | self._used)
        if d.differs:
            seen = find_batch(self._expected_all, rec.batch, rec.step) if d.batch else None
            base = dict(self._baseline)
            moved = tuple(n[len(RNG_BEFORE):] for n, v in rec.values if n.startswith(RNG_BEFORE)
                          and base.get(n[len(RNG_BEFORE):], v) != v) if first_after else ()
            cause = likely_cause(d, self._env_diffs, batch_seen_at=seen, held=self._held if first_after else "",
                                 moved=moved, start=self._start if first_after else None,
                                 hint=find_hint(self._expected_all, {rec.step: rec, **self._seen}, rec.step))
            self._finish(ResumeReport("diverged", self._first, rec.step, d, cause, matched=self._matched))
        else:
            self._matched += 1
            self._seen[rec.step] = rec
            if rec.step >= self._last:
                self._finish(self._exact(rec.step))

    def _exact(self, last: int) -> ResumeReport:
        names = {n for n, _ in self._baseline}
        unused = tuple(sorted(names - self._expected_used - self._used))
        return ResumeReport("exact", self._first, last, unused=unused, planned_last=self._last, matched=self._matched)

    def _finish(self, report: ResumeReport, *, warn: bool | None = None) -> None:
        self._done = True
        self.report = report
        if self._writer is not None:
            self._writer.append(ResumeCheck(report.verdict, report.first, report.last, report.text),
                                step=report.last)
            self._writer.sync()
        if report.verdict == "diverged" and self.verify == "strict":
            raise ResumeDivergedError(report.text, path=self.directory)
        if self.verify != "off" and (report.verdict != "skipped" or warn):
            announce(report, ok=report.verdict == "exact")

    def close(self) -> ResumeReport | None:
        """Finish: a resume whose re-executed range was cut short reports what it saw."""
        if not self._done:
            if self._checked >= self._first:
                self._finish(self._exact(self._checked))
            else:
                self._finish(ResumeReport("skipped", reason=f"the run stopped before step {self._first}"), warn=False)
        if self._writer is not None:
            self._writer.close()
        return self.report


def _void(to_step: int, *maps: dict[int, LedgerStep]) -> None:
    """Drop the records of steps after ``to_step``: a rollback abandoned them."""
    for m in maps:
        for s in [s for s in m if s > to_step]:
            del m[s]
