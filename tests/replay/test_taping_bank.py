"""The bank over the in-process transport, recorded on a real tape through RecorderSink.

- ``ckpt tape check`` (CliRunner) finds no violation on the recorded tape, and each
  committed snapshot's MANIFEST cut clocks and channel states are exactly the tape's;
- a tampered copy (a receive moved before its receiver's cut) is caught as an orphan;
- force mode fed from the *tape* (the taped receive order after a cut, and from the start)
  reproduces every teller bit for bit.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt_cli.main import cli
from replay import Recorder
from replay.channel import Endpoint, ForcedScheduler, InProcessNetwork, RecorderSink, SeededScheduler
from replay.channel import taped_delivery_order
from replay.clock import VectorClock
from replay.events import Event
from replay.snapshot import CHANNELS_KEY, MemoryControl, MemorySnapshotStore, SnapshotAgent
from replay.tape import TapeReader, TapeWriter
from replay.tape.reader import EVENT_HEAD
from tests.replay._bank import INITIAL, Teller, finish_forced
import hangs

HANG = hangs.hang_s(3)  # a hang bound for a wait on peers or threads (tests/hangs.py), never a speed verdict

SNAPS = [(40, "p0", "s-a"), (45, "p2", "s-b"), (200, "p3", "s-c")]  # (tick, initiator, name)


NAMES = ["p0", "p1", "p2", "p3"]
EDGES = sorted({(a, b) for i, a in enumerate(NAMES) for b in (NAMES[(i + 1) % 4], NAMES[(i + 2) % 4])}
               | {("p3", "p1")})


def build(sink: Any, schedulers: dict[str, Any], store: MemorySnapshotStore, seed: int
          ) -> tuple[dict[str, Teller], dict[str, Endpoint], dict[str, SnapshotAgent]]:
    net = InProcessNetwork(EDGES, actors=NAMES)
    control = MemoryControl()  # one control plane: coordinators and participants meet here
    tellers = {a: Teller(seed + i) for i, a in enumerate(NAMES)}
    eps = {a: Endpoint(net.transport(a), scheduler=schedulers[a], sink=sink, step=(lambda t=tellers[a]: t.steps))
           for a in NAMES}
    agents = {a: SnapshotAgent(eps[a], {"teller": tellers[a]}, store=store, control=control, participants=NAMES,
                               background=False) for a in NAMES}
    return tellers, eps, agents


@dataclass
class Taped:
    path: Path
    tellers: dict[str, Teller]
    endpoints: dict[str, Endpoint]
    store: MemorySnapshotStore
    outcomes: dict[str, Any]


@pytest.fixture(scope="module")
def taped(tmp_path_factory: pytest.TempPathFactory) -> Taped:
    path = tmp_path_factory.mktemp("bank") / "bank.tape"
    store = MemorySnapshotStore()
    rec = Recorder.open(str(path), actor="p0", rng_every=0, commit="test")
    scheds = {a: SeededScheduler(5 + i) for i, a in enumerate(NAMES)}
    tellers, eps, agents = build(RecorderSink(rec, endpoint_steps=True), scheds, store, seed=77)
    rng = random.Random(3)
    starts = list(SNAPS)
    handles = {}
    tick = 0
    while (tick < 400 or len(handles) < len(SNAPS) or any(ag.in_flight() for ag in agents.values())):
        while starts and starts[0][0] <= tick:
            _, who, name = starts.pop(0)
            handles[name] = agents[who].initiate(name)
        a = rng.choice(NAMES)
        tellers[a].step(eps[a])
        tick += 1
        assert tick < 20_000
    outcomes = {n: h.wait(HANG) for n, h in handles.items()}
    for ag in agents.values():
        ag.close()
    rec.close()
    return Taped(path, tellers, eps, store, outcomes)


def run_cli(*args: str) -> Any:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_recorded_bank_tape_checks_clean(taped: Taped) -> None:
    assert all(o.committed for o in taped.outcomes.values()), taped.outcomes
    res = run_cli("tape", "check", str(taped.path))
    assert res.exit_code == 0, res.output
    assert res.output == f"ok: {taped.path}: no invariant violated\n"
    res = run_cli("tape", "verify", str(taped.path))
    assert res.exit_code == 0, res.output


def test_tape_holds_the_snapshots_exactly(taped: Taped) -> None:
    evs = list(TapeReader(taped.path).events())
    kinds = {e.kind.name for e in evs}
    assert {"send", "recv", "decision", "snapshot", "snapshot_channels", "snapshot_outcome"} <= kinds
    inflight_total = 0
    for name, out in taped.outcomes.items():
        meta = taped.store.read_meta(name)
        cuts = {e.actor: e for e in evs if e.kind.name == "snapshot" and e.payload["snapshot_id"] == name}
        chans = {e.actor: e for e in evs if e.kind.name == "snapshot_channels" and e.payload["snapshot_id"] == name}
        (outcome,) = [e for e in evs if e.kind.name == "snapshot_outcome" and e.payload["snapshot_id"] == name]
        assert outcome.payload == {"snapshot_id": name, "committed": 1, "path": name, "parts": NAMES, "excluded": [],
                                   "reason": ""}
        assert sorted(cuts) == sorted(chans) == NAMES
        total = 0
        for a in NAMES:
            # One clock: the part's cut is the taped snapshot event's clock, bit for bit.
            assert VectorClock.decode(meta["cut"][a]) == cuts[a].clock
            assert cuts[a].payload["inflight"] == []
            recorded = taped.store.read_entry(name, a, CHANNELS_KEY)
            want = sorted((f"{src}->{a}", m["seq"] + 1) for src, msgs in recorded.items() for m in msgs)
            assert sorted(tuple(r) for r in chans[a].payload["inflight"]) == want
            inflight_total += len(want)
            total += int(taped.store.read_entry(name, a, "teller")["balance"])
            total += sum(int(m["tensors"][0]) for msgs in recorded.values() for m in msgs)
        assert total == INITIAL * len(NAMES)  # conservation
    assert inflight_total > 0  # the run exercised recorded channel state


def test_messages_carry_the_taped_send_clock(taped: Taped) -> None:
    evs = list(TapeReader(taped.path).events())
    sends = {(e.payload["channel"], e.payload["chan_seq"]): e for e in evs if e.kind.name == "send"}
    recvs = [e for e in evs if e.kind.name == "recv"]
    assert recvs and len(sends) >= len(recvs)
    before: dict[int, VectorClock] = {}  # recv seq -> its actor's clock at the previous event
    last: dict[str, VectorClock] = {}
    for e in evs:
        if e.kind.name == "recv":
            before[e.seq] = last.get(e.actor, VectorClock())
        if e.kind.name != "actor":
            last[e.actor] = e.clock
    for r in recvs:
        s = sends[(r.payload["channel"], r.payload["chan_seq"])]
        assert s.payload["digest"] == r.payload["digest"]
        # The receive merged exactly the clock the taped send had, then ticked.
        assert r.clock == before[r.seq].receive(r.actor, s.clock)
    for a, ep in taped.endpoints.items():
        last = [e for e in evs if e.actor == a][-1]
        assert ep.clock == last.clock  # the endpoint has no clock of its own


# -- tampering ------------------------------------------------------------------------


def rewrite(src: Path, dst: Path, events: list[Event]) -> None:
    """Write ``events`` (actor declarations included) as a new tape with src's metadata."""
    meta = TapeReader(src).meta
    ids: dict[str, int] = {}
    with TapeWriter(dst, meta) as w:
        for e in events:
            if e.kind.name == "actor":
                ids[e.payload["name"]] = len(ids)
                w.actors.append(e.payload["name"])
                w.append(e.kind.code, EVENT_HEAD.pack(e.step, ids[e.actor], 0) + e.raw)
                continue
            ent = sorted((ids[a], c) for a, c in e.clock.entries)
            flat = [x for pair in ent for x in pair]
            w.append(e.kind.code, EVENT_HEAD.pack(e.step, ids[e.actor], len(ent))
                     + struct.pack("<" + "HQ" * len(ent), *flat) + e.raw)


def test_receive_moved_before_the_cut_is_caught(taped: Taped, tmp_path: Path) -> None:
    evs = list(TapeReader(taped.path).events())
    cut_of = {(e.actor, e.payload["snapshot_id"]): e for e in evs if e.kind.name == "snapshot"}
    sends = {(e.payload["channel"], e.payload["chan_seq"]): e for e in evs if e.kind.name == "send"}
    # A receive that directly follows its receiver's cut, of a message sent after its
    # sender's cut (it came behind the marker that made the cut).
    target = None
    for i, e in enumerate(evs):
        if e.kind.name != "snapshot":
            continue
        j = next(k for k in range(i + 1, len(evs)) if evs[k].actor == e.actor)
        r = evs[j]
        if r.kind.name != "recv":
            continue
        s = sends[(r.payload["channel"], r.payload["chan_seq"])]
        if s.clock[s.actor] > cut_of[(s.actor, e.payload["snapshot_id"])].clock[s.actor]:
            target = (i, j)
            break
    assert target is not None, "the run has no receive right after a cut (change SNAPS)"
    i, j = target
    cut, r = evs[i], evs[j]
    sid = cut.payload["snapshot_id"]
    me = cut.actor
    # Move the receive before the cut, re-clocked as it then would be: the receive takes
    # the cut's own counter, the cut takes the receive's (merged) clock.
    moved_recv = Event(r.seq, me, VectorClock(tuple((a, c) for a, c in r.clock.entries if a != me)
                                              + ((me, cut.clock[me]),)), r.step, r.kind, r.raw)
    moved_cut = Event(cut.seq, me, r.clock, cut.step, cut.kind, cut.raw)
    bad = evs[:i] + [moved_recv] + evs[i + 1 : j] + [moved_cut] + evs[j + 1 :]
    out = tmp_path / "tampered.tape"
    rewrite(taped.path, out, bad)
    res = run_cli("tape", "check", str(out))
    assert res.exit_code == 6, res.output
    channel, seq = r.payload["channel"], r.payload["chan_seq"]
    assert f"[snapshot-orphan] snapshot {sid!r}: {channel}#{seq} received before {me}'s cut but sent after" in res.output
    assert f"[snapshot-inconsistent] snapshot {sid!r}: {me}'s cut has seen" in res.output
    assert "clock-monotonic" not in res.output  # the tampering is a consistent history, but for the cut
    # The untouched copy checks clean: the rewrite itself changes nothing.
    same = tmp_path / "same.tape"
    rewrite(taped.path, same, evs)
    assert run_cli("tape", "check", str(same)).exit_code == 0


# -- force mode from the tape -----------------------------------------------------------


def _finish(tellers: dict[str, Teller], eps: dict[str, Endpoint], targets: dict[str, int]) -> None:
    finish_forced(NAMES, tellers, eps, targets)


def _assert_same(taped: Taped, tellers: dict[str, Teller], eps: dict[str, Endpoint],
                 orders: dict[str, ForcedScheduler]) -> None:
    for a in NAMES:
        o, r = taped.tellers[a], tellers[a]
        assert o.steps == r.steps, a
        assert torch.equal(o.balance, r.balance), a
        assert torch.equal(o.acc, r.acc), a
        assert torch.equal(o.gen.get_state(), r.gen.get_state()), a
        assert taped.endpoints[a].next_send == eps[a].next_send, a
        assert taped.endpoints[a].next_recv == eps[a].next_recv, a
        assert orders[a].remaining == 0, a


@pytest.mark.parametrize("name", ["s-b", "s-c"])
def test_restore_forced_from_the_tape_is_bit_identical(taped: Taped, name: str) -> None:
    evs = list(TapeReader(taped.path).events())
    orders = {a: ForcedScheduler(taped_delivery_order(evs, a, name)) for a in NAMES}
    tellers, eps, agents = build(None, orders, taped.store, seed=31337)  # wrong seeds: all from the snapshot
    for a in NAMES:
        agents[a].restore(name)
    _finish(tellers, eps, {a: taped.tellers[a].steps for a in NAMES})
    _assert_same(taped, tellers, eps, orders)


def test_whole_run_forced_from_the_tape_is_bit_identical(taped: Taped) -> None:
    evs = list(TapeReader(taped.path).events())
    orders = {a: ForcedScheduler(taped_delivery_order(evs, a)) for a in NAMES}
    tellers, eps, _ = build(None, orders, MemorySnapshotStore(), seed=77)  # same seeds, no snapshots
    _finish(tellers, eps, {a: taped.tellers[a].steps for a in NAMES})
    _assert_same(taped, tellers, eps, orders)


def test_delivery_order_needs_the_cut() -> None:
    from replay.errors import SnapshotError

    with pytest.raises(SnapshotError, match="the tape holds no cut of this actor for the snapshot") as ei:
        taped_delivery_order([], "p0", "nope")
    assert "actor p0" in str(ei.value) and "snapshot nope" in str(ei.value)
