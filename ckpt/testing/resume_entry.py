"""Resume-equivalence check: kill a training run with SIGKILL, resume it, compare bits.

``check_resume(entry, ...)`` runs a user entry point twice, each time in fresh
processes: once straight through (the reference), and once as a chain of attempts, the
first killed with SIGKILL at step ``kill_at[0]``, the next resumed from the run
directory's latest checkpoint and killed at ``kill_at[1]``, and so on; the last attempt
runs to the end. It then compares, bit for bit:

* the loss of every step (each attempt's report against the reference's, so steps
  re-run after a resume are checked too), naming the first differing step;
* right after each resume, the state the manager loaded against the reference's own
  checkpoint of that step (every tensor, the RNG streams, the data cursor), naming the
  first differing tensor and the entry (field) that was not restored;
* the final state: parameters, optimizer and scheduler state, counters, RNG, data.

An exactness claim is refused when the attempts ran in different environments (the
fingerprint of ``ckpt.context.env``: versions, determinism flags, thread counts) or at
different world sizes: the result then says ``refused`` and names every difference.

Entry-point contract
====================
An entry point is a function ``train(ctx: RunContext) -> None``, named ``module:function``
and importable in a fresh process (the harness passes its ``sys.path`` on). It must:

1. build model, optimizer, scheduler and data deterministically from ``ctx.seed``
   (and ``ctx.rank``/``ctx.world_size``; the harness initialises torch.distributed with
   gloo before the call when ``world_size > 1`` and tears it down after);
2. create its checkpoint manager with ``mgr = ctx.manager(state, data=..., ...)``, which
   is a ``CheckpointManager`` on ``ctx.run_dir`` saving every ``ctx.save_every`` steps
   (other keywords pass through), and call ``mgr.resume()``; optionally, before that,
   ``ctx.watch(full_state)`` declares every entry the loop depends on (default: the
   manager's entries), so an entry left out of the checkpoint is named after a resume;
3. run optimizer steps ``mgr.start_step + 1 .. ctx.steps``, calling after each one
   ``mgr.after_step(step)`` and then ``ctx.report(step, loss)``. ``report`` is the kill
   hook: in an attempt told to die at step K, it records the loss and the process kills
   itself with SIGKILL, so a save of step K may still be in flight;
4. call ``ctx.finish()`` at the end (it saves the manager's state, data and RNG for the
   comparison) and return.

``ctx.options`` carries string options from the caller (``--option key=value``), e.g. to
switch a deliberate bug on in tests. The replay helper re-executes the same contract.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..errors import CkptError
from .verdict import Verdict

__all__ = [
    "RunContext",
    "ResumeCheckResult",
    "Divergence",
    "ResumeEvent",
    "ResumeCheckError",
    "check_resume",
    "compare_checkpoints",
    "exactness_refusals",
]

_CHILD_FLAG = "--ckpt-resume-child"


class ResumeCheckError(CkptError, RuntimeError):
    """The check could not run: an attempt crashed, timed out or broke the contract."""


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Divergence:
    """One way the interrupted run differs. ``where``: ``loss``, ``resume`` or ``final``."""

    where: str
    step: int | None
    field: str | None
    tensor: str | None
    detail: str
    rank: int = 0

    def __str__(self) -> str:
        bits = [self.where]
        if self.step is not None:
            bits.append(f"step {self.step}")
        if self.world_rank_note:
            bits.append(self.world_rank_note)
        if self.field is not None:
            bits.append(f"field {self.field!r}")
        if self.tensor is not None:
            bits.append(f"at {self.tensor!r}")
        return ", ".join(bits) + f": {self.detail}"

    @property
    def world_rank_note(self) -> str:
        return f"rank {self.rank}" if self.rank else ""


@dataclass(frozen=True, slots=True)
class ResumeEvent:
    """One attempt of a kill-and-resume check: what it resumed from, at which step, and where it was killed."""

    attempt: int
    checkpoint: str | None  # name of the checkpoint resumed from; None: started fresh
    step: int
    killed_at: int | None


@dataclass(frozen=True, slots=True)
class ResumeCheckResult:
    """The outcome of ``check_resume``: identical or not, the refusals, the divergences, the
    resumes, and how much was compared."""

    entry: str
    steps: int
    kill_at: tuple[int, ...]
    world_size: int
    identical: bool
    refused: tuple[str, ...]
    divergences: tuple[Divergence, ...]
    resumes: tuple[ResumeEvent, ...]
    losses_compared: int
    tensors_compared: int
    work_dir: str

    @property
    def verdict(self) -> Verdict:
        """REFUSED whenever a reason refuses the claim, even with differences listed: they
        may come from the different environments, not from the resume."""
        if self.refused:
            return Verdict.REFUSED
        return Verdict.IDENTICAL if self.identical else Verdict.DIFFERENT

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code

    @property
    def first(self) -> Divergence | None:
        return min(self.divergences, key=lambda d: (d.step if d.step is not None else 1 << 62), default=None)

    def summary(self) -> str:
        lines = [f"check-resume {self.entry}: steps={self.steps} world_size={self.world_size} kill_at={list(self.kill_at)}"]
        for ev in self.resumes:
            start = f"resumed from {ev.checkpoint}" if ev.checkpoint else "started fresh"
            end = f", killed (SIGKILL) at step {ev.killed_at}" if ev.killed_at is not None else ", ran to the end"
            lines.append(f"  attempt {ev.attempt}: {start} (step {ev.step}){end}")
        lines.append(f"  compared: {self.losses_compared} step losses, {self.tensors_compared} tensors, RNG, data state")
        for r in self.refused:
            lines.append(f"  refused: {r}")
        first = self.first
        for d in self.divergences[:20]:
            lines.append(f"  differs: {d}")
        if first is not None:
            lines.append(f"  first difference: {first}")
        if self.verdict is Verdict.REFUSED:
            lines.append("REFUSED: no exactness claim is made (see the reasons above)")
        else:
            lines.append(str(self.verdict))
        return "\n".join(lines)


# --- the child side: RunContext --------------------------------------------------------


class RunContext:
    """What an entry point gets. See the module docstring for the contract."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.run_dir: str = spec["run_dir"]
        self.steps: int = int(spec["steps"])
        self.seed: int = int(spec["seed"])
        self.save_every: int | None = spec.get("save_every")
        self.rank: int = int(spec.get("rank", 0))
        self.world_size: int = int(spec.get("world_size", 1))
        self.kill_at: int | None = spec.get("kill_at")
        self.attempt: int = int(spec.get("attempt", 0))
        self.async_save: bool = bool(spec.get("async_save", True))
        self.options: dict[str, str] = dict(spec.get("options") or {})
        self.out_dir: str = spec["out_dir"]
        self._events = open(os.path.join(self.out_dir, f"events-rank-{self.rank:05d}.jsonl"), "a", encoding="utf-8")
        self.reference: bool = bool(spec.get("reference", False))
        self._mgr: Any = None
        self._watched: dict[str, Any] | None = None
        self._reported = False

    def _log(self, **event: Any) -> None:
        # Flushed per line: a SIGKILL loses nothing the kernel already has.
        self._events.write(json.dumps(event, sort_keys=True) + "\n")
        self._events.flush()

    def watch(self, state: Mapping[str, Any]) -> None:
        """Declare the full training state the check compares (default: the manager's).

        Declare everything the loop depends on, including entries deliberately left out
        of the checkpoint: then a missing entry shows up by name right after a resume.
        """
        self._watched = dict(state)

    def _snapshot(self, path: str, step: int, **meta: Any) -> None:
        import ckpt

        mgr = self._mgr
        ckpt.save(
            path,
            self._watched if self._watched is not None else mgr.state,
            data=mgr.data,
            generators=mgr.generators or None,
            step=step,
            meta=meta,
            overwrite=True,
            ledger=False,  # a comparison snapshot, not a step of the run
            this_rank_only=True,  # one path per rank: each rank's own state, on purpose
        )

    def manager(self, state: Mapping[str, Any], **kwargs: Any) -> Any:
        """A ``CheckpointManager`` on ``run_dir`` that saves every ``save_every`` steps."""
        from ..manager import CheckpointManager, RetentionPolicy

        ctx = self

        class _HarnessManager(CheckpointManager):
            def resume(self, *, defer_rng: bool = False, exactness: str | None = None) -> Any:
                result = super().resume(defer_rng=defer_rng, exactness=exactness)
                ctx._on_resume(self, result, deferred=defer_rng)
                return result

        kwargs.setdefault("every_steps", self.save_every)
        kwargs.setdefault("async_save", self.async_save)
        # Keep every checkpoint: the reference's are what resumed states are compared to.
        kwargs.setdefault("retention", RetentionPolicy(keep_last=1 << 30))
        self._mgr = _HarnessManager(self.run_dir, state, **kwargs)
        return self._mgr

    def _on_resume(self, mgr: Any, result: Any, *, deferred: bool) -> None:
        if result is None:
            self._log(kind="start", step=0, checkpoint=None)
            return
        step = int(result.step or 0)
        self._log(kind="start", step=step, checkpoint=mgr.resumed_from["name"], deferred_rng=deferred)
        # What was actually loaded, right now, before any step runs.
        self._snapshot(os.path.join(self.out_dir, f"resumed-rank-{self.rank:05d}"), step, deferred_rng=deferred)

    def report(self, step: int, loss: Any) -> None:
        """Record the loss of optimizer step ``step``; the kill hook of the check."""
        if not self._reported and self._mgr is None:
            self._log(kind="start", step=step - 1, checkpoint=None)
        self._reported = True
        value = float(loss.item() if hasattr(loss, "item") else loss)
        self._log(kind="loss", step=int(step), loss=value.hex())
        if self.reference and self.save_every and step % self.save_every == 0 and self._mgr is not None:
            # The state at each save point, to compare a resumed attempt's loaded state with.
            self._snapshot(os.path.join(self.out_dir, f"state-{step:08d}-rank-{self.rank:05d}"), step)
        if self.kill_at is not None and step == self.kill_at:
            self._events.close()
            os.kill(os.getpid(), signal.SIGKILL)

    def finish(self, state: Mapping[str, Any] | None = None, *, data: Any = None, generators: Any = None) -> None:
        """Save the final state for the comparison (defaults: the manager's)."""
        import ckpt

        mgr = self._mgr
        if mgr is not None:
            mgr.close()
        if state is None:
            if mgr is None:
                raise ResumeCheckError("ctx.finish() without a state and without ctx.manager(...)")
            state = self._watched if self._watched is not None else mgr.state
            data, generators = mgr.data, mgr.generators
        ckpt.save(
            os.path.join(self.out_dir, f"final-rank-{self.rank:05d}"),
            state,
            data=data,
            generators=generators or None,
            step=self.steps,
            overwrite=True,
            this_rank_only=True,
            ledger=False,
        )
        self._log(kind="finish", step=self.steps)
        self._events.close()


def _child_main(spec_json: str) -> int:
    import importlib

    spec = json.loads(spec_json)
    for p in reversed(spec.get("sys_path", [])):
        if p not in sys.path:
            sys.path.insert(0, p)
    # Read at capture time (ckpt.context.env), so they take effect in a forked child too.
    os.environ.update(spec.get("env") or {})
    mod_name, _, fn_name = spec["entry"].partition(":")
    fn = getattr(importlib.import_module(mod_name), fn_name)
    ws = int(spec.get("world_size", 1))
    if ws > 1:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=float(spec.get("timeout", 120)))
        # the attempt's store, served by the parent (_launch): every rank is a client
        store = dist.TCPStore("127.0.0.1", int(spec["port"]), is_master=False, wait_for_workers=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=int(spec["rank"]), world_size=ws, timeout=timeout)
    try:
        fn(RunContext(spec))
    finally:
        if ws > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


# --- the parent side -------------------------------------------------------------------


def _serve_store(timeout: float) -> Any:
    """The rendezvous store of one attempt's ranks, served by this process on a port the OS
    assigned as it listens (``.port``). A port found free, closed and handed to rank 0 to
    bind later could be taken in between (by gloo's own connections, or another job)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


@dataclass(slots=True)
class _Attempt:
    name: str
    out_dir: str
    kill_at: int | None
    available: str | None = None  # newest committed checkpoint when the attempt started
    procs: list[Any] = field(default_factory=list)  # Popen or multiprocessing.Process
    logs: list[Any] = field(default_factory=list)
    store: Any = None  # the ranks' rendezvous (world size > 1), held until they have exited


_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.utils.data", "numpy", "ckpt.testing.resume_entry", "ckpt.manager", "ckpt._load"]


def _forkserver() -> Any:
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    # Children fork from a server that has only imported these (no RNG drawn, no thread
    # pool used, no training state): each attempt is a fresh process, minus the seconds
    # that importing torch and torch._dynamo cost.
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Keep multiprocessing from re-running the caller's ``__main__`` in the child.

    A forkserver child normally re-imports the parent's main script (``spawn.prepare``),
    which runs a script without an ``if __name__ == "__main__"`` guard a second time. A
    main module whose spec is named ``__main__`` is skipped by ``prepare``, so one stands
    in while the child's preparation data is taken (inside ``Process.start``).
    """
    import importlib.machinery
    import types

    real = sys.modules["__main__"]
    stand_in = types.ModuleType("__main__")
    stand_in.__spec__ = importlib.machinery.ModuleSpec("__main__", None)
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        sys.modules["__main__"] = real


def _forked_child(spec_json: str, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    code = _child_main(spec_json)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


def _launch(
    base: Mapping[str, Any],
    out_dir: str,
    run_dir: str,
    kill_at: int | None,
    attempt: int,
    world_size: int,
    env: Mapping[str, str],
    isolation: str,
) -> _Attempt:
    os.makedirs(out_dir, exist_ok=True)
    att = _Attempt(os.path.basename(out_dir), out_dir, kill_at)
    if world_size > 1:
        att.store = _serve_store(float(base.get("timeout", 120)))
    port = att.store.port if att.store is not None else 0
    for rank in range(world_size):
        spec = dict(base, run_dir=run_dir, out_dir=out_dir, kill_at=kill_at, attempt=attempt, rank=rank, world_size=world_size, port=port, env=dict(env))
        log_path = os.path.join(out_dir, f"log-rank-{rank:05d}.txt")
        if isolation == "forkserver":
            p = _forkserver().Process(target=_forked_child, args=(json.dumps(spec), log_path), name=f"ckpt-check-{attempt}-{rank}")
            with _main_not_reimported():
                p.start()
            att.procs.append(p)
            continue
        child_env = dict(os.environ)
        child_env.update(env)
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        log = open(log_path, "wb")
        att.logs.append(log)
        att.procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ckpt.testing.resume_entry", _CHILD_FLAG, json.dumps(spec)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                cwd=os.getcwd(),
            )
        )
    return att


def _returncode(p: Any) -> int | None:
    return p.poll() if isinstance(p, subprocess.Popen) else p.exitcode


def _wait(att: _Attempt, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in att.procs:
            left = max(0.1, deadline - time.monotonic())
            if isinstance(p, subprocess.Popen):
                try:
                    p.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    pass
            else:
                p.join(left)
            if _returncode(p) is None:
                raise ResumeCheckError(f"attempt {att.name} ran past {timeout:.0f}s", path=att.out_dir)
    finally:
        for p in att.procs:
            if _returncode(p) is None:
                p.kill()
                p.wait() if isinstance(p, subprocess.Popen) else p.join()
        for log in att.logs:
            log.close()
        att.store = None  # every rank has exited: the rendezvous closes
    for rank, p in enumerate(att.procs):
        code = _returncode(p)
        want_kill = att.kill_at is not None
        if want_kill and code == -signal.SIGKILL:
            continue
        if not want_kill and code == 0:
            continue
        tail = _tail(os.path.join(att.out_dir, f"log-rank-{rank:05d}.txt"))
        if want_kill and code == 0:
            msg = f"attempt {att.name} rank {rank} finished without reaching kill step {att.kill_at} (does the entry call ctx.report every step?)"
        else:
            msg = f"attempt {att.name} rank {rank} exited with status {code}"
        raise ResumeCheckError(f"{msg}; log tail:\n{tail}", path=att.out_dir, rank=rank)


def _tail(path: str, n: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
        return data[-n:].decode(errors="replace")
    except OSError:
        return "<no log>"


def _events(out_dir: str, rank: int) -> list[dict[str, Any]]:
    path = os.path.join(out_dir, f"events-rank-{rank:05d}.jsonl")
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        break  # a torn last line (killed mid-write)
    except FileNotFoundError:
        pass
    return out


def _losses(events: Sequence[Mapping[str, Any]]) -> dict[int, str]:
    return {int(e["step"]): str(e["loss"]) for e in events if e.get("kind") == "loss"}


def check_resume(
    entry: str,
    *,
    steps: int = 12,
    kill_at: Sequence[int] = (),
    world_size: int = 1,
    save_every: int = 3,
    seed: int = 0,
    options: Mapping[str, str] | None = None,
    async_save: bool = True,
    resume_env: Mapping[str, str] | None = None,
    work_dir: str | None = None,
    timeout: float = 300.0,
    isolation: str = "forkserver",
    progress: Callable[[int, int], None] | None = None,
) -> ResumeCheckResult:
    """Run ``entry`` straight through and killed-and-resumed; compare bit for bit.

    ``progress(done, total)`` counts the attempts that have finished.

    ``kill_at`` defaults to the step right after the first save and a step mid-run.
    ``resume_env`` adds environment variables to the resumed attempts only (to show that
    a changed environment refuses the claim); they are set in the child before the entry
    runs. ``isolation``: ``"forkserver"`` forks each attempt from a server process that
    has only imported torch (fast); ``"exec"`` starts a new interpreter per attempt.
    Raises ``ResumeCheckError`` when an attempt crashes or times out.
    """
    if isolation not in ("forkserver", "exec"):
        raise ValueError(f"isolation must be 'forkserver' or 'exec', got {isolation!r}")
    if ":" not in entry:
        raise ValueError(f"entry must be 'module:function', got {entry!r}")
    if steps < 2:
        raise ValueError(f"steps must be >= 2, got {steps}")
    kills = tuple(sorted(set(kill_at))) if kill_at else tuple(sorted({min(save_every + 1, steps), max(1, steps // 2 + 1)}))
    for k in kills:
        if not 1 <= k <= steps:
            raise ValueError(f"kill step {k} is outside 1..{steps}")
    work = work_dir or tempfile.mkdtemp(prefix="ckpt-check-resume-")
    os.makedirs(work, exist_ok=True)
    base = {
        "entry": entry,
        "steps": steps,
        "seed": seed,
        "save_every": save_every,
        "async_save": async_save,
        "options": dict(options or {}),
        "sys_path": [p for p in sys.path if p and os.path.isdir(p)],
        "timeout": timeout,
    }
    ref_dir = os.path.join(work, "reference")
    chain_run = os.path.join(work, "interrupted", "run")
    # The reference runs alongside the first attempt: they share nothing on disk.
    ref = _launch(dict(base, reference=True), ref_dir, os.path.join(ref_dir, "run"), None, 0, world_size, {}, isolation)
    try:
        attempts = []
        for i, k in enumerate((*kills, None)):
            from ..manager import list_checkpoints

            committed = [r.name for r in list_checkpoints(chain_run) if r.committed]
            att = _launch(base, os.path.join(work, "interrupted", f"attempt-{i}"), chain_run, k, i, world_size, (resume_env or {}) if i else {}, isolation)
            att.available = committed[-1] if committed else None
            _wait(att, timeout)
            attempts.append(att)
            if progress is not None:
                progress(i + 1, len(kills) + 1)
    finally:
        _wait(ref, timeout)
    return _compare(entry, steps, kills, world_size, work, ref_dir, attempts)


def _compare(entry: str, steps: int, kills: tuple[int, ...], world_size: int, work: str, ref_dir: str, attempts: list[_Attempt]) -> ResumeCheckResult:
    from ..reader import CheckpointReader
    from ..writer import part_name_for_rank

    divergences: list[Divergence] = []
    refused: list[str] = []
    resumes: list[ResumeEvent] = []
    losses_compared = 0
    tensors = 0
    for rank in range(world_size):
        ref_losses = _losses(_events(ref_dir, rank))
        for step in range(1, steps + 1):
            if step not in ref_losses:
                raise ResumeCheckError(f"the reference run did not report step {step}", path=ref_dir, rank=rank)
        seen: set[int] = set()
        for i, att in enumerate(attempts):
            ev = _events(att.out_dir, rank)
            start = next((e for e in ev if e.get("kind") == "start"), None)
            if start is None:
                raise ResumeCheckError(f"attempt {i} reported nothing (does the entry call ctx.report?)", path=att.out_dir, rank=rank)
            if rank == 0:
                resumes.append(ResumeEvent(i, start.get("checkpoint"), int(start.get("step", 0)), att.kill_at))
            first_bad = None
            for step, value in sorted(_losses(ev).items()):
                losses_compared += rank == 0
                seen.add(step)
                if first_bad is None and value != ref_losses.get(step):
                    first_bad = step
                    divergences.append(
                        Divergence("loss", step, None, None, f"attempt {i}: {_fhex(value)} != reference {_fhex(ref_losses.get(step))}", rank)
                    )
            # The state the manager loaded, against the reference's checkpoint of that step.
            snap = os.path.join(att.out_dir, f"resumed-rank-{rank:05d}")
            if start.get("checkpoint") and os.path.isdir(snap):
                step = int(start.get("step", 0))
                ref_snap = os.path.join(ref_dir, f"state-{step:08d}-rank-{rank:05d}")
                if not os.path.isdir(ref_snap):
                    raise ResumeCheckError(f"the reference run left no state snapshot of step {step}", path=ref_snap)
                a = CheckpointReader(ref_snap)
                b = CheckpointReader(snap)
                refused += [f"attempt {i} after resume: {r}" for r in exactness_refusals(a.context(), b.context())]
                deferred = bool(b.meta.get("deferred_rng"))
                diffs, n = compare_checkpoints(a, b, rng=not deferred)
                tensors += n
                for d in diffs[:1]:
                    divergences.append(Divergence("resume", step + 1, d[0], d[1], f"after resuming from {start['checkpoint']}: {d[2]}", rank))
        missing = [s for s in range(1, steps + 1) if s not in seen]
        if missing:
            divergences.append(Divergence("loss", missing[0], None, None, f"steps {missing[:5]} were never run by the interrupted run", rank))
        # final states
        fa = CheckpointReader(os.path.join(ref_dir, f"final-rank-{rank:05d}"))
        fb = CheckpointReader(os.path.join(attempts[-1].out_dir, f"final-rank-{rank:05d}"))
        refused += [f"final: {r}" for r in exactness_refusals(fa.context(), fb.context())]
        diffs, n = compare_checkpoints(fa, fb)
        tensors += n
        for d in diffs[:1]:
            divergences.append(Divergence("final", None, d[0], d[1], d[2], rank))
    for ev in resumes:
        had = attempts[ev.attempt].available
        if ev.attempt > 0 and ev.checkpoint is None and had:
            refused.append(
                f"attempt {ev.attempt} started from scratch although {had} was committed: the entry did not "
                "resume (does it call mgr.resume()?), so resuming was not tested"
            )
    if kills and not any(ev.checkpoint for ev in resumes):
        # Every attempt started from scratch (e.g. each kill came before an async save
        # committed): the runs match, but nothing about resuming was checked.
        refused.append(
            "no attempt resumed from a checkpoint (every kill came before a save committed): resuming was not "
            "tested; kill later, or use blocking saves (--sync)"
        )
    identical = not divergences and not refused
    return ResumeCheckResult(
        entry, steps, kills, world_size, identical, tuple(dict.fromkeys(refused)), tuple(divergences), tuple(resumes), losses_compared, tensors, work
    )


def _fhex(v: str | None) -> str:
    if v is None:
        return "<missing>"
    try:
        return f"{float.fromhex(v)!r} ({v})"
    except ValueError:
        return v


def exactness_refusals(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Why a bit-exact claim cannot be made between two part contexts (empty: it can)."""
    from ..context.env import env_differences

    out = [f"environment {d}" for d in env_differences(saved.get("env") or {}, current.get("env") or {})]
    wa = (saved.get("topology") or {}).get("world_size", 1)
    wb = (current.get("topology") or {}).get("world_size", 1)
    if wa != wb:
        out.append(f"world_size {wa} -> {wb}: reduction order changes, numerics cannot be bit-identical")
    return out


# --- bitwise comparison of two checkpoints ---------------------------------------------


def compare_checkpoints(a: Any, b: Any, *, part_a: str | None = None, part_b: str | None = None, rng: bool = True) -> tuple[list[tuple[str, str | None, str]], int]:
    """Compare two checkpoints bit for bit: ``([(field, tensor_key, detail)], tensors)``.

    Order: state entries in the first checkpoint's order, depth first; then RNG streams,
    the data cursor, and ``extra``. ``field`` is the top-level entry (``optim``), or
    ``rng.<stream>``, ``data``, ``extra``.
    """
    if part_a is not None and len(a.parts) == 1:
        part_a = None
    if part_b is not None and len(b.parts) == 1:
        part_b = None
    sa, sb = a.state(part=part_a), b.state(part=part_b)
    out: list[tuple[str, str | None, str]] = []
    count = [0]
    for name in list(sa) + [n for n in sb if n not in sa]:
        if name not in sa or name not in sb:
            out.append((name, None, f"entry {name!r} is {'missing from the resumed run' if name not in sb else 'only in the resumed run'}"))
            continue
        d = _first_diff(sa[name], sb[name], name, count)
        if d is not None:
            out.append((name, d[0], d[1]))
    ca, cb = a.context(part_a), b.context(part_b)
    if rng:
        ra, rb = ca.get("rng") or {}, cb.get("rng") or {}
        for stream in ("python", "numpy", "torch_cpu", "cuda", "generators"):
            if not _same(ra.get(stream), rb.get(stream)):
                out.append((f"rng.{stream}", None, f"RNG stream {stream!r} differs (not restored, or restored at the wrong moment)"))
    if not _same(ca.get("data"), cb.get("data")):
        out.append(("data", None, f"data state differs: {_short(ca.get('data'))} != {_short(cb.get('data'))}"))
    return out, count[0]


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) < 200 else s[:200] + "..."


def _first_diff(x: Any, y: Any, path: str, count: list[int]) -> tuple[str | None, str] | None:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            return path, f"{type(x).__name__} != {type(y).__name__}"
        count[0] += 1
        from ..diff import tensor_diff

        d = tensor_diff(x, y, max_abs=False)
        if d.equal:
            return None
        if d.reason:
            return path, d.reason
        idx = d.first or 0
        fx, fy = x.reshape(-1)[idx].item(), y.reshape(-1)[idx].item()
        return path, f"element {idx}: {fx!r} != {fy!r} (bitwise)"
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        for k in list(x) + [k for k in y if k not in x]:
            if k not in x or k not in y:
                return f"{path}/{k}", "key present in only one run"
            d = _first_diff(x[k], y[k], f"{path}/{k}", count)
            if d is not None:
                return d
        return None
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        if len(x) != len(y):
            return path, f"length {len(x)} != {len(y)}"
        for i, (u, v) in enumerate(zip(x, y)):
            d = _first_diff(u, v, f"{path}/{i}", count)
            if d is not None:
                return d
        return None
    if not _same(x, y):
        return path, f"{x!r} != {y!r}"
    return None


def _same(x: Any, y: Any) -> bool:
    """Equality that is bitwise for floats (NaN == NaN with the same payload, 0.0 != -0.0)."""
    if isinstance(x, float) and isinstance(y, float):
        return struct.pack("<d", x) == struct.pack("<d", y)
    if isinstance(x, Mapping) and isinstance(y, Mapping):
        return set(x) == set(y) and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    return type(x) is type(y) and x == y


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == _CHILD_FLAG:
        sys.exit(_child_main(sys.argv[2]))
    sys.exit("usage: ckpt check-resume --entry module:function (this module's own CLI is for child processes)")
