"""DataLoader workers: the stream does not depend on num_workers, persistence or prefetch.

Kept small: each configuration forks its own workers.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from ckpt.data import QuarantinePolicy, ResumableLoader
from ckpt_data_testkit import AugDataset, assert_streams_equal, take, via_msgpack
import hangs

N, B = 36, 6  # 6 steps per epoch
STEPS = 12  # two epochs: persistent workers serve the second one without restarting

pytestmark = pytest.mark.timeout(120)


def _make(*, on_bad: str = "quarantine", **kw: Any) -> ResumableLoader:
    policy = QuarantinePolicy(fields=("x",), on_bad=on_bad)  # type: ignore[arg-type]
    return ResumableLoader(
        AugDataset(N, nan_at=frozenset({5, 20})), seed=17, global_batch_size=B, world_size=1,
        quarantine=policy, timeout=hangs.hang_s(6) if kw.get("num_workers") else 0, **kw,
    )


@pytest.fixture(scope="module")
def reference() -> tuple[list[dict[str, torch.Tensor]], dict[str, Any]]:
    loader = _make()
    return take(loader, STEPS), loader.state_dict()


@pytest.mark.parametrize("num_workers,persistent", [(1, False), (2, False), (2, True)])
def test_stream_is_identical_for_any_worker_count(
    reference: tuple[list[dict[str, torch.Tensor]], dict[str, Any]], num_workers: int, persistent: bool
) -> None:
    loader = _make(num_workers=num_workers, persistent_workers=persistent)
    assert_streams_equal(take(loader, STEPS), reference[0])
    assert loader.state_dict() == reference[1]  # same quarantine records, same cursor


def test_resume_with_another_worker_count_counts_only_consumed_batches(
    reference: tuple[list[dict[str, torch.Tensor]], dict[str, Any]],
) -> None:
    loader = _make(num_workers=2, prefetch_factor=4)
    it = iter(loader)
    head = [next(it) for _ in range(4)]  # by now the workers have produced all 6 batches
    state = via_msgpack(loader.state_dict())
    assert (state["epoch"], state["position"]) == (0, 4 * B)
    del it
    resumed = _make(num_workers=1, persistent_workers=True)
    resumed.load_state_dict(state)
    assert_streams_equal(head + take(resumed, STEPS - 4), reference[0])


def test_persistent_workers_break_then_continue_and_leave_global_rng_alone(
    reference: tuple[list[dict[str, torch.Tensor]], dict[str, Any]],
) -> None:
    loader = _make(num_workers=2, persistent_workers=True)
    torch_before, py_before = torch.get_rng_state(), random.getstate()
    it = iter(loader)
    assert torch.equal(torch.get_rng_state(), torch_before)
    got = [next(it), next(it)]
    del it  # abandon a pass with batches still in flight
    got += take(loader, STEPS - 2)  # persistent workers are reset, not restarted
    assert_streams_equal(got, reference[0])
    assert torch.equal(torch.get_rng_state(), torch_before) and random.getstate() == py_before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_batches_and_cuda_rng_untouched(
    reference: tuple[list[dict[str, torch.Tensor]], dict[str, Any]],
) -> None:
    torch.cuda.init()
    cuda_before = torch.cuda.get_rng_state_all()
    in_process = take(_make(pin_memory=True), STEPS)  # reseeds only the CPU generator
    pinned = take(_make(num_workers=2, pin_memory=True), STEPS)
    assert all(b["t"].is_pinned() for b in pinned)
    assert_streams_equal(in_process, reference[0])
    assert_streams_equal(pinned, reference[0])
    assert all(torch.equal(a, b) for a, b in zip(cuda_before, torch.cuda.get_rng_state_all()))


def test_errors_raised_in_a_worker_keep_their_type() -> None:
    from ckpt.errors import IntegrityError

    loader = _make(num_workers=1, on_bad="raise")
    with pytest.raises(IntegrityError, match="field 'x' has NaN/Inf"):
        take(loader, STEPS)
    assert loader.position % B == 0 and loader.epoch == 0  # the failed batch was not consumed
