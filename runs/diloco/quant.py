"""Low-bit communication of outer gradients and fragment updates (Streaming / Decoupled
DiLoCo's int4): per-block absmax scales, symmetric uniform levels, packed bits.

A tensor is flattened and cut into blocks of ``block`` elements (the last one may be
shorter). Each block has one float32 scale ``s`` = its largest magnitude; an element
``x`` becomes the integer level ``round(x / s * L)`` in ``[-L, L]`` with ``L = 2**(b-1) - 1``
levels a side (b = 2: {-1, 0, 1}; b = 4: 15 levels), and is decoded as ``level * s / L``.
One bit keeps the sign only: ``+s`` or ``-s`` with ``s`` the block's mean magnitude (signSGD
with a scale). 16 bits are float16 values, 32 bits the float32 values themselves.

Levels are stored as ``level + L`` (or the sign bit) in ``b`` bits each, packed little end
first into uint8 (b = 2: four to a byte). What travels, and what the tape digests, is the
packed bytes and the scales: the receiver decodes exactly what was sent, so a replay
decodes the same bits. Pure functions of CPU tensors: bit-reproducible.

Error feedback is the caller's: it keeps ``residual = value - decode(encode(value))`` and
adds it to the next value (learners), or encodes the difference to what the receiver
holds (the syncer's broadcast), which corrects the error at the next send by itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Encoded", "encode", "decode", "encoded_nbytes", "BITS"]

BITS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Encoded:
    """One tensor as sent: the packed levels (uint8) and the per-block scales (float32)."""

    bits: int
    shape: tuple[int, ...]
    packed: torch.Tensor
    scales: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales]


def _levels(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def encode(x: torch.Tensor, bits: int, block: int = 64) -> Encoded:
    """``x`` (any float dtype) at ``bits`` bits per element."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    shape = tuple(x.shape)
    flat = x.detach().reshape(-1).to(torch.float32)
    if bits == 32:
        return Encoded(32, shape, flat.clone(), torch.zeros(0, dtype=torch.float32))
    if bits == 16:
        return Encoded(16, shape, flat.to(torch.float16), torch.zeros(0, dtype=torch.float32))
    n = flat.numel()
    nb = (n + block - 1) // block
    pad = torch.zeros(nb * block, dtype=torch.float32)
    pad[:n] = flat
    blocks = pad.view(nb, block)
    if bits == 1:
        counts = torch.full((nb,), float(block))
        if n % block:
            counts[-1] = float(n % block)
        scales = blocks.abs().sum(1) / counts
        codes = (blocks >= 0).to(torch.uint8)
    else:
        L = _levels(bits)
        scales = blocks.abs().amax(1)
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        lv = torch.round(blocks / safe[:, None] * L).clamp_(-L, L)
        codes = (lv + L).to(torch.uint8)
    codes = codes.reshape(-1)[:n]
    return Encoded(bits, shape, _pack(codes, bits), scales.contiguous())


def decode(e: Encoded, block: int = 64) -> torch.Tensor:
    """The float32 tensor ``e`` stands for."""
    n = 1
    for d in e.shape:
        n *= d
    if e.bits == 32:
        return e.packed.reshape(e.shape).clone()
    if e.bits == 16:
        return e.packed.to(torch.float32).reshape(e.shape)
    codes = _unpack(e.packed, e.bits, n).to(torch.float32)
    nb = (n + block - 1) // block
    pad = torch.zeros(nb * block, dtype=torch.float32)
    pad[:n] = codes
    blocks = pad.view(nb, block)
    if e.bits == 1:
        vals = (blocks * 2 - 1) * e.scales[:, None]
    else:
        L = _levels(e.bits)
        vals = (blocks - L) * (e.scales[:, None] / L)
    return vals.reshape(-1)[:n].reshape(e.shape)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.clone()
    per = 8 // bits
    n = codes.numel()
    m = (n + per - 1) // per
    pad = torch.zeros(m * per, dtype=torch.int32)
    pad[:n] = codes.to(torch.int32)
    lanes = pad.view(m, per)
    out = torch.zeros(m, dtype=torch.int32)
    for i in range(per):  # little end first: element i of a byte sits at bits [i*b, (i+1)*b)
        out |= lanes[:, i] << (i * bits)
    return out.to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits == 8:
        return packed[:n].to(torch.int32)
    per = 8 // bits
    mask = (1 << bits) - 1
    p = packed.to(torch.int32)
    lanes = torch.stack([(p >> (i * bits)) & mask for i in range(per)], dim=1)
    return lanes.reshape(-1)[:n]


def encoded_nbytes(es: Sequence[Encoded]) -> int:
    """Bytes on the wire: the packed levels and the scales."""
    return sum(e.packed.numel() * e.packed.element_size() + e.scales.numel() * 4 for e in es)
