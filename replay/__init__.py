"""Event tapes with vector clocks, tape invariants, and deterministic replay.

Public names only; internals live in the submodules. Keep this a plain list so that
additions (channels, snapshots) merge cleanly.
"""

from __future__ import annotations

from replay.check import Violation, check_events, check_tape
from replay.clock import Order, VectorClock
from replay.errors import DivergenceError, ReplayError, TapeCorruptError, TapeError, TapeTruncatedError
from replay.events import KINDS, Event, Kind
from replay.recorder import Actor, Recorder, ReplayStop, Stamp
from replay.replayer import Divergence, ReplayResult, fork, record, replay
from replay.tape import TapeReader, TapeWriter

__all__ = [
    "VectorClock",
    "Order",
    "Event",
    "Kind",
    "KINDS",
    "TapeWriter",
    "TapeReader",
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
    "check_events",
    "Violation",
    "ReplayError",
    "TapeError",
    "TapeCorruptError",
    "TapeTruncatedError",
    "DivergenceError",
]
