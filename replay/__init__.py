"""Event tapes with vector clocks, tape invariants, deterministic replay, channels and
Chandy-Lamport snapshots.

Public names only; internals live in the submodules. Keep this a plain list so that
additions merge cleanly. The channel and snapshot names need torch, and importing
``replay`` must not (``ckpt --help`` and the tape tools stay torch-free): they are
imported on first use, by the module ``__getattr__`` below.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from replay.check import Violation, check_events, check_tape, check_tapes
from replay.clock import Order, VectorClock
from replay.errors import DivergenceError, ReplayError, TapeCorruptError, TapeError, TapeTruncatedError
from replay.events import KINDS, Event, Kind
from replay.recorder import Actor, Recorder, ReplayStop, Stamp
from replay.replayer import Divergence, ReplayResult, fork, record, replay
from replay.tape import TapeReader, TapeWriter
from replay.tape.merge import merge_tapes
from replay.tape.repair import repair as repair_tape
from replay.digest import state_digest

__all__ = [
    "VectorClock",
    "Order",
    "Event",
    "Kind",
    "KINDS",
    "TapeWriter",
    "TapeReader",
    "repair_tape",
    "merge_tapes",
    "state_digest",
    "Recorder",
    "Actor",
    "Stamp",
    "ReplayStop",
    "record",
    "replay",
    "fork",
    "ReplayResult",
    "Divergence",
    "check_tape",
    "check_tapes",
    "check_events",
    "Violation",
    "ReplayError",
    "TapeError",
    "TapeCorruptError",
    "TapeTruncatedError",
    "DivergenceError",
    "errors",
    "sdc",
    # channels and snapshots (lazy: they import torch)
    "Endpoint",
    "Message",
    "MessageKind",
    "Transport",
    "EventSink",
    "ClockSink",
    "ListSink",
    "InProcessNetwork",
    "TorchDistTransport",
    "ArrivalScheduler",
    "SeededScheduler",
    "ForcedScheduler",
    "RecorderSink",
    "taped_delivery_order",
    "message_digest",
    "TapeHub",
    "TapeSink",
    "TapeSinkEvents",
    "LocalTape",
    "RemoteTape",
    "LogApplier",
    "MsgRef",
    "Inbox",
    "ref_of",
    "endpoint_name",
    "actor_of",
    "meta_digest",
    "stamp_to_json",
    "stamp_from_json",
    "SnapshotAgent",
    "SnapshotHandle",
    "Outcome",
    "CkptSnapshotStore",
    "MemorySnapshotStore",
    "TorchStoreControl",
    "MemoryControl",
    "check_cut",
    "cut_from_meta",
    "delivery_order",
    "CHANNELS_KEY",
    "Pending",
]

_LAZY: dict[str, str] = {
    **dict.fromkeys(["Endpoint", "Message", "MessageKind", "Transport", "EventSink", "ClockSink", "ListSink",
                     "InProcessNetwork", "TorchDistTransport", "ArrivalScheduler", "SeededScheduler",
                     "ForcedScheduler", "RecorderSink", "taped_delivery_order", "message_digest", "TapeHub",
                     "TapeSink", "TapeSinkEvents", "LocalTape", "RemoteTape", "LogApplier", "MsgRef", "Inbox", "ref_of",
                     "endpoint_name", "actor_of", "meta_digest", "stamp_to_json", "stamp_from_json"],
                    "replay.channel"),
    **dict.fromkeys(["SnapshotAgent", "SnapshotHandle", "Outcome", "CkptSnapshotStore", "MemorySnapshotStore",
                     "TorchStoreControl", "MemoryControl", "check_cut", "cut_from_meta", "delivery_order", "CHANNELS_KEY",
                     "Pending"],
                    "replay.snapshot"),
}


def __getattr__(name: str) -> Any:
    if name in ("sdc", "errors"):
        value = import_module(f"replay.{name}")
        globals()[name] = value
        return value
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'replay' has no attribute {name!r}")
    value = getattr(import_module(mod), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
