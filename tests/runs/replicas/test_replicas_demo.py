"""``ckpt demo replicas --quick``: what it prints holds against the tapes it left behind.

The run is the README's own (``shared=replicas-quick``: tests/e2e/test_readme.py compares
what it printed line by line), run once per session by tests/conftest.py; this file adds
the checks a printout cannot make: every scenario's tape checks clean, its kills, joins,
SDC verdicts and the rollback are on the tape as printed, and the plot was written.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torchft")

import replay  # noqa: E402
from replay import TapeReader  # noqa: E402

# the first test to ask for the shared run pays for it (1-2 min on 2 busy cores)
# one worker runs every reader of the shared run (pytest-xdist), so it is paid for once
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.xdist_group("replicas-quick")]

SCENARIOS = ("nofault", "replace", "shrink", "sdc", "spike", "spike-ref")


@pytest.fixture(scope="module")
def demo(shared_runs) -> tuple[Path, str]:
    run = shared_runs.get("replicas-quick")
    assert run.returncode == 0, run.output
    return run.path("/tmp/replicas-demo"), run.output


def _events(out: Path, name: str) -> list:
    return list(TapeReader(out / name / "run.tape").events())


def test_every_scenario_recorded_checked_and_replayed(demo: tuple[Path, str]) -> None:
    out, text = demo
    assert text.rstrip().endswith("demo: all checks passed")
    for name in SCENARIOS:
        assert replay.check_tape(out / name / "run.tape") == [], name
        m = re.search(rf"^\[{re.escape(name)}\] recorded .* force replay: IDENTICAL \((\d+) events", text, re.M)
        assert m, (name, text)
        assert int(m.group(1)) <= len(_events(out, name))
    assert (out / "replicas-loss.png").stat().st_size > 10_000


def test_the_printed_faults_are_the_taped_ones(demo: tuple[Path, str]) -> None:
    out, text = demo
    for name, dead in (("replace", "g2"), ("shrink", "g1")):
        evs = _events(out, name)
        moved = [e for e in evs if e.kind.name == "data_reassign"]
        assert moved and all(e.payload["lost"] == [dead] for e in moved)
        m = re.search(rf"^\[{name}\] step (\d+): the attempt {dead} died in was not committed", text, re.M)
        assert m and int(m.group(1)) == moved[0].step
    joined = [e for e in _events(out, "replace") if e.kind.name == "recovery_loaded" and e.actor == "g3.0"]
    m = re.search(r"g3\.0 joined at step (\d+) and recovered from live peer (\S+) \(checkpoint stream ([0-9a-f]+)", text)
    assert joined and m and (joined[0].step, joined[0].payload["source"]) == (int(m.group(1)), m.group(2))
    assert joined[0].payload["stream"].hex().startswith(m.group(3))
    bad = {(e.step, e.payload["check"], tuple(e.payload["odd"])) for e in _events(out, "sdc")
           if e.kind.name == "sdc_verdict" and not e.payload["ok"]}
    assert {(4, "reexec", ("g2.0",)), (7, "cross-replica", ("g1",))} <= bad
    rollbacks = [e for e in _events(out, "spike") if e.kind.name == "rollback"]
    m = re.search(r"every replica rolled back to (step-\d+)", text)
    assert m and rollbacks and {e.payload["ckpt_name"] for e in rollbacks} == {m.group(1)}
    assert not [e for e in _events(out, "spike-ref") if e.kind.name in ("spike", "rollback")]
