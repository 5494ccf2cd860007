"""The run with real processes over torch.distributed gloo: learners are SIGKILLed,
replacement processes recover from a healthy peer, and the tape replays bit-identically
(as threads) under ``ckpt replay --mode force``."""

from __future__ import annotations

import signal

import pytest
import torch

import ckpt
from replay.check import check_tape
from runs.diloco.restore import restore_run
from runs.diloco.snapshots import list_snapshots
from runs.diloco import record
from replay.replayer import replay
from replay.tape import TapeReader

from tests.runs.diloco._kit import tiny

pytestmark = [pytest.mark.slow]


@pytest.mark.timeout(240)
def test_gloo_processes_sigkill_recover_and_replay(tmp_path) -> None:
    cfg = tiny(learners=3, quorum=2, steps=24, transport="gloo", io_timeout_s=60.0, snapshot_every=1)
    res = record(tmp_path / "tape", cfg)
    codes = res.extra["exitcodes"]
    killed = sorted(n for n, c in codes.items() if c == -signal.SIGKILL)
    assert killed == sorted(a for f in res.schedule.faults if f.kind in ("kill", "loss") for a in f.targets)
    assert all(c == 0 for n, c in codes.items() if n not in killed)  # replacements and survivors finished
    assert res.syncer.steps == cfg.syncer_steps
    assert sorted(a for _, a in res.syncer.activations) == killed
    events = list(TapeReader(res.tape).events())
    rec = [e for e in events if e.kind.name == "fault_recovered"]
    assert sorted(e.actor for e in rec) == killed
    assert all(e.payload["observed"] >= e.payload["target_clock"] for e in rec)
    assert check_tape(res.tape) == []
    r = replay(res.tape, mode="force")
    assert r.identical, r.format()
    again = r.value
    assert [n for n, _ in again.syncer.state] == [n for n, _ in res.syncer.state]
    for (n, x), (_, y) in zip(again.syncer.state, res.syncer.state):
        assert torch.equal(x, y), n
    assert again.syncer.val == res.syncer.val
    # snapshots: learner processes wrote their own parts; the newest one that continues
    # exactly under this tape (kept by the retention policy) does so bit-identically, as threads
    snaps = list_snapshots(tmp_path / "checkpoints")
    assert snaps and all(o["committed"] for o in res.extra["snapshots"])
    for k in snaps:
        ckpt.open(k["path"]).verify()
    exact = [k for k in snaps if k["meta"]["exact"]]  # kept by the retention policy
    assert exact
    rr = restore_run(res.tape, exact[-1]["path"])
    assert rr.identical, rr.divergence
    for (n, x), (_, y) in zip(rr.run.syncer.state, res.syncer.state):
        assert torch.equal(x, y), n
    mine, theirs = again.final_learner_states(), rr.run.final_learner_states()
    assert sorted(mine) == sorted(theirs)
    for a in mine:
        for (n, x), (_, y) in zip(theirs[a], mine[a]):
            assert torch.equal(x, y), (a, n)

    # a syncer fault: the run continues from the newest snapshot (whoever it left out) on a
    # new tape, its learners relaunched as real processes on a new gloo group
    from runs.diloco.restore import continue_run

    snap = snaps[-1]
    new = tmp_path / "continued" / "tape"
    res2 = continue_run(res.tape, snap["path"], new, transport="gloo")
    assert len(res2.syncer.plans) == cfg.syncer_steps - snap["step"]
    codes2 = res2.extra["exitcodes"]
    assert codes2 and all(c in (0, -signal.SIGKILL) for c in codes2.values()), codes2
    assert check_tape(new) == []
    rr2 = restore_run(new, snap["path"])  # a forced replay of the continuation from its snapshot
    assert rr2.identical, rr2.divergence
    for (n, x), (_, y) in zip(rr2.run.syncer.state, res2.syncer.state):
        assert torch.equal(x, y), n
    assert rr2.run.syncer.val == res2.syncer.val
