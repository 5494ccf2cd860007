"""Repairing a tape with a torn tail: truncate it explicitly, then rebuild the step index.

A crash while a record is being appended leaves a torn tail (tape-format.md §7); the
reader stops before it. ``repair`` cuts the files back to the last valid record (whole
segments after it are removed), reporting every byte it drops, and rebuilds the index.
A corrupt record in the middle is refused (``TapeCorruptError``) unless ``salvage``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from replay.tape.reader import TapeReader

__all__ = ["Cut", "RepairReport", "repair"]


@dataclass(frozen=True, slots=True)
class Cut:
    file: str
    old_size: int
    new_size: int
    remove: bool  # a segment left empty is removed (never the first)


@dataclass(frozen=True, slots=True)
class RepairReport:
    path: str
    cuts: tuple[Cut, ...]  # empty: nothing to repair
    records: int  # valid records kept
    reason: str  # why the tail is invalid (the reader's torn reason)
    applied: bool  # False for a dry run

    @property
    def dropped_bytes(self) -> int:
        return sum(c.old_size - c.new_size for c in self.cuts)


def repair(path: str | os.PathLike[str], *, dry_run: bool = False, salvage: bool = False) -> RepairReport:
    """Truncate ``path``'s torn tail (every valid record is kept) and rebuild its index."""
    r = TapeReader(path)
    if salvage:
        for _ in r.frames(salvage=True):
            pass
    else:
        r.verify()  # raises on a corrupt middle record
    seg, end = r.valid_end
    cuts: list[Cut] = []
    for i, p in enumerate(r.segment_paths):
        size = p.stat().st_size
        if i == seg and size > end:
            cuts.append(Cut(str(p), size, end, end == 0 and i != 0))
        elif i > seg:
            cuts.append(Cut(str(p), size, 0, i != 0))
    report = RepairReport(str(path), tuple(cuts), r.records, r.torn_reason or "torn tail", not dry_run and bool(cuts))
    if dry_run or not cuts:
        return report
    for c in cuts:
        if c.remove:
            os.remove(c.file)
        else:
            with open(c.file, "r+b") as fh:
                fh.truncate(c.new_size)
                fh.flush()
                os.fsync(fh.fileno())
    TapeReader(Path(path)).rebuild_index()
    return report
