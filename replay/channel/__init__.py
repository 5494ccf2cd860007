"""FIFO, sequence-numbered, point-to-point channels between named actors.

``Endpoint`` is what applications and the snapshot agent use; a ``Transport`` moves the
messages: ``InProcessNetwork`` (deterministic, for tests and forced replay) or
``TorchDistTransport`` (torch.distributed point-to-point; imported lazily because it
needs an initialised process group). ``RecorderSink`` records them on the event tape;
``TapeHub`` puts a whole job (threads and processes, restarted incarnations) on one tape,
and ``Inbox`` lets an application consume delivered messages in its own, taped, order.
"""

from __future__ import annotations

from typing import Any

from replay.channel.base import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ArrivalScheduler,
    ClockSink,
    Endpoint,
    EventSink,
    ForcedScheduler,
    ListSink,
    Message,
    MessageKind,
    PeerGone,
    Ready,
    Scheduler,
    SeededScheduler,
    SinkEvent,
    Transport,
    channel_name,
)
from replay.channel.hub import (
    LocalTape,
    LogApplier,
    MsgRef,
    RemoteTape,
    TapeHub,
    TapeSink,
    TapeSinkEvents,
    actor_of,
    endpoint_name,
    meta_digest,
    stamp_from_json,
    stamp_to_json,
)
from replay.channel.inbox import Inbox, ref_of
from replay.channel.inprocess import InProcessNetwork, InProcessTransport
from replay.channel.taping import RecorderSink, message_digest, taped_delivery_order

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ArrivalScheduler",
    "ClockSink",
    "Endpoint",
    "EventSink",
    "ForcedScheduler",
    "Inbox",
    "InProcessNetwork",
    "InProcessTransport",
    "ListSink",
    "LocalTape",
    "LogApplier",
    "Message",
    "MessageKind",
    "MsgRef",
    "PeerGone",
    "Ready",
    "RecorderSink",
    "RemoteTape",
    "Scheduler",
    "SeededScheduler",
    "SinkEvent",
    "TapeHub",
    "TapeSink",
    "TapeSinkEvents",
    "TorchDistTransport",
    "Transport",
    "actor_of",
    "channel_name",
    "endpoint_name",
    "message_digest",
    "meta_digest",
    "ref_of",
    "stamp_from_json",
    "stamp_to_json",
    "taped_delivery_order",
]


def __getattr__(name: str) -> Any:
    if name == "TorchDistTransport":
        from replay.channel.torchdist import TorchDistTransport

        return TorchDistTransport
    raise AttributeError(name)
