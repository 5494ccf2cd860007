"""``ckpt demo rollback``: its printed claims hold against the tapes and checkpoints it
left behind, and the recorded spike replays bit for bit through the real CLI."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_cli.main import cli

from hangs import hang_s, run

# a demo run: `make check` leaves it out; one worker runs every reader of the shared run
# (pytest-xdist), so it is paid for once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rollback-quick")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_demo(shared_runs) -> tuple[Path, str]:
    """``ckpt demo rollback --quick``, the run the README shows (``shared=rollback-quick``, run
    once per session by tests/conftest.py): its output directory and what it printed."""
    run = shared_runs.get("rollback-quick")
    assert run.returncode == 0, run.output
    return run.path("/tmp/rollback-demo"), run.output


def test_the_report_matches_the_tapes(quick_demo: tuple[Path, str]) -> None:
    from ckpt.ledger import read_ledger_dir
    from replay.tape import TapeReader

    out, text = quick_demo
    assert text.rstrip().endswith("demo: all checks passed")
    m = re.search(r"episode 1: robust_z at step (\d+): loss ([\d.]+), .* robust z ([\d.]+) > 6", text)
    assert m, text
    events = list(TapeReader(out / "spike.tape").events())
    [spike] = [e for e in events if e.kind.name == "spike"]
    [rollback] = [e for e in events if e.kind.name == "rollback"]
    assert spike.step == rollback.step == int(m.group(1)) and f"{spike.payload['value']:.4f}" == m.group(2)
    assert rollback.payload["to_step"] == 40 and rollback.payload["ckpt_name"] == "step-00000040"
    assert rollback.payload["edits"] == [{"epoch": 0, "steps": [40, 41], "action": "skip", "delay": 0}]
    [fault] = [e for e in events if e.kind.name == "fault_injected"]
    assert fault.payload["detail"] == [40, 41]
    routed = {(e.payload["layer"], e.payload["batch"]): e.payload["digest"] for e in events if e.kind.name == "routing"}
    replayed = {(e.payload["layer"], e.payload["batch"]): e.payload["digest"] for e in events
                if e.kind.name == "routing_replay"}
    assert len(routed) == 8 and replayed == routed
    # the no-spike tape has none of it; the ledger of the guarded run holds the same episode
    assert not [e for e in TapeReader(out / "clean.tape").events() if e.kind.code >= 48]
    [ledger], _ = read_ledger_dir(str(out / "run" / "ledger"))
    assert [type(g.record).__name__ for g in ledger.guard[:2]] == ["Verdict", "RollbackEvent"]
    assert ledger.guard[1].record.to_step == 40
    # the run's directory holds no checkpoint of the abandoned timeline
    names = sorted(p.name for p in (out / "run").iterdir() if p.name.startswith("step-"))
    assert names == ["step-00000030", "step-00000040"]  # keep_last=2; step 48 is not a save step
    tol = re.search(r"guarded ([\d.]+) \(([\d.]+)% off, tolerance 5%\)", text)
    assert tol and float(tol.group(2)) <= 5.0


def test_the_spike_replays_bit_for_bit_through_the_cli(quick_demo: tuple[Path, str]) -> None:
    out, _ = quick_demo
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = run([sys.executable, "-m", "ckpt_cli", "replay", str(out / "spike.tape"), "--mode", "force", "--trust"],
            cwd=str(out), env=env, bound_s=hang_s(60.0))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"IDENTICAL: \d+ events matched the tape \(force mode\)", r.stdout), r.stdout
    shown = run([sys.executable, "-m", "ckpt_cli", "tape", "show", str(out / "spike.tape"), "--kind", "rollback"],
                env=env, bound_s=hang_s(5.0))
    assert shown.returncode == 0 and "rollback" in shown.stdout and "step-00000040" in shown.stdout, shown.stdout


def test_a_verified_replay_matches_too(quick_demo: tuple[Path, str]) -> None:
    from replay import replay
    from runs.rollback.run import main

    out, _ = quick_demo
    res = replay(out / "spike.tape", mode="verify", entry=main)
    assert res.identical, res.format()
    assert [rb.step for rb in res.value.rollbacks] == [40]


def test_the_demo_is_listed() -> None:
    r = CliRunner().invoke(cli, ["demo", "--list"])
    assert r.exit_code == 0 and re.search(r"^rollback\s+loss-spike rollback on a tiny MoE", r.output, re.M), r.output


@pytest.mark.parametrize("quick", [True])
def test_a_second_run_into_the_same_directory_is_refused(quick_demo: tuple[Path, str], quick: bool) -> None:
    from runs.rollback.demo import main

    out, _ = quick_demo
    with pytest.raises(FileExistsError, match="spike.tape exists: pass an empty --out directory"):
        main(out, quick=quick, echo=lambda s: None)
