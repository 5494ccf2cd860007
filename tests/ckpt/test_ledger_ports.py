"""Fresh-process proofs of the step ledger on a common-style GPT script (docs/examples/tiny_gpt.py).

Each run is a real interpreter; the first is SIGKILLed right after step 9 by the
ledger's own environment instruction, the second resumes from the checkpoint of step 6.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

import ckpt
from ckpt.testing import kill_env
import hangs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "docs", "examples", "tiny_gpt.py")
STEPS = ["--steps", "12", "--eval-interval", "6"]


def _run(cwd, *flags, kill_at=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_LEDGER_")}
    env["PYTHONPATH"] = ROOT
    if kill_at is not None:
        env.update(kill_env(kill_at, env))  # the harness's kill switch, as check-resume installs it
    return hangs.run([sys.executable, SCRIPT, "--out", "run", *STEPS, *flags], cwd=cwd, env=env,
                     capture_output=True, text=True, bound_s=hangs.hang_s(30))


def _tensors(path):
    r = ckpt.open(path)
    return {t.key: r.tensor(t.key) for p in r.parts for t in p.tensors}


def _check_resume(tmp_path, *flags):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_LEDGER_")}
    env["PYTHONPATH"] = ROOT
    return hangs.run([sys.executable, "-m", "ckpt_cli", "check-resume", "--kill-at", "9", "--work-dir",
                           str(tmp_path), "--", sys.executable, SCRIPT, "--out", "{run}/run", *STEPS, *flags],
                     cwd=ROOT, env=env, capture_output=True, text=True, bound_s=hangs.hang_s(60))


def _checks(run_dir):
    tapes, problems = ckpt.ledger.read_ledger_dir(str(run_dir / "run" / "ledger"))
    assert not problems
    return [c for t in tapes for c in t.checks]


@pytest.mark.slow
def test_naive_port_is_caught_at_the_first_resumed_step_naming_the_batch(tmp_path):
    """check-resume -- python script.py: DIFFERENT with the cause; the resumed process's own
    verification (warn policy) named the batch at the first resumed step, on its tape."""
    res = _check_resume(tmp_path)
    assert res.returncode == 6, res.stdout + res.stderr
    assert res.stdout.rstrip().endswith("DIFFERENT")
    # both faults of the naive port are named: the lost prefetched batch and the evaluation re-run
    assert "likely cause: the batch and RNG stream(s) torch_cpu differ" in res.stdout
    assert "the data position was not captured (a batch prefetched" in res.stdout
    assert "ckpt.rng.isolated()" in res.stdout
    (check,) = _checks(tmp_path / "resumed")
    assert check.verdict == "diverged" and check.first == 7
    assert check.report.startswith("resume diverged at step 7 (first compared step 7): batch differs")
    log = (tmp_path / "resumed.log").read_text()
    assert "ResumeVerificationWarning: resume diverged at step 7" in log


@pytest.mark.slow
def test_evaluation_outside_isolated_is_named_as_the_cause(tmp_path):
    first = _run(tmp_path, "--save-batch", kill_at=9)
    assert first.returncode == -signal.SIGKILL, first.stderr
    out = _run(tmp_path, "--save-batch")
    assert out.returncode == 0, out.stderr
    assert "resume diverged at step 7 (first compared step 7): RNG stream torch_cpu differs" in out.stdout
    assert "batch differs" not in out.stdout
    assert "an evaluation or sampling run again on resume?" in out.stdout
    assert "ckpt.rng.isolated()" in out.stdout


@pytest.mark.slow
def test_correct_port_verifies_and_is_bit_identical(tmp_path):
    """check-resume -- python script.py says IDENTICAL; checked again here with torch.equal."""
    res = _check_resume(tmp_path, "--save-batch", "--isolate-eval")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.rstrip().endswith("IDENTICAL")
    assert "checkpoint run/ckpt: identical" in res.stdout
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    (check,) = _checks(resumed)
    assert check.report == (
        "resume verified exact over steps 7..9: 3 re-run steps matched; state used only later, such as a best-so-far "
        "metric, is not covered; unused, not compared: rng numpy, python")
    a, b = _tensors(str(straight / "run" / "ckpt")), _tensors(str(resumed / "run" / "ckpt"))
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra = ckpt.open(str(straight / "run" / "ckpt")).context()["rng"]
    rb = ckpt.open(str(resumed / "run" / "ckpt")).context()["rng"]
    assert ra["torch_cpu"] == rb["torch_cpu"]
    ha = {s.step: s for t in ckpt.ledger.read_ledger_dir(str(straight / "run" / "ledger"))[0] for s in t.steps}
    hb = {s.step: s for t in ckpt.ledger.read_ledger_dir(str(resumed / "run" / "ledger"))[0] for s in t.steps}
    assert sorted(ha) == sorted(hb) == list(range(1, 13))
    assert all(ha[s].batch == hb[s].batch and ha[s].loss == hb[s].loss and ha[s].params == hb[s].params for s in ha)


NO_CHECKPOINT = """
import os, sys, torch, ckpt
led = ckpt.ledger.Ledger(os.path.join(sys.argv[1], "ledger"))
for step in range(1, 13):
    led.step(step, batch=torch.randn(2), loss=0.5)
led.close()
"""

NO_LEDGER = """
import os, sys, torch, ckpt
ckpt.save(os.path.join(sys.argv[1], "ckpt"), {"w": torch.zeros(2)}, step=1)  # no optimizer step: no tape
"""


@pytest.mark.slow
@pytest.mark.parametrize("body, said", [(NO_CHECKPOINT, "never reached a checkpoint"), (NO_LEDGER, "no step ledger")])
def test_check_resume_command_makes_no_claim(tmp_path, body, said):
    script = tmp_path / "s.py"
    script.write_text(body)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_LEDGER_")}
    env["PYTHONPATH"] = ROOT
    res = hangs.run([sys.executable, "-m", "ckpt_cli", "check-resume", "--work-dir", str(tmp_path / "w"), "--",
                          sys.executable, str(script), "{run}"], cwd=ROOT, env=env, capture_output=True, text=True,
                    bound_s=hangs.hang_s(30))
    assert res.returncode == 2, res.stdout + res.stderr
    assert said in res.stdout and res.stdout.rstrip().endswith("NO CLAIM")
