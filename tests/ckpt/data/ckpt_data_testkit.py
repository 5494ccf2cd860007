"""Small datasets and stream helpers shared by tests/ckpt/data/test_data_*.py."""

from __future__ import annotations

import random
from typing import Any

import msgpack
import numpy as np
import torch

from ckpt.data import ResumableLoader


class AugDataset:
    """Map-style: sample i with augmentations drawn from all three global RNGs.

    ``nan_at`` samples have NaN in field ``x``; ``raise_at`` samples raise OSError.
    """

    def __init__(self, n: int, *, nan_at: frozenset[int] = frozenset(), raise_at: frozenset[int] = frozenset()):
        self.n = n
        self.nan_at = nan_at
        self.raise_at = raise_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i in self.raise_at:
            raise OSError(f"cannot read sample {i}")
        return {
            "i": torch.tensor(i),
            "x": torch.tensor(float("nan") if i in self.nan_at else float(i)),
            "t": torch.rand(3),
            "py": torch.tensor(random.random(), dtype=torch.float64),
            "np": torch.tensor(np.random.rand(), dtype=torch.float64),
        }


class ListShards:
    """A ShardSource of ``sizes`` shards; reads of ``bad_shards`` raise OSError."""

    def __init__(self, sizes: list[int], *, bad_shards: frozenset[int] = frozenset()):
        self.sizes = sizes
        self.bad_shards = bad_shards
        self.reads: list[tuple[int, int]] = []

    def num_shards(self) -> int:
        return len(self.sizes)

    def shard_size(self, shard: int) -> int:
        return self.sizes[shard]

    def read(self, shard: int, offset: int) -> dict[str, torch.Tensor]:
        self.reads.append((shard, offset))
        if shard in self.bad_shards:
            raise OSError(f"shard {shard} is corrupt")
        return {"s": torch.tensor(shard), "o": torch.tensor(offset), "t": torch.rand(2)}


def take(loader: ResumableLoader, count: int) -> list[Any]:
    """The next ``count`` batches, crossing epochs; breaks mid-epoch when done."""
    out: list[Any] = []
    while len(out) < count:
        for batch in loader:
            out.append(batch)
            if len(out) == count:
                break
    return out


def assert_streams_equal(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), k
        for key in x:
            assert torch.equal(x[key], y[key]), f"batch {k} field {key}: {x[key]} != {y[key]}"


def via_msgpack(state: dict[str, Any]) -> dict[str, Any]:
    return msgpack.unpackb(msgpack.packb(state), raw=False)
