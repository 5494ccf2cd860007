"""Shared helpers for the DiLoCo tests: tiny configs and tape surgery."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable, Sequence

from replay.channel import InProcessNetwork, Message
from runs.diloco import DiLoCoConfig
from replay.events import KIND_BY_NAME
from replay.tape import TapeReader, TapeWriter
from replay.tape.reader import CLOCK_ENTRY, EVENT_HEAD


def tiny(**kw: object) -> DiLoCoConfig:
    base = dict(learners=4, quorum=2, fragments=2, inner_h=4, steps=32, layers=1, dim=32, seq_len=16,
                seqs_per_learner=128, shards_per_learner=8, val_seqs=16, batch=8, grace_cap_s=0.05,
                jitter_s=0.03, io_timeout_s=60.0)
    base.update(kw)
    return DiLoCoConfig(**base)  # type: ignore[arg-type]


def copy_with_duplicate_merge(src: str | Path, dst: str | Path) -> None:
    """Copy a tape and append, as the syncer's next event, a second copy of its last
    merge (same contributions, its clock ticked): one merge applied twice."""
    r = TapeReader(src)
    w = TapeWriter(dst, dict(r.meta))
    merge_code = KIND_BY_NAME["merge"].code
    last_merge = None
    last_body_of: dict[int, bytes] = {}
    for _seg, fr in r.frames():
        body = bytes(fr.body)
        if fr.kind == KIND_BY_NAME["actor"].code:
            (n,) = struct.unpack_from("<H", body, EVENT_HEAD.size)
            w.actors.append(body[EVENT_HEAD.size + 2:EVENT_HEAD.size + 2 + n].decode())
        else:
            _step, aid, _n = EVENT_HEAD.unpack_from(body, 0)
            last_body_of[aid] = body
            if fr.kind == merge_code:
                last_merge = body
        w.append(fr.kind, body)
    assert last_merge is not None
    step, aid, n = EVENT_HEAD.unpack_from(last_merge, 0)
    # the syncer's latest clock, with its own entry ticked once more
    latest = last_body_of[aid]
    _s, _a, ln = EVENT_HEAD.unpack_from(latest, 0)
    entries = [CLOCK_ENTRY.unpack_from(latest, EVENT_HEAD.size + i * CLOCK_ENTRY.size) for i in range(ln)]
    entries = [(i, c + 1 if i == aid else c) for i, c in entries]
    payload = last_merge[EVENT_HEAD.size + n * CLOCK_ENTRY.size:]
    body = EVENT_HEAD.pack(step, aid, len(entries)) + b"".join(CLOCK_ENTRY.pack(i, c) for i, c in entries) + payload
    w.append(merge_code, body)
    w.close()


class Gate:
    """Holds a channel back from the message ``hold`` picks on (that message and every later
    one on its channel, so FIFO stays intact) until ``until`` picks a posted message (held
    or not) or ``until_killed`` is killed: an interleaving forced by events, not by sleeps."""

    def __init__(self, hold: Callable[[Message], bool], until: Callable[[Message], bool] = lambda m: False,
                 until_killed: str | None = None) -> None:
        self.hold, self.until, self.until_killed = hold, until, until_killed
        self.open = False
        self.channels: set[tuple[str, str]] = set()
        self.held: list[Message] = []


def gated_network(gates: Sequence[Gate]) -> type[InProcessNetwork]:
    """An ``InProcessNetwork`` class whose deliveries the ``gates`` hold back (for
    ``monkeypatch.setattr(runs.diloco.run, "InProcessNetwork", ...)``)."""

    class Gated(InProcessNetwork):
        def _post(self, msg: Message) -> None:
            with self._cond:  # reentrant: releases post from inside
                opened = [g for g in gates if not g.open and g.until(msg)]
                g_hold = next((g for g in gates if not g.open and
                               ((msg.src, msg.dst) in g.channels or g.hold(msg))), None)
                if g_hold is not None:
                    g_hold.channels.add((msg.src, msg.dst))
                    g_hold.held.append(msg)
                else:
                    super()._post(msg)
                for g in opened:
                    self._release(g)

        def kill(self, actor: str, detail: str = "killed") -> None:
            with self._cond:
                super().kill(actor, detail)
                for g in gates:
                    if not g.open and g.until_killed == actor:
                        self._release(g)

        def _release(self, g: Gate) -> None:
            g.open = True
            for m in g.held:
                if m.dst not in self._dead and m.src not in self._dead:
                    self._post(m)
            g.held.clear()

    return Gated
