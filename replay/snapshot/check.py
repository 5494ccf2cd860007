"""Checks of a recorded cut against recorded events, and the forced order after a cut.

``check_cut`` is the consistency law of a Chandy-Lamport snapshot, stated on events:
for every message, (a) a receive inside the cut implies its send is inside the cut,
(b) a message recorded as in flight was sent inside and received outside the cut, and
(c) a message sent inside the cut and not received inside it is recorded as in flight.
An event of actor ``a`` is inside the cut when its clock's own entry ``[a]`` is at most
the cut clock's ``[a]`` (clocks tick on every send and receive, markers do not tick).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from replay.channel.base import SinkEvent
from replay.clock import VectorClock

__all__ = ["Cut", "cut_from_meta", "check_cut", "delivery_order"]


@dataclass(frozen=True, slots=True)
class Cut:
    """A snapshot's cut: each process's clock at its cut, and the in-flight messages per channel."""

    clocks: Mapping[str, VectorClock]
    inflight: Mapping[tuple[str, str], tuple[int, ...]]

    def inside(self, actor: str, clock: VectorClock) -> bool:
        return clock[actor] <= self.clocks[actor][actor]


def cut_from_meta(meta: Mapping[str, Any]) -> Cut:
    """The cut as a committed snapshot's MANIFEST meta describes it."""
    clocks = {a: VectorClock.decode(raw) for a, raw in meta["cut"].items()}
    inflight: dict[tuple[str, str], tuple[int, ...]] = {}
    for dst, chans in meta["channels"].items():
        for src, ch in chans.items():
            first, count = int(ch["first_seq"]), int(ch["count"])
            inflight[(src, dst)] = tuple(range(first, first + count))
    return Cut(clocks, inflight)


def check_cut(events: Iterable[SinkEvent], cut: Cut) -> list[str]:
    """All violations of the consistency law (empty when the cut is consistent)."""
    sends: dict[tuple[str, str, int], VectorClock] = {}
    recvs: dict[tuple[str, str, int], VectorClock] = {}
    for e in events:
        if e.kind == "send":
            sends[(e.actor, str(e.payload["dst"]), int(e.payload["seq"]))] = e.clock
        elif e.kind == "recv":
            recvs[(str(e.payload["src"]), e.actor, int(e.payload["seq"]))] = e.clock
    out: list[str] = []
    recorded = {(s, d, q) for (s, d), seqs in cut.inflight.items() for q in seqs}
    for (s, d, q), rclock in sorted(recvs.items()):
        if s not in cut.clocks or d not in cut.clocks:
            continue
        sclock = sends.get((s, d, q))
        if sclock is None:
            out.append(f"{s}->{d} seq {q}: received but never sent")
            continue
        if cut.inside(d, rclock) and not cut.inside(s, sclock):
            out.append(f"{s}->{d} seq {q}: receive inside the cut, send outside")
    for (s, d, q), sclock in sorted(sends.items()):
        if s not in cut.clocks or d not in cut.clocks:
            continue
        rclock = recvs.get((s, d, q))
        sent_in = cut.inside(s, sclock)
        recv_in = rclock is not None and cut.inside(d, rclock)
        should_record = sent_in and not recv_in
        if should_record and (s, d, q) not in recorded:
            out.append(f"{s}->{d} seq {q}: sent inside the cut, not received inside it, and not recorded in flight")
        if (s, d, q) in recorded and not should_record:
            out.append(f"{s}->{d} seq {q}: recorded in flight but "
                       + ("sent outside the cut" if not sent_in else "received inside the cut"))
    for key in sorted(recorded):
        if key not in sends:
            out.append(f"{key[0]}->{key[1]} seq {key[2]}: recorded in flight but never sent")
    return out


def delivery_order(events: Sequence[SinkEvent], actor: str, snapshot: str) -> list[tuple[str, int] | None]:
    """The receive outcomes of ``actor`` after its cut in ``snapshot``: the order a
    ``ForcedScheduler`` replays (``(src, seq)`` per delivery, None per empty poll)."""
    mine = [e for e in events if e.actor == actor]
    start = None
    for i, e in enumerate(mine):
        if e.kind == "snapshot.record" and e.payload.get("snapshot") == snapshot:
            start = i + 1
            break
    if start is None:
        raise ValueError(f"actor {actor!r} has no record event for snapshot {snapshot!r}")
    out: list[tuple[str, int] | None] = []
    for e in mine[start:]:
        if e.kind == "recv":
            out.append((str(e.payload["src"]), int(e.payload["seq"])))
        elif e.kind == "recv.none":
            out.append(None)
    return out
