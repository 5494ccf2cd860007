"""FIFO, sequence-numbered, point-to-point channels between named actors.

``Endpoint`` is what applications and the snapshot agent use; a ``Transport`` moves the
messages: ``InProcessNetwork`` (deterministic, for tests and forced replay) or
``TorchDistTransport`` (torch.distributed point-to-point; imported lazily because it
needs an initialised process group).
"""

from __future__ import annotations

from typing import Any

from replay.channel.base import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ArrivalScheduler,
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

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "ArrivalScheduler",
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
    "Scheduler",
    "SeededScheduler",
    "SinkEvent",
    "TorchDistTransport",
    "Transport",
    "channel_name",
]


def __getattr__(name: str) -> Any:
    if name == "TorchDistTransport":
        from replay.channel.torchdist import TorchDistTransport

        return TorchDistTransport
    raise AttributeError(name)
