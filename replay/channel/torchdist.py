"""A transport over torch.distributed point-to-point ops (gloo on CPU; see the NCCL note).

Each process runs one receiver thread per inbound peer. The thread posts a receive for
the fixed 64-byte header, checks the declared lengths against the bound, and only then
allocates and receives the metadata and tensor chunks (wire.py). Finished messages go
into one arrival queue that the Endpoint drains. Sends happen on the caller's thread,
one message at a time per destination (a lock), so FIFO per channel holds.

Failure mapping (every error names the channel and the sequence number):
- gloo reports a closed connection ("Connection closed by peer") or its own timeout on a
  pending op: the peer died -> PeerDiedError, with the seq of the torn message when the
  header had arrived, else the next expected seq;
- a header that declares more than ``max_message_bytes``: MessageTooLargeError; the
  receiver drains the chunks through one scratch buffer, and the channel stays usable;
- a receive that waits too long: ReceiveTimeoutError, raised by the Endpoint (a gloo
  timeout poisons the whole gloo context, so timeouts are never taken at the gloo level).

Idle channels: a receiver thread waits on gloo with the process group's timeout. A
channel idle for longer than that timeout breaks the group; create the group with a
timeout above the longest idle gap (spec/snapshot-protocol.md, "Limits").

NCCL: pass ``device="cuda:N"`` to land received tensors on the GPU. The p2p calls go to
``group``; with NCCL, concurrent point-to-point calls from the receiver threads and the
sender on one communicator are not safe, so give the transport a gloo group (headers and
chunks cross on the CPU) and keep NCCL for collectives. This path is not tested here.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from replay.channel import wire
from replay.channel.base import DEFAULT_MAX_MESSAGE_BYTES, Message, MessageKind, PeerGone, channel_name
from replay.errors import ChannelError, MessageTooLargeError, PeerDiedError

__all__ = ["TorchDistTransport", "DEFAULT_CHUNK_BYTES"]

DEFAULT_CHUNK_BYTES = 16 * 1024 * 1024


class TorchDistTransport:
    """``actors[i]`` is the actor name of group rank ``i``.

    ``inbound``/``outbound`` default to every other actor. ``tag`` separates these
    point-to-point messages from other p2p traffic on the same group (gloo honours tags).
    """

    def __init__(
        self,
        actors: Sequence[str],
        *,
        inbound: Iterable[str] | None = None,
        outbound: Iterable[str] | None = None,
        group: Any = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        tag: int = 0x5250,
        device: str | torch.device = "cpu",
    ) -> None:
        if not dist.is_initialized():
            raise ChannelError("torch.distributed is not initialised")
        self._group = group
        world = dist.get_world_size(group)
        if len(actors) != world or len(set(actors)) != world:
            raise ChannelError(f"need {world} distinct actor names, one per rank; got {list(actors)}")
        if not wire.MIN_CHUNK_BYTES <= chunk_bytes <= wire.MAX_CHUNK_BYTES:
            raise ChannelError(f"chunk_bytes {chunk_bytes} outside [{wire.MIN_CHUNK_BYTES}, {wire.MAX_CHUNK_BYTES}]")
        self._actors = tuple(actors)
        self._rank_of = {a: i for i, a in enumerate(actors)}
        self._actor = actors[dist.get_rank(group)]
        others = [a for a in actors if a != self._actor]
        self._inbound = tuple(sorted(inbound)) if inbound is not None else tuple(others)
        self._outbound = tuple(sorted(outbound)) if outbound is not None else tuple(others)
        for a in (*self._inbound, *self._outbound):
            if a not in self._rank_of or a == self._actor:
                raise ChannelError(f"bad peer {a!r} for actor {self._actor!r}")
        self.max_message_bytes = int(max_message_bytes)
        self.chunk_bytes = int(chunk_bytes)
        self._tag = int(tag)
        self._device = torch.device(device)
        self._inbox: queue.Queue[Message | PeerGone | ChannelError] = queue.Queue()
        self._send_locks = {d: threading.Lock() for d in self._outbound}
        self._closing = threading.Event()
        self._closed = False
        self._threads = {
            src: threading.Thread(target=self._rx_loop, args=(src,), name=f"replay-rx-{src}", daemon=True)
            for src in self._inbound
        }
        for t in self._threads.values():
            t.start()

    # -- Transport protocol -----------------------------------------------------------
    @property
    def actor(self) -> str:
        return self._actor

    @property
    def inbound(self) -> tuple[str, ...]:
        return self._inbound

    @property
    def outbound(self) -> tuple[str, ...]:
        return self._outbound

    def recv(self, timeout: float | None) -> Message | PeerGone | ChannelError | None:
        try:
            if timeout is not None and timeout <= 0:
                return self._inbox.get_nowait()
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, msg: Message) -> None:
        if msg.dst not in self._send_locks:
            raise ChannelError(f"no channel from {self._actor} to {msg.dst}", channel=msg.channel, seq=msg.seq)
        if self._closed:
            raise ChannelError("transport is closed", channel=msg.channel, seq=msg.seq)
        tensors = [t.detach().to("cpu" if self._device.type == "cpu" else self._device).contiguous()
                   for t in msg.tensors]
        try:
            blob = wire.encode_meta(msg.src, msg.dst, msg.clock, msg.meta, tensors)
        except ChannelError as exc:
            raise ChannelError(exc.message, channel=msg.channel, seq=msg.seq) from exc
        if len(blob) > wire.MAX_META_BYTES:
            raise ChannelError(f"metadata of {len(blob)} bytes above the format limit {wire.MAX_META_BYTES}",
                               channel=msg.channel, seq=msg.seq)
        payload = sum(t.numel() * t.element_size() for t in tensors)
        header = wire.encode_header(wire.Header(msg.kind, msg.seq, len(blob), len(tensors), payload,
                                                self.chunk_bytes))
        segments = [torch.frombuffer(bytearray(blob), dtype=torch.uint8)] if blob else []
        segments += [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
        with self._send_locks[msg.dst]:
            try:
                self._send_bytes(torch.frombuffer(bytearray(header), dtype=torch.uint8), msg.dst)
                for seg in segments:
                    for a, b in wire.chunk_spans(seg.numel(), self.chunk_bytes):
                        self._send_bytes(seg[a:b], msg.dst)
            except RuntimeError as exc:
                raise PeerDiedError(f"send to {msg.dst} failed, the peer is gone: {_first_line(exc)}",
                                    channel=msg.channel, seq=msg.seq) from exc

    def close(self, timeout: float = 10.0, *, gone: Iterable[str] = ()) -> None:
        """Say BYE on every outbound channel and wait for every inbound peer's BYE.

        This is a barrier over the channel graph: call it when no more messages will be
        sent. Raises ChannelError naming the channels whose peer never said BYE. ``gone``:
        peers known to have exited (their process ended): no BYE is sent to them, since a
        gloo send to a peer whose connection the transport has not seen close yet can
        wait for a receive that never comes; their receiver threads end on the closed
        connection.
        """
        if self._closed:
            return
        self._closed = True
        bye = wire.encode_header(wire.Header(MessageKind.BYE, 0, 0, 0, 0, self.chunk_bytes))
        gone = set(gone)
        for dst in self._outbound:
            if dst in gone:
                continue
            try:
                with self._send_locks[dst]:
                    self._send_bytes(torch.frombuffer(bytearray(bye), dtype=torch.uint8), dst)
            except RuntimeError:
                pass  # a dead peer needs no goodbye
        for t in self._threads.values():
            t.join(timeout)
        self._closing.set()
        stuck = [channel_name(s, self._actor) for s, t in self._threads.items() if t.is_alive()]
        if stuck:
            raise ChannelError(f"peers did not close within {timeout} s", channel=",".join(stuck))

    # -- internals ----------------------------------------------------------------------
    def _global(self, actor: str) -> int:
        r = self._rank_of[actor]
        return dist.get_global_rank(self._group, r) if self._group is not None else r

    def _send_bytes(self, buf: torch.Tensor, dst: str) -> None:
        if self._device.type != "cpu":
            buf = buf.to(self._device)
        dist.isend(buf, self._global(dst), group=self._group, tag=self._tag).wait()

    def _recv_bytes(self, buf: torch.Tensor, src: str) -> None:
        try:
            dist.irecv(buf, self._global(src), group=self._group, tag=self._tag).wait()
        except RuntimeError as exc:  # the connection, not our own code: the peer is gone
            raise _TransportFailure() from exc

    def _recv_segment(self, dst: torch.Tensor, src: str, chunk: int) -> None:
        for a, b in wire.chunk_spans(dst.numel(), chunk):
            self._recv_bytes(dst[a:b], src)

    def _drain(self, nbytes: int, src: str, chunk: int) -> None:
        scratch = torch.empty(min(nbytes, chunk), dtype=torch.uint8, device=self._device)
        for a, b in wire.chunk_spans(nbytes, chunk):
            self._recv_bytes(scratch[: b - a], src)

    def _rx_loop(self, src: str) -> None:
        chan = channel_name(src, self._actor)
        hdr = torch.empty(wire.HEADER_SIZE, dtype=torch.uint8, device=self._device)
        next_seq = 0
        while True:
            seq: int | None = None
            try:
                self._recv_bytes(hdr, src)
                h = wire.decode_header(_host_bytes(hdr))
                if h.kind is MessageKind.BYE:
                    return
                seq = h.seq
                meta = torch.empty(h.meta_len, dtype=torch.uint8, device=self._device)
                self._recv_segment(meta, src, h.chunk_bytes)
                blob = wire.decode_meta(_host_bytes(meta), n_tensors=h.n_tensors,
                                        payload_len=h.payload_len)
                if blob.src != src or blob.dst != self._actor:
                    raise ChannelError(f"message addressed {blob.src}->{blob.dst} arrived on this channel")
                if h.meta_len + h.payload_len > self.max_message_bytes:
                    # Drain through a scratch buffer so the stream stays aligned; never
                    # allocate what the peer declared.
                    for d in blob.tensors:
                        if d.nbytes:
                            self._drain(d.nbytes, src, h.chunk_bytes)
                    self._inbox.put(MessageTooLargeError(
                        f"message of {h.meta_len + h.payload_len} bytes is above the declared bound of "
                        f"{self.max_message_bytes} bytes; dropped", channel=chan, seq=h.seq))
                    continue
                tensors = [torch.empty(d.shape, dtype=d.dtype, device=self._device) for d in blob.tensors]
                for t in tensors:
                    if t.numel():
                        self._recv_segment(t.reshape(-1).view(torch.uint8), src, h.chunk_bytes)
                if h.kind is MessageKind.DATA:
                    next_seq = h.seq + 1
                self._inbox.put(Message(src, self._actor, h.seq, blob.clock, h.kind, blob.meta, tuple(tensors)))
            except ChannelError as exc:
                # A malformed stream cannot be resynchronised: report and stop reading.
                self._inbox.put(ChannelError(f"malformed message, channel closed: {exc.message}", channel=chan,
                                             seq=seq if seq is not None else next_seq))
                return
            except _TransportFailure as exc:
                if self._closing.is_set():
                    return
                where = "mid-message" if seq is not None else "between messages"
                self._inbox.put(PeerGone(src, f"{where}: {_first_line(exc.__cause__ or exc)}", seq))
                return
            except Exception as exc:
                # A failure on *this* side (a decode bug, a missing library, memory): the
                # peer is alive and may be blocked sending to us, so this must not read as
                # "peer gone" (a survivor would wait for a replacement forever). Report it
                # as a channel error; the endpoint raises it to its owner, whose process
                # fails, and the sender's blocked send then fails on the closed connection.
                self._inbox.put(ChannelError(f"receiver failed, channel closed: {type(exc).__name__}: "
                                             f"{_first_line(exc)}", channel=chan,
                                             seq=seq if seq is not None else next_seq))
                return


class _TransportFailure(Exception):
    """A receive failed in the transport (``__cause__`` holds gloo's error)."""


def _host_bytes(t: torch.Tensor) -> bytes:
    """A small uint8 tensor's bytes, without numpy (``Tensor.numpy()`` raises "Numpy is not
    available" when numpy is missing, which once left the gloo demo hanging)."""
    return bytes(t.cpu().tolist())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
