"""The tape hub (spec/snapshot-protocol.md §9b): one tape for a job of threads and
processes, incarnations of one actor, remote logs applied in order, snapshot events."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replay import Recorder, TapeReader, check_tape
from replay.channel import (
    Inbox,
    InProcessNetwork,
    Endpoint,
    LogApplier,
    RemoteTape,
    TapeHub,
    TapeSinkEvents,
    actor_of,
    endpoint_name,
    meta_digest,
)
from replay.errors import ReplayError


def test_incarnations_share_one_tape_actor_and_its_channel_seqs(tmp_path: Path) -> None:
    assert endpoint_name("w-1", 0) == "w-1" and endpoint_name("w-1", 2) == "w-1~2"
    assert actor_of("w-1~2") == actor_of("w-1") == "w-1"
    net = InProcessNetwork.complete(["c", "w", "w~1"])
    with Recorder.open(str(tmp_path / "t"), entry_point="x:y", actor="c") as rec:
        hub = TapeHub(rec, wait_s=5.0)
        ibs = {e: Inbox(Endpoint(net.transport(e)), hub.local(actor_of(e))) for e in ("c", "w", "w~1")}
        for e in ("w", "w~1"):  # the first incarnation, then its replacement
            ref = ibs[e].send("c", {"k": e}, [torch.ones(2)])
            got = ibs["c"].wait_ref(ref)
            ibs["c"].tape.recv(ref)
            assert got.meta["k"] == e
        ibs["c"].send("w~1", {"k": "untaped"}, taped=False)
        st = [hub.stamp(("w", "c", 0)), hub.stamp(("w~1", "c", 0))]
        assert [(s.channel, s.chan_seq) for s in st] == [("w->c", 1), ("w->c", 2)]  # one channel, counting on
        assert hub.unreceived_to("w~1") == [] and hub.stamp(("c", "w~1", 0), wait=False) is None
    assert check_tape(tmp_path / "t") == []


def test_remote_logs_wait_for_the_send_they_receive(tmp_path: Path) -> None:
    with Recorder.open(str(tmp_path / "t"), entry_point="x:y", actor="c") as rec:
        hub = TapeHub(rec, wait_s=5.0)
        applier = LogApplier(hub)
        a, b = RemoteTape("a"), RemoteTape("b")
        b.recv(("a", "b", 0))  # b's log arrives first: its receive must wait for a's send
        b.note("after")
        applier.add("b", *b.drain())
        assert applier.pending() == 2
        a.send(("a", "b", 0), "b", meta_digest({"x": 1}, []))
        a.params([("w", torch.zeros(2))])
        applier.add("a", *a.drain())
        assert applier.pending() == 0
    events = list(TapeReader(tmp_path / "t").events())
    assert [(e.actor, e.kind.name) for e in events if e.actor in ("a", "b") and e.kind.name != "actor"] == \
        [("a", "send"), ("a", "params"), ("b", "recv"), ("b", "note")]
    assert check_tape(tmp_path / "t") == []
    with Recorder.open(str(tmp_path / "u"), entry_point="x:y", actor="c") as rec:
        with pytest.raises(ReplayError, match="unknown remote tape op"):
            LogApplier(TapeHub(rec)).add("a", [["bogus"]], [])


def test_tape_sink_events_name_messages_by_their_tape_stamps(tmp_path: Path) -> None:
    net = InProcessNetwork.complete(["c", "w"])
    with Recorder.open(str(tmp_path / "t"), entry_point="x:y", actor="c") as rec:
        hub = TapeHub(rec, wait_s=5.0)
        w = Inbox(Endpoint(net.transport("w")), hub.local("w"))
        w.send("c", {"n": 1})
        w.send("c", {"n": 2}, taped=False)  # control traffic: no stamp, left out
        ev = TapeSinkEvents(hub.local("c"), hub)
        clock = ev.record("snapshot.record", "c", None, 0, {"snapshot": "s"})  # type: ignore[arg-type]
        assert clock is not None and clock == hub.local("c").clock
        ev.record("snapshot.local_done", "c", None, 0, {"snapshot": "s", "inflight_refs": [["w->c", 0], ["w->c", 1]],
                                                         "also": [["x->c", 9]]})  # type: ignore[arg-type]
        ev.record("snapshot.commit", "c", None, 0, {"snapshot": "s", "path": "p", "parts": ["c"], "excluded": []})  # type: ignore[arg-type]
        assert ev.record("send", "c", None, 0, {}) is None  # type: ignore[arg-type]
        with pytest.raises(ReplayError, match="needs the tape hub"):
            TapeSinkEvents(hub.local("c")).record("snapshot.local_done", "c", None, 0,  # type: ignore[arg-type]
                                                  {"snapshot": "s", "inflight_refs": [["w->c", 0]]})
    evs = {e.kind.name: e for e in TapeReader(tmp_path / "t").events() if e.actor == "c"}
    assert [tuple(r) for r in evs["snapshot_channels"].payload["inflight"]] == [("w->c", 1), ("x->c", 9)]
    assert evs["snapshot_outcome"].payload["committed"]
