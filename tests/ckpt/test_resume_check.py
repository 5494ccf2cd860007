"""The resume-equivalence check on the tiny transformer: SIGKILL, resume, compare bits.

The entry (runs/basic/resume_tiny.py) has dropout, AdamW, a warmup-cosine schedule,
gradient accumulation, a shuffled loader with 2 workers and random augmentation. An
epoch is 8 optimizer steps; saves every 3 steps.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from ckpt.testing.resume_entry import ResumeCheckError, check_resume, compare_checkpoints, exactness_refusals
from ckpt.testing import Verdict, assert_resume_exact
import hangs

ENTRY = "runs.basic.resume_tiny:train"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_single_process_async_kills_on_a_save_step_and_mid_epoch(tmp_path):
    # 6: a save step, so the save of step 6 may be in flight when the process dies (its
    # temporary dir is removed on resume); the save of 3 has committed, because at most
    # one save is in flight. 10: mid-epoch of epoch 2, a step after the save of 9.
    res = assert_resume_exact(ENTRY, steps=12, kill_at=[6, 10], tmp_path=tmp_path)
    assert res.world_size == 1 and res.divergences == () and res.refused == ()
    assert [e.killed_at for e in res.resumes] == [6, 10, None]
    assert res.resumes[1].checkpoint in ("step-00000003", "step-00000006")
    assert res.resumes[2].checkpoint in ("step-00000006", "step-00000009")
    assert res.losses_compared >= 12 and res.tensors_compared > 50


def test_two_gloo_ranks_ddp_sync_kill_right_after_a_save(tmp_path):
    # Blocking saves make the resume point deterministic: killed at 4 and 7, the steps
    # right after the saves of 3 and 6.
    res = assert_resume_exact(ENTRY, steps=10, kill_at=[4, 7], world_size=2, async_save=False, tmp_path=tmp_path)
    assert [(e.checkpoint, e.killed_at) for e in res.resumes] == [(None, 4), ("step-00000003", 7), ("step-00000006", None)]


def test_cli_names_the_field_not_restored_and_exits_6(tmp_path):
    from ckpt_cli.main import cli

    out = CliRunner().invoke(
        cli,
        ["check-resume", "--entry", ENTRY, "--steps", "8", "--kill-at", "4", "--sync", "--option", "omit=sched", "--work-dir", str(tmp_path)],
    )
    assert out.exit_code == 6, out.output
    assert "attempt 1: resumed from step-00000003 (step 3), ran to the end" in out.output
    # The scheduler was left out of the checkpoint: named at the first step run after the resume.
    assert "first difference: resume, step 4, field 'sched', at 'sched/last_epoch'" in out.output
    assert "after resuming from step-00000003: 3 != 0" in out.output
    assert out.output.rstrip().endswith("DIFFERENT")


def test_changed_environment_refuses_the_claim(tmp_path):
    res = check_resume(
        ENTRY, steps=6, kill_at=[4], async_save=False, resume_env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, work_dir=str(tmp_path)
    )
    assert not res.identical
    assert res.divergences == ()  # bits agree here, but nothing licenses the claim
    assert "attempt 1 after resume: environment env.CUBLAS_WORKSPACE_CONFIG: None -> ':4096:8'" in res.refused
    assert "REFUSED" in res.summary() and res.verdict is Verdict.REFUSED and res.exit_code == 6


def test_world_size_change_is_refused():
    saved = {"env": {"torch": "2.13.0"}, "topology": {"world_size": 2}}
    now = {"env": {"torch": "2.13.0"}, "topology": {"world_size": 1}}
    assert exactness_refusals(saved, now) == ["world_size 2 -> 1: reduction order changes, numerics cannot be bit-identical"]
    assert exactness_refusals(saved, saved) == []


def test_compare_checkpoints_names_first_tensor_and_rng(tmp_path):
    import torch

    import ckpt

    torch.manual_seed(0)
    m = torch.nn.Linear(2, 2)
    ckpt.save(tmp_path / "a", {"model": m, "c": {"n": 1}})
    with torch.no_grad():
        m.bias[1] = -0.0 if m.bias[1] == 0 else m.bias[1] * 2
    torch.rand(1)
    ckpt.save(tmp_path / "b", {"model": m, "c": {"n": 1}})
    diffs, n = compare_checkpoints(ckpt.open(tmp_path / "a"), ckpt.open(tmp_path / "b"))
    assert n == 2
    assert diffs[0][:2] == ("model", "model/bias") and diffs[0][2].startswith("element 1: ")
    assert diffs[1] == ("rng.torch_cpu", None, "RNG stream 'torch_cpu' differs (not restored, or restored at the wrong moment)")
    same, _ = compare_checkpoints(ckpt.open(tmp_path / "a"), ckpt.open(tmp_path / "a"))
    assert same == []


def test_argument_errors_and_crashing_entry(tmp_path):
    with pytest.raises(ValueError, match="module:function"):
        check_resume("no_colon")
    with pytest.raises(ValueError, match=r"kill step 30 is outside 1\.\.6"):
        check_resume(ENTRY, steps=6, kill_at=[30])
    with pytest.raises(ResumeCheckError, match=r"(?s)attempt reference rank 0 exited with status 1.*No module named 'no_such_module_xyz'"):
        check_resume("no_such_module_xyz:train", steps=3, kill_at=[2], work_dir=str(tmp_path / "f"),
                     timeout=hangs.hang_s(6))
    with pytest.raises(ResumeCheckError, match=r"(?s)exited with status 1.*No module named 'no_such_module_xyz'"):
        check_resume("no_such_module_xyz:train", steps=3, kill_at=[2], work_dir=str(tmp_path / "e"),
                     timeout=hangs.hang_s(6), isolation="exec")
    with pytest.raises(ValueError, match="isolation must be"):
        check_resume(ENTRY, isolation="thread")


def test_cli_usage_errors():
    from ckpt_cli.main import cli

    r = CliRunner().invoke(cli, ["check-resume", "--entry", ENTRY, "--kill-at", "x"])
    assert r.exit_code == 2 and "'x' is not a step number" in r.output
    r = CliRunner().invoke(cli, ["check-resume", "--entry", ENTRY, "--option", "novalue"])
    assert r.exit_code == 2 and "'novalue' is not KEY=VALUE" in r.output
    r = CliRunner().invoke(cli, ["check-resume", "--help"])
    assert r.exit_code == 0 and "--kill-at" in r.output


def test_a_check_that_never_resumed_makes_no_claim(tmp_path):
    # Killed at step 1 with saves every 3 steps: no checkpoint exists, every attempt
    # starts fresh. The runs agree, but resuming was not tested, so it must not pass.
    res = check_resume(ENTRY, steps=6, kill_at=[1], save_every=3, async_save=False, work_dir=str(tmp_path))
    assert not res.identical
    assert not res.divergences
    assert any("resuming was not tested" in r for r in res.refused)
    assert "REFUSED" in res.summary() and res.verdict is Verdict.REFUSED and res.exit_code == 6
