"""Hang detection for the tests: a bound only catches a hang, it never judges speed.

- :func:`hang_s`: the bound for a wait that takes ``quiet_s`` on a quiet machine (at least
  10x it), times ``CKPT_TIMEOUT_SCALE`` (``replay.watchdog.hang_bound``);
- :func:`run`: ``subprocess.run`` whose bound, when it expires, makes the child's whole
  process group dump its Python stacks (``PYTHONFAULTHANDLER`` + SIGABRT) and then fails
  the test naming the hang, with everything the command printed;
- tests/conftest.py scales every pytest-timeout bound (the ini default and each
  ``@pytest.mark.timeout``) by the same knob.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any, Sequence

import pytest

from replay.watchdog import hang_bound


def scale() -> float:
    from ckpt.knobs import knobs

    return knobs().timeout_scale


def hang_s(quiet_s: float, *, floor_s: float = 60.0) -> float:
    """Seconds after which a wait of ``quiet_s`` (quiet machine) is a hang."""
    return hang_bound(quiet_s, floor_s=floor_s)


def run(cmd: Sequence[str] | str, *, bound_s: float, input: str | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kw)`` (output captured as text unless ``stdout`` is given),
    failing the test with every process's stacks if it has not exited after ``bound_s``
    (already a hang bound: pass :func:`hang_s`)."""
    kw.setdefault("text", True)
    kw.pop("capture_output", None)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    env = dict(kw.pop("env", None) or os.environ)
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT dumps every thread's stacks (workers inherit it)
    p = subprocess.Popen(cmd, env=env, start_new_session=True,
                         stdin=subprocess.PIPE if input is not None else None, **kw)
    try:
        out, err = p.communicate(input, timeout=bound_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGABRT)  # the command and its workers dump their stacks
        except ProcessLookupError:
            pass
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        pytest.fail(f"HANG: {cmd!r} had not exited after {bound_s:.0f} s (a hang bound: 10x its quiet time "
                    f"times CKPT_TIMEOUT_SCALE={scale():g}); its processes' stacks follow its output.\n"
                    f"--- stdout ---\n{out}\n--- stderr (stacks at the end) ---\n{err}", pytrace=False)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)
