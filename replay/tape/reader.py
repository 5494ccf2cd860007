"""Tape reader: one file or a segment directory, validated as it is read.

The reader never returns a record it has not checksummed, never skips one, and
applies the torn-tail rule only to the last segment. ``dropped_bytes`` and
``torn_reason`` tell what a torn tail cost once iteration has finished.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from replay.clock import VectorClock
from replay.errors import TapeCorruptError, TapeError, TapeFormatError, TapeTruncatedError
from replay.events import KIND_BY_CODE, Event
from replay.tape import format as fmt
from replay.tape.index import IndexEntry, read_index, write_index
from replay.tape.writer import index_path

__all__ = ["TapeReader", "VerifyReport", "decode_event", "read_events", "EVENT_HEAD", "CLOCK_ENTRY"]

EVENT_HEAD = struct.Struct("<qHH")  # step, actor id, clock entry count
CLOCK_ENTRY = struct.Struct("<HQ")
_STEP = struct.Struct("<q")
_ACTOR_KIND = 1


@dataclass(frozen=True, slots=True)
class VerifyReport:
    path: str
    segments: int
    records: int
    events: int
    valid_bytes: int
    dropped_bytes: int
    torn_reason: str
    last_seq: int
    closed: bool  # ends with a close record (§5.5); False: the writer never finished, or the end is lost
    index: str  # "ok", "absent", "ignored (...)" (damaged or foreign: a hint that is not used)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def decode_event(frame: fmt.Frame, names: list[str], where: str = "") -> Event:
    """Decode an event body; an ``actor`` event appends its name to ``names``."""
    body = frame.body
    try:
        kind = KIND_BY_CODE[frame.kind]
    except KeyError:
        raise TapeFormatError(f"unknown event kind code {frame.kind}{where}", seq=frame.seq, offset=frame.offset) from None
    if len(body) < EVENT_HEAD.size:
        raise TapeFormatError(f"event body too short{where}", seq=frame.seq, offset=frame.offset)
    step, actor_id, ncl = EVENT_HEAD.unpack_from(body, 0)
    pos = EVENT_HEAD.size + CLOCK_ENTRY.size * ncl
    if pos > len(body):
        raise TapeFormatError(f"event clock runs past the body{where}", seq=frame.seq, offset=frame.offset)
    raw = bytes(body[pos:])
    if kind.code == _ACTOR_KIND:
        if ncl:  # §6.1: a declaration happens before its actor has a clock
            raise TapeFormatError(f"actor declaration carries a {ncl}-entry clock (must be empty){where}",
                                  seq=frame.seq, offset=frame.offset)
        if actor_id != len(names):
            raise TapeFormatError(f"actor declared with id {actor_id}, expected {len(names)}{where}", seq=frame.seq,
                                  offset=frame.offset)
        names.append(kind.unpack(raw)["name"])
    if actor_id >= len(names):
        raise TapeFormatError(f"event refers to undeclared actor id {actor_id}{where}", seq=frame.seq,
                              offset=frame.offset)
    entries = []
    flat = struct.unpack_from("<" + "HQ" * ncl, body, EVENT_HEAD.size) if ncl else ()
    prev = -1
    for i in range(0, 2 * ncl, 2):
        aid, counter = flat[i], flat[i + 1]
        # Canonical: ids strictly increasing, counters non-zero, ids declared.
        if aid <= prev or counter == 0 or aid >= len(names):
            raise TapeFormatError(f"non-canonical event clock{where}", seq=frame.seq, offset=frame.offset)
        prev = aid
        entries.append((names[aid], counter))
    return Event(frame.seq, names[actor_id], VectorClock(tuple(entries)), step, kind, raw)


class _Segment:
    __slots__ = ("path", "data", "size")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        if self.size == 0:
            self.data: bytes | mmap.mmap = b""
        else:
            with open(path, "rb") as f:
                # Mapped, not read: a long single-file tape costs address space, not memory.
                self.data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


class TapeReader:
    """Read and validate a tape (file or segment directory)."""

    def __init__(self, path: str | os.PathLike[str], *, torn_ok: bool = True) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"no tape at {self.path}")
        self.is_dir = self.path.is_dir()
        self.torn_ok = torn_ok
        if self.is_dir:
            names = sorted(p.name for p in self.path.iterdir() if p.name.endswith(".seg"))
            if not names:
                raise TapeFormatError("tape directory holds no segments", path=str(self.path))
            for i, n in enumerate(names):
                if n != f"{i:08d}.seg":
                    raise TapeCorruptError(f"segment {i:08d}.seg missing (found {n})", path=str(self.path))
            self.segment_paths = [self.path / n for n in names]
        else:
            self.segment_paths = [self.path]
        first = _Segment(self.segment_paths[0])
        try:
            self.header = fmt.decode_segment_header(first.data)
        except TapeError as e:
            raise e.located(path=e.path or str(self.segment_paths[0])) from None
        self.dropped_bytes = 0
        self.torn_reason = ""
        self.valid_end: tuple[int, int] = (0, self.header.size)
        self.records = 0
        self.last_seq = -1
        self.closed = False
        self._actors: list[str] = []

    # -- metadata ----------------------------------------------------------------------
    @property
    def meta(self) -> dict[str, Any]:
        return {k: v for k, v in self.header.meta.items() if k != "actors"}

    @property
    def run_id(self) -> bytes:
        return self.header.run_id

    @property
    def actors(self) -> list[str]:
        return list(self._actors)

    @property
    def index_path(self) -> Path:
        return index_path(self.path, self.is_dir)

    # -- frames ---------------------------------------------------------------------------
    def _segment_header(self, i: int, seg: _Segment, final: bool) -> fmt.SegmentHeader | None:
        try:
            hdr = fmt.decode_segment_header(seg.data)
        except TapeTruncatedError:
            if final and i > 0 and self.torn_ok:
                return None  # a segment whose header never finished: never written
            raise
        if hdr.run_id != self.header.run_id or hdr.segment != i or hdr.flags != self.header.flags:
            raise TapeCorruptError("segment belongs to another tape or is out of place", path=str(seg.path),
                                   segment=i)
        if i == 0 and (hdr.first_seq != 0 or hdr.chain_prev != 0):
            # §3: a tape's first segment starts at seq 0 with no chain link; anything else
            # is a tape missing its beginning (or a segment cut out of another tape).
            raise TapeCorruptError(f"first segment starts at seq {hdr.first_seq} (chain_prev {hdr.chain_prev:#x}); "
                                   "a tape starts at seq 0", path=str(seg.path), segment=0, offset=48)
        return hdr

    def frames(self, *, start_segment: int = 0, salvage: bool = False) -> Iterator[tuple[int, fmt.Frame]]:
        """Yield ``(segment, frame)`` for every valid record, in order."""
        n = len(self.segment_paths)
        self.records, self.dropped_bytes, self.torn_reason, self.last_seq = 0, 0, "", -1
        self.closed = False
        next_seq: int | None = None
        last_ck = 0
        for i in range(start_segment, n):
            seg = _Segment(self.segment_paths[i])
            final = i == n - 1
            where = f" in {seg.path}"
            try:
                hdr = self._segment_header(i, seg, final)
            except TapeError as e:
                if salvage:
                    self.torn_reason = f"segment {i}: {e.message}"
                    self.dropped_bytes = seg.size
                    return
                raise
            if hdr is None:
                self.dropped_bytes, self.torn_reason = seg.size, "truncated segment header"
                return
            if next_seq is not None and (hdr.first_seq != next_seq or (hdr.chain and hdr.chain_prev != last_ck)):
                raise TapeCorruptError(f"segment starts at seq {hdr.first_seq}, expected {next_seq}{where}",
                                       offset=0, seq=next_seq)
            scan = fmt.Scan()
            for fr in fmt.scan_segment(seg.data, hdr, final=final, scan=scan, where=where, torn_ok=self.torn_ok,
                                       salvage=salvage):
                yield i, fr
            next_seq, last_ck = scan.next_seq, scan.last_checksum
            self.records += scan.records
            self.last_seq = scan.next_seq - 1
            self.valid_end = (i, scan.end)
            self.closed = scan.closed
            if scan.torn_reason:
                self.torn_reason = scan.torn_reason
                self.dropped_bytes = scan.dropped
                if salvage:
                    return

    def events(self, *, from_step: int | None = None) -> Iterator[Event]:
        """Decode every event in tape order (from the first with step >= ``from_step``).

        With ``from_step`` the step index lets the reader skip *decoding* the records
        before the entry it names; every skipped record is still validated and its step
        read, and one at or above the entry's step (a wrong or forged index, §10) raises
        :class:`TapeCorruptError` instead of silently dropping events."""
        names: list[str] = self._actors
        names.clear()
        start_seq, limit_step = 0, 0
        if from_step is not None:
            entry = self._seek_entry(from_step)
            if entry is not None:
                start_seq, limit_step = entry.seq, entry.step
        for i, fr in self.frames():
            if fr.seq < start_seq and fr.kind != _ACTOR_KIND:
                if len(fr.body) >= 8 and _STEP.unpack_from(fr.body, 0)[0] >= limit_step:
                    raise TapeCorruptError(f"step index {self.index_path} is wrong: record seq {fr.seq} before its "
                                           f"entry (step {limit_step}, seq {start_seq}) has step "
                                           f"{_STEP.unpack_from(fr.body, 0)[0]}", path=str(self.segment_paths[i]),
                                           offset=fr.offset, seq=fr.seq)
                continue  # validated, not decoded: the index let us skip it
            ev = decode_event(fr, names, f" in {self.segment_paths[i]}")
            if from_step is not None and ev.step < from_step:
                continue
            yield ev

    # -- index ---------------------------------------------------------------------------
    def index(self) -> list[IndexEntry] | None:
        return read_index(self.index_path, self.run_id)

    def _seek_entry(self, step: int) -> IndexEntry | None:
        entries = self.index()
        if not entries:
            return None
        # The last entry at or below ``step``: its guarantee (no earlier non-actor record
        # has a step >= its step) makes everything before it safe to skip. An entry above
        # ``step`` would skip the events of steps in between if the index is sparse.
        best = None
        for e in entries:
            if e.step > step:
                break
            best = e
        return best if best is not None and self._entry_valid(best) else None

    def _entry_valid(self, e: IndexEntry) -> bool:
        # The tape is the authority: trust an entry only if the frame it names is there.
        if e.segment >= len(self.segment_paths):
            return False
        seg = _Segment(self.segment_paths[e.segment])
        if e.offset + fmt.RECORD_HEADER > seg.size:
            return False
        _c, _n, kind, _f, seq, _s, _p = struct.unpack_from("<QIHHQQQ", seg.data, e.offset)
        return seq == e.seq or (kind == fmt.BLOCK_KIND and seq <= e.seq)

    def rebuild_index(self) -> list[IndexEntry]:
        """Recompute the step index from the tape and replace the sidecar."""
        entries = self._expected_index(decode_payloads=False)[0]
        write_index(self.index_path, self.run_id, entries)
        return entries

    def _expected_index(self, *, decode_payloads: bool) -> tuple[list[IndexEntry], int]:
        """The index the tape implies (§10), and the number of events; validates every record."""
        names: list[str] = []
        entries: list[IndexEntry] = []
        top: int | None = None
        n = 0
        for i, fr in self.frames():
            where = f" in {self.segment_paths[i]}"
            ev = decode_event(fr, names, where)
            if decode_payloads:
                try:
                    ev.payload
                except TapeError as e:
                    raise e.located(e.message + where, offset=fr.offset) from None
            n += 1
            # Actor declarations are bookkeeping: §10's guarantee excludes them (a seek
            # decodes every declaration it passes), so the index does not point at them.
            if fr.kind != _ACTOR_KIND and (top is None or ev.step > top):
                top = ev.step
                entries.append(IndexEntry(ev.step, ev.seq, i, fr.offset))
        return entries, n

    def _check_index(self, expected: list[IndexEntry]) -> str:
        """Compare the sidecar with the index the records imply (§10 "Validation")."""
        p = self.index_path
        if not p.exists() and not p.is_symlink():
            return "absent"
        got = read_index(p, self.run_id)
        if got is None:
            return "ignored (damaged, foreign or unreadable; `ckpt tape repair` rebuilds it)"
        for k, (g, x) in enumerate(zip(got, expected)):
            if g != x:
                raise TapeCorruptError(f"step index entry {k} is {g} but the records give {x}", path=str(p),
                                       offset=32 + 32 * k)
        if self.closed and len(got) != len(expected):
            raise TapeCorruptError(f"step index has {len(got)} entries, the closed tape's records give "
                                   f"{len(expected)}", path=str(p), offset=32 + 32 * min(len(got), len(expected)))
        # A tape that was not closed may have entries past its last record (the writer
        # writes an entry before the record it names) or lack its last ones (not synced).
        return "ok"

    # -- whole-tape operations -------------------------------------------------------------
    def verify(self) -> VerifyReport:
        """Read every record, decode every event and payload, check the step index; raises on corruption."""
        expected, n = self._expected_index(decode_payloads=True)
        index = self._check_index(expected)
        seg, end = self.valid_end
        valid = sum(p.stat().st_size for p in self.segment_paths[:seg]) + end
        return VerifyReport(str(self.path), len(self.segment_paths), self.records, n, valid, self.dropped_bytes,
                            self.torn_reason, self.last_seq, self.closed, index)


def read_events(path: str | os.PathLike[str], **kw: Any) -> list[Event]:
    return list(TapeReader(path).events(**kw))

