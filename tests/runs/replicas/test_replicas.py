"""The replica run end to end (issue 14 §1 and §3).

Two runs only (multi-process torchft runs are expensive on 2 cores): one with a process per
rank, real SIGKILL and a joiner, replayed by the real ``ckpt replay`` command; one with
torchft's Managers as threads, two-rank groups, a joiner and both SDC faults. Nothing here
waits on time: the kill point and the join point are logical steps, every timing-dependent
outcome is a taped decision.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import pytest

pytest.importorskip("torchft")

import replay  # noqa: E402
from replay import TapeReader, check_events  # noqa: E402
from runs.replicas import Join, Kill, ReplicaConfig, SdcFault, record  # noqa: E402

from hangs import hang_s, run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
pytestmark = pytest.mark.slow


def _events(tape):
    return list(TapeReader(tape).events())


def test_sigkilled_group_survivors_train_on_replacement_recovers_and_replay_is_exact(tmp_path):
    # the replacement's first recovery stream is also hit in transit (SDC on the communication
    # path): refused on receipt, the attempt fails (the survivors' all-reduce times out, timeout_s),
    # the retry's stream is intact
    cfg = ReplicaConfig(groups=(("g0", 1), ("g1", 1), ("g2", 1)), steps=12, kills=(Kill("g2", 3),),
                        joins=(Join("g3", 1, 5),), timeout_s=8.0, sdc_faults=(SdcFault("g3.0", 0, "received", bit=3),))
    tape = str(tmp_path / "run.tape")
    res = record(tape, cfg)
    assert res.exitcodes["g2.0"] == -9 and res.killed["g2"]
    done = {a: r for a, r in res.ranks.items() if r["outcome"] == "finished"}
    assert set(done) == {"g0.0", "g1.0", "g3.0"} and all(r["steps"] == 12 for r in done.values())
    assert len({bytes(r["params"]) for r in done.values()}) == 1  # one replicated state at the end
    # healed from a live peer (twice: the first stream it got was damaged in transit, refused)
    assert len(done["g3.0"]["recovered_from"]) == 2 and set(done["g3.0"]["recovered_from"]) <= {"g0", "g1"}
    evs = _events(tape)
    assert replay.check_tape(tape) == []
    # the attempt g2 died in: its samples went back to the stream, the tape says so
    re = [e for e in evs if e.kind.name == "data_reassign"]
    assert {e.actor for e in re if e.payload["lost"] == ["g2"]} == {"g0.0", "g1.0"}
    assert all(len(e.payload["sample_ids"]) == cfg.global_batch for e in re)
    # every committed step under a quorum; the joiner holds exactly what its source sent
    loaded = [e for e in evs if e.kind.name == "recovery_loaded"]
    sent = [e for e in evs if e.kind.name == "recovery_sent"]
    # torchft may also heal a group that started late (a taped quorum decision that depends on
    # timing); the joiner g3.0 recovers exactly once, and every recovery matches what was sent
    joined = [e for e in loaded if e.actor == "g3.0"]
    assert len(joined) == 1
    # the damaged stream was refused on receipt, its source named, before anything was loaded
    stream = [e for e in evs if e.kind.name == "sdc_verdict" and e.payload["check"] == "stream"]
    assert [(e.actor, e.payload["ok"]) for e in stream] == [("g3.0", 0)]
    assert stream[0].payload["odd"] and stream[0].payload["odd"][0] in ("g0.0", "g1.0")
    assert [e.payload["target"] for e in evs if e.kind.name == "fault_detected" and e.actor == "g3.0"
            and e.payload["fault"] == "stream-corrupt"] == stream[0].payload["odd"]
    assert evs.index(stream[0]) < evs.index(joined[0])
    for ld in loaded:
        assert any(s.payload["state"] == ld.payload["state"] and s.payload["peer"] == ld.actor for s in sent)
    k = evs.index(joined[0])
    forged = joined[0].kind.pack(joined[0].payload["source"], joined[0].payload["stream"], b"\x00" * 16)
    assert [v.rule for v in check_events(evs[:k] + [replace(evs[k], raw=forged)] + evs[k + 1:])] == [
        "recovery-state-mismatch"]
    # the real command re-executes the faulty run bit for bit (ranks as threads, decisions forced)
    out = run([os.path.join(os.path.dirname(sys.executable), "ckpt"), "replay", tape, "--mode", "force", "--trust"],
              cwd=str(tmp_path), bound_s=hang_s(60.0))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "IDENTICAL" in out.stdout


def test_two_rank_groups_join_and_both_sdc_faults_are_caught_and_replayed(tmp_path):
    cfg = ReplicaConfig(groups=(("g0", 2), ("g1", 2), ("g2", 2)), steps=8, joins=(Join("g3", 2, 1),),
                        reexec_every=3,
                        sdc_faults=(SdcFault("g2.1", 3, "local", bucket=0, index=11, bit=28),
                                    SdcFault("g1.1", 5, "reduced", bucket=3, index=2, bit=30)))
    tape = str(tmp_path / "sdc.tape")
    res = record(tape, cfg, transport="threads")
    evs = _events(tape)
    assert replay.check_tape(tape) == []
    bad = [e for e in evs if e.kind.name == "sdc_verdict" and not e.payload["ok"]]
    # re-execution: g2.1 computed its step-3 gradient wrong; it alone finds it, at step 3
    rex = {(e.step, e.actor, tuple(e.payload["odd"])) for e in bad if e.payload["check"] == "reexec"}
    assert rex == {(3, "g2.1", ("g2.1",))}
    # cross replica: g1.1's reduced bucket b3 flipped at step 5; the rank-1 ring names g1 at step 5
    cross = {(e.step, e.actor, tuple(e.payload["odd"]), tuple(e.payload["buckets"]))
             for e in bad if e.payload["check"] == "cross-replica"}
    assert {c[:1] + c[2:] for c in cross} == {(5, ("g1",), ("b3",))}
    assert {c[1] for c in cross} >= {"g0.1", "g1.1", "g3.1"}  # g2 left at step 3
    # g2.1's wrong gradient was in every replica's sum: every replica dropped step 3 (attempt 0)
    assert {e.actor for e in evs if e.kind.name == "step_commit" and e.step == 3 and not e.payload["committed"]} == {
        f"{g}.{r}" for g in ("g0", "g1", "g2", "g3") for r in (0, 1)}
    # exclusion binds the whole group (both of its ranks leave); torchft carries on without it
    assert all(res.ranks[f"{g}.{r}"]["outcome"] == "excluded" for g in ("g1", "g2") for r in (0, 1))
    assert all(res.ranks[f"{g}.{r}"]["steps"] == 8 for g in ("g0", "g3") for r in (0, 1))
    # the joiner's two ranks recovered rank by rank from a live peer (under load a slow initial
    # group may also have healed from a peer at the start: torchft decided it, the tape says so)
    # (a group that dropped a step heals at the next one, from any up-to-date peer, g3 included)
    loaded = [(e.actor, e.payload["source"]) for e in evs if e.kind.name == "recovery_loaded"]
    first = {a: src for a, src in reversed(loaded)}
    assert {"g3.0", "g3.1"} <= set(first) and not any(first[a].startswith("g3.") for a in ("g3.0", "g3.1"))
    assert all(src.split(".")[1] == a.split(".")[1] for a, src in loaded)

    rr = replay.replay(tape, mode="force")
    assert rr.identical, rr.format()


def test_a_partially_failed_all_reduce_replays_exactly(tmp_path):
    # g1.0's all-reduce of step 3 completes on every member, then g1.0 reports it failed: it
    # does not join the step's exchange, so the others' fails (timeout_s) and no replica commits
    # the attempt (a step is committed by all or by none). The replay re-runs the all-reduce
    # with every member (it completed for some, so all took part), g1.0 then failing it as taped.
    # min_replicas=3: no quorum forms without a live group (torchft's lighthouse would otherwise
    # form one without a group that is slow to ask, after its join timeout: on a loaded machine
    # g1 could then heal past step 3 and never run the attempt this test is about)
    cfg = ReplicaConfig(groups=(("g0", 1), ("g1", 1), ("g2", 1)), steps=8, sdc=False, late_failures=(("g1.0", 3),),
                        timeout_s=5.0, min_replicas=3)
    tape = str(tmp_path / "run.tape")
    res = record(tape, cfg, transport="threads")
    assert len({bytes(r["params"]) for r in res.ranks.values()}) == 1
    evs = _events(tape)
    inj = [e for e in evs if e.kind.name == "fault_injected" and e.payload["fault"] == "late-failure"]
    assert [(e.actor, e.step) for e in inj] == [("g1.0", 3)]
    failed = next(e for e in evs[evs.index(inj[0]):] if e.actor == "g1.0" and e.kind.name == "decision"
                  and e.payload["what"] == "allreduce")
    assert failed.payload["value"] is False
    peers = [e for e in evs if e.kind.name == "decision" and e.payload["what"] == "allreduce"
             and e.payload["key"] == failed.payload["key"] and e.actor != "g1.0" and e.step == 3]
    assert peers and all(e.payload["value"] is True for e in peers)  # the same collective completed for them
    # ... and none of them committed that attempt (all or none)
    for d in peers + [failed]:
        nxt = next(e for e in evs[evs.index(d):] if e.actor == d.actor and e.kind.name == "step_commit")
        assert nxt.step == 3 and not nxt.payload["committed"]
    assert replay.check_tape(tape) == []
    rr = replay.replay(tape, mode="force")
    assert rr.identical, rr.format()
