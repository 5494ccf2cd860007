"""One process's ledger tape: a single-file tape (spec/tape-format.md §2) in a ledger
directory, and the reader that turns a directory of them back into records.

A tape has exactly one writer, so each process appends to a tape of its own,
``NNNNN.tape`` with the next free number; a resumed run's new process starts a new
tape. Each record is written with one ``os.write`` as the step ends, so a process
killed at any point leaves at most a torn tail (dropped by the §7 rule), never a lost
step that came before. ``ckpt tape show`` reads these tapes like any other.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import CkptError, TapeDataError, TapeTruncatedError
from ..tape import format as fmt
from ..guard.events import RollbackEvent
from .record import (ACTOR_NAME, GuardEntry, LedgerOpen, LedgerRecord, LedgerStep, LedgerValues, ResumeCheck,
                     decode_event, encode_event)

__all__ = ["LedgerTapeWriter", "LedgerTape", "read_ledger_tape", "read_ledger_dir", "ledger_tapes"]

#: a ledger tape is read whole; ~150 bytes a step, so this is millions of steps
MAX_LEDGER_BYTES = 1 << 30
_NAME = re.compile(r"^(\d{5,})\.tape$")


def ledger_tapes(directory: str) -> list[str]:
    """The ledger tapes in ``directory``, oldest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = sorted((int(m.group(1)), n) for n in names if (m := _NAME.match(n)))
    return [os.path.join(directory, n) for _, n in found]


class LedgerTapeWriter:
    """Appends ledger events to a new tape file (never overwrites)."""

    def __init__(self, directory: str, meta: dict[str, Any]) -> None:
        os.makedirs(directory, exist_ok=True)
        existing = ledger_tapes(directory)
        n = int(os.path.basename(existing[-1]).split(".")[0]) + 1 if existing else 0
        while True:
            self.path = os.path.join(directory, f"{n:05d}.tape")
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
                break
            except FileExistsError:
                n += 1
        self._salt = int.from_bytes(secrets.token_bytes(8), "little")
        meta = dict(meta)
        meta["actors"] = []
        os.write(self._fd, fmt.encode_segment_header(run_id=secrets.token_bytes(16), salt=self._salt, segment=0,
                                                     first_seq=0, chain_prev=0, flags=0, meta=meta))
        self._seq = 0
        self._counter = 0
        self.append(ACTOR_NAME)

    def append(self, rec: LedgerRecord, *, step: int = 0) -> None:
        """Tape one record; a step with plain values is followed by its ``ledger_values``."""
        if self._fd < 0:
            raise CkptError("the ledger tape is closed", path=self.path)
        self._append(rec, step)
        if isinstance(rec, LedgerStep) and rec.values:
            self._append(LedgerValues(rec.step, rec.values), rec.step)

    def _append(self, rec: LedgerRecord, step: int) -> None:
        if not isinstance(rec, str):
            self._counter += 1
        kind, body = encode_event(rec, self._counter, step=step)
        raw, _ = fmt.encode_record(self._seq, kind, body, self._salt)
        os.write(self._fd, raw)
        self._seq += 1

    def sync(self) -> None:
        if self._fd >= 0:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.write(self._fd, fmt.encode_record(self._seq, fmt.CLOSE_KIND, b"", self._salt)[0])  # §5.5
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1


@dataclass(slots=True)
class LedgerTape:
    """What one ledger tape holds. ``torn`` is the byte count of a dropped torn tail.
    ``guard``: the loss-spike guard's events (spec/loss-guard.md §6); ``rollbacks``:
    ``(len(steps) when it was taped, to_step)`` per rollback, the cut that voids the
    earlier records of later steps (spec/tape-format.md §6.3 rule 5)."""

    path: str
    meta: dict[str, Any]
    opens: list[LedgerOpen] = field(default_factory=list)
    steps: list[LedgerStep] = field(default_factory=list)
    checks: list[ResumeCheck] = field(default_factory=list)
    guard: list[GuardEntry] = field(default_factory=list)
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    torn: int = 0

    @property
    def run_id(self) -> str:
        return str(self.meta.get("run_id") or (self.opens[0].run_id if self.opens else ""))


def read_ledger_tape(path: str) -> LedgerTape:
    """Decode one ledger tape; a torn tail is dropped (and counted), anything else that
    does not decode raises ``TapeDataError`` naming the file and offset."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise TapeTruncatedError("empty ledger tape: its header was never written", path=path, offset=0)
        if size > MAX_LEDGER_BYTES:
            raise TapeDataError(f"ledger tape of {size} bytes above the {MAX_LEDGER_BYTES} byte limit", path=path)
        data = f.read(MAX_LEDGER_BYTES + 1)
    try:
        hdr = fmt.decode_segment_header(data)
        tape = LedgerTape(path, dict(hdr.meta))
        scan = fmt.Scan()
        for fr in fmt.scan_segment(data, hdr, final=True, scan=scan, where=f" in {path}"):
            rec = decode_event(fr.kind, fr.body, where=f" in {path} at offset {fr.offset}")
            if isinstance(rec, LedgerOpen):
                tape.opens.append(rec)
            elif isinstance(rec, LedgerStep):
                tape.steps.append(rec)
            elif isinstance(rec, LedgerValues):
                if not tape.steps or tape.steps[-1].step != rec.step:
                    raise TapeDataError(f"ledger_values of step {rec.step} does not follow that step's ledger_step",
                                        path=path, offset=fr.offset)
                tape.steps[-1] = replace(tape.steps[-1], values=rec.values)
            elif isinstance(rec, ResumeCheck):
                tape.checks.append(rec)
            elif isinstance(rec, GuardEntry):
                tape.guard.append(rec)
                if isinstance(rec.record, RollbackEvent):
                    tape.rollbacks.append((len(tape.steps), rec.record.to_step))
            elif rec is None:
                raise TapeDataError(f"event kind {fr.kind} on a ledger tape", path=path, offset=fr.offset)
        tape.torn = scan.dropped
    except TapeDataError as e:
        raise e.located(path=path) from None
    return tape


def read_ledger_dir(directory: str) -> tuple[list[LedgerTape], list[str]]:
    """Every readable tape in a ledger directory, oldest first, and one problem line per
    tape that could not be read (it is left out, never half-used)."""
    tapes, problems = [], []
    for p in ledger_tapes(directory):
        try:
            tapes.append(read_ledger_tape(p))
        except TapeTruncatedError:
            continue  # the header itself never finished: a tape that was never written (§7 rule 2)
        except (TapeDataError, OSError, ValueError) as e:
            problems.append(f"{p}: {e}")
    return tapes, problems
