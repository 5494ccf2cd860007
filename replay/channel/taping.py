"""Channels and snapshots recorded on the event tape: a Recorder-backed EventSink.

Wire an Endpoint to a tape and every send, receive and snapshot step lands on it::

    rec = Recorder.open("p0.tape", actor="p0")
    ep = Endpoint(transport, sink=RecorderSink(rec))       # same sink for many endpoints
    agent = SnapshotAgent(ep, state, store=..., control=..., participants=...)

One clock per actor. ``RecorderSink`` is a :class:`~replay.channel.base.ClockSink`: the
Endpoint keeps no clock of its own and the recorder's actor clock is the only one. A
send is taped *before* the message leaves and the message carries the clock of that
taped event; a delivery merges the message's clock on the tape. This is the smaller of
the two possible joins (the other, a recorder that accepts clocks from outside, would
leave every other taped event - steps, losses, decisions - without a clock to carry):
the recorder and its tape format are unchanged, and ``ckpt tape check`` sees the very
clocks that travelled. Snapshot bookkeeping ticks like every taped event; MARKERs are
never taped, so they neither tick a clock nor consume a channel seq, and a restored run
is forced onto the original's delivery order by ``(src, seq)``.

Event mapping (the tape's kinds are the table in ``replay/events.py``):

======================  ======================================================================
channel event           taped as
======================  ======================================================================
send                    ``send``: channel ``src->dst``, chan_seq = seq + 1 (tapes count from 1,
                        channels from 0), peer = dst, digest = :func:`message_digest`;
                        flushed to the OS before the message leaves (``flush_sends``)
recv                    ``recv``: the same channel/chan_seq, peer = src, digest recomputed from
                        what arrived (so ``tape check`` compares payloads end to end)
recv.none               ``decision`` what=``recv.empty`` (an empty poll: part of the order)
peer.died               ``fault_detected`` fault=``peer-died``
snapshot.record         ``snapshot`` with no inflight refs; its clock is the cut
snapshot.local_done     ``snapshot_channels``: the recorded channel state (channel, seq + 1)
snapshot.peer_failed    ``fault_detected`` fault=``snapshot-peer-failed``
snapshot.exclude        ``fault_detected`` fault=``snapshot-excluded`` (by the coordinator)
snapshot.commit/abort   ``snapshot_outcome`` (a commit fsyncs the tape)
snapshot.restore        ``note`` (after the restored cut was merged into the actor's clock)
snapshot.begin/marker   nothing: the cut follows at once / markers never tick
======================  ======================================================================

Multi-process jobs: one tape per process (one writer each, the format's rule), checked
together by ``ckpt tape check A B C`` (spec/tape-format.md §2.1).
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import xxhash

from replay import digest as dg
from replay.channel.base import Message, channel_name
from replay.clock import VectorClock
from replay.errors import ReplayError, SnapshotError
from replay.events import Event
from replay.recorder import Actor, Recorder, Stamp

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["RecorderSink", "message_digest", "taped_delivery_order", "EMPTY_POLL", "TAPED_AS"]

EMPTY_POLL = "recv.empty"  # the decision `what` of a receive call that delivered nothing

# Every channel/snapshot event kind and what it becomes on the tape (None: not taped).
# An event kind missing here is an error, never silently dropped.
TAPED_AS: dict[str, str | None] = {
    "send": "send",
    "recv": "recv",
    "recv.none": "decision",
    "peer.died": "fault_detected",
    "snapshot.begin": None,
    "snapshot.marker": None,
    "snapshot.record": "snapshot",
    "snapshot.local_done": "snapshot_channels",
    "snapshot.peer_failed": "fault_detected",
    "snapshot.exclude": "fault_detected",
    "snapshot.commit": "snapshot_outcome",
    "snapshot.abort": "snapshot_outcome",
    "snapshot.restore": "note",
}

_LEN = struct.Struct("<QI")


def message_digest(meta: bytes, tensors: Sequence["torch.Tensor"]) -> bytes:
    """xxh3-128 of a message's payload: its msgpack metadata bytes, then each tensor's
    digest (dtype, shape and bytes, ``replay.digest.tensor_digest``). Lengths frame the
    parts, so moving bytes from the metadata into a tensor changes the digest."""
    h = xxhash.xxh3_128()
    h.update(_LEN.pack(len(meta), len(tensors)))
    h.update(meta)
    for t in tensors:
        h.update(dg.tensor_digest(t))
    return h.digest()


def _digest(msg: Message) -> bytes:
    return message_digest(msg.meta_bytes(), msg.tensors)


class RecorderSink:
    """Records channel and snapshot events of any number of endpoints on one Recorder.

    Each endpoint's actor becomes the recorder's actor of the same name
    (``Recorder.actor``). With ``endpoint_steps`` the Endpoint's ``step`` callable sets
    that actor's step; otherwise events carry the step the recorder is at (``rec.step``).
    With ``flush_sends`` (the default) a taped send reaches the OS before its message
    leaves: if this process then dies, no receiver holds a message whose send its tape
    lost (the receiver's ``recv`` would have no send, and a snapshot's channel state
    would name one never taped). It costs one write per message.
    """

    def __init__(self, recorder: Recorder, *, endpoint_steps: bool = False, flush_sends: bool = True) -> None:
        self.recorder = recorder
        self.endpoint_steps = endpoint_steps
        self.flush_sends = flush_sends
        self._actors: dict[str, Actor] = {}
        self._lock = threading.Lock()

    def actor(self, name: str) -> Actor:
        a = self._actors.get(name)
        if a is None:
            with self._lock:
                a = self._actors.setdefault(name, self.recorder.actor(name))
        return a

    def _at(self, name: str, step: int) -> Actor:
        a = self.actor(name)
        if self.endpoint_steps:
            a.current_step = step
        return a

    # -- ClockSink ---------------------------------------------------------------------
    def clock_of(self, actor: str) -> VectorClock:
        return self.actor(actor).clock

    def adopt_clock(self, actor: str, clock: VectorClock) -> None:
        self.actor(actor).observe(clock)

    def record_send(self, msg: Message, step: int) -> VectorClock:
        a = self._at(msg.src, step)
        clock = a.send(msg.channel, peer=msg.dst, digest=_digest(msg), chan_seq=msg.seq + 1).clock
        if self.flush_sends:
            self.recorder.flush()
        return clock

    def record_recv(self, msg: Message, step: int) -> None:
        a = self._at(msg.dst, step)
        a.recv(Stamp(msg.channel, msg.seq + 1, _digest(msg), msg.clock, msg.src))

    # -- EventSink ---------------------------------------------------------------------
    def record(self, kind: str, actor: str, clock: VectorClock, step: int,
               payload: Mapping[str, Any]) -> VectorClock | None:
        """Tape one channel/snapshot event; returns the cut for ``snapshot.record``.

        ``clock`` is ignored: the actor's clock on the tape is the only clock."""
        if kind not in TAPED_AS:
            raise ReplayError(f"no tape mapping for channel event kind {kind!r}", actor=actor)
        if TAPED_AS[kind] is None:
            return None
        a = self._at(actor, step)
        p = payload
        if kind == "snapshot.record":
            return a.snapshot(str(p["snapshot"]), ())
        if kind == "snapshot.local_done":
            a.snapshot_channels(str(p["snapshot"]), [(str(ch), int(seq) + 1) for ch, seq in p["inflight_refs"]])
        elif kind in ("snapshot.commit", "snapshot.abort"):
            a.snapshot_outcome(str(p["snapshot"]), committed=kind == "snapshot.commit", path=str(p.get("path", "")),
                               parts=list(p.get("parts", ())), excluded=list(p.get("excluded", ())),
                               reason=str(p.get("reason", "")))
        elif kind == "snapshot.exclude":
            a.fault_detected("snapshot-excluded", str(p["actor"]), {"snapshot": p["snapshot"], "reason": p["reason"]})
        elif kind == "snapshot.peer_failed":
            a.fault_detected("snapshot-peer-failed", str(p["peer"]), {"snapshot": p["snapshot"]})
        elif kind == "peer.died":
            a.fault_detected("peer-died", str(p["peer"]), None)
        elif kind == "recv.none":
            a.decide(EMPTY_POLL, str(step), lambda: None)
        elif kind == "snapshot.restore":
            a.note(f"snapshot.restore {p['snapshot']}")
        else:  # send/recv reach a ClockSink through record_send/record_recv only
            raise ReplayError(f"channel event {kind!r} must be taped through record_send/record_recv", actor=actor)
        return None


def taped_delivery_order(events: Iterable[Event], actor: str, snapshot: str | None = None
                         ) -> list[tuple[str, int] | None]:
    """``actor``'s receive outcomes on the tape, after its cut of ``snapshot`` (from the
    start when None): ``(src, seq)`` per channel delivery, None per empty poll. This is
    the order a :class:`~replay.channel.base.ForcedScheduler` replays in force mode."""
    started = snapshot is None
    out: list[tuple[str, int] | None] = []
    for e in events:
        if e.actor != actor:
            continue
        k = e.kind.name
        if not started:
            started = k == "snapshot" and e.payload["snapshot_id"] == snapshot
            continue
        if k == "recv":
            p = e.payload
            if p["channel"] == channel_name(p["peer"], actor):  # a channel delivery, not another taped recv
                out.append((p["peer"], p["chan_seq"] - 1))
        elif k == "decision" and e.payload["what"] == EMPTY_POLL:
            out.append(None)
    if not started:
        raise SnapshotError("the tape holds no cut of this actor for the snapshot", actor=actor, snapshot=snapshot)
    return out
