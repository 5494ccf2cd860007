"""A recorded run (threads, the same code the processes run): its tape, its snapshot, and
a tampered copy.

- ``tape check`` finds no violation, and the tape holds the outages, bypasses and
  recoveries the schedule says;
- the mid-run snapshot (taken while a stage is offline) restores and continues under the
  tape in force mode, every event after the cuts identical, final states bit-identical;
- the error-feedback residuals cross the snapshot exactly;
- a tampered copy (a send from a stage while it is offline) is caught by ``ckpt tape check``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from ckpt_cli.main import cli
from replay import TapeReader, TapeWriter, check_tape, state_digest
from replay.clock import VectorClock
from replay.events import KIND_BY_NAME, Event
from replay.tape.merge import encode_body
from replay.tape.reader import EVENT_HEAD
from runs.stages.config import StagesConfig
from runs.stages.run import RunOutcome, record, restore_run

# Two outages (the second spans the snapshot at step 5), exchanges every 2 steps.
CFG = StagesConfig(replicas=2, steps=10, p=0.15, k=3, seed=2, outer_every=2, eval_every=2, snapshot_at=(5,),
                   corpus_seqs=256, val_seqs=16, transport="threads")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    torch.set_num_threads(1)
    return record(CFG, tmp_path_factory.mktemp("stages") / "run")


@pytest.mark.slow
def test_the_tape_checks_clean_and_holds_the_schedule(run: RunOutcome) -> None:
    assert check_tape(run.tape) == []
    sched = run.ctl.schedule
    assert [(o.replica, o.stage, o.first, o.until, o.source) for o in sched.outages] == [(1, 1, 1, 4, 0), (0, 2, 4, 7, 1)]
    evs = list(TapeReader(run.tape).events())
    downs = sorted((e.actor, e.payload["first"], e.payload["until"]) for e in evs if e.kind.name == "stage_down")
    assert downs == [("r0s2", 4, 7), ("r1s1", 1, 4)]
    ups = sorted((e.actor, e.step, e.payload["source"]) for e in evs if e.kind.name == "stage_up")
    assert ups == [("r0s2", 7, "r1s2"), ("r1s1", 4, "r0s1")]
    bypass = sorted((e.payload["offline"], e.step, e.payload["direction"]) for e in evs if e.kind.name == "bypass")
    assert bypass == sorted((x, t, d) for x, ts in (("r1s1", range(1, 4)), ("r0s2", range(4, 7)))
                            for t in ts for d in ("fwd", "bwd"))
    # an offline stage is silent: nothing of it between its stage_down and its stage_up but the
    # snapshot's bookkeeping and the receipt of its rejoin plan and recovery order, then the
    # recovery it loads as it comes up
    for x in ("r0s2", "r1s1"):
        mine = [e.kind.name for e in evs if e.actor == x]
        i, j = mine.index("stage_down"), mine.index("stage_up")
        assert mine[j - 1] == "recovery_loaded", mine[i + 1:j]
        assert set(mine[i + 1:j - 1]) <= {"recv", "snapshot", "snapshot_channels"}, mine[i + 1:j]
    # busy stage-steps: everything but the offline ones
    assert sum(run.ctl.busy.values()) == CFG.replicas * CFG.stages * CFG.steps - 6


@pytest.mark.slow
def test_snapshot_restores_and_continues_bit_identically(run: RunOutcome) -> None:
    snap = Path(run.run_dir) / "snapshots" / "step-00005"
    rr = restore_run(run.tape, snap)
    assert rr.identical, rr.format()
    assert rr.events_compared > 400
    again = rr.value
    assert again.ctl.val == run.ctl.val and again.ctl.loss == run.ctl.loss
    assert again.states is not None and run.states is not None
    for w, named in run.states.items():
        mine = again.states[w]
        assert [n for n, _ in mine] == [n for n, _ in named]
        for (n, a), (_, b) in zip(named, mine):
            assert a.dtype == b.dtype and torch.equal(a, b), (w, n)


@pytest.mark.slow
def test_error_feedback_residuals_cross_the_snapshot_exactly(run: RunOutcome) -> None:
    import ckpt

    snap = Path(run.run_dir) / "snapshots" / "step-00005"
    r = ckpt.open(snap)
    evs = list(TapeReader(run.tape).events())
    for w in CFG.workers:
        saved = r.tensor("ef/e", part=w)
        if w == "r1s1":  # offline at steps 1..3, recovered at 4: its residual restarted at zero
            assert torch.equal(saved, torch.zeros_like(saved))
            continue
        # the residual in the part is the one the last exchange before the cut (step 3) left
        (last,) = [e for e in evs if e.actor == w and e.kind.name == "ef_residual" and e.step == 3]
        assert state_digest([("e", saved)]) == last.payload["digest"], w
        assert 0 < last.payload["kept"] < last.payload["total"] and saved.abs().sum() > 0
    # the restored run's next exchanges start from it: their residual digests are the tape's
    # (test_snapshot_restores_and_continues_bit_identically compares every later event)


def _rewrite(src: str, dst: Path, insert_after: Any, new_kind: str, fields: tuple[Any, ...]) -> Event:
    """Copy a tape, inserting one event of ``insert_after``'s actor right after it. Later
    counters of that actor (in every clock that names it) move up by one, so the copy is a
    well-formed history apart from what the inserted event itself says."""
    reader = TapeReader(src)
    names: list[str] = []
    frames = list(reader.events())
    actor, at = insert_after.actor, insert_after.clock[insert_after.actor]

    def bump(c: VectorClock) -> VectorClock:
        return VectorClock.of({a: (n + 1 if a == actor and n > at else n) for a, n in c.entries})

    k = KIND_BY_NAME[new_kind]
    inserted = Event(-1, actor, VectorClock.of({**dict(insert_after.clock.entries), actor: at + 1}),
                     insert_after.step, k, k.pack(*fields))
    out: list[Event] = []
    for e in frames:
        if e.kind.name == "actor":
            names.append(e.actor)
            continue
        out.append(Event(e.seq, e.actor, bump(e.clock), e.step, e.kind, e.raw))
        if e.seq == insert_after.seq:
            out.append(inserted)
    ids = {a: i for i, a in enumerate(names)}
    w = TapeWriter(dst, dict(reader.meta))
    for a in names:
        raw = a.encode()
        w.actors.append(a)
        w.append(KIND_BY_NAME["actor"].code, EVENT_HEAD.pack(0, ids[a], 0) + len(raw).to_bytes(2, "little") + raw)
    for e in out:
        w.append(e.kind.code, encode_body(e, ids))
    w.close()
    return inserted


@pytest.mark.slow
def test_a_send_from_an_offline_stage_is_caught(run: RunOutcome, tmp_path: Path) -> None:
    evs = list(TapeReader(run.tape).events())
    (down,) = [e for e in evs if e.actor == "r0s2" and e.kind.name == "stage_down"]
    bad = tmp_path / "tampered.tape"
    _rewrite(run.tape, bad, down, "send", ("r0s2->r0s3", 999, "r0s3", b"\x05" * 16))
    r = CliRunner().invoke(cli, ["tape", "check", str(bad)])
    assert r.exit_code == 6, r.output
    assert "[stage-send-while-offline] r0s2 sent r0s2->r0s3#999 at step 4 while offline (down since step 4)" in r.output
    assert "clock-monotonic" not in r.output and "duplicate-send" not in r.output  # only the tampering is wrong
    same = tmp_path / "same.tape"  # the rewrite itself breaks nothing: a harmless note checks clean
    _rewrite(run.tape, same, down, "note", ("harmless",))
    assert CliRunner().invoke(cli, ["tape", "check", str(same)]).exit_code == 0
    # and a recovery whose digest is not its source's
    (loaded,) = [e for e in evs if e.actor == "r0s2" and e.kind.name == "recovery_loaded"]
    p = loaded.payload
    forged = tmp_path / "forged.tape"
    _rewrite(run.tape, forged, loaded, "recovery_loaded", (p["source"], p["stream"], b"\x09" * 16))
    r = CliRunner().invoke(cli, ["tape", "check", str(forged)])
    assert r.exit_code == 6 and "[recovery-state-mismatch]" in r.output, r.output
