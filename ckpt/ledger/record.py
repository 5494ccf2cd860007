"""Ledger records and their tape events, pure: bytes in, bytes out.

The ledger is written in the one tape format (spec/tape-format.md): one actor,
``ledger``, declared by an ``actor`` event, then ``ledger_open`` (22), one
``ledger_step`` (23) per optimizer step, each followed by a ``ledger_values`` (72) event
when the step recorded plain values, and ``resume_check`` (24) events. The payload
schemas are rows of the event table in ``replay/events.py`` (and §6.2 of the spec);
``tests/ckpt/test_ledger.py`` checks that ``replay``'s generic decoder reads what this
module writes, field for field.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Union

#: a plain value on the ledger: compared exactly (floats by their bits)
Value = Union[bool, int, float, str, bytes, None]

from ..errors import TapeFormatError
from ..guard import events as guard_events
from ..tape.payload import PayloadReader, PayloadWriter

__all__ = [
    "KIND_ACTOR", "KIND_OPEN", "KIND_STEP", "KIND_CHECK", "KIND_VALUES", "LedgerValues", "Value", "HAS_BATCH", "HAS_LOSS", "HAS_PARAMS",
    "LedgerOpen", "LedgerStep", "ResumeCheck", "GuardEntry", "encode_event", "decode_event", "event_head", "read_head",
]

KIND_ACTOR = 1
KIND_OPEN = 22
KIND_STEP = 23
KIND_CHECK = 24
KIND_VALUES = 72
HAS_BATCH, HAS_LOSS, HAS_PARAMS = 1, 2, 4
ACTOR_NAME = "ledger"
_ZERO = bytes(16)
MAX_LIST = 1 << 20

_HEAD = struct.Struct("<qHH")  # step, actor id, clock entries
_CLOCK1 = struct.Struct("<HQ")


@dataclass(frozen=True, slots=True)
class LedgerOpen:
    """A process started its ledger at ``start_step`` (after restoring ``source``, if any)."""

    run_id: str
    start_step: int
    source: str
    rng: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class LedgerStep:
    """One optimizer step. ``batch``/``loss``/``params`` are None when not recorded.
    ``values``: plain values the step recorded, sorted by name (the script's
    ``values={"lr": lr}``; names starting ``ckpt.`` are the ledger's own, spec §6.3),
    taped as a ``ledger_values`` event right after the ``ledger_step``."""

    step: int
    rng: tuple[tuple[str, bytes], ...]
    batch: bytes | None = None
    loss: float | None = None
    params: bytes | None = None
    values: tuple[tuple[str, Value], ...] = ()


@dataclass(frozen=True, slots=True)
class LedgerValues:
    """The plain values of step ``step`` (the ``ledger_values`` event); a reader folds
    them into that step's ``LedgerStep``."""

    step: int
    values: tuple[tuple[str, Value], ...]


@dataclass(frozen=True, slots=True)
class ResumeCheck:
    """A resume verification on the ledger: the verdict (``exact``, ``diverged`` or ``skipped``),
    the steps compared and the report's text."""

    verdict: str  # exact | diverged | skipped
    first: int
    last: int
    report: str


@dataclass(frozen=True, slots=True)
class GuardEntry:
    """A loss-spike guard event (kinds 48-53, ``ckpt.guard.events``) on the ledger, at ``step``."""

    step: int
    record: guard_events.GuardRecord


LedgerRecord = Union[LedgerOpen, LedgerStep, LedgerValues, ResumeCheck, GuardEntry, str]


def encode_event(rec: LedgerRecord, counter: int, *, step: int = 0) -> tuple[int, bytes]:
    """(kind, body) of one ledger event; a ``str`` is the ``actor`` declaration.
    ``counter`` is the ledger actor's clock entry (1, 2, ... per non-actor event)."""
    if isinstance(rec, GuardEntry):
        kind, payload = guard_events.encode_payload(rec.record)
        return kind, event_head(rec.step, counter) + payload
    w = PayloadWriter()
    if isinstance(rec, str):
        w.out += _HEAD.pack(0, 0, 0)
        return KIND_ACTOR, bytes(w.str(rec, cut=True))
    at = rec.step if isinstance(rec, (LedgerStep, LedgerValues)) else (rec.start_step if isinstance(rec, LedgerOpen) else step)
    w.out += event_head(at, counter)
    if isinstance(rec, LedgerOpen):
        w.str(rec.run_id, cut=True).i64(rec.start_step).str(rec.source, cut=True).digests(rec.rng)
        return KIND_OPEN, bytes(w)
    if isinstance(rec, LedgerStep):
        has = (HAS_BATCH if rec.batch is not None else 0) | (HAS_LOSS if rec.loss is not None else 0) | (
            HAS_PARAMS if rec.params is not None else 0)
        w.u32(has).d128(rec.batch if rec.batch is not None else _ZERO)
        w.f64(rec.loss if rec.loss is not None else 0.0).digests(rec.rng)
        w.d128(rec.params if rec.params is not None else _ZERO)
        return KIND_STEP, bytes(w)
    if isinstance(rec, LedgerValues):
        w.msgpack(dict(rec.values))
        return KIND_VALUES, bytes(w)
    w.str(rec.verdict, cut=True).i64(rec.first).i64(rec.last).str(rec.report, cut=True)
    return KIND_CHECK, bytes(w)


def event_head(step: int, counter: int) -> bytes:
    """The event body's head (spec §6.1) for the one actor of a ledger tape, ``ledger``
    (id 0), at ``step`` with clock ``{ledger: counter}``."""
    return _HEAD.pack(step, 0, 1) + _CLOCK1.pack(0, counter)


def read_head(body: bytes | memoryview, where: str) -> tuple[int, PayloadReader]:
    """(step, a reader positioned at the payload) of one ledger-tape event body."""
    c = PayloadReader(body, where, "ledger event")
    step, _actor, n = c.unpack(_HEAD)
    c.take(_CLOCK1.size * n)
    return step, c


def decode_event(kind: int, body: bytes | memoryview, *, where: str = "") -> LedgerRecord | None:
    """The record of one ledger event; ``None`` for kinds the ledger does not own."""
    if kind in guard_events.KINDS:
        step, c = read_head(body, where)
        return GuardEntry(step, guard_events.decode_payload(kind, b"", reader=c))
    if kind not in (KIND_ACTOR, KIND_OPEN, KIND_STEP, KIND_CHECK, KIND_VALUES):
        return None
    step, c = read_head(body, where)
    if kind == KIND_ACTOR:
        rec: LedgerRecord = c.str()
    elif kind == KIND_OPEN:
        run_id = c.str()
        start = c.i64()
        rec = LedgerOpen(run_id, start, c.str(), c.digests())
    elif kind == KIND_STEP:
        has = c.u32()
        batch = c.d128()
        loss = c.f64()
        rng = c.digests()
        params = c.d128()
        rec = LedgerStep(step, rng, batch if has & HAS_BATCH else None, loss if has & HAS_LOSS else None,
                         params if has & HAS_PARAMS else None)
    elif kind == KIND_VALUES:
        raw = c.msgpack()
        if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
            raise TapeFormatError(f"ledger_values is not a map of names to values{where}")
        bad = [k for k, v in raw.items() if not isinstance(v, (bool, int, float, str, bytes, type(None)))]
        if bad:
            raise TapeFormatError(f"ledger_values {bad[0]!r} is not a plain value{where}")
        rec = LedgerValues(step, tuple(sorted(raw.items())))
    else:
        verdict = c.str()
        first = c.i64()
        last = c.i64()
        rec = ResumeCheck(verdict, first, last, c.str())
    c.done()
    return rec
