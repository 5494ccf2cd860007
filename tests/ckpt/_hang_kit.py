"""Run a training script in a fresh process under a hang detector; make a git checkout.

A hang is detected, never timed: the script arms ``faulthandler.dump_traceback_later``
with a generous bound (far above a healthy run on a loaded machine); on expiry it dumps
every thread's stack and exits, and the test fails naming the hang and showing them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
import hangs

ROOT = Path(__file__).resolve().parents[2]

#: seconds before a run is declared hung: a detector, not a speed requirement
HANG_BOUND_S = hangs.hang_s(42)

PRELUDE = f"""\
import faulthandler, sys
faulthandler.dump_traceback_later({HANG_BOUND_S:.0f}, exit=True)
sys.path.insert(0, {str(ROOT)!r})
"""


def run_script(script: Path, *args: str, cwd: Path) -> str:
    """Run ``script`` (which starts with ``PRELUDE``); return its output, or fail naming
    a hang (with every thread's stack) or the error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # the outer bound catches a child whose in-process detector did not even fire
    p = hangs.run([sys.executable, str(script), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                  stderr=subprocess.STDOUT, text=False, bound_s=HANG_BOUND_S + hangs.hang_s(12))
    out = p.stdout.decode(errors="replace")
    if "Timeout (" in out and "most recent call first" in out:
        raise AssertionError(f"HUNG: {script.name} made no progress for {HANG_BOUND_S:.0f} s; every thread's stack:\n"
                             + out[-12000:])
    assert p.returncode == 0, f"{script.name} failed (rc {p.returncode}):\n{out[-6000:]}"
    return out


def git_checkout(path: Path) -> str:
    """A git repository at ``path`` with one commit; returns its HEAD SHA."""
    path.mkdir(parents=True, exist_ok=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=path, check=True)
    (path / "README").write_text("a training repo\n")
    subprocess.run([*git, "add", "README"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], cwd=path, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, check=True, capture_output=True).stdout.decode().strip()
