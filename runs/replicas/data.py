"""The data position of a replica run: one global stream, replicated on every replica.

Step ``t``'s global batch is the next global batch of a ``ckpt.data.ResumableLoader``
(every replica holds the same one), split over the ranks that take part in the attempt,
in quorum order. The cursor moves only when the step is committed: the samples of an
attempt that failed (a group died in it) are handed out again at the retry, split over
the survivors (policy ``redistribute``), or skipped (``drop``), and a ``data_reassign``
event says which. Nothing is lost silently, and a joiner takes its peer's cursor with
the rest of the state. torchft's own ``DistributedSampler`` instead shards the data by
replica rank and "occasionally drops batches on rejoining"; a dead group's shard is
never read.
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt.data import ResumableLoader

__all__ = ["GlobalCursor", "share"]


class _Ids(torch.utils.data.Dataset):
    """Sample ``i`` is its own id: the loader serves ids, each rank gathers its rows."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(i)


class GlobalCursor:
    """The replicated data position: a ``ckpt.data.ResumableLoader`` of the whole global
    batch (one "rank": every replica holds the same cursor), peeked at by each attempt and
    moved only by a committed (or, policy ``drop``, a dropped) step. ``loader`` is the
    data field of every checkpoint (the periodic ones and the recovery stream), and the
    loss-spike guard edits its order (skip or defer a window)."""

    def __init__(self, n: int, *, seed: int, global_batch: int) -> None:
        self.loader = ResumableLoader(_Ids(n), seed=seed, global_batch_size=global_batch, world_size=1, rank=0,
                                      seed_sample_rngs=False)
        self._it: Any = None
        self._at: tuple[int, int] | None = None  # the cursor the live iterator stands at

    def peek(self) -> list[int]:
        """The sample ids of the next global batch (does not move)."""
        return [int(i) for i in self.loader.peek(1)[0][1]]

    def advance(self) -> None:
        # a load or an edit (a rollback) makes a live iterator stale: a fresh one then
        if self._it is None or self._at != self.loader.cursor:
            self._it = iter(self.loader)
        try:
            next(self._it)
        except StopIteration:  # the epoch is over: the next iter() starts the next one
            self._it = iter(self.loader)
            next(self._it)
        self._at = self.loader.cursor

    def position(self) -> tuple[int, int]:
        """(epoch, loader step) of the next global batch."""
        return self.loader.upcoming(1)[0]

    def reset(self) -> None:
        """After a load or an edit: the next advance starts a fresh iterator."""
        self._it = None

    def skip(self) -> None:
        """Policy drop: the failed attempt's samples are skipped, the stream moves on."""
        self.advance()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()


def share(n: int, participants: int, replica_rank: int, group_size: int, group_rank: int) -> tuple[int, int]:
    """This rank's contiguous share [lo, hi) of a global batch of ``n``: replica
    ``replica_rank`` of ``participants`` takes its slice, rank ``group_rank`` its part of it."""
    lo, hi = n * replica_rank // participants, n * (replica_rank + 1) // participants
    m = hi - lo
    return lo + m * group_rank // group_size, lo + m * (group_rank + 1) // group_size
