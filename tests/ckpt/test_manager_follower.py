"""A follower CheckpointManager (writer=False) of a run directory another manager writes:
replicas of one data-parallel state, where one replica writes and every one rolls back."""

from __future__ import annotations

import threading

import pytest
import torch

from ckpt import CheckpointManager
from ckpt.errors import CkptError, RunDirLockedError
import hangs


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def _train(state: dict, steps: int) -> None:
    for _ in range(steps):
        state["optim"].zero_grad()
        state["model"](torch.ones(2, 4)).sum().backward()
        state["optim"].step()


def test_follower_reads_never_locks_saves_or_deletes(tmp_path):
    run = tmp_path / "run"
    w_state, f_state = _state(0), _state(1)
    writer = CheckpointManager(run, w_state, every_steps=2, ledger=False)
    follower = CheckpointManager(run, f_state, every_steps=2, ledger=False, writer=False)  # no RunDirLockedError
    assert writer.writer and not follower.writer
    for step in (1, 2, 3, 4):
        _train(w_state, 1)
        _train(f_state, 1)
        writer.after_step(step)
        assert follower.after_step(step) is False  # due, but a follower saves nothing
    assert [r.step for r in writer.checkpoints() if r.committed] == [2, 4]
    with pytest.raises(CkptError, match="follower"):
        follower.save(5)
    # the follower rolls back to the writer's step 2 and deletes nothing: the writer's job
    rw = follower.rewind(before=4)
    assert rw is not None and rw.step == 2 and rw.discarded == ()
    assert [r.step for r in writer.checkpoints() if r.committed] == [2, 4]
    ref = _state(0)
    _train(ref, 2)
    assert torch.equal(f_state["model"].weight, ref["model"].weight)
    # the writer's own rewind to the same target discards its newer checkpoint
    assert writer.rewind(step=2).discarded == ("step-00000004",)
    follower.close()
    writer.close()


def test_set_writer_hands_the_lock_over(tmp_path):
    run = tmp_path / "run"
    a = CheckpointManager(run, _state(0), ledger=False)
    b = CheckpointManager(run, _state(0), ledger=False, writer=False)
    with pytest.raises(RunDirLockedError):
        b.set_writer(True, wait=False)
    assert not b.writer
    took = threading.Thread(target=b.set_writer, args=(True,))  # waits for a's lock
    took.start()
    a.set_writer(False)  # hands it over: the waiting thread gets it
    took.join(hangs.hang_s(3))  # a hang bound: a thread still waiting fails the assertion below
    assert not took.is_alive() and b.writer and not a.writer
    b.save(7)
    assert [r.step for r in b.checkpoints() if r.committed] == [7]
    with pytest.raises(CkptError, match="follower"):
        a.save(8)
    b.close()
    a.close()
