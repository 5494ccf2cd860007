"""Edits of the order (skip / defer), the cursor over an edited epoch, and peek()."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch

from ckpt.data import DataEdit, ResumableLoader
from ckpt.data._edits import apply_edit, epoch_schedule
from ckpt.errors import FormatError
from ckpt_data_testkit import AugDataset, assert_streams_equal, take, via_msgpack


def _loader(n: int = 40, **kw: Any) -> ResumableLoader:
    opts: dict[str, Any] = dict(seed=5, global_batch_size=4, world_size=1, rank=0)
    opts.update(kw)
    return ResumableLoader(AugDataset(n), **opts)


def _steps(loader: ResumableLoader, count: int) -> list[tuple[int, int]]:
    out = []
    while len(out) < count:
        for _ in loader:
            info = loader.last_batch
            assert info is not None
            out.append((info.epoch, info.step))
            if len(out) == count:
                break
    return out


def test_the_schedule_rule() -> None:
    order = list(range(10))
    assert apply_edit(order, DataEdit(0, (3, 4))) == [0, 1, 2, 5, 6, 7, 8, 9]
    # defer: two other batches are served between where the block was and where it is now
    assert apply_edit(order, DataEdit(0, (3, 4), "defer", 2)) == [0, 1, 2, 5, 6, 3, 4, 7, 8, 9]
    # the epoch ends first: the block goes last
    assert apply_edit(order, DataEdit(0, (8,), "defer", 5)) == [0, 1, 2, 3, 4, 5, 6, 7, 9, 8]
    # listed order is kept in the block, and later edits apply to what earlier ones left
    two = [DataEdit(1, (2, 3), "defer", 1), DataEdit(1, (5,))]
    assert epoch_schedule(7, two, 1) == [0, 1, 4, 2, 3, 6]
    assert epoch_schedule(7, two, 0) is None  # untouched epoch: identity, implicit
    with pytest.raises(ValueError, match=r"step 5 of epoch 1 is not in its schedule of 6 steps"):
        apply_edit(epoch_schedule(7, two, 1), DataEdit(1, (5,)))
    with pytest.raises(ValueError, match=r"step 1 of epoch 0 was already served \(slot 1, the cursor is at slot 3\)"):
        apply_edit(order, DataEdit(0, (1, 6)), consumed=3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(epoch=-1, steps=(1,)), "DataEdit.epoch must be an int >= 0, got -1"),
    (dict(epoch=0, steps=()), "DataEdit.steps must be a non-empty tuple"),
    (dict(epoch=0, steps=[1]), "DataEdit.steps must be a non-empty tuple"),
    (dict(epoch=0, steps=(1, 1)), "lists a step twice"),
    (dict(epoch=0, steps=(True,)), "must hold ints >= 0"),
    (dict(epoch=0, steps=(1,), action="drop"), "must be 'skip' or 'defer', got 'drop'"),
    (dict(epoch=0, steps=(1,), action="skip", delay=2), "a skip has no delay"),
    (dict(epoch=0, steps=(1,), action="defer", delay=0), "a defer needs DataEdit.delay >= 1, got 0"),
])
def test_bad_edits_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DataEdit(**kwargs)


def test_skip_mid_epoch_serves_the_rest_and_the_next_epoch_is_whole() -> None:
    loader = _loader()  # 10 steps an epoch
    assert _steps(loader, 3) == [(0, 0), (0, 1), (0, 2)]
    loader.edit(DataEdit(0, (4, 5)))
    assert len(loader) == 8 and loader.steps_per_epoch == 10 and loader.cursor == (0, 3)
    got = _steps(loader, 7 + 2)
    assert got == [(0, 3), (0, 6), (0, 7), (0, 8), (0, 9), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert loader.edits == ()  # epoch 0 is over: its edits are dropped from the state
    assert loader.state_dict()["version"] == 1 and "edits" not in loader.state_dict()


def test_defer_serves_the_block_later() -> None:
    loader = _loader()
    _steps(loader, 2)
    loader.edit(DataEdit(0, (2, 3), "defer", 3))
    ahead = loader.upcoming(8)
    assert ahead == [(0, 4), (0, 5), (0, 6), (0, 2), (0, 3), (0, 7), (0, 8), (0, 9)]
    assert _steps(loader, 8) == ahead


def test_an_edit_makes_a_live_iterator_stale() -> None:
    loader = _loader()
    it = iter(loader)
    next(it)
    loader.edit(DataEdit(0, (5,)))
    with pytest.raises(RuntimeError, match="superseded"):
        next(it)


def test_edits_that_cannot_apply_are_refused_and_change_nothing() -> None:
    loader = _loader()
    _steps(loader, 12)  # epoch 1, slot 2
    before = loader.state_dict()
    for edit, message in [
        (DataEdit(0, (3,)), "epoch 0 is over (the cursor is in epoch 1)"),
        (DataEdit(1, (1,)), "step 1 of epoch 1 was already served (slot 1, the cursor is at slot 2)"),
        (DataEdit(1, (10,)), "step 10 is not one of the 10 steps of an epoch"),
    ]:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            loader.edit(edit)
    loader.edit(DataEdit(1, (6,)))
    with pytest.raises(ValueError, match=r"step 6 of epoch 1 is not in its schedule of 9 steps"):
        loader.edit(DataEdit(1, (6,)))
    with pytest.raises(TypeError, match="takes a ckpt.data.DataEdit"):
        loader.edit({"epoch": 1})  # type: ignore[arg-type]
    assert loader.state_dict() == {**before, "version": 2, "edits": [DataEdit(1, (6,)).to_dict()]}


def test_a_resume_inside_an_edited_epoch_serves_what_the_uninterrupted_run_served() -> None:
    def edited() -> ResumableLoader:
        loader = _loader()
        take(loader, 2)
        loader.edit(DataEdit(0, (3, 4), "defer", 2))
        loader.edit(DataEdit(1, (0, 9)))  # a later epoch is edited too
        return loader

    straight = edited()
    full = take(straight, 25)
    interrupted = edited()
    first = take(interrupted, 5)  # inside the edited epoch 0
    state = via_msgpack(interrupted.state_dict())
    assert state["version"] == 2 and len(state["edits"]) == 2
    resumed = _loader()
    resumed.load_state_dict(state)
    assert resumed.state_dict() == interrupted.state_dict()
    assert_streams_equal(first + take(resumed, 20), full)


def test_upcoming_and_slots_between_cross_epochs() -> None:
    loader = _loader()
    loader.edit(DataEdit(0, (9,)))
    assert loader.upcoming(3, start=(0, 7)) == [(0, 7), (0, 8), (1, 0)]
    assert loader.slots_between((0, 7), (1, 2)) == 4
    assert loader.slots_between((0, 3), (0, 3)) == 0
    with pytest.raises(ValueError, match="before"):
        loader.slots_between((1, 0), (0, 5))


def test_peek_reads_what_iteration_serves_and_moves_nothing() -> None:
    loader = _loader()
    take(loader, 8)
    loader.edit(DataEdit(0, (9,), "defer", 1))  # noqa: the block moves past the epoch end: stays last
    state = copy.deepcopy(loader.state_dict())
    random.seed(1)
    torch.manual_seed(2)
    np.random.seed(3)
    rng = (random.getstate(), torch.get_rng_state(), np.random.get_state()[1].copy())
    peeked = loader.peek(4)
    assert (random.getstate(), np.random.get_state()[1].tolist()) == (rng[0], rng[2].tolist())
    assert torch.equal(torch.get_rng_state(), rng[1])
    assert loader.state_dict() == state and loader.cursor == (0, 8)
    assert [(i.epoch, i.step) for i, _ in peeked] == [(0, 8), (0, 9), (1, 0), (1, 1)]
    served = take(loader, 4)
    assert_streams_equal([b for _, b in peeked], served)


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["edits"][0].update(epoch=0), "0 outside [1, 18446744073709551615] (key 'edits[0].epoch')"),
    (lambda d: d["edits"][0].update(steps=[10]), "10 is not one of the 10 steps of an epoch (key 'edits[0].steps[0]')"),
    (lambda d: d["edits"][0].update(action="drop"), "must be 'skip' or 'defer'"),
    (lambda d: d["edits"].append(dict(d["edits"][0])), "step 6 of epoch 1 is not in its schedule"),
    (lambda d: d["edits"][0].pop("delay"), "missing key 'delay' (key 'edits[0].delay')"),
    (lambda d: d.update(edits=[]), "a version-2 state holds 1 to 4096 edits, got 0 (key 'edits')"),
    (lambda d: d.update(version=1), "unknown key 'edits' (key 'edits')"),
    (lambda d: d.update(position=36), "position 36 is not the start of one of the 9 global batches"),
])
def test_malformed_edits_in_a_state_are_refused(mutate: Any, message: str) -> None:
    loader = _loader()
    take(loader, 12)
    loader.edit(DataEdit(1, (6,)))
    state = copy.deepcopy(loader.state_dict())
    mutate(state)
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        _loader().load_state_dict(state)
