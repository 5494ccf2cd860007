"""The compressed replica update (SparseLoCo style, spec/stages.md §6): error feedback,
per-chunk top-k, low-bit quantisation of the kept values, and the wire payload.

Pure tensor functions: the worker (``worker.py``) owns the residual and the anchor and
moves the payloads over its taped channels. Sender and receivers decode a payload with the
same function, so the value a sender subtracts from its residual is, bit for bit, the value
every receiver adds to the anchor.

Payload (three tensors): ``offs`` uint8, each kept value's offset in its chunk, chunk by
chunk, offsets ascending within a chunk; ``codes`` uint8, one ``bits``-bit code per kept
value packed ``8 // bits`` to a byte, first value in the low bits (a code is the magnitude
level minus one in its low ``bits - 1`` bits and the sign in its top bit); ``scales``
float32, each chunk's largest kept magnitude. The number of values kept is implicit:
``min(topk, len(chunk))`` per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Payload", "compress", "decode", "kept_count", "error_feedback"]


@dataclass(frozen=True)
class Payload:
    offs: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.offs, self.codes, self.scales]

    @classmethod
    def of(cls, tensors: "tuple[torch.Tensor, ...] | list[torch.Tensor]") -> "Payload":
        if len(tensors) != 3:
            raise ValueError(f"a compressed update has 3 tensors, got {len(tensors)}")
        offs, codes, scales = tensors
        if offs.dtype != torch.uint8 or codes.dtype != torch.uint8 or scales.dtype != torch.float32:
            raise ValueError("compressed update tensors must be uint8, uint8, float32")
        return cls(offs, codes, scales)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _chunks(n: int, chunk: int) -> int:
    return -(-n // chunk)


def kept_count(n: int, chunk: int, topk: int) -> int:
    full, rest = divmod(n, chunk)
    return full * min(topk, chunk) + min(topk, rest)


def _check(n: int, chunk: int, topk: int, bits: int) -> None:
    if not 1 <= chunk <= 256:
        raise ValueError("chunk must be in 1..256 (offsets travel as uint8)")
    if not 1 <= topk <= chunk:
        raise ValueError("topk must be in 1..chunk")
    if bits not in (2, 4, 8):
        raise ValueError("bits must be 2, 4 or 8")
    if n < 1:
        raise ValueError("nothing to compress")


def error_feedback(residual: torch.Tensor, anchor: torch.Tensor, params: torch.Tensor, beta: float) -> torch.Tensor:
    """``beta * residual + (anchor - params)``: the vector an exchange compresses."""
    return residual * beta + (anchor - params)


def compress(e: torch.Tensor, *, chunk: int, topk: int, bits: int) -> Payload:
    """Top-``topk`` magnitudes of every ``chunk`` values of the flat float32 vector ``e``
    (ties: lower index first), quantised to ``bits`` bits."""
    if e.dim() != 1 or e.dtype != torch.float32:
        raise ValueError("compress takes a flat float32 vector")
    n = e.numel()
    _check(n, chunk, topk, bits)
    nch = _chunks(n, chunk)
    mag = torch.full((nch * chunk,), -1.0)  # padding ranks below every real value, zeros included
    mag[:n] = e.abs()
    order = torch.sort(mag.view(nch, chunk), dim=1, descending=True, stable=True).indices[:, :topk]
    offs = torch.sort(order, dim=1).values  # ascending offsets within each chunk
    pos = offs + torch.arange(nch).unsqueeze(1) * chunk
    real = pos < n
    pos, offs = pos[real], offs[real]  # a short last chunk keeps fewer
    vals = e[pos]
    chunk_of = pos // chunk
    scales = torch.zeros(nch, dtype=torch.float32).scatter_reduce(0, chunk_of, vals.abs(), reduce="amax")
    levels = 1 << (bits - 1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[chunk_of]
    q = torch.clamp(torch.round(vals.abs() / safe * levels), 1, levels).to(torch.uint8)
    codes = (q - 1) | ((vals < 0).to(torch.uint8) << (bits - 1))
    return Payload(offs.to(torch.uint8).contiguous(), _pack(codes, bits), scales)


def decode(p: Payload, n: int, *, chunk: int, topk: int, bits: int) -> torch.Tensor:
    """The dense float32 vector of length ``n`` a payload stands for."""
    _check(n, chunk, topk, bits)
    kept = kept_count(n, chunk, topk)
    nch = _chunks(n, chunk)
    if p.offs.numel() != kept or p.scales.numel() != nch or p.codes.numel() != -(-kept * bits // 8):
        raise ValueError(f"payload sizes {p.offs.numel()}/{p.codes.numel()}/{p.scales.numel()} do not fit "
                         f"{n} values (chunk {chunk}, topk {topk}, {bits} bits)")
    per = torch.tensor([min(topk, n - c * chunk) for c in range(nch)])
    chunk_of = torch.repeat_interleave(torch.arange(nch), per)
    pos = chunk_of * chunk + p.offs.to(torch.int64)
    if bool((pos >= n).any()) or bool((p.offs.to(torch.int64) >= chunk).any()):
        raise ValueError("payload offset outside its chunk")
    codes = _unpack(p.codes, bits, kept)
    levels = 1 << (bits - 1)
    q = (codes & (levels - 1)).to(torch.float32) + 1
    sign = torch.where((codes >> (bits - 1)) & 1 == 1, -1.0, 1.0)
    vals = sign * (p.scales[chunk_of] * q / levels)
    out = torch.zeros(n, dtype=torch.float32)
    out[pos] = vals
    return out


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8)
    padded[:n] = codes
    lanes = padded.view(-1, per)
    out = torch.zeros(lanes.shape[0], dtype=torch.uint8)
    for i in range(per):
        out |= lanes[:, i] << (i * bits)
    return out


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    lanes = torch.stack([(packed >> (i * bits)) & mask for i in range(per)], dim=1).reshape(-1)
    return lanes[:n]
