"""``ckpt demo stages --quick``: the one end-to-end process test of the pipeline run (the
README's own run of it, shared: tests/e2e/test_readme.py compares what it printed).

Every worker is a process over gloo. The demo's claims are checked against what it left
behind: the per-process tapes and the job tape (``ckpt tape check``), the job tape's forced
replay through the real ``ckpt replay`` command, the snapshot, the recovery checkpoints
and the plot, never only against the printed text.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hangs import hang_s, run

ROOT = Path(__file__).resolve().parents[2]


def _ckpt(*args: str, quiet_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return run([sys.executable, "-m", "ckpt_cli", *args], cwd=ROOT, env=env, bound_s=hang_s(quiet_s))


# the first test to ask for the shared run pays for it (1-2.5 min on 2 busy cores)
# one worker runs every reader of the shared run (pytest-xdist), so it is paid for once
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.xdist_group("stages-quick")]


@pytest.fixture(scope="module")
def demo(shared_runs) -> tuple[Path, str]:
    """``ckpt demo stages --quick``: the very run the README shows (``shared=stages-quick``),
    run once per session (tests/conftest.py SHARED_RUNS); what it printed, stdout and stderr."""
    run = shared_runs.get("stages-quick")
    assert run.returncode == 0, run.output
    return run.path("/tmp/stages-demo"), run.output


def test_the_quick_demo_passes_and_its_claims_hold(demo: tuple[Path, str]) -> None:
    from replay import TapeReader
    from runs.stages.demo import demo_config

    out, text = demo
    assert text.rstrip().endswith("demo: all checks passed")
    cfg = demo_config(quick=True)
    run = out / "run"
    tapes = sorted((run / "tapes").glob("*.tape"))
    assert [t.stem for t in tapes] == sorted(cfg.actors)  # one tape per process
    evs = list(TapeReader(run / "run.tape").events())
    n = lambda kind: sum(1 for e in evs if e.kind.name == kind)  # noqa: E731
    m = re.search(r"(\d+) outages, (\d+) bypass events, (\d+) stalls, (\d+) recoveries", text)
    assert m and tuple(map(int, m.groups())) == (n("fault_injected"), n("bypass"), n("stage_stall"), n("stage_up"))
    assert n("fault_injected") >= 2 and n("stage_up") >= 1 and n("bypass") > 0
    assert re.search(r"of the 9 per-process tapes together: 0", text)
    assert (out / "stages-loss.png").stat().st_size > 10_000
    assert list((run / "snapshots").glob("step-*")) and list((run / "recovery").glob("r*"))


def test_the_tapes_check_clean_through_the_cli(demo: tuple[Path, str]) -> None:
    out, _ = demo
    run = out / "run"
    r = _ckpt("tape", "check", *map(str, sorted((run / "tapes").glob("*.tape"))))
    assert r.returncode == 0, r.stdout + r.stderr
    r = _ckpt("tape", "check", str(run / "run.tape"))
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_quick_demos_tape_force_replays_identically(demo: tuple[Path, str]) -> None:
    out, _ = demo
    r = _ckpt("replay", str(out / "run" / "run.tape"), "--mode", "force", "--trust")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "IDENTICAL:" in r.stdout and "events matched the tape (force mode)" in r.stdout
