"""Low-bit communication (runs/diloco/quant.py): the encoding, and a compressed run whose
encoded payloads are what the wire and the tape carry, so that it replays bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from runs.diloco import DiLoCoConfig, record
from runs.diloco.quant import BITS, Encoded, decode, encode, encoded_nbytes

from tests.runs.diloco._kit import tiny


def test_encoding_is_exact_on_its_levels_and_packs_the_bits() -> None:
    x = torch.tensor([[-7.0, -3.0, 0.0, 5.0, 7.0]])
    assert torch.equal(decode(encode(x, 4)), x)  # absmax 7, 15 levels: every value is a level
    e = encode(torch.randn(1000, generator=torch.Generator().manual_seed(1)), 4, block=64)
    assert e.packed.dtype == torch.uint8 and e.packed.numel() == 500 and e.scales.numel() == 16
    assert encoded_nbytes([e]) == 500 + 16 * 4
    assert encode(torch.ones(9), 2).packed.numel() == 3 and encode(torch.ones(9), 1).packed.numel() == 2
    assert torch.equal(decode(encode(x, 32)), x) and decode(encode(x, 16)).dtype == torch.float32
    one = decode(encode(torch.tensor([1.0, -3.0, 2.0]), 1))  # signs, scaled by the mean magnitude
    assert torch.equal(one, torch.tensor([2.0, -2.0, 2.0]))
    assert torch.equal(decode(encode(torch.zeros(5), 4)), torch.zeros(5))  # a zero block stays zero
    with pytest.raises(ValueError, match="bits must be one of"):
        encode(x, 3)
    with pytest.raises(ValueError, match="comm_bits"):
        DiLoCoConfig(comm_bits=5)


@pytest.mark.parametrize("bits", BITS)
def test_error_shrinks_with_the_bits(bits: int) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, 11, generator=g)
    e = encode(x, bits, block=16)
    assert isinstance(e, Encoded) and e.shape == (37, 11)
    err = float((decode(e, block=16) - x).norm() / x.norm())
    bound = {1: 0.7, 2: 0.8, 4: 0.2, 8: 0.01, 16: 1e-3, 32: 0.0}[bits]
    assert err <= bound, err


@pytest.mark.slow
def test_an_int4_run_under_chaos_sends_a_third_of_the_bytes_and_replays_bit_for_bit(tmp_path) -> None:
    from replay import check_tape, replay

    full = record(tmp_path / "f" / "tape", tiny(steps=16))
    res = record(tmp_path / "q" / "tape", tiny(steps=16, comm_bits=4))
    assert all(math.isfinite(v) for _, v in res.syncer.val)
    # 4 bits and a float32 scale per 64: 0.14x, plus what goes whole (to a replacement, from one)
    assert res.syncer.bytes_up < 0.4 * full.syncer.bytes_up and res.syncer.bytes_down < 0.4 * full.syncer.bytes_down
    assert check_tape(res.tape) == []
    rr = replay(res.tape, mode="force")
    assert rr.identical, rr.format()
    again = rr.value
    assert again.syncer.val == res.syncer.val
    for (n, a), (_, b) in zip(again.syncer.state, res.syncer.state):
        assert torch.equal(a, b), n
