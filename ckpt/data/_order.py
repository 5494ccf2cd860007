"""The global sample order of one epoch: a keyed bijection on ``[0, n)``.

``EpochOrder(n, seed, epoch).index(p)`` is the dataset index at global position ``p``.
It is a six-round balanced Feistel network on ``2h`` bits (the smallest even width with
``2**(2h) >= n``), restricted to ``[0, n)`` by cycle walking (Black & Rogaway 2002,
"Ciphers with arbitrary finite domains"): apply the network until the value lands in
range. Because the network is a permutation of the larger domain, the walk terminates
and the restriction is a permutation of ``[0, n)``; the expected walk is below 4 steps.

Why not ``torch.randperm``: its algorithm is not specified and has changed between
releases, it materialises ``n`` values per epoch, and it cannot answer "which sample is
at position p" without building the whole permutation. This network is O(1) per
position, needs no memory, and is plain integer arithmetic, so the order is the same on
every platform and torch version. ``tests/ckpt/data/test_data_order.py`` pins test vectors.

The round function only multiplies 32-bit values by constants below ``2**31``, so every
intermediate fits in a signed int64. The same code therefore runs on Python ints (the
reference) and, vectorised, on int64 tensors (the fast path), with identical results.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from ._mix import M64, TAG_PERMUTATION, mix64

__all__ = ["EpochOrder", "MAX_SAMPLES"]

_ROUNDS = 6
_M32 = 0xFFFF_FFFF
#: The largest dataset the order supports (the network is built on at most 62 bits so
#: that ``(left << half) | right`` stays a non-negative int64).
MAX_SAMPLES = 1 << 62

# Below this many positions, Python ints beat the per-op overhead of small tensors
# (about 7 us per index against about 50 us per walk step of ~40 tensor ops).
_SCALAR_BELOW = 32

_T = TypeVar("_T", int, torch.Tensor)


def _round(r: _T, key: int) -> _T:
    # A 32-bit integer hash in the style of Wellons' "lowbias32", with multipliers
    # chosen below 2**31 so that (2**32 - 1) * c < 2**63: no int64 overflow.
    y = (r ^ key) & _M32
    y = (y * 0x7FEB352D) & _M32
    y = y ^ (y >> 15)
    y = (y * 0x2C1B3C6D) & _M32
    y = y ^ (y >> 12)
    y = (y * 0x297A2D39) & _M32
    return y ^ (y >> 15)


class EpochOrder:
    """The permutation of ``[0, num_samples)`` for one ``(seed, epoch)``.

    It does not depend on world size, rank, batch size or worker count; those only
    decide who consumes which positions.
    """

    __slots__ = ("num_samples", "seed", "epoch", "_half", "_mask", "_keys")

    def __init__(self, num_samples: int, seed: int, epoch: int) -> None:
        if not 0 < num_samples <= MAX_SAMPLES:
            raise ValueError(f"num_samples must be in [1, 2^62], got {num_samples}")
        if not 0 <= seed <= M64:
            raise ValueError(f"seed must be in [0, 2^64), got {seed}")
        if not 0 <= epoch <= M64:
            raise ValueError(f"epoch must be in [0, 2^64), got {epoch}")
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = epoch
        bits = max(2, (num_samples - 1).bit_length())
        bits += bits & 1
        self._half = bits // 2
        self._mask = (1 << self._half) - 1
        self._keys = tuple(mix64(TAG_PERMUTATION, seed, epoch, r) & _M32 for r in range(_ROUNDS))

    def _network(self, x: _T) -> _T:
        half, mask = self._half, self._mask
        left = x >> half
        right = x & mask
        for key in self._keys:
            left, right = right, left ^ (_round(right, key) & mask)
        return (left << half) | right

    def index(self, position: int) -> int:
        """The dataset index at ``position`` (reference implementation on Python ints)."""
        if not 0 <= position < self.num_samples:
            raise IndexError(f"position {position} outside [0, {self.num_samples})")
        x = self._network(position)
        while x >= self.num_samples:
            x = self._network(x)
        return x

    def indices(self, positions: Sequence[int] | torch.Tensor) -> list[int]:
        """``[self.index(p) for p in positions]``, vectorised over an int64 tensor."""
        if not isinstance(positions, torch.Tensor) and len(positions) <= _SCALAR_BELOW:
            return [self.index(p) for p in positions]
        pos = torch.as_tensor(positions, dtype=torch.int64)
        if pos.numel() == 0:
            return []
        if int(pos.min()) < 0 or int(pos.max()) >= self.num_samples:
            raise IndexError(f"positions outside [0, {self.num_samples})")
        x = self._network(pos)
        out = x >= self.num_samples
        while bool(out.any()):
            x[out] = self._network(x[out])
            out = x >= self.num_samples
        return x.tolist()

    def __repr__(self) -> str:
        return f"EpochOrder(num_samples={self.num_samples}, seed={self.seed}, epoch={self.epoch})"
