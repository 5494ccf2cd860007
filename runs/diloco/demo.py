"""``ckpt demo``: the reference run end to end, and its report.

1. the chaos run (learners as processes over gloo, or threads), recorded at ``DIR/tape``;
2. the same seed without faults;
3. the synchronous elastic baseline under the same schedule, checkpointing into
   ``DIR/checkpoints/baseline`` (kept by the retention policy);
4. ``replay --mode force`` of the chaos tape, and ``tape check``;
5. the newest kept snapshot that continues exactly under the tape (the chaos run snapshots
   every few syncer steps into ``DIR/checkpoints``) restored and continued under it;
6. a syncer fault drill: the learners relaunched, the run continued live from the newest
   snapshot (whoever it left out) on a new tape, and that tape checked and replayed;
7. the report and ``DIR/loss.png``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from runs.common.report import ProgressBar, verify_checkpoints
from runs.diloco.config import DiLoCoConfig

__all__ = ["demo_config", "run_demo"]


def demo_config(*, quick: bool = False, transport: str = "gloo") -> DiLoCoConfig:
    if quick:
        # the tests' size: a few seconds on two cores
        return DiLoCoConfig(learners=4, quorum=2, fragments=2, inner_h=4, steps=48, layers=1, dim=32, seq_len=16,
                            seqs_per_learner=128, shards_per_learner=8, val_seqs=32, batch=8, grace_cap_s=0.05,
                            jitter_s=0.03, io_timeout_s=60.0, transport=transport, snapshot_every=2, rejoin_after=0)
    # rejoin_after 0: replacements are hot spares, activated in the plan that detects the death
    return DiLoCoConfig(grace_cap_s=0.05, jitter_s=0.03, transport=transport, snapshot_every=4, rejoin_after=0)


def run_demo(out_dir: str | os.PathLike[str], *, quick: bool = False, transport: str = "gloo",
             echo: Callable[[str], None] = print, progress: bool = False) -> Any:
    """Run everything; returns the :class:`~runs.diloco.report.Report` (``ok()`` says all held)."""
    from replay import check_tape
    from runs.diloco.baseline import run_baseline
    from runs.diloco.chaos import describe
    from runs.diloco.report import build_report, plot
    from runs.diloco.run import record
    from replay import replay
    from replay import TapeReader

    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    tape = out / "tape"
    if tape.exists():
        raise FileExistsError(f"{tape} exists: pass an empty --out directory")
    cfg = demo_config(quick=quick, transport=transport)
    bar = ProgressBar(echo, progress)
    wall: dict[str, float] = {}

    echo(f"chaos run: {cfg.learners} learners ({cfg.transport}), syncer, seeded faults")
    t0 = time.monotonic()
    chaos = record(tape, cfg, on_step=lambda s, plan: bar("chaos run", s + 1, cfg.syncer_steps))
    wall["chaos"] = time.monotonic() - t0
    for line in describe(chaos.schedule):
        echo("  " + line)

    echo(f"no-fault run (same seed, {cfg.transport})")
    t0 = time.monotonic()
    # the same transport as the chaos run: how far learners run ahead of the merges (and
    # so the loss) depends on it, and the loss check compares the two runs
    calm_cfg = cfg.with_(chaos=False, snapshot_every=0)
    nofault = record(out / "runs" / "nofault.tape", calm_cfg,
                     on_step=lambda s, plan: bar("no-fault run", s + 1, cfg.syncer_steps))
    wall["nofault"] = time.monotonic() - t0

    echo("synchronous elastic data-parallel baseline (same schedule, restarts from its last checkpoint)")
    t0 = time.monotonic()
    base = run_baseline(cfg, chaos.schedule, out / "checkpoints" / "baseline",
                        progress=lambda k, n: bar("baseline", k, n))
    wall["baseline"] = time.monotonic() - t0

    echo("replay --mode force of the chaos tape")
    t0 = time.monotonic()
    rr = replay(tape, mode="force")
    again = rr.value
    same_syncer = again is not None and _same(again.syncer.state, chaos.syncer.state) and \
        again.syncer.val == chaos.syncer.val
    wall["replay"] = time.monotonic() - t0
    violations = check_tape(tape)

    echo("restore the newest snapshot that continues exactly under the tape, in force mode")
    t0 = time.monotonic()
    # learner processes (gloo) return no states: their reference is the forced replay,
    # which matched every learner's final-state digest on the tape
    restore_line, restore_ok = _restore_check(tape, out / "checkpoints",
                                              chaos if chaos.learners or again is None else again)
    wall["restore"] = time.monotonic() - t0

    echo("syncer fault: relaunch, continue live from the newest snapshot on a new tape, then replay that tape")
    t0 = time.monotonic()
    fault_line, fault_ok = _syncer_fault_check(tape, out, cfg)
    wall["syncer_fault"] = time.monotonic() - t0

    events = list(TapeReader(tape).events())
    rep = build_report(cfg, chaos, nofault, base, events)
    rep.replay_identical = bool(rr.identical and same_syncer)
    rep.replay_events = rr.events_compared
    rep.replay_detail = (f"; every learner's final-state digest and loss on the tape matched, syncer state and "
                         f"validation losses equal: {'yes' if same_syncer else 'NO'}")
    rep.tape_check_violations = len(violations)
    rep.tape_check_first = [v.format() for v in violations[:3]]
    rep.snapshot_restore = restore_line
    rep.snapshot_restore_identical = restore_ok
    rep.syncer_fault, rep.syncer_fault_ok = fault_line, fault_ok
    from runs.diloco.snapshots import list_snapshots

    snaps = [k["path"] for k in list_snapshots(out / "checkpoints")]
    rep.snapshots_kept = len(snaps)
    rep.checkpoints_verified = verify_checkpoints([*snaps, *base.checkpoints])
    rep.plot_path = plot(str(out / "loss.png"), cfg, chaos, nofault, base, events)
    rep.wall_s = wall
    echo("")
    echo(rep.format())
    echo("")
    echo(f"output directory: {out}")
    last = base.checkpoints[-1] if base.checkpoints else str(out / "checkpoints")
    last_snap = snaps[-1] if snaps else last
    echo("next:")
    for cmd in (f"ckpt tape show {tape}", f"ckpt replay {tape} --mode force --trust", f"ckpt ls {out / 'checkpoints'}",
                f"ckpt inspect {last_snap}"):
        echo(f"  {cmd}")
    return rep


def _restore_check(tape: Path, root: Path, chaos: Any) -> tuple[str, bool]:
    """Restore the newest kept snapshot that continues exactly under this tape (it left no
    learner out alive; the retention policy keeps one) and continue it in force mode:
    identical when every post-cut event matched the tape and the final parameters
    (syncer, momentum, every learner) and the post-cut losses are equal."""
    from runs.diloco.restore import restore_run
    from runs.diloco.snapshots import list_snapshots

    ok = [k for k in list_snapshots(root) if k["meta"].get("exact")]
    if not ok:
        return "NO (no kept snapshot continues exactly under this tape)", False
    snap = ok[-1]
    rr = restore_run(tape, snap["path"])
    run = rr.run
    same = bool(rr.identical and run is not None and _same(run.syncer.state, chaos.syncer.state)
                and run.syncer.val == [v for v in chaos.syncer.val if v[0] >= rr.syncer_step])
    if same:
        mine, theirs = chaos.final_learner_states(), run.final_learner_states()
        same = sorted(mine) == sorted(theirs) and all(_same(theirs[a], mine[a]) for a in mine)
        by = {(o.actor, o.incarnation): o.losses for o in chaos.learners}
        same = same and all(o.losses == by[(o.actor, o.incarnation)][len(by[(o.actor, o.incarnation)]) - len(o.losses):]
                            for o in run.learners)
    word = "yes" if same else "NO"
    left = f", it left out {', '.join(snap['meta']['excluded'])} (dead)" if snap["meta"]["excluded"] else ""
    return (f"identical {word} (from {snap['name']}: syncer step {rr.syncer_step} of {chaos.cfg.syncer_steps}{left}; "
            f"{rr.events_compared} events after the cuts matched the tape; final parameters, momentum and "
            f"post-cut losses equal)"), same


def _syncer_fault_check(tape: Path, out: Path, cfg: Any) -> tuple[str, bool | None]:
    """The one fault that costs a pause, as a drill: take the syncer as dead right after
    the newest kept snapshot (whoever it left out: every snapshot is restorable), relaunch
    the learners as real processes (``cfg.transport``) and continue the run live from it
    (``continue_run``) on ``out/continued/tape``; then check the new tape and replay it in
    force mode (from step 0, or from the snapshot when it left a learner out alive, which
    rejoined afresh); ok when it checks clean and the replay reproduces the continued
    run's syncer state and validation losses bit for bit. The pause runs from the call to
    the first merge: process start-up, process group, restore and the first quorum."""
    from replay import check_tape
    from runs.diloco.restore import continue_run, restore_run
    from runs.diloco.snapshots import list_snapshots
    from replay import replay

    kept = list_snapshots(out / "checkpoints")
    if not kept:
        return "NO (no snapshot was kept)", False
    snap = kept[-1]
    new = out / "continued" / "tape"
    t0 = time.monotonic()
    first: list[float] = []
    res = continue_run(tape, snap["path"], new, on_step=lambda s, plan: first or first.append(time.monotonic()))
    pause = (first[0] if first else time.monotonic()) - t0
    violations = check_tape(new)
    exact = bool(snap["meta"].get("exact"))
    if exact:
        rr = replay(new, mode="force")
        again, events, how = rr.value, rr.events_compared, "from step 0"
        same = bool(rr.identical and again is not None and _same(again.syncer.state, res.syncer.state)
                    and [v for v in again.syncer.val if v[0] >= snap["step"]] == res.syncer.val)
    else:
        rs = restore_run(new, snap["path"])
        again, events, how = rs.run, rs.events_compared, f"from {snap['name']}"
        same = bool(rs.identical and again is not None and _same(again.syncer.state, res.syncer.state)
                    and again.syncer.val == res.syncer.val)
    steps = len(res.syncer.plans)
    procs = res.extra.get("exitcodes")
    how_run = f"{len(procs)} learner processes relaunched" if procs else "learners as threads"
    left = f", it left out {', '.join(snap['meta']['excluded'])}" if snap["meta"]["excluded"] else ""
    return (f"continued live from {snap['name']}{left} (taken as if the syncer died right after it; {how_run}) on "
            f"{new}: {steps} syncer steps to the end, pause {pause:.2f} s to the first merge (process start-up "
            f"included); tape check {len(violations)} violations; force replay {how} bit-identical "
            f"{'yes' if same else 'NO'} ({events} events)"), same and not violations and \
        steps == cfg.syncer_steps - snap["step"]


def _same(a: list[tuple[str, Any]], b: list[tuple[str, Any]]) -> bool:
    import torch

    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and torch.equal(x, y) for (_, x), (_, y) in zip(a, b))


def main(out_dir: str, *, quick: bool, echo: Callable[[str], None], progress: bool,
         options: Mapping[str, Any]) -> list[tuple[str, bool]]:
    """``ckpt demo diloco`` (the registry's entry point, :data:`runs.DEMOS`)."""
    rep = run_demo(out_dir, quick=quick, transport=str(options.get("transport", "gloo")), echo=echo, progress=progress)
    return rep.checks()
