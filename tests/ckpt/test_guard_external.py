"""LossGuard.roll_back: an episode another detector (SDC) asks for (spec/loss-guard.md §3.1)."""

from __future__ import annotations

import pytest
import torch

from ckpt import CheckpointManager
from ckpt.data import ResumableLoader
from ckpt.errors import GuardConfigError
from ckpt.guard import GuardConfig, LossGuard, events


class _Tape:
    def __init__(self) -> None:
        self.kinds: list[tuple[int, bytes]] = []

    def record_event(self, kind: int, payload: bytes) -> None:
        self.kinds.append((kind, payload))

    def decide_event(self, kind: int, compute):  # noqa: ANN001 - the TapeSink protocol
        payload = compute()
        self.kinds.append((kind, payload))
        return payload


def _run(tmp_path, tape):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ResumableLoader(torch.arange(64.0).reshape(32, 2), seed=1, global_batch_size=4, seed_sample_rngs=False)
    mgr = CheckpointManager(tmp_path / "run", {"model": model, "optim": opt}, data=loader, every_steps=4, ledger=False)
    guard = LossGuard(mgr, GuardConfig(window=8, min_history=3, skip_after=1), tape=tape)
    mgr.save(0)
    it = iter(loader)
    for step in range(1, 7):
        next(it)
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        assert guard.after_step(step, loss=1.0 + 0.01 * step) is None
    return mgr, guard, model, loader


def test_roll_back_goes_to_the_newest_checkpoint_and_skips_no_data(tmp_path):
    tape = _Tape()
    mgr, guard, model, loader = _run(tmp_path, tape)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    rb = guard.roll_back(7, rule="sdc", loss=1.5)
    assert (rb.detected, rb.step, rb.checkpoint, rb.edits, rb.verdict.rule) == (7, 4, "step-00000004", (), "sdc")
    assert loader.cursor == (0, 4) and loader.edits == ()
    assert not torch.equal(model.weight, saved["weight"])  # the state is step 4's again
    spikes = [events.decode_payload(k, p) for k, p in tape.kinds if k == events.SPIKE]
    assert [(s.rule, s.value) for s in spikes] == [("sdc", 1.5)]
    assert len(guard.episodes) == 1  # the same budget as a spike's
    mgr.close()


def test_roll_back_with_the_data_policy_and_bad_rules(tmp_path):
    mgr, guard, _, loader = _run(tmp_path, None)
    with pytest.raises(GuardConfigError, match="detector"):
        guard.roll_back(7, rule="robust_z")
    rb = guard.roll_back(7, rule="sdc", data_policy=True)
    assert rb.step == 4 and rb.edits and loader.edits == rb.edits
    mgr.close()
