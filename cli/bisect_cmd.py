"""``ckpt ledger diff``, ``ckpt bisect`` and ``ckpt check-determinism``: from "these runs
differ" to the first step, then to the first operation (``ckpt.bisect``).

The steps that run training code (making a capsule, tracing a step) run in child
processes, ``python -m ckpt.bisect ...``, each with the interpreter and settings of its
environment: another venv (``--python-b``), another thread count (``--threads-b``),
deterministic algorithms (``--deterministic-b``), or extra variables (``--env-b K=V``).
The other environment needs torch, this package's small dependencies and this
repository on its import path (set here through PYTHONPATH).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Sequence

import click

from ckpt_cli._common import ANY_PATH, dump_json, handle_errors, json_option

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__import__("ckpt").__file__)))


# -- ckpt ledger diff -------------------------------------------------------------------------


@click.group("ledger")
def ledger_group() -> None:
    """Step ledgers: compare two runs step by step."""


@ledger_group.command("diff")
@click.argument("run_a", type=ANY_PATH)
@click.argument("run_b", type=ANY_PATH)
@json_option("§4.16")
@handle_errors
def ledger_diff_cmd(run_a: str, run_b: str, as_json: bool) -> None:
    """The first step where two runs of one script differ (batch, RNG stream, loss bits,
    parameters), the environment differences, and whether they were ever equal.
    RUN_A/RUN_B: run directories (with ledger/) or ledger directories. Exit 0 identical,
    6 different, 2 nothing in common."""
    from ckpt.bisect import diff_runs

    rd = diff_runs(run_a, run_b)
    if as_json:
        dump_json(rd.as_json())
    else:
        click.echo(rd.summary())
    if rd.common == 0:
        raise click.exceptions.Exit(2)
    if not rd.identical:
        raise click.exceptions.Exit(6)


# -- environments ------------------------------------------------------------------------------


@dataclass
class Env:
    """How one side runs: its interpreter, its settings and its variables."""

    name: str
    python: str = sys.executable
    threads: int | None = None
    deterministic: bool = False
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        bits = [self.python]
        if self.threads:
            bits.append(f"{self.threads} thread{'s' if self.threads != 1 else ''}")
        if self.deterministic:
            bits.append("deterministic algorithms")
        bits += [f"{k}={v}" for k, v in sorted(self.env.items())]
        return ", ".join(bits)

    def run(self, args: Sequence[str], cwd: str, log: str) -> None:
        cmd = [self.python, "-m", "ckpt.bisect", *args]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        if self.deterministic:
            cmd.append("--deterministic")
        env = {**os.environ, **self.env}  # the child's environment: ours, passed on (spec/knobs.md)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PKG_ROOT, cwd, env.get("PYTHONPATH")]))
        with open(log, "ab") as out:
            rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
        if rc != 0:
            with open(log, "rb") as f:
                tail = f.read()[-3000:].decode(errors="replace")
            raise click.ClickException(f"environment {self.name} failed ({shlex.join(cmd)}, exit {rc}):\n{tail}")


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{it!r} is not KEY=VALUE")
        out[k] = v
    return out


def _checkpoint_before(run_dir: str, step: int) -> str | None:
    """The newest committed checkpoint of ``run_dir`` before ``step``; None: start from the
    target as built (the script's seeded step 0), re-executing every step before it."""
    from ckpt.manager import list_checkpoints

    found = [r for r in list_checkpoints(run_dir) if r.committed and r.step < step]
    return found[-1].path if found else None


def bisect_step(checkpoint: str | None, step: int, entry: str, a: Env, b: Env, work: str, cwd: str) -> Any:
    """Make the capsule of ``step`` in environment A, trace it in A and in B, compare."""
    from ckpt.bisect import compare_traces, load_trace

    log = os.path.join(work, "bisect.log")
    capsule = os.path.join(work, f"step-{step:08d}.capsule")
    start = os.path.abspath(checkpoint) if checkpoint else "start"
    if checkpoint is None:
        click.echo(f"no checkpoint before step {step}: starting from the entry's state as built (step 0)", err=True)
    a.run(["capsule", start, "--entry", entry, "--step", str(step), "--out", capsule], cwd, log)
    ta, tb = os.path.join(work, "a.trace"), os.path.join(work, "b.trace")
    a.run(["trace", capsule, "--entry", entry, "--out", ta], cwd, log)
    b.run(["trace", capsule, "--entry", entry, "--out", tb], cwd, log)
    return compare_traces(load_trace(ta), load_trace(tb))


_ENV_OPTIONS = [
    click.option("--python-b", default=None, metavar="PYTHON", help="Interpreter of environment B (another venv)."),
    click.option("--threads-a", type=int, default=None, help="Intra-op threads in environment A."),
    click.option("--threads-b", type=int, default=None, help="Intra-op threads in environment B."),
    click.option("--deterministic-b", is_flag=True, help="torch.use_deterministic_algorithms(True) in B."),
    click.option("--env-b", multiple=True, metavar="K=V", help="An environment variable of B (repeatable)."),
]


def _env_options(fn: Any) -> Any:
    for opt in reversed(_ENV_OPTIONS):
        fn = opt(fn)
    return fn


def _report(cmp: Any, step: int, a: Env, b: Env) -> str:
    lines = [f"step {step}: A = {a.describe()}", f"         B = {b.describe()}", cmp.summary()]
    return "\n".join(lines)


def _comparison_json(cmp: Any, step: int) -> dict[str, Any]:
    f = cmp.first
    return {"step": step, "identical": cmp.identical, "operations_equal": cmp.compared,
            "first": None if f is None else {"module": f.entry.module, "phase": f.entry.phase,
                                             "occurrence": f.entry.occurrence, "count": f.count, "numel": f.numel,
                                             "max_abs": f.max_abs, "max_ulp": f.max_ulp, "what": f.describe()},
            "env_differences": list(cmp.env_differences)}


# -- ckpt bisect ---------------------------------------------------------------------------------


@click.group("bisect")
def bisect_group() -> None:
    """From the first differing step to the first differing operation (module and phase)."""


@bisect_group.command("run")
@click.argument("run_a", type=ANY_PATH)
@click.argument("run_b", type=ANY_PATH)
@click.option("--entry", required=True, metavar="MODULE:FUNCTION",
              help="Returns a ckpt.bisect.Target (state, step(batch), next_batch()); imported from the working directory.")
@click.option("--step", type=int, default=None, help="Bisect this step (default: the first that differs).")
@click.option("--work", type=ANY_PATH, default=None, help="Keep the capsule and traces here.")
@_env_options
@json_option("§4.17")
@handle_errors
def bisect_run_cmd(run_a: str, run_b: str, entry: str, step: int | None, work: str | None, python_b: str | None,
                   threads_a: int | None, threads_b: int | None, deterministic_b: bool, env_b: tuple[str, ...],
                   as_json: bool) -> None:
    """Find the first step where RUN_B's ledger departs from RUN_A's, restore RUN_A's last
    checkpoint before it, re-execute up to it, and trace that step in both environments:
    name the first module and phase whose output differs, and by how much. Exit 0 if the
    step's operations agree, 6 if they differ."""
    from ckpt.bisect import diff_runs

    if step is None:
        rd = diff_runs(run_a, run_b)
        if rd.first is None:
            click.echo(rd.summary())
            raise click.exceptions.Exit(0 if rd.identical else 2)
        step = rd.first.step
    a = Env("A", threads=threads_a)
    b = Env("B", python=python_b or sys.executable, threads=threads_b, deterministic=deterministic_b,
            env=_parse_env(env_b))
    work = os.path.abspath(work or tempfile.mkdtemp(prefix="ckpt-bisect-"))
    os.makedirs(work, exist_ok=True)
    cmp = bisect_step(_checkpoint_before(run_a, step), step, entry, a, b, work, os.getcwd())
    if as_json:
        dump_json({**_comparison_json(cmp, step), "work": work})
    else:
        click.echo(_report(cmp, step, a, b))
        click.echo(f"capsule and traces: {work}")
    if not cmp.identical:
        raise click.exceptions.Exit(6)


@bisect_group.command("capsule")
@click.argument("checkpoint", type=ANY_PATH)
@click.option("--entry", required=True, metavar="MODULE:FUNCTION")
@click.option("--step", type=int, default=None, help="The step to capture (default: the one after the checkpoint).")
@click.option("--out", required=True, type=ANY_PATH)
@handle_errors
def capsule_cmd(checkpoint: str, entry: str, step: int | None, out: str) -> None:
    """Write the capsule of a step (the state before it, its batch, its RNG) as one file to
    take to another machine; there, ``ckpt bisect trace`` it."""
    from ckpt.bisect import load_target, make_capsule

    got = make_capsule(checkpoint, load_target(entry), out, step=step)
    click.echo(f"capsule of step {got.step}: {out}")


@bisect_group.command("trace")
@click.argument("capsule", type=ANY_PATH)
@click.option("--entry", required=True, metavar="MODULE:FUNCTION")
@click.option("--out", required=True, type=ANY_PATH)
@click.option("--digests-only", is_flag=True, help="Keep digests, not tensors (smaller; no magnitudes).")
@handle_errors
def trace_cmd(capsule: str, entry: str, out: str, digests_only: bool) -> None:
    """Run a capsule's step here with every operation digested; write the trace."""
    from ckpt.bisect import load_target, save_trace, trace_capsule

    trace = trace_capsule(capsule, load_target(entry), keep_tensors=not digests_only)
    save_trace(trace, out)
    click.echo(f"trace of step {trace.meta.get('step')}: {len(trace.entries)} operations -> {out}")


@bisect_group.command("compare")
@click.argument("trace_a", type=ANY_PATH)
@click.argument("trace_b", type=ANY_PATH)
@json_option("§4.17")
@handle_errors
def compare_cmd(trace_a: str, trace_b: str, as_json: bool) -> None:
    """The first operation where two traces of one capsule differ. Exit 0 same, 6 different."""
    from ckpt.bisect import compare_traces, load_trace

    ta = load_trace(trace_a)
    cmp = compare_traces(ta, load_trace(trace_b))
    step = int(ta.meta.get("step") or 0)
    if as_json:
        dump_json(_comparison_json(cmp, step))
    else:
        click.echo(cmp.summary())
    if not cmp.identical:
        raise click.exceptions.Exit(6)


# -- ckpt check-determinism ---------------------------------------------------------------------

#: the known fixes, tried in this order; each is verified by two more runs
FIXES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("one intra-op thread (torch.set_num_threads(1))", {"threads": 1}),
    ("deterministic algorithms (torch.use_deterministic_algorithms(True), CUBLAS_WORKSPACE_CONFIG=:4096:8)",
     {"deterministic": True, "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}),
    ("both", {"threads": 1, "deterministic": True, "env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}}),
)

# The child's sitecustomize: it reads the CKPT_DET_* variables this process sets for it
# (spec/knobs.md, "set for a child process"); no torch import here, the CLI stays fast.
_SITE = '''import os
if os.environ.get("CKPT_DET_THREADS") or os.environ.get("CKPT_DET_DETERMINISTIC"):
    import torch
    if os.environ.get("CKPT_DET_THREADS"):
        torch.set_num_threads(int(os.environ["CKPT_DET_THREADS"]))
    if os.environ.get("CKPT_DET_DETERMINISTIC"):
        torch.use_deterministic_algorithms(True)
'''


def _run_script(argv: Sequence[str], run: str, settings: dict[str, Any], site: str, log: str) -> int:
    cmd = [a.replace("{run}", run) for a in argv]
    env = {**os.environ, **settings.get("env", {})}  # the child's environment: ours, passed on
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")]))
    if settings.get("threads"):
        env["CKPT_DET_THREADS"] = str(settings["threads"])
    if settings.get("deterministic"):
        env["CKPT_DET_DETERMINISTIC"] = "1"
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        return subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode


@click.command("check-determinism", context_settings={"ignore_unknown_options": True})
@click.option("--entry", default=None, metavar="MODULE:FUNCTION",
              help="A ckpt.bisect.Target of the script: also name the first nondeterministic operation.")
@click.option("--threads", type=int, default=None, help="Run both times with this many intra-op threads.")
@click.option("--compare-threads", type=int, default=None,
              help="Run the second time with this many threads instead (is the result thread-count dependent?).")
@click.option("--deterministic", is_flag=True, help="Run with torch.use_deterministic_algorithms(True).")
@click.option("--work", type=ANY_PATH, default=None, help="Keep the runs here.")
@click.option("--no-fixes", is_flag=True, help="Do not try the known fixes.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@handle_errors
def check_determinism_cmd(entry: str | None, threads: int | None, compare_threads: int | None, deterministic: bool,
                          work: str | None, no_fixes: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND twice with the same seed and compare the two step ledgers: the first
    nondeterministic step (and with --entry, the operation), then the known fixes, each
    verified by two more runs. COMMAND must write its run (a CheckpointManager run
    directory) to {run}, which is replaced by a fresh directory per run:

        ckpt check-determinism -- python train.py --out {run}

    The command runs in this working directory, unmodified except for {run}. Exit 0
    deterministic, 6 nondeterministic (the report names what fixes it), 2 no claim."""
    from ckpt.bisect import diff_runs

    argv = list(command[1:] if command and command[0] == "--" else command)
    if not any("{run}" in a for a in argv):
        raise click.UsageError("the command must contain {run}: where each run writes its run directory")
    work = os.path.abspath(work or tempfile.mkdtemp(prefix="ckpt-determinism-"))
    os.makedirs(work, exist_ok=True)
    site = os.path.join(work, "site")
    os.makedirs(site, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITE)
    log = os.path.join(work, "runs.log")
    base: dict[str, Any] = {"threads": threads, "deterministic": deterministic}
    second = dict(base, threads=compare_threads) if compare_threads else base

    def pair(tag: str, s1: dict[str, Any], s2: dict[str, Any]) -> Any:
        a, b = os.path.join(work, f"{tag}-1"), os.path.join(work, f"{tag}-2")
        for run, s in ((a, s1), (b, s2)):
            rc = _run_script(argv, run, s, site, log)
            if rc != 0:
                raise click.ClickException(f"NO CLAIM: the run into {run} exited with status {rc} (log: {log})")
        return a, b, diff_runs(a, b)

    a, b, rd = pair("run", base, second)
    click.echo(rd.summary())
    if rd.common == 0:
        raise click.exceptions.Exit(2)
    if rd.identical:
        click.echo(f"DETERMINISTIC: two runs agree over {rd.common} steps (runs: {work})")
        return
    assert rd.first is not None
    if entry:
        a_env = Env("A", threads=base["threads"], deterministic=deterministic)
        b_env = Env("B", threads=second["threads"], deterministic=deterministic)
        bw = os.path.join(work, "bisect")
        os.makedirs(bw, exist_ok=True)
        cmp = bisect_step(_checkpoint_before(a, rd.first.step), rd.first.step, entry, a_env, b_env, bw, os.getcwd())
        click.echo(cmp.summary() if not cmp.identical else
                   f"step {rd.first.step} re-executed from the same capsule agrees in every operation: the difference "
                   "comes from state before the step that the ledger does not hold, or from outside the traced model")
    if no_fixes or compare_threads:
        raise click.exceptions.Exit(6)
    for what, fix in FIXES:
        s = {"threads": fix.get("threads", threads), "deterministic": fix.get("deterministic", deterministic),
             "env": fix.get("env", {})}
        _, _, fixed = pair("fix-" + str(FIXES.index((what, fix))), s, s)
        if fixed.identical:
            click.echo(f"FIX: {what} makes two runs agree over {fixed.common} steps (verified by a rerun)")
            raise click.exceptions.Exit(6)
    click.echo("no known fix removed it: the difference is in the script (an unseeded source, the clock, "
               "file order) or in an operation no switch makes deterministic")
    raise click.exceptions.Exit(6)
