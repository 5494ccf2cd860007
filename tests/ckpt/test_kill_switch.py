"""The harnesses' kill switch and verdict model (ckpt/testing): a production ledger holds no
kill logic; the switch the harness installs kills right after the step; one exit-code table."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from ckpt.ledger import read_ledger_dir
from ckpt.testing import EXIT_CODES, CommandCheck, ResumeCheckResult, Verdict, kill_env
from ckpt.testing.kill_switch import SITE_DIR
import hangs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = textwrap.dedent(
    """
    from ckpt.ledger import Ledger
    led = Ledger("led", verify="off")
    for step in range(1, 6):
        led.step(step, loss=float(step))
    led.close()
    print("finished")
    """
)


def _run(cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return hangs.run([sys.executable, "-c", SCRIPT], cwd=cwd, env=env, capture_output=True, text=True,
                     bound_s=hangs.hang_s(12))


def _steps(cwd: Path) -> list[int]:
    tapes, problems = read_ledger_dir(str(cwd / "led"))
    assert not problems
    return [s.step for t in tapes for s in t.steps]


@pytest.mark.slow
def test_the_installed_switch_kills_right_after_the_step_and_the_bare_variable_does_nothing(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_LEDGER_")}
    base["PYTHONPATH"] = ROOT
    # a sitecustomize the switch's own shadows: it still runs
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('the other sitecustomize ran', flush=True)\n")
    base["PYTHONPATH"] += os.pathsep + str(other)
    (tmp_path / "a").mkdir()
    killed = _run(tmp_path / "a", {**base, **kill_env(3, base)})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout == "the other sitecustomize ran\n" and killed.stderr == ""
    assert _steps(tmp_path / "a") == [1, 2, 3]  # the step's record is durable, nothing after it
    # the variable alone, as a production run would see it: no switch, no kill
    (tmp_path / "b").mkdir()
    plain = _run(tmp_path / "b", {**base, "CKPT_LEDGER_KILL_AT": "3"})
    assert plain.returncode == 0 and "finished" in plain.stdout, plain.stderr
    assert _steps(tmp_path / "b") == [1, 2, 3, 4, 5]


def test_kill_env_puts_the_site_directory_first_once() -> None:
    env = kill_env(7, {"PYTHONPATH": os.pathsep.join([SITE_DIR, "/x"])})
    assert env == {"CKPT_LEDGER_KILL_AT": "7", "PYTHONPATH": os.pathsep.join([SITE_DIR, "/x"])}
    assert kill_env(2, {})["PYTHONPATH"] == SITE_DIR
    with pytest.raises(ValueError):
        kill_env(0)


def test_one_verdict_model_and_one_exit_code_table_for_both_harnesses() -> None:
    assert EXIT_CODES == {Verdict.IDENTICAL: 0, Verdict.DIFFERENT: 6, Verdict.REFUSED: 6, Verdict.NO_CLAIM: 2}
    for v in Verdict:
        assert CommandCheck(v, ()).exit_code == EXIT_CODES[v] and CommandCheck(v, ()).passed == (v is Verdict.IDENTICAL)

    def entry(identical: bool, refused: tuple[str, ...]) -> ResumeCheckResult:
        return ResumeCheckResult("m:f", 4, (2,), 1, identical, refused, (), (), 4, 0, "")

    assert entry(True, ()).verdict is Verdict.IDENTICAL and entry(True, ()).exit_code == 0
    assert entry(False, ()).verdict is Verdict.DIFFERENT and entry(False, ()).exit_code == 6
    refused = entry(False, ("world_size 2 -> 1",))
    assert refused.verdict is Verdict.REFUSED and refused.exit_code == 6
    assert refused.summary().endswith("REFUSED: no exactness claim is made (see the reasons above)")


def test_the_old_module_names_resolve_with_a_warning() -> None:
    import importlib

    for old, new, name in (("ckpt.resume_check", "ckpt.testing.resume_entry", "check_resume"),
                           ("ckpt.ledger.check", "ckpt.testing.resume_command", "check_command")):
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=rf"{old} moved to ckpt\.testing"):
            mod = importlib.import_module(old)
        assert getattr(mod, name) is getattr(importlib.import_module(new), name)
    import ckpt.ledger

    with pytest.warns(DeprecationWarning, match="ENV_KILL_AT moved"):
        assert ckpt.ledger.ENV_KILL_AT == "CKPT_LEDGER_KILL_AT"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "ENV_KILL_AT" not in ckpt.ledger.__all__


COMMAND = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[2])  # the repository: found under python -E too
    import torch
    import ckpt
    from ckpt.ledger import Ledger
    run = sys.argv[1]
    led = Ledger(os.path.join(run, "ledger"), verify="off")
    for step in range(1, 7):
        if step == 3:
            ckpt.save(os.path.join(run, "ckpt"), {"w": torch.zeros(2)}, step=3, overwrite=True, ledger=False)
        led.step(step, loss=float(step))
    led.close()
    """
)


@pytest.mark.slow
def test_check_command_kills_through_the_switch_and_names_a_python_that_skips_it(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt.testing import check_command

    script = tmp_path / "train.py"
    script.write_text(COMMAND)
    monkeypatch.setenv("PYTHONPATH", ROOT)
    # killed at step 4 as told; this script never resumes, so the check claims nothing for that reason
    res = check_command([sys.executable, str(script), "{run}", ROOT], kill_at=[4], work=str(tmp_path / "w1"))
    assert res.verdict is Verdict.NO_CLAIM and res.exit_code == 2
    assert "no attempt resumed from a checkpoint" in res.text, res.text
    # python -E ignores PYTHONPATH, so the switch is never installed: said so, not passed off as a result
    res = check_command([sys.executable, "-E", str(script), "{run}", ROOT], kill_at=[4], work=str(tmp_path / "w2"))
    assert res.verdict is Verdict.NO_CLAIM and "exited with status 0 instead" in res.text
    assert "-E, -I or -S" in res.text
