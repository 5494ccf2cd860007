"""Hang detection for the tests: a bound only catches a hang, it never judges speed.

- :func:`hang_s`: the bound for a wait that takes ``quiet_s`` on a quiet machine (at least
  10x it), times ``CKPT_TIMEOUT_SCALE`` (``replay.watchdog.hang_bound``);
- :func:`run` (and :func:`popen` + :func:`communicate` for a child the test talks to
  meanwhile): ``subprocess.run`` whose bound, when it expires, makes the child's whole
  process group dump its Python stacks (``PYTHONFAULTHANDLER`` + SIGABRT) and then fails
  the test naming the hang, with everything the command printed;
- with ``py-spy`` installed (the ``test`` extra), a hang also records every process's native
  and Python stacks, all threads (the gloo collective a rank waits in, a thread stuck in a
  C call, which ``faulthandler`` cannot show), before the SIGABRT;
- tests/conftest.py scales every pytest-timeout bound (the ini default and each
  ``@pytest.mark.timeout``) by the same knob.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import pytest

from replay.watchdog import hang_bound

import proctree


def scale() -> float:
    from ckpt.knobs import knobs

    return knobs().timeout_scale


def hang_s(quiet_s: float, *, floor_s: float = 60.0) -> float:
    """Seconds after which a wait of ``quiet_s`` (quiet machine) is a hang."""
    return hang_bound(quiet_s, floor_s=floor_s)


def popen(cmd: Sequence[str] | str, **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kw)`` in its own process group, with ``PYTHONFAULTHANDLER``
    set, so that :func:`communicate` can make it and its workers dump their stacks."""
    env = dict(kw.pop("env", None) or os.environ)
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT dumps every thread's stacks (workers inherit it)
    return subprocess.Popen(cmd, env=env, start_new_session=True, **kw)


def communicate(p: subprocess.Popen, *, bound_s: float, input: Any = None) -> tuple[Any, Any]:
    """``p.communicate(input)`` (also the wait for a child without pipes), failing the test with
    its stacks if it has not exited after ``bound_s`` (a hang bound: pass :func:`hang_s`).
    Started by :func:`popen`, its whole process group dumps its stacks; another child gets SIGABRT alone."""
    try:
        return p.communicate(input, timeout=bound_s)
    except subprocess.TimeoutExpired:
        pass
    own_group = _pgid(p.pid) == p.pid
    # Every process under it, found before any dies (an orphan is reparented and lost):
    # a launcher such as torchrun starts each rank in a session of its own, out of reach of
    # its group's signal, and an orphaned rank holding the pipes would keep the reads below
    # waiting for ever.
    tree = proctree.tree(p.pid)
    native = native_stacks(tree)
    _signal(p, signal.SIGABRT, own_group)  # the command (and its workers) dump their stacks
    _kill_all(tree, signal.SIGABRT)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        _signal(p, signal.SIGKILL, own_group)
        _kill_all(tree, signal.SIGKILL)
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a process outside the tree still holds a pipe
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()
            out = err = "(the output could not be read: a process outside its tree holds the pipes)"
    pytest.fail(f"HANG: {p.args!r} had not exited after {bound_s:.0f} s (a hang bound: 10x its quiet time "
                f"times CKPT_TIMEOUT_SCALE={scale():g}); its processes' stacks follow its output.\n"
                f"--- stdout ---\n{out}\n--- stderr (stacks at the end) ---\n{err}\n"
                f"--- native stacks (py-spy dump --native, before the SIGABRT) ---\n{native}", pytrace=False)


def native_stacks(pids: Sequence[int]) -> str:
    """``py-spy dump --native`` of each process (every thread's C and Python frames), or why not."""
    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if spy is None:
        return "(py-spy is not installed: only faulthandler's Python stacks)"
    out = []
    for q in pids:
        try:
            cmdline = Path(f"/proc/{q}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:300]
        except OSError:
            continue
        try:
            r = subprocess.run([spy, "dump", "--native", "--pid", str(q)], capture_output=True, text=True,
                               timeout=60)  # a bound on the dump itself; the hang is already called
            dump = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            dump = "(py-spy did not finish in 60 s)"
        out.append(f"==== pid {q}: {cmdline}\n{dump}")
    return "\n".join(out)


def _kill_all(pids: list[int], sig: int) -> None:
    for q in pids:
        try:
            os.kill(q, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _signal(p: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        os.killpg(p.pid, sig) if group else p.send_signal(sig)
    except ProcessLookupError:
        pass


def run(cmd: Sequence[str] | str, *, bound_s: float, input: str | bytes | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kw)`` (stdout and stderr captured, as text unless ``text`` or
    ``encoding`` is given; ``check=True`` raises ``CalledProcessError`` as there), failing the test with every
    process's stacks if it has not exited after ``bound_s`` (already a hang bound: pass :func:`hang_s`)."""
    check = kw.pop("check", False)
    kw.pop("capture_output", None)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    if "text" not in kw and "universal_newlines" not in kw and "encoding" not in kw:
        kw["text"] = True
    p = popen(cmd, stdin=subprocess.PIPE if input is not None else None, **kw)
    try:
        out, err = communicate(p, bound_s=bound_s, input=input)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    if check and p.returncode:
        raise subprocess.CalledProcessError(p.returncode, p.args, out, err)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
