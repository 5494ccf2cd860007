"""The default step ledger of ckpt.save / ckpt.load (ckpt.ledger.auto), and the verdicts
and causes every ledger gives (issue 23).

The acceptance pair runs tests/ckpt/scripts/gpt_port.py, a GPT script of the common
single-file style, in real interpreters: the first process is SIGKILLed after step 10,
the second resumes from the checkpoint of step 8 with ``--init_from=resume``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import warnings

import pytest
import torch

import ckpt
from ckpt.knobs import override
from ckpt.ledger import LedgerStep, ResumeVerificationWarning, compare_runs, read_ledger_dir
from ckpt.ledger import auto
from ckpt.ledger.compare import likely_cause, compare_step
from ckpt.ledger.ledger import ResumeVerified
from ckpt.testing import kill_env
import hangs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "ckpt", "scripts", "gpt_port.py")


def _data(cwd):
    os.makedirs(cwd / "data", exist_ok=True)
    rnd = random.Random(0)
    (cwd / "data" / "input.txt").write_text("".join(rnd.choice("abcdefghij klmnop\n") for _ in range(5000)))


def _run(cwd, *flags, kill_at=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_LEDGER_", "CKPT_AUTO_LEDGER"))}
    env["PYTHONPATH"] = ROOT
    if kill_at is not None:
        env.update(kill_env(kill_at, env))  # the harness's kill switch, as check-resume installs it
    return hangs.run([sys.executable, SCRIPT, "--out_dir=out", *flags], cwd=cwd, env=env, capture_output=True,
                     text=True, bound_s=hangs.hang_s(30))


def _kill_and_resume(tmp_path, port):
    _data(tmp_path)
    first = _run(tmp_path, f"--port={port}", kill_at=10)
    assert first.returncode == -signal.SIGKILL, first.stderr
    assert first.stderr == ""  # a fresh run has nothing to verify and says nothing
    second = _run(tmp_path, f"--port={port}", "--init_from=resume")
    assert second.returncode == 0, second.stderr
    return second


@pytest.mark.slow
def test_quick_start_swap_is_caught_at_its_first_resume_naming_the_cause(tmp_path):
    """torch.save/torch.load -> ckpt.save/ckpt.load and nothing else: DIFFERENT at the first
    re-run step, the cause named: the stream moved between the load and that step."""
    out = _kill_and_resume(tmp_path, "swap")
    lines = out.stderr.splitlines()
    assert lines[0] == ("ckpt.ledger:0: ResumeVerificationWarning: resume diverged at step 9 (first compared step 9): "
                        "RNG stream torch_cpu differs before the optimizer step; RNG stream torch_cpu differs; "
                        "parameters differ after the step (sampled)")
    assert lines[1].startswith("  likely cause: RNG stream(s) torch_cpu moved between the resume (the load restored "
                               "it at step 8) and step 9, and not as the first run's moved between its save and step 9")
    assert "a batch drawn after ckpt.load" in lines[1] and "an evaluation run again on resume?" in lines[1]
    assert "while the batch is equal" not in out.stderr  # no batch was recorded: none is claimed equal
    tapes, problems = read_ledger_dir(str(tmp_path / "out" / "ledger"))
    assert not problems and [c.verdict for t in tapes for c in t.checks] == ["diverged"]


@pytest.mark.slow
def test_guided_port_is_verified_exact_and_is_bit_identical(tmp_path):
    out = _kill_and_resume(tmp_path, "guided")
    assert out.stderr.splitlines() == [
        "ckpt.ledger:0: ResumeVerified: resume verified exact over steps 9..10: 2 re-run steps matched; state used "
        "only later, such as a best-so-far metric, is not covered; unused, not compared: rng numpy, python"]
    straight = tmp_path / "straight"
    straight.mkdir()
    _data(straight)
    ref = _run(straight, "--port=guided")
    assert ref.returncode == 0 and ref.stdout == out.stdout  # the final loss, printed to 6 digits
    a, b = ckpt.open(str(straight / "out" / "ckpt")), ckpt.open(str(tmp_path / "out" / "ckpt"))
    keys = [t.key for p in a.parts for t in p.tensors]
    assert keys and all(torch.equal(a.tensor(k), b.tensor(k)) for k in keys)
    assert a.context()["rng"]["torch_cpu"] == b.context()["rng"]["torch_cpu"]


# -- in-process runs: one "process" per auto.reset() -----------------------------------------
def _model():
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def _steps(m, opt, n, *, lr=None, draw=0):
    for _ in range(n):
        torch.randn(draw) if draw else None
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
        x = torch.randn(3, 4)
        m(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _first_run(tmp_path, *, steps_after=3, lr=None):
    m, opt = _model()
    _steps(m, opt, 2)
    ckpt.save(tmp_path / "ckpt", {"model": m, "optim": opt}, step=2)
    _steps(m, opt, steps_after, lr=lr)
    auto.reset()  # the process died here (its tape has no close record: as after a kill)


def _resume(tmp_path, **load):
    m, opt = _model()
    r = ckpt.load(tmp_path / "ckpt", {"model": m, "optim": opt}, **load)
    return m, opt, r


def test_in_process_resume_is_verified_and_the_line_is_filterable(tmp_path):
    _first_run(tmp_path)
    m, opt, _ = _resume(tmp_path)
    with pytest.warns(ResumeVerified, match=r"^resume verified exact over steps 3\.\.5: 3 re-run steps matched; "
                                            r"state used only later, such as a best-so-far metric, is not covered"):
        _steps(m, opt, 3)
    auto.reset()
    m, opt, _ = _resume(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=ckpt.ledger.ResumeNotice)  # the documented filter
        _steps(m, opt, 3)


def test_a_learning_rate_outside_the_checkpoint_is_named(tmp_path):
    _first_run(tmp_path, lr=0.05)  # the script set lr after the save; the resumed one does not
    m, opt, _ = _resume(tmp_path)
    with pytest.warns(ResumeVerificationWarning) as w:
        _steps(m, opt, 3)
    text = str(w[0].message)
    assert "resume diverged at step 3" in text and "param_groups[0].lr differs (0.05 vs 0.1)" in text
    assert "the logged value param_groups[0].lr differ" in text
    assert "nondeterministic" not in text


def test_killed_right_after_a_checkpoint_says_not_verified_loudly(tmp_path):
    _first_run(tmp_path, steps_after=0)
    (tmp_path / "ledger").mkdir(exist_ok=True)
    m, opt, _ = _resume(tmp_path)
    with pytest.warns(ResumeVerificationWarning, match="^resume not verified: (no steps to compare|no ledger in)"):
        _steps(m, opt, 1)


def test_rng_held_back_and_never_restored_is_named_at_the_first_step(tmp_path):
    _first_run(tmp_path)
    m, opt, r = _resume(tmp_path, restore_rng=False)
    with pytest.warns(ResumeVerificationWarning) as w:
        _steps(m, opt, 3)
    texts = [str(x.message) for x in w]
    assert texts[0] == ("resume at step 2: the RNG streams were held back (ckpt.load(..., restore_rng=False)) and "
                        "never restored before step 3: restore them with ckpt.rng.restore_rng(result.context['rng']) "
                        "before the first step")
    assert "likely cause: the RNG streams were held back" in texts[1]
    auto.reset()
    _first_run(tmp_path / "b")  # the diverged resume above is now the newest record of steps 3..5
    m, opt, r = _resume(tmp_path / "b", restore_rng=False)
    ckpt.rng.restore_rng(r.context["rng"])  # the deferred restore: verified exact
    with pytest.warns(ResumeVerified):
        _steps(m, opt, 3)


def test_a_load_no_step_follows_writes_and_says_nothing(tmp_path):
    m, opt = _model()
    ckpt.save(tmp_path / "ckpt", {"model": m, "optim": opt})
    auto.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _resume(tmp_path)
        auto.reset()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_off_switches(tmp_path):
    m, opt = _model()
    ckpt.save(tmp_path / "a" / "ckpt", {"model": m, "optim": opt}, ledger=False)
    _steps(m, opt, 2)
    assert not (tmp_path / "a" / "ledger").exists() and "ledger" not in ckpt.open(str(tmp_path / "a" / "ckpt")).manifest.meta
    with override(auto_ledger=0):
        ckpt.save(tmp_path / "b" / "ckpt", {"model": m, "optim": opt})
        _steps(m, opt, 2)
    assert not (tmp_path / "b" / "ledger").exists()
    ckpt.save(tmp_path / "c" / "ckpt", {"model": m, "optim": opt})
    _steps(m, opt, 2)
    assert (tmp_path / "c" / "ledger").is_dir()
    assert ckpt.open(str(tmp_path / "c" / "ckpt")).manifest.meta["ledger"]["step"] == 4  # AdamW's own count


def test_a_ledger_of_the_scripts_own_makes_the_default_one_stand_down(tmp_path):
    m, opt = _model()
    ckpt.ledger.Ledger(tmp_path / "mine")
    ckpt.save(tmp_path / "ckpt", {"model": m, "optim": opt})
    _steps(m, opt, 2)
    assert not (tmp_path / "ledger").exists() and auto.active() is None


def test_manager_defer_rng_never_restored_is_named_and_values_are_compared(tmp_path):
    def run(stop=None, *, defer=False, restore=True, lr_bug=False):
        m, opt = _model()
        with ckpt.CheckpointManager(tmp_path / "run", {"model": m, "optim": opt}, every_steps=2,
                                    signals=()) as mgr:
            mgr.resume(defer_rng=defer) if defer else mgr.resume()
            if defer and restore:
                mgr.restore_rng()
            lr = 0.1 if not (lr_bug and mgr.start_step) else 0.2
            for step in range(mgr.start_step + 1, 7):
                _steps(m, opt, 1, draw=1)
                mgr.after_step(step, values={"lr": lr})
                if step == stop:
                    mgr.ledger._writer = None  # the process dies: no close, no verdict
                    return mgr
        return mgr

    run(stop=5)
    with pytest.warns(ResumeVerificationWarning) as w:
        run(defer=True, restore=False)
    texts = [str(x.message) for x in w]
    assert texts[0].startswith("resume at step 4: the RNG streams were held back (resume(defer_rng=True)) and never "
                               "restored before step 5: call restore_rng()")
    assert any("likely cause: the RNG streams were held back at the resume (resume(defer_rng=True))" in t
               for t in texts), texts
    import shutil

    shutil.rmtree(tmp_path / "run")
    run(stop=5)
    with pytest.warns(ResumeVerificationWarning) as w:
        run(lr_bug=True)
    (text,) = [str(x.message) for x in w]
    assert "lr differs (0.1 vs 0.2)" in text and "a value carried across steps that the checkpoint does not hold" in text


# -- the cause table without a process ---------------------------------------------------------
D = bytes(16)


def _st(step, *, rng=0, loss=1.0, params=None, batch=None, values=()):
    return LedgerStep(step, (("torch_cpu", bytes([rng]) * 16),), batch, loss, params, values)


def test_without_a_batch_no_batch_is_claimed_equal():
    d = compare_step(_st(5), _st(5, rng=3), None)
    assert not d.batch_compared
    cause = likely_cause(d)
    assert cause.startswith("RNG stream(s) torch_cpu differ: something drew from them") and "batch" not in cause


def test_loss_differs_names_state_not_held_unless_the_environment_differs():
    exp = {s: _st(s, params=b"\1" * 16 if s == 4 else None) for s in range(3, 7)}
    act = dict(exp)
    act[5] = _st(5, loss=2.0)
    rep = compare_runs(exp, act, expected_used={"torch_cpu"}, actual_used=set())
    assert rep.cause.startswith("the loss differs while the RNG streams are equal (the batch is not recorded), in the "
                                "same environment: state that the checkpoint does not hold (a variable carried across "
                                "steps: a recurrent hidden state, a learning rate outside the optimizer and scheduler, "
                                "a best-so-far metric)")
    assert "the parameter digests last agreed at step 4" in rep.cause and "nondeterministic" not in rep.cause
    rep = compare_runs(exp, act, expected_used={"torch_cpu"}, actual_used=set(), env_diffs=["torch: '2.12' -> '2.13'"])
    assert "in a different environment: a nondeterministic kernel or the environment difference (torch: '2.12' -> "
    "'2.13')" in rep.cause
    with_batch = {s: _st(s, batch=D) for s in (5,)}
    rep = compare_runs(with_batch, {5: _st(5, batch=D, loss=3.0)}, expected_used=set(), actual_used=set())
    assert rep.cause.startswith("the loss differs while batch and RNG streams are equal, in the same environment")


def test_values_round_trip_on_the_tape_and_a_differing_value_is_named(tmp_path):
    led = ckpt.ledger.Ledger(tmp_path / "ledger")
    led.step(1, loss=1.0, values={"lr": 5.0, "best": torch.tensor(0.25), "phase": "warm"})
    led.close()
    (tape,), _ = read_ledger_dir(str(tmp_path / "ledger"))
    assert tape.steps[0].values == (("best", 0.25), ("lr", 5.0), ("phase", "warm"))
    d = compare_step(tape.steps[0], _st(1, values=(("best", 0.25), ("lr", 20.0), ("phase", "warm"))), None)
    assert d.values == (("lr", 5.0, 20.0),) and "lr differs (5.0 vs 20.0)" in d.what()
    with pytest.raises(TypeError, match="ledger value 'x' must be a plain number"):
        led.step(2, values={"x": [1, 2]})


# -- ckpt check-resume -- COMMAND, in the user's directory -------------------------------------
def _check(cwd, *command, work):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_LEDGER_", "CKPT_CHECK_", "CKPT_AUTO"))}
    env["PYTHONPATH"] = ROOT
    return hangs.run([sys.executable, "-m", "ckpt_cli", "check-resume", "--kill-at", "10", "--work-dir", work,
                           "--", sys.executable, SCRIPT, *command], cwd=cwd, env=env, capture_output=True, text=True,
                     bound_s=hangs.hang_s(60))


@pytest.mark.slow
def test_check_resume_runs_the_script_where_it_lives_with_its_own_output_per_run(tmp_path):
    """The script reads data/input.txt relative to its working directory and resumes only
    when told (--init_from=resume): {run} and {resume} need no wrapper. The first check's
    work directory is relative (to where the check runs), the second's absolute (elsewhere):
    where it lies changes nothing but where the runs go."""
    _data(tmp_path)
    res = _check(tmp_path, "--out_dir={run}", "--init_from={resume}", "--port=guided", work="chk")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.rstrip().endswith("IDENTICAL")
    assert "checkpoint ckpt: identical (tensors and used RNG streams, bit for bit)" in res.stdout
    assert "resumed process said: resume verified exact over steps 9..10" in res.stdout
    assert (tmp_path / "chk" / "straight" / "ckpt").is_dir() and (tmp_path / "chk" / "resumed" / "ledger").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["chk", "data"]
    elsewhere = tmp_path / "elsewhere" / "chk"
    swap = _check(tmp_path, "--out_dir={run}", "--init_from={resume}", "--port=swap", work=str(elsewhere))
    assert swap.returncode == 6 and swap.stdout.rstrip().endswith("DIFFERENT"), swap.stdout + swap.stderr
    assert (elsewhere / "straight" / "ckpt").is_dir() and (elsewhere / "resumed" / "ledger").is_dir()
    assert sorted(os.listdir(tmp_path)) == ["chk", "data", "elsewhere"]
    assert "resumed process said: resume diverged at step 9 (first compared step 9): RNG stream torch_cpu differs " \
        "before the optimizer step" in swap.stdout
    # the runs' out_dir and init_from differ by design: said apart, never a difference of the state
    (state_line,) = [ln for ln in swap.stdout.splitlines() if ln.startswith("checkpoint ckpt: differs in ")]
    assert "rng" in state_line and "config" not in state_line
    assert "checkpoint ckpt: config differs in init_from, out_dir (not state" in swap.stdout


@pytest.mark.slow
def test_check_resume_refuses_a_run_whose_output_lands_outside_its_place(tmp_path):
    _data(tmp_path)
    res = _check(tmp_path, "--out_dir=" + str(tmp_path / "shared"), "--init_from={resume}", work="chk")
    assert res.returncode == 2 and res.stdout.rstrip().endswith("NO CLAIM"), res.stdout + res.stderr
    assert "the command has no {run}" in res.stdout
    assert f"this run's step ledger {tmp_path / 'shared' / 'ledger'}" in res.stdout
    assert f"is outside the attempt's run directory {tmp_path / 'chk' / 'straight'}" in res.stdout


# -- ckpt diff / inspect: plain values, and config apart from state ----------------------------
def test_diff_compares_plain_values_and_tells_config_from_state(tmp_path):
    from click.testing import CliRunner

    from ckpt_cli.main import cli

    m = torch.nn.Linear(2, 2)
    for name, lr, out in (("a", 5.0, "a"), ("b", 20.0, "a"), ("c", 5.0, "c")):
        ckpt.save(tmp_path / name, {"model": m, "lr": lr}, extra={"iter_num": 3}, config={"out_dir": out},
                  ledger=False)
    run = CliRunner().invoke
    r = run(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--ignore", "env", "--ignore", "commit"])
    assert r.exit_code == 6 and "  value lr: 5.0 -> 20.0" in r.output and r.output.endswith("different: values\n")
    r = run(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--ignore", "env", "--ignore", "commit"])
    assert r.exit_code == 8, r.output
    assert "keys out_dir" in r.output and r.output.endswith(
        "state identical; different: config (not the training state)\n")
    r = run(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--ignore", "env", "--ignore", "commit",
                  "--ignore", "lr"])
    assert r.exit_code == 0, r.output
    r = run(cli, ["inspect", str(tmp_path / "b")])
    assert r.exit_code == 0 and "  values       lr 20.0, extra.iter_num 3" in r.output
    r = run(cli, ["inspect", str(tmp_path / "b"), "--json"])
    assert '"values": {' in r.output and '"lr": 20.0' in r.output
