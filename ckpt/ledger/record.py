"""Ledger records and their tape events, pure: bytes in, bytes out.

The ledger is written in the one tape format (spec/tape-format.md): one actor,
``ledger``, declared by an ``actor`` event, then ``ledger_open`` (22), one
``ledger_step`` (23) per optimizer step and ``resume_check`` (24) events. The payload
schemas are rows of the event table in ``replay/events.py`` (and §6.2 of the spec);
``tests/ckpt/test_ledger.py`` checks that ``replay``'s generic decoder reads what this
module writes, field for field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import TapeFormatError

__all__ = [
    "KIND_ACTOR", "KIND_OPEN", "KIND_STEP", "KIND_CHECK", "HAS_BATCH", "HAS_LOSS", "HAS_PARAMS",
    "LedgerOpen", "LedgerStep", "ResumeCheck", "encode_event", "decode_event",
]

KIND_ACTOR = 1
KIND_OPEN = 22
KIND_STEP = 23
KIND_CHECK = 24
HAS_BATCH, HAS_LOSS, HAS_PARAMS = 1, 2, 4
ACTOR_NAME = "ledger"
_ZERO = bytes(16)
MAX_LIST = 1 << 20

_HEAD = struct.Struct("<qHH")  # step, actor id, clock entries
_CLOCK1 = struct.Struct("<HQ")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")


@dataclass(frozen=True, slots=True)
class LedgerOpen:
    """A process started its ledger at ``start_step`` (after restoring ``source``, if any)."""

    run_id: str
    start_step: int
    source: str
    rng: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class LedgerStep:
    """One optimizer step. ``batch``/``loss``/``params`` are None when not recorded."""

    step: int
    rng: tuple[tuple[str, bytes], ...]
    batch: bytes | None = None
    loss: float | None = None
    params: bytes | None = None


@dataclass(frozen=True, slots=True)
class ResumeCheck:
    verdict: str  # exact | diverged | skipped
    first: int
    last: int
    report: str


def _str(out: bytearray, s: str) -> None:
    b = s.encode()
    if len(b) > 0xFFFF:
        b = b[:0xFFFF].decode(errors="ignore").encode()  # a report longer than a str field is cut, never refused
    out += _U16.pack(len(b))
    out += b


def _digests(out: bytearray, items: tuple[tuple[str, bytes], ...]) -> None:
    out += _U32.pack(len(items))
    for name, d in items:
        _str(out, name)
        out += d


def encode_event(rec: LedgerOpen | LedgerStep | ResumeCheck | str, counter: int, *, step: int = 0) -> tuple[int, bytes]:
    """(kind, body) of one ledger event; a ``str`` is the ``actor`` declaration.
    ``counter`` is the ledger actor's clock entry (1, 2, ... per non-actor event)."""
    out = bytearray()
    if isinstance(rec, str):
        out += _HEAD.pack(0, 0, 0)
        _str(out, rec)
        return KIND_ACTOR, bytes(out)
    at = rec.step if isinstance(rec, LedgerStep) else (rec.start_step if isinstance(rec, LedgerOpen) else step)
    out += _HEAD.pack(at, 0, 1)
    out += _CLOCK1.pack(0, counter)
    if isinstance(rec, LedgerOpen):
        _str(out, rec.run_id)
        out += _I64.pack(rec.start_step)
        _str(out, rec.source)
        _digests(out, rec.rng)
        return KIND_OPEN, bytes(out)
    if isinstance(rec, LedgerStep):
        has = (HAS_BATCH if rec.batch is not None else 0) | (HAS_LOSS if rec.loss is not None else 0) | (
            HAS_PARAMS if rec.params is not None else 0)
        out += _U32.pack(has)
        out += rec.batch if rec.batch is not None else _ZERO
        out += _F64.pack(rec.loss if rec.loss is not None else 0.0)
        _digests(out, rec.rng)
        out += rec.params if rec.params is not None else _ZERO
        return KIND_STEP, bytes(out)
    _str(out, rec.verdict)
    out += _I64.pack(rec.first)
    out += _I64.pack(rec.last)
    _str(out, rec.report)
    return KIND_CHECK, bytes(out)


class _Cursor:
    def __init__(self, body: bytes | memoryview, where: str) -> None:
        self.mv = memoryview(body)
        self.pos = 0
        self.where = where

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.mv):
            raise TapeFormatError(f"ledger event runs past its body{self.where}")
        v = self.mv[self.pos : self.pos + n]
        self.pos += n
        return v

    def unpack(self, s: struct.Struct) -> tuple:
        return s.unpack(self.take(s.size))

    def str(self) -> str:
        (n,) = self.unpack(_U16)
        try:
            return bytes(self.take(n)).decode()
        except UnicodeDecodeError:
            raise TapeFormatError(f"ledger string is not UTF-8{self.where}") from None

    def digests(self) -> tuple[tuple[str, bytes], ...]:
        (n,) = self.unpack(_U32)
        if n > MAX_LIST or n * 18 > len(self.mv) - self.pos:
            raise TapeFormatError(f"ledger digest count {n} does not fit the body{self.where}")
        return tuple((self.str(), bytes(self.take(16))) for _ in range(n))


def decode_event(kind: int, body: bytes | memoryview, *, where: str = "") -> LedgerOpen | LedgerStep | ResumeCheck | str | None:
    """The record of one ledger event; ``None`` for kinds the ledger does not own."""
    if kind not in (KIND_ACTOR, KIND_OPEN, KIND_STEP, KIND_CHECK):
        return None
    c = _Cursor(body, where)
    step, _actor, n = c.unpack(_HEAD)
    c.take(_CLOCK1.size * n)
    if kind == KIND_ACTOR:
        rec: LedgerOpen | LedgerStep | ResumeCheck | str = c.str()
    elif kind == KIND_OPEN:
        run_id = c.str()
        (start,) = c.unpack(_I64)
        rec = LedgerOpen(run_id, start, c.str(), c.digests())
    elif kind == KIND_STEP:
        (has,) = c.unpack(_U32)
        batch = bytes(c.take(16))
        (loss,) = c.unpack(_F64)
        rng = c.digests()
        params = bytes(c.take(16))
        rec = LedgerStep(step, rng, batch if has & HAS_BATCH else None, loss if has & HAS_LOSS else None,
                         params if has & HAS_PARAMS else None)
    else:
        verdict = c.str()
        (first,) = c.unpack(_I64)
        (last,) = c.unpack(_I64)
        rec = ResumeCheck(verdict, first, last, c.str())
    if c.pos != len(c.mv):
        raise TapeFormatError(f"ledger event has {len(c.mv) - c.pos} trailing bytes{where}")
    return rec
