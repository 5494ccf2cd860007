"""The Endpoint over the in-process transport: FIFO, seq, clocks, schedulers, typed errors."""

from __future__ import annotations

import threading

import pytest
import torch

from replay.channel import (
    ArrivalScheduler,
    Endpoint,
    ForcedScheduler,
    InProcessNetwork,
    ListSink,
    MessageKind,
    SeededScheduler,
)
from replay.clock import VectorClock
from replay.errors import (
    ChannelError,
    DivergenceError,
    MessageTooLargeError,
    PeerDiedError,
    ReceiveTimeoutError,
    SnapshotError,
)
import hangs

HANG = hangs.hang_s(3)  # a hang bound for a wait on peers or threads (tests/hangs.py), never a speed verdict


def star(sched=None, sink=None, **kw):
    net = InProcessNetwork([("a", "c"), ("b", "c"), ("c", "a")])
    eps = {x: Endpoint(net.transport(x), scheduler=sched if x == "c" else None, sink=sink, **kw) for x in "abc"}
    return net, eps


def test_fifo_seq_clock_and_repeated_payloads_stay_distinct() -> None:
    sink = ListSink()
    _, ep = star(sink=sink)
    t = torch.arange(4.0)
    for _ in range(3):
        ep["a"].send("c", {"same": True}, [t])
    t.add_(100)  # the sender reuses its buffer at once: messages have value semantics
    got = [ep["c"].recv(timeout=HANG) for _ in range(3)]
    assert [m.seq for m in got] == [0, 1, 2]
    assert [m.clock for m in got] == [VectorClock.of(a=1), VectorClock.of(a=2), VectorClock.of(a=3)]
    assert all(torch.equal(m.tensors[0], torch.arange(4.0)) and m.meta == {"same": True} for m in got)
    assert ep["c"].clock == VectorClock.of(a=3, c=3)
    kinds = [(e.kind, e.actor, e.payload.get("seq")) for e in sink.events]
    assert kinds == [("send", "a", 0), ("send", "a", 1), ("send", "a", 2), ("recv", "c", 0), ("recv", "c", 1),
                     ("recv", "c", 2)]
    assert sink.events[3].payload["send_clock"] == VectorClock.of(a=1).encode()


def test_arrival_scheduler_delivers_in_arrival_order_across_channels() -> None:
    _, ep = star(sched=ArrivalScheduler())
    ep["b"].send("c", {"i": 0})
    ep["a"].send("c", {"i": 1})
    ep["b"].send("c", {"i": 2})
    assert [ep["c"].recv(1).meta["i"] for _ in range(3)] == [0, 1, 2]


def test_seeded_scheduler_is_deterministic_and_fifo_per_channel() -> None:
    def run(seed: int) -> list[tuple[str, int]]:
        _, ep = star(sched=SeededScheduler(seed))
        for i in range(20):
            ep["a" if i % 3 else "b"].send("c", {"i": i})
        return [(m.src, m.seq) for m in (ep["c"].recv(1) for _ in range(20))]

    first = run(7)
    assert first == run(7)
    assert first != run(8) or first != run(9)
    for src in "ab":
        seqs = [q for s, q in first if s == src]
        assert seqs == sorted(seqs)


def test_forced_scheduler_replays_order_including_empty_polls() -> None:
    order = [("b", 0), None, ("a", 0), ("a", 1)]
    _, ep = star(sched=ForcedScheduler(order))
    ep["a"].send("c", {"x": "a0"})
    ep["a"].send("c", {"x": "a1"})
    ep["b"].send("c", {"x": "b0"})
    got = [ep["c"].try_recv() for _ in range(4)]
    assert [None if m is None else m.meta["x"] for m in got] == ["b0", None, "a0", "a1"]
    with pytest.raises(DivergenceError, match="forced delivery order exhausted"):
        ep["c"].try_recv()


def test_forced_scheduler_waits_for_a_message_sent_by_another_thread() -> None:
    _, ep = star(sched=ForcedScheduler([("b", 0)]))
    ep["a"].send("c", {"x": "early"})
    threading.Timer(0.05, lambda: ep["b"].send("c", {"x": "late"})).start()
    assert ep["c"].recv(timeout=HANG).meta["x"] == "late"


def test_forced_scheduler_divergence_on_wrong_seq_and_blocking_none() -> None:
    _, ep = star(sched=ForcedScheduler([("a", 1)]))
    ep["a"].send("c", {})
    with pytest.raises(DivergenceError, match="expects seq 1 next, the channel holds seq 0"):
        ep["c"].recv(1)
    _, ep = star(sched=ForcedScheduler([None]))
    with pytest.raises(DivergenceError, match="a blocking receive must deliver"):
        ep["c"].recv(1)


def test_receive_timeout_names_channels_and_next_seqs() -> None:
    _, ep = star()
    ep["a"].send("c", {})
    ep["c"].recv(1)
    with pytest.raises(ReceiveTimeoutError) as ei:
        ep["c"].recv(timeout=0.05)
    assert ei.value.channel == "a->c,b->c" and ei.value.seq == "1,0"
    assert isinstance(ei.value, TimeoutError)
    _, ep = star(sched=ForcedScheduler([("b", 0)]), forced_wait_s=0.05)
    with pytest.raises(ReceiveTimeoutError, match=r"no message within 0.05 s \(channel b->c, seq 0\)"):
        ep["c"].try_recv()


def test_too_large_is_refused_before_sending_and_leaves_state_unchanged() -> None:
    _, ep = star(max_message_bytes=1000)
    with pytest.raises(MessageTooLargeError, match=r"message of 4\d\d\d bytes is above the declared bound of 1000 "
                                                   r"bytes \(channel a->c, seq 0\)"):
        ep["a"].send("c", {}, [torch.zeros(1000)])
    assert ep["a"].next_send["c"] == 0 and ep["a"].clock == VectorClock()
    ep["a"].send("c", {}, [torch.zeros(10)])
    assert ep["c"].recv(1).seq == 0


def test_peer_death_is_reported_at_once_and_its_complete_messages_stay_deliverable() -> None:
    net, ep = star()
    seen: list[str] = []
    ep["c"].on_peer_failed(seen.append)
    ep["a"].send("c", {"i": 0})
    net.kill("a")
    # Reported on the first receive call that sees it; the seq is the first one that
    # will never arrive (seq 0 arrived complete and is still delivered).
    with pytest.raises(PeerDiedError, match=r"peer a died: killed \(channel a->c, seq 1\)"):
        ep["c"].recv(1)
    assert seen == ["a"] and ep["c"].dead == {"a"}
    assert ep["c"].recv(1).meta == {"i": 0}
    with pytest.raises(ReceiveTimeoutError):
        ep["c"].recv(0.05)
    with pytest.raises(PeerDiedError, match=r"peer a is dead \(channel c->a, seq 0\)"):
        ep["c"].send("a", {})


def test_bad_usage_errors() -> None:
    _, ep = star()
    with pytest.raises(ChannelError, match=r"no channel from a to b \(channel a->b\)"):
        ep["a"].send("b", {})
    with pytest.raises(ChannelError, match="metadata is not msgpack-able"):
        ep["a"].send("c", {"x": object()})
    with pytest.raises(ChannelError, match="tensors must be torch.Tensor"):
        ep["a"].send("c", {}, [[1, 2]])  # type: ignore[list-item]
    with pytest.raises(ChannelError, match="two distinct actors"):
        InProcessNetwork([("a", "a")])


def test_control_messages_take_no_seq_and_no_tick_and_wait_behind_data() -> None:
    _, ep = star()
    seen = []
    ep["c"].on_control(lambda m: seen.append((m.src, m.seq, m.kind)))
    ep["a"].send("c", {"i": 0})
    ep["a"].send_control("c", MessageKind.MARKER, {"snapshot": "s"})
    ep["a"].send("c", {"i": 1})
    assert ep["a"].next_send["c"] == 2 and ep["a"].clock == VectorClock.of(a=2)
    ep["c"].poll()
    assert seen == []  # the marker sits behind undelivered data (FIFO)
    assert ep["c"].recv(1).seq == 0
    assert seen == []  # handed over at the start of the next receive call, not after a delivery
    assert ep["c"].recv(1).seq == 1
    assert seen == [("a", 1, MessageKind.MARKER)]


def test_restore_requeues_inflight_ahead_of_new_messages_and_checks_preconditions() -> None:
    _, ep = star()
    ep["a"].send("c", {"new": True})  # seq 0 from a fresh sender, arrives before restore
    c = ep["c"]
    from replay.channel import Message

    inflight = [Message("a", "c", 5, VectorClock.of(a=6), MessageKind.DATA, {"old": 5}),
                Message("a", "c", 6, VectorClock.of(a=7), MessageKind.DATA, {"old": 6})]
    with pytest.raises(SnapshotError, match="not contiguous"):
        c.restore({"clock": VectorClock.of(c=3).encode(), "next_send": {"a": 0}, "next_recv": {"a": 4, "b": 0}},
                  {"a": inflight})
    with pytest.raises(SnapshotError, match="topology differs"):
        c.restore({"clock": b"\x00\x00", "next_send": {}, "next_recv": {"a": 5, "b": 0}}, {})
    c.restore({"clock": VectorClock.of(c=3).encode(), "next_send": {"a": 0}, "next_recv": {"a": 5, "b": 0}},
              {"a": inflight})
    assert c.clock == VectorClock.of(c=3)
    assert [c.recv(1).meta for _ in range(2)] == [{"old": 5}, {"old": 6}]
    with pytest.raises(ChannelError, match="sequence gap: expected seq 7, got 0"):
        c.recv(1)  # the pre-restore sender was not restored: its seq 0 is a gap
    with pytest.raises(SnapshotError, match="before the endpoint delivers anything"):
        c.restore({"clock": b"\x00\x00", "next_send": {"a": 0}, "next_recv": {"a": 0, "b": 0}}, {})
