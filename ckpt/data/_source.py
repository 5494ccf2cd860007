"""Where samples come from: a map-style dataset or a ``ShardSource``, behind one flat index.

Both kinds are addressed by a flat *dataset index* in ``[0, num_samples)``. For a shard
source, index ``i`` is sample ``i - start[s]`` of the shard ``s`` whose range holds it,
with shards laid end to end in shard order. The shard sizes are read once, at
construction; the flat index is then a prefix-sum table and a bisection, so locating a
sample costs O(log shards) and never opens a file.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol, runtime_checkable

__all__ = ["ShardSource", "FlatSource"]


@runtime_checkable
class ShardSource(Protocol):
    """A sharded source with random access inside each shard (e.g. a list of files).

    A source whose shards can only be read sequentially can still implement ``read`` by
    caching the open shard and its cursor; the loader visits positions in a shuffled
    order, so such a source should be paired with cheap seeks.

    The object is sent to DataLoader worker processes, so it must be picklable (hold
    paths, open files lazily).
    """

    def num_shards(self) -> int:
        """How many shards there are."""
        ...

    def shard_size(self, shard: int) -> int:
        """How many samples shard ``shard`` holds (>= 0)."""
        ...

    def read(self, shard: int, offset: int) -> Any:
        """Sample ``offset`` of shard ``shard``; may raise for a corrupt shard."""
        ...


class FlatSource:
    """A map-style dataset or a ``ShardSource`` seen as ``num_samples`` flat indices."""

    __slots__ = ("_dataset", "_shards", "_starts", "num_samples", "num_shards")

    def __init__(self, source: Any) -> None:
        self._dataset: Any = None
        self._shards: ShardSource | None = None
        self._starts: list[int] = []
        if isinstance(source, ShardSource):
            count = source.num_shards()
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"ShardSource.num_shards() must be an int >= 0, got {count!r}")
            total = 0
            for shard in range(count):
                size = source.shard_size(shard)
                if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                    raise ValueError(f"ShardSource.shard_size({shard}) must be an int >= 0, got {size!r}")
                self._starts.append(total)
                total += size
            self._shards = source
            self.num_samples = total
            self.num_shards = count
        elif hasattr(source, "__getitem__") and hasattr(source, "__len__"):
            self._dataset = source
            self.num_samples = len(source)
            self.num_shards = 0
        else:
            raise TypeError(
                f"source must be a map-style dataset (__len__ and __getitem__) or a ShardSource, "
                f"got {type(source).__name__}"
            )

    @property
    def sharded(self) -> bool:
        return self._shards is not None

    def locate(self, index: int) -> tuple[int | None, int]:
        """``(shard, offset)`` of a flat index; ``shard`` is None for a map-style dataset."""
        if self._shards is None:
            return None, index
        # bisect_right - 1 skips empty shards: their start equals the next shard's start.
        shard = bisect.bisect_right(self._starts, index) - 1
        return shard, index - self._starts[shard]

    def read(self, shard: int | None, offset: int) -> Any:
        if self._shards is None:
            return self._dataset[offset]
        assert shard is not None
        return self._shards.read(shard, offset)
