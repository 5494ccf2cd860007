"""One tape from the per-process tapes of a job (spec/tape-format.md §2.1, "job tape").

A job writes one tape per process. ``ckpt tape check A B C`` judges them together, but a
replay compares one tape's events with a re-execution, so a job that replays as one
process needs its history on one tape: :func:`merge_tapes` writes it. Events keep their
bodies byte for byte except for the actor ids (a tape numbers its actors by declaration),
which are renumbered, every actor declared up front; the order is the multi-tape check's
(:func:`replay.check.merge_histories`), a linear extension of happens-before, so the job
tape checks exactly as its parts do together.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Mapping, Sequence

from replay.check import merge_histories
from replay.errors import ReplayError
from replay.events import KIND_BY_NAME, Event
from replay.tape.reader import CLOCK_ENTRY, EVENT_HEAD, TapeReader
from replay.tape.writer import TapeWriter

__all__ = ["merge_tapes", "encode_body"]

_ACTOR = KIND_BY_NAME["actor"].code
MAX_ACTORS = 0xFFFF  # actor ids are u16 (spec/tape-format.md §6.1)


def encode_body(ev: Event, ids: Mapping[str, int]) -> bytes:
    """``ev``'s event body with actors numbered by ``ids``: clock entries sorted by id,
    as a recorder writes them (so a replay under these ids produces the same bytes)."""
    entries = sorted((ids[a], c) for a, c in ev.clock.entries)
    head = EVENT_HEAD.pack(ev.step, ids[ev.actor], len(entries))
    return head + b"".join(CLOCK_ENTRY.pack(i, c) for i, c in entries) + ev.raw


def merge_tapes(paths: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], *,
                meta: Mapping[str, Any] | None = None, run_id: bytes | None = None, **writer_opts: Any) -> int:
    """Write at ``out`` one tape holding every event of the tapes at ``paths``.

    ``meta`` is the new tape's metadata (default: the first tape's, so its entry point
    and config carry over); ``merged_from`` (the source paths' names) is added.
    ``run_id`` defaults to the first tape's (the tapes of one job share it). Each actor
    must have its events on one tape (``ReplayError`` otherwise). Returns the number of
    events written, declarations excluded."""
    if not paths:
        raise ReplayError("merge_tapes needs at least one tape")
    readers = [TapeReader(p) for p in paths]
    histories = [list(r.events()) for r in readers]
    merged = merge_histories(histories, [str(p) for p in paths])
    order: list[str] = []
    seen: set[str] = set()
    for ev in merged:
        for a in (ev.actor, *(a for a, _ in ev.clock.entries)):
            if a not in seen:
                seen.add(a)
                order.append(a)
    if len(order) > MAX_ACTORS:
        raise ReplayError(f"{len(order)} actors exceed the tape's limit of {MAX_ACTORS}")
    ids = {a: i for i, a in enumerate(order)}
    new_meta = dict(meta if meta is not None else readers[0].meta)
    new_meta["merged_from"] = [Path(p).name for p in paths]
    w = TapeWriter(out, new_meta, run_id=run_id if run_id is not None else readers[0].run_id, **writer_opts)
    try:
        for a in order:
            raw = a.encode("utf-8")
            w.actors.append(a)
            w.append(_ACTOR, EVENT_HEAD.pack(0, ids[a], 0) + struct.pack("<H", len(raw)) + raw)
        top: int | None = None
        for ev in merged:
            if top is None or ev.step > top:
                top = ev.step
                w.note_step(ev.step)
            w.append(ev.kind.code, encode_body(ev, ids))
    except BaseException:
        w.abandon()
        raise
    w.close()
    return len(merged)
