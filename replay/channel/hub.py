"""One tape for a job of many actors, threads and processes: the tape hub (spec/snapshot-protocol.md §9b).

Every actor records through a :class:`TapeSink`. Messages are named
on the wire by their transport identity ``MsgRef = (src endpoint, dst endpoint, seq)``;
the tape names them by the *tape* actor's channel (``learner-2->syncer``) and its own
per-channel sequence number, which continues across a worker's incarnations (a worker
restarted under endpoint ``learner-2~1`` is still tape actor ``learner-2``). The
:class:`TapeHub` (in the process that owns the :class:`~replay.recorder.Recorder`) maps
one to the other: a send registers the :class:`~replay.recorder.Stamp` its event
produced, and a receive looks it up.

Two sinks:

- :class:`LocalTape` calls the recorder directly (actors running as threads of the
  recorder's process; this is also how every replay runs);
- :class:`RemoteTape` (a worker in its own process) appends the same calls to a log
  that travels on the worker's next message to the recording process; the hub's
  :class:`LogApplier` replays the log onto the recorder. A log entry that receives a
  message whose send is not taped yet (a peer-to-peer state transfer can overtake the
  peer's log) waits, with everything after it for that actor, until the send is.

Why one recorder for all processes: the tape is one file whose per-actor event
sequences are what ``ckpt replay --mode force`` compares, and the replay runs every
actor as a thread of one process. A per-process tape would need a merge step that
re-numbers actors and clocks; the log costs one list per message instead.

:class:`TapeSinkEvents` is the :class:`~replay.channel.base.EventSink` that puts a
:class:`~replay.snapshot.SnapshotAgent`'s events on a TapeSink (§9a rule 6).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Mapping, Protocol, Sequence

import msgpack
import torch

from replay.channel.taping import message_digest as _payload_digest
from replay.clock import VectorClock
from replay.errors import ReplayError
from replay.recorder import Recorder, Stamp

__all__ = ["MsgRef", "endpoint_name", "actor_of", "TapeSink", "TapeHub", "LocalTape", "RemoteTape", "LogApplier", "TapeSinkEvents",
           "meta_digest", "stamp_to_json", "stamp_from_json"]

MsgRef = tuple[str, str, int]
"""A message's reference on a tape: ``(src endpoint, dst endpoint, endpoint seq)``."""


def endpoint_name(actor: str, incarnation: int) -> str:
    """Transport name of a learner incarnation: ``learner-2``, then ``learner-2~1``, ..."""
    return actor if incarnation == 0 else f"{actor}~{incarnation}"


def actor_of(endpoint: str) -> str:
    """The tape actor an endpoint belongs to (its incarnations share one tape identity)."""
    return endpoint.split("~", 1)[0]


def meta_digest(meta: Mapping[str, Any], tensors: Sequence[torch.Tensor]) -> bytes:
    """The channel's payload digest (``replay.channel.message_digest``) of a message about to be
    sent, from its metadata mapping (packed as the wire packs it) and its tensors."""
    return _payload_digest(msgpack.packb(dict(meta), use_bin_type=True), list(tensors))


class TapeSink(Protocol):
    """What an actor writes its events to: a local tape, or a hub's remote one."""

    name: str

    def begin_step(self, step: int) -> None: ...
    def end_step(self) -> None: ...
    def batch(self, ids: Sequence[int]) -> None: ...
    def loss(self, value: float) -> None: ...
    def metric(self, name: str, value: float) -> None: ...
    def params(self, named: Sequence[tuple[str, torch.Tensor]]) -> None: ...
    def send(self, ref: MsgRef, peer: str, digest: bytes) -> None: ...
    def recv(self, ref: MsgRef) -> None: ...
    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any: ...
    def inject(self, fault: str, target: str, detail: Any) -> None: ...
    def detected(self, fault: str, target: str, detail: Any) -> None: ...
    def recovered(self, fault: str, target: str, target_ref: MsgRef, observed_ref: MsgRef) -> None: ...
    def note(self, text: str) -> None: ...
    def snapshot(self, name: str) -> None: ...
    def snapshot_channels(self, name: str, refs: Sequence[tuple[str, int]]) -> None: ...
    def snapshot_outcome(self, name: str, *, committed: bool, path: str, parts: Sequence[str],
                         excluded: Sequence[str], reason: str) -> None: ...


def stamp_to_json(s: Stamp) -> dict[str, Any]:
    """A message stamp as plain values (the inverse of ``stamp_from_json``)."""
    return {"channel": s.channel, "chan_seq": s.chan_seq, "digest": bytes(s.digest), "clock": s.clock.encode(),
            "sender": s.sender}


def stamp_from_json(d: Mapping[str, Any]) -> Stamp:
    """The stamp ``stamp_to_json`` wrote."""
    return Stamp(str(d["channel"]), int(d["chan_seq"]), bytes(d["digest"]), VectorClock.decode(d["clock"]),
                 str(d["sender"]))


class TapeHub:
    """The recorder plus the MsgRef -> Stamp table shared by every actor of the run."""

    def __init__(self, rec: Recorder, *, wait_s: float = 120.0) -> None:
        self.rec = rec
        self.wait_s = wait_s
        self._stamps: dict[MsgRef, Stamp] = {}
        # refs whose taped receive happened: a snapshot lists the taped messages a dead
        # incarnation never received (see syncer.py, "lost")
        self.received: set[MsgRef] = set()
        self._cond = threading.Condition()
        self.listeners: list[Callable[[], None]] = []
        # Serialises every recorder call of this run's actors. The recorder locks its
        # own emits, but Actor.end_step flushes the TapeWriter outside that lock, which
        # races with another thread's append (records written out of sequence).
        self.lock = threading.RLock()

    @property
    def mode(self) -> str:
        return self.rec.mode

    def register(self, ref: MsgRef, stamp: Stamp) -> None:
        with self._cond:
            self._stamps[ref] = stamp
            self._cond.notify_all()
        for f in self.listeners:
            f()

    def stamp(self, ref: MsgRef, *, wait: bool = True) -> Stamp | None:
        with self._cond:
            if wait:
                ok = self._cond.wait_for(lambda: ref in self._stamps, timeout=self.wait_s)
                if not ok:
                    raise ReplayError("a message was received whose send never reached the tape",
                                      channel=f"{ref[0]}->{ref[1]}", seq=ref[2])
            return self._stamps.get(ref)

    def unreceived_to(self, endpoint: str) -> list[MsgRef]:
        """Taped sends to ``endpoint`` with no taped receive, in (src, seq) order."""
        with self._cond:
            return sorted(r for r in self._stamps if r[1] == endpoint and r not in self.received)

    def local(self, actor: str) -> "LocalTape":
        return LocalTape(self, actor)


class LocalTape:
    """A TapeSink that records straight onto the hub's recorder (same process)."""

    def __init__(self, hub: TapeHub, name: str) -> None:
        self.hub = hub
        self.name = name
        with hub.lock:
            self.actor = hub.rec.actor(name)

    @property
    def mode(self) -> str:
        return self.hub.mode

    @property
    def clock(self) -> VectorClock:
        return self.actor.clock

    def begin_step(self, step: int) -> None:
        with self.hub.lock:
            self.actor.begin_step(step)

    def end_step(self) -> None:
        with self.hub.lock:
            self.actor.end_step()

    def batch(self, ids: Sequence[int]) -> None:
        with self.hub.lock:
            self.actor.batch(list(ids))

    def loss(self, value: float) -> None:
        with self.hub.lock:
            self.actor.loss(float(value))

    def metric(self, name: str, value: float) -> None:
        with self.hub.lock:
            self.actor.metric(name, float(value))

    def params(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        with self.hub.lock:
            self.actor.params(named=named)

    def send(self, ref: MsgRef, peer: str, digest: bytes) -> None:
        with self.hub.lock:
            stamp = self.actor.send(f"{self.name}->{actor_of(ref[1])}", peer=peer, digest=digest)
        self.hub.register(ref, stamp)

    def recv(self, ref: MsgRef) -> None:
        stamp = self.hub.stamp(ref)  # may wait: outside the lock
        assert stamp is not None
        with self.hub.lock:
            self.actor.recv(stamp)
        with self.hub._cond:
            self.hub.received.add(ref)

    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any:
        if self.hub.mode == "record":
            value = compute()  # may block on messages: outside the lock
            with self.hub.lock:
                return self.actor.decide(what, key, lambda: value)
        with self.hub.lock:
            return self.actor.decide(what, key, compute)

    def inject(self, fault: str, target: str, detail: Any) -> None:
        with self.hub.lock:
            self.actor.maybe_inject(fault, target, lambda: detail)

    def detected(self, fault: str, target: str, detail: Any) -> None:
        with self.hub.lock:
            self.actor.fault_detected(fault, target, detail)

    def recovered(self, fault: str, target: str, target_ref: MsgRef, observed_ref: MsgRef) -> None:
        t, o = self.hub.stamp(target_ref), self.hub.stamp(observed_ref)
        assert t is not None and o is not None
        with self.hub.lock:
            self.actor.recovered(fault, target, target_clock=t.clock, observed=o.clock)

    def note(self, text: str) -> None:
        with self.hub.lock:
            self.actor.note(text)

    def snapshot(self, name: str) -> None:
        with self.hub.lock:
            self.actor.snapshot(name, ())

    def snapshot_channels(self, name: str, refs: Sequence[tuple[str, int]]) -> None:
        with self.hub.lock:
            self.actor.snapshot_channels(name, [(str(c), int(q)) for c, q in refs])

    def snapshot_outcome(self, name: str, *, committed: bool, path: str, parts: Sequence[str],
                         excluded: Sequence[str], reason: str) -> None:
        with self.hub.lock:
            self.actor.snapshot_outcome(name, committed=committed, path=path, parts=parts, excluded=excluded,
                                        reason=reason)

    # -- the syncer's decisions (the syncer always records locally) --------------------
    def quorum(self, key: str, minimum: int, members: Sequence[str]) -> list[str]:
        with self.hub.lock:
            return self.actor.quorum(key, minimum, lambda: list(members))

    def merge(self, key: str, refs: Sequence[MsgRef], weights: Sequence[float]) -> tuple[list[Any], Any]:
        stamps = [self.hub.stamp(r) for r in refs]
        with self.hub.lock:
            return self.actor.merge(key, lambda: (stamps, list(weights)))


class RemoteTape:
    """A TapeSink for a learner in another process: the calls become a log shipped to the hub.

    ``decide`` computes locally (a remote actor only ever records; replays run in one
    process with :class:`LocalTape`).
    """

    mode = "record"

    def __init__(self, name: str) -> None:
        self.name = name
        self._log: list[list[Any]] = []
        self._tensors: list[torch.Tensor] = []

    def drain(self) -> tuple[list[list[Any]], list[torch.Tensor]]:
        log, ts = self._log, self._tensors
        self._log, self._tensors = [], []
        return log, ts

    def begin_step(self, step: int) -> None:
        self._log.append(["begin", step])

    def end_step(self) -> None:
        self._log.append(["end"])

    def batch(self, ids: Sequence[int]) -> None:
        self._log.append(["batch", [int(i) for i in ids]])

    def loss(self, value: float) -> None:
        self._log.append(["loss", float(value)])

    def metric(self, name: str, value: float) -> None:
        self._log.append(["metric", name, float(value)])

    def params(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        first = len(self._tensors)
        self._tensors.extend(t.detach().clone() for _, t in named)
        self._log.append(["params", [n for n, _ in named], first])

    def send(self, ref: MsgRef, peer: str, digest: bytes) -> None:
        self._log.append(["send", list(ref), peer, digest])

    def recv(self, ref: MsgRef) -> None:
        self._log.append(["recv", list(ref)])

    def decide(self, what: str, key: str, compute: Callable[[], Any]) -> Any:
        value = compute()
        self._log.append(["decide", what, key, value])
        return value

    def inject(self, fault: str, target: str, detail: Any) -> None:
        self._log.append(["inject", fault, target, detail])

    def detected(self, fault: str, target: str, detail: Any) -> None:
        self._log.append(["detected", fault, target, detail])

    def recovered(self, fault: str, target: str, target_ref: MsgRef, observed_ref: MsgRef) -> None:
        self._log.append(["recovered", fault, target, list(target_ref), list(observed_ref)])

    def note(self, text: str) -> None:
        self._log.append(["note", text])

    def snapshot(self, name: str) -> None:
        self._log.append(["snapshot", name])

    def snapshot_channels(self, name: str, refs: Sequence[tuple[str, int]]) -> None:
        self._log.append(["snapchan", name, [[str(c), int(q)] for c, q in refs]])

    def snapshot_outcome(self, name: str, *, committed: bool, path: str, parts: Sequence[str],
                         excluded: Sequence[str], reason: str) -> None:
        self._log.append(["snapout", name, bool(committed), path, list(parts), list(excluded), reason])


def _ref(x: Sequence[Any]) -> MsgRef:
    return (str(x[0]), str(x[1]), int(x[2]))


class LogApplier:
    """Replays RemoteTape logs onto LocalTapes, in order per actor, waiting for stamps.

    ``add`` queues a log shipped by ``actor``'s process and applies every entry whose
    inputs are there; ``pump`` retries the waiting ones (call it after a send was taped
    elsewhere); ``pending`` counts what is still waiting (non-zero at the end of a job
    means a receive whose send never reached the tape)."""

    def __init__(self, hub: TapeHub) -> None:
        self.hub = hub
        self._queues: dict[str, deque[tuple[list[Any], list[torch.Tensor]]]] = {}
        self._tapes: dict[str, LocalTape] = {}
        self._lock = threading.RLock()

    def add(self, actor: str, log: list[list[Any]], tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            q = self._queues.setdefault(actor, deque())
            for e in log:
                q.append((e, list(tensors)))
            self.pump()

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def pump(self) -> None:
        """Apply every entry whose inputs are available; repeat while progress is made."""
        with self._lock:
            progress = True
            while progress:
                progress = False
                for actor, q in self._queues.items():
                    while q and self._ready(q[0][0]):
                        e, ts = q.popleft()
                        self._apply(actor, e, ts)
                        progress = True

    def _ready(self, e: list[Any]) -> bool:
        if e[0] == "recv":
            return self.hub.stamp(_ref(e[1]), wait=False) is not None
        if e[0] == "recovered":
            return all(self.hub.stamp(_ref(r), wait=False) is not None for r in (e[3], e[4]))
        return True

    def _apply(self, actor: str, e: list[Any], ts: list[torch.Tensor]) -> None:
        t = self._tapes.get(actor)
        if t is None:
            t = self._tapes[actor] = self.hub.local(actor)
        op = e[0]
        if op == "begin":
            t.begin_step(int(e[1]))
        elif op == "end":
            t.end_step()
        elif op == "batch":
            t.batch(e[1])
        elif op == "loss":
            t.loss(e[1])
        elif op == "metric":
            t.metric(e[1], e[2])
        elif op == "params":
            names, first = e[1], int(e[2])
            t.params(list(zip(names, ts[first:first + len(names)])))
        elif op == "send":
            t.send(_ref(e[1]), e[2], bytes(e[3]))
        elif op == "recv":
            t.recv(_ref(e[1]))
        elif op == "decide":
            t.decide(e[1], e[2], lambda: e[3])
        elif op == "inject":
            t.inject(e[1], e[2], e[3])
        elif op == "detected":
            t.detected(e[1], e[2], e[3])
        elif op == "recovered":
            t.recovered(e[1], e[2], _ref(e[3]), _ref(e[4]))
        elif op == "note":
            t.note(e[1])
        elif op == "snapshot":
            t.snapshot(e[1])
        elif op == "snapchan":
            t.snapshot_channels(e[1], [(str(c), int(q)) for c, q in e[2]])
        elif op == "snapout":
            t.snapshot_outcome(e[1], committed=bool(e[2]), path=str(e[3]), parts=list(e[4]), excluded=list(e[5]),
                               reason=str(e[6]))
        else:
            raise ReplayError(f"unknown remote tape op {op!r}", actor=actor)


class TapeSinkEvents:
    """An :class:`~replay.channel.base.EventSink` that tapes a SnapshotAgent's events on a
    :class:`TapeSink` (spec/snapshot-protocol.md §9a rule 6).

    Channel events (send, recv, empty polls, peer deaths) are not taped here: an
    application on the hub tapes its sends and receives itself, where it sends and where
    it *consumes* (an :class:`~replay.channel.inbox.Inbox`), which is not where the
    endpoint delivers. The recorded channel state's endpoint references become tape
    references through ``hub`` (an untaped message has none and is left out); a
    ``snapshot.local_done`` payload's ``also`` entries are tape references already."""

    def __init__(self, sink: TapeSink, hub: TapeHub | None = None) -> None:
        self.sink = sink
        self.hub = hub

    def _tape_refs(self, payload: Mapping[str, Any]) -> list[tuple[str, int]]:
        refs = {(str(c), int(q)) for c, q in payload.get("also", ())}
        for channel, seq in payload.get("inflight_refs", ()):
            src, _, dst = str(channel).partition("->")
            if self.hub is None:
                raise ReplayError("recorded channel state needs the tape hub to name its messages", channel=channel)
            st = self.hub.stamp((src, dst, int(seq)), wait=False)
            if st is not None:
                refs.add((st.channel, st.chan_seq))
        return sorted(refs)

    def record(self, kind: str, actor: str, clock: VectorClock, step: int,
               payload: Mapping[str, Any]) -> VectorClock | None:
        s, p = self.sink, payload
        if kind == "snapshot.record":
            s.snapshot(str(p["snapshot"]))
            return getattr(s, "clock", None)
        if kind == "snapshot.local_done":
            s.snapshot_channels(str(p["snapshot"]), self._tape_refs(p))
        elif kind == "snapshot.exclude":
            s.detected("snapshot-excluded", str(p["actor"]), {"snapshot": p["snapshot"], "reason": p["reason"]})
        elif kind == "snapshot.peer_failed":
            s.detected("snapshot-peer-failed", str(p["peer"]), {"snapshot": p["snapshot"]})
        elif kind in ("snapshot.commit", "snapshot.abort"):
            s.snapshot_outcome(str(p["snapshot"]), committed=kind == "snapshot.commit", path=str(p.get("path", "")),
                               parts=list(p.get("parts", ())), excluded=list(p.get("excluded", ())),
                               reason=str(p.get("reason", "")))
        elif kind == "snapshot.restore":
            s.note(f"snapshot.restore {p['snapshot']}")
        return None
