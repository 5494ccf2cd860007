"""The order a sharded sampler draws, replayed on resume (``ckpt/integrations/_sampler_order.py``).

Under more than one process Lightning and Accelerate shard ``StatefulDataLoader(shuffle=True)``'s
sampler (torchdata's ``RandomSampler``) in ways that hide its generator from the loader's
state, and a resumed process draws the permutation another number of times than the saved
run did. These build the samplers exactly as each trainer does for rank 0 of 2, in process,
and check that the resumed epoch and the next one read the saved run's indices (and, as a
control, that without the replay they do not). The 2-process random-kill trials in
``test_trainer_multiproc.py`` check the same end to end.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

pytest.importorskip("torchdata.stateful_dataloader")

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import BatchSampler, RandomSampler  # noqa: E402

from ckpt.integrations import _sampler_order  # noqa: E402

N = 24


def _lightning_loader() -> Any:
    """What Lightning's data connector makes of ``StatefulDataLoader(shuffle=True)``'s
    sampler on rank 0 of 2 (torchdata's RandomSampler is not torch's: wrapped, not replaced)."""
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    torch.manual_seed(0)  # the sampler seeds its generator from the global RNG, as in a fresh process
    inner = RandomSampler(range(N))
    return types.SimpleNamespace(sampler=DistributedSamplerWrapper(inner, num_replicas=2, rank=0, shuffle=True, seed=0))


def _epoch(loader: Any, epoch: int, draws: int) -> list[int]:
    """An epoch's indices after ``draws`` iter() calls (Lightning's loader makes 2 per epoch,
    the build of a restored iterator 4): the last one is read."""
    loader.sampler.set_epoch(epoch)
    for _ in range(draws):
        order = list(iter(loader.sampler))
    return order


def test_lightning_wrapper_order_is_drawn_again_from_the_saved_streams() -> None:
    straight = _lightning_loader()
    _sampler_order.install([straight])
    epochs = [_epoch(straight, 0, 2), _epoch(straight, 1, 2), _epoch(straight, 2, 2)]
    saved = _sampler_order.saved_orders([straight])  # a save during epoch 2
    assert saved[0] is not None
    epochs.append(_epoch(straight, 3, 2))

    plain = _lightning_loader()  # a resumed process without the replay
    assert _epoch(plain, 2, 4) != epochs[2]

    resumed = _lightning_loader()
    _sampler_order.install([resumed])
    _sampler_order.pin([resumed], saved)
    assert _epoch(resumed, 2, 4) == epochs[2]  # every draw of the restore is the saved one
    _sampler_order.unpin([resumed])
    assert _epoch(resumed, 3, 2) == epochs[3]  # the next epoch continues the saved generator


def _accelerate_loader() -> StatefulDataLoader:
    """What Accelerate's ``prepare_data_loader`` makes of ``StatefulDataLoader(shuffle=True)`` on
    rank 0 of 2: the batch sampler sharded, so the loader's state holds no sampler state."""
    pytest.importorskip("accelerate")
    from accelerate.data_loader import BatchSamplerShard

    torch.manual_seed(0)
    shard = BatchSamplerShard(BatchSampler(RandomSampler(range(N)), 4, False), num_processes=2, process_index=0)
    return StatefulDataLoader(list(range(N)), batch_sampler=shard)


def _indices(batches: Any) -> list[list[int]]:
    return [b.tolist() for b in batches]


def test_accelerate_sharded_loader_starts_its_next_iterator_from_the_saved_generator() -> None:
    from ckpt.integrations.accelerate import _ORDER, _LoaderWithOrder

    straight = _accelerate_loader()
    draws = _sampler_order.record_iterators(straight)
    assert draws is not None
    epochs = [_indices(straight), _indices(straight)]
    it = iter(straight)
    first = _indices([next(it)])
    state = _LoaderWithOrder(straight, draws).state_dict()  # a save during epoch 2, after one batch
    assert isinstance(state[_ORDER], torch.Tensor)
    epochs.append(first + _indices(it))
    epochs.append(_indices(straight))

    plain = _accelerate_loader()  # a resumed process without the replay
    plain.load_state_dict({k: v for k, v in state.items() if k != _ORDER})
    assert _indices(plain) != epochs[2][1:]

    resumed = _accelerate_loader()
    _LoaderWithOrder(resumed, _sampler_order.record_iterators(resumed)).load_state_dict(state)
    assert _indices(resumed) == epochs[2][1:]
    assert _indices(resumed) == epochs[3]


def test_a_loader_without_a_generator_is_left_alone() -> None:
    loader = StatefulDataLoader(list(range(N)), batch_size=4)  # sequential: no order to replay
    assert _sampler_order.record_iterators(loader) is None
    assert "_get_iterator" not in loader.__dict__
