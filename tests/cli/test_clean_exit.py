"""A failed command that leaves a daemon thread blocked (a replay's rank stuck in a
collective) ends at once with its own exit code and everything it printed: the
interpreter is not finalized under the live thread (that aborted with "terminate called
without an active exception" and exit 134 when the thread sat in gloo)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hangs import hang_s, run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # interpreters in subprocesses: `make check` leaves them out

_CHILD = """
import atexit, sys, threading
from ckpt_cli.main import main
threading.Thread(target=threading.Event().wait, name="rank-in-a-collective", daemon=True).start()
atexit.register(lambda: print("finalized under a live thread", flush=True))
print("before", flush=True)
main(sys.argv[1:])
"""


def _child(*args: str):
    return run([sys.executable, "-c", _CHILD, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
               bound_s=hang_s(5.0))


def test_a_failure_with_a_stranded_thread_exits_with_its_code_without_finalizing(tmp_path: Path) -> None:
    p = _child("inspect", str(tmp_path / "missing"))
    assert p.returncode == 5, p.stdout + p.stderr  # EXIT_NOT_FOUND, the command's own code
    assert p.stdout == "before\n" and "error:" in p.stderr and "missing" in p.stderr
    assert "terminate called" not in p.stderr


def test_a_success_finalizes_as_usual(tmp_path: Path) -> None:
    p = _child("--version")
    assert p.returncode == 0 and "finalized under a live thread" in p.stdout
