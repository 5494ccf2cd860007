"""The data position of a replica run: one global stream, replicated on every replica.

Step ``t``'s global batch is the next ``global_batch`` positions of the stream (the
epoch's ``ckpt.data.EpochOrder``), split over the ranks that take part in the attempt,
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

from ckpt.data import EpochOrder

__all__ = ["GlobalCursor", "share"]


class GlobalCursor:
    """Stateful: (epoch, position) in the global stream, the data field of the checkpoint."""

    def __init__(self, n: int, *, seed: int, global_batch: int) -> None:
        self.n = n
        self.seed = seed
        self.global_batch = global_batch
        self.epoch = 0
        self.position = 0
        self.skipped = 0

    def peek(self) -> list[int]:
        """The sample ids of the next global batch (does not move)."""
        out = []
        e, p = self.epoch, self.position
        order = EpochOrder(self.n, self.seed, e)
        for _ in range(self.global_batch):
            if p >= self.n:
                e, p = e + 1, 0
                order = EpochOrder(self.n, self.seed, e)
            out.append(order.index(p))
            p += 1
        return out

    def advance(self) -> None:
        p = self.position + self.global_batch
        self.epoch += p // self.n
        self.position = p % self.n

    def skip(self) -> None:
        """Policy drop: the failed attempt's samples are skipped, the stream moves on."""
        self.advance()
        self.skipped += self.global_batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "n": self.n,
                "global_batch": self.global_batch, "skipped": self.skipped}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if (sd["n"], sd["seed"], sd["global_batch"]) != (self.n, self.seed, self.global_batch):
            raise ValueError(f"cursor of another stream: {sd}")
        self.epoch, self.position, self.skipped = int(sd["epoch"]), int(sd["position"]), int(sd["skipped"])


def share(n: int, participants: int, replica_rank: int, group_size: int, group_rank: int) -> tuple[int, int]:
    """This rank's contiguous share [lo, hi) of a global batch of ``n``: replica
    ``replica_rank`` of ``participants`` takes its slice, rank ``group_rank`` its part of it."""
    lo, hi = n * replica_rank // participants, n * (replica_rank + 1) // participants
    m = hi - lo
    return lo + m * group_rank // group_size, lo + m * (group_rank + 1) // group_size
