"""The guard's tape events (kinds 48-53), pure: records <-> payload bytes.

The schemas are rows of the one event table, ``replay/events.py`` (spec/tape-format.md
§6.2); ``ckpt`` cannot import it, so the payloads are encoded here with
``ckpt.tape.payload`` and handed to a tape as bytes: the step ledger's writer, or a
recorder's ``record_event`` / ``decide_event``. ``tests/ckpt/test_guard_events.py``
checks the bytes equal what the table encodes, field for field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import xxhash

from ..errors import TapeFormatError
from ..tape.payload import PayloadReader, PayloadWriter
from .rule import Verdict

__all__ = [
    "SPIKE", "ROLLBACK", "ROUTING", "ROUTING_REPLAY", "WARMUP", "REFUSED", "KINDS", "DECISIONS",
    "Spike", "RollbackEvent", "Routing", "RoutingReplay", "Warmup", "Refused", "GuardRecord",
    "encode_payload", "decode_payload", "experts_digest",
]

SPIKE, ROLLBACK, ROUTING, ROUTING_REPLAY, WARMUP, REFUSED = 48, 49, 50, 51, 52, 53
KINDS = (SPIKE, ROLLBACK, ROUTING, ROUTING_REPLAY, WARMUP, REFUSED)
#: decision kinds: a forced replay returns the taped payload instead of computing it
DECISIONS = frozenset({ROLLBACK, ROUTING})


#: the ``spike`` event is the rule's verdict (``anomalous`` is true on a tape)
Spike = Verdict


@dataclass(frozen=True, slots=True)
class RollbackEvent:
    episode: int
    to_step: int
    ckpt_id: str
    ckpt_name: str
    policy: str
    edits: tuple[dict[str, Any], ...]
    discarded: tuple[str, ...]
    fallbacks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Routing:
    layer: str
    epoch: int
    batch: int
    k: int
    experts: bytes  # u16 LE ids, tokens x k in row order
    digest: bytes


@dataclass(frozen=True, slots=True)
class RoutingReplay:
    layer: str
    epoch: int
    batch: int
    digest: bytes


@dataclass(frozen=True, slots=True)
class Warmup:
    batches: tuple[tuple[int, int], ...]
    rng: tuple[tuple[str, bytes], ...]


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str  # limit | no-checkpoint
    detail: dict[str, Any]


GuardRecord = Union[Spike, RollbackEvent, Routing, RoutingReplay, Warmup, Refused]


def experts_digest(experts: bytes) -> bytes:
    return xxhash.xxh3_128_digest(experts)


def encode_payload(rec: GuardRecord) -> tuple[int, bytes]:
    """(kind code, payload) of one guard record."""
    w = PayloadWriter()
    if isinstance(rec, Spike):
        w.str(rec.rule).f64(rec.value).f64(rec.median).f64(rec.mad).f64(rec.scale).f64(rec.score)
        return SPIKE, bytes(w.f64(rec.threshold).msgpack([float(x) for x in rec.window]))
    if isinstance(rec, RollbackEvent):
        w.u32(rec.episode).i64(rec.to_step).str(rec.ckpt_id).str(rec.ckpt_name).str(rec.policy)
        return ROLLBACK, bytes(w.msgpack([dict(e) for e in rec.edits]).strs(rec.discarded).strs(rec.fallbacks))
    if isinstance(rec, Routing):
        w.str(rec.layer).u64(rec.epoch).u64(rec.batch).u32(rec.k)
        return ROUTING, bytes(w.msgpack(bytes(rec.experts)).d128(rec.digest))
    if isinstance(rec, RoutingReplay):
        return ROUTING_REPLAY, bytes(w.str(rec.layer).u64(rec.epoch).u64(rec.batch).d128(rec.digest))
    if isinstance(rec, Warmup):
        return WARMUP, bytes(w.msgpack([[int(e), int(s)] for e, s in rec.batches]).digests(rec.rng))
    if isinstance(rec, Refused):
        return REFUSED, bytes(w.str(rec.reason).msgpack(dict(rec.detail)))
    raise TypeError(f"not a guard record: {type(rec).__name__}")


def decode_payload(kind: int, body: bytes | memoryview, *, where: str = "",
                   reader: PayloadReader | None = None) -> GuardRecord:
    """The record of one guard event payload; ``TapeFormatError`` for bytes that do not
    follow the kind's schema. ``reader``: a reader already past the event head."""
    c = reader if reader is not None else PayloadReader(body, where, "guard event")
    rec: GuardRecord
    if kind == SPIKE:
        rule, value, med, mad, scale, score, thr = c.str(), c.f64(), c.f64(), c.f64(), c.f64(), c.f64(), c.f64()
        window = c.msgpack()
        if not isinstance(window, list) or not all(isinstance(x, float) for x in window):
            raise _bad(c, "spike window must be an array of float64")
        rec = Spike(True, rule, value, med, mad, scale, score, thr, tuple(window))
    elif kind == ROLLBACK:
        episode, to_step, cid, name, policy = c.u32(), c.i64(), c.str(), c.str(), c.str()
        edits = c.msgpack()
        if not isinstance(edits, list) or not all(isinstance(e, dict) for e in edits):
            raise _bad(c, "rollback edits must be an array of maps")
        rec = RollbackEvent(episode, to_step, cid, name, policy, tuple(edits), c.strs(), c.strs())
    elif kind == ROUTING:
        layer, epoch, batch, k = c.str(), c.u64(), c.u64(), c.u32()
        experts = c.msgpack()
        if not isinstance(experts, bytes):
            raise _bad(c, "routing experts must be a msgpack bin")
        rec = Routing(layer, epoch, batch, k, experts, c.d128())
    elif kind == ROUTING_REPLAY:
        rec = RoutingReplay(c.str(), c.u64(), c.u64(), c.d128())
    elif kind == WARMUP:
        batches = c.msgpack()
        if not isinstance(batches, list) or not all(
                isinstance(b, list) and len(b) == 2 and all(type(x) is int for x in b) for b in batches):
            raise _bad(c, "warmup batches must be an array of [epoch, step] pairs")
        rec = Warmup(tuple((b[0], b[1]) for b in batches), c.digests())
    elif kind == REFUSED:
        reason = c.str()
        detail = c.msgpack()
        if not isinstance(detail, dict):
            raise _bad(c, "rollback_refused detail must be a map")
        rec = Refused(reason, detail)
    else:
        raise ValueError(f"kind {kind} is not a guard kind")
    c.done()
    return rec


def _bad(c: PayloadReader, message: str) -> Exception:
    return TapeFormatError(f"{message}{c.where}")
