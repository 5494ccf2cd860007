"""replay.sdc: bucket digests, the all-gather-by-all-reduce slots, the majority judge, bit flips."""

from __future__ import annotations

import pytest
import torch

from replay.sdc import bucket_digests, compare_digests, digest_slots, flip_bit, judge, unpack_slots


def test_digest_slots_summed_over_replicas_hold_every_row_exactly():
    rows = [bucket_digests([torch.randn(10, generator=torch.Generator().manual_seed(r)) for _ in range(3)])
            for r in range(4)]
    total = sum(digest_slots(d, r, 4) for r, d in enumerate(rows))  # what an all-reduce SUM computes
    assert unpack_slots(total) == rows


def test_judge_names_the_odd_replica_and_bucket():
    good, bad = b"a" * 16, b"b" * 16
    v = judge({"g0": [good, good], "g1": [good, bad], "g2": [good, good]})
    assert not v.ok and v.odd == ("g1",) and v.buckets == (1,) and not v.ambiguous
    assert judge({"g0": [good], "g1": [good], "g2": [good]}).ok
    two = judge({"g0": [good], "g1": [bad]})  # no majority with two replicas
    assert not two.ok and two.ambiguous and two.odd == ()


def test_one_flipped_bit_changes_exactly_that_buckets_digest():
    t = torch.zeros(64)
    buckets = [t[:32], t[32:]]
    before = bucket_digests(buckets)
    flip_bit(buckets[1], 3, 30)
    after = bucket_digests(buckets)
    assert before[0] == after[0] and before[1] != after[1]
    assert t[35].item() == 2.0  # bit 30 of +0.0 is the exponent's top bit
    flip_bit(buckets[1], 3, 30)
    assert bucket_digests(buckets) == before
    with pytest.raises(ValueError):
        flip_bit(t, 0, 32)
    assert compare_digests([("b0", b"x"), ("b1", b"y")], [("b0", b"x"), ("b1", b"z")]) == ["b1"]
