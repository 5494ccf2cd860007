"""Application-driven snapshots (spec/snapshot-protocol.md §9a): scope, participants and
policy exclusion per snapshot, markers taken by the application, held and unconsumed
messages, manual coordination, partial restore. A star (one coordinator, three workers)
over the in-process transport, driven step by step from one thread, so every assertion
is exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from replay.channel import Endpoint, Inbox, InProcessNetwork, ListSink
from replay.errors import SnapshotError
from tests.replay._bank import Box
from replay.snapshot import CkptSnapshotStore, MemoryControl, MemorySnapshotStore, SnapshotAgent

NAMES = ["c", "w0", "w1", "w2"]
WORKERS = NAMES[1:]


class Star:
    def __init__(self, store: Any, *, events: bool = True, names: list[str] = NAMES) -> None:
        self.net = InProcessNetwork.complete(names)
        self.store, self.ctl = store, MemoryControl()
        self.sink = ListSink()
        self.eps = {a: Endpoint(self.net.transport(a)) for a in names}
        self.box = {a: Inbox(self.eps[a], None, markers=True) for a in names}  # type: ignore[arg-type]
        self.state = {a: Box(float(i)) for i, a in enumerate(names)}
        kw: dict[str, Any] = dict(store=store, control=self.ctl, participants=names, markers="application",
                                  coordinate="manual", background=False, events=self.sink if events else None)
        self.agents = {a: SnapshotAgent(self.eps[a], {"box": self.state[a]}, excludable=WORKERS if a == "c" else (),
                                        scope=None if a == "c" else {"c"}, **kw) for a in names}
        for a in names:  # a marker that closes a recorded channel is taken at its FIFO point
            self.box[a].on_marker = self.agents[a].offer_marker

    def send(self, src: str, dst: str, v: float) -> None:
        self.box[src].send(dst, {"v": v}, [torch.tensor([v])], taped=False)

    def cpoll(self) -> None:
        """The coordinator polls: reply markers are taken as they arrive, data is held."""
        self.box["c"].poll()
        assert not any(Inbox.is_marker(m) for m in self.box["c"].box.values())

    def take(self, a: str) -> None:
        """The worker's decision: consume data up to the marker, then cut there."""
        ib = self.box[a]
        ib.poll()
        refs = list(ib.box)
        for i, r in enumerate(refs):
            m = ib.box.pop(r)
            if Inbox.is_marker(m):
                self.agents[a].take_marker(m, unconsumed=list(ib.box.values()))
                return
            self.state[a].n += 1
            self.state[a].w += m.tensors[0]


def _kinds(sink: ListSink) -> list[tuple[str, str]]:
    """The snapshot events a tape would hold (markers and begins are never taped)."""
    from replay.channel.taping import TAPED_AS

    return [(e.actor, e.kind) for e in sink.events if e.kind.startswith("snapshot.") and TAPED_AS[e.kind]]


@pytest.fixture(params=["memory", "ckpt"])
def store(request, tmp_path):
    return MemorySnapshotStore() if request.param == "memory" else CkptSnapshotStore(tmp_path / "snaps")


def test_star_snapshot_with_policy_exclusion_commits_and_tapes_at_chosen_points(store) -> None:
    j = Star(store)
    c = j.agents["c"]
    for w in WORKERS:
        j.send("c", w, 1.0)
        j.send(w, "c", 10.0)
    j.box["c"].poll()  # the coordinator holds the workers' messages unconsumed
    held = list(j.box["c"].box)
    c.initiate("s1", exclude={"w2": "recovering"})
    j.send("c", "w0", 5.0)  # after the cut: w0 must not consume it before its own cut
    j.send("w1", "c", 20.0)  # after c's cut, before w1's: channel state
    j.take("w0")
    j.take("w1")
    assert j.state["w0"].n == 1 and j.state["w1"].n == 1  # each took c's pre-cut message only
    j.send("w0", "c", 30.0)  # after w0's cut: not recorded
    assert not c.ready("s1")  # the markers are not in yet
    j.cpoll()
    assert c.markers_in("s1", ["w0", "w1"]) and c.ready("s1")
    rec = c.recorded("s1")
    assert [float(m.tensors[0]) for m in rec["w1"]] == [20.0] and rec["w0"] == []
    assert _kinds(j.sink)[:2] == [("c", "snapshot.exclude"), ("c", "snapshot.record")]
    n_before = len(j.sink.events)
    out = c.commit("s1", meta={"app": 7})
    assert len(j.sink.events) == n_before  # commit tapes nothing: the application tapes its outcome
    assert out["committed"] and out["parts"] == ["c", "w0", "w1"] and out["excluded"] == ["w2"], out
    c.finish("s1", out, inflight=[["w0->c", 1]])
    assert _kinds(j.sink)[-2:] == [("c", "snapshot.local_done"), ("c", "snapshot.commit")]
    done = j.sink.events[-2].payload
    assert done["inflight_refs"] == [["w1->c", 1]] and done["also"] == [["w0->c", 1]]
    meta = store.read_meta("s1")
    assert meta["excluded"] == ["w2"] and meta["parts"] == ["c", "w0", "w1"] and meta["app"] == 7
    assert meta["participants"] == NAMES
    # w0 rolled its cut back over the unconsumed message: a restored c sends it again
    assert store.read_extra("s1", "w0")["endpoint"]["next_recv"]["c"] == 1
    assert held  # and what c held stays its own state (nothing of it is channel state)
    assert store.read_extra("s1", "c")["channels"]["w1"] == {"first_seq": 1, "count": 1}

    # partial restore: c and the included workers from their parts; w2 rejoins on its own
    k = Star(store)
    for a in ("c", "w0", "w1"):
        k.agents[a].restore("s1", partial=True, announce=False, resume=True)
    assert [float(x) for x in k.state["w0"].w] == [2.0] * 4 and k.state["w0"].n == 1
    assert k.eps["w0"].next_recv["c"] == 1 and k.eps["c"].next_recv["w1"] == 1
    m = k.eps["c"].try_recv()  # the recorded channel state comes first
    assert m is not None and m.src == "w1" and float(m.tensors[0]) == 20.0
    assert k.agents["c"].ready("s1")  # committed already: the restored coordinator closes it again
    again = k.agents["c"].commit("s1")
    assert again["committed"] and again["parts"] == out["parts"] and again["excluded"] == out["excluded"]
    k.agents["c"].finish("s1", again)
    with pytest.raises(SnapshotError, match="no part for this process"):
        k.agents["w2"].restore("s1", partial=True)
    with pytest.raises(SnapshotError, match="restores only at the process count"):
        Star(store).agents["c"].restore("s1")  # not partial: refused, as before


def test_a_busy_channel_outside_the_scope_aborts_the_snapshot(store) -> None:
    j = Star(store)
    j.send("w0", "w1", 3.0)  # peer traffic in flight at w1's cut (delivered, not consumed)
    j.agents["c"].initiate("s2")
    j.box["w1"].poll()
    j.take("w0")
    ib = j.box["w1"]
    marker = next(m for m in ib.box.values() if Inbox.is_marker(m))
    ib.box.pop(next(r for r, m in ib.box.items() if m is marker))
    j.agents["w1"].take_marker(marker, unconsumed=list(ib.box.values()))
    j.take("w2")
    j.cpoll()
    assert j.agents["c"].ready("s2")
    out = j.agents["c"].commit("s2")
    assert not out["committed"] and "w0->w1 is not quiet" in out["reason"], out
    j.agents["c"].finish("s2", out)
    assert j.sink.events[-1].kind == "snapshot.abort"
    assert store.pending_leftovers() == []


def test_a_dead_participant_is_excluded_at_the_commit_and_a_replay_writes_nothing() -> None:
    store = MemorySnapshotStore()
    j = Star(store)
    j.agents["c"].initiate("s3")
    j.take("w0")
    j.take("w1")  # w2 dies before its marker
    j.cpoll()
    assert not j.agents["c"].ready("s3")
    assert j.agents["c"].ready("s3", dead={"w2"})
    out = j.agents["c"].commit("s3", dead={"w2"})
    assert out["committed"] and out["excluded"] == ["w2"]
    j.agents["c"].finish("s3", out)
    assert [e.payload["actor"] for e in j.sink.events if e.kind == "snapshot.exclude"] == ["w2"]

    # the same protocol with no store: cuts, markers and events, nothing written
    r = Star(None)
    r.agents["c"].initiate("s3")
    for w in WORKERS:
        r.take(w)
    r.cpoll()
    with pytest.raises(SnapshotError, match="take commit"):
        r.agents["c"].commit("s3")
    r.agents["c"].finish("s3", out)  # the taped outcome, as a replay has it
    assert [e.actor for e in r.sink.events if e.kind == "snapshot.record"] == ["c", "w0", "w1", "w2"]
    # the coordinator's events are the recording's, w2's marker notwithstanding
    assert [k for k in _kinds(r.sink) if k[0] == "c"] == [k for k in _kinds(j.sink) if k[0] == "c"]


def test_application_options_are_checked() -> None:
    j = Star(MemorySnapshotStore())
    with pytest.raises(SnapshotError, match="only an excludable"):
        j.agents["c"].initiate("x", exclude={"c": "no"})
    ep = Endpoint(InProcessNetwork.complete(["a", "b"]).transport("a"))
    with pytest.raises(SnapshotError, match="markers must be"):
        SnapshotAgent(ep, {}, store=None, control=MemoryControl(), participants=["a", "b"], markers="x")
    with pytest.raises(SnapshotError, match="coordinate must be"):
        SnapshotAgent(ep, {}, store=None, control=MemoryControl(), participants=["a", "b"], coordinate="x")
    auto = SnapshotAgent(ep, {}, store=None, control=MemoryControl(), participants=["a", "b"])
    with pytest.raises(SnapshotError, match="take_marker is for"):
        auto.take_marker(None)  # type: ignore[arg-type]
    with pytest.raises(SnapshotError, match="coordinated here by hand"):
        auto.ready("nope")
