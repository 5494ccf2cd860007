"""FIFO, sequence-numbered, point-to-point channels between named actors.

``Endpoint`` is what applications and the snapshot agent use; a ``Transport`` moves the
messages: ``InProcessNetwork`` (deterministic, for tests and forced replay) or
``TorchDistTransport`` (torch.distributed point-to-point; imported lazily because it
needs an initialised process group). ``RecorderSink`` records them on the event tape.
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
from replay.channel.inprocess import InProcessNetwork, InProcessTransport
from replay.channel.taping import RecorderSink, message_digest, taped_delivery_order

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ArrivalScheduler",
    "ClockSink",
    "Endpoint",
    "EventSink",
    "ForcedScheduler",
    "InProcessNetwork",
    "InProcessTransport",
    "ListSink",
    "Message",
    "MessageKind",
    "PeerGone",
    "Ready",
    "RecorderSink",
    "Scheduler",
    "SeededScheduler",
    "SinkEvent",
    "TorchDistTransport",
    "Transport",
    "channel_name",
    "message_digest",
    "taped_delivery_order",
]


def __getattr__(name: str) -> Any:
    if name == "TorchDistTransport":
        from replay.channel.torchdist import TorchDistTransport

        return TorchDistTransport
    raise AttributeError(name)
