"""Single-process behaviour: coverage, kill-and-resume, epoch boundaries, global RNG."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from ckpt.data import EpochOrder, ResumableLoader
from ckpt_data_testkit import AugDataset, ListShards, assert_streams_equal, take, via_msgpack

N, B = 45, 4  # drop_last: 11 steps per epoch, samples at positions 44.. dropped


def _loader(**kw: Any) -> ResumableLoader:
    opts: dict[str, Any] = dict(seed=7, global_batch_size=B, world_size=1, rank=0)
    opts.update(kw)
    return ResumableLoader(AugDataset(N), **opts)


def test_epoch_follows_the_order_and_covers_every_sample_once() -> None:
    loader = _loader(drop_last=False, global_batch_size=5)
    batches = list(loader)
    served = torch.cat([b["i"] for b in batches]).tolist()
    assert served == EpochOrder(N, 7, 0).indices(range(N))
    assert sorted(served) == list(range(N))
    assert (loader.epoch, loader.position) == (1, 0)
    second = torch.cat([b["i"] for b in loader]).tolist()
    assert second == EpochOrder(N, 7, 1).indices(range(N)) and second != served


def test_shard_source_flat_index_skips_empty_shards() -> None:
    src = ListShards([3, 0, 2, 0, 4])
    batches = list(ResumableLoader(src, seed=1, global_batch_size=3, world_size=1))
    pairs = sorted(zip(torch.cat([b["s"] for b in batches]).tolist(), torch.cat([b["o"] for b in batches]).tolist()))
    assert pairs == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]


@pytest.mark.parametrize("kill_after", [0, 1, 5, 10, 11, 12, 20, 22, 25])
def test_kill_and_resume_gives_the_identical_remaining_stream(kill_after: int) -> None:
    total = 27  # 2 full epochs of 11 steps, then 5 steps into epoch 2
    reference = take(_loader(), total)
    first = _loader()
    head = take(first, kill_after)
    state = via_msgpack(first.state_dict())
    assert state["epoch"] == kill_after // 11 and state["position"] == (kill_after % 11) * B
    del first  # "killed": nothing but the state survives
    resumed = _loader()
    resumed.load_state_dict(state)
    assert not resumed.resumed_elastic
    assert_streams_equal(head + take(resumed, total - kill_after), reference)


def test_break_and_reiterate_continues_from_what_was_consumed() -> None:
    reference = list(_loader())
    loader = _loader()
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    del it
    got += list(loader)  # a new pass continues at step 3, not at 0
    assert_streams_equal(got, reference)


def test_state_after_the_last_batch_names_the_next_epoch() -> None:
    loader = _loader()
    it = iter(loader)
    for _ in range(10):
        next(it)
    assert (loader.epoch, loader.position, loader.step) == (0, 40, 10)
    next(it)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 0
    with pytest.raises(StopIteration):
        next(it)
    assert len(loader) == 11 and loader.last_batch is not None and loader.last_batch.step == 10


def _rng_states() -> tuple[Any, torch.Tensor, Any]:
    return random.getstate(), torch.get_rng_state(), np.random.get_state()


def _assert_rng_equal(a: tuple[Any, torch.Tensor, Any], b: tuple[Any, torch.Tensor, Any]) -> None:
    assert a[0] == b[0]
    assert torch.equal(a[1], b[1])
    assert a[2][0] == b[2][0] and np.array_equal(a[2][1], b[2][1]) and a[2][2:] == b[2][2:]


def test_iter_and_fetch_leave_the_global_rngs_untouched() -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    loader = _loader()
    before = _rng_states()
    it = iter(loader)
    _assert_rng_equal(before, _rng_states())
    next(it)  # num_workers=0: the samples are read and augmented in this process
    _assert_rng_equal(before, _rng_states())
    plain = torch.utils.data.DataLoader(list(range(8)), batch_size=4)
    iter(plain)  # the pitfall this guards against: DataLoader draws from the global RNG
    assert not torch.equal(before[1], torch.get_rng_state())


def test_augmentations_do_not_depend_on_the_global_rng() -> None:
    torch.manual_seed(0)
    a = take(_loader(), 3)
    torch.manual_seed(1)
    random.seed(1)
    b = take(_loader(), 3)
    assert_streams_equal(a, b)


def test_a_superseded_iterator_refuses_to_continue() -> None:
    loader = _loader()
    old = iter(loader)
    next(old)
    iter(loader)
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        next(old)
    stale = iter(loader)
    loader.load_state_dict(loader.state_dict())
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        next(stale)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(seed=-1), r"seed must be an int in \[0, 2\^64\), got -1"),
        (dict(global_batch_size=0), r"global_batch_size must be an int >= world_size \(1\), got 0"),
        (dict(global_batch_size=46), r"45 samples make no global batch of 46 \(drop_last=True\)"),
        (dict(world_size=2, rank=2), r"rank must be in \[0, 2\), got 2"),
        (dict(world_size=0), r"world_size must be an int >= 1, got 0"),
    ],
)
def test_bad_configuration_raises(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _loader(**kw)


def test_source_must_be_a_dataset_or_shard_source() -> None:
    with pytest.raises(TypeError, match="must be a map-style dataset .* or a ShardSource, got int"):
        ResumableLoader(5, seed=0, global_batch_size=1)


def test_each_sample_draws_from_rngs_seeded_by_its_counters() -> None:
    """The documented contract: sample at position p of epoch e sees torch's CPU RNG,
    Python's ``random`` and numpy's global RNG seeded from ``sample_seed(seed, e, p, 0)``."""
    from ckpt.data import sample_seed

    loader = _loader()
    take(loader, 12)  # into epoch 1
    batch = next(iter(loader))
    info = loader.last_batch
    assert info is not None and (info.epoch, info.step) == (1, 1)
    for j, p in enumerate(info.positions):
        s = sample_seed(7, 1, p, 0)
        assert torch.equal(batch["t"][j], torch.rand(3, generator=torch.Generator().manual_seed(s)))
        assert batch["py"][j].item() == random.Random(s).random()
        assert batch["np"][j].item() == np.random.RandomState(s & 0xFFFF_FFFF).rand()
        assert batch["i"][j].item() == info.indices[j] == EpochOrder(N, 7, 1).index(p)


def test_an_exhausted_iterator_keeps_raising_stop_iteration() -> None:
    loader = _loader()
    it = iter(loader)
    assert len(list(it)) == 11
    following = iter(loader)
    with pytest.raises(StopIteration):
        next(it)
    assert next(following)["i"].shape == (B,)
