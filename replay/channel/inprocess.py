"""A deterministic in-process transport: one network object, one transport per actor.

Nothing here is timing-dependent when driven from one thread: arrival order is the
order of ``send`` calls, and the Endpoint's scheduler (seeded or forced) picks the
delivery order across channels. It is also thread-safe, so actors may run as threads
(replay in force mode does this: the forced order makes the outcome independent of
thread timing).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Iterable

from replay.channel.base import Message, MessageKind, PeerGone, channel_name
from replay.errors import ChannelError, PeerDiedError

__all__ = ["InProcessNetwork", "InProcessTransport"]


class InProcessNetwork:
    """Directed channels between named actors. ``edges`` are ``(src, dst)`` pairs."""

    def __init__(self, edges: Iterable[tuple[str, str]], *, actors: Iterable[str] = ()) -> None:
        self._edges = sorted(set((str(s), str(d)) for s, d in edges))
        for s, d in self._edges:
            if s == d:
                raise ChannelError("a channel needs two distinct actors", channel=channel_name(s, d))
        names = set(actors)
        for s, d in self._edges:
            names.update((s, d))
        self.actors: tuple[str, ...] = tuple(sorted(names))
        self._cond = threading.Condition()
        self._inbox: dict[str, deque[Message | PeerGone]] = {a: deque() for a in self.actors}
        self._dead: set[str] = set()
        self._transports: dict[str, InProcessTransport] = {}
        self._shut: str | None = None  # shutdown()'s detail

    @classmethod
    def complete(cls, actors: Iterable[str]) -> "InProcessNetwork":
        names = list(actors)
        return cls([(a, b) for a in names for b in names if a != b], actors=names)

    @property
    def edges(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._edges)

    def transport(self, actor: str) -> "InProcessTransport":
        if actor not in self._inbox:
            raise ChannelError(f"unknown actor {actor!r}")
        if actor not in self._transports:
            inbound = tuple(s for s, d in self._edges if d == actor)
            outbound = tuple(d for s, d in self._edges if s == actor)
            self._transports[actor] = InProcessTransport(self, actor, inbound, outbound)
        return self._transports[actor]

    def kill(self, actor: str, detail: str = "killed") -> None:
        """The actor stops: its inbox is dropped, and every receiver of one of its
        channels gets a PeerGone after the last message it had fully sent."""
        with self._cond:
            if actor in self._dead:
                return
            self._dead.add(actor)
            self._inbox[actor].clear()
            for s, d in self._edges:
                if s == actor and d not in self._dead:
                    self._inbox[d].append(PeerGone(actor, detail))
            self._cond.notify_all()

    def shutdown(self, detail: str) -> None:
        """The whole run failed: every actor is killed (as by :meth:`kill`) and from now on a
        receive on any of its transports raises ChannelError at once, so that no thread is
        left blocked on an endpoint nobody will ever send to (a wait without a clock, such as
        a hot spare's, would otherwise never end)."""
        for a in self.actors:
            self.kill(a, detail)
        with self._cond:
            self._shut = detail
            self._cond.notify_all()

    def in_flight(self) -> list[Message]:
        """Messages sent and not yet taken by their receiver's endpoint (for tests)."""
        with self._cond:
            return [m for q in self._inbox.values() for m in q if isinstance(m, Message)]

    # -- used by transports -------------------------------------------------------------
    def _post(self, msg: Message) -> None:
        with self._cond:
            if msg.src in self._dead:
                raise ChannelError(f"actor {msg.src} is dead and cannot send", channel=msg.channel, seq=msg.seq)
            if msg.dst in self._dead:
                raise PeerDiedError(f"peer {msg.dst} is dead", channel=msg.channel, seq=msg.seq)
            self._inbox[msg.dst].append(msg)
            self._cond.notify_all()

    def _take(self, actor: str, timeout: float | None) -> Message | PeerGone | None:
        with self._cond:
            q = self._inbox[actor]
            if not q and timeout != 0:
                deadline = None if timeout is None else time.monotonic() + timeout
                while not q and self._shut is None:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
            if self._shut is not None:
                raise ChannelError(f"{actor}: the network was shut down ({self._shut})", channel=f"*->{actor}")
            return q.popleft() if q else None


class InProcessTransport:
    """One actor's end of an ``InProcessNetwork``: deterministic, in-process delivery."""

    def __init__(self, net: InProcessNetwork, actor: str, inbound: tuple[str, ...], outbound: tuple[str, ...]) -> None:
        self._net = net
        self._actor = actor
        self._inbound = inbound
        self._outbound = outbound

    @property
    def actor(self) -> str:
        return self._actor

    @property
    def inbound(self) -> tuple[str, ...]:
        return self._inbound

    @property
    def outbound(self) -> tuple[str, ...]:
        return self._outbound

    def send(self, msg: Message) -> None:
        if msg.dst not in self._outbound:
            raise ChannelError(f"no channel from {self._actor} to {msg.dst}", channel=msg.channel, seq=msg.seq)
        if msg.kind is MessageKind.DATA and msg.tensors:
            # Value semantics, as over a wire: the sender may reuse its buffers at once.
            msg = Message(msg.src, msg.dst, msg.seq, msg.clock, msg.kind, msg.meta,
                          tuple(t.detach().clone() for t in msg.tensors))
        self._net._post(msg)

    def recv(self, timeout: float | None) -> Message | PeerGone | None:
        return self._net._take(self._actor, timeout)

    def close(self, timeout: float = 10.0) -> None:
        return None
