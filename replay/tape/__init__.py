"""The event tape: pure framing (``format``), writer, reader and step index."""

from __future__ import annotations

from replay.tape.reader import TapeReader, VerifyReport, read_events
from replay.tape.writer import TapeWriter

__all__ = ["TapeReader", "TapeWriter", "VerifyReport", "read_events"]
