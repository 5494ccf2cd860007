"""Goodput accounting of the reference run and of the synchronous elastic baseline."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckpt
from runs.diloco.baseline import run_baseline
from runs.diloco.chaos import NO_FAULTS, make_schedule
from runs.diloco.report import diloco_goodput

from tests.runs.diloco._kit import tiny


def test_diloco_goodput_counts_steps_up_to_the_last_merged_contribution() -> None:
    cfg = tiny(learners=2, steps=8, inner_h=4, fragments=2)  # P=2: fragment p at t = 1, 3 (mod 4)
    merged = [
        # learner-0 ran all 8 steps and every contribution was merged
        *({"s": s, "actor": "learner-0", "inc": 0, "t": t, "started": 0} for s, t in ((0, 1), (1, 3), (2, 5), (3, 7))),
        # learner-1 died after step 4: its last merged contributions carried steps 0..1 (p0) and 0..3 (p1);
        # its replacement started at its peer's step 6 and had step 7 merged for p1 only
        {"s": 0, "actor": "learner-1", "inc": 0, "t": 1, "started": 0},
        {"s": 1, "actor": "learner-1", "inc": 0, "t": 3, "started": 0},
        {"s": 3, "actor": "learner-1", "inc": 1, "t": 7, "started": 6},
    ]
    g, useful, cap = diloco_goodput(cfg, merged)
    # per fragment: learner-0 6 (p0: steps 6, 7 come after its last sync at t=5 and never
    # reach the model) + 8 (p1); learner-1 2 (p0) + 4 (p1) + 2 (p1, the replacement's 6..7)
    assert g == (6 + 8 + 2 + 4 + 2) / (2 * 8 * 2)
    assert (useful, cap) == (11, 16)


@pytest.mark.slow
def test_baseline_without_faults_counts_every_step(tmp_path: Path) -> None:
    cfg = tiny(steps=16)
    b = run_baseline(cfg, NO_FAULTS, tmp_path / "ck")
    assert (b.slots, b.restarts, b.rolled_back_steps, b.downtime_slots) == (16, 0, 0, 0)
    assert b.useful == b.capacity == cfg.learners * 16 and b.goodput == 1.0
    assert [Path(p).name for p in b.checkpoints] == ["step-00000012", "step-00000016"]  # keep_last=2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_baseline_under_chaos_stops_everyone_and_restarts_from_a_checkpoint(tmp_path: Path) -> None:
    cfg = tiny()
    sched = make_schedule(cfg)
    b = run_baseline(cfg, sched, tmp_path / "a")
    deaths = [f for f in sched.faults if f.kind in ("kill", "loss")]
    # each death stops the job once, and the rejoin of its learners stops it again
    assert b.restarts == 2 * len(deaths)
    # rolled back: the steps since the last checkpoint (every inner_h steps) at each death
    assert b.rolled_back_steps == sum(f.step % cfg.inner_h for f in deaths)
    assert b.executed > b.useful  # rolled-back steps were computed and thrown away
    assert b.useful < b.capacity and 0 < b.goodput < 1
    assert b.capacity == cfg.learners * b.slots and b.slots > cfg.steps
    kinds = [k for _, k, _ in b.events]
    assert kinds.count("rejoin") == len(deaths) and "jitter" in kinds
    for p in b.checkpoints:
        ckpt.open(p).verify()
    # logical time only: a second run is bit-identical, losses included
    again = run_baseline(cfg, sched, tmp_path / "b")
    assert again.val == b.val and (again.useful, again.slots) == (b.useful, b.slots)


def test_goodput_accounting_puts_every_lost_learner_step_under_one_cause() -> None:
    from runs.common.chaos import Fault, Schedule
    from runs.diloco.report import goodput_accounting
    from runs.diloco.syncer import SyncerOutcome

    cfg = tiny(learners=2, steps=8, inner_h=4, fragments=2)  # round 0: p0 at t=1, p1 at t=3; the last: both at t=7
    assert cfg.fragments_due(1) == [0] and cfg.fragments_due(3) == [1] and cfg.fragments_due(5) == []
    assert cfg.fragments_due(7) == [0, 1] and cfg.last_send(0) == 7
    sched = Schedule((Fault("kill", ("learner-1",), 4, {}),), 0)
    m = lambda s, a, k, t, st: {"s": s, "actor": a, "inc": k, "t": t, "started": st, "steps": 1}  # noqa: E731
    sy = SyncerOutcome(merged=[
        m(0, "learner-0", 0, 1, 0), m(1, "learner-0", 0, 3, 0), m(2, "learner-0", 0, 7, 0), m(3, "learner-0", 0, 7, 0),
        # learner-1 died at step 4: steps 2-3 of p0 ran after its last p0 contribution (kill)
        m(0, "learner-1", 0, 1, 0), m(1, "learner-1", 0, 3, 0),
        # its replacement was activated when its peer was at step 5, and adopted step 6
        m(2, "learner-1", 1, 7, 6), m(3, "learner-1", 1, 7, 6)],
        joins=[{"endpoint": "learner-1~1", "started": 6, "asked_at": 5}])
    a = goodput_accounting(cfg, sched, sy)
    assert a.capacity == 16 and a.counted == 13
    # per fragment, halved: p0 steps 2,3 kill; steps 4 (both p) before the activation, 5 after it
    assert a.lost == {"kill": 1.0, "rejoin wait": 1.0, "recovery transfer": 1.0, "quorum wait": 0.0,
                      "stale contributions": 0.0}
    assert a.counted + sum(a.lost.values()) == a.capacity and a.goodput == 13 / 16
