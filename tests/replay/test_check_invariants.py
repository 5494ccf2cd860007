"""Elle-style invariants: each rule fires on a history built to break it, with its witnesses."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from replay.check import RULES, check_events, check_tape
from replay.clock import VectorClock
from replay.events import KIND_BY_NAME, Event
from replay.recorder import Recorder, Stamp

D1, D2 = b"\x01" * 16, b"\x02" * 16


class H:
    """A hand-built history: events with explicit clocks (what a buggy system might tape)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def add(self, actor: str, clock: dict[str, int], kind: str, *fields: object, step: int = 0) -> Event:
        k = KIND_BY_NAME[kind]
        ev = Event(len(self.events), actor, VectorClock.of(clock), step, k, k.pack(*fields))
        self.events.append(ev)
        return ev


def rules(h: H) -> list[str]:
    return [v.rule for v in check_events(h.events)]


def test_clean_history_has_no_violation(tmp_path: Path) -> None:
    path = tmp_path / "ok.tape"
    with Recorder.open(str(path), rng_every=0) as rec:
        a, b = rec.actor("a"), rec.actor("b")
        for step in range(3):
            with rec.step(step):
                sa = a.send("ch/a", b"x", peer="main")
                sb = b.send("ch/b", b"y", peer="main")
                rec.recv(sa)
                rec.recv(sb)
                rec.quorum(str(step), 2, lambda: ["a", "b"])
                rec.merge(str(step), lambda: ([sa, sb], [0.5, 0.5]))
        rec.recovered("crash", "a", target_clock=sa.clock, observed=rec.clock)
        rec.snapshot("s")
        a.snapshot("s")
        b.snapshot("s")
    assert check_tape(path) == []


def test_clock_monotonic() -> None:
    h = H()
    e1 = h.add("a", {"a": 2}, "note", "x")
    e2 = h.add("a", {"a": 2}, "note", "y")  # did not tick
    h.add("a", {"a": 3, "b": 1}, "note", "z")
    e4 = h.add("a", {"a": 4}, "note", "w")  # forgot what it had seen of b
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["clock-monotonic", "clock-monotonic"]
    assert vs[0].events == (e1, e2) and vs[1].events[1] is e4
    assert "does not follow" in vs[0].message


def test_receive_rules() -> None:
    h = H()
    s = h.add("a", {"a": 1}, "send", "c", 1, "b", D1)
    h.add("b", {"a": 1, "b": 1}, "recv", "c", 1, "a", D1)
    r2 = h.add("b", {"a": 1, "b": 2}, "recv", "c", 1, "a", D1)  # delivered twice
    r3 = h.add("b", {"a": 1, "b": 3}, "recv", "c", 2, "a", D1)  # never sent
    h.add("a", {"a": 2}, "send", "c", 3, "b", D1)
    h.add("b", {"b": 4, "a": 1}, "recv", "c", 3, "a", D2)  # not after its send, and the digest differs
    h.add("a", {"a": 3}, "send", "c", 3, "b", D1)  # same message id sent again
    vs = check_events(h.events)
    got = [v.rule for v in vs]
    assert got == ["duplicate-recv", "recv-without-send", "recv-not-after-send", "recv-payload-mismatch",
                   "duplicate-send"]
    assert vs[0].events[1] is r2 and vs[0].events[0].seq == 1 and vs[1].events == (r3,)
    assert vs[2].events[0].kind.name == "send" and "c#3" in vs[2].message
    assert s.seq == 0


def test_merge_rules() -> None:
    h = H()
    s1 = h.add("a", {"a": 1}, "send", "p", 1, "m", D1)
    h.add("m", {"a": 1, "m": 1}, "recv", "p", 1, "a", D1)
    m1 = h.add("m", {"a": 1, "m": 2}, "merge", "k1", [("p", 1)], [1.0])
    m2 = h.add("m", {"a": 1, "m": 3}, "merge", "k2", [("p", 1), ("p", 9)], [1.0])  # twice, and unknown
    s2 = h.add("a", {"a": 2}, "send", "p", 2, "m", D1)
    m3 = h.add("m", {"a": 1, "m": 4}, "merge", "k3", [("p", 2), ("p", 2)], [1.0])  # not after send, dup in one
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["merge-applied-twice", "merge-unknown-contribution", "merge-not-after-send",
                                    "merge-applied-twice"]
    assert vs[0].events == (m1, m2) and "already applied by merge 'k1'" in vs[0].message
    assert vs[2].events == (s2, m3)
    assert s1.seq == 0


def test_quorum_rules() -> None:
    h = H()
    h.add("m", {"m": 1}, "quorum", "ok", 2, ["a", "b"])
    e = h.add("m", {"m": 2}, "quorum", "small", 3, ["a", "b"])
    d = h.add("m", {"m": 3}, "quorum", "dup", 2, ["a", "a"])
    vs = check_events(h.events)
    assert [(v.rule, v.events) for v in vs] == [("quorum-below-minimum", (e,)), ("quorum-duplicate-member", (d,)),
                                                ("quorum-below-minimum", (d,))]
    assert "has 2 members, minimum 3" in vs[0].message


def test_recovery_rule() -> None:
    h = H()
    h.add("a", {"a": 1}, "fault_recovered", "crash", "a", VectorClock.of(m=3), VectorClock.of(m=3, a=1))
    bad = h.add("a", {"a": 2}, "fault_recovered", "crash", "a", VectorClock.of(m=3), VectorClock.of(m=2, a=5))
    vs = check_events(h.events)
    assert [(v.rule, v.events) for v in vs] == [("recovery-before-target", (bad,))]
    assert "not >= target" in vs[0].message


def _two_actor_cut(build: Callable[[H], None]) -> list[str]:
    h = H()
    build(h)
    return rules(h)


def test_snapshot_rules() -> None:
    def orphan(h: H) -> None:
        h.add("a", {"a": 1}, "snapshot", "s", [])
        h.add("a", {"a": 2}, "send", "c", 1, "b", D1)  # after a's cut
        h.add("b", {"a": 2, "b": 1}, "recv", "c", 1, "a", D1)
        h.add("b", {"a": 2, "b": 2}, "snapshot", "s", [])  # b's cut saw it: inconsistent

    assert _two_actor_cut(orphan) == ["snapshot-inconsistent", "snapshot-orphan"]

    def inflight_missing(h: H) -> None:
        h.add("a", {"a": 1}, "send", "c", 1, "b", D1)
        h.add("a", {"a": 2}, "snapshot", "s", [])
        h.add("b", {"b": 1}, "snapshot", "s", [])  # c#1 crosses the cut, not recorded
        h.add("b", {"a": 1, "b": 2}, "recv", "c", 1, "a", D1)

    assert _two_actor_cut(inflight_missing) == ["snapshot-inflight-missing"]

    def inflight_ok(h: H) -> None:
        h.add("a", {"a": 1}, "send", "c", 1, "b", D1)
        h.add("a", {"a": 2}, "snapshot", "s", [])
        h.add("b", {"b": 1}, "snapshot", "s", [("c", 1)])
        h.add("b", {"a": 1, "b": 2}, "recv", "c", 1, "a", D1)

    assert _two_actor_cut(inflight_ok) == []

    def spurious_and_dup(h: H) -> None:
        h.add("a", {"a": 1}, "send", "c", 1, "b", D1)
        h.add("b", {"a": 1, "b": 1}, "recv", "c", 1, "a", D1)
        h.add("a", {"a": 2}, "snapshot", "s", [])
        h.add("b", {"a": 1, "b": 2}, "snapshot", "s", [("c", 1), ("zz", 4)])
        h.add("b", {"a": 1, "b": 3}, "snapshot", "s", [])

    assert _two_actor_cut(spurious_and_dup) == ["snapshot-duplicate", "snapshot-inflight-spurious",
                                                "snapshot-inflight-spurious"]


def test_rollback_and_routing_rules() -> None:
    spike = ("robust_z", 9.0, 1.0, 0.1, 0.15, 53.0, 6.0, [1.0, 1.1, 0.9])
    edits = [{"epoch": 0, "steps": [44], "action": "skip", "delay": 0}]
    h = H()
    h.add("main", {"main": 1}, "spike", *spike, step=45)
    h.add("main", {"main": 2}, "rollback", 1, 40, "ab" * 16, "step-00000040", "skip", edits, [], [], step=45)
    h.add("main", {"main": 3}, "routing", "moe.0", 0, 46, 2, b"\x01\x00\x02\x00", D1, step=45)
    h.add("main", {"main": 4}, "routing_replay", "moe.0", 0, 46, D1, step=41)
    assert rules(h) == []
    h.add("main", {"main": 5}, "rollback", 2, 50, "cd" * 16, "step-00000050", "skip", edits, [], [], step=50)
    h.add("main", {"main": 6}, "routing_replay", "moe.0", 0, 46, D2, step=42)
    h.add("main", {"main": 7}, "routing_replay", "moe.1", 0, 46, D1, step=42)
    assert rules(h) == ["rollback-not-before-detection", "rollback-without-spike", "routing-replay-mismatch",
                        "routing-replay-uncached"]


def test_every_rule_is_exercised_and_documented() -> None:
    import replay.check as chk

    for rule in RULES:
        assert rule in (chk.__doc__ or ""), rule
    spec = (Path(__file__).resolve().parents[2] / "spec" / "tape-format.md").read_text()
    for rule in RULES:
        assert f"`{rule}`" in spec, rule


@pytest.mark.parametrize("n", [0, 1])
def test_recorder_stamps_make_receive_after_send(tmp_path: Path, n: int) -> None:
    path = tmp_path / f"r{n}.tape"
    with Recorder.open(str(path), rng_every=0) as rec:
        a = rec.actor("a")
        st: Stamp = a.send("c", {"k": [1, 2]}, peer="main")
        rec.recv(st)
        assert st.clock.happened_before(rec.clock)
    assert check_tape(path) == []
