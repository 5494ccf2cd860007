"""RecorderSink and the tape checks it feeds, piece by piece.

- one clock per actor: an Endpoint on a RecorderSink has no clock of its own; a message
  carries its taped send's clock; markers tape nothing and tick nothing;
- failures: an oversize message tapes nothing, a send to a dead peer is taped and
  followed by the death; exclusion and abort reach the tape as their outcome, and check;
- the two-phase snapshot rules, and several tapes checked as one history.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt_cli.main import cli
from replay import Recorder
from replay.channel import Endpoint, InProcessNetwork, RecorderSink, message_digest
from replay.channel import taping
from replay.check import RULES, check_events, check_tapes, merge_histories
from replay.clock import VectorClock
from replay.errors import MessageTooLargeError, PeerDiedError, ReplayError
from replay.events import KIND_BY_NAME, Event
from replay.snapshot import MemoryControl, MemorySnapshotStore, SnapshotAgent
from replay.tape import TapeReader
from tests.replay._agents import pump
import hangs

HANG = hangs.hang_s(3)  # a hang bound for a wait on peers or threads (tests/hangs.py), never a speed verdict

ROOT = Path(__file__).resolve().parents[2]
D1 = b"\x01" * 16


def kinds_of(path: Path, actor: str) -> list[str]:
    return [e.kind.name for e in TapeReader(path).events() if e.actor == actor and e.kind.name != "actor"]


def test_endpoint_clock_is_the_recorders(tmp_path: Path) -> None:
    path = tmp_path / "t.tape"
    with Recorder.open(str(path), actor="a", rng_every=0) as rec:
        net = InProcessNetwork.complete(["a", "b"])
        sink = RecorderSink(rec)
        a, b = Endpoint(net.transport("a"), sink=sink), Endpoint(net.transport("b"), sink=sink)
        rec.note("local work ticks the same clock")
        assert a.clock == rec.clock == VectorClock.of(a=1)
        m = a.send("b", {"k": "v"}, [torch.arange(3)])
        assert m.clock == a.clock == rec.clock == VectorClock.of(a=2)  # the message carries the taped clock
        got = b.recv(1)
        assert got.clock == m.clock and b.clock == VectorClock.of(a=2, b=1) == sink.actor("b").clock
        assert b.try_recv() is None  # an empty poll is taped (it is part of the delivery order)
    evs = [e for e in TapeReader(path).events() if e.kind.name != "actor"]
    assert [(e.actor, e.kind.name) for e in evs] == [("a", "note"), ("a", "send"), ("b", "recv"), ("b", "decision")]
    send, recv, empty = evs[1:]
    assert send.payload == {"channel": "a->b", "chan_seq": 1, "peer": "b",
                            "digest": message_digest(m.meta_bytes(), m.tensors)}
    assert recv.payload == {**send.payload, "peer": "a"} and send.clock == m.clock
    assert empty.payload == {"what": "recv.empty", "key": "0", "value": None}
    assert check_tapes([path]) == []


def test_markers_tape_nothing_and_tick_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.tape"
    store = MemorySnapshotStore()
    with Recorder.open(str(path), actor="a", rng_every=0) as rec:
        net = InProcessNetwork.complete(["a", "b"])
        sink = RecorderSink(rec)
        eps = {n: Endpoint(net.transport(n), sink=sink) for n in "ab"}
        ctl = MemoryControl()
        agents = {n: SnapshotAgent(eps[n], {"w": torch.zeros(2)}, store=store, control=ctl, participants=["a", "b"],
                                   background=False) for n in "ab"}
        eps["a"].send("b", {}, [torch.ones(1)])  # a:1
        h = agents["a"].initiate("s")  # the cut is a taped event (a:2); the marker to b is not
        assert eps["a"].clock == VectorClock.of(a=2) and eps["a"].next_send["b"] == 1
        assert [e.kind.name for e in _live(rec, path)] == ["send", "snapshot"]
        m = eps["b"].try_recv()  # FIFO: the data message comes before the marker
        assert m is not None and m.seq == 0 and eps["b"].clock == VectorClock.of(a=1, b=1)
        assert eps["b"].try_recv() is None  # the marker: cut (b:2), channel state (b:3), empty poll (b:4)
        assert eps["b"].clock == VectorClock.of(a=1, b=4) and eps["b"].next_recv["a"] == 1
        agents["a"].poll()  # b's marker closes a's recording
        out = h.wait(HANG)
        assert out.committed, out.reason
        for ag in agents.values():
            ag.close()
        cut = store.read_meta("s")["cut"]
        assert VectorClock.decode(cut["a"]) == VectorClock.of(a=2)
        assert VectorClock.decode(cut["b"]) == VectorClock.of(a=1, b=2)
    assert kinds_of(path, "b") == ["recv", "snapshot", "snapshot_channels", "decision"]
    assert kinds_of(path, "a") == ["send", "snapshot", "snapshot_channels", "snapshot_outcome"]
    assert check_tapes([path]) == []


def _live(rec: Recorder, path: Path) -> list[Event]:
    assert rec.writer is not None
    rec.writer.flush()
    return [e for e in TapeReader(path).events() if e.kind.name != "actor"]


def test_oversize_send_tapes_nothing_and_dead_peer_send_is_taped(tmp_path: Path) -> None:
    path = tmp_path / "f.tape"
    with Recorder.open(str(path), actor="a", rng_every=0) as rec:
        net = InProcessNetwork.complete(["a", "b"])
        a = Endpoint(net.transport("a"), sink=RecorderSink(rec), max_message_bytes=1024)
        with pytest.raises(MessageTooLargeError, match="above the declared bound of 1024 bytes") as ei:
            a.send("b", {}, [torch.zeros(1024)])
        assert ei.value.channel == "a->b" and ei.value.seq == 0
        assert a.clock == VectorClock() and a.next_send["b"] == 0
        net.kill("b")
        with pytest.raises(PeerDiedError, match="peer b is dead") as ei:
            a.send("b", {"x": 1})
        assert ei.value.channel == "a->b" and ei.value.seq == 0 and a.next_send["b"] == 0
    evs = [e for e in TapeReader(path).events() if e.kind.name != "actor"]
    assert [e.kind.name for e in evs] == ["send", "fault_detected"]  # the attempt, then what became of it
    assert evs[1].payload == {"fault": "peer-died", "target": "b", "detail": None}
    assert check_tapes([path]) == []


def _job(rec: Recorder, excludable: tuple[str, ...] = ()) -> tuple[Any, dict[str, Endpoint], dict[str, SnapshotAgent]]:
    names = ["p0", "p1", "p2"]
    net = InProcessNetwork.complete(names)
    sink = RecorderSink(rec)
    ctl, store = MemoryControl(), MemorySnapshotStore()
    eps = {a: Endpoint(net.transport(a), sink=sink) for a in names}
    agents = {a: SnapshotAgent(eps[a], {"w": torch.full((2,), float(i))}, store=store, control=ctl,
                               participants=names, excludable=excludable, grace_s=0.2) for i, a in enumerate(names)}
    return net, eps, agents


def test_exclusion_and_abort_reach_the_tape(tmp_path: Path) -> None:
    path = tmp_path / "x.tape"
    with Recorder.open(str(path), actor="p0", rng_every=0) as rec:
        net, eps, agents = _job(rec, excludable=("p2",))
        eps["p2"].send("p1", {"last": True}, [torch.tensor(5)])
        h = agents["p0"].initiate("ex")
        agents["p1"].poll()
        net.kill("p2")
        out = pump([agents["p0"], agents["p1"]], h)
        assert out.committed and out.excluded == ("p2",), out.reason
        agents["p0"].excludable = frozenset()  # p2 is dead and, this time, not excludable
        h2 = agents["p0"].initiate("ab")
        out2 = pump([agents["p0"], agents["p1"]], h2)
        assert not out2.committed
        for a in ("p0", "p1"):
            agents[a].close()
    evs = list(TapeReader(path).events())
    outcomes = {e.payload["snapshot_id"]: e.payload for e in evs if e.kind.name == "snapshot_outcome"}
    assert outcomes["ex"] == {"snapshot_id": "ex", "committed": 1, "path": "ex", "parts": ["p0", "p1"],
                              "excluded": ["p2"], "reason": ""}
    assert outcomes["ab"]["committed"] == 0 and outcomes["ab"]["parts"] == list(out2.parts)
    assert outcomes["ab"]["excluded"] == [] and outcomes["ab"]["reason"] == out2.reason
    assert "participant p2 failed before its part was durable" in outcomes["ab"]["reason"]
    faults = [(e.actor, e.payload["fault"], e.payload["target"]) for e in evs if e.kind.name == "fault_detected"]
    assert ("p0", "snapshot-excluded", "p2") in faults
    chans = {e.actor: e.payload["inflight"] for e in evs
             if e.kind.name == "snapshot_channels" and e.payload["snapshot_id"] == "ex"}
    assert chans["p1"] == [("p2->p1", 1)]  # queued from the failed peer: channel state, never received
    res = CliRunner().invoke(cli, ["tape", "check", str(path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("flush_sends", [True, False])
def test_a_send_reaches_the_os_before_its_message_leaves(tmp_path: Path, flush_sends: bool) -> None:
    path = tmp_path / f"w{int(flush_sends)}.tape"
    with Recorder.open(str(path), actor="a", rng_every=0) as rec:
        net = InProcessNetwork.complete(["a", "b"])
        ep = Endpoint(net.transport("a"), sink=RecorderSink(rec, flush_sends=flush_sends))
        ep.send("b", {"i": 1})
        seen = [e.kind.name for e in TapeReader(path).events() if e.kind.name != "actor"]  # as a crash would leave it
        assert seen == (["send"] if flush_sends else [])
    assert [e.kind.name for e in TapeReader(path).events() if e.kind.name != "actor"] == ["send"]


def test_unknown_channel_event_is_refused(tmp_path: Path) -> None:
    with Recorder.open(str(tmp_path / "u.tape"), rng_every=0) as rec:
        sink = RecorderSink(rec)
        with pytest.raises(ReplayError, match="no tape mapping for channel event kind 'bogus'") as ei:
            sink.record("bogus", "main", VectorClock(), 0, {})
        assert ei.value.actor == "main"
        with pytest.raises(ReplayError, match="must be taped through record_send/record_recv"):
            sink.record("send", "main", VectorClock(), 0, {})


def test_every_channel_event_kind_has_a_tape_mapping() -> None:
    found: set[str] = set()
    for f in ("replay/channel/base.py", "replay/snapshot/agent.py"):
        found |= set(re.findall(r'(?:\b|_)record\("([\w.]+)"', (ROOT / f).read_text()))
    assert "snapshot.record" in found and "recv.none" in found
    assert found | {"send", "recv"} == set(taping.TAPED_AS)
    for taped in taping.TAPED_AS.values():
        assert taped is None or taped in KIND_BY_NAME


def test_message_digest_frames_its_parts() -> None:
    t = torch.arange(4, dtype=torch.int32)
    base = message_digest(b"\x80", [t])
    assert len(base) == 16 and base == message_digest(b"\x80", [t.clone()])
    assert message_digest(b"\x80", [t.to(torch.int64)]) != base  # dtype is part of it
    assert message_digest(b"\x80", [t.reshape(2, 2)]) != base  # and the shape
    assert message_digest(b"\x80\x00", []) != message_digest(b"\x80", [torch.zeros(1, dtype=torch.uint8)])


def test_restore_merges_the_cut_into_the_recorder_clock(tmp_path: Path) -> None:
    path = tmp_path / "r.tape"
    with Recorder.open(str(path), actor="a", rng_every=0) as rec:
        net = InProcessNetwork.complete(["a", "b"])
        ep = Endpoint(net.transport("a"), sink=RecorderSink(rec))
        rec.note("x")
        rec.note("y")
        cut = VectorClock.of(a=1, b=7)
        ep.restore({"clock": cut.encode(), "next_send": {"b": 3}, "next_recv": {"b": 2}}, {})
        assert ep.clock == rec.clock == VectorClock.of(a=2, b=7)  # merged: never back below a:2
        m = ep.send("b", {})
        assert m.seq == 3 and m.clock == VectorClock.of(a=3, b=7)


# -- two-phase rules and several tapes -------------------------------------------------


class H:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, actor: str, clock: dict[str, int], kind: str, *fields: object) -> Event:
        k = KIND_BY_NAME[kind]
        ev = Event(len(self.events), actor, VectorClock.of(clock), 0, k, k.pack(*fields))
        self.events.append(ev)
        return ev


def rules(h: H) -> list[str]:
    return [v.rule for v in check_events(h.events)]


def crossing(h: H) -> None:
    """a sends c#1 before its cut; b receives it after its own: c#1 is in flight."""
    h.add("a", {"a": 1}, "send", "c", 1, "b", D1)
    h.add("a", {"a": 2}, "snapshot", "s", [])
    h.add("b", {"b": 1}, "snapshot", "s", [])
    h.add("b", {"a": 1, "b": 2}, "recv", "c", 1, "a", D1)


def test_two_phase_channel_state_completes_the_cut() -> None:
    h = H()
    crossing(h)
    h.add("a", {"a": 3}, "snapshot_channels", "s", [])
    h.add("b", {"a": 1, "b": 3}, "snapshot_channels", "s", [("c", 1)])
    h.add("a", {"a": 4}, "snapshot_outcome", "s", 1, "/s", ["a", "b"], [], "")
    assert rules(h) == []
    h = H()
    crossing(h)
    h.add("b", {"a": 1, "b": 3}, "snapshot_channels", "s", [])  # forgot c#1
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["snapshot-inflight-missing"]
    assert vs[0].message == "snapshot 's': c#1 crosses the cut but is not in the recorded channel state"


def test_two_phase_receiver_without_channel_state_is_not_judged() -> None:
    h = H()
    crossing(h)
    h.add("a", {"a": 3}, "snapshot_channels", "s", [])  # two-phase; b's tape ended before its part
    assert rules(h) == []


def test_channel_state_before_the_cut_and_duplicates() -> None:
    h = H()
    early = h.add("b", {"b": 1}, "snapshot_channels", "s", [])
    h.add("b", {"b": 2}, "snapshot", "s", [])
    h.add("b", {"b": 3}, "snapshot_channels", "s", [])
    h.add("b", {"b": 4}, "snapshot_channels", "s", [])
    o1 = h.add("b", {"b": 5}, "snapshot_outcome", "s", 1, "/s", ["b"], [], "")
    o2 = h.add("b", {"b": 6}, "snapshot_outcome", "s", 0, "/s", ["b"], [], "late")
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["snapshot-channels-early", "snapshot-duplicate", "snapshot-duplicate"]
    assert vs[0].events == (early,) and vs[0].message == "b recorded the channel state of snapshot 's' before its cut"
    assert vs[2].events == (o1, o2) and vs[2].message == "snapshot 's' has two outcomes"


def test_committed_snapshot_needs_every_part_and_ignores_the_excluded() -> None:
    h = H()
    crossing(h)
    h.add("b", {"a": 1, "b": 3}, "snapshot_channels", "s", [("c", 1)])
    # x's cut saw more of a than a's own cut (inconsistent) - but x was excluded.
    h.add("x", {"a": 5, "x": 1}, "snapshot", "s", [])
    out = h.add("a", {"a": 3}, "snapshot_outcome", "s", 1, "/s", ["a", "b", "y"], ["x"], "")
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["snapshot-part-missing", "snapshot-part-missing"]
    assert vs[0].message == "snapshot 's' committed with part a, whose channel state is not on the tape"
    assert vs[1].message == "snapshot 's' committed with part y, whose cut is not on the tape"
    assert vs[1].events == (out,)


def test_aborted_snapshot_is_checked_for_consistency_only() -> None:
    h = H()
    crossing(h)  # c#1 crossing with no channel state: fine for an abort
    h.add("a", {"a": 3}, "send", "d", 1, "b", D1)  # after a's cut...
    h.add("b", {"a": 3, "b": 3}, "recv", "d", 1, "a", D1)
    h.add("a", {"a": 4}, "snapshot_outcome", "s", 0, "/s", ["a"], [], "b died")
    assert rules(h) == []
    h2 = H()
    h2.add("a", {"a": 1}, "snapshot", "s", [])
    h2.add("a", {"a": 2}, "send", "d", 1, "b", D1)
    h2.add("b", {"a": 2, "b": 1}, "recv", "d", 1, "a", D1)
    h2.add("b", {"a": 2, "b": 2}, "snapshot", "s", [])  # ...received inside b's cut: orphan, abort or not
    h2.add("a", {"a": 3}, "snapshot_outcome", "s", 0, "/s", [], [], "deadline")
    assert rules(h2) == ["snapshot-inconsistent", "snapshot-orphan"]


def test_new_rules_are_documented() -> None:
    spec = (ROOT / "spec" / "tape-format.md").read_text()
    for rule in ("snapshot-channels-early", "snapshot-part-missing"):
        assert rule in RULES and f"`{rule}`" in spec


def _two_tapes(tmp_path: Path) -> tuple[Path, Path]:
    pa, pb = tmp_path / "a.tape", tmp_path / "b.tape"
    ra = Recorder.open(str(pa), actor="a", rng_every=0)
    rb = Recorder.open(str(pb), actor="b", rng_every=0)
    for i in range(3):
        st = ra.send("a->b", bytes([i]), peer="b")
        rb.note("busy")  # b's local work: its events outnumber a's
        rb.recv(st)
        st2 = rb.send("b->a", bytes([i]), peer="a")
        ra.recv(st2)
    ra.close()
    rb.close()
    return pa, pb


def test_per_process_tapes_check_as_one_history(tmp_path: Path) -> None:
    pa, pb = _two_tapes(tmp_path)
    alone = [v.rule for v in check_tapes([pb])]
    assert alone and set(alone) == {"recv-without-send"}  # a's sends live on a's tape
    assert check_tapes([pb, pa]) == [] == check_tapes([pa, pb])
    merged = merge_histories([list(TapeReader(pb).events()), list(TapeReader(pa).events())])
    seen: set[tuple[str, int]] = set()
    for e in merged:
        if e.kind.name == "send":
            seen.add((e.payload["channel"], e.payload["chan_seq"]))
        elif e.kind.name == "recv":
            assert (e.payload["channel"], e.payload["chan_seq"]) in seen  # a linear extension of happens-before
    res = CliRunner().invoke(cli, ["tape", "check", str(pb), str(pa), "--json"], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.output) == []
    res = CliRunner().invoke(cli, ["tape", "check", str(pb)], catch_exceptions=False)
    assert res.exit_code == 6 and "[recv-without-send] receive of a->b#1 has no earlier send" in res.output


def test_an_actor_on_two_tapes_is_refused(tmp_path: Path) -> None:
    pa, _ = _two_tapes(tmp_path)
    with pytest.raises(ReplayError, match=r"actor 'a' has events on two tapes \(.*a.tape and .*a.tape\)"):
        check_tapes([pa, pa])
    res = CliRunner().invoke(cli, ["tape", "check", str(pa), str(pa)], catch_exceptions=False)
    assert res.exit_code != 0 and "per-process tapes must hold disjoint actors" in res.output
