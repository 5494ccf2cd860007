"""An actor's message plumbing over the tape hub: taped sends and an inbox addressed by MsgRef.

An application that consumes messages in its own order (through taped decisions, not
in delivery order) keeps them in an :class:`Inbox`: every message the endpoint delivers
lands in ``box`` (arrival order, keyed by ``MsgRef``), and the application takes what
its decision names. Sends are taped before they leave (``send(taped=True)``), so the
tape is the same whether or not the peer is still alive; a send can also be untaped
(the application's own control traffic: a shipped tape log, an acknowledgement). The
tape digest covers the metadata given to ``send`` and the tensors, never ``extra``
entries (a shipped tape log, wall-clock timings: different in every run).

Snapshot MARKERs (control messages) are put in the box at their FIFO position, so an
application that takes markers itself (``SnapshotAgent(markers="application")``) sees
each one after every data message sent before it (spec/snapshot-protocol.md §9a).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import torch
import xxhash

from replay.channel.base import Endpoint, Message, MessageKind
from replay.channel.hub import MsgRef, TapeSink, actor_of, meta_digest
from replay.errors import PeerDiedError, ReceiveTimeoutError

__all__ = ["Inbox", "ref_of"]


def ref_of(msg: Message) -> MsgRef:
    """The message's reference on a tape: ``(src, dst, seq)``."""
    return (msg.src, msg.dst, msg.seq)


class Inbox:
    """One actor's endpoint + tape sink + inbox. ``on_dead(endpoint)`` hears of dead peers;
    ``on_arrival(msg)`` sees every delivered message first and returns True when it
    consumed it (it then never reaches the box)."""

    def __init__(self, ep: Endpoint, tape: TapeSink, *, timeout_s: float = 120.0,
                 on_dead: Callable[[str], None] | None = None,
                 on_arrival: Callable[[Message], bool] | None = None, markers: bool = False) -> None:
        self.ep = ep
        self.tape = tape
        self.timeout_s = timeout_s
        self.on_dead = on_dead or (lambda e: None)
        # on_arrival(msg) -> True when the message was consumed out of band (not buffered)
        self.on_arrival = on_arrival or (lambda m: False)
        self.box: "OrderedDict[MsgRef, Message]" = OrderedDict()
        # on_marker(msg) -> True when the marker was taken at once (SnapshotAgent.offer_marker)
        self.on_marker: Callable[[Message], bool] | None = None
        # gone(endpoint) -> True when its process is known to have ended (an orchestrator
        # sees an exit code before a transport sees the connection close): a send to it is
        # taped and skipped, exactly as one that fails on a dead peer
        self.gone: Callable[[str], bool] | None = None
        if markers:
            # A MARKER is handed over once every data message sent before it was delivered
            # (the endpoint's FIFO cut point), so in the box it sits right after them.
            ep.on_control(self._marker)

    @staticmethod
    def marker_ref(msg: Message) -> MsgRef:
        """A MARKER's key in the box: a negative seq (it consumes no data seq, spec §1)
        derived from its snapshot's name, so the same marker has the same key in every
        run (a taped decision names it) and two snapshots' markers never share one."""
        h = xxhash.xxh3_64_intdigest(str(msg.meta.get("snapshot", "")).encode())
        return (msg.src, msg.dst, -1 - (h >> 2))

    def _marker(self, msg: Message) -> None:
        if self.on_marker is not None and self.on_marker(msg):
            return
        self.box[self.marker_ref(msg)] = msg

    @staticmethod
    def is_marker(msg: Message) -> bool:
        return msg.kind is not MessageKind.DATA

    @property
    def name(self) -> str:
        return self.ep.actor

    # -- sending ---------------------------------------------------------------------
    def send(self, dst: str, meta: Mapping[str, Any], tensors: Sequence[torch.Tensor] = (), *, taped: bool = True,
             extra: Mapping[str, Any] | None = None) -> MsgRef | None:
        """Tape the send (before it leaves, so the tape is the same whether or not the
        peer is still alive), then send. Returns the ref, or None if the peer is dead."""
        ref = (self.ep.actor, dst, self.ep.next_send[dst])
        if taped:
            self.tape.send(ref, actor_of(dst), meta_digest(meta, tensors))
        full = dict(meta)
        if extra:
            full.update(extra)
        try:
            if self.gone is not None and self.gone(dst):
                raise PeerDiedError(f"peer {dst} has ended", channel=f"{self.ep.actor}->{dst}", seq=ref[2])
            self.ep.send(dst, full, list(tensors))
        except PeerDiedError:
            self.ep.next_send[dst] = ref[2] + 1  # the seq is spent: refs stay aligned with the tape
            self.on_dead(dst)
            return None
        return ref

    # -- receiving -------------------------------------------------------------------
    def _take(self, msg: Message) -> None:
        if not self.on_arrival(msg):
            self.box[ref_of(msg)] = msg

    def poll(self, wait_s: float = 0.0) -> int:
        """Move every arrived message into the box; True count of new ones."""
        n = 0
        deadline = time.monotonic() + wait_s
        while True:
            try:
                if wait_s > 0 and n == 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return n
                    msg = self.ep.recv(timeout=left)
                else:
                    msg = self.ep.try_recv()
            except ReceiveTimeoutError:
                return n
            except PeerDiedError as e:
                self.on_dead(str(e.context.get("channel", "?")).split("->")[0])
                continue
            if msg is None:
                return n
            self._take(msg)
            n += 1

    def wait(self, pred: Callable[[], bool], what: str, *, tick: float = 0.5, bounded: bool = True) -> None:
        """Block until ``pred()`` holds, taking in messages meanwhile. ``bounded=False``:
        no clock, for a wait that legitimately lasts as long as the run (the run's own
        watchdog catches a hang there, and a closed transport ends it)."""
        deadline = time.monotonic() + self.timeout_s if bounded else math.inf
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReceiveTimeoutError(f"{self.name} waited {self.timeout_s} s for {what}",
                                          channel=f"*->{self.name}")
            self.poll(wait_s=min(left, tick))

    def wait_ref(self, ref: MsgRef) -> Message:
        self.wait(lambda: ref in self.box, f"message {ref}")
        return self.box[ref]

    def first_from(self, src: str, kinds: Sequence[str], *, bounded: bool = True) -> Message:
        """The oldest boxed message from ``src`` of one of ``kinds`` (waits for it; see
        :meth:`wait` for ``bounded``). Raises PeerDiedError once ``src`` is gone without
        having sent one (its death is reported after everything it sent)."""
        def find() -> Message | None:
            for m in self.box.values():
                if m.src == src and m.meta.get("kind") in kinds:
                    return m
            return None

        def gone() -> bool:
            return src in self.ep.dead and not self.ep.buffered(src)

        self.wait(lambda: find() is not None or gone(), f"{kinds} from {src}", bounded=bounded)
        m = find()
        if m is None:
            raise PeerDiedError(f"{self.name} waited for {kinds} from {src}, which is gone",
                                channel=f"{src}->{self.name}")
        return m

    def pop(self, ref: MsgRef) -> Message:
        return self.box.pop(ref)
