"""What the pipeline-stage run needs from replay, tested as a library user would:

- the five stage rules of ``tape check`` (spec/tape-format.md §8), each fired by a history
  built to break it, with its witnesses, and silent on a clean one;
- ``Endpoint.recv_from``: delivery in program order whatever the arrival order;
- ``Actor.event`` for a run's own kinds, refusing generic and decision kinds;
- ``merge_tapes``: a job's per-process tapes as one tape that checks and reads the same;
- ``SnapshotAgent.restore(announce=False)`` tapes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from replay import Recorder, TapeReader, check_events, check_tape, check_tapes, merge_tapes, state_digest
from replay.channel import Endpoint, InProcessNetwork, RecorderSink
from replay.snapshot import MemoryControl, MemorySnapshotStore, SnapshotAgent
from replay.clock import VectorClock
from replay.errors import ReceiveTimeoutError
from replay.events import KIND_BY_NAME, Event
import hangs

HANG = hangs.hang_s(3)  # a hang bound for a wait on peers or threads (tests/hangs.py), never a speed verdict

D1, D2, D3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16


class H:
    """A hand-built history (per-actor clocks ticked by hand)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.clocks: dict[str, dict[str, int]] = {}

    def add(self, actor: str, kind: str, *fields: object, step: int = 0) -> Event:
        c = self.clocks.setdefault(actor, {})
        c[actor] = c.get(actor, 0) + 1
        k = KIND_BY_NAME[kind]
        ev = Event(len(self.events), actor, VectorClock.of(dict(c)), step, k, k.pack(*fields))
        self.events.append(ev)
        return ev


def outage(h: H, *, first: int = 3, until: int = 6, bypass_steps: range | None = None,
           bwd_steps: range | None = None, up_step: int | None = None, up_digest: bytes = D1) -> H:
    """r0s1 is offline for [first, until); r0s0 / r0s2 bypass it; r1s1 serves its recovery."""
    h.add("r0s1", "stage_down", first, until, step=first)
    fwd = range(first, until) if bypass_steps is None else bypass_steps
    bwd = fwd if bwd_steps is None else bwd_steps
    for t in fwd:
        h.add("r0s0", "bypass", "r0s1", "r0s0", "r0s2", "fwd", step=t)
    for t in bwd:
        h.add("r0s2", "bypass", "r0s1", "r0s2", "r0s0", "bwd", step=t)
    h.add("r1s1", "recovery_sent", "r0s1", D3, D1, 4096, step=until)
    h.add("r0s1", "recovery_loaded", "r1s1", D3, up_digest, step=until)
    h.add("r0s1", "stage_up", "r1s1", step=until if up_step is None else up_step)
    return h


def rules(h: H) -> list[str]:
    return [v.rule for v in check_events(h.events)]


def test_a_clean_outage_has_no_violation() -> None:
    assert rules(outage(H())) == []
    assert rules(outage(H(), bypass_steps=range(0))) == []  # the wait policy: no bypass at all


def test_send_while_offline() -> None:
    h = H()
    down = h.add("r0s1", "stage_down", 3, 6, step=3)
    bad = h.add("r0s1", "send", "r0s1->r0s2", 7, "r0s2", D1, step=4)
    h.add("r0s1", "stage_up", "r1s1", step=6)
    h.add("r0s1", "send", "r0s1->r0s2", 8, "r0s2", D1, step=6)  # after coming up: fine
    vs = [v for v in check_events(h.events) if v.rule == "stage-send-while-offline"]
    assert len(vs) == 1 and vs[0].events == (down, bad)
    assert "r0s1 sent r0s1->r0s2#7 at step 4 while offline (down since step 3)" in vs[0].message


def test_bypass_must_cover_exactly_the_window() -> None:
    vs = check_events(outage(H(), bypass_steps=range(3, 5)).events)  # step 5 not bypassed
    assert [v.rule for v in vs] == ["bypass-window"]
    assert "r0s1's outage 3..5 is bypassed at some steps only (not at [5])" in vs[0].message
    assert rules(outage(H(), bwd_steps=range(3, 5))) == ["bypass-window"]  # gradients not routed at step 5
    h = outage(H())
    h.add("r0s0", "bypass", "r0s1", "r0s0", "r0s2", "fwd", step=6)  # the stage is back at 6
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["bypass-outside-outage"]
    assert "r0s0 routed fwd around r0s1 at step 6, when r0s1 was not offline" in vs[0].message


def test_a_tape_that_ends_inside_an_outage_is_judged_up_to_its_end() -> None:
    h = H()
    h.add("r0s1", "stage_down", 3, 9, step=3)
    for t in (3, 4):
        h.add("r0s0", "bypass", "r0s1", "r0s0", "r0s2", "fwd", step=t)
        h.add("r0s2", "bypass", "r0s1", "r0s2", "r0s0", "bwd", step=t)
    assert rules(h) == []
    h.add("r0s0", "bypass", "r0s1", "r0s0", "r0s2", "fwd", step=6)  # a hole at 5
    assert "bypass-window" in rules(h)


def test_stage_up_must_close_its_outage() -> None:
    assert rules(outage(H(), up_step=7)) == ["stage-up-mismatch"]
    h = H()
    h.add("r1s1", "recovery_sent", "r0s1", D3, D1, 4096, step=2)
    h.add("r0s1", "recovery_loaded", "r1s1", D3, D1, step=2)
    h.add("r0s1", "stage_up", "r1s1", step=2)
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["stage-up-mismatch"]
    assert "r0s1 came up at step 2 without going down" in vs[0].message


def test_recovery_state_must_match_its_source() -> None:
    # a stage's recovery is checked by the one peer-recovery rule of every run (replicas too)
    vs = check_events(outage(H(), up_digest=D2).events)
    assert [v.rule for v in vs] == ["recovery-state-mismatch"]
    assert f"r0s1 recovered from r1s1 at step 6 with state {D2.hex()}" in vs[0].message
    assert f"the source sent {D1.hex()}" in vs[0].message
    assert {e.kind.name for e in vs[0].events} == {"recovery_sent", "recovery_loaded"}
    h = H()
    h.add("r0s1", "stage_down", 1, 2, step=1)
    h.add("r0s1", "recovery_loaded", "r1s1", D3, D1, step=2)  # nobody sent it
    h.add("r0s1", "stage_up", "r1s1", step=2)
    assert rules(h) == ["recovery-without-source"]
    h = H()
    h.add("r0s1", "stage_down", 1, 2, step=1)
    h.add("r0s1", "stage_up", "r1s1", step=2)  # came up with no recovery loaded at all
    vs = check_events(h.events)
    assert [v.rule for v in vs] == ["stage-up-mismatch"]
    assert "without loading a recovery from it at that step" in vs[0].message


# -- Endpoint.recv_from ------------------------------------------------------------------


def test_recv_from_delivers_in_program_order(tmp_path: Path) -> None:
    net = InProcessNetwork([("a", "c"), ("b", "c")])
    with Recorder.open(str(tmp_path / "t.tape"), actor="c", rng_every=0) as rec:
        sink = RecorderSink(rec)
        eps = {x: Endpoint(net.transport(x), sink=sink) for x in "abc"}
        eps["a"].send("c", {"i": 0})
        eps["b"].send("c", {"i": 1})
        eps["a"].send("c", {"i": 2})
        got = [eps["c"].recv_from(s).meta["i"] for s in ("b", "a", "a")]  # arrival order was a, b, a
        assert got == [1, 0, 2]
        with pytest.raises(ReceiveTimeoutError) as ei:
            eps["c"].recv_from("b", timeout=0.01)
        assert ei.value.context["channel"] == "b->c" and ei.value.context["seq"] == 1
    recvs = [(e.payload["peer"], e.payload["chan_seq"]) for e in TapeReader(tmp_path / "t.tape").events()
             if e.kind.name == "recv"]
    assert recvs == [("b", 1), ("a", 1), ("a", 2)]
    assert check_tape(tmp_path / "t.tape") == []


# -- Actor.event ---------------------------------------------------------------------------


def test_event_tapes_a_runs_kind_and_refuses_the_others(tmp_path: Path) -> None:
    with Recorder.open(str(tmp_path / "e.tape"), actor="r0s0", rng_every=0) as rec:
        rec.current_step = 4
        rec.event("bypass", "r0s1", "r0s0", "r0s2", "fwd")
        with pytest.raises(ValueError, match="not a run's own record kind: use its Actor method"):
            rec.event("send", "c", 1, "p", D1)
        with pytest.raises(KeyError, match="unknown event kind"):
            rec.event("nope")
        with pytest.raises(TypeError, match="takes 4 fields"):
            rec.event("bypass", "r0s1")
    (ev,) = [e for e in TapeReader(tmp_path / "e.tape").events() if e.kind.name == "bypass"]
    assert ev.step == 4 and ev.payload == {"offline": "r0s1", "src": "r0s0", "dst": "r0s2", "direction": "fwd"}


def test_state_digest_is_the_params_events_digest(tmp_path: Path) -> None:
    m = torch.nn.Linear(3, 2)
    with Recorder.open(str(tmp_path / "p.tape"), rng_every=0) as rec:
        rec.params([("", m)])
    (ev,) = [e for e in TapeReader(tmp_path / "p.tape").events() if e.kind.name == "params"]
    assert state_digest(m.state_dict().items()) == ev.payload["digest"]
    assert state_digest([("w", torch.zeros(2))]) != state_digest([("w", torch.zeros(2, dtype=torch.float64))])


# -- merge_tapes --------------------------------------------------------------------------


def _two_process_job(tmp_path: Path) -> list[Path]:
    """Two 'processes' (one recorder each) exchanging messages over taped channels."""
    net = InProcessNetwork([("p", "q"), ("q", "p")])
    paths = [tmp_path / "p.tape", tmp_path / "q.tape"]
    run_id = b"\x07" * 16
    recs = [Recorder.open(str(p), actor=p.stem, rng_every=0, run_id=run_id, config={"x": 1}) for p in paths]
    eps = {r.name: Endpoint(net.transport(r.name), sink=RecorderSink(r)) for r in recs}
    for step in range(3):
        for r in recs:
            r.begin_step(step)
        eps["p"].send("q", {"step": step}, [torch.full((2,), float(step))])
        eps["q"].recv_from("p")
        eps["q"].send("p", {"ack": step})
        eps["p"].recv_from("q")
        recs[0].metric("loss", 1.0 / (step + 1))
        for r in recs:
            r.end_step()
    for r in recs:
        r.close()
    return paths


def test_merge_tapes_makes_one_tape_of_a_job(tmp_path: Path) -> None:
    paths = _two_process_job(tmp_path)
    out = tmp_path / "job.tape"
    n = merge_tapes(paths, out)
    merged = TapeReader(out)
    assert merged.run_id == b"\x07" * 16 and merged.meta["config"] == {"x": 1}
    assert merged.meta["merged_from"] == ["p.tape", "q.tape"]
    evs = list(merged.events())
    assert n == len([e for e in evs if e.kind.name != "actor"])
    assert check_tape(out) == [] and check_tapes(paths) == []
    for p in paths:  # every actor's events are the same, in the same order, byte for byte in payload and clock
        mine = [e for e in TapeReader(p).events() if e.actor == p.stem and e.kind.name != "actor"]
        theirs = [e for e in evs if e.actor == p.stem and e.kind.name != "actor"]
        assert [(e.kind.code, e.step, e.clock, e.raw) for e in mine] == \
               [(e.kind.code, e.step, e.clock, e.raw) for e in theirs]
    # the merge orders sends before their receives
    pos = {(e.kind.name, e.payload.get("channel"), e.payload.get("chan_seq")): i for i, e in enumerate(evs)
           if e.kind.name in ("send", "recv")}
    assert all(pos[("send", c, s)] < i for (k, c, s), i in pos.items() if k == "recv")


def test_merge_tapes_refuses_an_actor_on_two_tapes(tmp_path: Path) -> None:
    from replay.errors import ReplayError

    for name in ("a.tape", "b.tape"):
        with Recorder.open(str(tmp_path / name), actor="same", rng_every=0) as rec:
            rec.note("x")
    with pytest.raises(ReplayError, match="actor 'same' has events on two tapes"):
        merge_tapes([tmp_path / "a.tape", tmp_path / "b.tape"], tmp_path / "m.tape")
    assert not (tmp_path / "m.tape").exists()


# -- SnapshotAgent.restore(announce=False) --------------------------------------------------


def test_restore_without_announcing_tapes_nothing(tmp_path: Path) -> None:
    store = MemorySnapshotStore()

    def job(path: Path) -> tuple[Recorder, dict[str, SnapshotAgent], dict[str, dict[str, torch.Tensor]]]:
        net = InProcessNetwork([("a", "b"), ("b", "a")])
        rec = Recorder.open(str(path), actor="a", rng_every=0)
        sink, ctl = RecorderSink(rec), MemoryControl()
        eps = {x: Endpoint(net.transport(x), sink=sink) for x in "ab"}
        states = {x: {"w": torch.zeros(2)} for x in "ab"}
        agents = {x: SnapshotAgent(eps[x], {"s": states[x]}, store=store, control=ctl, participants=["a", "b"],
                                   background=False) for x in "ab"}
        return rec, agents, states

    rec, agents, states = job(tmp_path / "1.tape")
    states["a"]["w"] += 3
    h = agents["a"].initiate("s1")
    while not h.done():
        agents["b"].poll()
        agents["a"].poll()
    assert h.wait(HANG).committed
    rec.close()
    rec2, agents2, states2 = job(tmp_path / "2.tape")
    for x in "ab":
        agents2[x].restore("s1", announce=False)
    rec2.close()
    assert torch.equal(states2["a"]["w"], torch.full((2,), 3.0))
    assert {e.kind.name for e in TapeReader(tmp_path / "2.tape").events()} == {"actor"}  # declarations only


def test_ckpt_tape_merge(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckpt_cli.main import cli

    paths = _two_process_job(tmp_path)
    out = tmp_path / "job.tape"
    r = CliRunner().invoke(cli, ["tape", "merge", *map(str, paths), "-o", str(out)])
    assert r.exit_code == 0, r.output
    n = sum(1 for e in TapeReader(out).events() if e.kind.name != "actor")
    assert r.output == f"merged 2 tapes ({n} events) into {out}\n"
    assert CliRunner().invoke(cli, ["tape", "check", str(out)]).exit_code == 0
    again = CliRunner().invoke(cli, ["tape", "merge", *map(str, paths), "-o", str(out)])  # never overwrites
    assert again.exit_code != 0 and "exists" in again.output
    assert "Write one job tape" in CliRunner().invoke(cli, ["tape", "merge", "--help"]).output
