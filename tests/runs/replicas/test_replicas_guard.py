"""The loss-spike guard in the replica run (issue 14 §2 for the replica run, §3's rollback
policy): periodic checkpoints through ckpt.CheckpointManager on one run directory (the
quorum's first replica writes, every replica can load), a spike rolls every replica back
together, SDC under policy rollback goes back to the newest checkpoint that verifies;
both force-replay bit for bit. torchft's Managers run as threads (timing-dependent
outcomes are taped decisions; nothing here waits on time)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torchft")

import replay  # noqa: E402
from replay import TapeReader  # noqa: E402
from runs.replicas import ReplicaConfig, SdcFault, Spike, record  # noqa: E402

pytestmark = pytest.mark.slow
GROUPS = (("g0", 1), ("g1", 1), ("g2", 1))
GUARD = {"window": 16, "min_history": 6, "z_threshold": 6.0, "skip_after": 1}


def _events(tape, kind):
    return [e for e in TapeReader(tape).events() if e.kind.name == kind]


def test_a_loss_spike_rolls_every_replica_back_together_and_replays_exactly(tmp_path):
    cfg = ReplicaConfig(groups=GROUPS, steps=44, lr=1e-2, ckpt_every=4, spikes=(Spike(34, 2),), guard=GUARD)
    tape = str(tmp_path / "run.tape")
    res = record(tape, cfg, transport="threads")
    assert {r["outcome"] for r in res.ranks.values()} == {"finished"}
    assert len({bytes(r["params"]) for r in res.ranks.values()}) == 1  # one replicated state at the end
    spikes, rollbacks = _events(tape, "spike"), _events(tape, "rollback")
    # every replica saw the spike at the same step and rolled back to the same checkpoint, with
    # the same data edit (the corrupted window: loader steps 34 and 35, skipped)
    assert {e.actor for e in spikes} == {e.actor for e in rollbacks} == {"g0.0", "g1.0", "g2.0"}
    assert {(e.step, e.payload["rule"]) for e in spikes} == {(34, "robust_z")}
    assert {(e.step, e.payload["to_step"], e.payload["ckpt_name"], e.payload["ckpt_id"]) for e in rollbacks} == {
        (34, 32, "step-00000032", rollbacks[0].payload["ckpt_id"])}
    assert {tuple(tuple(x["steps"]) for x in e.payload["edits"]) for e in rollbacks} == {((34, 35),)}
    # one writer (the quorum's first replica) kept the periodic checkpoints (retention: the last two)
    ckpts = sorted(n for n in os.listdir(tmp_path / "run.ckpt") if n.startswith("step-"))
    assert ckpts == ["step-00000040", "step-00000044"]
    # the corrupted window was trained once, in the attempt the guard threw away; its second
    # batch was skipped with it (skip_after=1) and never served
    hit = [(e.actor, e.payload["target"]) for e in _events(tape, "fault_injected")]
    assert sorted(hit) == [("g0.0", "e0.s34"), ("g1.0", "e0.s34"), ("g2.0", "e0.s34")]
    assert replay.check_tape(tape) == []
    rr = replay.replay(tape, mode="force")
    assert rr.identical, rr.format()


def test_sdc_policy_rollback_returns_to_the_newest_verified_checkpoint(tmp_path):
    cfg = ReplicaConfig(groups=GROUPS, steps=13, ckpt_every=4, sdc_policy="rollback", guard=GUARD,
                        sdc_faults=(SdcFault("g1.0", 9, "reduced", bucket=2, index=5, bit=30),))
    tape = str(tmp_path / "run.tape")
    run = tmp_path / "run.ckpt"

    def damage_step_8(actor: str, step: int) -> None:
        # the writer's checkpoint of step 8 is on disk once g0.0 commits step 8 (index 8 = 9th
        # step); flip a byte in one of its tensor files: the rollback must skip it
        if actor == "g0.0" and step == 8:
            d = run / "step-00000008"
            f = max((p for p in d.rglob("*") if p.is_file() and p.suffix == ".safetensors"),
                    key=lambda p: p.stat().st_size)
            b = bytearray(f.read_bytes())
            b[-9] ^= 0x40
            f.write_bytes(bytes(b))

    res = record(tape, cfg, transport="threads", on_commit=damage_step_8)
    assert {r["outcome"] for r in res.ranks.values()} == {"finished"}
    assert len({bytes(r["params"]) for r in res.ranks.values()}) == 1
    found = [e for e in _events(tape, "sdc_verdict") if not e.payload["ok"]]
    assert {(e.step, tuple(e.payload["odd"])) for e in found} == {(9, ("g1",))}
    rollbacks = _events(tape, "rollback")
    assert {e.actor for e in rollbacks} == {"g0.0", "g1.0", "g2.0"}
    # the newest checkpoint before step 9 (step 8) fails verification: back to step 4, and the
    # data is not at fault, so nothing is skipped
    assert {(e.step, e.payload["to_step"], tuple(e.payload["fallbacks"]), len(e.payload["edits"])) for e in rollbacks
            if e.actor == "g0.0"} == {(9, 4, ("step-00000008",), 0)}
    assert {(e.payload["rule"]) for e in _events(tape, "spike")} == {"sdc"}
    assert replay.check_tape(tape) == []
    rr = replay.replay(tape, mode="force")
    assert rr.identical, rr.format()
