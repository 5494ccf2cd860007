"""The channel seam: messages, transports, event sinks, delivery schedulers, endpoints.

Layering (each layer knows only the one below it)::

    application / SnapshotAgent
        Endpoint       per actor: vector clock, per-channel sequence numbers, delivery order
                       (Scheduler), event recording (EventSink), marker hand-off
        Transport      moves whole Messages between named actors, FIFO per channel
                       (InProcessTransport, TorchDistTransport)

A *channel* is the ordered pair ``src -> dst``. Data messages on a channel carry the
sequence numbers 0, 1, 2, ... with no gaps, and each carries the sender's vector clock
after its send tick. Control messages (snapshot markers) travel in the same FIFO but
neither consume a sequence number nor tick the clock: they carry ``seq`` = the number
of data messages sent on the channel before them. That keeps the data sequence and
the clocks of a run identical whether or not snapshots were taken, which is what lets
a restored run be forced onto the original's post-cut delivery order by ``(src, seq)``.

Markers are handed to control handlers only at the start of a receive call
(``recv``/``try_recv``/``poll``), before anything is delivered in that call. A snapshot
cut therefore always falls *between* two application-visible events of an actor.

One clock per actor. An Endpoint keeps the actor's vector clock itself only while no one
else does. When its sink is a :class:`ClockSink` (the event tape's recorder, via
``replay.channel.taping.RecorderSink``), the sink's clock is the actor's only clock: a
send is taped first and the message carries the clock of that taped event, and a receive
is taped by merging the message's clock there. Two clocks for one actor (one ticking on
every taped event, one on messages only) would make a recorded tape uncheckable: its
receives would not be after its sends and its cuts would mean nothing.
"""

from __future__ import annotations

import enum
import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import msgpack
import torch

from replay.clock import VectorClock
from replay.errors import (
    ChannelError,
    DivergenceError,
    MessageTooLargeError,
    PeerDiedError,
    ReceiveTimeoutError,
    SnapshotError,
)

__all__ = [
    "MessageKind",
    "Message",
    "PeerGone",
    "Transport",
    "EventSink",
    "ClockSink",
    "SinkEvent",
    "ListSink",
    "Ready",
    "Scheduler",
    "ArrivalScheduler",
    "SeededScheduler",
    "ForcedScheduler",
    "Endpoint",
    "channel_name",
    "DEFAULT_MAX_MESSAGE_BYTES",
]

# 256 MiB: far above any marker or metadata message, small enough that a corrupt length
# field cannot make a receiver allocate the machine away.
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
"""The largest message a channel accepts unless told otherwise (256 MiB)."""


def channel_name(src: str, dst: str) -> str:
    """The name of the channel from ``src`` to ``dst``: ``src->dst``."""
    return f"{src}->{dst}"


class MessageKind(enum.IntEnum):
    """Wire values are part of the format (spec/snapshot-protocol.md); never renumber."""

    DATA = 1
    MARKER = 2
    BYE = 3  # transport-internal: "I will send nothing more on this channel"


@dataclass(frozen=True, slots=True)
class Message:
    """One message on a channel: its ends, its sequence number, the sender's vector clock, a
    msgpack-able ``meta`` and tensors."""

    src: str
    dst: str
    seq: int
    clock: VectorClock
    kind: MessageKind = MessageKind.DATA
    meta: Mapping[str, Any] = field(default_factory=dict)
    tensors: tuple[torch.Tensor, ...] = ()

    @property
    def channel(self) -> str:
        return channel_name(self.src, self.dst)

    def meta_bytes(self) -> bytes:
        try:
            return msgpack.packb(self.meta, use_bin_type=True, strict_types=False)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ChannelError(f"message metadata is not msgpack-able: {exc}", channel=self.channel, seq=self.seq) from exc

    def payload_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


@dataclass(frozen=True, slots=True)
class PeerGone:
    """Queued by a transport after the last complete message from a peer that died.

    ``seq`` is the sequence number of a message the peer was in the middle of sending
    (a torn message), or None when it died between messages.
    """

    src: str
    detail: str
    seq: int | None = None


@runtime_checkable
class Transport(Protocol):
    """Moves whole messages; FIFO per (src, dst) channel; no ordering across channels."""

    @property
    def actor(self) -> str: ...

    @property
    def inbound(self) -> tuple[str, ...]: ...

    @property
    def outbound(self) -> tuple[str, ...]: ...

    def send(self, msg: Message) -> None:
        """Send durably to ``msg.dst`` (returns once the transport owns the bytes).

        Raises PeerDiedError when the destination is gone.
        """

    def recv(self, timeout: float | None) -> Message | PeerGone | ChannelError | None:
        """The next arrival on any inbound channel, in arrival order.

        ``timeout`` 0 polls; None waits forever. Returns None on timeout. A
        ChannelError item (e.g. a dropped oversize message) is returned, not raised,
        so that the endpoint can attach its own context.
        """

    def close(self, timeout: float = 10.0) -> None: ...


# -- event sink ------------------------------------------------------------------------


class EventSink(Protocol):
    """Where sends, receives and snapshot outcomes are recorded (the tape, in the end).

    ``payload`` is msgpack-able. Implementations must tolerate calls from a background
    thread (snapshot commit); ``Endpoint`` serialises its own calls with a lock.
    ``record`` returns None, or (a :class:`ClockSink`) the clock the event was taped at.
    """

    def record(self, kind: str, actor: str, clock: VectorClock, step: int,
               payload: Mapping[str, Any]) -> VectorClock | None: ...


@runtime_checkable
class ClockSink(Protocol):
    """An EventSink that keeps the actors' vector clocks: one clock per actor, its own.

    An Endpoint whose sink is one keeps no clock. It asks ``clock_of``; a send calls
    ``record_send`` *before* the message leaves (the message carries the returned clock,
    which is the taped send event's); a delivery calls ``record_recv`` (merge the
    message's clock, tick, tape). Other events go to ``record``, which returns the clock
    of the taped event when it ticked one (a snapshot's cut) and None when it taped
    nothing (markers: they never tick). ``adopt_clock`` merges a restored cut.
    """

    def record(self, kind: str, actor: str, clock: VectorClock, step: int,
               payload: Mapping[str, Any]) -> VectorClock | None: ...

    def clock_of(self, actor: str) -> VectorClock: ...

    def adopt_clock(self, actor: str, clock: VectorClock) -> None: ...

    def record_send(self, msg: Message, step: int) -> VectorClock: ...

    def record_recv(self, msg: Message, step: int) -> None: ...


@dataclass(frozen=True, slots=True)
class SinkEvent:
    """One event a sink recorded: kind, actor, vector clock, step and payload."""

    kind: str
    actor: str
    clock: VectorClock
    step: int
    payload: Mapping[str, Any]


class ListSink:
    """An in-memory sink, for tests and for deriving forced delivery orders."""

    def __init__(self) -> None:
        self.events: list[SinkEvent] = []
        self._lock = threading.Lock()

    def record(self, kind: str, actor: str, clock: VectorClock, step: int, payload: Mapping[str, Any]) -> None:
        with self._lock:
            self.events.append(SinkEvent(kind, actor, clock, step, dict(payload)))
        return None

    def to_list(self) -> list[dict[str, Any]]:
        """A msgpack-able form (clocks encoded), for shipping events between processes."""
        with self._lock:
            return [
                {"kind": e.kind, "actor": e.actor, "clock": e.clock.encode(), "step": e.step, "payload": dict(e.payload)}
                for e in self.events
            ]

    @staticmethod
    def from_list(items: Iterable[Mapping[str, Any]]) -> list[SinkEvent]:
        return [
            SinkEvent(i["kind"], i["actor"], VectorClock.decode(i["clock"]), int(i["step"]), dict(i["payload"]))
            for i in items
        ]


class _NullSink:
    def record(self, kind: str, actor: str, clock: VectorClock, step: int, payload: Mapping[str, Any]) -> None:
        return None


# -- delivery schedulers ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """A channel whose head message is a deliverable data message."""

    src: str
    seq: int
    arrival: int


class _Wait:
    __slots__ = ()

    def __repr__(self) -> str:
        return "WAIT"


class _Nothing:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOTHING"


WAIT = _Wait()  # the scheduler needs a message that has not arrived yet
NOTHING = _Nothing()  # a polling receive delivers nothing this time
Choice = "str | _Wait | _Nothing"


class Scheduler(Protocol):
    """Decides which ready channel delivers next (FIFO within a channel is the endpoint's).

    ``commit`` False is a dry run (``Endpoint.can_deliver``): it must not consume state.
    """

    def choose(self, ready: Sequence[Ready], *, polling: bool, commit: bool) -> str | _Wait | _Nothing: ...


class ArrivalScheduler:
    """Deliver in arrival order across channels: what a real job does."""

    def choose(self, ready: Sequence[Ready], *, polling: bool, commit: bool) -> str | _Wait | _Nothing:
        if ready:
            return min(ready, key=lambda r: r.arrival).src
        return NOTHING if polling else WAIT


class SeededScheduler:
    """A seeded random choice among ready channels; deterministic given the arrivals."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, ready: Sequence[Ready], *, polling: bool, commit: bool) -> str | _Wait | _Nothing:
        if not ready:
            return NOTHING if polling else WAIT
        if not commit:
            return ready[0].src  # dry run: "something is deliverable"; draw nothing
        return self._rng.choice(sorted(r.src for r in ready))


class ForcedScheduler:
    """Force mode: deliver exactly the recorded order.

    ``order`` holds one entry per receive call: ``(src, seq)`` for a delivery, or None
    for a polling receive that delivered nothing. A forced entry waits for its message
    even in a polling receive, because the recorded run had it at that point. When the
    order runs out, ``then`` takes over, or the next receive raises DivergenceError.
    """

    def __init__(self, order: Iterable[tuple[str, int] | None], *, then: Scheduler | None = None) -> None:
        self._order: deque[tuple[str, int] | None] = deque(
            None if e is None else (str(e[0]), int(e[1])) for e in order
        )
        self._then = then
        self.consumed = 0

    @property
    def remaining(self) -> int:
        return len(self._order)

    def choose(self, ready: Sequence[Ready], *, polling: bool, commit: bool) -> str | _Wait | _Nothing:
        if not self._order:
            if self._then is not None:
                return self._then.choose(ready, polling=polling, commit=commit)
            raise DivergenceError("forced delivery order exhausted: the replay receives more than the recording did",
                                  seq=self.consumed)
        entry = self._order[0]
        if entry is None:
            if not polling:
                raise DivergenceError("forced order says this receive delivered nothing, but a blocking receive must "
                                      "deliver", seq=self.consumed)
            if commit:
                self._order.popleft()
                self.consumed += 1
            return NOTHING
        src, seq = entry
        for r in ready:
            if r.src == src:
                if r.seq != seq:
                    raise DivergenceError(f"forced order expects seq {seq} next, the channel holds seq {r.seq}",
                                          channel=channel_name(src, "*"), seq=r.seq)
                if commit:
                    self._order.popleft()
                    self.consumed += 1
                return src
        return WAIT

    def expected(self) -> tuple[str, int] | None:
        return self._order[0] if self._order else None


# -- endpoint --------------------------------------------------------------------------


ControlHandler = Callable[[Message], None]
DeliveryObserver = Callable[[Message], None]
FailureHandler = Callable[[str], None]


class Endpoint:
    """One actor's view of its channels. Not thread-safe: one thread drives it.

    Options are keyword-only:
    - ``scheduler``: delivery order across channels (default: arrival order);
    - ``sink``: where send/recv events go (default: nowhere); a :class:`ClockSink`
      also keeps this actor's clock (see the module docstring);
    - ``max_message_bytes``: the declared per-message bound (metadata + tensor bytes),
      checked before sending and, by the transport, before allocating on receipt;
    - ``step``: a callable giving the application's step for recorded events;
    - ``forced_wait_s``: how long a forced receive waits for its recorded message.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        scheduler: Scheduler | None = None,
        sink: EventSink | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        step: Callable[[], int] | None = None,
        forced_wait_s: float = 60.0,
        record_empty: bool = True,
    ) -> None:
        self.transport = transport
        self.actor = transport.actor
        self.scheduler: Scheduler = scheduler or ArrivalScheduler()
        self.sink: EventSink = sink or _NullSink()
        self.max_message_bytes = int(max_message_bytes)
        self._step = step or (lambda: 0)
        self.forced_wait_s = forced_wait_s
        self.record_empty = record_empty
        self._clocks: ClockSink | None = sink if isinstance(sink, ClockSink) else None
        self._clock = VectorClock()
        self.next_send: dict[str, int] = {d: 0 for d in transport.outbound}
        self.next_recv: dict[str, int] = {s: 0 for s in transport.inbound}
        self._buf: dict[str, deque[tuple[int, Message]]] = {s: deque() for s in transport.inbound}
        self._skip: dict[str, set[int]] = {s: set() for s in transport.inbound}
        self._arrivals = itertools.count()
        self.dead: set[str] = set()
        self._control: list[ControlHandler] = []
        self._observers: list[DeliveryObserver] = []
        self._failure: list[FailureHandler] = []
        self._sink_lock = threading.Lock()
        self.delivered = 0

    # -- wiring for layers above ------------------------------------------------------
    @property
    def inbound(self) -> tuple[str, ...]:
        return tuple(self.transport.inbound)

    @property
    def outbound(self) -> tuple[str, ...]:
        return tuple(self.transport.outbound)

    def on_control(self, handler: ControlHandler) -> None:
        self._control.append(handler)

    def on_deliver(self, observer: DeliveryObserver) -> None:
        self._observers.append(observer)

    def on_peer_failed(self, handler: FailureHandler) -> None:
        self._failure.append(handler)

    @property
    def clock(self) -> VectorClock:
        """The actor's vector clock (the ClockSink's when there is one)."""
        return self._clocks.clock_of(self.actor) if self._clocks is not None else self._clock

    @clock.setter
    def clock(self, value: VectorClock) -> None:
        if self._clocks is not None:
            self._clocks.adopt_clock(self.actor, value)
        else:
            self._clock = value

    def record(self, kind: str, payload: Mapping[str, Any]) -> VectorClock:
        """Record an event; returns its clock (the taped event's, when a ClockSink ticked)."""
        with self._sink_lock:
            clock = self.clock
            taped = self.sink.record(kind, self.actor, clock, self._step(), payload)
        return taped if taped is not None else clock

    @property
    def step(self) -> int:
        return self._step()

    # -- sending ----------------------------------------------------------------------
    def send(self, dst: str, meta: Mapping[str, Any] | None = None, tensors: Sequence[torch.Tensor] = ()) -> Message:
        if dst not in self.next_send:
            raise ChannelError(f"no channel from {self.actor} to {dst}", channel=channel_name(self.actor, dst))
        seq = self.next_send[dst]
        if dst in self.dead:
            raise PeerDiedError(f"peer {dst} is dead", channel=channel_name(self.actor, dst), seq=seq)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise ChannelError(f"tensors must be torch.Tensor, got {type(t).__name__}",
                                   channel=channel_name(self.actor, dst), seq=seq)
        clock = self.clock.send(self.actor)
        msg = Message(self.actor, dst, seq, clock, MessageKind.DATA, dict(meta or {}), tuple(tensors))
        size = len(msg.meta_bytes()) + msg.payload_nbytes()
        if size > self.max_message_bytes:
            # Checked before anything is sent or ticked: the caller's state is unchanged.
            raise MessageTooLargeError(
                f"message of {size} bytes is above the declared bound of {self.max_message_bytes} bytes",
                channel=msg.channel, seq=seq)
        if self._clocks is not None:
            # Tape first: the message must carry the clock of its taped send event. A send
            # that then fails stays on the tape, followed by the peer's death.
            with self._sink_lock:
                clock = self._clocks.record_send(msg, self._step())
            msg = Message(msg.src, msg.dst, seq, clock, MessageKind.DATA, msg.meta, msg.tensors)
        try:
            self.transport.send(msg)
        except PeerDiedError:
            self._mark_dead(dst)
            raise
        self.next_send[dst] = seq + 1
        if self._clocks is None:
            self._clock = clock
            self.record("send", {"channel": msg.channel, "dst": dst, "seq": seq, "nbytes": size})
        return msg

    def send_control(self, dst: str, kind: MessageKind, meta: Mapping[str, Any]) -> Message:
        """Send a control message (marker): no sequence number consumed, no clock tick."""
        if dst not in self.next_send:
            raise ChannelError(f"no channel from {self.actor} to {dst}", channel=channel_name(self.actor, dst))
        msg = Message(self.actor, dst, self.next_send[dst], self.clock, kind, dict(meta), ())
        if dst in self.dead:
            raise PeerDiedError(f"peer {dst} is dead", channel=msg.channel, seq=msg.seq)
        try:
            self.transport.send(msg)
        except PeerDiedError:
            self._mark_dead(dst)
            raise
        return msg

    # -- receiving --------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> Message:
        """Deliver the next data message (blocking). Raises ReceiveTimeoutError."""
        msg = self._receive(polling=False, timeout=timeout)
        assert msg is not None
        return msg

    def recv_from(self, src: str, timeout: float | None = None) -> Message:
        """Deliver the next data message on the channel ``src -> me`` (blocking), whatever
        arrived on other channels meanwhile: the delivery order is then the program's, not
        the arrival order, and no receive is a timing-dependent choice. Markers are handed
        over as in :meth:`recv`. The scheduler chooses among that one channel only (a
        :class:`ForcedScheduler` must expect it next). Raises ReceiveTimeoutError."""
        if src not in self._buf:
            raise ChannelError(f"no channel from {src} to {self.actor}", channel=channel_name(src, self.actor))
        msg = self._receive(polling=False, timeout=timeout, only=src)
        assert msg is not None
        return msg

    def try_recv(self) -> Message | None:
        """Deliver a data message if one is ready (a forced order may make this wait)."""
        return self._receive(polling=True, timeout=0.0)

    def poll(self) -> None:
        """Take in arrivals and run control handlers; deliver nothing."""
        self._ingest(0.0)
        self._run_control()

    def can_deliver(self) -> bool:
        """Would ``try_recv`` return without waiting? (Used by single-threaded simulations.)"""
        self._ingest(0.0)
        self._run_control()
        choice = self.scheduler.choose(self._ready(), polling=True, commit=False)
        return choice is not WAIT

    def pending(self, src: str) -> int:
        """Messages (data and control) that arrived on ``src -> me`` and are not delivered."""
        return len(self._buf[src])

    def buffered(self, src: str) -> list[Message]:
        """Data messages that arrived complete on ``src -> me`` and are not delivered yet."""
        return [m for _, m in self._buf[src] if m.kind is MessageKind.DATA]

    def _ready(self) -> list[Ready]:
        out = []
        for src, q in self._buf.items():
            if q and q[0][1].kind is MessageKind.DATA:
                arrival, m = q[0]
                out.append(Ready(src, m.seq, arrival))
        return out

    def _receive(self, *, polling: bool, timeout: float | None, only: str | None = None) -> Message | None:
        forced = isinstance(self.scheduler, ForcedScheduler)
        if forced and polling:
            timeout = self.forced_wait_s
        deadline = None if timeout is None else time.monotonic() + timeout
        self._ingest(0.0)
        while True:
            self._run_control()
            ready = self._ready()
            if only is not None:
                if only in self.dead and not self.buffered(only):
                    raise PeerDiedError(f"peer {only} is dead", channel=channel_name(only, self.actor),
                                        seq=self.next_recv[only])
                ready = [r for r in ready if r.src == only]
            choice = self.scheduler.choose(ready, polling=polling, commit=True)
            if isinstance(choice, str):
                return self._deliver(choice)
            if choice is NOTHING:
                if self.record_empty:
                    self.record("recv.none", {})
                return None
            # WAIT: block for one more arrival.
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._timeout_error(timeout, only)
            got = self._ingest(left, block=True)
            if not got and deadline is not None and time.monotonic() >= deadline:
                raise self._timeout_error(timeout, only)

    def _timeout_error(self, timeout: float | None, only: str | None = None) -> ReceiveTimeoutError:
        exp = self.scheduler.expected() if isinstance(self.scheduler, ForcedScheduler) else None
        if only is not None and exp is None:
            return ReceiveTimeoutError(f"no message within {timeout} s", channel=channel_name(only, self.actor),
                                       seq=self.next_recv[only] + len(self.buffered(only)))
        if exp is not None:
            src, seq = exp
            return ReceiveTimeoutError(f"no message within {timeout} s", channel=channel_name(src, self.actor), seq=seq)
        live = sorted(s for s in self.inbound if s not in self.dead)
        chans = ",".join(channel_name(s, self.actor) for s in live) or f"*->{self.actor}"
        seqs = ",".join(str(self.next_recv[s] + len(self._buf[s])) for s in live)
        return ReceiveTimeoutError(f"no message within {timeout} s", channel=chans, seq=seqs or None)

    def _ingest(self, timeout: float | None, *, block: bool = False) -> bool:
        """Move arrivals from the transport into per-channel buffers. True if any came."""
        got = False
        wait = timeout if block else 0.0
        while True:
            item = self.transport.recv(wait)
            wait = 0.0
            if item is None:
                return got
            got = True
            if isinstance(item, Message):
                self._buf[item.src].append((next(self._arrivals), item))
            elif isinstance(item, PeerGone):
                seq = item.seq if item.seq is not None else self._next_expected(item.src)
                self._mark_dead(item.src)
                raise PeerDiedError(f"peer {item.src} died: {item.detail}",
                                    channel=channel_name(item.src, self.actor), seq=seq)
            elif isinstance(item, MessageTooLargeError):
                src = item.context["channel"].split("->")[0]
                self._skip[src].add(int(item.context["seq"]))
                raise item
            else:
                raise item

    def _next_expected(self, src: str) -> int:
        n = self.next_recv[src]
        for _, m in self._buf[src]:
            if m.kind is MessageKind.DATA:
                n = max(n, m.seq + 1)
        return n

    def _run_control(self) -> None:
        # Hand over control messages that sit at the head of a channel, oldest first:
        # FIFO guarantees that every data message sent before a marker was delivered.
        while True:
            heads = [(q[0][0], src) for src, q in self._buf.items() if q and q[0][1].kind is not MessageKind.DATA]
            if not heads:
                return
            _, src = min(heads)
            _, msg = self._buf[src].popleft()
            if msg.kind is MessageKind.MARKER:
                for h in self._control:
                    h(msg)

    def _deliver(self, src: str) -> Message:
        _, msg = self._buf[src].popleft()
        expect = self.next_recv[src]
        while expect in self._skip[src]:
            self._skip[src].discard(expect)
            expect += 1
        if msg.seq != expect:
            raise ChannelError(f"sequence gap: expected seq {expect}, got {msg.seq}", channel=msg.channel, seq=msg.seq)
        self.next_recv[src] = msg.seq + 1
        self.delivered += 1
        if self._clocks is not None:
            with self._sink_lock:
                self._clocks.record_recv(msg, self._step())
        else:
            self._clock = self._clock.receive(self.actor, msg.clock)
            self.record("recv", {"channel": msg.channel, "src": src, "seq": msg.seq, "send_clock": msg.clock.encode()})
        for obs in self._observers:
            obs(msg)
        return msg

    def _mark_dead(self, peer: str) -> None:
        if peer in self.dead:
            return
        self.dead.add(peer)
        self.record("peer.died", {"peer": peer})
        for h in self._failure:
            h(peer)

    # -- state for snapshots and restore ---------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # With a ClockSink, another thread (a snapshot coordinator taping an outcome) may
        # tick the clock at any time: the snapshot agent stores the cut it taped instead.
        return {
            "clock": self.clock.encode(),
            "next_send": dict(self.next_send),
            "next_recv": dict(self.next_recv),
        }

    def restore(self, state: Mapping[str, Any], inflight: Mapping[str, Sequence[Message]]) -> None:
        """Reset clock and sequence numbers to a cut and queue the recorded in-flight
        messages at the head of their channels, ahead of anything that arrived since."""
        if self.delivered:
            raise SnapshotError("restore must happen before the endpoint delivers anything", actor=self.actor)
        if set(state["next_send"]) != set(self.next_send) or set(state["next_recv"]) != set(self.next_recv):
            raise SnapshotError(
                "the channel topology differs from the snapshot's: "
                f"snapshot out={sorted(state['next_send'])} in={sorted(state['next_recv'])}, "
                f"here out={sorted(self.next_send)} in={sorted(self.next_recv)}", actor=self.actor)
        self.clock = VectorClock.decode(state["clock"])  # a ClockSink merges it (its clock never goes back)
        self.next_send = {k: int(v) for k, v in state["next_send"].items()}
        self.next_recv = {k: int(v) for k, v in state["next_recv"].items()}
        for src, msgs in inflight.items():
            if src not in self._buf:
                raise SnapshotError(f"recorded channel {channel_name(src, self.actor)} does not exist here",
                                    actor=self.actor)
            expect = self.next_recv[src]
            for m in msgs:
                if m.seq != expect:
                    raise SnapshotError("recorded channel state is not contiguous", channel=m.channel, seq=m.seq)
                expect += 1
            # Negative arrival numbers: the recorded messages arrived "before" anything new.
            head = [(-len(msgs) + i - 1_000_000_000, m) for i, m in enumerate(msgs)]
            self._buf[src] = deque(head + list(self._buf[src]))

    def close(self, timeout: float = 10.0) -> None:
        self.transport.close(timeout)
