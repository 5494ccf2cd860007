"""The one event-kind table: code, name, payload schema and meaning of every tape event.

``spec/tape-format.md`` §6 reproduces this table; ``tests/replay/test_tape_spec.py``
checks that the two agree, so edit both or neither.

A payload is a fixed sequence of typed fields, little-endian, with no padding and no
field names on the wire (the schema is the kind). Floats are IEEE-754 binary64 bit
patterns, so a loss recorded here is the exact value and "bit-identical loss
sequence" is a byte comparison. Codes are stable forever: a retired kind keeps its
code reserved, and a reader that meets an unknown code fails (it cannot skip a
payload whose schema it does not know without risking a silent misread).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence


from ckpt.format.codec import ContainerLimitError
from ckpt.tape.format import strict_pairs  # one definition, next to the framing it serves
from ckpt.tape.payload import pack_msgpack, unpack_msgpack  # the msgpack field rules, with the framing
from replay.clock import VectorClock
from replay.errors import TapeFormatError, TapeLimitError

__all__ = ["Kind", "KINDS", "KIND_BY_NAME", "KIND_BY_CODE", "Event", "FIELD_TYPES", "kind", "strict_pairs", "unpack_msgpack"]

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")

# Bounds a decoder enforces before allocating (a hostile count must not become a list).
MAX_LIST = 1 << 20
MAX_MSGPACK = 1 << 20


class _OverLimit(ValueError):
    """A count or length above spec §12's limits: ``TapeLimitError``, not a format error."""

# field type -> one-line wire description (spec §6.1 renders this table).
FIELD_TYPES: dict[str, str] = {
    "u32": "u32 LE",
    "u64": "u64 LE",
    "i64": "i64 LE (two's complement)",
    "f64": "IEEE-754 binary64 LE, exact bits",
    "d128": "16 raw bytes (xxh3-128 digest, big-endian as xxhash prints it)",
    "str": "u16 LE byte length, then UTF-8",
    "strs": "u16 LE count, then count x str",
    "u64s": "u32 LE count, then count x u64 LE",
    "digests": "u32 LE count, then count x (str name, d128 digest)",
    "refs": "u32 LE count, then count x (str channel, u64 LE channel seq)",
    "clock": "a canonical VectorClock encoding (clock.py): u16 count, count x (u8 len, UTF-8 actor, u64 counter)",
    "msgpack": "u32 LE byte length, then one msgpack object (no ext types)",
}


@dataclass(frozen=True, slots=True)
class Kind:
    """One row of the event table."""

    code: int
    name: str
    fields: tuple[tuple[str, str], ...]
    doc: str
    # True for events whose *value* is a timing-dependent decision: in force mode the
    # replayer returns the taped value instead of recomputing it.
    decision: bool = False
    _names: tuple[str, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        for _, t in self.fields:
            if t not in FIELD_TYPES:
                raise ValueError(f"unknown field type {t!r} in kind {self.name}")
        object.__setattr__(self, "_names", tuple(n for n, _ in self.fields))

    # -- encoding --------------------------------------------------------------------
    def pack(self, *values: Any) -> bytes:
        """Encode positional field values (in table order) into payload bytes."""
        if len(values) != len(self.fields):
            raise TypeError(f"{self.name} takes {len(self.fields)} fields {self._names}, got {len(values)}")
        if not values:
            return b""
        out = bytearray()
        for (fname, ftype), v in zip(self.fields, values):
            _ENCODERS[ftype](out, v, fname)
        return bytes(out)

    def pack_map(self, values: Mapping[str, Any]) -> bytes:
        return self.pack(*(values[n] for n in self._names))

    def unpack(self, data: bytes | memoryview) -> dict[str, Any]:
        """Decode payload bytes; strict (no trailing bytes, bounded counts)."""
        mv = memoryview(data)
        pos = 0
        out: dict[str, Any] = {}
        try:
            for fname, ftype in self.fields:
                out[fname], pos = _DECODERS[ftype](mv, pos)
        except _OverLimit as e:  # spec §15a: a length or count above §12's limits
            raise TapeLimitError(f"{self.name} payload: {e}", field=fname) from None
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            raise TapeFormatError(f"malformed {self.name} payload: {e}", field=fname) from None
        if pos != len(mv):
            raise TapeFormatError(f"{len(mv) - pos} trailing bytes after {self.name} payload")
        return out


# -- field codecs -----------------------------------------------------------------------
def _enc_str(out: bytearray, v: str, name: str) -> None:
    raw = v.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError(f"field {name}: string longer than 65535 bytes")
    out += _U16.pack(len(raw))
    out += raw


def _enc_d128(out: bytearray, v: bytes, name: str) -> None:
    if len(v) != 16:
        raise ValueError(f"field {name}: digest must be 16 bytes, got {len(v)}")
    out += v


def _enc_u64s(out: bytearray, v: Sequence[int], name: str) -> None:
    n = len(v)
    out += _U32.pack(n)
    out += struct.pack(f"<{n}Q", *v)


def _enc_strs(out: bytearray, v: Sequence[str], name: str) -> None:
    out += _U16.pack(len(v))
    for s in v:
        _enc_str(out, s, name)


def _enc_digests(out: bytearray, v: Sequence[tuple[str, bytes]], name: str) -> None:
    out += _U32.pack(len(v))
    for n, d in v:
        _enc_str(out, n, name)
        _enc_d128(out, d, name)


def _enc_refs(out: bytearray, v: Sequence[tuple[str, int]], name: str) -> None:
    out += _U32.pack(len(v))
    for ch, s in v:
        _enc_str(out, ch, name)
        out += _U64.pack(s)


def _enc_msgpack(out: bytearray, v: Any, name: str) -> None:
    raw = pack_msgpack(v)
    try:
        unpack_msgpack(raw)  # a recorder never writes what a reader refuses
    except ValueError as e:
        raise ValueError(f"field {name}: {e}") from None
    if len(raw) > MAX_MSGPACK:
        raise ValueError(f"field {name}: msgpack value larger than {MAX_MSGPACK} bytes")
    out += _U32.pack(len(raw))
    out += raw


def _fixed(s: struct.Struct) -> tuple[Callable[..., None], Callable[..., tuple[Any, int]]]:
    def enc(out: bytearray, v: Any, name: str) -> None:
        out += s.pack(v)

    def dec(mv: memoryview, pos: int) -> tuple[Any, int]:
        return s.unpack_from(mv, pos)[0], pos + s.size

    return enc, dec


def _need(mv: memoryview, pos: int, n: int) -> None:
    if pos + n > len(mv):
        raise ValueError(f"payload truncated: need {n} bytes at {pos}, have {len(mv) - pos}")


def _dec_str(mv: memoryview, pos: int) -> tuple[str, int]:
    _need(mv, pos, 2)
    (n,) = _U16.unpack_from(mv, pos)
    pos += 2
    _need(mv, pos, n)
    return bytes(mv[pos : pos + n]).decode("utf-8"), pos + n


def _dec_d128(mv: memoryview, pos: int) -> tuple[bytes, int]:
    _need(mv, pos, 16)
    return bytes(mv[pos : pos + 16]), pos + 16


def _count(mv: memoryview, pos: int, s: struct.Struct, each_min: int) -> tuple[int, int]:
    _need(mv, pos, s.size)
    (n,) = s.unpack_from(mv, pos)
    pos += s.size
    # Refuse a count the remaining bytes cannot possibly hold before building a list.
    if n > MAX_LIST:
        raise _OverLimit(f"count {n} above the limit {MAX_LIST}")
    if n * each_min > len(mv) - pos:
        raise ValueError(f"count {n} exceeds what the payload can hold")
    return n, pos


def _dec_u64s(mv: memoryview, pos: int) -> tuple[list[int], int]:
    n, pos = _count(mv, pos, _U32, 8)
    return list(struct.unpack_from(f"<{n}Q", mv, pos)), pos + 8 * n


def _dec_strs(mv: memoryview, pos: int) -> tuple[list[str], int]:
    n, pos = _count(mv, pos, _U16, 2)
    out = []
    for _ in range(n):
        s, pos = _dec_str(mv, pos)
        out.append(s)
    return out, pos


def _dec_digests(mv: memoryview, pos: int) -> tuple[list[tuple[str, bytes]], int]:
    n, pos = _count(mv, pos, _U32, 18)
    out = []
    for _ in range(n):
        s, pos = _dec_str(mv, pos)
        d, pos = _dec_d128(mv, pos)
        out.append((s, d))
    return out, pos


def _dec_refs(mv: memoryview, pos: int) -> tuple[list[tuple[str, int]], int]:
    n, pos = _count(mv, pos, _U32, 10)
    out = []
    for _ in range(n):
        s, pos = _dec_str(mv, pos)
        _need(mv, pos, 8)
        out.append((s, _U64.unpack_from(mv, pos)[0]))
        pos += 8
    return out, pos


def _enc_clock(out: bytearray, v: VectorClock, name: str) -> None:
    out += v.encode()


def _dec_clock(mv: memoryview, pos: int) -> tuple[VectorClock, int]:
    return VectorClock.decode_from(mv, pos)


def _dec_msgpack(mv: memoryview, pos: int) -> tuple[Any, int]:
    _need(mv, pos, 4)
    (n,) = _U32.unpack_from(mv, pos)
    pos += 4
    if n > MAX_MSGPACK:
        raise _OverLimit(f"msgpack length {n} above limit {MAX_MSGPACK}")
    _need(mv, pos, n)
    try:
        return unpack_msgpack(bytes(mv[pos : pos + n])), pos + n
    except ContainerLimitError as e:
        raise _OverLimit(str(e)) from None


_ENCODERS: dict[str, Callable[[bytearray, Any, str], None]] = {
    "str": _enc_str, "d128": _enc_d128, "u64s": _enc_u64s, "strs": _enc_strs,
    "digests": _enc_digests, "refs": _enc_refs, "clock": _enc_clock, "msgpack": _enc_msgpack,
}
_DECODERS: dict[str, Callable[[memoryview, int], tuple[Any, int]]] = {
    "str": _dec_str, "d128": _dec_d128, "u64s": _dec_u64s, "strs": _dec_strs,
    "digests": _dec_digests, "refs": _dec_refs, "clock": _dec_clock, "msgpack": _dec_msgpack,
}
for _t, _s in (("u32", _U32), ("u64", _U64), ("i64", _I64), ("f64", _F64)):
    _ENCODERS[_t], _DECODERS[_t] = _fixed(_s)


# -- THE table ----------------------------------------------------------------------------
# Codes 0 and 0xFF00-0xFFFF are reserved (0xFFFF frames a zstd block, see tape/format.py).
# Code ranges set aside for the reference runs' own kinds, so that work on several runs at
# once never hands out one code twice (reuse the generic kinds above where they fit):
#   25-31 DiLoCo (runs/diloco)             32-47 replicas and SDC (runs/replicas)
#   48-55 loss-spike rollback and routing  56-71 pipeline stages (runs/stages)
#   72 the step ledger's plain values  73-95 free
# 33/34 (recovery_sent / recovery_loaded) are every run's peer-recovery pair, one rule for all.
KINDS: tuple[Kind, ...] = (
    Kind(1, "actor", (("name", "str"),),
         "Declares the next actor id (= this event's actor field) for the name. Precedes any use."),
    Kind(2, "step_begin", (), "An optimizer step starts; the step field is the global step."),
    Kind(3, "step_end", (), "The step finished: after optimizer.step() and scheduler.step()."),
    Kind(4, "batch", (("sample_ids", "u64s"),), "The sample ids the step consumed, in order."),
    Kind(5, "rng", (("source", "str"), ("digest", "d128")),
         "xxh3-128 of one RNG state (torch, torch.cuda:N, python, numpy, or a named generator)."),
    Kind(6, "loss", (("value", "f64"),), "The step's loss, exact float64 bits."),
    Kind(7, "metric", (("name", "str"), ("value", "f64")), "A named scalar, exact float64 bits."),
    Kind(8, "params", (("digest", "d128"), ("tensors", "digests")),
         "Digest of all parameters and buffers, plus one xxh3-128 per named tensor."),
    Kind(9, "send", (("channel", "str"), ("chan_seq", "u64"), ("peer", "str"), ("digest", "d128")),
         "A message left on a channel; chan_seq counts per channel from 1; peer is the destination."),
    Kind(10, "recv", (("channel", "str"), ("chan_seq", "u64"), ("peer", "str"), ("digest", "d128")),
         "A message was delivered; peer is the source. Must match an earlier send."),
    Kind(11, "decision", (("what", "str"), ("key", "str"), ("value", "msgpack")),
         "A timing-dependent choice (delivery order, merge weights, grace outcome, fault schedule, ...).",
         decision=True),
    Kind(12, "quorum", (("key", "str"), ("minimum", "u32"), ("members", "strs")),
         "Quorum membership decided for key; invariant: len(members) >= minimum.", decision=True),
    Kind(13, "merge", (("key", "str"), ("contributions", "refs"), ("weights", "msgpack")),
         "A merge applied these contributions (channel, chan_seq of their sends) with these weights.",
         decision=True),
    Kind(14, "fault_injected", (("fault", "str"), ("target", "str"), ("detail", "msgpack")),
         "A fault was injected into target (decided once, forced on replay).", decision=True),
    Kind(15, "fault_detected", (("fault", "str"), ("target", "str"), ("detail", "msgpack")),
         "A fault in target was noticed by this actor."),
    Kind(16, "fault_recovered", (("fault", "str"), ("target", "str"), ("target_clock", "clock"),
                                 ("observed", "clock")),
         "target recovered after observing clock `observed`; invariant: observed >= target_clock."),
    Kind(17, "checkpoint", (("ckpt_id", "str"), ("path", "str")),
         "A checkpoint of this actor's state was committed (the writer fsyncs the tape here)."),
    Kind(18, "snapshot", (("snapshot_id", "str"), ("inflight", "refs")),
         "This actor's local state of a distributed snapshot; the event clock is its cut; inflight "
         "lists the recorded channel state (messages sent before the sender's cut, received after ours)."),
    Kind(19, "note", (("text", "str"),), "Free text; compared like any other event."),
    Kind(20, "snapshot_channels", (("snapshot_id", "str"), ("inflight", "refs")),
         "This actor's recorded channel state of a Chandy-Lamport snapshot, known only once every incoming "
         "channel's marker has arrived; it completes the actor's earlier snapshot event, whose inflight is then "
         "empty."),
    Kind(21, "snapshot_outcome", (("snapshot_id", "str"), ("committed", "u32"), ("path", "str"),
                                  ("parts", "strs"), ("excluded", "strs"), ("reason", "str")),
         "The coordinator committed (1) or aborted (0) a distributed snapshot: parts are the actors whose state "
         "it holds, excluded the failed ones left out, reason why it aborted (the writer fsyncs the tape here)."),
    Kind(22, "ledger_open", (("run_id", "str"), ("start_step", "i64"), ("source", "str"), ("rng", "digests")),
         "A process starts its step ledger (ckpt.ledger) at start_step; source names the checkpoint it resumed "
         "from (empty for a fresh start); rng holds the digest of each RNG stream right after that."),
    Kind(23, "ledger_step", (("has", "u32"), ("batch", "d128"), ("loss", "f64"), ("rng", "digests"),
                             ("params", "d128")),
         "One optimizer step of the ledger: has bit 0 batch, bit 1 loss, bit 2 params say which fields were "
         "recorded (the others are zero); batch digests every tensor the step consumed; rng is each stream's "
         "digest after the step."),
    Kind(24, "resume_check", (("verdict", "str"), ("first", "i64"), ("last", "i64"), ("report", "str")),
         "The verification of a resume against the ledger: verdict exact, diverged or skipped over steps "
         "first..last, with the full report text."),
    # -- 32-47: replica fault tolerance and SDC (runs/replicas, replay.sdc) --
    Kind(32, "step_commit", (("quorum", "str"), ("committed", "u32"), ("participants", "u32"), ("params", "d128"),
                             ("state", "d128")),
         "A replica's commit verdict for one attempt of the step (the step field) under quorum `quorum`; params and "
         "state digest its parameters and its whole replicated state after the step (zero when not committed); "
         "invariant: a committed step follows this actor's quorum event of that key, which lists it."),
    Kind(33, "recovery_sent", (("peer", "str"), ("stream", "d128"), ("state", "d128"), ("nbytes", "u64")),
         "This worker sent its state at the step (the step field) to the recovering peer: the digest of what "
         "carried it (a checkpoint stream; a message naming a checkpoint: that message's digest), the state digest "
         "and the data bytes. Every run's peer recovery (replicas, pipeline stages)."),
    Kind(34, "recovery_loaded", (("source", "str"), ("stream", "d128"), ("state", "d128")),
         "This worker loaded the state source sent it for the step; invariant: stream and state equal those of the "
         "source's recovery_sent to this actor for the same step."),
    Kind(35, "membership", (("quorum", "str"), ("joined", "strs"), ("left", "strs"), ("members", "strs")),
         "The replica groups of quorum `quorum` as this replica sees them, against its previous quorum."),
    Kind(36, "data_reassign", (("policy", "str"), ("lost", "strs"), ("sample_ids", "u64s")),
         "The samples of a step attempt that was not committed (lost: the groups that failed in it) go back to "
         "the global stream (policy redistribute: the retry splits them over the surviving groups) or are skipped "
         "(policy drop)."),
    Kind(37, "sdc_digests", (("kind", "str"), ("buckets", "digests")),
         "xxh3-128 of each gradient bucket of this replica at the step's accumulation boundary: kind local (its "
         "own gradient, before the all-reduce) or reduced (after it)."),
    Kind(38, "sdc_verdict", (("check", "str"), ("ok", "u32"), ("odd", "strs"), ("buckets", "strs"),
                             ("detail", "msgpack")),
         "An SDC check at the step: check cross-replica (reduced-bucket digests compared across replicas), "
         "reexec (the step re-executed and its digests compared) or stream (bytes checked on receipt); odd names "
         "the replicas found wrong, buckets the buckets that differ."),
    # 48-55: loss-spike rollback and anticipatory routing (ckpt.guard; spec/loss-guard.md).
    Kind(48, "spike", (("rule", "str"), ("value", "f64"), ("median", "f64"), ("mad", "f64"), ("scale", "f64"),
                       ("score", "f64"), ("threshold", "f64"), ("window", "msgpack")),
         "A loss spike or non-finite loss was detected at this step: rule robust_z or nonfinite, the loss, the "
         "window's median and MAD, the scale and robust z-score, the threshold, and the window of accepted losses "
         "the rule looked at (oldest first)."),
    Kind(49, "rollback", (("episode", "u32"), ("to_step", "i64"), ("ckpt_id", "str"), ("ckpt_name", "str"),
                          ("policy", "str"), ("edits", "msgpack"), ("discarded", "strs"), ("fallbacks", "strs")),
         "The guard rolled back to the checkpoint of to_step (content id, name) and applied the data policy: edits "
         "are the data edits made (epoch, steps, action, delay); discarded the newer checkpoints deleted, "
         "fallbacks the newer ones that did not verify. Invariant: to_step < the event's step.", decision=True),
    Kind(50, "routing", (("layer", "str"), ("epoch", "u64"), ("batch", "u64"), ("k", "u32"), ("experts", "msgpack"),
                         ("digest", "d128")),
         "Warmup: the top-k expert ids one MoE layer chose with the restored weights for the batch of global step "
         "batch of epoch, as u16 LE bytes (tokens x k, row order); digest is xxh3-128 of those bytes.",
         decision=True),
    Kind(51, "routing_replay", (("layer", "str"), ("epoch", "u64"), ("batch", "u64"), ("digest", "d128")),
         "A cached routing was used to train its batch; digest of the ids used. Invariant: equal to the digest of "
         "the earlier routing event of the same layer, epoch and batch."),
    Kind(52, "warmup", (("batches", "msgpack"), ("rng", "digests")),
         "The routing warmup read these [epoch, step] batches ahead; rng is each training RNG stream's digest, "
         "the same before and after it."),
    Kind(53, "rollback_refused", (("reason", "str"), ("detail", "msgpack")),
         "A spike was detected but not rolled back: reason limit (the rollback budget is spent) or no-checkpoint "
         "(none before the anomaly); detail says why."),
    # 56-71: pipeline stages (runs/stages, spec/stages.md)
    Kind(56, "stage_down", (("first", "u64"), ("until", "u64")),
         "This pipeline stage goes offline for global steps first..until-1; it sends nothing until its stage_up."),
    Kind(57, "stage_up", (("source", "str"),),
         "This stage rejoined at the end of its outage with the state of source, loaded by its recovery_loaded "
         "of the same step."),
    # 58: retired before release (a stage's recovery source tapes recovery_sent, 33)
    Kind(59, "bypass", (("offline", "str"), ("src", "str"), ("dst", "str"), ("direction", "str")),
         "This step's activations (direction fwd, taped by the upstream stage) or gradients (bwd, by the downstream "
         "stage) go from src to dst around the offline stage."),
    Kind(60, "ef_residual", (("key", "str"), ("digest", "d128"), ("kept", "u64"), ("total", "u64"),
                             ("nbytes", "u64")),
         "After the compressed replica exchange key: the digest of the error-feedback residual left, the values "
         "sent and in total, and the payload bytes sent to each peer."),
    Kind(61, "stage_stall", (("reason", "str"),),
         "This stage is live but idles this step (its replica waits: reason wait or edge-down)."),
    Kind(72, "ledger_values", (("values", "msgpack"),),
         "The plain values of the ledger step of the same step field, right after its ledger_step: a map of names to "
         "nil, bool, int, float, str or bytes (the script's values, e.g. lr; names starting ckpt. are the ledger's "
         "own), compared exactly on a resume."),
)
"""Every event kind of the tape format (spec/tape-format.md §6), by code: name, fields and meaning."""

KIND_BY_NAME: dict[str, Kind] = {k.name: k for k in KINDS}
KIND_BY_CODE: dict[int, Kind] = {k.code: k for k in KINDS}
assert len(KIND_BY_NAME) == len(KINDS) == len(KIND_BY_CODE)


def kind(name_or_code: str | int) -> Kind:
    """Look up a kind by name or code; raises KeyError naming the valid choices."""
    table: Mapping[Any, Kind] = KIND_BY_CODE if isinstance(name_or_code, int) else KIND_BY_NAME
    try:
        return table[name_or_code]
    except KeyError:
        raise KeyError(f"unknown event kind {name_or_code!r}; known: {', '.join(KIND_BY_NAME)}") from None


@dataclass(frozen=True, slots=True)
class Event:
    """One decoded tape event. ``raw`` is the payload exactly as taped."""

    seq: int
    actor: str
    clock: VectorClock
    step: int
    kind: Kind
    raw: bytes

    @property
    def payload(self) -> dict[str, Any]:
        try:
            return self.kind.unpack(self.raw)
        except (TapeFormatError, TapeLimitError) as e:
            raise type(e)(e.message, **{**e.context, "seq": self.seq}) from None

    def same(self, other: "Event") -> bool:
        """Equal in everything replay promises to reproduce (the tape seq is not)."""
        return (self.kind.code == other.kind.code and self.step == other.step and self.actor == other.actor
                and self.clock == other.clock and self.raw == other.raw)

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "actor": self.actor, "step": self.step, "kind": self.kind.name,
                "clock": self.clock.as_dict(), "payload": jsonable(self.payload)}


def jsonable(v: Any) -> Any:
    """Payload values as JSON: digests as hex, clocks as dicts, floats kept (repr is exact)."""
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, VectorClock):
        return v.as_dict()
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    return v


def describe(kinds: Iterable[Kind] = KINDS) -> list[dict[str, Any]]:
    """The table as plain data (for `ckpt tape show --kinds` and the spec check)."""
    return [{"code": k.code, "name": k.name, "fields": [list(f) for f in k.fields], "decision": k.decision,
             "doc": k.doc} for k in kinds]
