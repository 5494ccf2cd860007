"""Elastic resume: another world size, same global batch, same global sample sequence."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt.data import QuarantinePolicy, ResumableLoader, merge_rank_states
from ckpt_data_testkit import AugDataset, take, via_msgpack

N, B = 70, 8  # drop_last=False: 9 steps, the last one has 6 samples


def _rank(world: int, rank: int, **kw: Any) -> ResumableLoader:
    return ResumableLoader(
        AugDataset(N, nan_at=frozenset({4, 33, 61})), seed=5, global_batch_size=B, world_size=world, rank=rank,
        drop_last=False, quarantine=QuarantinePolicy(fields=("x",)), **kw,
    )


def _global_steps(loaders: list[ResumableLoader], steps: int) -> list[dict[str, torch.Tensor]]:
    """Run all ranks in lockstep; per step, concatenate the rank batches in rank order."""
    per_rank = [take(loader, steps) for loader in loaders]
    return [{k: torch.cat([r[s][k] for r in per_rank]) for k in per_rank[0][s]} for s in range(steps)]


def _assert_same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for s, (x, y) in enumerate(zip(a, b)):
        for k in x:
            assert torch.equal(x[k], y[k]), f"step {s} field {k}"


@pytest.mark.parametrize("kill_after", [3, 9, 11])
@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_at_another_world_size_continues_the_global_sequence(kill_after: int, new_world: int) -> None:
    total = 14  # one epoch of 9 steps and 5 steps into the next
    reference = _global_steps([_rank(1, 0)], total)
    ranks = [_rank(2, r) for r in range(2)]
    head = _global_steps(ranks, kill_after)
    states = [via_msgpack(r.state_dict()) for r in ranks]
    assert {k: v for k, v in states[0].items() if k not in ("rank", "quarantine")} == {
        k: v for k, v in states[1].items() if k not in ("rank", "quarantine")
    }
    merged = merge_rank_states(states)
    resumed = [_rank(new_world, r) for r in range(new_world)]
    for loader in resumed:
        loader.load_state_dict(merged)
        assert loader.resumed_elastic
        info = loader.resume_info
        assert info is not None and (info.saved_world_size, info.world_size) == (2, new_world)
    tail = _global_steps(resumed, total - kill_after)
    # Same samples, in the same order, with the same augmentations: nothing dropped or
    # seen twice. (Model numerics would still differ: reduction order changes.)
    _assert_same(head + tail, reference)
    # Epoch 0 served N samples: every good sample once, plus three replacements.
    served = torch.cat([s["i"] for s in reference[:9]]).tolist()
    assert len(served) == N and set(served) | {4, 33, 61} == set(range(N)) and not {4, 33, 61} & set(served)


def test_same_world_size_resume_is_not_elastic() -> None:
    ranks = [_rank(2, r) for r in range(2)]
    _global_steps(ranks, 2)
    again = _rank(2, 1)
    again.load_state_dict(ranks[1].state_dict())
    assert not again.resumed_elastic and again.resume_info is not None and again.resume_info.saved_rank == 1


def test_world_sizes_that_cannot_split_the_batch_are_refused() -> None:
    with pytest.raises(ValueError, match=r"final global batch has 6 samples, fewer than world_size=7"):
        _rank(7, 0)
    with pytest.raises(ValueError, match=r"global_batch_size must be an int >= world_size \(9\), got 8"):
        _rank(9, 0)
