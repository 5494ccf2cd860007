"""Quarantine: bad samples and shards are replaced deterministically, across resumes."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from ckpt.data import EpochOrder, QuarantinePolicy, ResumableLoader
from ckpt.data._mix import resample_index
from ckpt.errors import IntegrityError
from ckpt_data_testkit import AugDataset, ListShards, assert_streams_equal, take, via_msgpack

N, B, SEED = 40, 5, 3
BAD = frozenset({3, 17, 29})
NAN_REASON = "field 'x' has NaN/Inf"


def _loader(calls: list[tuple[int, int | None, str]] | None = None, **kw: Any) -> ResumableLoader:
    opts: dict[str, Any] = dict(seed=SEED, global_batch_size=B, world_size=1, quarantine=QuarantinePolicy(fields=("x",)))
    opts.update(kw)
    return ResumableLoader(
        AugDataset(N, nan_at=BAD), on_quarantine=None if calls is None else lambda *a: calls.append(a), **opts
    )


def _expected_served(epoch: int) -> list[int]:
    order = EpochOrder(N, SEED, epoch)
    out = []
    for p in range(N):
        candidate, attempt = order.index(p), 0
        while candidate in BAD:  # nothing is skipped unread in epoch 0: every bad one is checked
            attempt += 1
            candidate = resample_index(SEED, epoch, p, attempt, N)
        out.append(candidate)
    return out


def test_bad_samples_are_replaced_by_the_resample_chain_and_reported_once() -> None:
    calls: list[tuple[int, int | None, str]] = []
    loader = _loader(calls)
    served = torch.cat([b["i"] for b in loader]).tolist()
    assert served == _expected_served(0)
    first_seen = [i for i in EpochOrder(N, SEED, 0).indices(range(N)) if i in BAD]
    assert [c[0] for c in calls] == first_seen and all(c[1:] == (None, NAN_REASON) for c in calls)
    assert [(r.epoch, r.index, r.scope, r.reason) for r in loader.quarantined] == [
        (0, i, "sample", NAN_REASON) for i in first_seen
    ]
    served_1 = torch.cat([b["i"] for b in loader]).tolist()
    assert not BAD & set(served_1) and len(calls) == 3  # epoch 1 skips them unread


@pytest.mark.parametrize("kill_after", [1, 4, 7, 8, 9, 13])
def test_a_resumed_run_makes_the_same_choices(kill_after: int) -> None:
    total = 20  # 8 steps per epoch: into epoch 2
    ref_calls: list[tuple[int, int | None, str]] = []
    reference = _loader(ref_calls)
    ref = take(reference, total)
    calls: list[tuple[int, int | None, str]] = []
    first = _loader(calls)
    head = take(first, kill_after)
    state = via_msgpack(first.state_dict())
    resumed = _loader(calls)
    resumed.load_state_dict(state)
    assert_streams_equal(head + take(resumed, total - kill_after), ref)
    assert calls == ref_calls  # each record reported once, by whichever run found it
    assert resumed.state_dict() == reference.state_dict()


def test_bad_shard_is_replaced_this_epoch_and_skipped_unread_from_the_next() -> None:
    calls: list[tuple[int, int | None, str]] = []
    src = ListShards([4, 4, 4, 4], bad_shards=frozenset({2}))
    policy = QuarantinePolicy(scope="shard")
    loader = ResumableLoader(src, seed=1, global_batch_size=4, world_size=1, quarantine=policy,
                             on_quarantine=lambda *a: calls.append(a))
    epoch0 = list(loader)
    assert 2 not in torch.cat([b["s"] for b in epoch0]).tolist()
    # Within epoch 0 every draw from shard 2 is tried: its 4 positions, plus any
    # replacement candidate that lands there (the skip set is frozen at epoch start).
    assert {o for s, o in src.reads if s == 2} == {0, 1, 2, 3}
    assert len(calls) == 1 and calls[0][1:] == (2, "read raised OSError: shard 2 is corrupt")
    assert [(r.scope, r.shard) for r in loader.quarantined] == [("shard", 2)]
    src.reads.clear()
    epoch1 = list(loader)
    assert not [r for r in src.reads if r[0] == 2]
    assert 2 not in torch.cat([b["s"] for b in epoch1]).tolist()

    # A resume in the middle of epoch 0 still tries shard 2 there, as the original did.
    again = ResumableLoader(ListShards([4, 4, 4, 4], bad_shards=frozenset({2})), seed=1, global_batch_size=4,
                            world_size=1, quarantine=policy)
    head = take(again, 2)
    resumed = ResumableLoader(ListShards([4, 4, 4, 4], bad_shards=frozenset({2})), seed=1, global_batch_size=4,
                              world_size=1, quarantine=policy)
    resumed.load_state_dict(via_msgpack(again.state_dict()))
    assert_streams_equal(head + take(resumed, 6), epoch0 + epoch1)


def test_raise_policy_fails_on_the_first_bad_sample() -> None:
    loader = _loader(quarantine=QuarantinePolicy(fields=("x",), on_bad="raise"))
    with pytest.raises(IntegrityError, match=r"sample \d+ \(shard None, offset \d+\) at epoch 0 position \d+: "
                                             r"field 'x' has NaN/Inf \(key 'sample\[\d+\]'\)"):
        list(loader)
    raising = ResumableLoader(AugDataset(N, raise_at=frozenset({5})), seed=SEED, global_batch_size=B,
                              world_size=1, quarantine=QuarantinePolicy(on_bad="raise"))
    with pytest.raises(OSError, match="cannot read sample 5"):
        list(raising)
    unguarded = ResumableLoader(AugDataset(N, raise_at=frozenset({5})), seed=SEED, global_batch_size=B, world_size=1)
    with pytest.raises(OSError, match="cannot read sample 5"):
        list(unguarded)


def test_uncaught_exception_types_propagate() -> None:
    loader = ResumableLoader(AugDataset(N, raise_at=frozenset({5})), seed=SEED, global_batch_size=B, world_size=1,
                             quarantine=QuarantinePolicy(catch=(ValueError,)))
    with pytest.raises(OSError, match="cannot read sample 5"):
        list(loader)


def test_running_out_of_attempts_raises_integrity_error() -> None:
    loader = ResumableLoader(AugDataset(6, nan_at=frozenset(range(6))), seed=0, global_batch_size=2, world_size=1,
                             quarantine=QuarantinePolicy(fields=("x",), max_attempts=3))
    with pytest.raises(IntegrityError, match=r"epoch 0 position 0: all 3 candidates were bad or quarantined "
                                             r"\(first: sample \d\); raise max_attempts or fix the data"):
        next(iter(loader))


class _Fields:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return (i, float("inf") if i == 1 else 0.5, np.array([np.nan if i == 2 else 1.0]), "text")


def test_tuple_samples_with_float_and_numpy_fields() -> None:
    calls: list[tuple[int, int | None, str]] = []
    loader = ResumableLoader(_Fields(8), seed=0, global_batch_size=8, world_size=1, collate_fn=list,
                             quarantine=QuarantinePolicy(fields=(1, 2)), on_quarantine=lambda *a: calls.append(a))
    batch = next(iter(loader))
    assert {s[0] for s in batch} <= set(range(8)) - {1, 2}
    assert sorted(calls) == [(1, None, "field 1 has NaN/Inf"), (2, None, "field 2 has NaN/Inf")]
    missing = ResumableLoader(_Fields(8), seed=0, global_batch_size=8, world_size=1, collate_fn=list,
                              quarantine=QuarantinePolicy(fields=(9,), max_attempts=1))
    with pytest.raises(IntegrityError, match="all 1 candidates were bad"):
        next(iter(missing))
    text = ResumableLoader(_Fields(8), seed=0, global_batch_size=8, world_size=1, collate_fn=list,
                           quarantine=QuarantinePolicy(fields=(3,)))
    with pytest.raises(TypeError, match="quarantine field 3 has uncheckable type str"):
        next(iter(text))
    assert math.isinf(_Fields(8)[1][1])


@pytest.mark.parametrize(
    "kw,exc,message",
    [
        (dict(fields=["x"]), TypeError, "fields must be a tuple of str/int"),
        (dict(on_bad="skip"), ValueError, "on_bad must be 'quarantine' or 'raise', got 'skip'"),
        (dict(scope="file"), ValueError, "scope must be 'sample' or 'shard', got 'file'"),
        (dict(catch=(int,)), TypeError, "catch must be a tuple of exception types"),
        (dict(max_attempts=0), ValueError, "max_attempts must be an int >= 1, got 0"),
    ],
)
def test_policy_validation(kw: dict[str, Any], exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message):
        QuarantinePolicy(**kw)


def test_shard_scope_needs_a_shard_source() -> None:
    with pytest.raises(ValueError, match=r"scope='shard'\) needs a ShardSource"):
        _loader(quarantine=QuarantinePolicy(scope="shard"))
