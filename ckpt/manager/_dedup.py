"""Dedup tracking (spec/format-2.md §V.4): which checkpoint the next save may share files
with, and when a save writes everything."""

from __future__ import annotations

from typing import Any

from ..storage import Storage

__all__ = ["DedupSource"]


class DedupSource:
    """The checkpoint the next save may share files of (the last one committed or
    resumed from), and the count of dedup saves (every ``full_every``-th writes all)."""

    def __init__(self, enabled: bool, full_every: int) -> None:
        self.enabled = enabled
        self.full_every = full_every
        #: the checkpoint the next save may share files of
        self.source: str | None = None
        self._saves = 0

    def reuse(self, rank: int, storage: Storage) -> Any:
        """This rank's part of the previous checkpoint, for a dedup save to share files of
        (format-2.md §V.4); None for a full save. Every rank decides alike: the source and
        the save count are the same on all of them."""
        if not self.enabled or self.source is None:
            return None
        self._saves += 1
        if self.full_every and self._saves % self.full_every == 0:
            return None  # a full save bounds how many checkpoints share one file's fate
        from ..writer import part_name_for_rank, reuse_from

        return reuse_from(self.source, part_name_for_rank(rank), storage=storage)
