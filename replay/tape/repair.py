"""Repairing a tape with a torn tail: truncate it explicitly, then rebuild the step index.

A crash while a record is being appended leaves a torn tail (tape-format.md §7); the
reader stops before it. ``repair`` cuts the files back to the last valid record (whole
segments after it are removed), reporting every byte it drops, and rebuilds the index.
A corrupt record in the middle is refused (``TapeCorruptError``) unless ``salvage``.
It never writes through a symbolic link (a symlinked segment is refused; the index is
written under a fresh name and renamed), and a repaired tape stays "not closed".
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from replay.errors import TapeFormatError
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


def _truncate_no_follow(path: str, size: int) -> None:
    """Truncate a segment in place, refusing a symlink (it could point outside the tape)."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise TapeFormatError("segment is a symbolic link; repair never writes through one", path=path) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TapeFormatError("segment is not a regular file", path=path)
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def repair(path: str | os.PathLike[str], *, dry_run: bool = False, salvage: bool = False) -> RepairReport:
    """Truncate ``path``'s torn tail (every valid record is kept) and rebuild its index."""
    r = TapeReader(path)
    if salvage:
        for _ in r.frames(salvage=True):
            pass
    else:
        # Framing only (not verify): a wrong step index must not block the repair that rebuilds it.
        for _ in r.frames():  # raises on a corrupt middle record
            pass
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
            os.remove(c.file)  # removes a link itself, never its target
        else:
            _truncate_no_follow(c.file, c.new_size)
    TapeReader(Path(path)).rebuild_index()
    return report
