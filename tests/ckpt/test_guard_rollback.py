"""The loss-spike guard end to end: an injected spike (a corrupted window of batches)
rolls the run back, the restore is exact, the tape shows the episode, the run ends near
the no-spike run; no checkpoint, repeated spikes, reorder, retention, resume after."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import ckpt
from ckpt.data import DataEdit
from ckpt.errors import CkptError, GuardConfigError, GuardError, NoRollbackTargetError, RollbackLimitError
from ckpt.guard import GuardConfig, LossGuard
from ckpt.guard import events as gev
from ckpt.ledger import read_ledger_dir
from _guard_kit import build, eval_loss, finish, ledger_dir, objects, one_thread, samples_of, train  # noqa: F401

# The regression's per-batch loss is noisy once it fits (a hard batch of 32 is 4x the
# median): the injected spikes are 1e6x, so the tests judge at z > 20, not the default 6.
CFG = GuardConfig(z_threshold=20.0, skip_after=1)
SPIKE = samples_of(range(44, 46))  # global steps 44-45 of epoch 0: trained at steps 45-46




def _sd(obj: Any) -> Any:
    return obj.state_dict()


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_an_injected_spike_rolls_back_exactly_and_the_run_ends_near_the_clean_one(tmp_path) -> None:
    seen: dict[str, Any] = {}

    def on_rollback(run: Any, rb: Any) -> None:
        # Right after the episode, everything is the checkpoint's, exactly: load it into
        # fresh objects and compare (the RNG streams from the checkpoint's context).
        model, opt, sched, loader = objects()
        loaded = ckpt.load(os.path.join(run.run_dir, rb.checkpoint), {"model": model, "optim": opt, "sched": sched},
                           data=loader, restore_rng=False)
        assert _equal({"model": _sd(run.model), "optim": _sd(run.opt), "sched": _sd(run.sched)},
                      {"model": _sd(model), "optim": _sd(opt), "sched": _sd(sched)})
        assert run.loader.state_dict() == {**loader.state_dict(), "version": 2, "edits": [DataEdit(0, (44, 45)).to_dict()]}
        assert bytes(torch.get_rng_state().numpy()) == loaded.context["rng"]["torch_cpu"]
        seen["checkpoints"] = [r.name for r in run.mgr.checkpoints()]

    run = finish(train(build(str(tmp_path / "spiky"), scaled=SPIKE, config=CFG), 80, on_rollback=on_rollback))
    [rb] = run.rollbacks
    assert (rb.episode, rb.detected, rb.step, rb.checkpoint, rb.policy) == (1, 45, 40, "step-00000040", "skip")
    assert rb.verdict.rule == "robust_z" and rb.verdict.score > 1e5 and len(rb.verdict.window) == 32
    assert rb.edits == (DataEdit(0, (44, 45)),) and rb.discarded == () and rb.fallbacks == ()
    assert "step-00000050" not in seen["checkpoints"]  # the spike's step was never saved
    # the offending batches are never served again; the re-executed steps are the same
    assert run.served.count((0, 44)) == 1 and (0, 45) not in run.served  # skip_after=1: 45 pre-empted
    losses = dict(run.losses[:44])
    again = {s: v for s, v in run.losses[45:] if s <= 44}
    assert again and all(losses[s] == v for s, v in again.items())
    # the run goes on to the end and lands near the run that never saw the spike
    clean = finish(train(build(str(tmp_path / "clean"), config=CFG), 80))
    unguarded = finish(train(build(str(tmp_path / "unguarded"), scaled=SPIKE, config=None), 80))
    assert clean.rollbacks == [] and run.step == 80
    assert abs(eval_loss(run) - eval_loss(clean)) <= 0.25 * eval_loss(clean)
    assert eval_loss(unguarded) > 100 * eval_loss(clean)


def test_an_async_manager_rolls_back_the_same_way(tmp_path) -> None:
    # The save of step 40 may still be in flight when step 45 spikes: the rewind waits
    # for it to commit before choosing, and the run is the synchronous one, bit for bit.
    sync = finish(train(build(str(tmp_path / "s"), scaled=SPIKE, config=CFG), 60))
    run = finish(train(build(str(tmp_path / "a"), scaled=SPIKE, config=CFG, async_save=True), 60))
    assert [(rb.detected, rb.step) for rb in run.rollbacks] == [(45, 40)]
    assert run.losses == sync.losses
    for p, q in zip(sync.model.parameters(), run.model.parameters()):
        assert torch.equal(p, q)


def test_the_tape_shows_the_episode(tmp_path) -> None:
    run = finish(train(build(str(tmp_path / "r"), scaled=SPIKE, config=CFG), 50))
    tapes, problems = read_ledger_dir(ledger_dir(run))
    assert problems == [] and len(tapes) == 1
    [tape] = tapes
    kinds = [(g.step, type(g.record).__name__) for g in tape.guard]
    assert kinds == [(45, "Verdict"), (45, "RollbackEvent")]
    spike, rollback = (g.record for g in tape.guard)
    assert isinstance(spike, gev.Spike) and spike.rule == "robust_z" and spike.threshold == 20.0
    assert spike.window == run.rollbacks[0].verdict.window and spike.value == run.rollbacks[0].verdict.value
    assert isinstance(rollback, gev.RollbackEvent)
    assert (rollback.to_step, rollback.ckpt_name, rollback.policy) == (40, "step-00000040", "skip")
    assert rollback.edits == ({"epoch": 0, "steps": [44, 45], "action": "skip", "delay": 0},)
    assert tape.rollbacks == [(45, 40)]  # 45 steps recorded before it; it voids those after 40
    assert [s.step for s in tape.steps] == list(range(1, 46)) + list(range(41, 51))
    # replay's generic reader decodes the same events (the table row is the schema)
    from replay.tape import TapeReader

    names = [(e.step, e.kind.name) for e in TapeReader(tape.path).events() if e.kind.code >= 48]
    assert names == [(45, "spike"), (45, "rollback")]
    from replay import check_tape

    assert check_tape(tape.path) == []


def test_a_non_finite_loss_rolls_back_even_without_history(tmp_path) -> None:
    nan = samples_of([5])
    run = finish(train(build(str(tmp_path / "r"), nan=nan, config=CFG, every=4), 30))
    [rb] = run.rollbacks
    assert (rb.verdict.rule, rb.detected, rb.step) == ("nonfinite", 6, 4)
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    assert all(v == v for _, v in run.losses[6:])


def test_a_spike_with_no_earlier_checkpoint(tmp_path) -> None:
    run = build(str(tmp_path / "r"), scaled=SPIKE, config=CFG, every=100, save0=False)
    with pytest.raises(NoRollbackTargetError, match=r"loss spike at step 45 .*: no committed checkpoint before step 45 "
                                                     r"to roll back to \(checkpoints at steps none\); save step 0"):
        train(run, 50)
    finish(run)
    [tape], _ = read_ledger_dir(ledger_dir(run))
    assert [type(g.record).__name__ for g in tape.guard] == ["Verdict", "Refused"]
    assert tape.guard[1].record.reason == "no-checkpoint"
    # on_no_checkpoint="continue": the step is accepted as it is and the run goes on
    cfg = GuardConfig(z_threshold=20.0, on_no_checkpoint="continue")
    run = finish(train(build(str(tmp_path / "c"), scaled=SPIKE, config=cfg, every=100, save0=False), 50))
    assert run.rollbacks == [] and run.step == 50


def test_repeated_spikes_are_bounded(tmp_path) -> None:
    # A long corrupted stretch and a policy that skips one batch at a time: every rollback
    # meets the next bad batch. max_rollbacks=2: the third spike stops the run, clearly.
    cfg = GuardConfig(z_threshold=20.0, max_rollbacks=2)
    run = build(str(tmp_path / "r"), scaled=samples_of(range(44, 50)), config=cfg)
    with pytest.raises(RollbackLimitError, match=r"loss spike at step 45 .*: 2 rollbacks already, the limit "
                                                 r"\(GuardConfig.max_rollbacks=2\); the run stops"):
        train(run, 80)
    finish(run)
    # each episode skips the spiking batch; the next bad one takes its place at step 45
    assert [(rb.detected, rb.step, rb.edits) for rb in run.rollbacks] == [
        (45, 40, (DataEdit(0, (44,)),)), (45, 40, (DataEdit(0, (44,)), DataEdit(0, (45,))))]
    [tape], _ = read_ledger_dir(ledger_dir(run))
    assert [type(g.record).__name__ for g in tape.guard][-2:] == ["Verdict", "Refused"]
    assert tape.guard[-1].record.detail == {"episodes": 2, "max_rollbacks": 2}


def test_reorder_serves_the_window_later(tmp_path) -> None:
    # Reorder defers the window; the corrupted samples come back reorder_delay batches
    # later and spike again: with a budget of one rollback, that second spike stops it.
    cfg = GuardConfig(z_threshold=20.0, policy="reorder", reorder_delay=5, max_rollbacks=1)
    run = build(str(tmp_path / "r"), scaled=samples_of([44]), config=cfg)
    with pytest.raises(RollbackLimitError):
        train(run, 80)
    finish(run)
    [rb] = run.rollbacks
    assert rb.edits == (DataEdit(0, (44,), "defer", 5),)
    after = run.served[run.served.index((0, 44)) + 1:]
    assert after[after.index((0, 40)):] == [(0, s) for s in (40, 41, 42, 43, 45, 46, 47, 48, 49, 44)]


def test_retention_keeps_a_target_before_the_lookback(tmp_path) -> None:
    # keep_last=1 alone would leave only the newest checkpoint. With lookback=6 the
    # guard's rule keeps, at the save of step 40 (floor 34): 35 and 40 (above the floor,
    # future targets) and 30 (the newest at or below it). A spike at 45 goes to 35.
    cfg = GuardConfig(z_threshold=20.0, lookback=6, skip_before=1)
    names: list[list[str]] = []
    run = build(str(tmp_path / "r"), scaled=samples_of([44]), config=cfg, every=5,
                retention=ckpt.RetentionPolicy(keep_last=1))
    train(run, 44)
    names.append([r.name for r in run.mgr.checkpoints()])
    train(run, 60)
    finish(run)
    assert names[0] == ["step-00000030", "step-00000035", "step-00000040"]
    [rb] = run.rollbacks
    assert (rb.detected, rb.step, rb.discarded) == (45, 35, ("step-00000040",))
    assert rb.edits == (DataEdit(0, (43, 44)),)  # skip_before=1: the batch before the spike's too


def test_a_crash_after_a_rollback_resumes_exactly(tmp_path) -> None:
    straight = finish(train(build(str(tmp_path / "a"), scaled=SPIKE, config=CFG), 60))
    # the same run, killed after re-executing steps 41-44 (the newest checkpoint is still
    # step 40, which predates the episode: the resumed run lives the episode again)
    first = train(build(str(tmp_path / "b"), scaled=SPIKE, config=CFG), 60, stop=lambda r, s: bool(r.rollbacks) and s >= 44)
    assert len(first.rollbacks) == 1 and first.step == 44
    finish(first)
    again = build(str(tmp_path / "b"), scaled=SPIKE, config=CFG, resume=True)
    assert again.mgr.start_step == 40
    finish(train(again, 60))
    assert len(again.rollbacks) == 1
    for p, q in zip(straight.model.parameters(), again.model.parameters()):
        assert torch.equal(p, q)
    # the ledger voided the abandoned steps 41-45 of the first process: the resume
    # verifies exact over the re-executed 41-44, not "diverged" at 45
    report = again.mgr.resume_report
    assert report is not None and report.verdict == "exact" and (report.first, report.last) == (41, 44), report.text


def test_a_resume_after_the_episode_keeps_the_policy_and_the_budget(tmp_path) -> None:
    straight = finish(train(build(str(tmp_path / "a"), scaled=SPIKE, config=CFG), 70))
    first = finish(train(build(str(tmp_path / "b"), scaled=SPIKE, config=CFG), 70, stop=lambda r, s: s >= 55))
    meta = ckpt.open(os.path.join(first.run_dir, "step-00000050")).meta["guard"]
    assert meta["version"] == 1 and len(meta["window"]) == 32 and meta["routing"] == []
    assert meta["episodes"] == [{"episode": 1, "detected": 45, "to_step": 40, "checkpoint": "step-00000040",
                                 "policy": "skip", "edits": [DataEdit(0, (44, 45)).to_dict()]}]
    again = build(str(tmp_path / "b"), scaled=SPIKE, config=CFG, resume=True)
    assert again.guard is not None and again.guard.episodes == meta["episodes"]
    finish(train(again, 70))
    assert again.rollbacks == []
    for p, q in zip(straight.model.parameters(), again.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=2), "GuardConfig.window must be an int >= 3, got 2"),
    (dict(min_history=40), "GuardConfig.min_history (40) must be <= window (32)"),
    (dict(min_history=True), "GuardConfig.min_history must be an int >= 3, got True"),
    (dict(z_threshold=0), "GuardConfig.z_threshold must be a finite number > 0, got 0"),
    (dict(z_threshold=float("nan")), "GuardConfig.z_threshold must be a finite number > 0, got nan"),
    (dict(min_scale=-1.0), "GuardConfig.min_scale must be a finite number >= 0, got -1.0"),
    (dict(lookback=-1), "GuardConfig.lookback must be an int >= 0, got -1"),
    (dict(policy="drop"), "GuardConfig.policy must be one of 'skip', 'reorder', got 'drop'"),
    (dict(skip_after=1.5), "GuardConfig.skip_after must be an int >= 0, got 1.5"),
    (dict(reorder_delay=0), "GuardConfig.reorder_delay must be an int >= 1, got 0"),
    (dict(max_rollbacks=0), "GuardConfig.max_rollbacks must be an int >= 1, got 0"),
    (dict(on_no_checkpoint="ignore"), "GuardConfig.on_no_checkpoint must be one of 'raise', 'continue'"),
    (dict(warmup_batches=-2), "GuardConfig.warmup_batches must be an int >= 0, got -2"),
])
def test_bad_configs_are_refused_clearly(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(GuardConfigError) as info:
        GuardConfig(**kwargs)
    assert message in str(info.value) and isinstance(info.value, ValueError)
    assert info.value.key == next(iter(kwargs))


def test_bad_wiring_is_refused_clearly(tmp_path) -> None:
    model = torch.nn.Linear(2, 1)
    plain = ckpt.CheckpointManager(str(tmp_path / "p"), {"model": model}, signals=())
    with pytest.raises(GuardConfigError, match="data= must be a ckpt.data.ResumableLoader, got NoneType"):
        LossGuard(plain)
    plain.close()
    run = build(str(tmp_path / "r"), config=CFG)
    with pytest.raises(GuardError, match="already has a LossGuard"):
        LossGuard(run.mgr, CFG)
    with pytest.raises(CkptError, match="a LossGuard is attached to this manager: call guard.after_step"):
        run.mgr.after_step(1, loss=1.0)
    with pytest.raises(GuardConfigError, match=r"warmup_batches=2 needs model= \(the MoE model\) and forward="):
        run.guard.close()
        LossGuard(run.mgr, GuardConfig(warmup_batches=2))
    with pytest.raises(TypeError, match="loss must be a number or a one-element tensor, got str"):
        LossGuard(run.mgr, CFG).after_step(1, loss="high")
    finish(run)
