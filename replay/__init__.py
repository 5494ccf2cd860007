"""Event tapes with vector clocks, tape invariants and deterministic replay.

The core is at the top level: clocks, events, the tape (reader, writer, repair, merge),
the recorder and the replayer, the tape checker and the errors. Channels and snapshots
are public subpackages with exact ``__all__`` of their own, named here:

- ``replay.channel``: endpoints and transports (``Endpoint``, ``InProcessNetwork``,
  ``TorchDistTransport``), taping channel traffic (``RecorderSink``), one tape for a job
  of threads and processes (``TapeHub``, ``LocalTape``, ``RemoteTape``, ``LogApplier``,
  ``Inbox``);
- ``replay.snapshot``: Chandy-Lamport snapshots (``SnapshotAgent``, the stores, the
  control planes, ``check_cut``);
- ``replay.sdc`` (silent-data-corruption digests), ``replay.errors`` and ``replay.watchdog``
  (a progress watchdog: a multi-process run that hangs dumps every process's stacks).

Both subpackages need torch, and importing ``replay`` must not (``ckpt --help`` and the
tape tools stay torch-free): they are imported on first use, by the module
``__getattr__`` below. The names they held at the top level before (``replay.Endpoint``,
...) still resolve, with a DeprecationWarning naming their home.
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
    # public subpackages (imported on first use)
    "channel",
    "snapshot",
    "sdc",
    "errors",
    "watchdog",
]

_SUBPACKAGES = ("channel", "snapshot", "sdc", "errors", "watchdog")

# The names the top level held before the subpackages were its public face: still resolved
# (old code keeps working), with a warning that names the subpackage to import them from.
_MOVED: dict[str, str] = {
    **dict.fromkeys(["Endpoint", "Message", "MessageKind", "Transport", "EventSink", "ClockSink", "ListSink",
                     "InProcessNetwork", "TorchDistTransport", "ArrivalScheduler", "SeededScheduler",
                     "ForcedScheduler", "RecorderSink", "taped_delivery_order", "message_digest", "TapeHub",
                     "TapeSink", "TapeSinkEvents", "LocalTape", "RemoteTape", "LogApplier", "MsgRef", "Inbox", "ref_of",
                     "endpoint_name", "actor_of", "meta_digest", "stamp_to_json", "stamp_from_json"],
                    "channel"),
    **dict.fromkeys(["SnapshotAgent", "SnapshotHandle", "Outcome", "CkptSnapshotStore", "MemorySnapshotStore",
                     "TorchStoreControl", "MemoryControl", "check_cut", "cut_from_meta", "delivery_order", "CHANNELS_KEY",
                     "Pending"],
                    "snapshot"),
}


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        value = import_module(f"replay.{name}")
        globals()[name] = value
        return value
    sub = _MOVED.get(name)
    if sub is None:
        raise AttributeError(f"module 'replay' has no attribute {name!r}")
    import warnings

    warnings.warn(f"replay.{name} moved to replay.{sub}.{name}: import it from replay.{sub}", DeprecationWarning,
                  stacklevel=2)
    return getattr(import_module(f"replay.{sub}"), name)  # not cached: every old use is told


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
