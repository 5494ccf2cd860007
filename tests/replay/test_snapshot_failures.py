"""Snapshot failure handling and restore rules, over the in-process transport, with the
ckpt-backed store (real directories) and the in-memory one."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from replay.channel import Endpoint, InProcessNetwork, ListSink
from replay.errors import SnapshotError
from tests.replay._agents import pump
from tests.replay._bank import Box
from replay.snapshot import (
    CHANNELS_KEY,
    CkptSnapshotStore,
    MemoryControl,
    MemorySnapshotStore,
    SnapshotAgent,
)
import hangs

HANG = hangs.hang_s(3)  # a hang bound for a wait on peers or threads (tests/hangs.py), never a speed verdict


def job(store, names=("p0", "p1", "p2"), **kw):
    net = InProcessNetwork.complete(names)
    sink = ListSink()
    ctl = MemoryControl()
    eps = {a: Endpoint(net.transport(a), sink=sink) for a in names}
    boxes = {a: Box(float(i)) for i, a in enumerate(names)}
    agents = {a: SnapshotAgent(eps[a], {"box": boxes[a]}, store=store, control=ctl, participants=names, **kw)
              for a in names}
    return net, sink, eps, boxes, agents


@pytest.fixture(params=["ckpt", "memory"])
def store(request, tmp_path):
    return CkptSnapshotStore(tmp_path / "snaps") if request.param == "ckpt" else MemorySnapshotStore()


def test_commit_writes_one_checkpoint_with_a_part_per_process(store) -> None:
    net, sink, eps, boxes, agents = job(store)
    eps["p1"].send("p0", {"x": 1}, [torch.ones(2)])  # in flight across the cut
    h = agents["p0"].initiate("s1")
    boxes["p0"].w.add_(100)  # after the cut: must not show in the part
    assert eps["p0"].recv(1).meta == {"x": 1}  # delivered after p0's cut: recorded in flight
    out = pump(agents.values(), h)
    assert out.committed and out.parts == ("p0", "p1", "p2") and out.excluded == ()
    meta = store.read_meta("s1")
    assert meta["format"] == "replay-snapshot" and meta["version"] == 1
    assert meta["parts"] == ["p0", "p1", "p2"] and meta["coordinator"] == "p0"
    assert set(meta["cut"]) == {"p0", "p1", "p2"}
    assert meta["channels"]["p0"]["p1"] == {"first_seq": 0, "count": 1}
    assert torch.equal(store.read_entry("s1", "p0", "box")["w"], torch.zeros(4))
    ch = store.read_entry("s1", "p0", CHANNELS_KEY)
    assert ch["p1"][0]["seq"] == 0 and ch["p1"][0]["meta"] == {"x": 1}
    assert torch.equal(ch["p1"][0]["tensors"][0], torch.ones(2))
    assert store.pending_leftovers() == []
    kinds = [e.kind for e in sink.events]
    assert kinds.count("snapshot.record") == 3 and kinds.count("snapshot.commit") == 1
    if isinstance(store, CkptSnapshotStore):
        import ckpt

        r = ckpt.open(store.path("s1"))
        assert [p.name for p in r.parts] == ["p0", "p1", "p2"] and r.manifest.kind == "snapshot"
        rep = r.verify()  # raises on any bad chunk; every part's files are covered
        assert rep.files == sum(len(p.files) for p in r.parts) == 6


def test_participant_dead_before_recording_aborts_cleanly(store) -> None:
    net, sink, eps, boxes, agents = job(store)
    net.kill("p2")
    h = agents["p0"].initiate("s2")
    out = pump([agents["p0"], agents["p1"]], h)
    assert not out.committed
    assert "participant p2 failed before its part was durable" in out.reason
    assert store.pending_leftovers() == []
    if isinstance(store, CkptSnapshotStore):
        assert os.listdir(store.root) == []  # no commit, no temporary directory
    aborts = [e for e in sink.events if e.kind == "snapshot.abort"]
    assert len(aborts) == 1 and aborts[0].payload["snapshot"] == "s2" and aborts[0].actor == "p0"


def test_failed_participant_excluded_by_policy(store) -> None:
    net, sink, eps, boxes, agents = job(store, excludable=("p2",))
    eps["p2"].send("p1", {"last": True}, [torch.tensor(5)])
    h = agents["p0"].initiate("s3")
    agents["p1"].poll()  # p1 records; p2's message arrived but is not delivered
    net.kill("p2")
    out = pump([agents["p0"], agents["p1"]], h)
    assert out.committed, out.reason
    assert out.parts == ("p0", "p1") and out.excluded == ("p2",)
    meta = store.read_meta("s3")
    assert meta["excluded"] == ["p2"] and meta["parts"] == ["p0", "p1"]
    assert [e.payload["actor"] for e in sink.events if e.kind == "snapshot.exclude"] == ["p2"]
    # It arrived complete before p2 died, after p1's cut: it is channel state.
    assert store.read_entry("s3", "p1", CHANNELS_KEY)["p2"][0]["meta"] == {"last": True}


def test_marked_failed_participant_is_excluded_without_transport_error(store) -> None:
    net, sink, eps, boxes, agents = job(store, excludable=("p2",))
    h = agents["p0"].initiate("s4")
    agents["p0"].mark_failed("p2", "tape says learner failed")  # alive, but declared failed
    out = pump([agents["p0"], agents["p1"]], h)
    assert out.committed and out.excluded == ("p2",)


def test_unreachable_participant_hits_the_deadline(store) -> None:
    names = ("p0", "p1")
    net = InProcessNetwork([("p0", "p1")])  # p0 has no incoming channel: fine; p1 never polls
    ctl = MemoryControl()
    eps = {a: Endpoint(net.transport(a)) for a in names}
    agents = {a: SnapshotAgent(eps[a], {}, store=store, control=ctl, participants=names, deadline_s=0.2)
              for a in names}
    out = agents["p0"].initiate("s5").wait(HANG)
    assert not out.committed and "participants ['p1'] reported no part within 0.2 s" in out.reason
    assert store.pending_leftovers() == []


def test_restore_at_a_different_process_count_is_refused(store) -> None:
    net, sink, eps, boxes, agents = job(store)
    assert pump(agents.values(), agents["p1"].initiate("s6")).committed
    _, _, eps2, _, agents2 = job(store, names=("p0", "p1"))
    with pytest.raises(SnapshotError, match=r"snapshot was taken at 3 processes \['p0', 'p1', 'p2'\]; this job has 2 "
                                            r"\['p0', 'p1'\]; a snapshot restores only at the process count"):
        agents2["p0"].restore("s6")
    _, _, _, _, agents3 = job(store, names=("p0", "p1", "q2"))
    with pytest.raises(SnapshotError, match=r"snapshot processes \['p0', 'p1', 'p2'\] differ"):
        agents3["p0"].restore("s6")


def test_restore_round_trip_puts_state_and_inflight_back(store) -> None:
    net, sink, eps, boxes, agents = job(store)
    eps["p2"].send("p0", {"k": "in-flight"}, [torch.arange(3)])
    h = agents["p1"].initiate("s7")
    agents["p0"].poll()  # p0 records at p1's marker, before p2's message is delivered
    assert eps["p0"].recv(1).meta == {"k": "in-flight"}
    assert pump(agents.values(), h).committed
    _, _, eps2, boxes2, agents2 = job(store)
    for b in boxes2.values():
        b.w.fill_(-1)
    for a in ("p0", "p1", "p2"):
        info = agents2[a].restore("s7")
    assert [torch.equal(boxes2[a].w, torch.full((4,), float(i))) for i, a in enumerate(("p0", "p1", "p2"))] == [True] * 3
    m = eps2["p0"].recv(1)
    assert (m.src, m.seq, m.meta) == ("p2", 0, {"k": "in-flight"}) and torch.equal(m.tensors[0], torch.arange(3))
    assert eps2["p0"].clock == eps["p0"].clock.__class__.decode(store.read_meta("s7")["cut"]["p0"]).receive("p0", m.clock)
    assert info.actor == "p2"


def test_registration_errors(store) -> None:
    net = InProcessNetwork.complete(["a", "b"])
    ep = Endpoint(net.transport("a"))
    with pytest.raises(SnapshotError, match="'replay.channels' is reserved"):
        SnapshotAgent(ep, {CHANNELS_KEY: torch.zeros(1)}, store=store, control=MemoryControl(), participants=["a"])
    with pytest.raises(SnapshotError, match="not among the participants"):
        SnapshotAgent(ep, {}, store=store, control=MemoryControl(), participants=["b"])
    agent = SnapshotAgent(ep, {"x": object()}, store=store, control=MemoryControl(), participants=["a", "b"])
    with pytest.raises(SnapshotError, match="cannot stage a value of type object"):
        agent.initiate("bad")
